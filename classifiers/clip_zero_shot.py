"""CLIP zero-shot: the generic fallback judge for any concept (open_clip).

Each label becomes a text prompt (``"a photo of {label}"``, more templates averaged if
given); an image's probabilities are the softmax of ``logit_scale * cos(image, text)`` over
the labels (CLIP's own zero-shot rule, logit scale 100 for OpenAI CLIP). A concept is
detected when its label is the top-1 and its probability is at least ``threshold``.

The same image tower serves as the CLIP embedding of the bias metric (:func:`image_embedding`,
which ``conf/metrics``' ``bias.similarity.embedding`` names).

Weights: OpenAI CLIP TorchScript archives (``clip_vit_l14_openai``, ``clip_vit_b32_openai``)
load into open_clip's architecture of the same name with QuickGELU, as open_clip does for its
``openai`` tag; ``weights=None`` builds the same architecture randomly initialised. The BPE
vocabulary ships with open_clip, so tokenisation works offline.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from classifiers._base import (
    OpenVocabularyMixin,
    PretrainedClassifier,
    check_images,
    normalize,
    require,
    resize_shorter_center_crop,
)

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def build_clip(
    arch: str = "ViT-L-14", weights: str | os.PathLike[str] | None = None, quick_gelu: bool = True
) -> nn.Module:
    """An open_clip CLIP model: random init (``weights=None``) or loaded from a file.

    Args:
        arch: open_clip architecture name (``ViT-L-14``, ``ViT-B-32``, ...).
        weights: OpenAI TorchScript archive or open_clip state dict.
        quick_gelu: OpenAI CLIP was trained with QuickGELU; keep ``True`` for its weights.
    """
    open_clip = require("open_clip", extra="dev", pip_name="open-clip-torch")
    import logging

    # open_clip logs a warning for every randomly initialised model; that is our intent here
    logger = logging.getLogger()
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        model = open_clip.create_model(arch, pretrained=None, force_quick_gelu=quick_gelu)
    finally:
        logger.setLevel(level)
    if weights is not None:
        open_clip.load_checkpoint(model, str(weights), weights_only=False)
    return model.eval()


class CLIPZeroShotClassifier(OpenVocabularyMixin, PretrainedClassifier):
    """Zero-shot CLIP judge over a configurable label set.

    Args:
        labels: the label set (concept names; ``-``/``_`` read as spaces in prompts), or
            ``None`` for an open vocabulary: every concept asked about becomes a label (see
            :class:`~classifiers._base.OpenVocabularyMixin`); :meth:`set_labels` replaces it.
        extra_labels: distractor labels that are never concepts (``"an empty background"``).
        templates: prompt templates with ``{}`` for the label; their text embeddings are
            averaged (CLIP's prompt ensembling).
        weights: ``"clip_vit_l14_openai"`` / ``"clip_vit_b32_openai"``, a local file, or
            ``None`` (random init).
        arch: open_clip architecture matching ``weights``.
        threshold: minimum softmax probability of the top-1 label.
    """

    name = "clip_zero_shot"
    version = "1"
    default_weights = "clip_vit_l14_openai"

    def __init__(
        self,
        labels: Sequence[str] | None = None,
        extra_labels: Sequence[str] = (),
        templates: Sequence[str] = ("a photo of {}.",),
        weights: str | os.PathLike[str] | None = "clip_vit_l14_openai",
        arch: str = "ViT-L-14",
        threshold: float = 0.0,
        aliases: dict[str, str] | None = None,
        device: str = "cpu",
        batch_size: int = 16,
    ) -> None:
        super().__init__(weights, threshold, aliases, device, batch_size)
        self.arch = arch
        self.templates = tuple(templates)
        self.extra_labels = tuple(extra_labels)
        self._labels: tuple[str, ...] = ()
        self._text_features: torch.Tensor | None = None
        self.open_vocabulary = labels is None
        self.set_labels(labels or ())

    @property
    def labels(self) -> Sequence[str]:
        return (*self._labels, *self.extra_labels)

    def set_labels(self, labels: Sequence[str]) -> None:
        """Replace the label set (clears the cached text embeddings)."""
        self._labels = tuple(labels)
        self._text_features = None
        self._normalized_index = None

    def build_model(self) -> nn.Module:
        path: Path | None = None if self.resolved is None else self.resolved.path()
        return build_clip(self.arch, path)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        size = self.model.visual.image_size
        size = size[0] if isinstance(size, (tuple, list)) else int(size)
        x = resize_shorter_center_crop(images, size, mode="bicubic")
        return normalize(x, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)

    @torch.no_grad()
    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        """L2-normalised CLIP image embeddings ``(N, D)`` (the bias metric's CLIP similarity)."""
        images = check_images(images)
        model = self.model

        def run(batch: torch.Tensor) -> torch.Tensor:
            f = model.encode_image(self.preprocess(batch.to(self.device)))
            return f / f.norm(dim=-1, keepdim=True)

        outs = [run(images[i : i + self.batch_size]) for i in range(0, len(images), self.batch_size)]
        return torch.cat(outs).float().cpu() if outs else torch.zeros(0, 0)

    @torch.no_grad()
    def text_features(self) -> torch.Tensor:
        """L2-normalised, template-averaged text embeddings ``(L, D)`` of the labels."""
        if self._text_features is None:
            if not self.labels:
                raise ValueError("CLIPZeroShotClassifier has no labels; pass labels= or call set_labels()")
            import open_clip

            tokenizer = open_clip.get_tokenizer(self.arch)
            feats = []
            for label in self.labels:
                text = label.replace("_", " ").replace("-", " ")
                tokens = tokenizer([t.format(text) for t in self.templates]).to(self.device)
                f = self.model.encode_text(tokens)
                f = f / f.norm(dim=-1, keepdim=True)
                f = f.mean(dim=0)
                feats.append(f / f.norm())
            self._text_features = torch.stack(feats)
        return self._text_features

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        img = self.embed_images(images)
        if len(img) == 0:
            return torch.zeros(0, len(self.labels))
        txt = self.text_features().float().cpu()
        scale = self.model.logit_scale.exp().clamp(max=100).item()
        return (scale * img @ txt.T).softmax(dim=-1)

    def detect(self, probs: torch.Tensor, concept: str) -> torch.Tensor:
        idx = self.label_index(concept)
        return (probs.argmax(dim=1) == idx) & (probs[:, idx] >= self.threshold)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "arch": self.arch,
            "templates": list(self.templates),
            "labels": list(self.labels),
        }


def image_embedding(**kwargs: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """CLIP's L2-normalised image embedding as a function of images (``(N, 3, H, W)`` in
    [0, 1] -> ``(N, D)``): the bias metric's CLIP similarity, bound by
    ``metrics.bias.similarity.embedding``. ``kwargs`` go to :class:`CLIPZeroShotClassifier`
    (``arch``, ``weights``, ``device``, ...)."""
    return CLIPZeroShotClassifier(**kwargs).embed_images
