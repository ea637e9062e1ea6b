"""Every erasure method at SD v1.4's real architecture (slow, opt in with ``-m slow``).

SD v1.4's UNet, VAE and text-encoder configurations (those of the hub's
``CompVis/stable-diffusion-v1-4``, written out here: nothing is downloaded) with random
weights, at a small resolution (the UNet's ``sample_size`` 8: 64 px images), on the CPU in
float32. Each method runs with its SD-scale settings (``model=sd14 domain=object``) cut to two
optimisation steps (closed forms run whole), in its own process, which reports its peak
resident memory; ``EMMA_SD_MEMORY_OUT=<file.json>`` collects the figures, from which
docs/protocols/README.md derives the GPU memory each method needs at 512 px.

    EMMA_SD_MEMORY_OUT=mem.json python -m pytest tests/test_sd_architecture.py -m slow
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

#: CompVis/stable-diffusion-v1-4, unet/config.json (sample_size set per run).
SD14_UNET: dict[str, Any] = dict(
    act_fn="silu", attention_head_dim=8, block_out_channels=(320, 640, 1280, 1280), center_input_sample=False,
    cross_attention_dim=768, down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    downsample_padding=1, flip_sin_to_cos=True, freq_shift=0, in_channels=4, layers_per_block=2,
    mid_block_scale_factor=1, norm_eps=1e-5, norm_num_groups=32, out_channels=4, sample_size=64,
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)
#: vae/config.json
SD14_VAE: dict[str, Any] = dict(
    act_fn="silu", block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
    in_channels=3, latent_channels=4, layers_per_block=2, norm_num_groups=32, out_channels=3, sample_size=512,
    up_block_types=("UpDecoderBlock2D",) * 4)
#: text_encoder/config.json (CLIP ViT-L/14's text tower)
SD14_TEXT: dict[str, Any] = dict(
    hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
    max_position_embeddings=77, vocab_size=49408, hidden_act="quick_gelu", projection_dim=768,
    layer_norm_eps=1e-5, bos_token_id=49406, eos_token_id=49407, pad_token_id=49407)

#: Two optimisation steps of each method's SD-scale settings (few images, few sampler steps);
#: pinned reference lists replaced by short inline lists (nothing is downloaded).
TWO_STEPS: dict[str, list[str]] = {
    "esd": ["method.iterations=2", "method.ddim_steps=2"],
    "uce": [],
    "rece": [],
    "mace": ["method.num_images=1", "method.max_train_steps=2", "method.aug_length=2", "method.prompt_len=null",
             "method.sample_steps=1", "method.segmenter=attention",
             "method.prompt_templates.default=['a photo of {}','an image of {}','{} in a photo']"],
    "ca": ["method.num_class_images=2", "method.train_batch_size=1", "method.max_train_steps=2",
           "method.sample_steps=1"],
    "fmn": ["method.num_images=1", "method.max_train_steps=2", "method.sample_steps=1", "method.max_train_steps_ti=2"],
    "salun": ["method.num_images=2", "method.train_batch_size=1", "method.epochs=1", "method.sample_steps=1"],
    "spm": ["method.iterations=2", "method.max_denoising_steps=3", "method.sampling_batch_size=1",
            "method.lr_warmup_steps=0"],
    "eap": ["method.iterations=2", "method.ddim_steps=2", "method.vocabulary=[boat,car,bird,ship,train]",
            "method.k_closest=4", "method.num_centers=2", "method.pgd_num_steps=1"],
    "advunlearn": ["method.iterations=2", "method.warmup_iter=1", "method.attack_step=1", "method.ddim_steps=2",
                   "method.retain_batch=1"],
    "sld": [],
}


def family(method: str) -> str:
    for prefix in ("esd", "sld", "ca"):
        if method == prefix or method.startswith(prefix + "_"):
            return prefix
    return method


def methods() -> list[str]:
    from emma import registry

    return [m for m in registry.choices("method") if m not in ("none", "checkpoint")]


def sd14_random_pipeline(sample_size: int = 8, seed: int = 0) -> Any:
    """SD v1.4's architecture with random weights (float32, CPU), offline."""
    import torch
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from emma.tinyworld import arch
    from emma.tinyworld.tokenizer import local_clip_tokenizer

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**{**SD14_UNET, "sample_size": sample_size})
    vae = AutoencoderKL(**SD14_VAE)
    text_encoder = CLIPTextModel(CLIPTextConfig(**SD14_TEXT))
    pipe = StableDiffusionPipeline(unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=local_clip_tokenizer(),
                                   scheduler=PNDMScheduler(**arch.SCHEDULER_CONFIG), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    for module in (unet, vae, text_encoder):
        module.requires_grad_(False)
    return pipe


def measure(method: str, sample_size: int = 8) -> dict[str, Any]:
    """Build the pipeline, run ``method``'s two steps on the object domain, report memory (MiB)."""
    import resource
    import time

    import torch
    from hydra.utils import instantiate

    from emma.domains import load_domain
    from emma.pipelines import fingerprint
    from emma.registry import compose

    def rss_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    torch.set_num_threads(1)
    pipe = sd14_random_pipeline(sample_size)
    params = {c: sum(p.numel() for p in getattr(pipe, c).parameters()) for c in ("unet", "vae", "text_encoder")}
    built = rss_mb()
    cfg = compose(["model=sd14", "domain=object", f"method={method}", *TWO_STEPS[family(method)]])
    m = instantiate(cfg.method, _convert_="all")
    if hasattr(m, "progress"):
        m.progress = False
    domain = load_domain("object")
    before = fingerprint(pipe, ("unet", "text_encoder"))
    t = time.perf_counter()
    m.erase(pipe, ["airplane"], seed=0, domain=domain)
    guidance = m.inference_guidance(pipe, ["airplane"], domain=domain)
    if guidance is not None:  # SLD: two sampling steps of one image
        guidance.sample(pipe, prompt=["a photo of an airplane"], generator=[torch.Generator().manual_seed(0)],
                        num_inference_steps=2, guidance_scale=7.5, height=sample_size * 8, width=sample_size * 8)
    seconds = time.perf_counter() - t
    return {"method": method, "params": params, "built_mb": built, "peak_mb": rss_mb(), "seconds": seconds,
            "changed": fingerprint(pipe, ("unet", "text_encoder")) != before,
            "edited_components": list(m.edited_components), "sample_px": sample_size * 8}


def unet_step_memory(sample_px: int) -> dict[str, float]:
    """Peak resident memory (MiB) of one forward and backward pass of SD v1.4's UNet (float32,
    batch 1, cross-attention trainable) at ``sample_px`` pixels, over the UNet alone: the
    activations a training step keeps, which grow with the image (docs/protocols/README.md)."""
    import resource

    import torch
    from diffusers import UNet2DConditionModel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**{**SD14_UNET, "sample_size": sample_px // 8})
    unet.requires_grad_(False)
    for n, p in unet.named_parameters():
        p.requires_grad_(".attn2." in n)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    x = torch.randn(1, 4, sample_px // 8, sample_px // 8)
    ctx = torch.randn(1, 77, 768)
    unet(x, torch.tensor([500]), encoder_hidden_states=ctx).sample.square().mean().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"sample_px": sample_px, "unet_mb": before, "step_mb": peak - before}


@pytest.mark.parametrize("px", [128, 256, 512])
def test_unet_step_memory_grows_with_the_image(px, tmp_path):
    out = tmp_path / "a.json"
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); "
            f"from test_sd_architecture import unet_step_memory; "
            f"json.dump(unet_step_memory({px}), open({str(out)!r}, 'w'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["step_mb"] > 0
    target = os.environ.get("EMMA_SD_MEMORY_OUT")
    if target:
        path = Path(target)
        table = json.loads(path.read_text()) if path.exists() else {}
        table[f"unet_step_{px}px"] = res
        path.write_text(json.dumps(table, indent=1, sort_keys=True))


def test_the_configs_are_sd14s():
    pipe = sd14_random_pipeline()
    counts = {c: sum(p.numel() for p in getattr(pipe, c).parameters()) for c in ("unet", "vae", "text_encoder")}
    assert counts == {"unet": 859_520_964, "vae": 83_653_863, "text_encoder": 123_060_480}


#: Methods whose run peaks near a 23 GiB machine's RAM (GiB of memory available at the start):
#: SalUn trains the whole UNet with Adam beside its saliency mask and peaked at 19.6 GiB resident
#: (2026-12-06, 64 px, one thread); with less available the kernel would stop it mid-run.
NEEDS_GIB = {"salun": 20.0}


def available_gib() -> float | None:
    """MemAvailable of /proc/meminfo in GiB (None where there is no /proc/meminfo)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


@pytest.mark.parametrize("method", methods())
def test_two_steps_of_every_method_at_sd14_architecture(method, tmp_path):
    need, have = NEEDS_GIB.get(method), available_gib()
    if need is not None and have is not None and have < need:
        pytest.skip(f"{method} at SD v1.4's architecture needs about {need:.0f} GiB of RAM; "
                    f"{have:.1f} GiB are available here")
    out = tmp_path / "m.json"
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'tests')!r}); "
            f"from test_sd_architecture import measure; "
            f"json.dump(measure({method!r}), open({str(out)!r}, 'w'))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "EMMA_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode != -9, (f"{method} was killed (SIGKILL; the kernel's out-of-memory killer if "
                                   f"RAM ran out: {have} GiB were available at the start)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    if family(method) == "sld":
        assert res["edited_components"] == [] and not res["changed"]
    else:
        assert res["changed"], f"{method} changed no weight in two steps"
    target = os.environ.get("EMMA_SD_MEMORY_OUT")
    if target:
        path = Path(target)
        table = json.loads(path.read_text()) if path.exists() else {}
        table[method] = res
        path.write_text(json.dumps(table, indent=1, sort_keys=True))
