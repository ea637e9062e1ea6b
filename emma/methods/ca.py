"""CA — Concept Ablation (Kumari et al., ICCV 2023).

The model's distribution for a target concept is matched to that of an *anchor* concept
(Grumpy Cat -> cat, Van Gogh painting -> painting). Training images are drawn by the model
itself from anchor prompts ("a photo of a cat"); each is paired with the same prompt naming
the target ("a photo of a grumpy cat"). With ``x_t`` the noised anchor image:

- ``loss="noise"`` (noise-based; EMMA's choice): ``|ε_θ(x_t, c_target) − ε|²`` — fine-tune
  on anchor images captioned with the target;
- ``loss="model"`` (model-based; the repository's default):
  ``|ε_θ(x_t, c_target) − sg(ε_θ(x_t, c_anchor))|²``.

Defaults follow the reference (nupurkmr9/concept-ablation @ c11fb1b, ``diffusers/``, the
README's commands): cross-attention key/value fine-tuning, 100 steps, base learning rate 2e-6
scaled by the batch (4 images on each of 2 GPUs -> 1.6e-5), AdamW, 1000 anchor images (25
steps, guidance 6), horizontal flips, and for objects the random resize augmentation whose
loss is masked to the image (with "a far away" / "zoomed in" words in the prompt). Styles
anchor on its 199 painting captions (``"<data:ca_captions_painting>"``) with the target
written "<caption>, in the style of <target>" or "in <target>'s style, <caption>" and no
resize; nudity anchors on its 203 people captions with "<target>, <caption>"-style prompts,
every attention projection at 4e-6 for 400 steps with prior preservation and the target as
the anchor images' negative prompt (``conf/preset/method_domain/ca*_sd_*.yaml``). Object
anchors are EMMA's COCO super-categories in caption templates (the reference asks an LLM for
captions of the anchor). Card: ``docs/protocols/methods/ca.md``.
"""

from __future__ import annotations

import contextlib
import re
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
#: How a target prompt is written from an anchor prompt: ``replace`` (the anchor's name replaced
#: by the concept's: the reference's objects), ``style`` and ``nudity`` (the reference's
#: ``__getprompt__`` phrasings, one of three drawn per sample).
TARGET_PROMPTS = ("replace", "style", "nudity")
STYLE_PHRASES = ("{caption}, in the style of {target}", "in {target}'s style, {caption}",
                 "in {target}'s style, {caption}")
NUDITY_PHRASES = ("{target}, {caption}", "in {target} style, {caption}", "{caption}, {target}")


def target_phrases(mode: str) -> tuple[str, ...]:
    """The reference's target-prompt phrasings of ``mode`` (``style`` / ``nudity``)."""
    return STYLE_PHRASES if mode == "style" else NUDITY_PHRASES


