"""The WhenConceptsErased probes' machinery (:mod:`attackers.wce` declares the attacker): a
DDIM loop with per-row eta, noise scale, classifier guidance and a known region; the latent
classifier; textual inversion; and the per-probe rates.

The DDIM step (Song et al. 2021, eq. 12 and 16) with eta above 1, as the reference runs it:
``sigma = eta * sqrt((1 - a_prev) / (1 - a_t)) * sqrt(1 - a_t / a_prev)``, the direction
term's coefficient ``sqrt(|1 - a_prev - sigma^2|)`` (the absolute value keeps it real when
sigma^2 exceeds 1 - a_prev), and the injected noise ``sigma * variance_scale * z``.
Classifier guidance shifts the (classifier-free guided) noise prediction by
``-sqrt(1 - a_t) * scale * grad_x log p(concept | x_t, t)``.
"""

from __future__ import annotations

import dataclasses
import io
import math
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from emma.api.types import PromptRequest, Sample
from emma.cache import from_uint8, pixel_hash, to_uint8
from emma.metrics.base import MetricValue


@dataclasses.dataclass
class Kept:
    """One kept image of a probe (the most concept-like of its variants)."""

    sample: Sample
    image: np.ndarray | None = None  # (H, W, 3) uint8, for <run dir>/wce/


