"""CA — Concept Ablation (Kumari et al., ICCV 2023).

The model's distribution for a target concept is matched to that of an *anchor* concept
(Grumpy Cat -> cat, Van Gogh painting -> painting). Training images are drawn by the model
itself from anchor prompts ("a photo of a cat"); each is paired with the same prompt naming
the target ("a photo of a grumpy cat"). With ``x_t`` the noised anchor image:

- ``loss="noise"`` (noise-based; EMMA's choice): ``|ε_θ(x_t, c_target) − ε|²`` — fine-tune
  on anchor images captioned with the target;
- ``loss="model"`` (model-based; the repository's default):
  ``|ε_θ(x_t, c_target) − sg(ε_θ(x_t, c_anchor))|²``.

Defaults follow the paper's object/style setting (nupurkmr9/concept-ablation): cross-attention
key/value fine-tuning, 100 steps, base learning rate 2e-6 scaled by the batch (4 images on
each of 2 GPUs -> 1.6e-5), Adam(W), 1000 generated anchor images. Anchors per domain follow
EMMA's generic concepts (objects -> their COCO super-category, styles -> painting, ...).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from emma.api.domain import Domain
from emma.api.method import ErasureMethod
from emma.config import to_python
from emma.errors import ConfigError, UnknownChoiceError
from emma.methods._common import (
    OTHERS,
    autocast,
    check_concepts,
    cpu_generator,
    diffusion_target,
    encode_text,
    expand_others,
    for_concept,
    for_domain,
    fp32_training,
    generate_latents,
    randint,
    randn,
    require_sd_pipeline,
    train_only,
    training_scheduler,
)

LOSSES = ("noise", "model")
PARAMETER_GROUPS = ("cross-attn", "attn", "full-weight")
DEFAULT_TEMPLATES: tuple[str, ...] = ("a photo of a {}", "a picture of a {}", "an image of a {}")


def ca_parameter_filter(group: str):
    """``cross-attn``: ``attn2.to_k``/``to_v``; ``attn``: every q/k/v/out projection of self-
    and cross-attention; ``full-weight``: the whole UNet."""
    if group == "cross-attn":
        return lambda n: ".attn2.to_k." in n or ".attn2.to_v." in n
    if group == "attn":
        return lambda n: any(f".{p}." in n for p in ("to_q", "to_k", "to_v", "to_out"))
    if group == "full-weight":
        return lambda n: True
    raise UnknownChoiceError("CA parameter_group", group, PARAMETER_GROUPS)


@contextlib.contextmanager
def start_token_detached(unet: torch.nn.Module) -> Iterator[None]:
    """While inside, no gradient flows through the cross-attention keys and values of the
    start-of-text token (position 0), as in the reference's Custom Diffusion attention
    processor: that token is the same in every prompt, so fitting it would move every prompt."""

    def hook(_module: torch.nn.Module, _inputs: Any, out: torch.Tensor) -> torch.Tensor:
        return torch.cat([out[:, :1].detach(), out[:, 1:]], dim=1)

    handles = [m.register_forward_hook(hook) for n, m in unet.named_modules()
               if n.endswith((".attn2.to_k", ".attn2.to_v"))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class ConceptAblationMethod(ErasureMethod):
    """Ablating Concepts in Text-to-Image Diffusion Models.

    Args:
        loss: ``noise`` (noise-based) or ``model`` (model-based).
        anchor_concepts: per domain, the anchor of each concept (a string or
            ``{concept: anchor, _default: anchor}``); an anchor may also be a list of names,
            ``"<others>"`` standing for the domain's concepts that are not erased.
        prompt_templates: per domain, caption templates with ``{}`` (filled with the anchor for
            the images and the anchor prompt, with the concept for the target prompt).
        parameter_group: ``cross-attn``, ``attn`` or ``full-weight``.
        learning_rate: base learning rate; multiplied by ``train_batch_size`` when ``scale_lr``.
        scale_lr: scale the learning rate by the batch size (the paper's ``--scale_lr``).
        train_batch_size: images per step (the paper: 4 per GPU on 2 GPUs).
        max_train_steps: optimisation steps.
        num_class_images: anchor images drawn before training.
        prior_preservation: also fit the anchor prompt to its own images (``--with_prior_preservation``,
            for targets whose name contains the anchor, e.g. "grumpy cat" / "cat").
        prior_loss_weight: weight of that term.
        adam_weight_decay / max_grad_norm: optimiser settings (diffusers training script).
        sample_steps / sample_guidance: sampler settings for the anchor images.
        detach_start_token: no gradient through the start token's cross-attention keys and
            values (the reference trains with this; see :func:`start_token_detached`).
        progress: show progress bars (not a hyper-parameter).
    """

    name = "ca"
    version = "2"
    edited_components = ("unet",)

    def __init__(
        self,
        loss: str = "noise",
        anchor_concepts: Any = "object",
        prompt_templates: Any = None,
        parameter_group: str = "cross-attn",
        learning_rate: float = 2e-6,
        scale_lr: bool = True,
        train_batch_size: int = 8,
        max_train_steps: int = 100,
        num_class_images: int = 1000,
        prior_preservation: bool = False,
        prior_loss_weight: float = 1.0,
        adam_weight_decay: float = 1e-2,
        max_grad_norm: float = 1.0,
        sample_steps: int = 50,
        sample_guidance: float = 6.0,
        detach_start_token: bool = True,
        progress: bool = True,
    ) -> None:
        if loss not in LOSSES:
            raise UnknownChoiceError("CA loss", loss, LOSSES)
        ca_parameter_filter(parameter_group)
        if int(train_batch_size) < 1 or int(num_class_images) < 1:
            raise ConfigError("CA needs train_batch_size >= 1 and num_class_images >= 1")
        super().__init__(
            loss=loss, anchor_concepts=to_python(anchor_concepts), prompt_templates=to_python(prompt_templates),
            parameter_group=parameter_group, learning_rate=float(learning_rate), scale_lr=bool(scale_lr),
            train_batch_size=int(train_batch_size), max_train_steps=int(max_train_steps),
            num_class_images=int(num_class_images), prior_preservation=bool(prior_preservation),
            prior_loss_weight=float(prior_loss_weight), adam_weight_decay=float(adam_weight_decay),
            max_grad_norm=float(max_grad_norm), sample_steps=int(sample_steps),
            sample_guidance=float(sample_guidance), detach_start_token=bool(detach_start_token),
        )
        self.progress = bool(progress)

    def prompt_pairs(self, concepts: Sequence[str], domain: Domain | None) -> list[tuple[str, str]]:
        """(anchor prompt, target prompt) pairs: every template, for every concept."""
        hp = self.hparams
        anchors = for_domain(hp["anchor_concepts"], domain, what="CA anchor_concepts")
        table = hp["prompt_templates"]
        if table is None:
            templates = list(DEFAULT_TEMPLATES)
        elif isinstance(table, dict):
            templates = list(for_domain(table, domain, what="CA prompt_templates"))
        else:
            templates = list(table)
        bad = [t for t in templates if t.count("{}") != 1]
        if bad or not templates:
            raise ConfigError(f"CA prompt_templates need exactly one '{{}}' each; bad: {bad or 'empty list'}")
        pairs = []
        for c in concepts:
            names = self.anchors_of(anchors, c, concepts, domain)
            pairs += [(t.format(a), t.format(c)) for t in templates for a in names]
        return pairs

    @staticmethod
    def anchors_of(anchors: Any, concept: str, erased: Sequence[str], domain: Domain | None) -> list[str]:
        """The anchor names of ``concept``: one string, or a list where ``"<others>"`` stands
        for the domain's concepts that are not erased (anchor images then never show the
        erased concept, which a generic anchor such as "shape" may draw)."""
        a = for_concept(anchors, concept, what="CA anchor_concepts")
        listed = [a] if isinstance(a, str) else list(a or [])
        for name in listed:
            if not isinstance(name, str) or not name.strip():
                raise ConfigError(f"CA anchor_concepts of {concept!r} must be names (or '{OTHERS}'); got {a!r}")
            if name.strip().lower() == concept.lower():
                raise ConfigError(f"CA anchor of {concept!r} is the concept itself; pick a different anchor")
        names = expand_others(listed, domain, erased) if OTHERS in listed else listed
        if not names:
            raise ConfigError(f"CA anchor_concepts of {concept!r} is empty (after removing the erased "
                              f"concepts from {a!r}); give at least one anchor")
        return names

    def erase(self, pipe: Any, concepts: Sequence[str], *, seed: int = 0, domain: Domain | None = None) -> Any:
        """Fine-tune ``pipe.unet`` so that target prompts draw what anchor prompts draw."""
        require_sd_pipeline(pipe, "CA")
        concepts = check_concepts(concepts, pipe.tokenizer, method="CA")
        hp = self.hparams
        gen = cpu_generator(seed)
        pairs = self.prompt_pairs(concepts, domain)

        # Anchor images drawn by the unedited model; image i uses pair i mod len(pairs).
        n = hp["num_class_images"]
        pair_of = [i % len(pairs) for i in range(n)]
        seeds = [randint(2**31 - 1, gen) for _ in range(n)]
        latents = generate_latents(pipe, [pairs[j][0] for j in pair_of], seeds,
                                   num_inference_steps=hp["sample_steps"],
                                   guidance_scale=hp["sample_guidance"],
                                   progress=self.progress, desc="CA anchor images")
        anchor_emb = encode_text(pipe, [a for a, _ in pairs])
        target_emb = encode_text(pipe, [t for _, t in pairs])

        unet = pipe.unet
        device, dtype = unet.device, unet.dtype
        sched = training_scheduler(pipe)
        n_t = sched.config.num_train_timesteps
        lr = hp["learning_rate"] * (hp["train_batch_size"] if hp["scale_lr"] else 1)
        bs = hp["train_batch_size"]
        detached = start_token_detached(unet) if hp["detach_start_token"] else contextlib.nullcontext()
        with fp32_training(unet), detached:
            params = train_only(unet, ca_parameter_filter(hp["parameter_group"]))
            opt = torch.optim.AdamW(params.values(), lr=lr, weight_decay=hp["adam_weight_decay"])
            order: list[int] = []
            bar = tqdm(range(hp["max_train_steps"]), desc=f"CA ({hp['loss']})", disable=not self.progress)
            for _ in bar:
                idx = []
                for _ in range(bs):
                    if not order:
                        order = torch.randperm(n, generator=gen).tolist()
                    idx.append(order.pop())
                x0 = latents[idx].to(device, torch.float32)
                noise = randn(x0.shape, gen, like=x0)
                t = torch.randint(0, n_t, (len(idx),), generator=gen).to(device)
                xt = sched.add_noise(x0, noise, t)
                pj = [pair_of[i] for i in idx]
                c_target = target_emb[pj].to(device, torch.float32)
                c_anchor = anchor_emb[pj].to(device, torch.float32)
                with autocast(device, dtype):
                    pred = unet(xt, t, encoder_hidden_states=c_target).sample
                    if hp["loss"] == "model":
                        with torch.no_grad():
                            target = unet(xt, t, encoder_hidden_states=c_anchor).sample
                    else:
                        target = diffusion_target(sched, x0, noise, t)
                    prior = None
                    if hp["prior_preservation"]:
                        prior = unet(xt, t, encoder_hidden_states=c_anchor).sample
                loss = F.mse_loss(pred.float(), target.float())
                if prior is not None:
                    loss = loss + hp["prior_loss_weight"] * F.mse_loss(
                        prior.float(), diffusion_target(sched, x0, noise, t).float())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(list(params.values()), hp["max_grad_norm"])
                opt.step()
                bar.set_postfix(loss=f"{loss.item():.4g}")
        return pipe
