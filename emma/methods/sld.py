"""SLD — Safe Latent Diffusion (Schramowski et al., CVPR 2023).

SLD edits no weight: it adds a *safety guidance* term to classifier-free guidance at
sampling time. With ``ε_u``, ``ε_p`` and ``ε_S`` the noise predictions for the unconditional
prompt, the prompt and the safety concept ``S`` (the erased concept), at step ``i``:

    μ     = where(ε_p − ε_S ≥ λ, 0, clamp(s_S |ε_p − ε_S|, max=1))          (eq. 6)
    γ     = μ (ε_S − ε_u) + s_m ν                                            (eqs. 4, 7)
    ν     ← β_m ν + (1 − β_m) γ                                              (eq. 8)
    ε̃    = ε_u + s_g (ε_p − ε_u − [i ≥ δ] γ)                                 (eq. 3)

with guidance scale ``s_S`` (``sld_guidance_scale``), threshold λ, warm-up δ steps,
momentum scale ``s_m`` and momentum β_m. The paper's four configurations (weak, medium,
strong, max) are ``conf/method/sld*.yaml``; medium is diffusers' default. The erase stage
returns the pipeline untouched (no unlearning time); :meth:`SLDMethod.inference_guidance`
hands the generation stage a :class:`SafeLatentGuidance`, which runs the denoising loop on
the pipeline's own components (as diffusers' ``StableDiffusionPipelineSafe`` does, which the
tests use as the reference).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from emma.api.domain import Domain
from emma.api.guidance import InferenceGuidance
from emma.api.method import ErasureMethod
from emma.config import to_python
from emma.errors import ConfigError
from emma.methods._common import check_concepts, domain_name, for_domain, require_sd_pipeline

# SLD's safety concept for inappropriate content (the paper's I2P categories).
SLD_DEFAULT_SAFETY_CONCEPT = (
    "hate, harassment, violence, suffering, humiliation, harm, suicide, sexual, nudity, "
    "bodily fluids, blood, obscene gestures, illegal activity, drug use, theft, vandalism, "
    "weapons, child abuse, brutality, cruelty"
)


class SafeLatentGuidance(InferenceGuidance):
    """Classifier-free guidance plus SLD's safety guidance away from ``safety_concept``.

    Args:
        safety_concept: the text of the concept steered away from.
        sld_guidance_scale: ``s_S``; at most 1 disables safety guidance (plain CFG).
        sld_warmup_steps: δ, steps before the safety term is applied.
        sld_threshold: λ, the margin beyond which a latent dimension counts as safe.
        sld_momentum_scale: ``s_m``.
        sld_mom_beta: β_m.
    """

    name = "sld"
    version = "1"

    def __init__(self, safety_concept: str, sld_guidance_scale: float = 1000.0, sld_warmup_steps: int = 10,
                 sld_threshold: float = 0.01, sld_momentum_scale: float = 0.3, sld_mom_beta: float = 0.4) -> None:
        self.safety_concept = str(safety_concept)
        self.sld_guidance_scale = float(sld_guidance_scale)
        self.sld_warmup_steps = int(sld_warmup_steps)
        self.sld_threshold = float(sld_threshold)
        self.sld_momentum_scale = float(sld_momentum_scale)
        self.sld_mom_beta = float(sld_mom_beta)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "safety_concept": self.safety_concept,
                "sld_guidance_scale": self.sld_guidance_scale, "sld_warmup_steps": self.sld_warmup_steps,
                "sld_threshold": self.sld_threshold, "sld_momentum_scale": self.sld_momentum_scale,
                "sld_mom_beta": self.sld_mom_beta}

    @torch.no_grad()
    def sample(self, pipe: Any, *, prompt: list[str] | None = None, prompt_embeds: torch.Tensor | None = None,
               negative_prompt: list[str] | None = None, negative_prompt_embeds: torch.Tensor | None = None,
               generator: list[torch.Generator], num_inference_steps: int, guidance_scale: float,
               height: int, width: int) -> torch.Tensor:
        if guidance_scale <= 1.0:
            raise ConfigError(f"SLD steers classifier-free guidance; it needs guidance_scale > 1, got {guidance_scale}")
        device = pipe._execution_device
        n = len(prompt) if prompt is not None else prompt_embeds.shape[0]
        cond, uncond = pipe.encode_prompt(prompt, device, 1, True, negative_prompt,
                                          prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds)
        safety = pipe.encode_prompt([self.safety_concept] * n, device, 1, False)[0]
        enabled = self.sld_guidance_scale > 1.0
        context = torch.cat([uncond, cond, safety] if enabled else [uncond, cond])
        sched = pipe.scheduler
        sched.set_timesteps(int(num_inference_steps), device=device)
        latents = pipe.prepare_latents(n, pipe.unet.config.in_channels, height, width, cond.dtype, device, generator)
        extra = pipe.prepare_extra_step_kwargs(generator, 0.0)
        momentum = None
        parts = 3 if enabled else 2
        for i, t in enumerate(sched.timesteps):
            x = sched.scale_model_input(torch.cat([latents] * parts), t)
            eps = pipe.unet(x, t, encoder_hidden_states=context, return_dict=False)[0]
            chunks = eps.chunk(parts)
            e_u, e_p = chunks[0], chunks[1]
            guidance = e_p - e_u
            if enabled:
                e_s = chunks[2]
                if momentum is None:
                    momentum = torch.zeros_like(guidance)
                scale = torch.clamp((e_p - e_s).abs() * self.sld_guidance_scale, max=1.0)
                scale = torch.where(e_p - e_s >= self.sld_threshold, torch.zeros_like(scale), scale)
                safety_term = (e_s - e_u) * scale + self.sld_momentum_scale * momentum
                momentum = self.sld_mom_beta * momentum + (1 - self.sld_mom_beta) * safety_term
                if i >= self.sld_warmup_steps:
                    guidance = guidance - safety_term
            latents = sched.step(e_u + guidance_scale * guidance, t, latents, **extra, return_dict=False)[0]
        image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False, generator=generator)[0]
        return pipe.image_processor.postprocess(image, output_type="pt", do_denormalize=[True] * n)


class SLDMethod(ErasureMethod):
    """Safe Latent Diffusion: inference-time safety guidance, no weight edit.

    Args:
        safety_concepts: per domain, the safety concept text; ``{}`` is replaced by the
            erased concept(s), joined with ", " (``"{}"``: the concept itself).
        sld_guidance_scale / sld_warmup_steps / sld_threshold / sld_momentum_scale /
            sld_mom_beta: see :class:`SafeLatentGuidance`.
    """

    name = "sld"
    version = "1"
    edited_components = ()

    def __init__(self, safety_concepts: Any = "{}", sld_guidance_scale: float = 1000.0, sld_warmup_steps: int = 10,
                 sld_threshold: float = 0.01, sld_momentum_scale: float = 0.3, sld_mom_beta: float = 0.4) -> None:
        if int(sld_warmup_steps) < 0 or not 0.0 <= float(sld_mom_beta) <= 1.0:
            raise ConfigError(f"SLD needs sld_warmup_steps >= 0 and 0 <= sld_mom_beta <= 1, got "
                              f"{sld_warmup_steps} and {sld_mom_beta}")
        super().__init__(safety_concepts=to_python(safety_concepts), sld_guidance_scale=float(sld_guidance_scale),
                         sld_warmup_steps=int(sld_warmup_steps), sld_threshold=float(sld_threshold),
                         sld_momentum_scale=float(sld_momentum_scale), sld_mom_beta=float(sld_mom_beta))

    def erase(self, pipe: Any, concepts: Sequence[str], *, seed: int = 0, domain: Domain | None = None) -> Any:
        """Check the concepts; the pipeline is returned unchanged (SLD acts while sampling)."""
        require_sd_pipeline(pipe, "SLD")
        check_concepts(concepts, pipe.tokenizer, method="SLD")
        return pipe

    def safety_concept(self, concepts: Sequence[str], domain: Domain | None) -> str:
        template = for_domain(self.hparams["safety_concepts"], domain, what="SLD safety_concepts")
        if not isinstance(template, str):
            raise ConfigError(f"SLD safety_concepts for domain {domain_name(domain)!r} must be a string, "
                              f"got {template!r}")
        return template.replace("{}", ", ".join(concepts))

    def inference_guidance(self, pipe: Any, concepts: Sequence[str], *,
                           domain: Domain | None = None) -> SafeLatentGuidance:
        concepts = check_concepts(concepts, pipe.tokenizer, method="SLD")
        hp = {k: v for k, v in self.hparams.items() if k != "safety_concepts"}
        return SafeLatentGuidance(self.safety_concept(concepts, domain), **hp)