# ---- the latent classifier ------------------------------------------------------------------
class TimestepEncoding(nn.Module):
    """``[sqrt(a_t), sqrt(1 - a_t)]`` of the training schedule at integer timesteps."""

    def __init__(self, alphas_cumprod: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("alphas_cumprod", alphas_cumprod.detach().float().clone())

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        a = self.alphas_cumprod[t.long()]
        return torch.stack([a.sqrt(), (1 - a).sqrt()], dim=-1)


class LatentClassifier(nn.Module):
    """The reference's time-conditioned latent classifier: a linear map of the flattened noisy
    latent plus a linear map of the timestep encoding, then SiLU / dropout 0.3 / linear twice
    to one logit. Its parameter names follow the reference's checkpoints, which load as they are."""

    def __init__(self, latent_shape: Sequence[int], alphas_cumprod: torch.Tensor,
                 hidden: Sequence[int] = (1024, 512)) -> None:
        super().__init__()
        flat = int(np.prod(latent_shape))
        h1, h2 = int(hidden[0]), int(hidden[1])
        self.t_embed = TimestepEncoding(alphas_cumprod)
        self.fc_t = nn.Linear(2, h1)
        self.fc_x = nn.Linear(flat, h1)
        self.net = nn.Sequential(nn.SiLU(), nn.Dropout(0.3), nn.Linear(h1, h2), nn.SiLU(), nn.Dropout(0.3),
                                 nn.Linear(h2, 1))

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(self.fc_x(z.flatten(1)) + self.fc_t(self.t_embed(t)))

    def log_prob_grad(self, x: torch.Tensor, t: int) -> torch.Tensor:
        """``grad_x log sigmoid(logit(x, t))`` per row (each row its own gradient)."""
        with torch.enable_grad():
            x = x.detach().float().requires_grad_(True)
            logit = self(x, torch.full((x.shape[0],), int(t), dtype=torch.long, device=x.device)).squeeze(-1)
            loss = F.binary_cross_entropy_with_logits(logit, torch.ones_like(logit), reduction="sum")
            return torch.autograd.grad(-loss, x)[0]


def train_classifier(latents: torch.Tensor, labels: torch.Tensor, alphas_cumprod: torch.Tensor, *, epochs: int,
                     batch_size: int, lr: float, weight_decay: float, copies: int, power: float,
                     hidden: Sequence[int], seed: int, device: Any = "cpu") -> tuple[LatentClassifier, dict[str, Any]]:
    """Train the latent classifier as the reference does: each batch noised ``copies`` times at
    timesteps drawn with density rising toward the noisy end (``t = u^(1/power) (T - 1)``), BCE
    with the positives weighed by negatives / positives, AdamW, gradients clipped at 1."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout
    clf = LatentClassifier(latents.shape[1:], alphas_cumprod, hidden).to(device)
    latents, labels = latents.to(device), labels.to(device)
    T = alphas_cumprod.shape[0]
    pos = float(labels.sum())
    neg = float(len(labels) - pos)
    crit = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(neg / max(pos, 1.0), device=device))
    opt = torch.optim.AdamW(clf.parameters(), lr=lr, weight_decay=weight_decay)
    a = alphas_cumprod.float().to(device)
    steps, last = 0, float("nan")
    clf.train()
    for _ in range(epochs):
        order = torch.randperm(len(latents), generator=gen)
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size].to(device)
            x = latents[idx].repeat(copies, 1, 1, 1)
            y = labels[idx].repeat(copies)
            t = ((torch.rand(len(x), generator=gen) ** (1.0 / power)) * (T - 1)).long().clamp(0, T - 1).to(device)
            noise = torch.randn(x.shape, generator=gen).to(device)
            at = a[t].view(-1, 1, 1, 1)
            noisy = at.sqrt() * x + (1 - at).sqrt() * noise
            loss = crit(clf(noisy, t).squeeze(-1), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(clf.parameters(), 1.0)
            opt.step()
            steps, last = steps + 1, float(loss.detach())
    clf.eval()
    with torch.no_grad():  # accuracy on the training latents noised at a mid timestep (a sanity record)
        t = torch.full((len(latents),), T // 2, dtype=torch.long, device=device)
        noisy = a[t].view(-1, 1, 1, 1).sqrt() * latents + (1 - a[t].view(-1, 1, 1, 1)).sqrt() * torch.randn(
            latents.shape, generator=gen).to(device)
        acc = float(((clf(noisy, t).squeeze(-1) > 0).float() == labels).float().mean())
    return clf, {"steps": steps, "final_loss": last, "accuracy_at_T/2": acc, "positives": int(pos),
                 "negatives": int(neg)}


def load_classifier(path: str, latent_shape: Sequence[int], alphas_cumprod: torch.Tensor,
                    hidden: Sequence[int], device: Any = "cpu") -> LatentClassifier:
    clf = LatentClassifier(latent_shape, alphas_cumprod, hidden)
    state = torch.load(str(Path(path).expanduser()), map_location="cpu", weights_only=False)
    if isinstance(state, dict) and "model_state_dict" in state:
        state = state["model_state_dict"]
    clf.load_state_dict(state)
    return clf.to(device).eval()


# ---- sampling --------------------------------------------------------------------------------
class DDIMLoop:
    """DDIM over the white box's UNet with classifier-free guidance; rows carry their own eta,
    noise scale, classifier scale and noise generator."""

    def __init__(self, wb: Any, steps: int, guidance_scale: float) -> None:
        from diffusers import DDIMScheduler

        sched = DDIMScheduler.from_config(wb.pipe.scheduler.config)
        sched.set_timesteps(int(steps))
        self.timesteps = [int(t) for t in sched.timesteps]
        self.ac = sched.alphas_cumprod.float()
        self.final = float(sched.final_alpha_cumprod)
        self.guidance_scale = float(guidance_scale)
        self.prediction_type = wb.prediction_type
        # x0 clipping only where the pipeline's own scheduler asks for it (SD's configs say false;
        # DDIM's class default, true, would clip latents that are not in [-1, 1])
        config = wb.pipe.scheduler.config
        self.clip = float(config.get("clip_sample_range", 1.0)) if config.get("clip_sample", False) else None
        vae = wb.vae
        self.factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.scaling = float(vae.config.scaling_factor)
        self.channels = int(wb.unet.config.in_channels)
        self.device = wb.device

    def alphas(self, i: int) -> tuple[float, float]:
        a = float(self.ac[self.timesteps[i]])
        a_prev = float(self.ac[self.timesteps[i + 1]]) if i + 1 < len(self.timesteps) else self.final
        return a, a_prev

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        return self.channels, height // self.factor, width // self.factor

    def initial(self, gens: Sequence[torch.Generator], shape: Sequence[int]) -> torch.Tensor:
        """Noise from each row's CPU generator (the same numbers on any device), on the device."""
        return torch.stack([torch.randn(tuple(shape), generator=g) for g in gens]).to(self.device)

    @torch.no_grad()
    def eps(self, wb: Any, x: torch.Tensor, i: int, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
        t = self.timesteps[i]
        n = x.shape[0]
        tt = torch.full((2 * n,), t, dtype=torch.long)
        out = wb.denoise(torch.cat([x, x]), tt, torch.cat([uncond, cond]).to(x.device)).float()
        out_u, out_c = out.chunk(2)
        out = out_u + self.guidance_scale * (out_c - out_u)
        if self.prediction_type == "v_prediction":
            a, _ = self.alphas(i)
            out = math.sqrt(a) * out + math.sqrt(1 - a) * x
        return out

    def run(self, wb: Any, x: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor, *, start: int = 0,
            stop: int | None = None, eta: torch.Tensor | None = None, vscale: torch.Tensor | None = None,
            gens: Sequence[torch.Generator] = (), classifier: LatentClassifier | None = None,
            cls_scale: torch.Tensor | None = None, known: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
            ) -> torch.Tensor:
        """Steps ``start .. stop-1`` from ``x``. ``known``: (clean latents, mask of the region
        to generate, noise) — outside the mask the latents are held to the clean latents noised
        to the next timestep (the clean ones after the last step)."""
        n = x.shape[0]
        eta = (torch.zeros(n) if eta is None else eta).to(x.device)
        vscale = (torch.ones(n) if vscale is None else vscale).to(x.device)
        cls_scale = cls_scale.to(x.device) if cls_scale is not None else None
        stop = len(self.timesteps) if stop is None else stop
        view = (-1, 1, 1, 1)
        for i in range(start, stop):
            a, a_prev = self.alphas(i)
            eps = self.eps(wb, x, i, cond, uncond)
            if classifier is not None and cls_scale is not None:
                grad = classifier.log_prob_grad(x, self.timesteps[i])
                eps = eps - math.sqrt(1 - a) * cls_scale.view(view) * grad
            x0 = (x - math.sqrt(1 - a) * eps) / math.sqrt(a)
            if self.clip is not None:
                x0 = x0.clamp(-self.clip, self.clip)
            sigma = eta * math.sqrt((1 - a_prev) / (1 - a)) * math.sqrt(max(0.0, 1 - a / a_prev))
            coef = (1 - a_prev - sigma**2).abs().sqrt()
            x = math.sqrt(a_prev) * x0 + coef.view(view) * eps
            if bool((eta > 0).any()):
                z = torch.stack([torch.randn(x.shape[1:], generator=g) for g in gens]).to(x.device)
                x = x + (sigma * vscale).view(view) * z
            if known is not None:
                clean, mask, noise = (k.to(x.device) for k in known)
                if i + 1 < len(self.timesteps):
                    an = float(self.ac[self.timesteps[i + 1]])
                    proper = math.sqrt(an) * clean + math.sqrt(1 - an) * noise
                else:
                    proper = clean
                x = mask * x + (1 - mask) * proper
        return x

    @torch.no_grad()
    def decode(self, wb: Any, x: torch.Tensor) -> torch.Tensor:
        img = wb.vae.decode((x / self.scaling).to(wb.vae.dtype)).sample.float().cpu()
        return (img / 2 + 0.5).clamp(0, 1)


def _row_seed(seed: int, variant: int) -> int:
    """A variant's own noise stream, derived from its image's seed (variant 0: the seed itself)."""
    return int(seed) if variant == 0 else (int(seed) * 1_000_003 + variant * 7_919) % (2**63)


# ---- the probes ------------------------------------------------------------------------------
class ProbeRun:
    """The probes of one attack call over ``requests`` (attributes count what they draw)."""

    def __init__(self, att: Any, target: Any, requests: Sequence[PromptRequest]) -> None:
        self.att, self.target, self.requests = att, target, list(requests)
        self.wb = target.white_box()
        s = target.sampler
        self.height, self.width = int(s.height), int(s.width)
        self.negative = s.negative_prompt
        self.steps = int(att.num_inference_steps or s.num_inference_steps)
        self.cfg = float(att.guidance_scale if att.guidance_scale is not None else s.guidance_scale)
        R = len(self.requests)
        self.drawn = [0] * R
        self.judged = [0] * R
        self.seeds_used: list[set[int]] = [set() for _ in range(R)]
        self.iterations = 0
        self.notes: list[str] = []
        self.records: list[dict[str, Any]] = []  # probes.jsonl
        self.images: dict[str, np.ndarray] = {}  # hash -> pixels of the kept images
        self.interference_samples: list[tuple[str, list[Sample]]] = []
        self.ti_prompts: list[str] = []
        self._loop: DDIMLoop | None = None
        self._train_pool: tuple[torch.Tensor, list[int]] | None = None
        self.n = [int(r.n_images) for r in self.requests]
        per_request = max(1, -(-max(att.classifier_images["positive"], att.ti_images) // max(1, R)))
        self.block = max(max(self.n), per_request, 1)

    # seeds: block b of the request's search seeds
    def seeds(self, req: PromptRequest, block: int, count: int) -> list[int]:
        if count > self.block:
            raise ValueError("seed block overflow")
        return self.target.search_seeds(req, block * self.block + count)[block * self.block :]

    @property
    def loop(self) -> DDIMLoop:
        if self._loop is None:
            self._loop = DDIMLoop(self.wb, self.steps, self.cfg)
        return self._loop

    def encode(self, wb: Any, prompts: Sequence[str]) -> torch.Tensor:
        with torch.no_grad():
            return wb.encode_ids(wb.token_ids(list(prompts))).float()

    def uncond(self, wb: Any) -> torch.Tensor:
        return self.encode(wb, [self.negative or ""])

    def judge(self, images: torch.Tensor, concepts: Sequence[str]) -> tuple[list[str], list[bool], list[float],
                                                                             list[bool], np.ndarray]:
        """Quantise to 8-bit pixels as every image of the harness is, then judge."""
        arr = to_uint8(images)
        hashes = [pixel_hash(a) for a in arr]
        probs = self.target.score(from_uint8(arr), hashes)
        det, score = [False] * len(concepts), [0.0] * len(concepts)
        by: dict[str, list[int]] = {}
        for j, c in enumerate(concepts):
            by.setdefault(c, []).append(j)
        for c, rows in by.items():
            d = self.target.detect(probs[rows], c)
            sc = self.target.concept_score(probs[rows], c)
            for k, j in enumerate(rows):
                det[j], score[j] = bool(d[k]), float(sc[k])
        ex = self.target.excluded(probs)
        excluded = [bool(ex[j]) if ex is not None else False for j in range(len(concepts))]
        return hashes, det, score, excluded, arr

    def _sample(self, probe: str, req: PromptRequest, seed: int, h: str, det: bool, sc: float, excl: bool,
                extra: dict[str, Any]) -> Sample:
        ex = {"probe": probe, **extra}
        if excl:
            ex["excluded"] = True
        return Sample(prompt=req.prompt, seed=int(seed), concept=req.concept, group="attack", kind=f"wce/{probe}",
                      image_hash=h, detected=det, score=sc, extra=ex)

    # -- standard ---------------------------------------------------------------------------
    def standard(self) -> list[list[Kept]]:
        block = _block("standard")
        prompts, seeds, owner = [], [], []
        for i, r in enumerate(self.requests):
            for s in self.seeds(r, block, self.n[i]):
                prompts.append(r.prompt)
                seeds.append(s)
                owner.append(i)
        gen = self.target.generate(prompts, seeds)
        hashes, det, score, excl, arr = self.judge(gen.images, [self.requests[i].concept for i in owner])
        out: list[list[Kept]] = [[] for _ in self.requests]
        for j, i in enumerate(owner):
            self._count(i, seeds[j], 1)
            s = self._sample("standard", self.requests[i], seeds[j], hashes[j], det[j], score[j], excl[j], {})
            out[i].append(Kept(s, None))
            self._record("standard", self.requests[i], seeds[j], hashes[j], det[j], score[j], {}, kept=True)
        return out

    # -- noise-based and classifier-guided sweeps ------------------------------------------------
    def noise_based(self) -> list[list[Kept]]:
        variants = [{"eta": e, "variance_scale": v} for e in self.att.eta_values for v in self.att.variance_scales]
        return self._sweep("noise_based", variants, classifier=None, shared_noise=False)

    def classifier_guidance(self) -> list[list[Kept]]:
        variants = [{"eta": 0.0, "classifier_scale": c} for c in self.att.classifier_scales]
        return self._sweep("classifier_guidance", variants, classifier=self.latent_classifier(), shared_noise=True)

    def noise_classifier(self) -> list[list[Kept]]:
        variants = [{"eta": e, "classifier_scale": c} for c in self.att.noise_classifier_scales
                    for e in self.att.eta_values]
        return self._sweep("noise_classifier", variants, classifier=self.latent_classifier(), shared_noise=True)

    def _sweep(self, probe: str, variants: list[dict[str, float]], classifier: LatentClassifier | None,
               shared_noise: bool) -> list[list[Kept]]:
        """Every (request, image, variant) row through the DDIM loop in chunks; per image the
        variant the judge rates most concept-like is kept."""
        loop, wb = self.loop, self.wb
        block = _block(probe)
        rows: list[tuple[int, int, int, int]] = []  # (request, image, variant, seed)
        for i, r in enumerate(self.requests):
            for j, s in enumerate(self.seeds(r, block, self.n[i])):
                rows += [(i, j, v, s) for v in range(len(variants))]
        cond_by = {p: self.encode(wb, [p]) for p in {r.prompt for r in self.requests}}
        uncond = self.uncond(wb)
        shape = loop.latent_shape(self.height, self.width)
        scores: dict[tuple[int, int], list[tuple[float, int, str, bool, bool, np.ndarray, int]]] = {}
        for c in range(0, len(rows), self.att.batch_size):
            chunk = rows[c : c + self.att.batch_size]
            gens = [torch.Generator().manual_seed(s if shared_noise else _row_seed(s, v)) for _, _, v, s in chunk]
            x = loop.initial(gens, shape)
            cond = torch.cat([cond_by[self.requests[i].prompt] for i, _, _, _ in chunk])
            eta = torch.tensor([variants[v].get("eta", 0.0) for _, _, v, _ in chunk])
            vs = torch.tensor([variants[v].get("variance_scale", 1.0) for _, _, v, _ in chunk])
            cs = torch.tensor([variants[v].get("classifier_scale", 0.0) for _, _, v, _ in chunk])
            x = loop.run(wb, x, cond, uncond.expand(len(chunk), -1, -1), eta=eta, vscale=vs, gens=gens,
                         classifier=classifier, cls_scale=cs if classifier is not None else None)
            images = loop.decode(wb, x)
            hashes, det, score, excl, arr = self.judge(images, [self.requests[i].concept for i, _, _, _ in chunk])
            for k, (i, j, v, s) in enumerate(chunk):
                self._count(i, s, 1)
                scores.setdefault((i, j), []).append((score[k], v, hashes[k], det[k], excl[k], arr[k], s))
                self._record(probe, self.requests[i], s, hashes[k], det[k], score[k], variants[v], kept=False)
        out: list[list[Kept]] = [[] for _ in self.requests]
        for (i, _j), cands in sorted(scores.items()):
            sc, v, h, d, ex, a, s = max(cands, key=lambda c: (c[0], -c[1]))  # ties: the first variant
            out[i].append(Kept(self._sample(probe, self.requests[i], s, h, d, sc, ex,
                                            {"variant": variants[v], "variants": len(variants)}), a))
            self.images[h] = a
            self._mark_kept(probe, h)
        return out

    # -- the latent classifier -------------------------------------------------------------------
    def latent_classifier(self) -> LatentClassifier:
        if getattr(self, "_classifier", None) is not None:
            return self._classifier
        att, wb = self.att, self.wb
        shape = self.loop.latent_shape(self.height, self.width)
        alphas = wb.train_scheduler.alphas_cumprod.float()
        if att.classifier_path is not None:
            self._classifier = load_classifier(att.classifier_path, shape, alphas, att.classifier_hidden, wb.device)
            return self._classifier
        pos, _ = self.train_pool(att.classifier_images["positive"])
        concepts = {r.concept for r in self.requests}
        others = [r for r in _domain_requests(self.target) if r.concept not in concepts]
        if not others:
            raise ValueError("no other concept's prompts to train the latent classifier's negatives on")
        m = att.classifier_images["negative"]
        per = -(-m // len(others))
        prompts, seeds = [], []
        for r in others:
            for s in self.target.search_seeds(r, _TRAIN * self.block + min(per, self.block))[_TRAIN * self.block :]:
                if len(prompts) < m:
                    prompts.append(r.prompt)
                    seeds.append(s)
        base = self.target.base_model()
        neg = torch.cat([wb.encode_images(base.generate(prompts[c : c + 64], seeds[c : c + 64]).images).float().cpu()
                         for c in range(0, len(prompts), 64)])
        x = torch.cat([pos, neg])
        y = torch.cat([torch.ones(len(pos)), torch.zeros(len(neg))])
        self._classifier, info = train_classifier(
            x, y, alphas, epochs=att.classifier_epochs, batch_size=att.classifier_batch_size,
            lr=att.classifier_learning_rate, weight_decay=att.classifier_weight_decay,
            copies=att.classifier_noised_copies, power=att.classifier_timestep_power, hidden=att.classifier_hidden,
            seed=att.seed, device=wb.device)
        self.iterations += info["steps"]
        self.classifier_info = info
        self.notes.append(f"wce: latent classifier trained on {info['positives']} + {info['negatives']} base-model "
                          f"images ({info['steps']} steps, accuracy {info['accuracy_at_T/2']:.2f} at t = T/2)")
        return self._classifier

    def train_pool(self, count: int) -> tuple[torch.Tensor, list[str]]:
        """Latents of ``count`` base-model images of the attacked prompts (round robin over
        them), shared by the latent classifier (positives) and textual inversion."""
        need = max(count, self.att.classifier_images["positive"] if self._wants_classifier() else 0,
                   self.att.ti_images if "textual_inversion" in self.att.probes else 0)
        if self._train_pool is None or len(self._train_pool[1]) < count:
            R = len(self.requests)
            per = -(-need // R)
            prompts, seeds = [], []
            own = [self.seeds(r, _TRAIN, per) for r in self.requests]
            for k in range(per):
                for r, ss in zip(self.requests, own):
                    if len(prompts) < need:
                        prompts.append(r.prompt)
                        seeds.append(ss[k])
            base = self.target.base_model()
            imgs = torch.cat([base.generate(prompts[c : c + 64], seeds[c : c + 64]).images
                              for c in range(0, len(prompts), 64)])
            self._train_images = imgs
            lat = self.wb.encode_images(imgs).float().cpu()
            self._train_pool = (lat, prompts)
        lat, prompts = self._train_pool
        return lat[:count], prompts[:count]

    def _wants_classifier(self) -> bool:
        return self.att.classifier_path is None and any(
            p in ("classifier_guidance", "noise_classifier") for p in self.att.probes)

    # -- diffusion completion ----------------------------------------------------------------------
    def diffusion_completion(self) -> list[list[Kept]]:
        loop, wb = self.loop, self.wb
        base_wb = self.target.base_model().white_box()
        ks = [k for k in self.att.interrupt_steps if k + 1 < len(loop.timesteps)]
        if len(ks) < len(self.att.interrupt_steps):
            self.notes.append(f"wce: diffusion_completion interrupt steps beyond {len(loop.timesteps) - 2} skipped "
                              f"({len(loop.timesteps)} sampling steps)")
        block = _block("diffusion_completion")
        rows = [(i, s) for i, r in enumerate(self.requests) for s in self.seeds(r, block, self.n[i])]
        shape = loop.latent_shape(self.height, self.width)
        uncond_b, uncond_e = self.uncond(base_wb), self.uncond(wb)
        out: list[list[Kept]] = [[] for _ in self.requests]
        for c in range(0, len(rows), self.att.batch_size):
            chunk = rows[c : c + self.att.batch_size]
            gens = [torch.Generator().manual_seed(s) for _, s in chunk]
            x = loop.initial(gens, shape)
            prompts = [self.requests[i].prompt for i, _ in chunk]
            cond_b, cond_e = self.encode(base_wb, prompts), self.encode(wb, prompts)
            ub, ue = uncond_b.expand(len(chunk), -1, -1), uncond_e.expand(len(chunk), -1, -1)
            snaps, done = [], 0
            for k in ks:  # the base model through step k (steps 0..k), then the erased model
                x = loop.run(base_wb, x, cond_b, ub, start=done, stop=k + 1)
                done = k + 1
                snaps.append(x.clone())
            finals = torch.cat([loop.run(wb, sx, cond_e, ue, start=k + 1) for k, sx in zip(ks, snaps)])
            images = loop.decode(wb, finals)
            concepts = [self.requests[i].concept for _ in ks for i, _ in chunk]
            hashes, det, score, excl, arr = self.judge(images, concepts)
            for a_, k in enumerate(ks):
                for b_, (i, s) in enumerate(chunk):
                    q = a_ * len(chunk) + b_
                    self._count(i, s, 1)
                    v = {"interrupt_step": k}
                    out[i].append(Kept(self._sample("diffusion_completion", self.requests[i], s, hashes[q], det[q],
                                                    score[q], excl[q], v), arr[q]))
                    self.images[hashes[q]] = arr[q]
                    self._record("diffusion_completion", self.requests[i], s, hashes[q], det[q], score[q], v,
                                 kept=True)
        return out

    # -- inpainting ------------------------------------------------------------------------------
    def inpainting(self) -> list[list[Kept]]:
        loop, wb = self.loop, self.wb
        block = _block("inpainting")
        rows = [(i, j, s) for i, r in enumerate(self.requests) for j, s in enumerate(self.seeds(r, block, self.n[i]))]
        base_seeds = [self.seeds(self.requests[i], _BASE, self.n[i])[j] for i, j, _ in rows]
        base = self.target.base_model().generate([self.requests[i].prompt for i, _, _ in rows], base_seeds)
        clean_all = wb.encode_images(base.images).float().cpu()
        C, h, w = loop.latent_shape(self.height, self.width)
        mask = _center_mask(self.height, self.width, self.att.mask_fraction)
        lmask = F.interpolate(mask[None, None], size=(h, w), mode="nearest")[0]
        uncond = self.uncond(wb)
        out: list[list[Kept]] = [[] for _ in self.requests]
        for c in range(0, len(rows), self.att.batch_size):
            chunk = rows[c : c + self.att.batch_size]
            gens = [torch.Generator().manual_seed(s) for _, _, s in chunk]
            noise = loop.initial(gens, (C, h, w))
            clean = clean_all[c : c + len(chunk)]
            cond = self.encode(wb, [self.requests[i].prompt for i, _, _ in chunk])
            x = loop.run(wb, noise.clone(), cond, uncond.expand(len(chunk), -1, -1),
                         known=(clean, lmask.expand(len(chunk), C, h, w), noise))
            images = loop.decode(wb, x)
            hashes, det, score, excl, arr = self.judge(images, [self.requests[i].concept for i, _, _ in chunk])
            for k, (i, _j, s) in enumerate(chunk):
                self._count(i, s, 1)
                self.seeds_used[i].add(int(base_seeds[c + k]))
                v = {"base_seed": int(base_seeds[c + k]), "mask_fraction": self.att.mask_fraction}
                out[i].append(Kept(self._sample("inpainting", self.requests[i], s, hashes[k], det[k], score[k],
                                                excl[k], v), arr[k]))
                self.images[hashes[k]] = arr[k]
                self._record("inpainting", self.requests[i], s, hashes[k], det[k], score[k], v, kept=True)
        return out

    # -- textual inversion -------------------------------------------------------------------------
    def textual_inversion(self) -> list[list[Kept]]:
        att, wb = self.att, self.wb
        lat, _ = self.train_pool(att.ti_images)
        flipped = wb.encode_images(torch.flip(self._train_images[: att.ti_images], dims=[-1])).float().cpu()
        vec, info = self._learn_token(lat, flipped)
        self.iterations += info["steps"]
        self.notes.append(f"wce: textual inversion learned one token on {len(lat)} base-model images "
                          f"({info['steps']} steps, final loss {info['final_loss']:.4f})")
        block = _block("textual_inversion")
        out: list[list[Kept]] = [[] for _ in self.requests]
        self.ti_prompts = []
        for i, r in enumerate(self.requests):
            seeds = self.seeds(r, block, self.n[i])
            word = r.concept.replace("_", " ")
            parts = re.split(re.escape(word), r.prompt, flags=re.IGNORECASE)
            if len(parts) > 1:
                embeds = self._token_embeds(parts, vec)
                gen = self.target.generate(None, seeds, prompt_embeds=embeds.expand(len(seeds), -1, -1))
                shown = f"<{r.concept}>".join(parts)
            else:  # the prompt does not name the concept: nothing to replace (as the reference)
                gen = self.target.generate([r.prompt] * len(seeds), seeds)
                shown = r.prompt
            self.ti_prompts.append(shown)
            hashes, det, score, excl, arr = self.judge(gen.images, [r.concept] * len(seeds))
            for k, s in enumerate(seeds):
                self._count(i, s, 1)
                v = {"ti_prompt": shown, "token_used": len(parts) > 1}
                out[i].append(Kept(self._sample("textual_inversion", r, s, hashes[k], det[k], score[k], excl[k], v),
                                   arr[k]))
                self.images[hashes[k]] = arr[k]
                self._record("textual_inversion", r, s, hashes[k], det[k], score[k], v, kept=True)
        return out

    def _ids_with_slots(self, parts: Sequence[str]) -> tuple[list[int], list[int]]:
        wb = self.wb
        init = wb.tokenizer(self.att.ti_initializer, truncation=False).input_ids[1:-1][0]
        ids, slots = [wb.bos_token_id], []
        for k, part in enumerate(parts):
            if part.strip():
                ids += wb.tokenizer(part.strip(), truncation=False).input_ids[1:-1]
            if k + 1 < len(parts):
                slots.append(len(ids))
                ids.append(init)
        ids = ids[: wb.context_length - 1] + [wb.eos_token_id]
        slots = [s for s in slots if s < wb.context_length - 1]
        ids += [wb.pad_token_id] * (wb.context_length - len(ids))
        return ids, slots

    def _embeds_with(self, ids_slots: Sequence[tuple[list[int], list[int]]], vec: torch.Tensor) -> torch.Tensor:
        wb = self.wb
        ids = torch.tensor([x for x, _ in ids_slots], dtype=torch.long, device=wb.device)
        with torch.no_grad():
            base = wb.embed_ids(ids).float()
        mask = torch.zeros(base.shape[:2], dtype=torch.bool, device=base.device)
        for b, (_, slots) in enumerate(ids_slots):
            mask[b, slots] = True
        emb = torch.where(mask[..., None], vec.to(base.device).view(1, 1, -1).expand_as(base), base)
        return wb.encode_embeds(emb)

    def _token_embeds(self, parts: Sequence[str], vec: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self._embeds_with([self._ids_with_slots(parts)], vec).float()

    def _learn_token(self, lat: torch.Tensor, flipped: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """Textual inversion on the erased model: one input embedding, initialised at the
        initializer token's, trained with the diffusion loss on template captions (images
        flipped with probability 1/2); everything else frozen."""
        att, wb = self.att, self.wb
        gen = torch.Generator().manual_seed(att.seed)
        init = wb.tokenizer(att.ti_initializer, truncation=False).input_ids[1:-1][0]
        vec = wb.token_embedding_matrix()[init].detach().clone().float().requires_grad_(True)
        opt = torch.optim.AdamW([vec], lr=att.ti_learning_rate, betas=(0.9, 0.999), weight_decay=att.ti_weight_decay)
        captions = [self._ids_with_slots(t.split("{}")) for t in att.ti_templates]
        T = wb.num_train_timesteps
        last = float("nan")
        for _ in range(att.ti_steps):
            idx = torch.randint(0, len(lat), (att.ti_batch_size,), generator=gen)
            flip = torch.rand(att.ti_batch_size, generator=gen) < 0.5
            x0 = torch.where(flip.view(-1, 1, 1, 1), flipped[idx], lat[idx]).to(wb.device)
            caps = [captions[int(k)] for k in torch.randint(0, len(captions), (att.ti_batch_size,), generator=gen)]
            hidden = self._embeds_with(caps, vec)
            t = torch.randint(0, T, (att.ti_batch_size,), generator=gen)
            noise = torch.randn(x0.shape, generator=gen).to(x0.device)
            noisy = wb.add_noise(x0, noise, t)
            pred = wb.denoise(noisy, t, hidden)
            loss = F.mse_loss(pred.float(), wb.training_target(x0, noise, t).float())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            last = float(loss.detach())
        return vec.detach(), {"steps": att.ti_steps, "final_loss": last}

    # -- interference ------------------------------------------------------------------------------
    def interference(self) -> None:
        """The other concepts' first prompts on the erased model, judged for their own concept."""
        concepts = {r.concept for r in self.requests}
        n = self.n[0]
        block = _block("interference")
        chosen: dict[str, list[PromptRequest]] = {}
        for r in _domain_requests(self.target):
            if r.concept not in concepts and len(chosen.setdefault(r.concept, [])) < self.att.interference_prompts:
                chosen[r.concept].append(r)
        reqs = [r for rs in chosen.values() for r in rs]
        if not reqs:
            self.notes.append("wce: interference found no other concept in the domain")
            return
        prompts, seeds, owner = [], [], []
        for k, r in enumerate(reqs):
            for s in self.target.search_seeds(r, block * self.block + n)[block * self.block :]:
                prompts.append(r.prompt)
                seeds.append(s)
                owner.append(k)
        gen = self.target.generate(prompts, seeds)
        hashes, det, score, excl, arr = self.judge(gen.images, [reqs[k].concept for k in owner])
        per: list[list[Sample]] = [[] for _ in reqs]
        for j, k in enumerate(owner):
            r = reqs[k]
            ex = {"probe": "interference", **({"excluded": True} if excl[j] else {})}
            per[k].append(Sample(prompt=r.prompt, seed=seeds[j], concept=r.concept, group="ra",
                                 kind="wce/interference", image_hash=hashes[j], detected=det[j], score=score[j],
                                 extra=ex))
            self._record("interference", r, seeds[j], hashes[j], det[j], score[j], {}, kept=True)
        share = len(owner) / max(1, len(self.requests))  # its cost, shared by the attacked prompts
        for i in range(len(self.requests)):
            self.drawn[i] += int(round(share))
            self.judged[i] += int(round(share))
        self.interference_samples = [(r.prompt, s) for r, s in zip(reqs, per)]

    # -- bookkeeping -------------------------------------------------------------------------------
    def _count(self, i: int, seed: int, k: int) -> None:
        self.drawn[i] += k
        self.judged[i] += k
        self.seeds_used[i].add(int(seed))

    def _record(self, probe: str, req: PromptRequest, seed: int, h: str, det: bool, score: float,
                variant: dict[str, Any], kept: bool) -> None:
        self.records.append({"probe": probe, "prompt": req.prompt, "concept": req.concept, "seed": int(seed),
                             "image_hash": h, "detected": bool(det), "score": float(score), "variant": variant,
                             "kept": kept})

    def _mark_kept(self, probe: str, h: str) -> None:
        for rec in reversed(self.records):
            if rec["probe"] == probe and rec["image_hash"] == h:
                rec["kept"] = True
                return

    def write(self, folder: Path | None) -> None:
        """``folder/probes.jsonl`` (every image drawn) and the kept images as PNG."""
        if folder is None:
            return
        from PIL import Image

        from attackers.wce import write_lines
        from emma.files import atomic_write_bytes

        for rec in self.records:
            a = self.images.get(rec["image_hash"])
            if a is not None and rec["kept"]:
                name = f"{rec['image_hash'][:16]}.png"
                buf = io.BytesIO()
                Image.fromarray(a).save(buf, format="PNG")
                atomic_write_bytes(folder / name, buf.getvalue(), fsync=False, what="a wce probe image")
                rec["file"] = name
        write_lines(folder / "probes.jsonl", self.records)


def _block(probe: str) -> int:
    from attackers.wce import PROBES

    return PROBES.index(probe)


_BASE = 8   # seed block: inpainting's base images
_TRAIN = 9  # seed block: base images the latent classifier and textual inversion learn from


def _domain_requests(target: Any) -> list[PromptRequest]:
    from attackers.wce import _domain_requests as get

    return get(target)


def _center_mask(height: int, width: int, fraction: float) -> torch.Tensor:
    """1 inside the central square (``fraction`` of each side) to generate, 0 around it."""
    mh, mw = max(1, round(height * fraction)), max(1, round(width * fraction))
    top, left = (height - mh) // 2, (width - mw) // 2
    m = torch.zeros(height, width)
    m[top : top + mh, left : left + mw] = 1.0
    return m


# ---- metrics ---------------------------------------------------------------------------------
def probe_metrics(probes: Sequence[str], kept: dict[str, list[list[Kept]]],
                  interference: Sequence[tuple[str, Sequence[Sample]]], seed: int,
                  n_resamples: int = 1000) -> dict[str, MetricValue]:
    """``wce/<probe>/asr`` (per attacked prompt, Wilson), ``wce/<probe>/asr/images`` (images,
    bootstrap clustered by prompt) and ``wce/interference/ra`` (the other concepts' images
    that show their concept, clustered by prompt)."""
    from emma.metrics.rates import AttackSuccessRate, PromptAttackSuccessRate, RetainingAbility

    out: dict[str, MetricValue] = {}
    for probe in probes:
        if probe == "interference":
            continue
        per = kept.get(probe, [])
        asr = PromptAttackSuccessRate()
        img = AttackSuccessRate(seed=seed, n_resamples=n_resamples)
        n_ex = 0
        for i, ks in enumerate(per):
            judged = [k.sample for k in ks if not k.sample.extra.get("excluded")]
            n_ex += len(ks) - len(judged)
            asr.update([s.detected for s in judged])
            img.update([s.detected for s in judged], clusters=[i] * len(judged))
        out[f"wce/{probe}/asr"] = asr.compute()
        out[f"wce/{probe}/asr/images"] = img.compute()
        if n_ex:
            out[f"wce/{probe}/asr/images"].n_excluded = n_ex
    if "interference" in probes and interference:
        ra = RetainingAbility(seed=seed, n_resamples=n_resamples)
        for i, (_, samples) in enumerate(interference):
            judged = [s for s in samples if not s.extra.get("excluded")]
            ra.update([s.detected for s in judged], clusters=[i] * len(judged))
        out["wce/interference/ra"] = ra.compute()
    return out
