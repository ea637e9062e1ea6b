"""SalUn — Saliency Unlearning (Fan et al., ICLR 2024), the Stable Diffusion variant.

1. **Weight saliency.** On images of the concept (drawn by the model itself, as the paper
   does for nudity), the gradient of the forgetting loss

       ℓ_f = −|ε − ((1 + g) ε_θ(x_t, c) − g ε_θ(x_t, ""))|²

   (classifier-free guidance ``g`` = ``mask_guidance``) is summed over the forget set; the
   ``mask_ratio`` fraction of UNet weights with the largest ``|Σ ∇ℓ_f|`` (ranked over the
   whole UNet) form the saliency mask.
2. **Random-label unlearning restricted to the mask.** The forget images captioned with the
   concept are fit to the model's own prediction for another concept of the domain (the
   "pseudo" label), while the retain images keep the plain diffusion loss:

       L = |ε_θ(x_t, c) − sg(ε_θ(x_t, c_pseudo))|² + α |ε_θ(x_r,t, c_r) − ε|²

   and every gradient is multiplied by the mask before the Adam step, so only salient
   weights move.

Defaults follow the repository (OPTML-Group/Unlearn-Saliency @ a6e89fd, ``SD/``:
``generate_mask.py``, then ``random_label.py`` as its README runs it for objects): mask ratio
0.5 (the most salient half: ``generate_mask.py`` ranks ``−|g|`` ascending and keeps ranks below
the threshold), guidance 7.5 for the mask, the whole UNet, Adam 1e-5, 5 epochs, batch 8,
α = 0.5, and the fixed pseudo label of ``random_label.py`` — class ``(c + 1) mod 10``, here
the concept after the erased one in the domain's order (``pseudo_label: next``). Nudity
(``nsfw_removal.py`` as the README runs it: α 0.1, 1 epoch, "a person wearing clothes" as
pseudo and retain label) is ``conf/preset/method_domain/salun_sd_nsfw.yaml``. The reference's
forget set is a class's Imagenette images (800 generated images for nudity); here
``num_images`` images are drawn by the model from the concept's prompts, and as many retain
images from the retain concepts. Card: ``docs/protocols/methods/salun.md``.
"""

from __future__ import annotations

import dataclasses
import math
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
    diffusion_target,
    domain_concept_names,
    domain_name,
    encode_text,
    erased_spellings,
    expand_others,
    for_domain,
    fp32_training,
    generate_latents,
    randint,
    randn,
    require_sd_pipeline,
    train_only,
    training_scheduler,
)

PARAMETER_GROUPS = ("full", "xattn")
PSEUDO_LABELS = ("next", "random")


def next_concept(concept: str, pseudo: Sequence[str], domain: Domain | None) -> str:
    """The fixed pseudo label of ``concept`` (``random_label.py``: class ``(c + 1) mod 10``): the
    first of ``pseudo`` after ``concept`` in the domain's order, cyclically; ``pseudo[0]`` when
    the domain does not list ``concept`` or none of its successors is a pseudo concept."""
    if isinstance(domain, Domain):
        order = domain_concept_names(domain)
        low = [x.lower() for x in order]
        spellings = erased_spellings([concept], domain)
        at = next((i for i, x in enumerate(low) if x in spellings), None)
        if at is not None:
            allowed = {p.lower(): p for p in pseudo}
            for step in range(1, len(order)):
                name = low[(at + step) % len(order)]
                if name in allowed:
                    return allowed[name]
    return pseudo[0]


def salun_parameter_filter(group: str):
    """``full``: the whole UNet (the repository's ``--train_method full``); ``xattn``: the
    cross-attention modules."""
    if group == "full":
        return lambda n: True
    if group == "xattn":
        return lambda n: ".attn2." in n
    raise UnknownChoiceError("SalUn parameter_group", group, PARAMETER_GROUPS)


