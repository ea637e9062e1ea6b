"""Architectures of the tiny world, as data.

The components are the classes SD v1.x uses (``UNet2DConditionModel``, ``AutoencoderKL``,
``CLIPTextModel``, ``CLIPTokenizer``) at miniature sizes, so that every
code path the harness runs on the tiny world is the one it runs on Stable Diffusion.
"""

from __future__ import annotations

from typing import Any

# 32x32 RGB -> 8x8x8 latents (two downsamplings; vae_scale_factor = 4).
VAE_CONFIG: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3,
    block_out_channels=(32, 64, 64),
    layers_per_block=1,
    latent_channels=8,
    norm_num_groups=16,
    sample_size=32,
)

TEXT_ENCODER_CONFIG: dict[str, Any] = dict(
    vocab_size=49408,
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=77,
    bos_token_id=49406,
    eos_token_id=49407,
    pad_token_id=49407,
    hidden_act="quick_gelu",
    projection_dim=64,
)

# Tiny worlds 2 and 3: no attention at the 8x8 level, where it cost
# half the UNet's time; text conditions the 4x4 and 2x2 levels and the middle block. A forward
# pass at batch 64 on one thread takes 79 ms against 205 ms for ``UNET_CONFIG_V1``. The first
# 4,000-step training of it drew name prompts far below world 1's fidelity (see the issue notes).
UNET_CONFIG: dict[str, Any] = dict(
    sample_size=8,
    in_channels=8,
    out_channels=8,
    block_out_channels=(32, 64, 128),
    layers_per_block=1,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    cross_attention_dim=64,
    attention_head_dim=8,
    norm_num_groups=16,
)

# The first tiny world's UNet (world 1): wider, text attended at 8x8 and 4x4 and not at 2x2.
UNET_CONFIG_V1: dict[str, Any] = {
    **UNET_CONFIG,
    "block_out_channels": (64, 128, 128),
    "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    "norm_num_groups": 32,
}

#: The UNets the training script can train (``--unet``); the pipeline folder records the one used.
UNET_CONFIGS: dict[str, dict[str, Any]] = {
    "v2": UNET_CONFIG,
    "v1": UNET_CONFIG_V1,
    # world 2's widths with world 1's attention placement (text attended at 8x8 and 4x4)
    "v2-attn8": {**UNET_CONFIG, "down_block_types": UNET_CONFIG_V1["down_block_types"],
                 "up_block_types": UNET_CONFIG_V1["up_block_types"]},
}

# The sampler the tiny-world pipeline ships with, in the SD v1.4 scheduler configuration
# (``SCHEDULER_CONFIG``). Euler ancestral draws every shape from its name prompt at 20 steps
# more reliably than the PNDM sampler of SD v1.4 (40 seeds per shape, guidance 5: lowest shape
# rate 0.93 against 0.73 for PNDM, at the same cost; DDIM is worse still). Built by
# ``emma.pipelines.make_scheduler(SCHEDULER_CLASS, SCHEDULER_CONFIG)``; swap samplers with
# ``model.scheduler``.
SCHEDULER_CLASS = "EulerAncestralDiscreteScheduler"

# The SD v1.4 scheduler configuration.
SCHEDULER_CONFIG: dict[str, Any] = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    skip_prk_steps=True,
    steps_offset=1,
    set_alpha_to_one=False,
    timestep_spacing="leading",
)

# diffusers' test sizes (tests/pipelines/stable_diffusion get_dummy_components), used by
# model=tiny_random: a randomly initialised pipeline for plumbing tests.
TINY_RANDOM_UNET: dict[str, Any] = dict(
    block_out_channels=(4, 8),
    layers_per_block=1,
    sample_size=8,
    in_channels=4,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    cross_attention_dim=32,
    norm_num_groups=2,
)
TINY_RANDOM_VAE: dict[str, Any] = dict(
    block_out_channels=(4, 8),
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    latent_channels=4,
    norm_num_groups=2,
)
TINY_RANDOM_TEXT_ENCODER: dict[str, Any] = dict(
    bos_token_id=49406,
    eos_token_id=49407,
    pad_token_id=49407,
    hidden_size=32,
    intermediate_size=37,
    layer_norm_eps=1e-05,
    num_attention_heads=4,
    num_hidden_layers=5,
    vocab_size=49408,
    max_position_embeddings=77,
)
