"""Plumbing shared by the real-weight classifiers.

- :class:`PretrainedClassifier` resolves and verifies weights in the constructor (so a missing
  checkpoint fails fast, with download instructions, before any heavy library is imported)
  and builds the network lazily on first use (so a config test can instantiate every
  classifier cheaply); ``weights=None`` means random initialisation (plumbing only).
- :func:`normalize_label` lets domain spellings (``brad-pitt``, ``baseballbat``,
  ``adidassb``) find classifier labels (``Brad_Pitt``, ``baseball bat``, ``Adidas SB``).
- Tensor preprocessing helpers: images arrive as float ``(N, 3, H, W)`` in ``[0, 1]``.
"""

from __future__ import annotations

import abc
import hashlib
import importlib
import importlib.metadata
import os
import pickle
import re
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from emma.api.classifier import Classifier
from emma.errors import EmmaError, UnknownChoiceError
from emma.weights import ResolvedWeights, resolve_weights

DATA_DIR = Path(__file__).resolve().parent / "data"


class MissingDependencyError(EmmaError, ImportError):
    """An optional dependency of a classifier is not installed."""


def require(module: str, extra: str, pip_name: str | None = None) -> Any:
    """Import ``module`` or raise a :class:`MissingDependencyError` naming the pip extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"this classifier needs the '{pip_name or module}' package, which is not installed "
            f"({exc}). Install it with `pip install 'emma-harness[{extra}]'` (or `pip install "
            f"{pip_name or module}`)."
        ) from None


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def normalize_label(text: str) -> str:
    """Spelling-insensitive key: accents stripped, lower case, only letters and digits."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c))
    return re.sub(r"[^a-z0-9]", "", text.lower())


