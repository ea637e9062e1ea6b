"""FMN — Forget-Me-Not (Zhang et al., 2023): attention re-steering.

On images of the concept (drawn by the model itself) noised at a random timestep, the UNet
is run with a prompt naming the concept, and the loss is the norm of the cross-attention
probabilities that the image's pixels put on the concept's tokens (and, with ``use_pooler``,
on the end-of-text tokens), over every cross-attention layer. Minimising it teaches the model
to ignore the concept's words; there is no replacement concept.

Defaults follow the repository (SHI-Labs/Forget-Me-Not, ``configs/attn.yaml``): the whole
UNet (``only_optimize_ca: false``; EMMA fine-tuned cross-attention only, ``true``), AdamW at
2e-6 (weight decay 0.01), 35 steps, batch 1, gradient clipping at 1, pooler token included,
prompt "a photo of {}" ("a photo in the style of {}" for styles). The repository's optional
textual-inversion stage (``use_ti``, on in its config) is not implemented: the concept's own
words are re-steered (card: ``docs/protocols/methods/fmn.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from emma.api.domain import Domain
from emma.api.method import ErasureMethod
from emma.config import to_python
from emma.errors import ConfigError
from emma.methods._common import (
    Attn2Processor,
    CrossAttnRecorder,
    attn2_processors,
    autocast,
    check_concepts,
    concept_positions,
    cpu_generator,
    encode_text,
    for_domain,
    fp32_training,
    generate_latents,
    randint,
    randn,
    require_sd_pipeline,
    train_only,
    training_scheduler,
)


class ForgetMeNotMethod(ErasureMethod):
    """Forget-Me-Not attention re-steering.

    Args:
        prompt_templates: per domain, the training prompt template with ``{}`` for the concept.
        only_optimize_ca: fine-tune the cross-attention modules (``attn2``) only; otherwise the
            whole UNet.
        use_pooler: add the end-of-text tokens to the re-steered tokens.
        learning_rate / max_train_steps / train_batch_size / adam_weight_decay / max_grad_norm:
            training (AdamW).
        num_images: images of each concept drawn before training.
        sample_steps / sample_guidance: sampler settings for those images.
        progress: show progress bars (not a hyper-parameter).
    """

    name = "fmn"
    version = "2"
    edited_components = ("unet",)

    def __init__(
        self,
        prompt_templates: Any = "a photo of {}",
        only_optimize_ca: bool = True,
        use_pooler: bool = True,
        learning_rate: float = 2e-6,
        max_train_steps: int = 35,
        train_batch_size: int = 1,
        adam_weight_decay: float = 0.01,
        max_grad_norm: float = 1.0,
        num_images: int = 8,
        sample_steps: int = 50,
        sample_guidance: float = 7.5,
        progress: bool = True,
    ) -> None:
        if int(train_batch_size) < 1 or int(num_images) < 1:
            raise ConfigError("FMN needs train_batch_size >= 1 and num_images >= 1")
        super().__init__(
            prompt_templates=to_python(prompt_templates), only_optimize_ca=bool(only_optimize_ca),
            use_pooler=bool(use_pooler), learning_rate=float(learning_rate),
            max_train_steps=int(max_train_steps),
            train_batch_size=int(train_batch_size), adam_weight_decay=float(adam_weight_decay),
            max_grad_norm=float(max_grad_norm), num_images=int(num_images), sample_steps=int(sample_steps),
            sample_guidance=float(sample_guidance),
        )
        self.progress = bool(progress)

    def prompts(self, concepts: Sequence[str], domain: Domain | None) -> list[str]:
        """One training prompt per concept."""
        template = for_domain(self.hparams["prompt_templates"], domain, what="FMN prompt_templates")
        if not isinstance(template, str) or template.count("{}") != 1:
            raise ConfigError(f"FMN prompt template must be a string with one '{{}}', got {template!r}")
        return [template.format(c) for c in concepts]

    def erase(self, pipe: Any, concepts: Sequence[str], *, seed: int = 0, domain: Domain | None = None) -> Any:
        """Fine-tune ``pipe.unet`` so that images no longer attend to the concepts' tokens."""
        require_sd_pipeline(pipe, "FMN")
        concepts = check_concepts(concepts, pipe.tokenizer, method="FMN")
        hp = self.hparams
        gen = cpu_generator(seed)
        prompts = self.prompts(concepts, domain)
        n = hp["num_images"]
        # Image j shows concept j // n (drawn by the unedited model).
        seeds = [randint(2**31 - 1, gen) for _ in range(n * len(concepts))]
        owner = [j // n for j in range(n * len(concepts))]
        latents = generate_latents(pipe, [prompts[o] for o in owner], seeds,
                                   num_inference_steps=hp["sample_steps"],
                                   guidance_scale=hp["sample_guidance"], progress=self.progress,
                                   desc="FMN images")
        emb = encode_text(pipe, prompts)
        # The pooled end token only: FMN's repository (SD 2.1) pads with "!", so its pooler
        # mask never covered padding; with SD v1.x's end-token padding we keep that meaning.
        positions = torch.stack([concept_positions(pipe.tokenizer, p, c, use_pooler=hp["use_pooler"],
                                                   pooler="first")
                                 for p, c in zip(prompts, concepts, strict=True)])

        unet = pipe.unet
        device, dtype = unet.device, unet.dtype
        sched = training_scheduler(pipe)
        n_t = sched.config.num_train_timesteps
        state: dict[str, Any] = {"probs": [], "pos": None}

        def record(name: str, probs: torch.Tensor, batch: int) -> None:
            heads = probs.shape[0] // batch
            pos = state["pos"].to(probs.device)
            for b in range(batch):
                state["probs"].append(probs[b * heads : (b + 1) * heads][:, :, pos[b]].reshape(-1))

        recorder = CrossAttnRecorder(record)
        keep = (lambda name: ".attn2." in name) if hp["only_optimize_ca"] else (lambda name: True)
        bs = hp["train_batch_size"]
        with fp32_training(unet), attn2_processors(unet, lambda name, m: Attn2Processor(name, recorder)):
            params = train_only(unet, keep)
            opt = torch.optim.AdamW(params.values(), lr=hp["learning_rate"],
                                    weight_decay=hp["adam_weight_decay"])
            order: list[int] = []
            bar = tqdm(range(hp["max_train_steps"]), desc="FMN", disable=not self.progress)
            for _ in bar:
                idx = []
                for _ in range(bs):
                    if not order:
                        order = torch.randperm(len(latents), generator=gen).tolist()
                    idx.append(order.pop())
                who = [owner[i] for i in idx]
                x0 = latents[idx].to(device, torch.float32)
                noise = randn(x0.shape, gen, like=x0)
                t = torch.randint(0, n_t, (len(idx),), generator=gen).to(device)
                xt = sched.add_noise(x0, noise, t)
                state["pos"], state["probs"] = positions[who], []
                with autocast(device, dtype):
                    unet(xt, t, encoder_hidden_states=emb[who].to(device, torch.float32))
                loss = torch.cat(state["probs"]).float().norm()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(list(params.values()), hp["max_grad_norm"])
                opt.step()
                bar.set_postfix(loss=f"{loss.item():.4g}")
        return pipe
