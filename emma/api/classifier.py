"""The Classifier role: images in, probabilities over labels out."""

from __future__ import annotations

import abc
from typing import ClassVar, Sequence

import torch

from emma.errors import UnknownChoiceError


class Classifier(abc.ABC):
    """Judges whether concepts are present in images.

    Images cross module boundaries as float ``(N, 3, H, W)`` tensors in ``[0, 1]``.

    Subclasses set ``name``, ``version`` (bumped on any change that moves numbers) and
    ``labels``, implement :meth:`predict`, and may override :meth:`detect` when the decision
    rule is not "probability of the concept's label >= threshold".
    """

    name: ClassVar[str] = "classifier"
    version: ClassVar[str] = "0"

    def __init__(self, threshold: float = 0.5, aliases: dict[str, str] | None = None) -> None:
        self.threshold = float(threshold)
        # concept name (as a domain spells it) -> classifier label
        self.aliases = {k.lower(): v for k, v in (aliases or {}).items()}

    @property
    @abc.abstractmethod
    def labels(self) -> Sequence[str]:
        """The label set, in the order of :meth:`predict`'s columns."""

    @abc.abstractmethod
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """Probabilities ``(N, len(labels))`` for float images ``(N, 3, H, W)`` in [0, 1]."""

    def weights_hash(self) -> str | None:
        """sha256 of the weights in use, recorded in results (``None`` for random init)."""
        return None

    def label_index(self, concept: str) -> int:
        """Column of ``concept`` in :meth:`predict`'s output; clear error if absent."""
        label = self.aliases.get(concept.lower(), concept)
        lowered = [lab.lower() for lab in self.labels]
        if label.lower() in lowered:
            return lowered.index(label.lower())
        raise UnknownChoiceError(f"{self.name} classifier label", concept, list(self.labels))

    def can_detect(self, concept: str) -> bool:
        try:
            self.label_index(concept)
        except UnknownChoiceError:
            return False
        return True

    def detect(self, probs: torch.Tensor, concept: str) -> torch.Tensor:
        """Boolean ``(N,)``: is ``concept`` present, given :meth:`predict`'s output."""
        return probs[:, self.label_index(concept)] >= self.threshold

    def cache_key(self) -> str:
        return f"{self.name}-v{self.version}-{self.weights_hash() or 'random'}"