def saliency_mask(gradients: dict[str, torch.Tensor], ratio: float) -> dict[str, torch.Tensor]:
    """Boolean masks of the ``ratio`` fraction of entries with the largest ``|gradient|``,
    ranked over all tensors together (ties at the threshold broken by order).

    The threshold is found by bisection over the float32 bit patterns of ``|gradient|`` (which
    order as the values do), counting per tensor, so that no flattened copy of every gradient
    is made: at SD scale that copy, its sort and its indices took three more times the UNet's
    size in memory than the gradients themselves.
    """
    if not 0.0 < ratio <= 1.0:
        raise ConfigError(f"SalUn mask_ratio must be in (0, 1], got {ratio}")
    total = sum(g.numel() for g in gradients.values())
    k = int(round(ratio * total))
    if k == 0:
        return {name: torch.zeros(g.shape, dtype=torch.bool, device=g.device) for name, g in gradients.items()}
    for name, g in gradients.items():
        if not torch.isfinite(g).all():
            raise ConfigError(f"SalUn saliency: the gradient of {name} is not finite; no mask can rank it")

    def count(bits: int, strict: bool = False) -> int:
        v = torch.tensor(bits, dtype=torch.int32).view(torch.float32).item()
        return sum(int((g.float().abs() > v).sum() if strict else (g.float().abs() >= v).sum())
                   for g in gradients.values())

    # the k-th largest |g| is the largest float v with at least k entries >= v
    lo, hi = 0, 0x7F800000  # 0.0 (count = total >= k) and +inf (count 0 < k)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) >= k:
            lo = mid
        else:
            hi = mid
    threshold = torch.tensor(lo, dtype=torch.int32).view(torch.float32).item()
    ties = k - count(lo, strict=True)  # entries equal to the threshold still to take, in order
    out = {}
    for name, g in gradients.items():
        a = g.float().abs()
        keep = a > threshold
        if ties > 0:
            eq = (a == threshold).flatten()
            take = eq & (eq.cumsum(0) <= ties)
            keep |= take.reshape(g.shape)
            ties -= int(take.sum())
        out[name] = keep
    return out


