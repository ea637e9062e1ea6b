"""``method=checkpoint``: load weights that were erased elsewhere.

Accepted sources:

- a diffusers pipeline folder (``unet/``, ``text_encoder/`` subfolders) or a single
  component folder (``config.json`` + ``diffusion_pytorch_model.safetensors`` /
  ``model.safetensors`` / ``*.bin``, sharded or not) — every key must be present;
- a single ``.safetensors`` / ``.pt`` / ``.ckpt`` / ``.bin`` state dict as the original
  repositories save them: diffusers UNet names (ESD's and UCE's ``.safetensors`` of the
  edited layers only; UCE's full ``unet.state_dict()`` ``.pt``), optionally prefixed with
  ``unet.`` / ``text_encoder.``, or the CompVis/LDM layout
  (``model.diffusion_model.*``, ``cond_stage_model.transformer.*``: ESD's original ``.pt``,
  CA's cross-attention deltas), mapped to diffusers names for the pipeline's UNet
  configuration. A partial state dict replaces only the weights it holds.

Everything is read and checked (unknown keys, shapes) before anything is written, so a
mismatch raises :class:`IncompatibleCheckpointError` and leaves the pipeline untouched.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from emma.api.domain import Domain
from emma.api.method import ErasureMethod
from emma.config import to_python
from emma.errors import ConfigError, EmmaError, UnknownChoiceError, WeightsUnavailableError

COMPONENTS = ("unet", "text_encoder")
KEY_MAPPINGS = ("auto", "diffusers", "ldm")
LDM_UNET_PREFIX = "model.diffusion_model."
LDM_TEXT_PREFIX = "cond_stage_model.transformer."
# Keys of full LDM checkpoints that are not UNet/text-encoder weights (VAE, EMA copy,
# schedule buffers): skipped, not errors.
LDM_IGNORED = re.compile(r"^(first_stage_model\.|model_ema\.|cond_stage_model\.|betas$|alphas_cumprod|"
                         r"alphas_cumprod_prev$|sqrt_|log_one_minus|posterior_|logvar$|lvlb_weights$)")
WEIGHT_FILES = {
    "unet": ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin"),
    "text_encoder": ("model.safetensors", "pytorch_model.bin"),
}
SUFFIXES = (".safetensors", ".pt", ".pth", ".ckpt", ".bin")


class IncompatibleCheckpointError(EmmaError):
    """Checkpoint keys or shapes that do not fit the pipeline's components."""


# --------------------------------------------------------------------------- key mapping
_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
           "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}


