"""Stages ``bias_base``, ``rates``, ``quality`` and ``timing``: the cell's metrics.

Bias compares the base and the erased model on the same prompts, so its base images are drawn
(``bias_base``) before the erase stage edits the pipeline in place.
"""

from __future__ import annotations

import time

from emma import quality
from emma.attack import attack_metrics
from emma.metrics import cell_metrics
from emma.stages.context import CellContext


def draw_base_bias(ctx: CellContext) -> None:
    bias = ctx.cfg.metrics.bias
    if not bias.enabled:
        return
    t = time.perf_counter()
    ctx.bias_sets = quality.bias_sets(ctx.domain, bias.attributes, seed=ctx.seed)
    base_gen = ctx.make_generator(ctx.pipe, ctx.base_fingerprint)
    ctx.base_bias = {b.attribute: quality.render_groups(base_gen, b, int(bias.images_per_prompt), "bias: base")
                     for b in ctx.bias_sets}
    ctx.images_generated_before += base_gen.images_generated
    ctx.timing["bias_base_s"] = time.perf_counter() - t


def rate_metrics(ctx: CellContext) -> None:
    """EA, RA and ASR with their intervals; an optimising attacker's own counts; metrics the
    attacker adds (STACE: asr = SIR_H, stace/...)."""
    original = ctx.attack_run.original if ctx.attack_run is not None else None
    ctx.metrics = cell_metrics.rate_metrics(ctx.suite, ctx.outputs, seed=ctx.seed, original=original)
    if ctx.attack_run is not None and ctx.attacker.resumable:
        ctx.metrics.update(attack_metrics(ctx.attack_run))
    if ctx.outputs or not ctx.attacker.complete():  # a partial attack reports its null metrics
        ctx.metrics.update(ctx.attacker.extra_metrics())
        ctx.notes += ctx.attacker.notes()


def quality_metrics(ctx: CellContext) -> None:
    """FID against the domain's reference, and bias of the erased model against the base."""
    cfg, requests, judge = ctx.cfg, ctx.requests, ctx.suite_judge
    if cfg.metrics.fid.enabled:
        t = time.perf_counter()
        texts = [r.prompt for r in requests for _ in r.seeds()]
        seeds = [s for r in requests for s in r.seeds()]
        fid, ctx.provenance["fid"] = quality.fid_metric(
            ctx.domain, ctx.generator.generate(texts, seeds).images,
            clusters=[i for i, r in enumerate(requests) for _ in r.seeds()],
            concepts=[r.concept for r in requests for _ in r.seeds()],
            judge=judge, cfg=cfg.metrics.fid, notes=ctx.notes, cache_root=ctx.cache_root, seed=ctx.seed)
        if fid is not None:
            ctx.metrics["fid"] = fid
        ctx.timing["fid_s"] = time.perf_counter() - t
    bias = cfg.metrics.bias
    if bias.enabled:
        t = time.perf_counter()
        ipp = int(bias.images_per_prompt)
        erased = {b.attribute: quality.render_groups(ctx.generator, b, ipp, "bias: erased") for b in ctx.bias_sets}
        ctx.metrics.update(quality.bias_metrics(
            ctx.base_bias, erased, ctx.bias_sets, quality.similarities(ctx.domain, judge, ctx.notes, bias.similarity),
            int(bias.n_resamples), ctx.seed, pairing=str(bias.get("pairing", "paired")), images_per_prompt=ipp))
        for label, imgs in (("base", ctx.base_bias), ("erased", erased)):
            ctx.extra_lines += quality.bias_sample_lines(imgs, ctx.bias_sets, ipp, label)
        ctx.timing["bias_s"] = time.perf_counter() - t


def timing_metrics(ctx: CellContext) -> None:
    """Unlearning time (replayed from the erased model's manifest when it was cached) and
    inference time per image (from the suite images' records)."""
    erased = ctx.erased
    ctx.metrics["time/unlearning_s"], ctx.provenance["time/unlearning_s"] = cell_metrics.unlearning_time(
        erased.unlearning_s, erased.manifest, erased.cached)
    inference, ctx.provenance["time/inference_s_per_image"] = cell_metrics.inference_time(
        ctx.suite_records, ctx.seed)
    if inference is not None:
        ctx.metrics["time/inference_s_per_image"] = inference
    ctx.notes += cell_metrics.timing_notes(ctx.provenance)
