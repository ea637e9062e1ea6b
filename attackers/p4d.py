"""P4D (Chin et al., ICML 2024): prompts whose noise prediction on the erased model matches
the base model's for the original prompt.

The algorithm of the reference code (joycenerd/P4D, ``run_p4dn.py``, ``prompt_optimization/
optimize_n.py`` and ``optimize_k.py``): the target image is the most unsafe (the judge's
highest concept score) of 3 base-model images of the prompt; continuous token embeddings are
projected each step to their nearest vocabulary embeddings (cosine, PEZ) for the forward
pass, with the gradient at the projected embeddings applied to the continuous ones (AdamW, lr
0.1, weight decay 0.1); loss = MSE between the erased UNet's noise prediction for the
adversarial prompt and the base UNet's for the original prompt, at ``x_t`` of the target
image's latent, a random timestep and fresh noise per step. P4D-N optimises 16 free tokens
(the prompt replaced); P4D-K puts a learnable token before every 3 prompt tokens (and one at
the end after a full group) and keeps the prompt's own tokens. Every ``eval_every`` steps the
hard prompt is drawn on the erased model and compared with the target image in an image
feature space (the reference: OpenCLIP ViT-H-14; here ``similarity``, or the judge's own
features where it has them — the tiny world); the most similar prompt is kept, with no early
stop. The judge is consulted once per request, to choose the target image
(``target_images`` > 1); ``selection: judge`` restores EMMA's former rule (keep the prompt
with the highest concept score, stop at the first judged success), declared as judged checks.

The original prompt stays a candidate (``keep_original``): it is drawn at the search's seed
and scored like the checks, and an attack whose best check is less similar to the target than
the original prompt hands on the original prompt (``extra.kept_original``; the best searched
prompt is named in ``extra.search_best_prompt``).

Requests are optimised as a batch (one UNet / text-encoder call per step for all of them),
the base model's text embeddings and target latents are computed once. Every image of the
search is drawn at ``target.search_seeds(request)``: never at the seeds of the final images.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

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
from emma.api.attacker import Attacker, AttackTarget, AttackTargetError
from emma.api.types import AttackOutput, PromptRequest
from emma.attack import judged_outputs
from emma.errors import ConfigError, UnknownChoiceError

VARIANTS = ("n", "k")
SELECTIONS = ("similarity", "judge")


class P4DAttacker(VocabularyCacheInputs, Attacker):
    """P4D-N / P4D-K.

    Args:
        variant: ``n`` (``n_tokens`` free tokens) or ``k`` (a learnable token before every
            ``every`` prompt tokens).
        n_tokens: P4D-N's prompt length (reference 16).
        every: P4D-K's spacing (reference 3).
        iterations: optimisation steps per request (reference 3000).
        learning_rate / weight_decay: AdamW's (reference 0.1 / 0.1).
        eval_every: steps between checks (reference 50).
        selection: ``similarity`` (the reference: keep the check whose image is most similar
            to the target image) or ``judge`` (keep the highest concept score of the judge).
        early_stop: stop a request at its first judged success (``selection: judge`` only).
        target_images: base-model images of the prompt whose most-concept one (by the judge)
            is the target (reference 3; 1: the first, no judge).
        similarity: the dotted name of a function that returns an image embedding
            (``images -> (N, D)``; CLIP at SD scale: ``classifiers.clip_zero_shot.image_embedding``),
            or ``None``: the judge's own features (``Classifier.features``).
        keep_original: the original prompt stays a candidate (see the module docstring).
        requests_per_batch: requests optimised (and cached) together.
        vocabulary: the tokens hard prompts are projected onto: ``all`` (the tokenizer's, the
            reference), ``domain`` (the tokens of the domain's prompts) or a list of words.
        seed: seeds the initial tokens, timesteps and noise.
    """

    name = "p4d"
    version = "3"  # 3: similarity selection, target = most-concept of 3 base images, search seeds
    needs_white_box = True
    needs_base_model = True
    resumable = True

    def __init__(self, variant: str = "n", n_tokens: int = 16, every: int = 3, iterations: int = 3000,
                 learning_rate: float = 0.1, weight_decay: float = 0.1, eval_every: int = 50,
                 selection: str = "similarity", early_stop: bool = False, target_images: int = 3,
                 similarity: Optional[str] = None, keep_original: bool = True,
                 requests_per_batch: int = 32, vocabulary: str | Sequence[str] = "all", seed: int = 0) -> None:
        if variant not in VARIANTS:
            raise UnknownChoiceError("P4D variant", variant, VARIANTS)
        self.variant = variant
        self.name = f"p4d_{variant}"  # type: ignore[misc]  # the variant names the attacker in results
        self.n_tokens = check_positive("p4d n_tokens", n_tokens)
        self.every = check_positive("p4d every", every)
        self.iterations = check_positive("p4d iterations", iterations)
        self.eval_every = check_positive("p4d eval_every", eval_every)
        self.learning_rate, self.weight_decay = float(learning_rate), float(weight_decay)
        if selection not in SELECTIONS:
            raise UnknownChoiceError("P4D selection", selection, SELECTIONS)
        self.selection = selection
        self.early_stop = bool(early_stop)
        if self.early_stop and selection != "judge":
            raise ConfigError("p4d early_stop=true stops at the judge's first success: it needs selection=judge "
                              "(the reference selects by image similarity, with no early stop)")
        self.target_images = check_positive("p4d target_images", target_images)
        self.similarity = str(similarity) if similarity else None
        self.keep_original = bool(keep_original)
        # the judge picks the target image among several, and checks under selection=judge
        self.uses_judge = selection == "judge" or self.target_images > 1
        self._embed: Any = None
        self.requests_per_batch = check_positive("p4d requests_per_batch", requests_per_batch)
        self.vocabulary = check_vocabulary("p4d", vocabulary)
        self.seed = int(seed)

    def budget(self) -> dict[str, int]:
        """Steps, checks (every ``eval_every`` steps and the last, plus the original prompt's)
        and the judged base images of the target choice."""
        last = self.iterations - 1
        checks = last // self.eval_every + 1 + int(last % self.eval_every != 0) + int(self.keep_original)
        return {"iterations": self.iterations, "checks": checks,
                "target_images": self.target_images}

    def config(self) -> dict[str, Any]:
        return {**super().config(), "variant": self.variant, "n_tokens": self.n_tokens, "every": self.every,
                "iterations": self.iterations, "learning_rate": self.learning_rate,
                "weight_decay": self.weight_decay, "eval_every": self.eval_every, "selection": self.selection,
                "early_stop": self.early_stop, "target_images": self.target_images, "similarity": self.similarity,
                "keep_original": self.keep_original, "vocabulary": self.vocabulary, "seed": self.seed,
                "budget": self.budget()}

    def _layout(self, prompt_ids: Sequence[int]) -> list[int | None]:
        return [None] * self.n_tokens if self.variant == "n" else after_every(prompt_ids, self.every)

    def check(self, target: AttackTarget, requests: Sequence[PromptRequest]) -> None:
        super().check(target, requests)
        if self.selection == "similarity" and self.similarity is not None:
            self._embedding()  # loads the embedding (and its weights) before any image is drawn
        if self.selection == "similarity" and self.similarity is None and not _judge_has_features(target):
            raise AttackTargetError("p4d selection=similarity with similarity=null compares images in the judge's "
                                    "feature space, and this judge has none; set attacker.similarity="
                                    "classifiers.clip_zero_shot.image_embedding (CLIP) or attacker.selection=judge")
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
        extras: list[dict[str, Any]] = [{} for _ in requests]
        for idx in groups.values():
            self._optimise(target, [requests[i] for i in idx], [states[i] for i in idx], [extras[i] for i in idx])
        share_time(states, t_batch)
        return judged_outputs(target, requests, [s.prompt for s in states],
                              [s.stats(variant=self.variant, **e) for s, e in zip(states, extras)])

    def _embedding(self) -> Any:
        if self._embed is None:
            import hydra.utils

            try:
                make = hydra.utils.get_method(str(self.similarity))
            except Exception as err:  # noqa: BLE001 - Hydra's lookup errors have several types
                raise ConfigError(f"p4d similarity={self.similarity!r} is not an importable function "
                                  f"({str(err).splitlines()[0]}); e.g. "
                                  "classifiers.clip_zero_shot.image_embedding") from None
            self._embed = make()
        return self._embed

    def embed(self, target: AttackTarget, images: torch.Tensor) -> torch.Tensor:
        """Unit image features the similarity is measured in."""
        if self.similarity is None:
            feats = target.features(images)
        else:
            feats = self._embedding()(images)
        return torch.nn.functional.normalize(feats.float().flatten(1), dim=-1)

    def _optimise(self, target: AttackTarget, reqs: Sequence[PromptRequest], states: list[RequestState],
                  extras: list[dict[str, Any]]) -> None:
        erased = target.white_box()
        base_model = target.base_model()
        base = base_model.white_box()
        gen = torch.Generator().manual_seed(self.seed)
        n = len(reqs)
        # the target: the most-concept of target_images base images (the judge's concept score)
        m_img = self.target_images
        seeds = [target.search_seeds(r, max(m_img, 1)) for r in reqs]
        drawn = base_model.generate([r.prompt for r in reqs for _ in range(m_img)],
                                    [s for ss in seeds for s in ss[:m_img]])
        pick = [0] * n
        if m_img > 1:
            probs = target.score(drawn.images, drawn.hashes)
            for i, r in enumerate(reqs):
                scores = target.concept_score(probs[i * m_img : (i + 1) * m_img], r.concept)
                pick[i] = int(torch.argmax(scores))
                states[i].judged += m_img
        images = torch.stack([drawn.images[i * m_img + pick[i]] for i in range(n)])
        x0 = base.encode_images(images).float()
        check_seeds = [ss[0] for ss in seeds]  # every check of a request draws at its first search seed
        for i in range(n):
            extras[i].update(search_seeds=seeds[i][:m_img], target_image=pick[i])
        goal_feats = self.embed(target, images) if self.selection == "similarity" else None
        if self.keep_original:
            orig = self._check(target, [r.prompt for r in reqs], reqs, list(range(n)), check_seeds, goal_feats)
            for i, (d, sc) in enumerate(orig):
                states[i].queries += 1
                states[i].judged += int(self.selection == "judge")
                extras[i].update(original_score=sc)
                states[i].best_score, states[i].success_check = sc, d
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
        # under selection=judge with early_stop, a request whose original prompt already succeeds stops
        live = [i for i in range(n) if not (self.early_stop and states[i].success_check)]
        best_search = [("", -float("inf"), False)] * n  # (prompt, score, detected) of the best check
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
                checked = self._check(target, texts, reqs, live, [check_seeds[i] for i in live], goal_feats)
                still = []
                for i, text, (d, sc) in zip(live, texts, checked):
                    st = states[i]
                    st.queries += 1
                    st.judged += int(self.selection == "judge")
                    bp, bs, bd = best_search[i]
                    # keep the best check so far: the most similar image (reference), or under
                    # selection=judge a success before any score
                    if (d and not bd) or (d == bd and sc > bs) or not bp:
                        best_search[i] = (text, sc, d)
                    if not (d and self.early_stop):
                        still.append(i)
                live = still
        bar.close()
        for i, st in enumerate(states):
            text, sc, d = best_search[i]
            extras[i].update(search_best_prompt=text, search_best_score=sc)
            # the original prompt stays a candidate: handed on when the search judged it better
            kept = self.keep_original and (st.success_check, st.best_score) > (d, sc)
            extras[i]["kept_original"] = bool(kept)
            if not kept:
                st.prompt, st.best_score, st.success_check = text, sc, d

    def _check(self, target: AttackTarget, texts: Sequence[str], reqs: Sequence[PromptRequest],
               rows: Sequence[int], seeds: Sequence[int], goal_feats: torch.Tensor | None) -> list[tuple[bool, float]]:
        """(success, score) of each text drawn once on the erased model: under ``similarity``
        the cosine similarity to the request's target image (success unknown: ``False``),
        under ``judge`` the judge's verdict and concept score."""
        if self.selection == "judge":
            det, score = target.check_prompts(list(texts), [reqs[i].concept for i in rows], list(seeds))
            return list(zip(det, score))
        gen = target.generate(list(texts), list(seeds))
        feats = self.embed(target, gen.images)
        sims = (feats * goal_feats[list(rows)]).sum(-1)
        return [(False, float(x)) for x in sims]


def _judge_has_features(target: Any) -> bool:
    judge = getattr(target, "judge", None)
    return bool(getattr(getattr(judge, "classifier", None), "has_features", False))
