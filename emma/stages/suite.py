"""Stage ``suite``: draw the domain's EA/RA prompts on the erased model and judge every image
(both cached per image), grouped by the judge each request asks for."""

from __future__ import annotations

import time

from emma.evaluate import judge_requests
from emma.generate import GenerationTarget
from emma.stages.context import CellContext


def draw_suite(ctx: CellContext) -> None:
    t = time.perf_counter()
    judges, requests = ctx.judges, ctx.requests
    for name in dict.fromkeys(judges.name_for(r) for r in requests):
        group = [r for r in requests if judges.name_for(r) == name]
        target = GenerationTarget(ctx.generator, judges.get(name))
        per_request = judge_requests(target, group, progress=f"suite: {ctx.domain.name}/{ctx.concept}")
        ctx.suite += list(zip(group, per_request))
    ctx.suite_records = dict(ctx.generator.records)  # timing of the suite images (stored with them)
    ctx.timing["suite_s"] = time.perf_counter() - t
