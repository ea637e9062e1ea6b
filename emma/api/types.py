"""Typed records that cross role boundaries."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal, Optional

if TYPE_CHECKING:  # annotations only: readers of results (validation, leaderboards) need no torch
    import torch

EA_TYPES: tuple[str, ...] = ("name", "prefix", "variant", "short", "long")
RA_TYPES: tuple[str, ...] = ("random", "similar")


@dataclasses.dataclass(frozen=True)
class PromptRequest:
    """One prompt to render ``n_images`` times, each image with its own seed derived from
    (``seed``, the prompt's identity, the image's index) by :mod:`emma.seeds`.

    Args:
        prompt: the text given to the pipeline.
        concept: the concept whose presence the judge checks in the images.
        group: ``"ea"`` (target concept: success = absent), ``"ra"`` (non-target concept:
            success = present) or ``"attack"``.
        kind: prompt type within the group (``name``, ``prefix``, ..., ``random``,
            ``similar``, or an attacker's own label).
        seed: the cell seed the images' seeds derive from (:func:`emma.seeds.image_seeds`).
        n_images: images per prompt.
        seed_key: the identity the seeds derive from; ``None``: the prompt itself. An
            attacked request's adversarial prompt keeps its original prompt's identity, a bias
            set's groups share their prompt index's, so paired images share seeds.
    """

    prompt: str
    concept: str
    group: Literal["ea", "ra", "attack", "bias", "fid"]
    kind: str
    seed: int = 0
    n_images: int = 1
    negative_prompt: Optional[str] = None
    guidance_scale: Optional[float] = None
    seed_key: Optional[str] = None

    @property
    def identity(self) -> str:
        """What the image seeds derive from besides the cell seed and the index."""
        return self.prompt if self.seed_key is None else self.seed_key

    def seeds(self) -> list[int]:
        """The evaluation seeds of the request's ``n_images`` images."""
        from emma.seeds import EVALUATION, image_seeds

        return image_seeds(self.seed, self.identity, self.n_images, EVALUATION)

    def search_seeds(self, n: int = 1) -> list[int]:
        """``n`` seeds for an attack's search on this request: the search stream, disjoint
        from every evaluation seed (:mod:`emma.seeds`)."""
        from emma.seeds import SEARCH, image_seeds

        return image_seeds(self.seed, self.identity, n, SEARCH)


@dataclasses.dataclass
class Sample:
    """One generated and judged image (a line of ``samples.jsonl``)."""

    prompt: str
    seed: int
    concept: str
    group: str
    kind: str
    image_hash: str
    detected: bool
    score: float
    cached: bool = False
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class AttackOutput:
    """What an attacker produced for one request: the adversarial prompt (or embeddings) and
    the judged images it yields on the target model.

    Args:
        adversarial_prompt: hard-token text, replayable on any model.
        success: the judge found the request's concept in at least one of ``samples``.
        queries: images the attack drew on the target (its own checks and ``samples``).
        judged_queries: images the search had the judge score (its checks, a reference
            image's confirmation), ``samples`` not included; 0 for an attacker that does not
            declare ``uses_judge``.
        iterations: optimisation steps (or generations) spent on this request.
        time_s: wall seconds spent on this request (0 when read from the attack cache).
        cached: read from the attack cache (no optimisation ran).
    """

    request: PromptRequest
    adversarial_prompt: str
    samples: list[Sample]
    success: bool
    prompt_embeds_hash: Optional[str] = None
    queries: int = 0
    iterations: int = 0
    time_s: float = 0.0
    cached: bool = False
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    judged_queries: int = 0

    def record(self) -> dict[str, Any]:
        """What the attack cache stores and ``samples.jsonl`` shows (samples aside)."""
        return {"adversarial_prompt": self.adversarial_prompt, "success": self.success,
                "queries": self.queries, "iterations": self.iterations, "time_s": self.time_s,
                "judged_queries": self.judged_queries, "prompt_embeds_hash": self.prompt_embeds_hash,
                "extra": self.extra}


@dataclasses.dataclass
class GeneratedImages:
    """Images of one generation call, in request order."""

    images: torch.Tensor  # (N, 3, H, W) float in [0, 1]
    hashes: list[str]
    cached: list[bool]
