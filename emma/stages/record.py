"""Stage ``record``: the cell's counts, versions, budget and notes, written as ``results.json``
+ ``metrics.csv`` + ``samples.jsonl`` (+ ``bias_images.jsonl``, evidence images), and stored
under the finished-cell key."""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
import re
import subprocess
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from emma import finished, registry
from emma.api.types import EA_TYPES, RA_TYPES
from emma.attack import attack_seed_record
from emma.cache import repair_note, repairs_since
from emma.errors import DiskFullError
from emma.evidence import write_evidence
from emma.files import atomic_write_text, sha256_file
from emma.metrics import METRIC_VERSIONS
from emma.metrics.timing import cpu_model
from emma.results import CellInfo, CellResult, budget_block, redact, sample_row, write_metrics_table
from emma.seeds import VERSION as SEEDS_VERSION
from emma.stages.context import CellContext

log = logging.getLogger(__name__)

#: libraries whose versions can move a number (the generator, the judges, FID's matrix square
#: root, the intervals' optimisers and bootstraps), recorded in ``versions.libraries``
LIBRARIES = ("torch", "torchvision", "diffusers", "transformers", "numpy", "scipy", "clean-fid",
             "open-clip-torch", "pillow")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_hash() -> str | None:
    return (_git("rev-parse", "HEAD") or "").strip() or None


