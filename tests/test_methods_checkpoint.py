"""``method=checkpoint``: diffusers folders and original-repository state dicts, key mapping
against diffusers' own LDM converter, and clear errors that leave the pipeline untouched."""

from __future__ import annotations

import argparse
import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import save_file

from emma.domains import load_domain
from emma.errors import ConfigError, WeightsUnavailableError
from emma.methods.checkpoint import (
    LDM_TEXT_PREFIX,
    LDM_UNET_PREFIX,
    CheckpointMethod,
    IncompatibleCheckpointError,
    ldm_to_diffusers_unet_keys,
)
from emma.methods.uce import UCEMethod
from emma.pipelines import fingerprint, tiny_random_pipeline
from emma.tinyworld import arch

SD14_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, cross_attention_dim=768,
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    block_out_channels=(320, 640, 1280, 1280), attention_head_dim=8,
)


@pytest.fixture(scope="module")
def base():
    pipe = tiny_random_pipeline(seed=0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def erased(base):
    pipe = copy.deepcopy(base)
    UCEMethod(guide_concepts="shape").erase(pipe, ["circle"], domain=load_domain("tinyworld"))
    return pipe


@pytest.fixture
def pipe(base):
    return copy.deepcopy(base)


def _text_param(pipe, suffix: str) -> torch.nn.Parameter:
    return next(p for n, p in pipe.text_encoder.named_parameters() if n.endswith(suffix))


def ldm_state_dict(pipe, with_text: bool = True, extras: bool = True) -> dict[str, torch.Tensor]:
    """A CompVis-layout checkpoint of ``pipe`` (what ESD's original code saves)."""
    sd = pipe.unet.state_dict()
    out = {LDM_UNET_PREFIX + k: sd[v].clone() for k, v in ldm_to_diffusers_unet_keys(pipe.unet).items()}
    if with_text:
        # LDM checkpoints name CLIP weights "cond_stage_model.transformer.text_model.*"
        out.update({LDM_TEXT_PREFIX + "text_model." + k.removeprefix("text_model."): v.clone()
                    for k, v in pipe.text_encoder.state_dict().items()})
    if extras:  # VAE, EMA and schedule buffers of a full LDM checkpoint are skipped
        out["first_stage_model.decoder.conv_in.weight"] = torch.zeros(2)
        out["betas"] = torch.zeros(1000)
        out["alphas_cumprod"] = torch.zeros(1000)
    return out


# --------------------------------------------------------------------------- key mapping
@pytest.mark.parametrize("config", [arch.TINY_RANDOM_UNET, arch.UNET_CONFIG, SD14_UNET],
                         ids=["tiny_random", "tinyworld", "sd14"])
def test_ldm_key_mapping_agrees_with_diffusers_converter(config):
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    with torch.device("meta"):
        unet = UNet2DConditionModel(**config)
    keys = list(unet.state_dict())
    table = ldm_to_diffusers_unet_keys(unet)
    assert sorted(table.values()) == sorted(keys)  # every weight has an LDM name
    # tag every LDM entry with its own id and let diffusers convert it
    ids = {ldm: torch.full((1,), float(i)) for i, ldm in enumerate(table)}
    ldm = {LDM_UNET_PREFIX + k: v for k, v in ids.items()}
    converted = convert_ldm_unet_checkpoint(ldm, dict(unet.config))
    assert set(converted) == set(keys)
    for ldm, diff in table.items():
        assert converted[diff] is ids[ldm], (ldm, diff)


# --------------------------------------------------------------------------- loading
def test_diffusers_unet_folder(base, erased, pipe, tmp_path):
    erased.unet.save_pretrained(tmp_path / "unet")
    m = CheckpointMethod(str(tmp_path / "unet"))
    assert m.edited_components == ("unet",)
    m.erase(pipe, ["circle"])
    assert fingerprint(pipe) == fingerprint(erased)


def test_diffusers_pipeline_folder_with_text_encoder(base, erased, pipe, tmp_path):
    other = copy.deepcopy(erased)
    with torch.no_grad():
        _text_param(other, "final_layer_norm.bias").add_(0.5)
    other.save_pretrained(tmp_path / "pipe")
    m = CheckpointMethod(str(tmp_path / "pipe"))
    assert m.edited_components == ("unet", "text_encoder")
    m.erase(pipe, ["circle"])
    assert fingerprint(pipe) == fingerprint(other)


def test_partial_safetensors_of_edited_layers_changes_only_them(base, erased, pipe, tmp_path):
    # ESD/UCE save only the layers they edit, with diffusers names
    sd = {k: v for k, v in erased.unet.state_dict().items() if ".attn2.to_" in k}
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "uce.safetensors")
    CheckpointMethod(str(tmp_path / "uce.safetensors")).erase(pipe, ["circle"])
    assert fingerprint(pipe) == fingerprint(erased)


def test_full_unet_state_dict_pt(erased, pipe, tmp_path):
    torch.save(erased.unet.state_dict(), tmp_path / "erased.pt")  # UCE's original format
    CheckpointMethod(str(tmp_path / "erased.pt")).erase(pipe, ["circle"])
    assert fingerprint(pipe) == fingerprint(erased)


