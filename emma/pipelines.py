"""Loading base and erased text-to-image pipelines.

Real checkpoints (SD v1.4, SD 2.1, SDXL) load through diffusers' ``from_pretrained``; when
they cannot be reached (offline, ``HF_HUB_OFFLINE=1``, no local copy) the loader raises a
:class:`~emma.errors.WeightsUnavailableError` that says what to download and where to
point ``model.pretrained``. ``model=tinyworld`` loads the pipeline that ships with the
package; ``model=tiny_random`` builds a randomly initialised SD-architecture pipeline from
configs (diffusers' test sizes) for plumbing tests.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from emma.errors import ConfigError, UnknownChoiceError, WeightsUnavailableError
from emma.model_config import (  # noqa: F401  (re-exported)
    DTYPE_NAMES,
    PIPELINE_CLASSES,
    SCHEDULERS,
    ModelConfig,  # noqa: F401  (re-exported: the schema of conf/model)
)
from emma.model_config import check_pipeline_folder as _check_pipeline_folder
from emma.weights import looks_like_path

TINYWORLD_DIR = Path(__file__).resolve().parent / "tinyworld" / "assets" / "pipeline"

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def load_pipeline(cfg: Any) -> Any:
    """Build the pipeline described by a model config (see :class:`ModelConfig`)."""
    kind = _get(cfg, "kind", "diffusers")
    dtype_name = _get(cfg, "dtype", "float32")
    if dtype_name not in DTYPES:
        raise UnknownChoiceError("model.dtype", dtype_name, DTYPES)
    dtype = DTYPES[dtype_name]
    device = _get(cfg, "device", "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"model.device={device} but no CUDA device is available; use model.device=cpu")
    if kind == "tiny_random":
        pipe = tiny_random_pipeline(seed=int(_get(cfg, "init_seed", 0)))
    elif kind == "tinyworld":
        pipe = _from_pretrained(
            "StableDiffusionPipeline", str(_get(cfg, "pretrained") or TINYWORLD_DIR), None, None,
            dtype, local_only=True,
        )
    elif kind == "diffusers":
        pretrained = _get(cfg, "pretrained")
        if not pretrained:
            raise ConfigError("model.kind=diffusers needs model.pretrained (a hub id or a folder)")
        pipe = _from_pretrained(
            _get(cfg, "pipeline_class", "StableDiffusionPipeline"), str(pretrained),
            _get(cfg, "revision"), _get(cfg, "variant"), dtype,
        )
    else:
        raise UnknownChoiceError("model.kind", kind, ("diffusers", "tinyworld", "tiny_random"))
    scheduler = _get(cfg, "scheduler")
    if scheduler:
        pipe.scheduler = make_scheduler(scheduler, pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    # Pretrained pipelines are loaded in their dtype already; only the tiny random one, built
    # in float32 from configs, is cast (module by module: diffusers' own .to(dtype) warns about
    # fp32-kept modules, which these configs have none of).
    if kind == "tiny_random" and dtype != torch.float32:
        for module in pipe.components.values():
            if isinstance(module, torch.nn.Module):
                torch.nn.Module.to(module, dtype=dtype)
    return freeze(pipe.to(device))


def freeze(pipe: Any) -> Any:
    """Every weight of ``pipe`` without gradients: diffusers loads modules trainable, and a
    backward pass through them (an attack's, a method's) would otherwise keep a gradient for
    every weight. Methods thaw what they train (``emma.methods._common.train_only``)."""
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.requires_grad_(False)
    return pipe


def make_scheduler(name: str, config: Any) -> Any:
    """Swap schedulers the diffusers way: ``X.from_config(pipe.scheduler.config)``."""
    import diffusers

    if name not in SCHEDULERS:
        raise UnknownChoiceError("model.scheduler", name, SCHEDULERS)
    return getattr(diffusers, name).from_config(config)


def _from_pretrained(
    class_name: str, pretrained: str, revision: str | None, variant: str | None,
    dtype: torch.dtype, local_only: bool = False,
) -> Any:
    import diffusers

    if class_name not in PIPELINE_CLASSES:
        raise UnknownChoiceError("model.pipeline_class", class_name, PIPELINE_CLASSES)
    cls = getattr(diffusers, class_name)
    offline = local_only or os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    kwargs: dict[str, Any] = dict(dtype=dtype, local_files_only=offline)
    if revision:
        kwargs["revision"] = revision
    if variant:
        kwargs["variant"] = variant
    if class_name == "StableDiffusionPipeline":
        # The harness judges images itself; SD's safety checker would blank NSFW outputs.
        kwargs.update(safety_checker=None, requires_safety_checker=False)
    local = looks_like_path(pretrained)
    if local:
        pretrained = os.path.expanduser(pretrained)
        _check_pipeline_folder(pretrained, skip=set(kwargs))
    try:
        return cls.from_pretrained(pretrained, **kwargs)
    except (OSError, ValueError) as err:
        cause = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        if local:
            raise WeightsUnavailableError(
                f"cannot load {class_name} from folder {pretrained!r}: {cause}"
            ) from None
        raise WeightsUnavailableError(
            f"cannot load {class_name} weights {pretrained!r}"
            f"{f' @ {revision}' if revision else ''} from the Hugging Face Hub"
            f"{' (offline: HF_HUB_OFFLINE is set)' if offline and not local_only else ''}.\n"
            f"  Download it where the Hub is reachable, e.g. "
            f"`huggingface-cli download {pretrained}"
            f"{f' --revision {revision}' if revision else ''} --local-dir /path/to/{Path(pretrained).name}`,\n"
            f"  then run with model.pretrained=/path/to/{Path(pretrained).name}.\n"
            f"  Cause: {cause}"
        ) from None


def tiny_random_pipeline(seed: int = 0) -> Any:
    """A randomly initialised SD pipeline at diffusers' test sizes, built offline."""
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from emma.tinyworld import arch
    from emma.tinyworld.tokenizer import local_clip_tokenizer

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**arch.TINY_RANDOM_UNET)
    torch.manual_seed(seed)
    vae = AutoencoderKL(**arch.TINY_RANDOM_VAE)
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(**arch.TINY_RANDOM_TEXT_ENCODER))
    return StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=local_clip_tokenizer(),
        scheduler=PNDMScheduler(**arch.SCHEDULER_CONFIG), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )


COMPONENTS = ("unet", "text_encoder", "text_encoder_2", "vae")


def fingerprint(pipe: Any, components: tuple[str, ...] = COMPONENTS) -> str:
    """sha256 over the weights (names, dtypes, shapes, bytes) of the pipeline's networks.

    Two pipelines with the same fingerprint draw the same images for the same sampler
    settings, so generated images are cached under it.
    """
    h = hashlib.sha256()
    for comp in components:
        module = getattr(pipe, comp, None)
        if module is None:
            continue
        h.update(comp.encode())
        for name, t in sorted(module.state_dict().items()):
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
