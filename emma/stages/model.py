"""Stage ``model``: load the base pipeline, fingerprint it, and let the attacker refuse a
model or request it cannot handle — before any image is drawn."""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

from emma import startup
from emma.api.guidance import InferenceGuidance
from emma.attack import CellAttackTarget, LazyBaseModel, domain_concept_requests, domain_prompt_texts
from emma.cache import ImageCache
from emma.generate import CachedGenerator
from emma.pipelines import fingerprint, load_pipeline
from emma.stages.context import CellContext


def generator_factory(model: DictConfig, cache: ImageCache, sampler: Mapping[str, Any] | None = None) -> Any:
    """``make(pipe, fingerprint, guidance=None) -> CachedGenerator`` with the model's sampler
    settings (``sampler``'s ``num_inference_steps`` / ``guidance_scale`` replace them)."""
    sampler = dict(sampler or {})

    def make(pipe: Any, fp: str, guidance: InferenceGuidance | None = None) -> CachedGenerator:
        return CachedGenerator(
            pipe, fp, cache,
            num_inference_steps=sampler.get("num_inference_steps", model.num_inference_steps),
            guidance_scale=sampler.get("guidance_scale", model.guidance_scale),
            height=model.height, width=model.width, batch_size=model.batch_size,
            negative_prompt=model.get("negative_prompt"), guidance=guidance,
        )
    return make


def attack_judge(ctx: CellContext) -> Any:
    """The judge of the attack requests, with the protocol's rules for it (a NudeNet threshold)."""
    name = ctx.judges.name_for(ctx.attack_requests[0])
    judge = ctx.judges.get(name)
    overrides = ctx.protocol.judge_overrides(judge.classifier.name) if ctx.protocol is not None else {}
    return ctx.judges.with_overrides(name, overrides) if overrides else judge


def attack_target(ctx: CellContext, generator: CachedGenerator) -> CellAttackTarget:
    """The front an attacker sees: ``generator``'s model (at the protocol's sampler), the judge
    of the attack requests (with the protocol's rules), the lazily loaded base model and the
    domain's prompts."""
    sampler = dict(ctx.protocol.sampler) if ctx.protocol is not None else {}
    if sampler:
        generator = generator.with_sampler(
            guidance_scale=float(sampler.get("guidance_scale", generator.guidance_scale)),
            num_inference_steps=int(sampler.get("num_inference_steps", generator.num_inference_steps)))
    return CellAttackTarget(generator, attack_judge(ctx), base=ctx.base_model, model_name=ctx.cfg.model.name,
                            domain_prompts=ctx.domain_prompts, protocol=ctx.protocol,
                            domain_requests=ctx.domain_requests)


def load_model(ctx: CellContext) -> None:
    t = time.perf_counter()
    model = ctx.cfg.model
    ctx.pipe = load_pipeline(model)
    ctx.base_fingerprint = fingerprint(ctx.pipe)
    ctx.timing["load_s"] = time.perf_counter() - t
    startup.restore_gc()  # the libraries are imported: the command line's start-up is over
    ctx.make_generator = generator_factory(model, ImageCache(ctx.cache_root))
    # the base model serves the attack only: it draws at the protocol's sampler
    sampler = ctx.protocol.sampler if ctx.protocol is not None else None
    ctx.base_model = LazyBaseModel(lambda: load_pipeline(model), ctx.base_fingerprint,
                                   generator_factory(model, ImageCache(ctx.cache_root), sampler), model.name)
    domain, seed = ctx.domain, ctx.seed
    ctx.domain_prompts = functools.lru_cache(maxsize=1)(lambda: domain_prompt_texts(domain, seed))
    ctx.domain_requests = functools.lru_cache(maxsize=1)(lambda: domain_concept_requests(domain, seed))
    if ctx.attack_requests:
        ctx.attacker.check(attack_target(ctx, ctx.make_generator(ctx.pipe, ctx.base_fingerprint)),
                           ctx.attack_requests)
