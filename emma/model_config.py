"""Schema of ``conf/model/*.yaml``, in a module without torch so that composing a config
(and serving a finished cell from the cache) does not import it."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class ModelConfig:
    """Schema of ``conf/model/*.yaml`` (a typo in a model file fails at compose time).

    Args:
        name: model alias (the file name).
        kind: ``diffusers`` (``from_pretrained``), ``tinyworld`` (shipped weights) or
            ``tiny_random`` (random init from configs).
        pretrained: hub id or local folder (``kind=diffusers``); ``null`` for the others.
        revision: hub revision (a commit hash pins the weights).
        variant: weight variant on the hub (``fp16``).
        pipeline_class: ``StableDiffusionPipeline`` or ``StableDiffusionXLPipeline``.
        dtype: ``float32``, ``float16`` or ``bfloat16``.
        device: ``cpu``, ``cuda``, ``cuda:1``, ...
        scheduler: scheduler class to swap in (``null`` keeps the checkpoint's).
        num_inference_steps / guidance_scale / height / width: sampling settings.
        batch_size: images per pipeline call.
        init_seed: seed of the random initialisation (``tiny_random``).
    """

    name: str = "model"
    kind: str = "diffusers"
    pretrained: Optional[str] = None
    revision: Optional[str] = None
    variant: Optional[str] = None
    pipeline_class: str = "StableDiffusionPipeline"
    dtype: str = "float32"
    device: str = "cpu"
    scheduler: Optional[str] = None
    num_inference_steps: int = 50
    guidance_scale: float = 7.5
    height: int = 512
    width: int = 512
    batch_size: int = 4
    init_seed: int = 0
    negative_prompt: Optional[str] = None


# The choices a model config may name (checked before any work, without importing torch).
PIPELINE_CLASSES = ("StableDiffusionPipeline", "StableDiffusionXLPipeline")
SCHEDULERS = (
    "PNDMScheduler",
    "DDIMScheduler",
    "DDPMScheduler",
    "EulerDiscreteScheduler",
    "EulerAncestralDiscreteScheduler",
    "DPMSolverMultistepScheduler",
    "LMSDiscreteScheduler",
)
DTYPE_NAMES = ("float32", "float16", "bfloat16")
