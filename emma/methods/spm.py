"""SPM — one-dimensional adapters ("semi-permeable membranes", Lyu et al., CVPR 2024).

Each erased concept gets its own rank-1 adapter ``ΔW = up · down`` on every linear and
convolution layer inside the UNet's transformer blocks (``proj_in``, self- and
cross-attention projections, feed-forward, ``proj_out``). Only the adapter is trained; the
base model stays frozen. Per iteration (``train_spm.py`` of Con6924/SPM):

- ``x_t`` is drawn by DDIM with the adapter on (guidance 3, conditioned on the concept) for a
  random number of steps out of ``max_denoising_steps``;
- **erasure**: ``ε_θ+Δ(x_t, c) -> ε_θ(x_t, "") − s (ε_θ(x_t, c) − ε_θ(x_t, ""))``, ``s`` =
  ``guidance_scale`` (ESD's target with the frozen model);
- **latent anchoring**: for ``sampling_batch_size`` random text embeddings ``a`` (Gaussian
  directions, accepted with probability ``1 − cos(a, c)``, scaled to 0.8-1.2 times the
  concept embedding's norm) ``|ε_θ+Δ(x_t, a) − ε_θ(x_t, a)|²`` weighted by ``la_strength``.

Defaults are the repository's (``configs/*/config.yaml``, ``prompt.yaml``): rank 1, α 1,
3000 iterations, lr 1e-4 with cosine-with-restarts (500 warm-up steps, 3 cycles), 30
denoising steps, guidance 1, anchoring strength 1000 with 4 anchors. (The repository's
8-bit AdamW is plain AdamW here.)

**Facilitated Transport** (``infer_spm.py``; ``facilitated_transport: true``): at sampling
time each membrane acts with the strength of the prompt's match with its concept — the larger
of the cosine similarity of the two prompts' text-encoder outputs and the share of the
concept's tokens the prompt contains (``matching_metric: clipcos_tokenuni``) — so prompts
unrelated to the concept are drawn by an almost untouched model.
:meth:`SPMMethod.inference_guidance` returns a :class:`FacilitatedTransport` that sets the
UNet's weights per prompt and draws with the pipeline. Without it the membranes act at full
strength on every prompt.

The trained adapters are fused into the UNet at full strength (what the erase cache stores),
and kept on their own: :meth:`SPMMethod.save_adapter` writes them to one safetensors file that
:func:`load_spm_adapter` fuses into any base pipeline of the same architecture (the erase
cache keeps it too, for Facilitated Transport after a cached erasure).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from emma.api.domain import Domain
from emma.api.guidance import InferenceGuidance
from emma.api.method import ErasureMethod
from emma.config import to_python
from emma.errors import ConfigError
from emma.methods._common import (
    autocast,
    check_concepts,
    cpu_generator,
    domain_name,
    domain_template,
    encode_text,
    for_domain,
    fp32_training,
    randint,
    randn,
    require_sd_pipeline,
)

ADAPTER_FILE = "spm_adapter.safetensors"


def spm_target_modules(unet: nn.Module) -> dict[str, nn.Module]:
    """The layers SPM adapts: every ``nn.Linear`` / ``nn.Conv2d`` inside a ``Transformer2DModel``."""
    out: dict[str, nn.Module] = {}
    for name, module in unet.named_modules():
        if type(module).__name__ == "Transformer2DModel":
            for child, sub in module.named_modules():
                if isinstance(sub, (nn.Linear, nn.Conv2d)) and child:
                    out[f"{name}.{child}"] = sub
    if not out:
        raise ConfigError(f"{type(unet).__name__} has no transformer blocks for SPM to adapt")
    return out


class SPMAdapter(nn.Module):
    """A rank-``r`` adapter per target layer: ``down`` (kaiming init) then ``up`` (zeros)."""

    def __init__(self, targets: dict[str, nn.Module], rank: int, alpha: float, generator: torch.Generator) -> None:
        super().__init__()
        self.rank, self.alpha = int(rank), float(alpha)
        self.scale = self.alpha / self.rank
        self.names = list(targets)
        self.down = nn.ParameterList()
        self.up = nn.ParameterList()
        for m in targets.values():
            if isinstance(m, nn.Linear):
                d_in, d_out, k = m.in_features, m.out_features, ()
            else:
                d_in, d_out, k = m.in_channels, m.out_channels, tuple(m.kernel_size)
            fan_in = d_in * math.prod(k)
            bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)), as nn.Linear/LoRA
            down = (torch.rand((self.rank, d_in, *k), generator=generator) * 2 - 1) * bound
            self.down.append(nn.Parameter(down))
            self.up.append(nn.Parameter(torch.zeros((d_out, self.rank) + (1,) * len(k))))

    def delta(self, i: int) -> torch.Tensor:
        """The weight change of layer ``i`` (same shape as its weight)."""
        down, up = self.down[i], self.up[i]
        if down.dim() == 2:
            return (up @ down) * self.scale
        return torch.einsum("or,rikl->oikl", up[:, :, 0, 0], down) * self.scale

    def branch(self, i: int, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        down, up = self.down[i].to(x.dtype), self.up[i].to(x.dtype)
        if isinstance(module, nn.Linear):
            return F.linear(F.linear(x, down), up) * self.scale
        h = F.conv2d(x, down, stride=module.stride, padding=module.padding, dilation=module.dilation)
        return F.conv2d(h, up) * self.scale


@contextmanager
def adapter_active(targets: dict[str, nn.Module], adapter: SPMAdapter) -> Iterator[None]:
    """Add the adapter's branch to its layers' outputs (forward hooks, removed on exit)."""
    handles = []
    try:
        for i, module in enumerate(targets.values()):
            def hook(mod, inputs, output, i=i):
                return output + adapter.branch(i, mod, inputs[0])
            handles.append(module.register_forward_hook(hook))
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def fuse_adapter(unet: nn.Module, adapter: SPMAdapter, multiplier: float = 1.0) -> None:
    """``W += multiplier · up · down · α/r`` on every adapted layer."""
    targets = spm_target_modules(unet)
    missing = [n for n in adapter.names if n not in targets]
    if missing:
        raise ConfigError(f"the SPM adapter does not fit this UNet: no layer {missing[0]!r} "
                          f"({len(missing)} missing)")
    for i, name in enumerate(adapter.names):
        w = targets[name].weight
        d = adapter.delta(i).to(w.device, torch.float32)
        if d.shape != w.shape:
            raise ConfigError(f"the SPM adapter does not fit this UNet: {name} is {tuple(w.shape)}, "
                              f"the adapter's {tuple(d.shape)}")
        w.copy_((w.float() + multiplier * d).to(w.dtype))


def load_spm_adapter(pipe: Any, path: str | os.PathLike, multiplier: float = 1.0) -> dict[str, Any]:
    """Fuse the adapters saved by :meth:`SPMMethod.save_adapter` into ``pipe.unet``.

    Args:
        pipe: a base pipeline of the architecture the adapter was trained on.
        path: the adapter file, or the folder holding ``spm_adapter.safetensors``.
        multiplier: strength of the membrane (1 = as trained).

    Returns:
        The file's metadata (concepts, rank, alpha, method config).
    """
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        path = path / ADAPTER_FILE
    if not path.exists():
        raise ConfigError(f"no SPM adapter at {path}; save one with SPMMethod.save_adapter(folder)")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    info = json.loads(meta.get("spm", "{}"))
    for adapter in _adapters_from_tensors(tensors, info):
        fuse_adapter(pipe.unet, adapter, multiplier)
    return info


def _adapters_from_tensors(tensors: dict[str, torch.Tensor], info: dict[str, Any]) -> list[SPMAdapter]:
    out = []
    for j, _concept in enumerate(info.get("concepts", [])):
        names = info["layers"]
        ad = SPMAdapter.__new__(SPMAdapter)
        nn.Module.__init__(ad)
        ad.rank, ad.alpha = int(info["rank"]), float(info["alpha"])
        ad.scale = ad.alpha / ad.rank
        ad.names = list(names)
        ad.down = nn.ParameterList([nn.Parameter(tensors[f"{j}.{i}.down"]) for i in range(len(names))])
        ad.up = nn.ParameterList([nn.Parameter(tensors[f"{j}.{i}.up"]) for i in range(len(names))])
        out.append(ad)
    return out


MATCHING_METRICS = ("clipcos_tokenuni", "clipcos", "tokenuni")


@torch.no_grad()
def matching_scores(pipe: Any, concepts: Sequence[str], metric: str, *, prompts: Sequence[str] | None = None,
                    prompt_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """``(N, len(concepts))`` matching scores of ``infer_spm.py``: per prompt and concept, the
    larger of ``clipcos`` (cosine similarity of the flattened text-encoder outputs) and
    ``tokenuni`` (the share of the concept's tokens, special tokens left out, that the prompt
    contains). Given only ``prompt_embeds`` (no text), ``tokenuni`` cannot be computed and
    ``clipcos`` alone is used."""
    if metric not in MATCHING_METRICS:
        raise ConfigError(f"SPM matching_metric {metric!r}: use one of {', '.join(MATCHING_METRICS)}")
    tok = pipe.tokenizer
    if prompt_embeds is None:
        prompt_embeds = encode_text(pipe, list(prompts or []))
    concept_embeds = encode_text(pipe, list(concepts)).to(prompt_embeds.device, prompt_embeds.dtype)
    scores = []
    if "clipcos" in metric or prompts is None:
        scores.append(F.cosine_similarity(prompt_embeds.flatten(1)[:, None].float(),
                                          concept_embeds.flatten(1)[None].float(), dim=-1).cpu())
    if "tokenuni" in metric and prompts is not None:
        special = {t for t in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id)
                   if t is not None}
        def ids(text: str) -> set[int]:
            return set(tok(text, padding="max_length", max_length=tok.model_max_length, truncation=True)
                       .input_ids) - special
        want = [ids(c) for c in concepts]
        scores.append(torch.tensor([[len(ids(p) & w) / max(len(w), 1) for w in want] for p in prompts]))
    return torch.stack(scores).max(0).values


class FacilitatedTransport(InferenceGuidance):
    """SPM's Facilitated Transport: each image is drawn with every membrane at the strength of
    its prompt's matching score (:func:`matching_scores`) instead of full strength.

    The pipeline's UNet holds the membranes fused at full strength (the erased model); for a
    group of prompts with the same scores the adapted layers are set to ``W + Σ_j (m_j − 1) ΔW_j``,
    the pipeline draws, and the weights are put back exactly (from a copy)."""

    name = "spm_facilitated_transport"
    version = "1"

    def __init__(self, adapters: Sequence[SPMAdapter], concepts: Sequence[str], metric: str) -> None:
        if len(adapters) != len(concepts) or not adapters:
            raise ConfigError("Facilitated Transport needs one SPM adapter per erased concept")
        if metric not in MATCHING_METRICS:
            raise ConfigError(f"SPM matching_metric {metric!r}: use one of {', '.join(MATCHING_METRICS)}")
        self.adapters, self.concepts, self.metric = list(adapters), list(concepts), metric

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "matching_metric": self.metric,
                "concepts": self.concepts}

    def multipliers(self, pipe: Any, prompts: Sequence[str] | None = None,
                    prompt_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``(N, n_membranes)``: each membrane's strength for each prompt."""
        return matching_scores(pipe, self.concepts, self.metric, prompts=prompts, prompt_embeds=prompt_embeds)

    @torch.no_grad()
    def sample(self, pipe: Any, *, prompt: list[str] | None = None, prompt_embeds: torch.Tensor | None = None,
               negative_prompt: list[str] | None = None, negative_prompt_embeds: torch.Tensor | None = None,
               generator: list[torch.Generator], num_inference_steps: int, guidance_scale: float,
               height: int, width: int) -> torch.Tensor:
        mult = self.multipliers(pipe, prompt, prompt_embeds)
        groups: dict[tuple[float, ...], list[int]] = {}
        for i, row in enumerate(mult.tolist()):
            groups.setdefault(tuple(row), []).append(i)
        targets = spm_target_modules(pipe.unet)
        names = self.adapters[0].names
        originals = {n: targets[n].weight.detach().clone() for n in names}
        out = torch.empty(len(mult), 3, height, width)
        try:
            for row, idx in groups.items():
                for li, n in enumerate(names):
                    w = originals[n].float()
                    for ad, m in zip(self.adapters, row, strict=True):
                        w = w + (m - 1.0) * ad.delta(li).to(w.device, torch.float32)
                    targets[n].weight.copy_(w.to(targets[n].weight.dtype))
                kwargs: dict[str, Any] = dict(generator=[generator[i] for i in idx], output_type="pt",
                                              num_inference_steps=num_inference_steps,
                                              guidance_scale=guidance_scale, height=height, width=width)
                if prompt_embeds is not None:
                    kwargs["prompt_embeds"] = prompt_embeds[idx]
                else:
                    kwargs["prompt"] = [prompt[i] for i in idx]
                if negative_prompt_embeds is not None:
                    kwargs["negative_prompt_embeds"] = negative_prompt_embeds[idx]
                elif negative_prompt is not None:
                    kwargs["negative_prompt"] = [negative_prompt[i] for i in idx]
                out[idx] = pipe(**kwargs).images.float().cpu()
        finally:
            for n in names:
                targets[n].weight.copy_(originals[n])
        return out


