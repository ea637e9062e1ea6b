"""UnlearnDiffAtk art-style classifier: EMMA's judge of the art-style domain.

A ``transformers`` ``ViTForImageClassification`` (ViT-B/16 pre-trained on ImageNet-21k,
fine-tuned by Zhang et al. for UnlearnDiffAtk on 129 classes: 128 artists + "Unknown
Artist"). The checkpoint is a Hugging Face Trainer folder (``checkpoint-2800``); its
``config.json`` (architecture + ``id2label``) ships with this package as
``classifiers/data/style_vit_config.json`` (made by ``scripts/make_label_files.py``), so the
network can be built without the weights; only ``pytorch_model.bin`` is downloaded.

Preprocessing is the ViT image processor of that checkpoint: resize to 224x224 (bilinear),
scale to [0, 1], normalise with mean = std = 0.5. Decision: EMMA counts a style as present
when it is among the ``top_k`` = 3 most probable classes (UnlearnDiffAtk uses top-1;
``top_k: 1`` reproduces it). Labels are compared spelling-insensitively, so EMMA's
``vincent-van-gogh`` and ``m.c.-escher`` keys match directly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from classifiers._base import (
    DATA_DIR,
    PretrainedClassifier,
    check_images,
    load_torch_checkpoint,
    normalize,
    require,
    resize,
)

CONFIG_PATH = DATA_DIR / "style_vit_config.json"


def style_vit_config() -> dict[str, Any]:
    """The shipped checkpoint config (architecture + ``id2label``)."""
    return json.loads(CONFIG_PATH.read_text())


def style_vit_labels() -> tuple[str, ...]:
    id2label = style_vit_config()["id2label"]
    return tuple(id2label[str(i)] for i in range(len(id2label)))


def style_vit_model(config: dict[str, Any] | None = None) -> nn.Module:
    """Randomly initialised ``ViTForImageClassification`` with the checkpoint's architecture."""
    transformers = require("transformers", extra="dev")
    cfg = dict(config or style_vit_config())
    for key in ("_name_or_path", "architectures", "transformers_version", "torch_dtype", "label2id"):
        cfg.pop(key, None)
    cfg["id2label"] = {int(k): v for k, v in cfg["id2label"].items()}
    cfg["label2id"] = {v: k for k, v in cfg["id2label"].items()}
    config_obj = transformers.ViTConfig(**cfg)
    return transformers.ViTForImageClassification(config_obj)


class StyleViTClassifier(PretrainedClassifier):
    """129-class art-style ViT (UnlearnDiffAtk checkpoint-2800).

    ``predict`` returns the softmax over the 129 classes; ``detect`` is True when the concept's
    class is among the ``top_k`` highest and its probability is at least ``threshold``.

    Args:
        weights: ``"style_vit_unlearndiffatk"``, a local ``pytorch_model.bin`` (or the
            checkpoint folder), or ``None`` (random init).
        top_k: 3 (EMMA) or 1 (UnlearnDiffAtk).
        threshold: minimum probability (0 = rank only, as in both references).
        image_size: ViT input size (224).
    """

    name = "style_vit"
    version = "1"
    default_weights = "style_vit_unlearndiffatk"

    def __init__(
        self,
        weights: str | os.PathLike[str] | None = "style_vit_unlearndiffatk",
        top_k: int = 3,
        threshold: float = 0.0,
        image_size: int = 224,
        aliases: dict[str, str] | None = None,
        device: str = "cpu",
        batch_size: int = 16,
    ) -> None:
        super().__init__(weights, threshold, aliases, device, batch_size)
        self.top_k = int(top_k)
        self.image_size = int(image_size)
        self._labels = style_vit_labels()

    @property
    def labels(self) -> Sequence[str]:
        return self._labels

    def build_model(self) -> nn.Module:
        model = style_vit_model()
        if self.resolved is not None:
            paths = self.resolved.paths
            key = next(
                (k for k in paths if k.endswith("pytorch_model.bin") or k.endswith(".safetensors")),
                next(iter(paths)),
            )
            path = paths[key]
            if str(path).endswith(".safetensors"):
                from safetensors.torch import load_file

                state = load_file(str(path))
            else:
                state = load_torch_checkpoint(path, self.resolved)
            model.load_state_dict(state, strict=True)
        return model

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        images = check_images(images)
        model = self.model

        def run(batch: torch.Tensor) -> torch.Tensor:
            x = normalize(resize(batch.to(self.device), self.image_size, "bilinear"), (0.5,) * 3, (0.5,) * 3)
            return model(pixel_values=x).logits.softmax(dim=-1)

        return self._batched(run, images)

    def detect(self, probs: torch.Tensor, concept: str) -> torch.Tensor:
        idx = self.label_index(concept)
        k = min(self.top_k, probs.shape[1])
        in_top = (probs.topk(k, dim=1).indices == idx).any(dim=1)
        return in_top & (probs[:, idx] >= self.threshold)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "top_k": self.top_k}
