"""One cell: (model, method, domain, concept, attacker, seeds) -> results.json + samples.jsonl.

Stages: load base model -> erase (cached by hash) -> generate the domain's EA/RA suite
(cached per image) -> judge (cached per image hash + classifier) -> attack -> metrics ->
write. Every stage is idempotent; a killed cell re-run picks up every finished image.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from emma import finished, quality
from emma.api.attacker import Attacker
from emma.api.classifier import Classifier
from emma.api.domain import Domain
from emma.api.method import ErasureMethod
from emma.api.types import PromptRequest, Sample
from emma.attack import (
    AttackCache,
    CellAttackTarget,
    LazyBaseModel,
    attack_metrics,
    attack_records,
    domain_prompt_texts,
    run_attack,
)
from emma.cache import (
    ClassifierScoreCache,
    ImageCache,
    atomic_write_text,
    repair_mark,
    repair_note,
    repairs_since,
    sha256_file,
)
from emma.config import classifier_config
from emma.erase import erase_cached
from emma.errors import ConfigError
from emma.evaluate import judge_requests
from emma.evidence import write_evidence
from emma.generate import CachedGenerator, GenerationTarget, Judge
from emma.metrics import METRIC_VERSIONS, cell_metrics
from emma.metrics.timing import cpu_model
from emma.pipelines import fingerprint, load_pipeline
from emma.results import CellInfo, CellResult
from emma.validate import check_cell
from emma.weights import ENV_CACHE

log = logging.getLogger(__name__)
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class Judges:
    """The cell's judges, one per classifier config name, built on first use."""

    def __init__(self, cfg: DictConfig, domain: Domain, cache_root: Path) -> None:
        self.cfg, self.domain, self.cache_root = cfg, domain, cache_root
        self.auto = cfg.classifier.get("_target_") is None
        self._judges: dict[str, Judge] = {}

    def name_for(self, request: PromptRequest) -> str:
        return self.domain.classifier_for(request) if self.auto else "__chosen__"

    def get(self, name: str) -> Judge:
        if name not in self._judges:
            ccfg = classifier_config(self.cfg, name, self.domain)
            classifier: Classifier = hydra.utils.instantiate(ccfg, _convert_="all")
            # keyed at use: can_detect may still add labels to an open-vocabulary judge
            self._judges[name] = Judge(classifier, ClassifierScoreCache(self.cache_root, classifier))
        return self._judges[name]

    def for_request(self, request: PromptRequest) -> Judge:
        return self.get(self.name_for(request))

    def all(self) -> list[Judge]:
        return list(self._judges.values())


def git_hash() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def runtime_info() -> dict[str, Any]:
    """What the numbers depend on besides config and weights: torch's CPU threads (float
    reductions split differently), the CPU and the device."""
    return {"torch_threads": torch.get_num_threads(), "machine": platform.machine(),
            "cpu": cpu_model(), "python": platform.python_version()}


def preset_choices() -> dict[str, str]:
    """The presets Hydra merged into this cell (``conf/preset/<group>/<choice>_<scale>``)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    choices = HydraConfig.get().runtime.choices
    out = {k.split("/", 1)[1]: v for k, v in choices.items()
           if k.startswith("preset/") and v and (CONF_DIR / k / f"{v}.yaml").exists()}
    scale = choices.get("scale@_global_")
    return {**out, "scale": scale} if scale else out


def config_choices() -> dict[str, str]:
    """The config files this cell was composed from (``method: esd_100``, ``attacker: p4d_n``):
    the names a user typed, which the leaderboard shows (several configs share a class)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}
    choices = HydraConfig.get().runtime.choices
    return {k: v for k in ("model", "method", "domain", "attacker", "classifier") if (v := choices.get(k))}


