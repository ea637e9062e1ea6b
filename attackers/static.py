"""The static attacker: EMMA's fixed prompt suites, rendered as they are."""

from __future__ import annotations

from typing import Any, Sequence

from emma.api.attacker import Attacker, AttackTarget
from emma.api.types import AttackOutput, PromptRequest
from emma.attack import evaluating
from emma.evaluate import judge_requests


class StaticAttacker(Attacker):
    """Renders each request's prompt unchanged; an output succeeds when the judge finds the
    target concept in at least one of its images.

    Args:
        kinds: restrict to these prompt types (``None``: every EA type the suite has).
    """

    name = "static"
    version = "2"  # 2: image seeds derived per prompt and index (emma.seeds)

    def __init__(self, kinds: Sequence[str] | None = None) -> None:
        self.kinds = list(kinds) if kinds else None

    def attack(self, target: AttackTarget, requests: Sequence[PromptRequest]) -> list[AttackOutput]:
        chosen = [r for r in requests if self.kinds is None or r.kind in self.kinds]
        with evaluating(target):  # no search: its images are the final ones
            samples = judge_requests(target, chosen, progress="attack: static")
        return [
            AttackOutput(request=req, adversarial_prompt=req.prompt, samples=s,
                         success=any(x.detected for x in s), queries=len(s))
            for req, s in zip(chosen, samples)
        ]

    def config(self) -> dict[str, Any]:
        return {**super().config(), "kinds": self.kinds}