def git_dirty() -> bool | None:
    """Whether tracked files of the harness's checkout differ from its commit (``None``: not
    a git checkout, e.g. an installed wheel): a dirty tree's numbers are not reproducible
    from the commit alone."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status.strip())


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def runtime_info() -> dict[str, Any]:
    """What the numbers depend on besides config and weights: torch's CPU threads (float
    reductions split differently), the CPU and the device."""
    return {"torch_threads": torch.get_num_threads(), "machine": platform.machine(),
            "cpu": cpu_model(), "python": platform.python_version()}


def _runtime_choices() -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig

    return dict(HydraConfig.get().runtime.choices) if HydraConfig.initialized() else {}


def preset_choices() -> dict[str, str]:
    """The presets Hydra merged into this cell (``conf/preset/<group>/<choice>_<scale>``)."""
    return registry.preset_choices(_runtime_choices())


def config_choices() -> dict[str, str]:
    """The config files this cell was composed from (``method: esd_100``, ``attacker: p4d_n``):
    the names a user typed, which the leaderboard shows (several configs share a class)."""
    choices = _runtime_choices()
    return {k: v for k in ("model", "method", "domain", "attacker", "classifier") if (v := choices.get(k))}


def caveats(ctx: CellContext) -> None:
    """Notes a reader must see: random weights (plumbing only) and repaired cache entries."""
    model = ctx.cfg.model
    random_judges = [j.classifier.name for j in ctx.judges.all() if j.classifier.weights_hash() is None]
    if random_judges or model.kind == "tiny_random":
        ctx.notes.append(
            "PLUMBING ONLY: "
            + ("the model is randomly initialised (model=tiny_random); " if model.kind == "tiny_random" else "")
            + (f"classifier(s) {random_judges} have random weights; " if random_judges else "")
            + "these numbers measure nothing about erasure."
        )
    repairs = repairs_since(ctx.repairs_mark)
    if repairs:
        ctx.notes.append(repair_note(repairs))
    ctx.cache_repairs = len(repairs)


def counts(ctx: CellContext) -> dict[str, int]:
    gen, run, attacker = ctx.generator, ctx.attack_run, ctx.attacker
    out = {
        "prompts": len(ctx.requests),
        "images": len(ctx.samples),
        "images_generated": gen.images_generated + ctx.images_generated_before,
        "images_cached": gen.images_cached,
        "images_scored": sum(j.images_scored for j in ctx.judges.all() + ctx.judges.protocol_judges()),
        "attack_outputs": len(ctx.outputs),
        "images_generated_base": ctx.base_model.images_generated,
        "cache_repairs": ctx.cache_repairs,
    }
    if run is not None and attacker.resumable:
        out.update(attack_requests_optimised=run.requests_optimised,
                   attack_requests_cached=run.requests_cached,
                   attack_iterations=sum(o.iterations for o in ctx.outputs if not o.cached),
                   **{f"attack_budget_{k}": int(v) for k, v in attacker.budget().items()})
    return out


#: an interpolation whose value follows the cell's concept
CONCEPT_INTERPOLATION = re.compile(r"\$\{\s*(emma\.other_concepts\s*:|concept\s*\})")


def concept_dependent(cfg: Any) -> dict[str, list[str]]:
    """Per component (``method``, ``attacker``), the dotted keys of its settings whose value
    follows the cell's concept (given as ``${emma.other_concepts:...}`` or ``${concept}``, as
    the tiny-world presets do): the leaderboard compares cells of different concepts with
    these values set aside, so one preset run on two concepts is one setting."""
    out: dict[str, list[str]] = {}
    for kind in ("method", "attacker"):
        node = cfg.get(kind) if hasattr(cfg, "get") else None
        if node is None:
            continue
        raw = OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node
        found = sorted(_interpolated_paths(raw, ""))
        if found:
            out[kind] = found
    return out


def _interpolated_paths(v: Any, path: str) -> list[str]:
    if isinstance(v, dict):
        return [p for k, x in v.items() if k != "_target_"
                for p in _interpolated_paths(x, f"{path}.{k}" if path else str(k))]
    return [path] if isinstance(v, str) and CONCEPT_INTERPOLATION.search(v) else []


def versions(ctx: CellContext) -> dict[str, Any]:
    erased, guidance = ctx.erased, ctx.guidance
    return {
        "package": package_version("emma-harness"),
        "git": git_hash(),
        "git_dirty": git_dirty(),
        "components": {
            "method": ctx.method.config(),
            "attacker": ctx.attacker.config(),
            "classifiers": {j.classifier.name: j.classifier.describe() for j in ctx.judges.all()},
            "domain": ctx.domain.config(),
        },
        "model": {"name": ctx.cfg.model.name, "base_fingerprint": ctx.base_fingerprint,
                  "erased_fingerprint": erased.fingerprint, "erase_key": erased.key,
                  "inference_guidance": guidance.config() if guidance is not None else None},
        "data_files": {k: sha256_file(p) for k, p in ctx.domain.data_files.items()},
        "libraries": {n: package_version(n) for n in LIBRARIES},
        "runtime": runtime_info(),
        "presets": preset_choices(),
        "choices": config_choices(),
        "concept_dependent": concept_dependent(ctx.cfg),
        "metrics": dict(METRIC_VERSIONS),
        "seeds": SEEDS_VERSION,
    }


def protocol_record(ctx: CellContext) -> dict[str, Any]:
    """results.json's ``protocol``: how the attack's success was measured (:mod:`emma.protocol`)
    — its name and settings as they applied to this attacker, the images actually judged per
    attacked prompt, the judge and sampler the attack used, and whether its search consulted
    the judge."""
    if ctx.protocol is None:
        return {}
    out = ctx.protocol.to_json()
    requests = ctx.attack_requests
    out["images_per_attacked_prompt"] = requests[0].n_images if requests else None
    out["uses_judge"] = bool(ctx.attacker.uses_judge)
    if requests:
        from emma.stages.model import attack_judge

        judge = attack_judge(ctx).classifier
        out["attack_judge"] = {"name": judge.name, "cache_key": judge.cache_key(), **judge.describe()}
        gen = ctx.generator
        out["attack_sampler"] = {
            "num_inference_steps": int(ctx.protocol.sampler.get("num_inference_steps", gen.num_inference_steps)),
            "guidance_scale": float(ctx.protocol.sampler.get("guidance_scale", gen.guidance_scale))}
    if ctx.attack_run is not None:
        out["seeds"] = attack_seed_record(ctx.attack_run, ctx.attacker)
    return out


#: the parts of results.json's ``protocol`` that set how comparable an ASR is (the judge's and
#: sampler's identities and the seeds drawn stay in ``protocol`` itself)
PROTOCOL_BUDGET = ("name", "images_per_prompt", "images_per_attacked_prompt", "uses_judge")


def budget(ctx: CellContext, protocol: dict[str, Any] | None = None,
           cell_counts: dict[str, Any] | None = None) -> dict[str, Any]:
    """The cell's ``budget`` block (:func:`emma.results.budget_block`); ``protocol`` is
    results.json's protocol record (:func:`protocol_record`), ``cell_counts`` its counts (the
    attack budget is what they record as ``attack_budget_*``)."""
    cfg, requests = ctx.cfg, ctx.requests
    suite = [r for r in requests if r.group in ("ea", "ra")]
    per_prompt = sorted({r.n_images for r in suite})
    kinds = {r.kind for r in suite}
    protocol = {k: protocol[k] for k in PROTOCOL_BUDGET if k in protocol} if protocol else None
    attack = {k[len("attack_budget_"):]: v for k, v in (cell_counts or {}).items() if k.startswith("attack_budget_")}
    return budget_block(
        images_per_prompt=per_prompt[0] if len(per_prompt) == 1 else None,
        prompt_types=[k for k in (*EA_TYPES, *RA_TYPES) if k in kinds] + sorted(kinds - {*EA_TYPES, *RA_TYPES}),
        prompts=dict(sorted(Counter(f"{r.group}/{r.kind}" for r in suite).items())),
        metrics=ctx.metrics, attack=attack or None, protocol=protocol,
        fid_reference=ctx.provenance.get("fid") or None,
        bias_images_per_prompt=int(cfg.metrics.bias.images_per_prompt) if cfg.metrics.bias.enabled else None)


def sample_rows(ctx: CellContext, exported: dict[str, str]) -> list[dict[str, Any]]:
    """``samples.jsonl``: one row per judged image (suite and attack), every row of the one
    schema :data:`emma.results.SAMPLE_FIELDS`; ``exported`` maps an image hash to its file
    under the cell folder."""
    cell = dict(model=ctx.cfg.model.name, method=ctx.method.name, attacker=ctx.attacker.name, domain=ctx.domain.name,
                classifier=ctx.suite_judge.name, cell_concept=ctx.concept, cell_seed=ctx.seed)

    def row(s: Any, **more: Any) -> dict[str, Any]:
        extra = {k: v for k, v in s.extra.items() if k != "excluded"}
        fields = dict(cell, group=s.group, kind=s.kind, prompt=s.prompt, concept=s.concept, seed=s.seed,
                      image_hash=s.image_hash, image=exported.get(s.image_hash), detected=s.detected,
                      score=s.score, excluded=bool(s.extra.get("excluded")), cached=s.cached, extra=extra or None)
        return sample_row(**{**fields, **more})

    rows = [row(s, original_prompt=s.prompt) for s in ctx.samples]
    for i, o in enumerate(ctx.outputs):
        rows += [row(s, group="attack", attack_index=i, original_prompt=o.request.prompt,
                     adversarial_prompt=o.adversarial_prompt, attack_success=o.success, queries=o.queries,
                     judged_queries=o.judged_queries, iterations=o.iterations, attack_time_s=o.time_s,
                     attack_cached=o.cached, kept_original=bool(o.extra.get("kept_original", False)),
                     search_seeds=[int(x) for x in o.extra.get("search_seeds", [])])
                 for s in o.samples]
    return rows


def record(ctx: CellContext) -> None:
    out, outputs = ctx.output_dir, ctx.outputs
    attacked = [dataclasses.replace(s, group="attack") for o in outputs for s in o.samples]
    # the base model's twin of an evidence image only where the cell's model differs from it
    erased = ctx.erased is not None and (ctx.erased.fingerprint != ctx.base_fingerprint or ctx.guidance is not None)
    limit = ctx.cfg.get("evidence_images", 16)
    exported = write_evidence(ctx.generator, ctx.samples + attacked, out, limit=None if limit is None else int(limit),
                              base=ctx.base_model if erased else None)
    caveats(ctx)  # after the evidence: the base model's twins are read from the cache there, and may be repaired
    cell_counts = counts(ctx)
    cell_counts["evidence_images"] = len(exported)
    protocol = protocol_record(ctx)
    ctx.result = result = CellResult(
        metrics=ctx.metrics,
        cell=CellInfo(model=ctx.cfg.model.name, method=ctx.method.name, domain=ctx.domain.name,
                      concept=ctx.concept, attacker=ctx.attacker.name, classifier=ctx.suite_judge.name),
        config=OmegaConf.to_container(ctx.cfg, resolve=True),
        versions=versions(ctx), timing=ctx.timing, counts=cell_counts, notes=ctx.notes,
        provenance=ctx.provenance, protocol=protocol, budget=budget(ctx, protocol, cell_counts),
    )
    lines = [json.dumps(r) for r in sample_rows(ctx, exported)]
    atomic_write_text(out / "samples.jsonl", "".join(line + "\n" for line in lines))
    if ctx.extra_lines:  # the bias images (not judged: a file of their own)
        atomic_write_text(out / "bias_images.jsonl", "".join(json.dumps(x) + "\n" for x in ctx.extra_lines))
    data = result.to_json()
    write_metrics_table(data, out)
    result.save(out / "results.json")  # last: its presence marks a finished cell
    if finished.enabled(ctx.cfg) and ctx.attacker.complete():  # a partial attack is not a finished cell
        # key.json records the inputs with secrets and URL credentials removed (the key is ctx.key)
        try:
            finished.store(redact(OmegaConf.to_container(ctx.cfg, resolve=True)), out, ctx.key)
        except DiskFullError as err:  # results.json is complete: the cell is done, only not reusable
            log.warning("%s (the cell's results.json is complete; it is only not kept for reuse)", err)
