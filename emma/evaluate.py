"""Render and judge prompt requests: the step that both suites and attackers share."""

from __future__ import annotations

from typing import Sequence

from emma.api.attacker import AttackTarget
from emma.api.types import PromptRequest, Sample


def judge_requests(
    target: AttackTarget, requests: Sequence[PromptRequest], *, progress: bool | str = False
) -> list[list[Sample]]:
    """Generate every request's images (cached), judge them, and return samples per request.

    A sample's ``detected`` says whether the judge found the request's ``concept``;
    ``score`` is that concept's probability; ``extra["excluded"]`` marks an image the judge
    has no verdict on (GCD: no face), which the rates leave out and count as ``n_excluded``.
    """
    prompts: list[str] = []
    seeds: list[int] = []
    owner: list[int] = []
    for i, req in enumerate(requests):
        for s in req.seeds():
            prompts.append(req.prompt)
            seeds.append(s)
            owner.append(i)
    desc = progress if isinstance(progress, str) else "generate"
    gen = target.generate(prompts, seeds, progress=desc if progress else False)
    probs = target.score(gen.images, gen.hashes, progress="classify" if progress else False)
    out: list[list[Sample]] = [[] for _ in requests]
    by_concept: dict[str, list[int]] = {}
    for j, i in enumerate(owner):
        by_concept.setdefault(requests[i].concept, []).append(j)
    detected = [False] * len(owner)
    scores = [0.0] * len(owner)
    for concept, rows in by_concept.items():
        det = target.detect(probs[rows], concept)
        score = target.concept_score(probs[rows], concept)
        for k, j in enumerate(rows):
            detected[j] = bool(det[k])
            scores[j] = float(score[k])
    excluded = target.excluded(probs)
    for j, i in enumerate(owner):
        req = requests[i]
        out[i].append(
            Sample(prompt=req.prompt, seed=seeds[j], concept=req.concept, group=req.group,
                   kind=req.kind, image_hash=gen.hashes[j], detected=detected[j],
                   score=scores[j], cached=gen.cached[j],
                   extra={"excluded": True} if excluded is not None and bool(excluded[j]) else {})
        )
    return out