def load_torch_checkpoint(path: str | os.PathLike[str], resolved: ResolvedWeights | None = None) -> Any:
    """``torch.load`` with ``weights_only=True``; full unpickling only for pinned registry files.

    Old checkpoints (GIPHY's 2018 pickle, some model zoos) hold more than tensors. They are
    unpickled in full only when they came from the registry with a matching pinned sha256,
    i.e. they are byte-identical to the published file; anything else must load as weights.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - decide below whether full unpickling is safe
        if resolved is not None and resolved.pinned and resolved.name != "local":
            return torch.load(path, map_location="cpu", weights_only=False)
        raise EmmaError(
            f"{path} cannot be loaded as plain weights ({type(exc).__name__}: {exc}). Only "
            "registry files that match their pinned sha256 are unpickled in full; convert this "
            "checkpoint to a plain state dict (torch.save(model.state_dict(), ...)) to use it."
        ) from None


_SAFE_PICKLE_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
    ("collections", "OrderedDict"),
}


class _NumpyOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_PICKLE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refusing to unpickle {module}.{name} (only numpy arrays and containers)"
        )


def load_numpy_pickle(path: str | os.PathLike[str]) -> Any:
    """Unpickle a file that holds only numpy arrays in plain containers (Q16's ``prompts.p``,
    MTCNN's ``det*.npy``), refusing any other global: these upstream files are unpinned, so
    they must not be able to run code. ``.npy`` object arrays are unwrapped with ``.item()``.
    """
    import numpy as np

    with open(path, "rb") as f:
        if f.read(6) == b"\x93NUMPY":
            f.seek(0)
            version = np.lib.format.read_magic(f)
            header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = header(f)
            if not dtype.hasobject:
                f.seek(0)
                return np.load(f, allow_pickle=False)
            obj = _NumpyOnlyUnpickler(f, encoding="latin1").load()
            return obj.item() if isinstance(obj, np.ndarray) and obj.shape == () else obj
        f.seek(0)
        return _NumpyOnlyUnpickler(f, encoding="latin1").load()


class NormalizedLabelsMixin:
    """``label_index`` that falls back to :func:`normalize_label` matching."""

    def label_index(self, concept: str) -> int:  # type: ignore[override]
        label = self.aliases.get(concept.lower(), concept)  # type: ignore[attr-defined]
        labels = list(self.labels)  # type: ignore[attr-defined]
        lowered = [lab.lower() for lab in labels]
        if label.lower() in lowered:
            return lowered.index(label.lower())
        key = normalize_label(label)
        index = getattr(self, "_normalized_index", None)
        if not index:  # built lazily; subclasses reset it to None when their labels change
            index = {}
            for i, lab in enumerate(labels):
                index.setdefault(normalize_label(lab), i)
            self._normalized_index = index
        if key in index:
            return index[key]
        raise UnknownChoiceError(f"{self.name} classifier label", concept, labels)  # type: ignore[attr-defined]

    def undetectable(self, concepts: Sequence[str]) -> list[str]:
        """The concepts of ``concepts`` this classifier has no label for (it can never find them)."""
        return [c for c in concepts if not self.can_detect(c)]  # type: ignore[attr-defined]


class OpenVocabularyMixin:
    """Label sets that grow on demand (CLIP zero-shot, VLM judge).

    Built with ``labels=None``, the classifier is *open-vocabulary*: asking for an unknown
    concept (``label_index``, ``can_detect``) appends it as a label. The label set is part of
    :meth:`cache_key`, so cached predictions never mix label sets.
    """

    open_vocabulary: bool = False

    def label_index(self, concept: str) -> int:  # type: ignore[override]
        try:
            return super().label_index(concept)  # type: ignore[misc]
        except UnknownChoiceError:
            if not self.open_vocabulary:
                raise
            label = self.aliases.get(concept.lower(), concept)  # type: ignore[attr-defined]
            self.set_labels((*self._labels, label))  # type: ignore[attr-defined]
            return super().label_index(concept)  # type: ignore[misc]

    def cache_key(self) -> str:
        labels = hashlib.sha256("\x1f".join(self.labels).encode()).hexdigest()[:12]  # type: ignore[attr-defined]
        return f"{super().cache_key()}-labels{labels}"  # type: ignore[misc]


class PretrainedClassifier(NormalizedLabelsMixin, Classifier):
    """A classifier with a real architecture whose weights come from the registry.

    Args:
        weights: registry entry name (see ``python -m emma.weights list``), a local file or
            folder, or ``None`` for random initialisation (plumbing only: decisions are noise).
        threshold: decision threshold (meaning depends on the classifier).
        aliases: concept name -> label.
        device: torch device for inference.
        batch_size: images per forward pass.
    """

    #: registry entry used in error messages when ``weights`` is an unusable path
    default_weights: str | None = None

    def __init__(
        self,
        weights: str | os.PathLike[str] | None = None,
        threshold: float = 0.5,
        aliases: dict[str, str] | None = None,
        device: str = "cpu",
        batch_size: int = 16,
    ) -> None:
        super().__init__(threshold=threshold, aliases=aliases)
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        # resolve + verify now: fail fast, before importing the heavy library
        self.resolved: ResolvedWeights | None = (
            None if weights is None else resolve_weights(weights, default_entry=self.default_weights)
        )
        self._model: torch.nn.Module | None = None

    @property
    def is_random(self) -> bool:
        return self.resolved is None

    def weights_hash(self) -> str | None:
        return None if self.resolved is None else self.resolved.fingerprint

    @property
    def model(self) -> torch.nn.Module:
        """The network, built (and loaded) on first access."""
        if self._model is None:
            model = self.build_model()
            self._model = model.to(self.device).eval()
        return self._model

    @abc.abstractmethod
    def build_model(self) -> torch.nn.Module:
        """Build the architecture and load ``self.resolved`` (random init when ``None``)."""

    def describe(self) -> dict[str, Any]:
        """What results record about this judge: name, version, weights and their hash."""
        return {
            "name": self.name,
            "version": self.version,
            "weights": None if self.resolved is None else self.resolved.to_json(),
            "weights_hash": self.weights_hash(),
            "threshold": self.threshold,
        }

    @torch.no_grad()
    def _batched(self, fn, images: torch.Tensor) -> torch.Tensor:
        outs = [fn(images[i : i + self.batch_size]) for i in range(0, len(images), self.batch_size)]
        if not outs:
            return torch.zeros(0, len(self.labels))
        return torch.cat(outs).float().cpu()


# ---------------------------------------------------------------------------------------------
# preprocessing (tensor versions of the PIL / torchvision transforms each checkpoint expects)


def check_images(images: torch.Tensor) -> torch.Tensor:
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images of shape (N, 3, H, W), got {tuple(images.shape)}")
    return images.float()


def resize(images: torch.Tensor, size: int | tuple[int, int], mode: str = "bilinear") -> torch.Tensor:
    """Resize to ``size`` (square int or (H, W)) with antialiasing, like PIL's resize."""
    hw = (size, size) if isinstance(size, int) else tuple(size)
    if tuple(images.shape[-2:]) == hw:
        return images
    out = F.interpolate(
        images,
        size=hw,
        mode=mode,
        antialias=mode in ("bilinear", "bicubic"),
        align_corners=False if mode in ("bilinear", "bicubic") else None,
    )
    return out.clamp(0, 1)


def resize_shorter_center_crop(images: torch.Tensor, size: int, mode: str = "bicubic") -> torch.Tensor:
    """torchvision ``Resize(size)`` (shorter side) + ``CenterCrop(size)``."""
    h, w = images.shape[-2:]
    scale = size / min(h, w)
    nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
    images = resize(images, (nh, nw), mode)
    top, left = (nh - size) // 2, (nw - size) // 2
    return images[..., top : top + size, left : left + size]


def normalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    m = torch.tensor(mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    return (images - m) / s


def to_uint8_hwc(images: torch.Tensor) -> list:
    """Float images -> list of uint8 ``(H, W, 3)`` RGB numpy arrays (as if saved to PNG)."""
    arr = (images.detach().float().clamp(0, 1) * 255.0).round().to(torch.uint8)
    return [a.permute(1, 2, 0).cpu().numpy() for a in arr]
