"""The Attacker role: find prompts (or embeddings) that bring an erased concept back."""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Protocol, Sequence

import torch

from emma.api.types import AttackOutput, GeneratedImages, PromptRequest


class AttackTarget(Protocol):
    """The narrow front an attacker sees: generate and score.

    White-box attackers additionally read ``pipe`` (UNet / text encoder); they declare
    ``needs_white_box = True``.
    """

    pipe: Any

    def generate(
        self,
        prompts: Sequence[str] | None = None,
        seeds: Sequence[int] = (),
        *,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt: str | None = None,
    ) -> GeneratedImages:
        """Render one image per (prompt or embedding row, seed)."""

    def score(self, images: torch.Tensor) -> torch.Tensor:
        """Classifier probabilities for images."""

    def detect(self, probs: torch.Tensor, concept: str) -> torch.Tensor:
        """Boolean presence of ``concept`` given :meth:`score`'s output."""


class Attacker(abc.ABC):
    """Turns attack requests (target concept + seed prompt) into attack outputs."""

    name: ClassVar[str] = "attacker"
    version: ClassVar[str] = "0"
    needs_white_box: ClassVar[bool] = False

    @abc.abstractmethod
    def attack(self, target: AttackTarget, requests: Sequence[PromptRequest]) -> list[AttackOutput]:
        """One :class:`AttackOutput` per request, in order."""

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version}
