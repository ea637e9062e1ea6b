"""Stage ``record``: the cell's counts, versions and notes, written as ``results.json`` +
``samples.jsonl`` (+ evidence images), and stored under the finished-cell key."""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from emma import finished, registry
from emma.attack import attack_records, attack_seed_record
from emma.cache import repair_note, repairs_since
from emma.errors import DiskFullError
from emma.evidence import write_evidence
from emma.files import atomic_write_text, sha256_file
from emma.metrics import METRIC_VERSIONS
from emma.metrics.timing import cpu_model
from emma.results import CellInfo, CellResult, redact
from emma.seeds import VERSION as SEEDS_VERSION
from emma.stages.context import CellContext

log = logging.getLogger(__name__)


def git_hash() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


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
        "libraries": {n: package_version(n) for n in ("torch", "diffusers", "transformers")},
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


def record(ctx: CellContext) -> None:
    caveats(ctx)
    out, outputs = ctx.output_dir, ctx.outputs
    cell_counts = counts(ctx)
    ctx.result = result = CellResult(
        metrics=ctx.metrics,
        cell=CellInfo(model=ctx.cfg.model.name, method=ctx.method.name, domain=ctx.domain.name,
                      concept=ctx.concept, attacker=ctx.attacker.name, classifier=ctx.suite_judge.name),
        config=OmegaConf.to_container(ctx.cfg, resolve=True),
        versions=versions(ctx), timing=ctx.timing, counts=cell_counts, notes=ctx.notes,
        provenance=ctx.provenance, protocol=protocol_record(ctx),
    )
    lines = [json.dumps(s.to_json()) for s in ctx.samples]
    lines += [json.dumps(r) for r in attack_records(outputs, ctx.attacker)]
    lines += [json.dumps(line) for line in ctx.extra_lines]
    atomic_write_text(out / "samples.jsonl", "\n".join(lines) + "\n")
    attacked = [dataclasses.replace(s, group="attack") for o in outputs for s in o.samples]
    cell_counts["evidence_images"] = write_evidence(ctx.generator, ctx.samples + attacked, out)
    result.save(out / "results.json")  # last: its presence marks a finished cell
    if finished.enabled(ctx.cfg) and ctx.attacker.complete():  # a partial attack is not a finished cell
        # key.json records the inputs with secrets and URL credentials removed (the key is ctx.key)
        try:
            finished.store(redact(OmegaConf.to_container(ctx.cfg, resolve=True)), out, ctx.key)
        except DiskFullError as err:  # results.json is complete: the cell is done, only not reusable
            log.warning("%s (the cell's results.json is complete; it is only not kept for reuse)", err)
