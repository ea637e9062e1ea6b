"""Stage ``model``: load the base pipeline, fingerprint it, and let the attacker refuse a
model or request it cannot handle — before any image is drawn."""

from __future__ import annotations

import functools
import time
from typing import Any

from omegaconf import DictConfig

from emma.api.guidance import InferenceGuidance
from emma.attack import CellAttackTarget, LazyBaseModel, domain_prompt_texts
from emma.cache import ImageCache
from emma.generate import CachedGenerator
from emma.pipelines import fingerprint, load_pipeline
from emma.stages.context import CellContext


def generator_factory(model: DictConfig, cache: ImageCache) -> Any:
    """``make(pipe, fingerprint, guidance=None) -> CachedGenerator`` with the model's sampler settings."""
    def make(pipe: Any, fp: str, guidance: InferenceGuidance | None = None) -> CachedGenerator:
        return CachedGenerator(
            pipe, fp, cache,
            num_inference_steps=model.num_inference_steps, guidance_scale=model.guidance_scale,
            height=model.height, width=model.width, batch_size=model.batch_size,
            negative_prompt=model.get("negative_prompt"), guidance=guidance,
        )
    return make


def attack_target(ctx: CellContext, generator: CachedGenerator) -> CellAttackTarget:
    """The front an attacker sees: ``generator``'s model, the judge of the attack requests,
    the lazily loaded base model and the domain's prompts."""
    return CellAttackTarget(generator, ctx.judges.for_request(ctx.attack_requests[0]), base=ctx.base_model,
                            model_name=ctx.cfg.model.name, domain_prompts=ctx.domain_prompts)


def load_model(ctx: CellContext) -> None:
    t = time.perf_counter()
    model = ctx.cfg.model
    ctx.pipe = load_pipeline(model)
    ctx.base_fingerprint = fingerprint(ctx.pipe)
    ctx.timing["load_s"] = time.perf_counter() - t
    ctx.make_generator = generator_factory(model, ImageCache(ctx.cache_root))
    ctx.base_model = LazyBaseModel(lambda: load_pipeline(model), ctx.base_fingerprint, ctx.make_generator,
                                   model.name)
    domain, seed = ctx.domain, ctx.seed
    ctx.domain_prompts = functools.lru_cache(maxsize=1)(lambda: domain_prompt_texts(domain, seed))
    if ctx.attack_requests:
        ctx.attacker.check(attack_target(ctx, ctx.make_generator(ctx.pipe, ctx.base_fingerprint)),
                           ctx.attack_requests)
