"""Erasure methods for tests of the erased-model cache: small, deterministic edits whose
effect on the weights is known."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from emma.api.domain import Domain
from emma.api.method import ErasureMethod


class Shift(ErasureMethod):
    """Adds 0.5 to the UNet's output bias: a known change to one tensor, instantly."""

    name = "shift"
    version = "1"

    def erase(self, pipe: Any, concepts: Sequence[str], *, seed: int = 0, domain: Domain | None = None) -> Any:
        with torch.no_grad():
            pipe.unet.conv_out.bias.add_(0.5)
        return pipe
