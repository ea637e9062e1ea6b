"""Stage ``attack``: the attacker works on the EA requests against the erased model;
optimising attackers run in cached batches (:func:`emma.attack.run_attack`)."""

from __future__ import annotations

import time

from emma.attack import AttackCache, run_attack
from emma.stages.context import CellContext
from emma.stages.model import attack_target


def attack(ctx: CellContext) -> None:
    t = time.perf_counter()
    if ctx.attack_requests:  # prompt_types may leave only RA prompts: then there is nothing to attack
        ctx.attacker.bind_cell(output_dir=ctx.output_dir, cache_dir=ctx.cache_root,
                               info={"model": ctx.cfg.model.name, "method": ctx.method.name,
                                     "domain": ctx.domain.name})
        ctx.attack_run = run_attack(ctx.attacker, attack_target(ctx, ctx.generator), ctx.attack_requests,
                                    AttackCache(ctx.cache_root))
    ctx.timing["attack_s"] = time.perf_counter() - t