def augment_latent(x0: torch.Tensor, gen: torch.Generator, *, augment: bool,
                   hflip: bool) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The reference's image augmentation (``CustomDiffusionDataset``) on one latent ``(C, h, w)``:
    a horizontal flip with probability ½ (``hflip``), then (``augment``) a random resize — with
    probability 0.66 to between a third and the whole size, placed at a random spot on a blank
    canvas, else to 1.2-1.4 times the size, randomly cropped — and the loss mask: the image's
    region less one latent pixel at its border (the whole latent when enlarged). Returns the
    latent, the mask ``(1, h, w)`` and the words the reference prepends to the prompt ("a far
    away ", "very small ", "zoomed in ", "close up " or ""). Done on latents (the harness draws
    the anchor images as latents), at 8 pixels per latent pixel."""
    c, h, w = x0.shape
    if hflip and randint(2, gen) == 1:
        x0 = x0.flip(-1)
    size = h * 8
    scale = size
    if augment:
        if float(torch.rand(1, generator=gen)) < 0.66:
            scale = randint(size + 1, gen, low=size // 3)
        else:
            scale = randint(int(1.4 * size), gen, low=int(1.2 * size))
    inner = max(1, round(scale / 8))
    outer_px, inner_px = (scale, size) if scale > size else (size, scale)
    top = randint(outer_px - inner_px + 1, gen) // 8
    left = randint(outer_px - inner_px + 1, gen) // 8
    resized = x0 if inner == h else F.interpolate(x0[None], size=(inner, inner), mode="bilinear",
                                                  align_corners=False)[0]
    mask = torch.zeros(1, h, w)
    if scale > size:
        out = resized[:, top : top + h, left : left + w]
        mask[:] = 1.0
    else:
        out = torch.zeros_like(x0)
        out[:, top : top + inner, left : left + inner] = resized
        mask[:, top + 1 : top + inner - 1, left + 1 : left + inner - 1] = 1.0
    words = ""
    if scale < 0.6 * size:
        words = ("a far away ", "very small ")[randint(2, gen)]
    elif scale > size:
        words = ("zoomed in ", "close up ")[randint(2, gen)]
    return out, mask, words


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
        anchor_prompts: per domain, captions the anchor images are drawn from instead of the
            templates (``"<data:ca_captions_painting>"``), or ``None``.
        target_prompts: per domain, how a target prompt is written from an anchor prompt:
            ``replace``, ``style`` or ``nudity`` (:data:`TARGET_PROMPTS`).
        anchor_negative_prompt: per domain, the negative prompt of the anchor images (``{}``:
            the concept; the reference's nudity setting), or ``None``.
        augment: the reference's random resize augmentation with its masked loss.
        hflip: the reference's random horizontal flip (``--hflip``).
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
    version = "3"
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
        anchor_prompts: Any = None,
        target_prompts: Any = "replace",
        anchor_negative_prompt: Any = None,
        augment: bool = False,
        hflip: bool = False,
        progress: bool = True,
    ) -> None:
        if loss not in LOSSES:
            raise UnknownChoiceError("CA loss", loss, LOSSES)
        target_prompts = to_python(target_prompts)
        modes = target_prompts.values() if isinstance(target_prompts, dict) else [target_prompts]
        for mode in modes:
            if mode not in TARGET_PROMPTS:
                raise UnknownChoiceError("CA target_prompts", str(mode), TARGET_PROMPTS)
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
            anchor_prompts=to_python(anchor_prompts), target_prompts=to_python(target_prompts),
            anchor_negative_prompt=to_python(anchor_negative_prompt), augment=bool(augment), hflip=bool(hflip),
        )
        self.progress = bool(progress)

    def prompt_pairs(self, concepts: Sequence[str], domain: Domain | None) -> list[tuple[str, str]]:
        """(anchor prompt, target) pairs for every concept: every template (or caption). The
        target is the target prompt for ``target_prompts: replace``; for ``style`` / ``nudity``
        it is the concept, which :func:`target_phrases` writes around the anchor prompt."""
        return [(a, t) for a, t, _ in self._pairs(concepts, domain)]

    def _pairs(self, concepts: Sequence[str], domain: Domain | None) -> list[tuple[str, str, str]]:
        """:meth:`prompt_pairs` with the concept of each pair."""
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
        captions = for_domain(hp["anchor_prompts"], domain, what="CA anchor_prompts")
        mode = for_domain(hp["target_prompts"], domain, what="CA target_prompts")
        pairs = []
        for c in concepts:
            names = self.anchors_of(anchors, c, concepts, domain)
            if captions:  # the reference's caption lists: anchor prompts as they are
                for cap in ([captions] if isinstance(captions, str) else captions):
                    a = next((n for n in names if n.lower() in cap.lower()), names[0])
                    target = re.sub(re.escape(a), c, cap, flags=re.IGNORECASE) if mode == "replace" else c
                    pairs.append((cap, target, c))
            elif mode == "replace":
                pairs += [(t.format(a), t.format(c), c) for t in templates for a in names]
            else:
                pairs += [(t.format(a), c, c) for t in templates for a in names]
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
        triples = self._pairs(concepts, domain)
        pairs = [(a, t) for a, t, _ in triples]
        owners = [c for _, _, c in triples]
        mode = for_domain(hp["target_prompts"], domain, what="CA target_prompts")
        negative = for_domain(hp["anchor_negative_prompt"], domain, what="CA anchor_negative_prompt")

        # Anchor images drawn by the unedited model; image i uses pair i mod len(pairs).
        n = hp["num_class_images"]
        pair_of = [i % len(pairs) for i in range(n)]
        seeds = [randint(2**31 - 1, gen) for _ in range(n)]
        latents = generate_latents(pipe, [pairs[j][0] for j in pair_of], seeds,
                                   num_inference_steps=hp["sample_steps"],
                                   guidance_scale=hp["sample_guidance"],
                                   progress=self.progress, desc="CA anchor images",
                                   negative_prompts=None if not negative else
                                   [negative.format(owners[j]) for j in pair_of])
        anchor_emb = encode_text(pipe, [a for a, _ in pairs])
        # The reference's data pipeline (flips, resize augmentation with a masked loss, target
        # prompts written per sample) or, without any of it, fixed target prompts per pair.
        per_sample = hp["augment"] or hp["hflip"] or mode != "replace"
        target_emb = None if per_sample else encode_text(pipe, [t for _, t in pairs])

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
                pj = [pair_of[i] for i in idx]
                mask = None
                if per_sample:
                    views, masks, texts = [], [], []
                    for i, j in zip(idx, pj, strict=True):
                        view, m, words = augment_latent(latents[i], gen, augment=hp["augment"], hflip=hp["hflip"])
                        views.append(view)
                        masks.append(m)
                        if mode == "replace":
                            texts.append(words + pairs[j][1])
                        else:
                            phrase = target_phrases(mode)[randint(3, gen)]
                            texts.append(words + phrase.format(caption=pairs[j][0], target=pairs[j][1]))
                    x0 = torch.stack(views).to(device, torch.float32)
                    mask = torch.stack(masks).to(device)
                    c_target = encode_text(pipe, texts).to(device, torch.float32)
                else:
                    x0 = latents[idx].to(device, torch.float32)
                    c_target = target_emb[pj].to(device, torch.float32)
                noise = randn(x0.shape, gen, like=x0)
                t = torch.randint(0, n_t, (len(idx),), generator=gen).to(device)
                xt = sched.add_noise(x0, noise, t)
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
                if mask is None:
                    loss = F.mse_loss(pred.float(), target.float())
                else:  # the reference: the mean over each image's valid region, then over the batch
                    # (its sum runs over the channels too, its count over the pixels only)
                    err = F.mse_loss(pred.float(), target.float(), reduction="none") * mask
                    loss = (err.sum((1, 2, 3)) / mask.sum((1, 2, 3)).clamp_min(1.0)).mean()
                if prior is not None:
                    loss = loss + hp["prior_loss_weight"] * F.mse_loss(
                        prior.float(), diffusion_target(sched, x0, noise, t).float())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(list(params.values()), hp["max_grad_norm"])
                opt.step()
                bar.set_postfix(loss=f"{loss.item():.4g}")
        return pipe