class SalUnMethod(ErasureMethod):
    """Saliency Unlearning: random-label unlearning on the most salient UNet weights.

    Args:
        prompt_templates: per domain, the caption template(s) with ``{}`` for the forget and
            retain images (a string or a list; the image's index picks the template).
        pseudo_concepts: per domain, the concepts whose prediction a forget image is fit to
            (``"<others>"`` = the domain's other concepts).
        pseudo_label: ``next`` (the reference, ``conf/method/salun.yaml``: one fixed label per
            erased concept, the first pseudo concept after it in the domain's order, cyclically —
            ``(c + 1) mod 10``; the first pseudo concept when the domain does not list the erased
            one) or ``random`` (one pseudo concept drawn per image; the default here).
        retain_concepts: per domain, the concepts of the retain images (``"<others>"`` too).
        mask_ratio: fraction of UNet weights in the saliency mask.
        mask_guidance: ``g`` of the forgetting loss that defines saliency.
        parameter_group: ``full`` or ``xattn`` (weights eligible for the mask).
        learning_rate / epochs / train_batch_size: Adam, passes over the forget set, batch.
        alpha: weight of the retain loss.
        num_images: forget images (and as many retain images) drawn by the model.
        sample_steps / sample_guidance: sampler settings for those images.
        progress: show progress bars (not a hyper-parameter).
    """

    name = "salun"
    version = "2"
    edited_components = ("unet",)

    def __init__(
        self,
        prompt_templates: Any = "an image of a {}",
        pseudo_concepts: Any = "<others>",
        retain_concepts: Any = "<others>",
        pseudo_label: str = "random",
        mask_ratio: float = 0.5,
        mask_guidance: float = 7.5,
        parameter_group: str = "full",
        learning_rate: float = 1e-5,
        epochs: int = 5,
        train_batch_size: int = 8,
        alpha: float = 0.5,
        num_images: int = 800,
        sample_steps: int = 50,
        sample_guidance: float = 7.5,
        progress: bool = True,
    ) -> None:
        salun_parameter_filter(parameter_group)
        if pseudo_label not in PSEUDO_LABELS:
            raise UnknownChoiceError("SalUn pseudo_label", str(pseudo_label), PSEUDO_LABELS)
        if not 0.0 < float(mask_ratio) <= 1.0:
            raise ConfigError(f"SalUn mask_ratio must be in (0, 1], got {mask_ratio}")
        if int(train_batch_size) < 1 or int(num_images) < 1 or int(epochs) < 0:
            raise ConfigError("SalUn needs train_batch_size >= 1, num_images >= 1 and epochs >= 0")
        super().__init__(
            prompt_templates=to_python(prompt_templates), pseudo_concepts=to_python(pseudo_concepts),
            retain_concepts=to_python(retain_concepts), pseudo_label=str(pseudo_label), mask_ratio=float(mask_ratio),
            mask_guidance=float(mask_guidance), parameter_group=parameter_group,
            learning_rate=float(learning_rate), epochs=int(epochs), train_batch_size=int(train_batch_size),
            alpha=float(alpha), num_images=int(num_images), sample_steps=int(sample_steps),
            sample_guidance=float(sample_guidance),
        )
        self.progress = bool(progress)
        self.last_mask: dict[str, torch.Tensor] | None = None  # the mask of the last erase (tests)

    def _templates(self, domain: Domain | None) -> list[str]:
        t = for_domain(self.hparams["prompt_templates"], domain, what="SalUn prompt_templates")
        templates = [t] if isinstance(t, str) else list(t or [])
        bad = [x for x in templates if x.count("{}") != 1]
        if bad or not templates:
            raise ConfigError(f"SalUn prompt_templates need exactly one '{{}}' each; bad: {bad or 'empty list'}")
        return templates

    def _concept_list(self, key: str, concepts: Sequence[str], domain: Domain | None) -> list[str]:
        names = expand_others(for_domain(self.hparams[key], domain, what=f"SalUn {key}"), domain, concepts)
        if not names:
            raise ConfigError(f"SalUn {key} for domain {domain_name(domain)!r} is empty once the erased concepts are "
                              "removed; give at least one other concept (or '<others>')")
        return names

    def erase(self, pipe: Any, concepts: Sequence[str], *, seed: int = 0, domain: Domain | None = None) -> Any:
        """Compute the saliency mask, then unlearn ``concepts`` on the masked UNet weights."""
        require_sd_pipeline(pipe, "SalUn")
        concepts = check_concepts(concepts, pipe.tokenizer, method="SalUn")
        gen = cpu_generator(seed)
        data = self._training_set(pipe, concepts, domain, gen)
        unet = pipe.unet
        dtype = unet.dtype  # the pipeline's own precision (autocast), before the fp32 master weights
        sched = training_scheduler(pipe)
        with fp32_training(unet):
            params = train_only(unet, salun_parameter_filter(self.hparams["parameter_group"]))
            grads = self._forget_gradients(unet, params, sched, data, gen, dtype)
            mask = {k: m.to(unet.device) for k, m in saliency_mask(grads, self.hparams["mask_ratio"]).items()}
            del grads
            self.last_mask = {k: m.cpu() for k, m in mask.items()}
            self._unlearn(unet, params, mask, sched, data, gen, dtype)
        return pipe

    def _training_set(self, pipe: Any, concepts: list[str], domain: Domain | None,
                      gen: torch.Generator) -> _TrainingSet:
        """``num_images`` forget images of ``concepts`` and as many retain images, drawn by the
        unedited model, with the embeddings of their captions and of each forget image's
        pseudo label (a retain/pseudo concept drawn per image)."""
        hp = self.hparams
        templates = self._templates(domain)
        pseudo = self._concept_list("pseudo_concepts", concepts, domain)
        retain = self._concept_list("retain_concepts", concepts, domain)
        n = hp["num_images"]
        forget_prompts = [templates[i % len(templates)].format(concepts[i % len(concepts)]) for i in range(n)]
        if hp["pseudo_label"] == "next":
            fixed = {c: next_concept(c, pseudo, domain) for c in concepts}
            pseudo_prompts = [templates[i % len(templates)].format(fixed[concepts[i % len(concepts)]])
                              for i in range(n)]
        else:
            pseudo_prompts = [templates[i % len(templates)].format(pseudo[randint(len(pseudo), gen)])
                              for i in range(n)]
        retain_prompts = [templates[i % len(templates)].format(retain[randint(len(retain), gen)]) for i in range(n)]
        seeds = [randint(2**31 - 1, gen) for _ in range(2 * n)]
        sample = dict(num_inference_steps=hp["sample_steps"], guidance_scale=hp["sample_guidance"],
                      progress=self.progress)
        x_forget = generate_latents(pipe, forget_prompts, seeds[:n], desc="SalUn forget images", **sample)
        x_retain = generate_latents(pipe, retain_prompts, seeds[n:], desc="SalUn retain images", **sample)
        return _TrainingSet(x_forget=x_forget, x_retain=x_retain, c_forget=encode_text(pipe, forget_prompts),
                            c_pseudo=encode_text(pipe, pseudo_prompts), c_retain=encode_text(pipe, retain_prompts),
                            c_null=encode_text(pipe, [""]))

    def _forget_gradients(self, unet: Any, params: dict[str, torch.nn.Parameter], sched: Any,
                          data: _TrainingSet, gen: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Step 1, saliency: the sum over the forget set of the forgetting loss's gradients."""
        hp = self.hparams
        device, n, bs, g = unet.device, hp["num_images"], hp["train_batch_size"], hp["mask_guidance"]
        # backward accumulates the batches' gradients in .grad (the same sums as adding them up
        # one by one, without a second UNet-sized buffer)
        unet.zero_grad(set_to_none=True)
        for s in tqdm(range(0, n, bs), desc="SalUn saliency", disable=not self.progress, leave=False):
            idx = list(range(s, min(s + bs, n)))
            x0, noise, t, xt = _noised(sched, data.x_forget, idx, gen, device)
            with autocast(device, dtype):
                e_c = unet(xt, t, encoder_hidden_states=data.c_forget[idx].to(device, torch.float32)).sample
                e_0 = unet(xt, t, encoder_hidden_states=data.c_null.expand(len(idx), -1, -1).to(
                    device, torch.float32)).sample
            pred = (1 + g) * e_c.float() - g * e_0.float()
            loss = -F.mse_loss(pred, diffusion_target(sched, x0, noise, t).float())
            loss.backward()
        grads = {k: p.grad if p.grad is not None else torch.zeros_like(p) for k, p in params.items()}
        for p in params.values():
            p.grad = None
        return grads

    def _unlearn(self, unet: Any, params: dict[str, torch.nn.Parameter], mask: dict[str, torch.Tensor],
                 sched: Any, data: _TrainingSet, gen: torch.Generator, dtype: torch.dtype) -> None:
        """Step 2: random-label unlearning, every gradient multiplied by the saliency mask."""
        hp = self.hparams
        device, n, bs = unet.device, hp["num_images"], hp["train_batch_size"]
        opt = torch.optim.Adam(params.values(), lr=hp["learning_rate"])
        f_order: list[int] = []
        r_order: list[int] = []
        bar = tqdm(range(hp["epochs"] * math.ceil(n / bs)), desc="SalUn", disable=not self.progress)
        for _ in bar:
            fi, ri = [], []
            for _ in range(bs):
                if not f_order:
                    f_order = torch.randperm(n, generator=gen).tolist()
                if not r_order:
                    r_order = torch.randperm(n, generator=gen).tolist()
                fi.append(f_order.pop())
                ri.append(r_order.pop())
            _, _, t, xt = _noised(sched, data.x_forget, fi, gen, device)
            r0, r_noise, r_t, r_xt = _noised(sched, data.x_retain, ri, gen, device)
            with autocast(device, dtype):
                with torch.no_grad():
                    target = unet(xt, t, encoder_hidden_states=data.c_pseudo[fi].to(device, torch.float32)).sample
                pred = unet(xt, t, encoder_hidden_states=data.c_forget[fi].to(device, torch.float32)).sample
                r_pred = unet(r_xt, r_t, encoder_hidden_states=data.c_retain[ri].to(device, torch.float32)).sample
            forget_loss = F.mse_loss(pred.float(), target.float())
            retain_loss = F.mse_loss(r_pred.float(), diffusion_target(sched, r0, r_noise, r_t).float())
            loss = forget_loss + hp["alpha"] * retain_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for k, p in params.items():
                if p.grad is not None:
                    p.grad.mul_(mask[k])
            opt.step()
            bar.set_postfix(forget=f"{forget_loss.item():.4g}", retain=f"{retain_loss.item():.4g}")


@dataclasses.dataclass
class _TrainingSet:
    """What SalUn trains on: forget and retain latents ``(N, C, h, w)`` drawn by the model, and
    the text embeddings of the forget captions, their pseudo labels, the retain captions and
    the empty prompt."""

    x_forget: torch.Tensor
    x_retain: torch.Tensor
    c_forget: torch.Tensor
    c_pseudo: torch.Tensor
    c_retain: torch.Tensor
    c_null: torch.Tensor


def _noised(sched: Any, latents: torch.Tensor, idx: list[int], gen: torch.Generator,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x0, noise, t, x_t)`` of the latents ``idx``: noise, then timesteps, drawn from ``gen``."""
    x0 = latents[idx].to(device, torch.float32)
    noise = randn(x0.shape, gen, like=x0)
    t = torch.randint(0, sched.config.num_train_timesteps, (len(idx),), generator=gen).to(device)
    return x0, noise, t, sched.add_noise(x0, noise, t)
