"""The tiny-world judge: a small CNN that predicts shape, colour and style of a scene.

Trained by ``scripts/train_tinyworld.py`` on procedural renders (and on their
reconstructions through the tiny world's VAE, so that it judges decoded images as it judges
renders). Its weights ship in ``emma/tinyworld/assets/classifier.safetensors``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from emma.api.classifier import Classifier
from emma.errors import WeightsUnavailableError
from emma.tinyworld.world import COLOURS, IMAGE_SIZE, SHAPES, STYLES

HEADS: dict[str, tuple[str, ...]] = {
    "shape": SHAPES,
    "colour": tuple(COLOURS),
    "style": STYLES,
}
ASSET_DIR = Path(__file__).resolve().parent.parent / "emma" / "tinyworld" / "assets"
DEFAULT_WEIGHTS = ASSET_DIR / "classifier.safetensors"


class TinyWorldNet(nn.Module):
    """~0.14M-parameter CNN with one linear head per attribute."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
                nn.Conv2d(cout, cout, 3, padding=1),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
            )

        self.features = nn.Sequential(
            block(3, width),
            nn.MaxPool2d(2),
            block(width, width * 2),
            nn.MaxPool2d(2),
            block(width * 2, width * 2),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.heads = nn.ModuleDict({k: nn.Linear(width * 2, len(v)) for k, v in HEADS.items()})

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Penultimate features (used as the tiny world's FID feature space)."""
        x = images * 2.0 - 1.0
        if x.shape[-1] != IMAGE_SIZE or x.shape[-2] != IMAGE_SIZE:
            x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", antialias=True)
        return self.features(x)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(images)
        return {k: head(h) for k, head in self.heads.items()}


class TinyWorldClassifier(Classifier):
    """Shape / colour / style judge of the tiny world.

    ``predict`` returns per-head softmax probabilities, concatenated in the order of
    ``labels`` (shapes, then colours, then styles). A concept is detected when its label is
    the head's top-1 and its probability is at least ``threshold``.

    Args:
        weights: ``"shipped"`` (the package's weights), a path of a ``safetensors`` state
            dict, or ``None`` for random weights (plumbing only).
        threshold: minimum probability of the top-1 label.
        device: torch device for inference.
        batch_size: images per forward pass.
    """

    name = "tinyworld"
    version = "1"
    has_features = True  # the tiny world's FID and bias similarity are computed in these

    def __init__(
        self,
        weights: str | Path | None = "shipped",
        threshold: float = 0.5,
        device: str = "cpu",
        batch_size: int = 256,
        aliases: dict[str, str] | None = None,
    ) -> None:
        super().__init__(threshold=threshold, aliases=aliases)
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        # random weights (weights=None) are seeded: their scores are cached under "random",
        # which must name one network, not whichever one this process happened to draw
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.net = TinyWorldNet()
        self._weights_hash: str | None = None
        if weights is not None:
            path = DEFAULT_WEIGHTS if str(weights) == "shipped" else Path(weights)
            if not path.exists():
                raise WeightsUnavailableError(
                    f"tiny-world classifier weights not found at {path}. They ship with the "
                    "package; rebuild them with `python scripts/train_tinyworld.py`, or pass "
                    "classifier.weights=null for random weights (plumbing only)."
                )
            from safetensors.torch import load_file

            self.net.load_state_dict(load_file(str(path)))
            self._weights_hash = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        self.net.to(self.device).eval()
        self._offsets: dict[str, int] = {}
        off = 0
        for head, labels in HEADS.items():
            self._offsets[head] = off
            off += len(labels)

    @property
    def labels(self) -> Sequence[str]:
        return [lab for labels in HEADS.values() for lab in labels]

    @property
    def is_random(self) -> bool:
        return self._weights_hash is None

    def weights_hash(self) -> str | None:
        return self._weights_hash

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        out = []
        for i in range(0, len(images), self.batch_size):
            logits = self.net(images[i : i + self.batch_size].to(self.device, torch.float32))
            out.append(torch.cat([logits[h].softmax(-1) for h in HEADS], dim=1).cpu())
        if not out:
            return torch.zeros(0, len(self.labels))
        return torch.cat(out)

    @torch.no_grad()
    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Penultimate-layer features ``(N, 64)``."""
        out = [
            self.net.embed(images[i : i + self.batch_size].to(self.device, torch.float32)).cpu()
            for i in range(0, len(images), self.batch_size)
        ]
        return torch.cat(out) if out else torch.zeros(0, 64)

    def head_of(self, concept: str) -> str:
        idx = self.label_index(concept)
        for head in reversed(list(HEADS)):
            if idx >= self._offsets[head]:
                return head
        raise AssertionError("unreachable")

    def detect(self, probs: torch.Tensor, concept: str) -> torch.Tensor:
        idx = self.label_index(concept)
        head = self.head_of(concept)
        lo = self._offsets[head]
        block = probs[:, lo : lo + len(HEADS[head])]
        top = block.argmax(dim=1) + lo
        return (top == idx) & (probs[:, idx] >= self.threshold)
