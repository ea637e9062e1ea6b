"""The Classifier role: images in, probabilities over labels out."""

from __future__ import annotations

import abc
import hashlib
import json
from typing import Any, ClassVar, Sequence

import torch

from emma.errors import ConfigError, UnknownChoiceError


class Classifier(abc.ABC):
    """Judges whether concepts are present in images.

    Images cross module boundaries as float ``(N, 3, H, W)`` tensors in ``[0, 1]``.

    Subclasses set ``name``, ``version`` (bumped on any change that moves numbers) and
    ``labels``, implement :meth:`predict`, and may override :meth:`detect` when the decision
    rule is not "probability of the concept's label >= threshold". A judge with a feature
    space of its own sets :attr:`has_features` and implements :meth:`features`.
    """

    name: ClassVar[str] = "classifier"
    version: ClassVar[str] = "0"
    #: whether :meth:`features` is implemented: on a domain that renders its own FID
    #: references (the tiny world), FID and the bias similarity are computed in these features
    has_features: ClassVar[bool] = False

    def __init__(self, threshold: float = 0.5, aliases: dict[str, str] | None = None) -> None:
        self.threshold = float(threshold)
        if not 0.0 <= self.threshold <= 1.0:  # also rejects NaN
            raise ConfigError(f"classifier '{self.name}': threshold={threshold} must be a probability in [0, 1]")
        # concept name (as a domain spells it) -> classifier label
        self.aliases = {k.lower(): v for k, v in (aliases or {}).items()}

    @property
    @abc.abstractmethod
    def labels(self) -> Sequence[str]:
        """The label set, in the order of :meth:`predict`'s columns."""

    @abc.abstractmethod
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        """Probabilities ``(N, len(labels))`` for float images ``(N, 3, H, W)`` in [0, 1]."""

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Image features ``(N, D)`` of float images ``(N, 3, H, W)`` in [0, 1] (judges with
        :attr:`has_features`)."""
        raise NotImplementedError(f"classifier '{self.name}' has no feature space (has_features is False)")

    def weights_hash(self) -> str | None:
        """sha256 of the weights in use, recorded in results (``None`` for random init)."""
        return None

    def describe(self) -> dict[str, Any]:
        """What results.json records of this judge (``versions.components.classifiers``):
        its version and weights; judges with more provenance (label sources, thresholds,
        checkpoints) extend it."""
        return {"version": self.version, "weights_sha256": self.weights_hash()}

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

    #: attributes that only steer :meth:`detect` (not :meth:`predict`), left out of the key
    detect_only: ClassVar[tuple[str, ...]] = ("threshold", "aliases")

    def cache_config(self) -> dict[str, Any]:
        """Everything that can change :meth:`predict`'s output: name, version, weights hash,
        the final label set, and every public setting of the instance (``margin``,
        ``face_size``, ``templates``, ``exposed_classes``, ``image_size``, ``device``, ...).
        Settings that only steer :meth:`detect` (:attr:`detect_only`) are left out: the score
        cache stores ``predict`` outputs."""
        settings = {k: _json_setting(v) for k, v in sorted(vars(self).items())
                    if not k.startswith("_") and k not in self.detect_only}
        return {"name": self.name, "version": self.version, "weights": self.weights_hash(),
                "labels": list(self.labels), "settings": {k: v for k, v in settings.items() if v is not _SKIP}}

    def cache_key(self) -> str:
        """Folder name of this judge's score cache: readable prefix + hash of :meth:`cache_config`.
        Computed at use, so labels an open-vocabulary judge adds are in it."""
        digest = hashlib.sha256(json.dumps(self.cache_config(), sort_keys=True, default=str).encode()).hexdigest()
        return f"{self.name}-v{self.version}-{(self.weights_hash() or 'random')[:16]}-{digest[:16]}"

    def excluded(self, probs: torch.Tensor) -> torch.Tensor | None:
        """Boolean ``(N,)``: images on which this judge has no verdict (they leave the rates'
        denominators and are counted as ``n_excluded``); ``None``: every image is judged."""
        return None


_SKIP = object()


def _json_setting(v: Any) -> Any:
    """A JSON-able view of a setting; objects that are not settings (models) are skipped."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        items = [_json_setting(x) for x in v]
        return _SKIP if any(x is _SKIP for x in items) else items
    if isinstance(v, dict):
        items = {str(k): _json_setting(x) for k, x in v.items()}
        return _SKIP if any(x is _SKIP for x in items.values()) else items
    if isinstance(v, torch.device):
        return str(v)
    if callable(v) and not isinstance(v, torch.nn.Module):  # an injected function (face detector)
        return f"{type(v).__module__}.{getattr(v, '__qualname__', type(v).__qualname__)}"
    return _SKIP