def diffusers_to_ldm_unet_key(key: str, unet_config: Any) -> str | None:
    """The CompVis/LDM name (without ``model.diffusion_model.``) of a diffusers UNet key, for
    SD-style UNets (``layers_per_block`` resnets per down block, one more per up block)."""
    lpb = unet_config["layers_per_block"] if isinstance(unet_config, dict) else unet_config.layers_per_block
    if not isinstance(lpb, int):
        return None
    up_types = unet_config["up_block_types"] if isinstance(unet_config, dict) else unet_config.up_block_types
    per = lpb + 1

    def resnet(rest: str) -> str:
        head, _, tail = rest.partition(".")
        return f"{_RESNET.get(head, head)}.{tail}"

    fixed = {"time_embedding.linear_1.": "time_embed.0.", "time_embedding.linear_2.": "time_embed.2.",
             "conv_in.": "input_blocks.0.0.", "conv_norm_out.": "out.0.", "conv_out.": "out.2."}
    for src, dst in fixed.items():
        if key.startswith(src):
            return dst + key[len(src):]
    m = re.match(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", key)
    if m:
        i, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
        blk = 1 + i * per + j
        if kind == "resnets":
            return f"input_blocks.{blk}.0.{resnet(rest)}"
        return f"input_blocks.{blk}.1.{rest}"
    m = re.match(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", key)
    if m:
        return f"input_blocks.{(int(m[1]) + 1) * per}.0.op.{m[2]}"
    m = re.match(r"mid_block\.(resnets|attentions)\.(\d+)\.(.*)", key)
    if m:
        kind, j, rest = m[1], int(m[2]), m[3]
        return f"middle_block.{2 * j}.{resnet(rest)}" if kind == "resnets" else f"middle_block.1.{rest}"
    m = re.match(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", key)
    if m:
        i, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
        blk = i * per + j
        if kind == "resnets":
            return f"output_blocks.{blk}.0.{resnet(rest)}"
        return f"output_blocks.{blk}.1.{rest}"
    m = re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)", key)
    if m:
        i = int(m[1])
        slot = 2 if "CrossAttn" in up_types[i] else 1
        return f"output_blocks.{i * per + lpb}.{slot}.conv.{m[2]}"
    return None


def ldm_to_diffusers_unet_keys(unet: Any) -> dict[str, str]:
    """``{ldm key: diffusers key}`` for every weight of ``unet``."""
    out = {}
    for k in unet.state_dict():
        ldm = diffusers_to_ldm_unet_key(k, unet.config)
        if ldm is not None:
            out[ldm] = k
    return out


# --------------------------------------------------------------------------- reading
def _load_file(path: Path, weights_only: bool) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=weights_only)
    except Exception as err:  # noqa: BLE001 - unpickling errors have many types
        hint = (" It may hold non-tensor objects (e.g. a Lightning checkpoint); if you trust the file, "
                "set method.weights_only=false." if weights_only else "")
        raise IncompatibleCheckpointError(f"cannot read {path}: {type(err).__name__}: {err}.{hint}") from None
    for wrapper in ("state_dict", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(wrapper), dict):
            obj = obj[wrapper]
    if not isinstance(obj, dict):
        raise IncompatibleCheckpointError(f"{path} does not hold a state dict (got {type(obj).__name__})")
    return {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}


def _component_files(folder: Path, component: str) -> list[Path]:
    for name in WEIGHT_FILES[component]:
        if (folder / name).exists():
            return [folder / name]
        index = folder / f"{name}.index.json"
        if index.exists():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [folder / s for s in shards]
    return []


def _folder_component(folder: Path) -> str | None:
    cfg = folder / "config.json"
    if not cfg.exists():
        return None
    conf = json.loads(cfg.read_text())
    if conf.get("_class_name", "").startswith("UNet"):
        return "unet"
    if any("CLIPText" in a for a in conf.get("architectures", [])):
        return "text_encoder"
    return None


# transformers < 5 names CLIP text weights "text_model.*"; 5.x drops the prefix.
TEXT_PREFIXES = ("text_encoder.", "text_model.", LDM_TEXT_PREFIX, "embeddings.", "encoder.layers.",
                 "final_layer_norm.")


def _owner(key: str) -> str:
    """The component a single-file key belongs to (prefixed, LDM or bare diffusers names)."""
    return "text_encoder" if key.startswith(TEXT_PREFIXES) else "unet"


def _strip(key: str) -> str:
    for prefix in ("unet.", "text_encoder."):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def _match_text_prefix(sd: dict[str, torch.Tensor], expected: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Add or drop the ``text_model.`` prefix so the names match this transformers version."""
    out = {}
    for k, v in sd.items():
        if k not in expected and k.startswith("text_model.") and k[len("text_model."):] in expected:
            k = k[len("text_model."):]
        elif k not in expected and f"text_model.{k}" in expected:
            k = f"text_model.{k}"
        out[k] = v
    return out


class CheckpointMethod(ErasureMethod):
    """Load externally erased weights into the pipeline's UNet / text encoder.

    Args:
        path: a diffusers folder, a component folder, or a state-dict file.
        components: components to load (``unet``, ``text_encoder``); ``None`` -> those the
            source holds.
        key_mapping: ``auto`` (detect), ``diffusers`` or ``ldm`` (CompVis names).
        weights_only: read ``.pt``/``.ckpt`` with ``torch.load(weights_only=True)`` (safe);
            ``False`` unpickles arbitrary objects — only for files you trust.
    """

    name = "checkpoint"
    version = "1"
    edited_components: tuple[str, ...] = ("unet",)

    def __init__(self, path: str, components: Sequence[str] | None = None, key_mapping: str = "auto",
                 weights_only: bool = True) -> None:
        if not path:
            raise ConfigError("method=checkpoint needs method.path (a diffusers folder or a state-dict file)")
        if key_mapping not in KEY_MAPPINGS:
            raise UnknownChoiceError("checkpoint key_mapping", key_mapping, KEY_MAPPINGS)
        components = to_python(components)
        if components is not None:
            components = [components] if isinstance(components, str) else list(components)
            for c in components:
                if c not in COMPONENTS:
                    raise UnknownChoiceError("checkpoint component", c, COMPONENTS)
        src = Path(path).expanduser()
        if not src.exists():
            raise WeightsUnavailableError(f"checkpoint {src} does not exist; set method.path to an erased "
                                          "model folder or state-dict file")
        if src.is_file() and src.suffix not in SUFFIXES:
            raise ConfigError(f"checkpoint file {src.name} has an unknown suffix; "
                              f"valid: {', '.join(SUFFIXES)}")
        super().__init__(path=str(src), components=components, key_mapping=key_mapping,
                         weights_only=bool(weights_only))
        self._path = src
        self._state: dict[str, dict[str, torch.Tensor]] | None = None
        self._sha: str | None = None
        self.edited_components = tuple(components) if components else self._detect_components()

    # ------------------------------------------------------------------ identity
    def config(self) -> dict[str, Any]:
        """Hyper-parameters plus the sha256 of the checkpoint's bytes (the erased-model cache key)."""
        return {**super().config(), "source_sha256": self.source_sha256()}

    def source_sha256(self) -> str:
        if self._sha is None:
            h = hashlib.sha256()
            if self._path.is_dir():
                files = sorted(p for p in self._path.rglob("*") if p.is_file())
            else:
                files = [self._path]
            for p in files:
                h.update(str(p.relative_to(self._path) if self._path.is_dir() else p.name).encode())
                with open(p, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 24), b""):
                        h.update(chunk)
            self._sha = h.hexdigest()
        return self._sha

    # ------------------------------------------------------------------ reading
    def _detect_components(self) -> tuple[str, ...]:
        if self._path.is_dir():
            comp = _folder_component(self._path)
            if comp:
                return (comp,)
            found = tuple(c for c in COMPONENTS if (self._path / c).is_dir())
            if not found:
                raise IncompatibleCheckpointError(
                    f"{self._path} is neither a diffusers pipeline folder (unet/, text_encoder/) nor a "
                    "component folder (config.json + weights)")
            return found
        keys = list(self._raw())
        found = [c for c in COMPONENTS if any(_owner(k) == c for k in keys)]
        return tuple(found) or ("unet",)

    def _raw(self) -> dict[str, torch.Tensor]:
        if not hasattr(self, "_raw_cache"):
            self._raw_cache = _load_file(self._path, self.hparams["weights_only"])
        return self._raw_cache

    def _read(self, pipe: Any) -> dict[str, dict[str, torch.Tensor]]:
        """``{component: {diffusers key: tensor}}``, every key and shape checked."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for comp in self.edited_components:
            module = getattr(pipe, comp, None)
            if module is None:
                raise IncompatibleCheckpointError(f"the pipeline has no {comp} to load the checkpoint into")
        if self._path.is_dir():
            for comp in self.edited_components:
                folder = self._path if _folder_component(self._path) == comp else self._path / comp
                files = _component_files(folder, comp)
                if not files:
                    raise IncompatibleCheckpointError(
                        f"{folder} has no {' or '.join(WEIGHT_FILES[comp])} for component {comp}")
                sd: dict[str, torch.Tensor] = {}
                for f in files:
                    sd.update(_load_file(f, self.hparams["weights_only"]))
                out[comp] = self._check(getattr(pipe, comp), comp, sd, full=True)
            return out
        raw = self._raw()
        mapping = self.hparams["key_mapping"]
        if mapping == "auto":
            is_ldm = any(k.startswith((LDM_UNET_PREFIX, LDM_TEXT_PREFIX)) for k in raw)
            mapping = "ldm" if is_ldm else "diffusers"
        for comp in self.edited_components:
            module = getattr(pipe, comp)
            if mapping == "ldm":
                if comp == "unet":
                    table = ldm_to_diffusers_unet_keys(module)
                    sd, unknown = {}, []
                    for k, v in raw.items():
                        if k.startswith(LDM_UNET_PREFIX):
                            name = k[len(LDM_UNET_PREFIX):]
                            if name in table:
                                sd[table[name]] = v
                            else:
                                unknown.append(k)
                        elif not LDM_IGNORED.match(k):
                            unknown.append(k)
                    if unknown:
                        self._fail_unknown(comp, unknown, [LDM_UNET_PREFIX + k for k in table])
                else:
                    n = len(LDM_TEXT_PREFIX)
                    sd = {k[n:]: v for k, v in raw.items() if k.startswith(LDM_TEXT_PREFIX)}
            else:
                sd = {_strip(k): v for k, v in raw.items() if _owner(k) == comp}
            out[comp] = self._check(module, comp, sd, full=False)
        return out

    def _check(self, module: Any, comp: str, sd: dict[str, torch.Tensor], *,
               full: bool) -> dict[str, torch.Tensor]:
        expected = module.state_dict()
        if comp == "text_encoder":
            sd = _match_text_prefix(sd, expected)
        unknown = [k for k in sd if k not in expected]
        if unknown:
            self._fail_unknown(comp, unknown, list(expected))
        bad = [(k, tuple(v.shape), tuple(expected[k].shape)) for k, v in sd.items()
               if tuple(v.shape) != tuple(expected[k].shape)]
        if bad:
            lines = "\n".join(f"    {k}: checkpoint {s}, {comp} expects {e}" for k, s, e in bad[:8])
            raise IncompatibleCheckpointError(
                f"{len(bad)} weight(s) of {self._path.name} do not fit the pipeline's {comp} "
                f"(a different model architecture?):\n{lines}")
        if not sd:
            raise IncompatibleCheckpointError(f"{self._path.name} holds no weights for the pipeline's {comp}")
        nonfinite = [k for k, v in sd.items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if nonfinite:
            raise IncompatibleCheckpointError(
                f"{self._path.name} holds NaN/inf in {len(nonfinite)} {comp} weight(s), e.g. "
                f"{', '.join(nonfinite[:3])}: a broken checkpoint (it would draw black images that read as "
                "perfect erasure)")
        if full:
            missing = [k for k in expected if k not in sd]
            if missing:
                raise IncompatibleCheckpointError(
                    f"{self._path} lacks {len(missing)} weight(s) of {comp}, e.g. {', '.join(missing[:5])}")
        return sd

    def _fail_unknown(self, comp: str, unknown: list[str], valid: list[str]) -> None:
        lines = []
        for k in unknown[:6]:
            close = difflib.get_close_matches(k, valid, n=1, cutoff=0.6)
            lines.append(f"    {k}" + (f"  (did you mean {close[0]}?)" if close else ""))
        raise IncompatibleCheckpointError(
            f"{len(unknown)} key(s) of {self._path.name} match no weight of the pipeline's {comp} "
            f"(key_mapping={self.hparams['key_mapping']}):\n" + "\n".join(lines)
            + f"\n  The {comp} has keys like {', '.join(valid[:3])}")

    # ------------------------------------------------------------------ erase
    @torch.no_grad()
    def erase(self, pipe: Any, concepts: Sequence[str], *, seed: int = 0, domain: Domain | None = None) -> Any:
        """Copy the checkpoint's weights into ``pipe`` (``concepts`` are recorded, not used)."""
        state = self._read(pipe)  # all checks happen here, before any write
        for comp, sd in state.items():
            target = getattr(pipe, comp).state_dict()
            for k, v in sd.items():
                target[k].copy_(v.to(target[k].dtype))
        return pipe