def test_ldm_checkpoint_unet_and_text_encoder(base, erased, pipe, tmp_path):
    other = copy.deepcopy(erased)
    with torch.no_grad():
        _text_param(other, "final_layer_norm.weight").mul_(0.5)
    torch.save({"state_dict": ldm_state_dict(other), "global_step": 1000}, tmp_path / "esd.ckpt")
    unet_only = copy.deepcopy(base)
    CheckpointMethod(str(tmp_path / "esd.ckpt"), components=["unet"]).erase(unet_only, ["circle"])
    assert fingerprint(unet_only, ("unet",)) == fingerprint(erased, ("unet",))
    assert fingerprint(unet_only, ("text_encoder",)) == fingerprint(base, ("text_encoder",))
    m = CheckpointMethod(str(tmp_path / "esd.ckpt"))
    assert m.edited_components == ("unet", "text_encoder")
    m.erase(pipe, ["circle"])
    assert fingerprint(pipe) == fingerprint(other)


def test_ldm_partial_cross_attention_delta(erased, pipe, tmp_path):
    # CA saves the cross-attention key/value weights in CompVis names
    full = ldm_state_dict(erased, with_text=False, extras=False)
    delta = {k: v for k, v in full.items() if ".attn2.to_k." in k or ".attn2.to_v." in k}
    torch.save({"state_dict": delta}, tmp_path / "delta.ckpt")
    CheckpointMethod(str(tmp_path / "delta.ckpt")).erase(pipe, ["circle"])
    assert fingerprint(pipe) == fingerprint(erased)


def test_checkpoint_loads_into_a_bf16_pipeline(erased, base, tmp_path):
    erased.unet.save_pretrained(tmp_path / "unet")
    pipe = copy.deepcopy(base).to(torch.bfloat16)
    CheckpointMethod(str(tmp_path / "unet")).erase(pipe, ["circle"])
    assert pipe.unet.dtype == torch.bfloat16
    w = "up_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight"
    assert torch.equal(pipe.unet.state_dict()[w], erased.unet.state_dict()[w].to(torch.bfloat16))


def test_config_hashes_the_checkpoint_bytes(erased, tmp_path):
    path = tmp_path / "w.safetensors"
    sd = {k: v.contiguous() for k, v in erased.unet.state_dict().items() if ".attn2.to_k." in k}
    save_file(sd, path)
    first = CheckpointMethod(str(path)).config()["source_sha256"]
    save_file({k: v + 1 for k, v in sd.items()}, path)
    assert CheckpointMethod(str(path)).config()["source_sha256"] != first


# --------------------------------------------------------------------------- errors
def test_shape_mismatch_is_a_clear_error_and_changes_nothing(base, pipe, tmp_path):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    other = UNet2DConditionModel(**{**arch.TINY_RANDOM_UNET, "cross_attention_dim": 16})
    other.save_pretrained(tmp_path / "unet")
    with pytest.raises(IncompatibleCheckpointError, match=r"attn2\.to_k\.weight: checkpoint \(8, 16\)"):
        CheckpointMethod(str(tmp_path / "unet")).erase(pipe, ["circle"])
    assert fingerprint(pipe) == fingerprint(base)


def test_unknown_keys_suggest_the_right_name(base, pipe, tmp_path):
    key = "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k.weight"
    bad = key.replace("to_k", "to_key")
    sd = {key: base.unet.state_dict()[key].contiguous(), bad: torch.zeros(8, 32)}
    save_file(sd, tmp_path / "x.safetensors")
    with pytest.raises(IncompatibleCheckpointError, match=f"did you mean {key}"):
        CheckpointMethod(str(tmp_path / "x.safetensors")).erase(pipe, ["circle"])
    assert fingerprint(pipe) == fingerprint(base)


def test_unet_folder_of_another_architecture_misses_keys(base, pipe, tmp_path):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    blocks = {"down_block_types": ("DownBlock2D",) * 2, "up_block_types": ("UpBlock2D",) * 2}
    smaller = UNet2DConditionModel(**{**arch.TINY_RANDOM_UNET, **blocks})
    smaller.save_pretrained(tmp_path / "unet")
    with pytest.raises(IncompatibleCheckpointError, match="lacks"):
        CheckpointMethod(str(tmp_path / "unet")).erase(pipe, ["circle"])
    assert fingerprint(pipe) == fingerprint(base)


def test_missing_path_and_bad_suffix(tmp_path):
    with pytest.raises(WeightsUnavailableError, match="does not exist"):
        CheckpointMethod(str(tmp_path / "nope"))
    (tmp_path / "w.txt").write_text("x")
    with pytest.raises(ConfigError, match="unknown suffix"):
        CheckpointMethod(str(tmp_path / "w.txt"))
    with pytest.raises(ConfigError, match="method.path"):
        CheckpointMethod("")


def test_unpicklable_file_explains_weights_only(tmp_path):
    path = tmp_path / "odd.pt"
    # e.g. a Lightning checkpoint that pickles its argparse hyper-parameters
    torch.save({"state_dict": {"w": torch.zeros(1)}, "hparams": argparse.Namespace(lr=1e-5)}, path)
    with pytest.raises(IncompatibleCheckpointError, match="weights_only=false"):
        CheckpointMethod(str(path))
