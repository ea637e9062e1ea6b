"""Stage ``erase``: the erased model (cached by its inputs' hash) and the generator that
draws from it; inference-time methods (SLD) return a sampling guidance instead of weights."""

from __future__ import annotations

import time

from emma.erase import erase_cached
from emma.stages.context import CellContext


def erase(ctx: CellContext) -> None:
    # The method erases the concept as prompts write it ("Vincent van Gogh", not the domain's
    # key vincent-van-gogh), as the methods' papers erase names.
    text = ctx.domain.concept(ctx.concept).label
    t = time.perf_counter()
    ctx.erased = erase_cached(ctx.pipe, ctx.method, [text], ctx.cache_root,
                              base_fingerprint=ctx.base_fingerprint, domain=ctx.domain, seed=ctx.seed)
    ctx.timing["erase_s"] = time.perf_counter() - t
    ctx.guidance = ctx.method.inference_guidance(ctx.erased.pipe, [text], domain=ctx.domain)
    if ctx.guidance is not None:
        ctx.notes.append(f"inference-time guidance '{ctx.guidance.name}': the method edits no weights and "
                         "changes how images are sampled (time/unlearning_s is 0)")
    ctx.generator = ctx.make_generator(ctx.erased.pipe, ctx.erased.fingerprint, ctx.guidance)