class SPMMethod(ErasureMethod):
    """SPM: a rank-1 membrane per concept, trained with latent anchoring, fused into the UNet.

    Args:
        rank / alpha: adapter rank and scale (``α / rank`` multiplies the branch).
        iterations: training steps per concept.
        learning_rate: AdamW learning rate.
        lr_warmup_steps / lr_num_cycles: the cosine-with-hard-restarts schedule.
        max_denoising_steps: DDIM steps of the sampler that draws ``x_t``.
        start_guidance: classifier-free guidance of that sampler.
        guidance_scale: ``s`` of the erasure target.
        la_strength: weight of the latent-anchoring loss (0 = plain erasure).
        sampling_batch_size: random anchors per iteration.
        neutral_concepts: per domain, the neutral prompt of the erasure target (``""`` in SPM).
        concept_templates: per domain, the prompt a membrane is trained on, with ``{}`` the
            concept (``{}``: its name alone, as the reference's ``target``/``positive`` prompts);
            facilitated transport matches prompts against the name either way.
        facilitated_transport: scale each membrane per prompt by its matching score at sampling
            time (the reference's inference); ``False``: full strength on every prompt.
        matching_metric: the score (:data:`MATCHING_METRICS`; the reference's ``clipcos_tokenuni``).
        progress: show a progress bar (not a hyper-parameter).
    """

    name = "spm"
    version = "2"
    edited_components = ("unet",)

    def __init__(
        self,
        rank: int = 1,
        alpha: float = 1.0,
        iterations: int = 3000,
        learning_rate: float = 1e-4,
        lr_warmup_steps: int = 500,
        lr_num_cycles: int = 3,
        max_denoising_steps: int = 30,
        start_guidance: float = 3.0,
        guidance_scale: float = 1.0,
        la_strength: float = 1000.0,
        sampling_batch_size: int = 4,
        neutral_concepts: Any = "",
        concept_templates: Any = "{}",
        facilitated_transport: bool = False,
        matching_metric: str = "clipcos_tokenuni",
        progress: bool = True,
    ) -> None:
        if matching_metric not in MATCHING_METRICS:
            raise ConfigError(f"SPM matching_metric {matching_metric!r}: use one of {', '.join(MATCHING_METRICS)}")
        if int(rank) < 1 or int(iterations) < 0 or int(max_denoising_steps) < 2:
            raise ConfigError(f"SPM needs rank >= 1, iterations >= 0 and max_denoising_steps >= 2; got "
                              f"{rank}, {iterations}, {max_denoising_steps}")
        super().__init__(
            rank=int(rank), alpha=float(alpha), iterations=int(iterations), learning_rate=float(learning_rate),
            lr_warmup_steps=int(lr_warmup_steps), lr_num_cycles=int(lr_num_cycles),
            max_denoising_steps=int(max_denoising_steps), start_guidance=float(start_guidance),
            guidance_scale=float(guidance_scale), la_strength=float(la_strength),
            sampling_batch_size=int(sampling_batch_size), neutral_concepts=to_python(neutral_concepts),
            concept_templates=to_python(concept_templates),
            facilitated_transport=bool(facilitated_transport), matching_metric=str(matching_metric),
        )
        self.progress = bool(progress)
        self.adapters: list[SPMAdapter] = []
        self.concepts: list[str] = []

    def erase(self, pipe: Any, concepts: Sequence[str], *, seed: int = 0, domain: Domain | None = None) -> Any:
        """Train one membrane per concept on the frozen UNet, then fuse them all into it."""
        from diffusers import DDIMScheduler
        from diffusers.optimization import get_cosine_with_hard_restarts_schedule_with_warmup

        require_sd_pipeline(pipe, "SPM")
        concepts = check_concepts(concepts, pipe.tokenizer, method="SPM")
        hp = self.hparams
        neutral = for_domain(hp["neutral_concepts"], domain, what="SPM neutral_concepts")
        if not isinstance(neutral, str):
            raise ConfigError(f"SPM neutral_concepts for domain {domain_name(domain)!r} must be a string, "
                              f"got {neutral!r}")
        template = domain_template(hp["concept_templates"], domain, what="SPM concept_templates")
        gen = cpu_generator(seed)
        unet = pipe.unet
        device, dtype = unet.device, unet.dtype
        targets = spm_target_modules(unet)
        sampler = DDIMScheduler.from_config(pipe.scheduler.config)
        sampler.set_timesteps(hp["max_denoising_steps"], device="cpu")
        train_t = DDIMScheduler.from_config(pipe.scheduler.config)
        train_t.set_timesteps(train_t.config.num_train_timesteps, device="cpu")
        n_train = train_t.config.num_train_timesteps
        size = unet.config.sample_size
        latent_shape = (1, unet.config.in_channels, size, size)
        blank = encode_text(pipe, [""])
        neutral_emb = encode_text(pipe, [neutral])

        adapters = []
        with fp32_training(unet):  # the UNet is frozen; fp32 so the adapter trains in fp32
            unet.requires_grad_(False)
            for concept in concepts:
                cond = encode_text(pipe, [template.format(concept)]).float()
                adapter = SPMAdapter(targets, hp["rank"], hp["alpha"], gen).to(device)
                opt = torch.optim.AdamW(adapter.parameters(), lr=hp["learning_rate"])
                sched = get_cosine_with_hard_restarts_schedule_with_warmup(
                    opt, hp["lr_warmup_steps"], max(hp["iterations"], 1), num_cycles=hp["lr_num_cycles"])
                bar = tqdm(range(hp["iterations"]), desc=f"SPM ({concept})", disable=not self.progress)
                for _ in bar:
                    k = randint(hp["max_denoising_steps"], gen, low=1)
                    z = randn(latent_shape, gen, device=device) * sampler.init_noise_sigma
                    with torch.no_grad(), adapter_active(targets, adapter):
                        xt = self._ddim(unet, sampler, sampler.timesteps[:k], z, cond, blank, hp["start_guidance"])
                    t = train_t.timesteps[int(k * n_train / hp["max_denoising_steps"])].to(device)
                    with torch.no_grad(), autocast(device, dtype):
                        e_pos = unet(xt, t, encoder_hidden_states=cond.to(device)).sample.float()
                        e_neu = unet(xt, t, encoder_hidden_states=neutral_emb.float().to(device)).sample.float()
                    target = e_neu - hp["guidance_scale"] * (e_pos - e_neu)
                    with adapter_active(targets, adapter), autocast(device, dtype):
                        e_tgt = unet(xt, t, encoder_hidden_states=cond.to(device)).sample.float()
                    loss = F.mse_loss(e_tgt, target)
                    if hp["la_strength"] > 0 and hp["sampling_batch_size"] > 0:
                        anchors = self._anchors(cond, hp["sampling_batch_size"], gen).to(device)
                        xr = xt.expand(len(anchors), -1, -1, -1)
                        with torch.no_grad(), autocast(device, dtype):
                            a_ori = unet(xr, t, encoder_hidden_states=anchors).sample.float()
                        with adapter_active(targets, adapter), autocast(device, dtype):
                            a_new = unet(xr, t, encoder_hidden_states=anchors).sample.float()
                        loss = loss + hp["la_strength"] * F.mse_loss(a_new, a_ori)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    sched.step()
                    bar.set_postfix(loss=f"{loss.item():.4g}", k=k)
                adapter.requires_grad_(False)
                adapters.append(adapter.cpu())
        for adapter in adapters:
            fuse_adapter(unet, adapter)
        self.adapters, self.concepts = adapters, list(concepts)
        return pipe

    def inference_guidance(self, pipe: Any, concepts: Sequence[str], *,
                           domain: Domain | None = None) -> InferenceGuidance | None:
        """:class:`FacilitatedTransport` over the membranes of the last erase (or of the cached
        erasure, :meth:`load_state`) when ``facilitated_transport``; else ``None``."""
        if not self.hparams["facilitated_transport"]:
            return None
        if not self.adapters or list(concepts) != self.concepts:
            raise ConfigError(f"SPM Facilitated Transport needs the membranes of {list(concepts)}; this method "
                              f"holds those of {self.concepts or 'none'} (erase first, or load a cached erasure)")
        return FacilitatedTransport(self.adapters, self.concepts, self.hparams["matching_metric"])

    def save_state(self, folder: Path) -> None:
        """The membranes (for Facilitated Transport after a cached erasure)."""
        if self.adapters:
            self.save_adapter(folder)

    def load_state(self, folder: Path) -> None:
        from safetensors import safe_open

        path = Path(folder) / ADAPTER_FILE
        if not path.exists():
            return
        with safe_open(str(path), framework="pt") as f:
            info = json.loads((f.metadata() or {}).get("spm", "{}"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        self.adapters = _adapters_from_tensors(tensors, info)
        self.concepts = list(info.get("concepts", []))

    @staticmethod
    def _anchors(cond: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
        """SPM's latent-anchoring samples: random directions, rejected with probability
        ``cos(direction, concept)``, scaled to 0.8-1.2 times the concept embedding's norm."""
        c = cond.detach().cpu().reshape(-1)
        out = []
        while len(out) < n:
            d = torch.randn(c.shape, generator=gen)
            d = d / d.norm()
            if torch.rand((), generator=gen).item() < 1 - F.cosine_similarity(c, d, dim=0).item():
                scale = torch.rand((), generator=gen).item() * 0.4 + 0.8
                out.append((scale * d * c.norm()).reshape(cond.shape[1:]))
        return torch.stack(out)

    @staticmethod
    def _ddim(unet: nn.Module, sampler: Any, timesteps: torch.Tensor, z: torch.Tensor, cond: torch.Tensor,
              uncond: torch.Tensor, guidance: float) -> torch.Tensor:
        x = z.float()
        ctx = torch.cat([uncond.float(), cond.float()]).to(x.device)
        for t in timesteps:
            eps = unet(torch.cat([x, x]), t.to(x.device), encoder_hidden_states=ctx).sample.float()
            e_u, e_c = eps.chunk(2)
            x = sampler.step(e_u + guidance * (e_c - e_u), t, x).prev_sample
        return x

    def save_adapter(self, folder: str | os.PathLike) -> Path:
        """Write the adapters of the last :meth:`erase` to ``folder/spm_adapter.safetensors``
        (atomically); :func:`load_spm_adapter` fuses them into another base pipeline."""
        from safetensors.torch import save_file

        if not self.adapters:
            raise ConfigError("SPM has no adapter to save: call erase() first")
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for j, ad in enumerate(self.adapters):
            for i in range(len(ad.names)):
                tensors[f"{j}.{i}.down"] = ad.down[i].detach().contiguous()
                tensors[f"{j}.{i}.up"] = ad.up[i].detach().contiguous()
        info = {"concepts": self.concepts, "rank": self.hparams["rank"], "alpha": self.hparams["alpha"],
                "layers": self.adapters[0].names, "method": self.config()}
        path = folder / ADAPTER_FILE
        tmp = folder / f".{ADAPTER_FILE}.{os.getpid()}.tmp"
        save_file(tensors, str(tmp), metadata={"spm": json.dumps(info, default=str)})
        os.replace(tmp, path)
        return path
