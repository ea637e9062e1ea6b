"""P4D (Chin et al., ICML 2024): prompts whose noise prediction on the erased model matches
the base model's for the original prompt.

The algorithm of the reference code (joycenerd/P4D, ``prompt_optimization/optimize_n.py`` and
``optimize_k.py``): continuous token embeddings, projected each step to their nearest
vocabulary embeddings (cosine, PEZ) for the forward pass, with the gradient at the projected
embeddings applied to the continuous ones (AdamW, lr 0.1, weight decay 0.1); loss = MSE
between the erased UNet's noise prediction for the adversarial prompt and the base UNet's for
the original prompt, at ``x_t`` of the base model's image of the prompt, a random timestep
and fresh noise per step. P4D-N optimises 16 free tokens (the prompt replaced); P4D-K puts
a learnable token before every 3 prompt tokens (and one at the end after a full group) and
keeps the prompt's own tokens. Every
``eval_every`` steps the hard prompt is drawn on the erased model and judged; the best one
(highest concept score of the judge; the reference uses CLIP similarity to the base images)
is kept, and with ``early_stop`` a request stops at its first success.

Requests are optimised as a batch (one UNet / text-encoder call per step for all of them),
the base model's text embeddings and reference latents are computed once.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from attackers.common import (
    RequestState,
    VocabularyCacheInputs,
    after_every,
    build_sequences,
    candidate_token_ids,
    check_positive,
    check_vocabulary,
    share_time,
)
from emma.api.attacker import Attacker, AttackTarget
from emma.api.types import AttackOutput, PromptRequest
from emma.attack import judged_outputs
from emma.errors import UnknownChoiceError

VARIANTS = ("n", "k")


class P4DAttacker(VocabularyCacheInputs, Attacker):
    """P4D-N / P4D-K.

    Args:
        variant: ``n`` (``n_tokens`` free tokens) or ``k`` (a learnable token before every
            ``every`` prompt tokens).
        n_tokens: P4D-N's prompt length (reference 16).
        every: P4D-K's spacing (reference 3).
        iterations: optimisation steps per request (reference 3000).
        learning_rate / weight_decay: AdamW's (reference 0.1 / 0.1).
        eval_every: steps between judged checks (reference 50).
        early_stop: stop a request at its first successful check.
        requests_per_batch: requests optimised (and cached) together.
        vocabulary: the tokens hard prompts are projected onto: ``all`` (the tokenizer's, the
            reference), ``domain`` (the tokens of the domain's prompts) or a list of words.
        seed: seeds the initial tokens, timesteps and noise.
    """

    name = "p4d"
    version = "2"
    needs_white_box = True
    needs_base_model = True
    resumable = True

    def __init__(self, variant: str = "n", n_tokens: int = 16, every: int = 3, iterations: int = 3000,
                 learning_rate: float = 0.1, weight_decay: float = 0.1, eval_every: int = 50,
                 early_stop: bool = True, requests_per_batch: int = 32,
                 vocabulary: str | Sequence[str] = "all", seed: int = 0) -> None:
        if variant not in VARIANTS:
            raise UnknownChoiceError("P4D variant", variant, VARIANTS)
        self.variant = variant
        self.name = f"p4d_{variant}"  # type: ignore[misc]  # the variant names the attacker in results
        self.n_tokens = check_positive("p4d n_tokens", n_tokens)
        self.every = check_positive("p4d every", every)
        self.iterations = check_positive("p4d iterations", iterations)
        self.eval_every = check_positive("p4d eval_every", eval_every)
        self.learning_rate, self.weight_decay = float(learning_rate), float(weight_decay)
        self.early_stop = bool(early_stop)
        self.requests_per_batch = check_positive("p4d requests_per_batch", requests_per_batch)
        self.vocabulary = check_vocabulary("p4d", vocabulary)
        self.seed = int(seed)

    def budget(self) -> dict[str, int]:
        return {"iterations": self.iterations, "checks": -(-self.iterations // self.eval_every)}

    def config(self) -> dict[str, Any]:
        return {**super().config(), "variant": self.variant, "n_tokens": self.n_tokens, "every": self.every,
                "iterations": self.iterations, "learning_rate": self.learning_rate,
                "weight_decay": self.weight_decay, "eval_every": self.eval_every,
                "early_stop": self.early_stop, "vocabulary": self.vocabulary, "seed": self.seed,
                "budget": self.budget()}

    def _layout(self, prompt_ids: Sequence[int]) -> list[int | None]:
        return [None] * self.n_tokens if self.variant == "n" else after_every(prompt_ids, self.every)

    def check(self, target: AttackTarget, requests: Sequence[PromptRequest]) -> None:
        super().check(target, requests)
        wb = target.white_box()
        candidate_token_ids(wb, self.vocabulary, target, self.name)
        for r in requests:
            ids = wb.tokenizer(r.prompt, truncation=False).input_ids[1:-1]
            build_sequences([self._layout(ids)], wb.context_length, wb.bos_token_id, wb.eos_token_id,
                            wb.pad_token_id, what=f"{self.name} on {r.prompt!r}")

    def attack(self, target: AttackTarget, requests: Sequence[PromptRequest]) -> list[AttackOutput]:
        t_batch = time.perf_counter()
        states = [RequestState(prompt=r.prompt) for r in requests]
        # P4D-K layouts differ in slot count between prompts: batch prompts of equal count.
        groups: dict[int, list[int]] = {}
        wb = target.white_box()
        for i, r in enumerate(requests):
            ids = wb.tokenizer(r.prompt, truncation=False).input_ids[1:-1]
            groups.setdefault(sum(t is None for t in self._layout(ids)), []).append(i)
        for idx in groups.values():
            self._optimise(target, [requests[i] for i in idx], [states[i] for i in idx])
        share_time(states, t_batch)
        return judged_outputs(target, requests, [s.prompt for s in states],
                              [s.stats(variant=self.variant) for s in states])

    def _optimise(self, target: AttackTarget, reqs: Sequence[PromptRequest], states: list[RequestState]) -> None:
        erased = target.white_box()
        base_model = target.base_model()
        base = base_model.white_box()
        gen = torch.Generator().manual_seed(self.seed)
        n = len(reqs)
        images = base_model.generate([r.prompt for r in reqs], [r.seed for r in reqs]).images
        x0 = base.encode_images(images).float()
        with torch.no_grad():
            target_hidden = base.encode_ids(base.token_ids([r.prompt for r in reqs]))
        prompt_ids = [erased.tokenizer(r.prompt, truncation=False).input_ids[1:-1] for r in reqs]
        seqs = build_sequences([self._layout(p) for p in prompt_ids], erased.context_length,
                               erased.bos_token_id, erased.eos_token_id, erased.pad_token_id)
        vocab = erased.token_embedding_matrix().float()
        m = seqs.slots.shape[1]
        cand = candidate_token_ids(erased, self.vocabulary, target, self.name)
        if cand is None:  # the reference draws initial ids from the whole vocabulary, specials excluded here
            cand = torch.arange(min(erased.bos_token_id, erased.eos_token_id))
            init = torch.randint(0, len(cand), (n, m), generator=gen)
        else:
            init = cand[torch.randint(0, len(cand), (n, m), generator=gen)]
        # PEZ projects onto the candidates (the whole vocabulary in the reference)
        cand_unit = torch.nn.functional.normalize(vocab, dim=-1)[cand]
        soft = torch.nn.Parameter(vocab[init].clone())
        opt = torch.optim.AdamW([soft], lr=self.learning_rate, weight_decay=self.weight_decay)
        with torch.no_grad():
            base_embeds = erased.embed_ids(seqs.ids.to(erased.device)).float()
        live = list(range(n))
        bar = tqdm(total=self.iterations, desc=f"  {self.name}", leave=False, unit="it")
        for step in range(self.iterations):
            if not live:
                break
            rows = torch.tensor(live)
            with torch.no_grad():  # PEZ: forward with the nearest hard tokens
                nn_ids = cand[(torch.nn.functional.normalize(soft.data[rows], dim=-1) @ cand_unit.T).argmax(-1)]
            hard = vocab[nn_ids].clone().requires_grad_(True)
            sub = type(seqs)(seqs.ids[rows], seqs.slots[rows])
            hidden = erased.encode_embeds(sub.embed(base_embeds[rows], hard))
            t = torch.randint(0, erased.num_train_timesteps, (len(live),), generator=gen)
            noise = torch.randn(x0[rows].shape, generator=gen)
            noisy = erased.add_noise(x0[rows], noise, t)
            with torch.no_grad():
                goal = base.denoise(noisy, t, target_hidden[rows])
            pred = erased.denoise(noisy, t, hidden)
            per_req = ((pred - goal) ** 2).flatten(1).mean(1)
            grad, = torch.autograd.grad(per_req.sum(), [hard])
            soft.grad = torch.zeros_like(soft)
            soft.grad[rows] = grad
            opt.step()
            for i in live:
                states[i].iterations += 1
            bar.update(1)
            bar.set_postfix(loss=f"{per_req.mean().item():.4f}", live=len(live))
            if step % self.eval_every == 0 or step == self.iterations - 1:
                texts = [erased.decode_ids(ids) for ids in sub.fill(nn_ids).tolist()]
                det, score = target.check_prompts(texts, [reqs[i].concept for i in live], [reqs[i].seed for i in live])
                still = []
                for i, text, d, sc in zip(live, texts, det, score):
                    st = states[i]
                    st.queries += 1
                    # keep the best prompt so far (highest concept score); a success always wins
                    if (d and not st.success_check) or (not st.success_check and sc > st.best_score):
                        st.prompt, st.best_score = text, sc
                    st.success_check = st.success_check or d
                    if not (st.success_check and self.early_stop):
                        still.append(i)
                live = still
        bar.close()
