"""ML-Decoder on TResNet-L: the object judge of EMMA (80 MS-COCO classes, multi-label).

Architecture (Ridnik et al., "ML-Decoder: Scalable and Versatile Classification Head"):
the TResNet-L backbone of the ML-Decoder model zoo (layers 3-4-23-3, bottleneck blocks
throughout, i.e. timm's ``tresnet_v2_l``) produces a 14x14x2048 map at 448 px; the ML-Decoder
head projects it to 768-d tokens, lets 80 fixed queries cross-attend to them in one
transformer-decoder layer, and maps each query to a logit with a group fully-connected layer.
Sigmoid scores; EMMA counts a class as present when it is among the top 20 scores and its
score exceeds 0.75.

Checkpoint format: the model-zoo ``.pth`` is ``torch.save({"model": state_dict,
"idx_to_class": {...}, ...})`` with InPlaceABN layers; :func:`convert_ml_decoder_state_dict`
maps it onto this module (timm's TResNet converter for the backbone, which also folds
InPlaceABN's ``|w| + eps`` into BatchNorm weights; the head's keys are kept verbatim).
Preprocessing follows the reference ``infer.py``: resize to 448x448, scale to [0, 1], no
mean/std normalisation.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from classifiers._base import DATA_DIR, PretrainedClassifier, check_images, load_torch_checkpoint, resize

#: COCO-2017 category names in category-id order (the order of the model zoo's idx_to_class)
COCO_LABELS: tuple[str, ...] = tuple(
    line.strip()
    for line in (DATA_DIR / "ml_decoder_coco_labels.txt").read_text().splitlines()
    if line.strip()
)


class MLDecoderLayer(nn.Module):
    """The single decoder layer of ML-Decoder (no self-attention among the queries).

    Parameter names match the reference implementation so checkpoints load verbatim.
    """

    def __init__(
        self, d_model: int = 768, nhead: int = 8, dim_feedforward: int = 2048, dropout: float = 0.1
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)
        self.multihead_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)

    def forward(self, tgt: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        # the reference adds the (dropped-out) queries to themselves before the first norm
        tgt = self.norm1(tgt + self.dropout1(tgt))
        attended = self.multihead_attn(tgt, memory, memory, need_weights=False)[0]
        tgt = self.norm2(tgt + self.dropout2(attended))
        ff = self.linear2(self.dropout(F.relu(self.linear1(tgt))))
        return self.norm3(tgt + self.dropout3(ff))


class _MLDecoderStack(nn.Module):
    def __init__(
        self, num_classes: int, num_queries: int, d_model: int, in_features: int, num_layers: int = 1
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLDecoderLayer(d_model) for _ in range(num_layers))
        self.embed_standart = nn.Linear(in_features, d_model)  # (sic) reference spelling
        self.query_embed = nn.Embedding(num_queries, d_model)
        self.query_embed.requires_grad_(False)
        self.num_classes = num_classes
        self.duplicate_factor = int(num_classes / num_queries + 0.999)
        self.duplicate_pooling = nn.Parameter(torch.empty(num_queries, d_model, self.duplicate_factor))
        self.duplicate_pooling_bias = nn.Parameter(torch.zeros(num_classes))
        nn.init.xavier_normal_(self.duplicate_pooling)


class MLDecoderHead(nn.Module):
    """ML-Decoder classification head over a ``(B, C, H, W)`` feature map.

    Args:
        num_classes: output logits.
        in_features: channels of the backbone's feature map (2048 for TResNet-L).
        num_of_groups: number of queries; ``-1`` = ``min(100, num_classes)`` (the COCO model
            therefore has 80 queries, one per class).
        decoder_embedding: token width (768).
    """

    def __init__(
        self, num_classes: int, in_features: int = 2048, num_of_groups: int = -1, decoder_embedding: int = 768
    ) -> None:
        super().__init__()
        num_queries = 100 if num_of_groups < 0 else num_of_groups
        num_queries = min(num_queries, num_classes)
        self.decoder = _MLDecoderStack(num_classes, num_queries, decoder_embedding, in_features)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        d = self.decoder
        tokens = features.flatten(2).transpose(1, 2) if features.ndim == 4 else features  # (B, HW, C)
        memory = F.relu(d.embed_standart(tokens)).transpose(0, 1)  # (HW, B, D)
        h = d.query_embed.weight.unsqueeze(1).expand(-1, tokens.shape[0], -1)  # (Q, B, D)
        for layer in d.layers:
            h = layer(h, memory)
        h = h.transpose(0, 1)  # (B, Q, D)
        # group fully-connected: query i owns `duplicate_factor` consecutive classes
        out = torch.einsum("bqd,qdk->bqk", h, d.duplicate_pooling)
        return out.flatten(1)[:, : d.num_classes] + d.duplicate_pooling_bias


class TResNetMLDecoder(nn.Module):
    """TResNet backbone (timm; its ``body`` holds the reference layer names) + ML-Decoder head."""

    def __init__(self, backbone: nn.Module, head: MLDecoderHead) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone.forward_features(images))


def ml_decoder_tresnet_l(
    num_classes: int = 80, num_of_groups: int = -1, decoder_embedding: int = 768
) -> TResNetMLDecoder:
    """Randomly initialised TResNet-L + ML-Decoder, the architecture of the COCO model zoo entry."""
    import timm

    backbone = timm.create_model("tresnet_v2_l", pretrained=False, num_classes=0, global_pool="")
    head = MLDecoderHead(num_classes, backbone.num_features, num_of_groups, decoder_embedding)
    return TResNetMLDecoder(backbone, head)


def convert_ml_decoder_state_dict(
    state: Mapping[str, Any], model: TResNetMLDecoder
) -> dict[str, torch.Tensor]:
    """Model-zoo checkpoint (``{"model": ...}`` or a bare state dict) -> ``model.state_dict()`` keys."""
    from timm.models.tresnet import checkpoint_filter_fn

    sd = state.get("model", state.get("state_dict", state))  # type: ignore[union-attr]
    sd = {k[7:] if k.startswith("module.") else k: v for k, v in sd.items()}
    body = {k[len("body.") :]: v for k, v in sd.items() if k.startswith("body.")}
    head = {k: v for k, v in sd.items() if k.startswith("head.")}
    # timm's converter expects the original TResNet naming with the "body." prefix
    body = checkpoint_filter_fn({f"body.{k}": v for k, v in body.items()}, model.backbone)
    out = {f"backbone.{k}": v for k, v in body.items()}
    out.update(head)
    own = model.state_dict()
    for k, v in own.items():  # InPlaceABN keeps no batch counter; BatchNorm wants one
        if k.endswith("num_batches_tracked") and k not in out:
            out[k] = v
    return out


class MLDecoderClassifier(PretrainedClassifier):
    """ML-Decoder (TResNet-L, MS-COCO, 448 px): EMMA's object and NSFW-object judge.

    ``predict`` returns sigmoid scores over the 80 COCO classes. A concept is detected when
    its score is ``> threshold`` (0.75) and among the ``top_k`` (20) highest scores, exactly
    the reference rule. Concept names are matched spelling-insensitively, so the EMMA object
    keys (``baseballbat``, ``diningtable``, ``tv``) find their labels.

    Args:
        weights: ``"ml_decoder_tresnet_l_coco"``, a local ``.pth``, or ``None`` (random).
        threshold: score threshold (EMMA: 0.75).
        top_k: only the ``top_k`` highest scores can count (reference: 20).
        image_size: input resolution (448 for the COCO model).
    """

    name = "ml_decoder"
    version = "1"
    default_weights = "ml_decoder_tresnet_l_coco"

    def __init__(
        self,
        weights: str | os.PathLike[str] | None = "ml_decoder_tresnet_l_coco",
        threshold: float = 0.75,
        top_k: int = 20,
        image_size: int = 448,
        aliases: dict[str, str] | None = None,
        device: str = "cpu",
        batch_size: int = 8,
    ) -> None:
        super().__init__(weights, threshold, aliases, device, batch_size)
        self.top_k = int(top_k)
        self.image_size = int(image_size)
        self._labels: tuple[str, ...] = COCO_LABELS

    @property
    def labels(self) -> Sequence[str]:
        if self.resolved is not None and self._model is None:
            self.model  # noqa: B018 - the checkpoint carries the authoritative label order
        return self._labels

    def build_model(self) -> nn.Module:
        model = ml_decoder_tresnet_l(num_classes=len(COCO_LABELS))
        if self.resolved is not None:
            state = load_torch_checkpoint(self.resolved.path(), self.resolved)
            model.load_state_dict(convert_ml_decoder_state_dict(state, model), strict=True)
            idx_to_class = state.get("idx_to_class") if isinstance(state, Mapping) else None
            if idx_to_class:
                names = tuple(str(idx_to_class[k]) for k in sorted(idx_to_class, key=int))
                if names != COCO_LABELS:
                    warnings.warn(
                        "checkpoint's idx_to_class differs from the shipped COCO list; "
                        "using the checkpoint's order",
                        stacklevel=2,
                    )
                    self._labels = names
                    self._normalized_index = None
        return model

    def predict(self, images: torch.Tensor) -> torch.Tensor:
        images = check_images(images)
        model = self.model

        def run(batch: torch.Tensor) -> torch.Tensor:
            x = resize(batch.to(self.device), self.image_size, mode="bicubic")
            return torch.sigmoid(model(x))

        return self._batched(run, images)

    def detect(self, probs: torch.Tensor, concept: str) -> torch.Tensor:
        idx = self.label_index(concept)
        k = min(self.top_k, probs.shape[1])
        in_top = (probs.topk(k, dim=1).indices == idx).any(dim=1)
        return in_top & (probs[:, idx] > self.threshold)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "top_k": self.top_k, "image_size": self.image_size}
