"""YOLO11 logo classifier: EMMA's judge of the copyright domain.

An Ultralytics YOLO11 classification model (``yolo11s-cls`` fine-tuned on 30 brands of
LogoDet-3K; ``scripts/train_logo_classifier.py`` reproduces the fine-tune for users who have
the dataset). The checkpoint is Ultralytics' ``.pt`` (a pickled ``ClassificationModel`` with
its class ``names``); labels are read from it, so any fine-tune with the brand names as class
folders works. ``weights=None`` builds the same architecture from Ultralytics' bundled
``yolo11s-cls.yaml`` with the 30 EMMA brands (``classifiers/data/yolo_logo_labels.txt``).

Preprocessing is Ultralytics' ``classify_transforms(224)``: resize the shorter side to 224
(bilinear), centre-crop 224, scale to [0, 1], no normalisation. Decision as in EMMA's
``batch_predict_logos.py``: the brand is present when it is the top-1 class (names compared
without case, spaces, hyphens or apostrophes, so ``mcdonalds`` finds ``McDonald's``);
``threshold`` optionally also demands a minimum probability.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from classifiers._base import (
    DATA_DIR,
    PretrainedClassifier,
    check_images,
    normalize_label,
    package_version,
    require,
    resize_shorter_center_crop,
)
from emma.errors import ConfigError

LOGO_LABELS: tuple[str, ...] = tuple(
    line.strip() for line in (DATA_DIR / "yolo_logo_labels.txt").read_text().splitlines() if line.strip()
)


def yolo_classifier_model(num_classes: int = len(LOGO_LABELS), cfg: str = "yolo11s-cls.yaml") -> nn.Module:
    """Randomly initialised Ultralytics classification model (architecture from its YAML)."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    require("ultralytics", extra="logos", pip_name="ultralytics-opencv-headless")
    from ultralytics.nn.tasks import ClassificationModel

    return ClassificationModel(cfg, nc=num_classes, verbose=False)


class YOLOLogoClassifier(PretrainedClassifier):
    """YOLO11-cls logo classifier over the 30 LogoDet-3K brands of EMMA.

    Args:
        weights: ``"yolo11s_cls_logo_emma"``, a local Ultralytics ``best.pt``, or ``None``
            (random init, the shipped brand list).
        threshold: minimum top-1 probability (0 = top-1 only, as EMMA).
        image_size: classification input size (224).
        arch: Ultralytics model YAML for random init.
        required_labels: brands the checkpoint must know (EMMA's 30 by default); a checkpoint
            whose class names miss them is rejected (it is not a logo fine-tune).
    """

    name = "yolo_logo"
    version = "1"
    default_weights = "yolo11s_cls_logo_emma"

    def __init__(
        self,
        weights: str | os.PathLike[str] | None = "yolo11s_cls_logo_emma",
        threshold: float = 0.0,
        image_size: int = 224,
        arch: str = "yolo11s-cls.yaml",
        required_labels: Sequence[str] | None = LOGO_LABELS,
        aliases: dict[str, str] | None = None,
        device: str = "cpu",
        batch_size: int = 32,
    ) -> None:
        super().__init__(weights, threshold, aliases, device, batch_size)
        self.image_size = int(image_size)
        self.arch = arch
        self.required_labels = tuple(required_labels or ())
        self._labels: tuple[str, ...] = LOGO_LABELS

    @property
    def labels(self) -> Sequence[str]:
        if self.resolved is not None and self._model is None:
            self.model  # noqa: B018 - the checkpoint carries the authoritative label order
        return self._labels

    def build_model(self) -> nn.Module:
        if self.resolved is None:
            return yolo_classifier_model(len(LOGO_LABELS), self.arch)
        os.environ.setdefault("YOLO_OFFLINE", "1")
        require("ultralytics", extra="logos", pip_name="ultralytics-opencv-headless")
        from ultralytics.nn.tasks import load_checkpoint

        # Ultralytics checkpoints are pickled modules; only registry files with a pinned hash
        # or a path the user chose reach this point
        model, _ = load_checkpoint(str(self.resolved.path()), device="cpu", fuse=False)
        names = getattr(model, "names", None) or {}
        labels = (
            tuple(str(names[i]) for i in sorted(names)) if isinstance(names, dict) else tuple(map(str, names))
        )
        have = {normalize_label(n) for n in labels}
        missing = [b for b in self.required_labels if normalize_label(b) not in have]
        if missing:
            raise ConfigError(
                f"{self.resolved.path()} is not a logo classifier for EMMA's brands: "
                f"its {len(labels)} classes "
                f"({', '.join(labels[:8])}{', ...' if len(labels) > 8 else ''}) miss {', '.join(missing[:8])}"
                f"{' ...' if len(missing) > 8 else ''}. Fine-tune one with scripts/train_logo_classifier.py "
                "and pass classifier.weights=/path/to/best.pt."
            )
        self._labels = labels
        self._normalized_index = None
        return model.float()

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        images = check_images(images)
        model = self.model

        def run(batch: torch.Tensor) -> torch.Tensor:
            x = resize_shorter_center_crop(batch.to(self.device), self.image_size, mode="bilinear")
            out = model(x)
            # Ultralytics' Classify head returns (softmax, logits) in eval mode
            return out[0] if isinstance(out, (tuple, list)) else out.softmax(dim=-1)

        return self._batched(run, images)

    def detect(self, probs: torch.Tensor, concept: str) -> torch.Tensor:
        idx = self.label_index(concept)
        return (probs.argmax(dim=1) == idx) & (probs[:, idx] >= self.threshold)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            # the headless build is a separate distribution of the same package
            "ultralytics_version": (package_version("ultralytics-opencv-headless")
                                    or package_version("ultralytics")),
            "arch": self.arch,
        }
