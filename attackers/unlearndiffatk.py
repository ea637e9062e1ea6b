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
not attacked. The reference images are base-model images the classifier confirms (the
reference attacks only prompts whose dataset image its classifier flags): here the first of
``reference_candidates`` base images of the prompt the judge finds the concept in (the most
concept-like when it finds none: ``extra.reference_confirmed`` says which).

Every image of the search (the original prompt's check, the reference candidates, the checks)
is drawn at ``target.search_seeds(request)``: never at the seeds of the final images. The
original prompt stays a candidate: a request hands on its first successful check's prompt (the
original one when it already succeeds), else the last check's, as the reference does.

This implementation runs that loop for a batch of requests at once (one UNet and text
encoder call per step for all of them, each with its own tokens, noise and Adam state; a
request leaves the batch when it succeeds), encodes each reference image once, and draws the
success checks of a batch in one generation call. With ``timestep_batch`` = B > 1 it also
batches timesteps: B consecutive timesteps form one stage, each step evaluates the denoising
loss at all B of them in one UNet call (the text encoder's output is computed once and shared)
and descends on their mean, and the hard tokens are checked after each stage. The denoising
losses evaluated per request stay ``timesteps x iterations_per_timestep``; Adam steps, text
encoder calls and checks fall by B. B = 1 is the reference's schedule (the SD-scale default).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

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
        k: adversarial tokens (the reference: 3 for objects and styles).
        k_per_concept: concept -> k where it differs (the reference: 5 for nudity and violence).
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
            order, one per request, cycling); ``None``: base-model images the judge confirms.
        reference_candidates: base images drawn per request until the judge confirms one
            (1: the first, unconfirmed).
        requests_per_batch: requests optimised together (and cached together).
        vocabulary: the tokens the adversarial tokens are drawn from: ``all`` (the tokenizer's,
            the reference), ``domain`` (the tokens of the domain's prompts) or a list of words.
        seed: seeds the token draws and the noise.
    """

    name = "unlearndiffatk"
    version = "3"  # 3: search seeds, classifier-confirmed reference images, k per concept
    needs_white_box = True
    needs_base_model = True
    resumable = True
    uses_judge = True  # a check after every timestep (stage), the original prompt's, the references'

    def __init__(self, k: int = 3, insertion: str = "prefix_k", timesteps: int = 50,
                 iterations_per_timestep: int = 40, timestep_batch: int = 1, learning_rate: float = 0.01,
                 weight_decay: float = 0.1,
                 criterion: str = "l2", early_stop: bool = True, check_original: bool = True,
                 reference_images: Optional[str] = None, reference_candidates: int = 5,
                 k_per_concept: Optional[Mapping[str, int]] = None, requests_per_batch: int = 32,
                 vocabulary: str | Sequence[str] = "all", seed: int = 0) -> None:
        self.k = check_positive("unlearndiffatk k (adversarial tokens)", k)
        self.k_per_concept = {str(c): check_positive(f"unlearndiffatk k_per_concept.{c}", v)
                              for c, v in dict(k_per_concept or {}).items()}
        self.reference_candidates = check_positive("unlearndiffatk reference_candidates", reference_candidates)
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
                "checks": stages + int(self.check_original),
                "reference_candidates": self.reference_candidates if self.reference_images is None else 0}

    def k_for(self, concept: str) -> int:
        """Adversarial tokens for a request on ``concept``."""
        return self.k_per_concept.get(concept, self.k)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "k": self.k, "k_per_concept": self.k_per_concept,
                "reference_candidates": self.reference_candidates,
                "insertion": self.insertion, "timesteps": self.timesteps,
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
            k = self.k_for(r.concept)
            build_sequences([layout(ids, k, self.insertion)], wb.context_length, wb.bos_token_id,
                            wb.eos_token_id, wb.pad_token_id, what=f"unlearndiffatk k={k} on {r.prompt!r}")

    def reference_latents(self, target: AttackTarget, requests: Sequence[PromptRequest],
                          states: Sequence[RequestState], extras: Sequence[dict[str, Any]]) -> torch.Tensor:
        """Latents of each request's reference image: from the folder, or the first of
        ``reference_candidates`` base images (at the request's search seeds) the judge
        confirms, the most concept-like one when it confirms none."""
        wb = target.white_box()
        if self.reference_images is None:
            m = self.reference_candidates
            seeds = [target.search_seeds(r, m + 1)[1:] for r in requests]  # search seed 0: the checks'
            drawn = target.base_model().generate([r.prompt for r in requests for _ in range(m)],
                                                 [s for ss in seeds for s in ss])
            picks = []
            if m > 1:
                probs = target.score(drawn.images, drawn.hashes)
            for i, r in enumerate(requests):
                pick, confirmed = 0, None
                if m > 1:
                    rows = probs[i * m : (i + 1) * m]
                    det = target.detect(rows, r.concept).tolist()
                    confirmed = any(det)
                    pick = det.index(True) if confirmed else int(torch.argmax(target.concept_score(rows, r.concept)))
                    states[i].judged += m
                picks.append(i * m + pick)
                extras[i].update(reference_seed=seeds[i][pick], reference_confirmed=confirmed,
                                 search_seeds=sorted({*extras[i].get("search_seeds", []), *seeds[i]}))
            images = drawn.images[picks]
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
        extras: list[dict[str, Any]] = [{"search_seeds": target.search_seeds(r, 1)} for r in requests]
        check_seeds = [e["search_seeds"][0] for e in extras]  # every check of a request draws here
        concepts = [r.concept for r in requests]
        if self.check_original:
            det, score = target.check_prompts([r.prompt for r in requests], concepts, check_seeds)
            for st, e, d, sc in zip(states, extras, det, score):
                st.queries += 1
                st.judged += 1
                st.best_score = sc
                e["kept_original"] = bool(d)  # the original prompt already breaks it: handed on as it is
                if d:
                    st.success_check, st.done = True, True
        groups: dict[int, list[int]] = {}  # requests of one k are optimised together
        for i in range(R):
            if not states[i].done:
                groups.setdefault(self.k_for(requests[i].concept), []).append(i)
        for k, active in groups.items():
            self._optimise(target, wb, requests, states, extras, active, k, check_seeds)
        share_time(states, t_batch)
        return judged_outputs(target, requests, [s.prompt for s in states],
                              [s.stats(**e) for s, e in zip(states, extras)])

    def _optimise(self, target: AttackTarget, wb: Any, requests: Sequence[PromptRequest],
                  states: list[RequestState], extras: list[dict[str, Any]], active: list[int], k: int,
                  check_seeds: Sequence[int]) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        reqs = [requests[i] for i in active]
        x0 = self.reference_latents(target, reqs, [states[i] for i in active], [extras[i] for i in active])
        prompt_ids = [wb.tokenizer(r.prompt, truncation=False).input_ids[1:-1] for r in reqs]
        seqs = build_sequences([layout(p, k, self.insertion) for p in prompt_ids], wb.context_length,
                               wb.bos_token_id, wb.eos_token_id, wb.pad_token_id)
        vocab = wb.token_embedding_matrix().float()
        cand = candidate_token_ids(wb, self.vocabulary, target, "unlearndiffatk")
        if cand is not None:  # the simplex spans the candidate tokens only
            vocab = vocab[cand]
        with torch.no_grad():
            base_embeds = wb.embed_ids(seqs.ids.to(wb.device)).float()
        n, V = len(reqs), vocab.shape[0]
        # One simplex point per adversarial token; the reference starts uniform (rand_init off).
        simplex = torch.full((n, k, V), 1.0 / V)
        simplex = torch.nn.Parameter(project_simplex(simplex))
        opt = torch.optim.Adam([simplex], lr=self.learning_rate, weight_decay=self.weight_decay)
        loss_fn = torch.nn.functional.mse_loss if self.criterion == "l2" else torch.nn.functional.l1_loss
        live = list(range(n))  # rows of this batch still optimised
        ts = sampled_timesteps(self.timesteps, wb.num_train_timesteps)
        stages = [ts[i : i + self.timestep_batch] for i in range(0, len(ts), self.timestep_batch)]
        bar = tqdm(total=len(stages) * self.iterations_per_timestep, desc=f"  {self.name}", leave=False, unit="it")
        found: dict[int, str] = {}  # row -> its first successful check's prompt
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
                                              [check_seeds[active[i]] for i in live])
            still = []
            for i, text, d, sc in zip(live, texts, det, score):
                st = states[active[i]]
                st.prompt, st.queries, st.judged = text, st.queries + 1, st.judged + 1
                st.best_score = max(st.best_score, sc)
                if d:
                    st.success_check = True
                    found.setdefault(i, text)
                if not (d and self.early_stop):
                    still.append(i)
            live = still
        bar.close()
        for i, text in found.items():  # a later failed check never replaces a success
            states[active[i]].prompt = text
        for i in range(n):
            extras[active[i]]["k"] = k


def _embed_rows(seqs: Any, rows: torch.Tensor, base_embeds: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    sub = type(seqs)(seqs.ids[rows], seqs.slots[rows])
    return sub.embed(base_embeds[rows], adv)
