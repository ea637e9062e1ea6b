"""Inference-time guidance: how a method that edits no weight changes sampling.

Some erasure methods (SLD) leave every weight as it is and instead steer the sampler. Such a
method returns an :class:`InferenceGuidance` from
:meth:`emma.api.method.ErasureMethod.inference_guidance`; the generation stage
(:class:`emma.generate.CachedGenerator`) then draws every image with
:meth:`InferenceGuidance.sample` instead of calling the pipeline, keys its image cache on
:meth:`InferenceGuidance.config`, and the cell records the guidance in ``results.json``
(``versions.model.inference_guidance``). The pipeline is never subclassed or patched: the
guidance reads its components (tokenizer, text encoder, UNet, scheduler, VAE) and runs its
own denoising loop.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch


class InferenceGuidance(abc.ABC):
    """A sampling procedure that replaces the pipeline's own classifier-free guidance loop.

    Subclasses set ``name`` and ``version`` (bump on any change that moves images) and
    implement :meth:`sample`.
    """

    name: ClassVar[str] = "guidance"
    version: ClassVar[str] = "0"

    def config(self) -> dict[str, Any]:
        """Everything that determines the images besides model, prompt, seed and sampler."""
        return {"name": self.name, "version": self.version}

    @abc.abstractmethod
    def sample(
        self,
        pipe: Any,
        *,
        prompt: list[str] | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt: list[str] | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        generator: list[torch.Generator],
        num_inference_steps: int,
        guidance_scale: float,
        height: int,
        width: int,
    ) -> torch.Tensor:
        """Images ``(N, 3, height, width)`` in [0, 1] (what ``pipe(..., output_type="pt")`` returns).

        Args:
            pipe: the (erased) diffusers pipeline whose components are used.
            prompt / prompt_embeds: N prompts, or their ``(N, L, D)`` text-encoder outputs.
            negative_prompt / negative_prompt_embeds: the unconditional side (default ``""``).
            generator: one CPU generator per image.
            num_inference_steps / guidance_scale / height / width: diffusers' meanings.
        """
