"""ESD — Erased Stable Diffusion (Gandikota et al., ICCV 2023).

The UNet is fine-tuned so that its prediction for the concept becomes the frozen model's
prediction guided *away* from the concept (negative guidance η):

    ε_θ(x_t, c)  ->  ε*(x_t) − η (ε*(x_t, c) − ε*(x_t))

``x_t`` is drawn by running the DDIM sampler (classifier-free guidance ``start_guidance``) of
the model being fine-tuned for a random number of steps ``k`` out of ``ddim_steps``; the
loss is taken at the timestep reached. ``esd-x`` fine-tunes the cross-attention layers only
(the paper's choice for styles), ``esd-u`` everything but cross-attention, the time embedding
and the output layers (for objects and nudity). Defaults are those of the paper's code
(rohitgandikota/erasing, ``train-esd.py``): 1000 iterations, Adam at 1e-5, η = 1,
start guidance 3, 50 DDIM steps, batch 1.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from emma.api.domain import Domain
from emma.api.method import ErasureMethod
from emma.config import to_python
from emma.errors import ConfigError, UnknownChoiceError
from emma.methods._common import (
    autocast,
    check_concepts,
    cpu_generator,
    encode_text,
    for_concept,
    for_domain,
    fp32_training,
    randint,
    randn,
    require_sd_pipeline,
    train_only,
)

TRAIN_METHODS = ("esd-x", "esd-u", "esd-x-strict", "esd-all")
SAMPLE_FROM = ("erased", "base")


def esd_parameter_filter(train_method: str):
    """Which UNet parameters (diffusers names) a train method fine-tunes.

    ``esd-x``: every parameter of the cross-attention modules (``attn2``: to_q, to_k, to_v,
    to_out). ``esd-u`` (the paper's "noxattn"): all but ``attn2``, the time embedding and the
    output normalisation/convolution. ``esd-x-strict``: ``attn2.to_k``/``to_v`` only.
    ``esd-all``: everything.
    """
    if train_method == "esd-x":
        return lambda n: ".attn2." in n
    if train_method == "esd-u":
        frozen = ("time_embedding.", "conv_out.", "conv_norm_out.")
        return lambda n: not (".attn2." in n or n.startswith(frozen))
    if train_method == "esd-x-strict":
        return lambda n: ".attn2.to_k." in n or ".attn2.to_v." in n
    if train_method == "esd-all":
        return lambda n: True
    raise UnknownChoiceError("ESD train_method", train_method, TRAIN_METHODS)


class ESDMethod(ErasureMethod):
    """Erasing Concepts from Diffusion Models (ESD).

    Args:
        train_method: ``esd-x`` (cross-attention), ``esd-u`` (all but cross-attention),
            ``esd-x-strict`` (cross-attention keys/values) or ``esd-all``.
        iterations: optimisation steps (the erasure strength: ESD-100/200/500/1000).
        learning_rate: Adam learning rate.
        negative_guidance: η, how far the target is pushed away from the concept.
        start_guidance: classifier-free guidance of the sampler that draws ``x_t``.
        ddim_steps: DDIM steps of that sampler (``x_t`` is the state after a random number
            of them).
        sample_from: draw ``x_t`` with the model being fine-tuned (``erased``, the paper) or
            with the frozen original (``base``, the repository's diffusers port).
        neutral_concepts: per domain, the prompt ``ε*(x_t)`` is conditioned on (``""`` for
            every domain in ESD); a string or ``{concept: prompt, _default: prompt}``.
        progress: show a progress bar (not a hyper-parameter).
    """

    name = "esd"
    version = "1"
    edited_components = ("unet",)

    def __init__(
        self,
        train_method: str = "esd-x",
        iterations: int = 1000,
        learning_rate: float = 1e-5,
        negative_guidance: float = 1.0,
        start_guidance: float = 3.0,
        ddim_steps: int = 50,
        sample_from: str = "erased",
        neutral_concepts: Any = "",
        progress: bool = True,
    ) -> None:
        esd_parameter_filter(train_method)
        if sample_from not in SAMPLE_FROM:
            raise UnknownChoiceError("ESD sample_from", sample_from, SAMPLE_FROM)
        if int(iterations) < 0 or int(ddim_steps) < 1:
            raise ConfigError(f"ESD needs iterations >= 0 and ddim_steps >= 1, "
                              f"got {iterations} and {ddim_steps}")
        super().__init__(
            train_method=train_method, iterations=int(iterations), learning_rate=float(learning_rate),
            negative_guidance=float(negative_guidance), start_guidance=float(start_guidance),
            ddim_steps=int(ddim_steps), sample_from=sample_from, neutral_concepts=to_python(neutral_concepts),
        )
        self.progress = bool(progress)

    def erase(self, pipe: Any, concepts: Sequence[str], *, seed: int = 0, domain: Domain | None = None) -> Any:
        """Fine-tune ``pipe.unet`` in place so that it no longer draws ``concepts``."""
        from diffusers import DDIMScheduler

        require_sd_pipeline(pipe, "ESD")
        concepts = check_concepts(concepts, pipe.tokenizer, method="ESD")
        hp = self.hparams
        neutral = for_domain(hp["neutral_concepts"], domain, what="ESD neutral_concepts")
        unet = pipe.unet
        device = unet.device
        dtype = unet.dtype
        gen = cpu_generator(seed)

        # One erase (and neutral) embedding per concept; the concept is drawn per iteration.
        cond = encode_text(pipe, concepts)
        uncond = encode_text(pipe, [for_concept(neutral, c, what="ESD neutral_concepts") for c in concepts])
        blank = encode_text(pipe, [""])
        sampler = DDIMScheduler.from_config(pipe.scheduler.config)
        sampler.set_timesteps(hp["ddim_steps"], device="cpu")
        timesteps = sampler.timesteps.clone()
        latent_shape = (1, unet.config.in_channels, unet.config.sample_size, unet.config.sample_size)

        frozen = copy.deepcopy(unet).requires_grad_(False).eval()
        keep = esd_parameter_filter(hp["train_method"])
        with fp32_training(unet):
            params = train_only(unet, keep)
            opt = torch.optim.Adam(params.values(), lr=hp["learning_rate"])
            bar = tqdm(range(hp["iterations"]), desc=f"ESD ({hp['train_method']})", disable=not self.progress)
            for _ in bar:
                i = randint(len(concepts), gen)
                k = randint(hp["ddim_steps"], gen)
                z = randn(latent_shape, gen, device=device) * sampler.init_noise_sigma
                drawer = unet if hp["sample_from"] == "erased" else frozen
                # Nothing before the trained forward needs autograd: inference mode skips its
                # bookkeeping; the clones turn the results into ordinary tensors for backward.
                with torch.inference_mode():
                    xt = self._sample_until(drawer, sampler, timesteps[:k], z, cond[i : i + 1],
                                            blank, hp["start_guidance"], dtype)
                    t = timesteps[k].to(device)
                    x_in = xt.to(dtype)
                    with autocast(device, dtype):
                        e_0 = frozen(x_in, t, encoder_hidden_states=uncond[i : i + 1].to(dtype)).sample
                        e_p = frozen(x_in, t, encoder_hidden_states=cond[i : i + 1].to(dtype)).sample
                    target = e_0.float() - hp["negative_guidance"] * (e_p.float() - e_0.float())
                xt, target, t = xt.clone(), target.clone(), t.clone()
                with autocast(device, dtype):
                    e_n = unet(xt.float(), t, encoder_hidden_states=cond[i : i + 1].float()).sample
                loss = F.mse_loss(e_n.float(), target)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                bar.set_postfix(loss=f"{loss.item():.4g}", k=k)
        del frozen
        return pipe

    @staticmethod
    def _sample_until(unet: Any, sampler: Any, timesteps: torch.Tensor, z: torch.Tensor,
                      cond: torch.Tensor, uncond: torch.Tensor, guidance: float,
                      dtype: torch.dtype) -> torch.Tensor:
        """Run DDIM (η = 0, classifier-free guidance) from ``z`` through ``timesteps``."""
        x = z.float()
        wdtype = next(unet.parameters()).dtype
        ctx = torch.cat([uncond, cond]).to(wdtype)
        for t in timesteps:
            with autocast(x.device, dtype):
                eps = unet(torch.cat([x, x]).to(wdtype), t.to(x.device), encoder_hidden_states=ctx).sample
            e_u, e_c = eps.float().chunk(2)
            x = sampler.step(e_u + guidance * (e_c - e_u), t, x).prev_sample
        return x
