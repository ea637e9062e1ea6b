"""Schema of ``conf/model/*.yaml``, in a module without torch so that composing a config
(and serving a finished cell from the cache) does not import it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection
from pathlib import Path
from typing import Optional

from emma.errors import WeightsUnavailableError


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


#: what ``from_pretrained`` is given directly for a pipeline class, so its folder needs no
#: subfolder for it (emma.pipelines passes no safety checker to Stable Diffusion)
PASSED_COMPONENTS = {"StableDiffusionPipeline": ("safety_checker", "requires_safety_checker")}


def check_local_pretrained(pretrained: object, pipeline_class: object) -> None:
    """For a ``model.pretrained`` that names a place on this machine
    (:func:`emma.weights.looks_like_path`): refuse it unless it is a diffusers pipeline folder
    (:func:`check_pipeline_folder`). A hub id passes (it is fetched, or told how, when loaded).
    Checked before any work (emma.validate) and again when the pipeline loads."""
    from emma.weights import looks_like_path

    if not isinstance(pretrained, str) or not pretrained.strip() or not looks_like_path(pretrained):
        return
    check_pipeline_folder(str(Path(pretrained).expanduser()), skip=PASSED_COMPONENTS.get(str(pipeline_class), ()))


PIPELINE_FOLDER = ("a diffusers pipeline folder holds model_index.json (a JSON object naming the pipeline's "
                   "`_class_name` and its components) and a subfolder per component (unet/, vae/, ...)")


def check_pipeline_folder(pretrained: str, skip: Collection[str] = ()) -> None:
    """Refuse a local ``model.pretrained`` that cannot be a diffusers pipeline folder with one
    line naming it and what such a folder holds (diffusers answers a missing path with a hub
    lookup and a model_index.json without ``_class_name`` with a bare ``KeyError``).
    Components in ``skip`` are passed to ``from_pretrained`` and need no subfolder."""
    folder = Path(pretrained)
    if not folder.exists():
        raise WeightsUnavailableError(
            f"model.pretrained {pretrained!r} looks like a local path but does not exist "
            f"({folder.absolute()}); give an existing pipeline folder or a hub id (org/name)")
    if not folder.is_dir():
        raise WeightsUnavailableError(
            f"model.pretrained {pretrained!r} is a file, not a folder; {PIPELINE_FOLDER}")
    index = folder / "model_index.json"
    try:
        spec = json.loads(index.read_text())
    except FileNotFoundError:
        problem = "it has no model_index.json"
    except (OSError, UnicodeDecodeError, ValueError) as err:
        problem = f"its model_index.json is not valid JSON ({type(err).__name__})"
    else:
        if not isinstance(spec, dict):
            problem = f"its model_index.json holds a {type(spec).__name__}, not an object"
        elif not spec.get("_class_name"):
            problem = "its model_index.json has no `_class_name`"
        else:
            missing = sorted(
                name for name, value in spec.items()
                if not name.startswith("_") and name not in skip and isinstance(value, list)
                and len(value) == 2 and value[0] is not None and not (folder / name).is_dir()
            )
            if not missing:
                return
            problem = f"it lacks the subfolder{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    raise WeightsUnavailableError(
        f"model.pretrained folder {pretrained!r} is not a diffusers pipeline folder: {problem}; {PIPELINE_FOLDER}")