def run_cell(cfg: DictConfig, output_dir: str | Path) -> CellResult:
    """Run one cell and write ``results.json`` and ``samples.jsonl`` into ``output_dir``."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    key = finished.cell_key(cfg)  # inputs as they are now, before anything runs
    hit = finished.lookup(cfg, output_dir)
    if hit is not None:  # a finished cell with these inputs: its stored result, no pipeline
        return CellResult.load(hit)
    timing: dict[str, float] = {}
    notes: list[str] = []
    cache_root = Path(cfg.paths.cache_dir).expanduser()
    if cfg.get("threads") is not None:
        torch.set_num_threads(int(cfg.threads))
    os.environ[ENV_CACHE] = str(cache_root)  # one root: weights, FID statistics, downloads follow it
    check_cell(cfg)  # every setting, before any work
    repairs_mark = repair_mark()

    t = time.perf_counter()
    domain: Domain = hydra.utils.instantiate(cfg.domain, _convert_="all")
    concept = domain.concept(domain.default_concept if cfg.concept is None else cfg.concept).name
    judges = Judges(cfg, domain, cache_root)
    method: ErasureMethod = hydra.utils.instantiate(cfg.method, _convert_="all")
    attacker: Attacker = hydra.utils.instantiate(cfg.attacker, _convert_="all")
    requests = domain.requests(concept, seed=int(cfg.seed),
                               images_per_prompt=cfg.images_per_prompt,
                               types=None if cfg.prompt_types is None else list(cfg.prompt_types))
    for req in requests:
        classifier = judges.for_request(req).classifier
        if not classifier.can_detect(req.concept):
            labels = list(classifier.labels)
            raise ConfigError(
                f"classifier '{classifier.name}' cannot judge {req.concept!r} ({req.kind} prompt "
                f"{req.prompt!r}); its labels: {', '.join(labels[:20])}{', ...' if len(labels) > 20 else ''}. "
                "Choose another classifier=..."
            )
    timing["setup_s"] = time.perf_counter() - t

    t = time.perf_counter()
    pipe = load_pipeline(cfg.model)
    base_fp = fingerprint(pipe)
    timing["load_s"] = time.perf_counter() - t

    def make_generator(p: Any, fp: str, guidance: Any = None) -> CachedGenerator:
        return CachedGenerator(
            p, fp, ImageCache(cache_root),
            num_inference_steps=cfg.model.num_inference_steps, guidance_scale=cfg.model.guidance_scale,
            height=cfg.model.height, width=cfg.model.width, batch_size=cfg.model.batch_size,
            negative_prompt=cfg.model.get("negative_prompt"), guidance=guidance,
        )

    # An attacker refuses a model or request it cannot handle here, before any image is drawn.
    attack_requests = [r for r in requests if r.group == "ea"]
    base_model = LazyBaseModel(lambda: load_pipeline(cfg.model), base_fp, make_generator, cfg.model.name)
    domain_prompts = functools.lru_cache(maxsize=1)(lambda: domain_prompt_texts(domain, int(cfg.seed)))
    if attack_requests:
        attacker.check(CellAttackTarget(make_generator(pipe, base_fp), judges.for_request(attack_requests[0]),
                                        base=base_model, model_name=cfg.model.name,
                                        domain_prompts=domain_prompts), attack_requests)

    images_generated = 0
    extra_lines: list[dict[str, Any]] = []  # samples.jsonl lines of the bias images
    bias_cfg = cfg.metrics.bias
    if bias_cfg.enabled:
        t = time.perf_counter()
        sets = quality.bias_sets(domain, bias_cfg.attributes, seed=int(cfg.seed))
        base_gen = make_generator(pipe, base_fp)
        base_bias = {b.attribute: quality.render_groups(base_gen, b, int(bias_cfg.images_per_prompt), "bias: base")
                     for b in sets}
        images_generated += base_gen.images_generated
        timing["bias_base_s"] = time.perf_counter() - t

    t = time.perf_counter()
    erased = erase_cached(pipe, method, [concept], cache_root, base_fingerprint=base_fp,
                          domain=domain.name, seed=int(cfg.seed))
    timing["erase_s"] = time.perf_counter() - t

    # Inference-time methods (SLD) steer sampling instead of editing weights.
    guidance = method.inference_guidance(erased.pipe, [concept], domain=domain.name)
    if guidance is not None:
        notes.append(f"inference-time guidance '{guidance.name}': the method edits no weights and "
                     "changes how images are sampled (time/unlearning_s is 0)")
    generator = make_generator(erased.pipe, erased.fingerprint, guidance)
    t = time.perf_counter()
    suite: list[tuple[PromptRequest, list[Sample]]] = []
    for name in dict.fromkeys(judges.name_for(r) for r in requests):
        group = [r for r in requests if judges.name_for(r) == name]
        target = GenerationTarget(generator, judges.get(name))
        per_request = judge_requests(target, group, progress=f"suite: {domain.name}/{concept}")
        suite += list(zip(group, per_request))
    samples: list[Sample] = [s for _, reqs in suite for s in reqs]
    suite_records = dict(generator.records)  # timing of the suite images (stored with them)
    timing["suite_s"] = time.perf_counter() - t

    t = time.perf_counter()
    outputs = []
    attack_run = None
    if attack_requests:  # prompt_types may leave only RA prompts: then there is nothing to attack
        target = CellAttackTarget(generator, judges.for_request(attack_requests[0]), base=base_model,
                                  model_name=cfg.model.name, domain_prompts=domain_prompts)
        if hasattr(attacker, "bind_cell"):  # attackers that write their own files (STACE's trace, report)
            attacker.bind_cell(output_dir=output_dir, cache_dir=cache_root,
                               info={"model": cfg.model.name, "method": method.name, "domain": domain.name})
        attack_run = run_attack(attacker, target, attack_requests, AttackCache(cache_root))
        outputs = attack_run.outputs
    timing["attack_s"] = time.perf_counter() - t

    metrics = cell_metrics.rate_metrics(suite, outputs, seed=int(cfg.seed))
    if attack_run is not None and attacker.resumable:
        metrics.update(attack_metrics(attack_run))
    provenance: dict[str, Any] = {}
    if outputs and hasattr(attacker, "extra_metrics"):  # e.g. STACE: asr = SIR_H, stace/...
        metrics.update(attacker.extra_metrics())
        notes += attacker.notes() if hasattr(attacker, "notes") else []
    suite_judge = judges.for_request(requests[0]).classifier
    if cfg.metrics.fid.enabled:
        t = time.perf_counter()
        texts = [r.prompt for r in requests for _ in r.seeds()]
        seeds = [s for r in requests for s in r.seeds()]
        fid, provenance["fid"] = quality.fid_metric(
            domain, generator.generate(texts, seeds).images,
            clusters=[i for i, r in enumerate(requests) for _ in r.seeds()],
            concepts=[r.concept for r in requests for _ in r.seeds()],
            judge=suite_judge, cfg=cfg.metrics.fid, notes=notes, cache_root=cache_root, seed=int(cfg.seed))
        if fid is not None:
            metrics["fid"] = fid
        timing["fid_s"] = time.perf_counter() - t
    if bias_cfg.enabled:
        t = time.perf_counter()
        erased_bias = {b.attribute: quality.render_groups(generator, b, int(bias_cfg.images_per_prompt),
                                                          "bias: erased") for b in sets}
        metrics.update(quality.bias_metrics(base_bias, erased_bias, sets,
                                            quality.similarities(domain, suite_judge, notes),
                                            int(bias_cfg.n_resamples), int(cfg.seed),
                                            pairing=str(bias_cfg.get("pairing", "paired")),
                                            images_per_prompt=int(bias_cfg.images_per_prompt)))
        for label, imgs in (("base", base_bias), ("erased", erased_bias)):
            extra_lines += quality.bias_sample_lines(imgs, sets, int(bias_cfg.images_per_prompt), label)
        timing["bias_s"] = time.perf_counter() - t
    metrics["time/unlearning_s"], provenance["time/unlearning_s"] = cell_metrics.unlearning_time(
        erased.unlearning_s, erased.manifest, erased.cached)
    inference, provenance["time/inference_s_per_image"] = cell_metrics.inference_time(suite_records, int(cfg.seed))
    if inference is not None:
        metrics["time/inference_s_per_image"] = inference
    notes += cell_metrics.timing_notes(provenance)

    random_judges = [j.classifier.name for j in judges.all() if j.classifier.weights_hash() is None]
    if random_judges or cfg.model.kind == "tiny_random":
        notes.append(
            "PLUMBING ONLY: "
            + ("the model is randomly initialised (model=tiny_random); " if cfg.model.kind == "tiny_random" else "")
            + (f"classifier(s) {random_judges} have random weights; " if random_judges else "")
            + "these numbers measure nothing about erasure."
        )

    repairs = repairs_since(repairs_mark)
    if repairs:
        notes.append(repair_note(repairs))
    counts = {
        "prompts": len(requests),
        "images": len(samples),
        "images_generated": generator.images_generated + images_generated,
        "images_cached": generator.images_cached,
        "images_scored": sum(j.images_scored for j in judges.all()),
        "attack_outputs": len(outputs),
        "images_generated_base": base_model.images_generated,
        "cache_repairs": len(repairs),
    }
    if attack_run is not None and attacker.resumable:
        counts.update(attack_requests_optimised=attack_run.requests_optimised,
                      attack_requests_cached=attack_run.requests_cached,
                      attack_iterations=sum(o.iterations for o in outputs if not o.cached),
                      **{f"attack_budget_{k}": int(v) for k, v in attacker.budget().items()})
    versions = {
        "package": _package_version("emma-harness"),
        "git": git_hash(),
        "components": {
            "method": method.config(),
            "attacker": attacker.config(),
            "classifiers": {j.classifier.name: (j.classifier.describe() if hasattr(j.classifier, "describe")
                                                else {"version": j.classifier.version,
                                                      "weights_sha256": j.classifier.weights_hash()})
                            for j in judges.all()},
            "domain": domain.config(),
        },
        "model": {"name": cfg.model.name, "base_fingerprint": base_fp,
                  "erased_fingerprint": erased.fingerprint, "erase_key": erased.key,
                  "inference_guidance": guidance.config() if guidance is not None else None},
        "data_files": {k: sha256_file(p) for k, p in getattr(domain, "data_files", {}).items()},
        "libraries": {n: _package_version(n) for n in ("torch", "diffusers", "transformers")},
        "runtime": runtime_info(),
        "presets": preset_choices(),
        "choices": config_choices(),
        "metrics": dict(METRIC_VERSIONS),
    }
    result = CellResult(
        metrics=metrics,
        cell=CellInfo(model=cfg.model.name, method=method.name, domain=domain.name, concept=concept,
                      attacker=attacker.name, classifier=suite_judge.name),
        config=OmegaConf.to_container(cfg, resolve=True),
        versions=versions, timing=timing, counts=counts, notes=notes, provenance=provenance,
    )
    lines = [json.dumps(s.to_json()) for s in samples]
    lines += [json.dumps(r) for r in attack_records(outputs, attacker)]
    lines += [json.dumps(line) for line in extra_lines]
    atomic_write_text(output_dir / "samples.jsonl", "\n".join(lines) + "\n")
    counts["evidence_images"] = write_evidence(
        generator, samples + [dataclasses.replace(s, group="attack") for o in outputs for s in o.samples], output_dir)
    result.save(output_dir / "results.json")  # last: its presence marks a finished cell
    if finished.enabled(cfg):
        finished.store(cfg, output_dir, key)
    return result


def summary_table(result: CellResult) -> str:
    """A short plain-text table of the metrics."""
    rows = [f"{'metric':<44}{'value':>10}{'95% CI':>22}{'n':>8}"]
    for k, v in sorted(result.metrics.items()):
        ci = f"[{v.ci_low:.3f}, {v.ci_high:.3f}]" if v.ci_low is not None and not np.isnan(v.ci_low) else ""
        value = f"{v.value:>10.4f}" if v.value is not None else f"{'null':>10}"
        rows.append(f"{k:<44}{value}{ci:>22}{v.n:>8}")
    return "\n".join(rows)


def describe(result: CellResult) -> str:
    c = result.cell
    head = (f"cell: model={c.model} method={c.method} domain={c.domain} concept={c.concept} "
            f"attacker={c.attacker} classifier={c.classifier}")
    counts = ", ".join(f"{k}={v}" for k, v in result.counts.items())
    return "\n".join([head, summary_table(result), counts] + [f"NOTE: {n}" for n in result.notes])
