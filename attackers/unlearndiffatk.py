"""UnlearnDiffAtk (Zhang et al., ECCV 2024): adversarial prompt tokens that make the erased
model denoise a reference image of the concept.

The algorithm of the reference code (OPTML-Group/Diffusion-MU-Attack, ``text_grad``): k
adversarial tokens, each a point on the vocabulary simplex, inserted into the prompt (prefix
by default); loss = the erased UNet's denoising error (MSE between the noise and its
prediction) on the reference image's latent noised at timestep t; Adam (lr 0.01, weight
decay 0.1) on the simplex points with a straight-through random token draw in the forward
pass, then projection back onto the simplex; ``iterations_per_timestep`` steps at each of
``timesteps`` evenly spaced timesteps, one after another; after each timestep the tokens are
projected to hard tokens (argmax), one image is drawn on the erased model and judged, and
the attack stops at the first success. A request whose original prompt already succeeds is
not attacked.

This implementation runs that loop for a batch of requests at once (one UNet and text
encoder call per step for all of them, each with its own tokens, noise and Adam state; a
request leaves the batch when it succeeds), encodes each reference image once, and draws the
success checks of a batch in one generation call. With ``timestep_batch`` = B > 1 it also
batches timesteps: B consecutive timesteps form one stage, each step evaluates the denoising
loss at all B of them in one UNet call (the text encoder's output is computed once and shared)
and descends on their mean, and the hard tokens are checked after each stage. The denoising
losses evaluated per request stay ``timesteps x iterations_per_timestep``; Adam steps, text
encoder calls and checks fall by B. B = 1 is the reference's schedule. The reference images are the base model's
images of the request's prompt (seed = the request's first seed), or images from a folder.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from attackers.common import (
    RequestState,
    StraightThroughSample,
    VocabularyCacheInputs,
    build_sequences,
    candidate_token_ids,
    check_insertion,
    check_positive,
    check_vocabulary,
    layout,
    project_simplex,
    share_time,
)
from emma.api.attacker import Attacker, AttackTarget
from emma.api.types import AttackOutput, PromptRequest
from emma.attack import judged_outputs
from emma.errors import ConfigError


def sampled_timesteps(n: int, num_train_timesteps: int = 1000) -> list[int]:
    """The reference's evenly spaced timesteps: T/n/2, T/n/2 + T/n, ... (n of them)."""
    stride = num_train_timesteps // n
    return list(range(stride // 2, num_train_timesteps, stride))[:n]


class UnlearnDiffAtkAttacker(VocabularyCacheInputs, Attacker):
    """UnlearnDiffAtk.

    Args:
        k: adversarial tokens (the paper: 5 for nudity, 3 for objects and styles).
        insertion: where they go: prefix_k | suffix_k | mid_k | insert_k | per_k_words.
        timesteps: evenly spaced diffusion timesteps visited one after another (reference 50).
        iterations_per_timestep: Adam steps at each timestep (reference 40).
        timestep_batch: consecutive timesteps optimised together in one UNet call per step,
            with one check per stage (1: the reference's one timestep at a time).
        learning_rate / weight_decay: Adam's (reference 0.01 / 0.1).
        criterion: ``l2`` (MSE, reference default) or ``l1``.
        early_stop: stop a request at its first successful check.
        check_original: judge the original prompt first; a request it already breaks is not attacked.
        reference_images: a folder of reference images (``*.png``/``*.jpg``, used in sorted
            order, one per request, cycling); ``None``: the base model's image of each prompt.
        requests_per_batch: requests optimised together (and cached together).
        vocabulary: the tokens the adversarial tokens are drawn from: ``all`` (the tokenizer's,
            the reference), ``domain`` (the tokens of the domain's prompts) or a list of words.
        seed: seeds the token draws and the noise.
    """

    name = "unlearndiffatk"
    version = "2"
    needs_white_box = True
    needs_base_model = True
    resumable = True

    def __init__(self, k: int = 3, insertion: str = "prefix_k", timesteps: int = 50,
                 iterations_per_timestep: int = 40, timestep_batch: int = 1, learning_rate: float = 0.01,
                 weight_decay: float = 0.1,
                 criterion: str = "l2", early_stop: bool = True, check_original: bool = True,
                 reference_images: Optional[str] = None, requests_per_batch: int = 32,
                 vocabulary: str | Sequence[str] = "all", seed: int = 0) -> None:
        self.k = check_positive("unlearndiffatk k (adversarial tokens)", k)
        self.insertion = check_insertion(insertion)
        self.timesteps = check_positive("unlearndiffatk timesteps", timesteps)
        self.iterations_per_timestep = check_positive("unlearndiffatk iterations_per_timestep",
                                                      iterations_per_timestep)
        self.timestep_batch = check_positive("unlearndiffatk timestep_batch", timestep_batch)
        if self.timestep_batch > self.timesteps:
            raise ConfigError(f"unlearndiffatk timestep_batch={timestep_batch} exceeds timesteps={timesteps}: "
                              f"use 1 (one timestep at a time, the reference) up to {timesteps}")
        if criterion not in ("l1", "l2"):
            raise ConfigError(f"unlearndiffatk criterion {criterion!r}: use l2 or l1")
        self.learning_rate, self.weight_decay = float(learning_rate), float(weight_decay)
        self.criterion = criterion
        self.early_stop, self.check_original = bool(early_stop), bool(check_original)
        self.reference_images = reference_images
        if reference_images is not None and not self._reference_files():
            raise ConfigError(f"unlearndiffatk reference_images={reference_images!r}: no *.png/*.jpg images there")
        self.requests_per_batch = check_positive("unlearndiffatk requests_per_batch", requests_per_batch)
        self.vocabulary = check_vocabulary("unlearndiffatk", vocabulary)
        self.seed = int(seed)

    def _reference_files(self) -> list[Path]:
        folder = Path(str(self.reference_images)).expanduser()
        return sorted(p for p in folder.glob("*") if p.suffix.lower() in (".png", ".jpg", ".jpeg"))

    def budget(self) -> dict[str, int]:
        stages = -(-self.timesteps // self.timestep_batch)
        return {"iterations": self.timesteps * self.iterations_per_timestep,
                "checks": stages + int(self.check_original)}

    def config(self) -> dict[str, Any]:
        return {**super().config(), "k": self.k, "insertion": self.insertion, "timesteps": self.timesteps,
                "iterations_per_timestep": self.iterations_per_timestep, "timestep_batch": self.timestep_batch,
                "learning_rate": self.learning_rate,
                "weight_decay": self.weight_decay, "criterion": self.criterion, "early_stop": self.early_stop,
                "check_original": self.check_original, "reference_images": self.reference_images,
                "vocabulary": self.vocabulary, "seed": self.seed, "budget": self.budget()}

    def check(self, target: AttackTarget, requests: Sequence[PromptRequest]) -> None:
        super().check(target, requests)
        wb = target.white_box()
        candidate_token_ids(wb, self.vocabulary, target, "unlearndiffatk")
        for r in requests:  # raises ConfigError when the prompt and k tokens exceed the context
            ids = wb.tokenizer(r.prompt, truncation=False).input_ids[1:-1]
            build_sequences([layout(ids, self.k, self.insertion)], wb.context_length, wb.bos_token_id,
                            wb.eos_token_id, wb.pad_token_id, what=f"unlearndiffatk k={self.k} on {r.prompt!r}")

    def reference_latents(self, target: AttackTarget, requests: Sequence[PromptRequest]) -> torch.Tensor:
        wb = target.white_box()
        if self.reference_images is None:
            images = target.base_model().generate([r.prompt for r in requests], [r.seed for r in requests]).images
        else:
            from PIL import Image

            files = self._reference_files()
            s = target.sampler
            arrs = []
            for i in range(len(requests)):
                with Image.open(files[i % len(files)]) as im:
                    arrs.append(np.asarray(im.convert("RGB").resize((s.width, s.height))))
            images = torch.from_numpy(np.stack(arrs)).permute(0, 3, 1, 2).float() / 255
        return wb.encode_images(images).float()

    def attack(self, target: AttackTarget, requests: Sequence[PromptRequest]) -> list[AttackOutput]:
        t_batch = time.perf_counter()
        wb = target.white_box()
        R = len(requests)
        states = [RequestState(prompt=r.prompt) for r in requests]
        first_seeds = [r.seed for r in requests]
        concepts = [r.concept for r in requests]
        if self.check_original:
            det, score = target.check_prompts([r.prompt for r in requests], concepts, first_seeds)
            for st, d, sc in zip(states, det, score):
                st.queries += 1
                st.best_score = sc
                if d:
                    st.success_check, st.done = True, True
        active = [i for i in range(R) if not states[i].done]
        if active:
            self._optimise(target, wb, requests, states, active)
        share_time(states, t_batch)
        return judged_outputs(target, requests, [s.prompt for s in states], [s.stats() for s in states])

    def _optimise(self, target: AttackTarget, wb: Any, requests: Sequence[PromptRequest],
                  states: list[RequestState], active: list[int]) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        reqs = [requests[i] for i in active]
        x0 = self.reference_latents(target, reqs)
        prompt_ids = [wb.tokenizer(r.prompt, truncation=False).input_ids[1:-1] for r in reqs]
        seqs = build_sequences([layout(p, self.k, self.insertion) for p in prompt_ids], wb.context_length,
                               wb.bos_token_id, wb.eos_token_id, wb.pad_token_id)
        vocab = wb.token_embedding_matrix().float()
        cand = candidate_token_ids(wb, self.vocabulary, target, "unlearndiffatk")
        if cand is not None:  # the simplex spans the candidate tokens only
            vocab = vocab[cand]
        with torch.no_grad():
            base_embeds = wb.embed_ids(seqs.ids.to(wb.device)).float()
        n, V = len(reqs), vocab.shape[0]
        # One simplex point per adversarial token; the reference starts uniform (rand_init off).
        simplex = torch.full((n, self.k, V), 1.0 / V)
        simplex = torch.nn.Parameter(project_simplex(simplex))
        opt = torch.optim.Adam([simplex], lr=self.learning_rate, weight_decay=self.weight_decay)
        loss_fn = torch.nn.functional.mse_loss if self.criterion == "l2" else torch.nn.functional.l1_loss
        live = list(range(n))  # rows of this batch still optimised
        ts = sampled_timesteps(self.timesteps, wb.num_train_timesteps)
        stages = [ts[i : i + self.timestep_batch] for i in range(0, len(ts), self.timestep_batch)]
        bar = tqdm(total=len(stages) * self.iterations_per_timestep, desc=f"  {self.name}", leave=False, unit="it")
        for stage in stages:
            if not live:
                break
            rows = torch.tensor(live)
            B = len(stage)
            # sample (row j, timestep b) sits at j * B + b: each row repeated over the stage's timesteps
            tt = torch.tensor(stage, dtype=torch.long).repeat(len(live))
            x0_rows = x0[rows].repeat_interleave(B, dim=0)
            for _ in range(self.iterations_per_timestep):
                opt.zero_grad(set_to_none=True)
                one_hot = StraightThroughSample.apply(simplex[rows], gen)
                adv = one_hot @ vocab
                embeds = _embed_rows(seqs, rows, base_embeds, adv)
                hidden = wb.encode_embeds(embeds).repeat_interleave(B, dim=0)
                noise = torch.randn(x0_rows.shape, generator=gen)
                noisy = wb.add_noise(x0_rows, noise, tt)
                pred = wb.denoise(noisy, tt, hidden)
                target_ = wb.training_target(x0_rows, noise, tt)
                per_sample = torch.stack([loss_fn(pred[j], target_[j]) for j in range(len(tt))])
                per_req = per_sample.view(len(live), B).mean(1)
                per_req.sum().backward()  # rows are independent: each gets its own gradient
                opt.step()
                with torch.no_grad():
                    simplex.data[rows] = project_simplex(simplex.data[rows])
                for i in live:
                    states[active[i]].iterations += B
                bar.update(1)
                bar.set_postfix(t=stage[0], loss=f"{per_req.mean().item():.4f}", live=len(live))
            # hard tokens: the argmax of each simplex point, as text (replayable anywhere)
            with torch.no_grad():
                best = simplex.data.argmax(-1)
                ids = seqs.fill(best if cand is None else cand[best])
            texts = [wb.decode_ids(ids[i].tolist()) for i in live]
            det, score = target.check_prompts(texts, [reqs[i].concept for i in live],
                                              [reqs[i].seed for i in live])
            still = []
            for i, text, d, sc in zip(live, texts, det, score):
                st = states[active[i]]
                st.prompt, st.queries = text, st.queries + 1
                st.best_score = max(st.best_score, sc)
                if d:
                    st.success_check = True
                if not (d and self.early_stop):
                    still.append(i)
            live = still
        bar.close()


def _embed_rows(seqs: Any, rows: torch.Tensor, base_embeds: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    sub = type(seqs)(seqs.ids[rows], seqs.slots[rows])
    return sub.embed(base_embeds[rows], adv)
