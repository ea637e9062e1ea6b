"""Ring-A-Bell (Tsai et al., ICLR 2024): a concept vector in the text encoder's space, and a
genetic search for hard prompts whose embedding is close to embed(prompt) + eta * vector.

The algorithm of the reference code (chiayi-hsu/Ring-A-Bell, ``Get_Concept_Vector`` and
``InversePrompt``): the concept vector is the mean, over paired prompts with and without the
concept, of the difference of their text-encoder outputs (all positions); a prompt's target
is its own encoding plus ``eta`` times the vector; a population of ``population`` prompts of
``K`` random tokens evolves for ``generations``: keep the better half by squared distance to
the target, one-point crossover with a random partner (probability ``crossover_rate``, two
children), then a random token replaced in each individual with probability
``mutation_rate``. The best prompt of the last generation is the attack. Model-agnostic: only
the tokenizer and text encoder are used, the erased model is queried once per final image.

Concept vectors: for a concept listed in ``concept_vectors``, the reference's own vector
(``Concept Vectors/<Name>_vector.npy`` at a pinned commit, checked by sha256:
:data:`REFERENCE_VECTORS`; the nudity vector averages the differences of 50 nudity / no-nudity
prompt pairs with the pairs NudeNet rejected dropped, the violence vector 30 violent / safe
sentence pairs, ``Get_Concept_Vector.ipynb``) or a local ``.npy`` of the text encoder's output
shape; for any other concept, the documented fallback: pairs of ``pair_templates`` filled with
the concept and with ``neutral``, plus the attacked prompts that name the concept paired with
themselves without the name.

Populations of a batch of requests are scored in one text-encoder call per generation, and
an individual's fitness is computed once (unchanged parents keep theirs).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from attackers.common import (
    RequestState,
    VocabularyCacheInputs,
    candidate_token_ids,
    check_positive,
    check_vocabulary,
    share_time,
)
from emma.api.attacker import Attacker, AttackTarget
from emma.api.types import AttackOutput, PromptRequest
from emma.attack import judged_outputs
from emma.datasets.download import RemoteFile
from emma.errors import ConfigError

RING_A_BELL_REPO = "chiayi-hsu/Ring-A-Bell"
RING_A_BELL_COMMIT = "e4585ada0a5eb185fbef89bb94147c97f8d2f79a"
#: The reference's concept vectors (SD v1.x text encoder, 77 x 768), pinned by commit and sha256.
REFERENCE_VECTORS: dict[str, RemoteFile] = {
    name: RemoteFile(RING_A_BELL_REPO, RING_A_BELL_COMMIT, f"Concept%20Vectors/{file}", sha,
                     f"Ring-A-Bell concept vector '{name}' ({file})")
    for name, file, sha in (
        ("nudity", "Nudity_vector.npy", "5e1c6a6612a515c08d46ed8668469bf20e5e34b636f32f8774a9ccef1160dd27"),
        ("violence", "Violence_vector.npy", "a97bac99bb75f58b353fa9dbb6673bae7e1e25ad04c2b3125291520be15f26df"),
        ("car", "Car_vector.npy", "130c3c16eb2d85ee559d917c1849a5c462419ecc993e0d2de009de8c5a4e7c6f"),
        ("vangogh", "VanGogh_vector.npy", "2d08f1c3ca5df914d9f4da2907fb74ea2066f94dd00b58bd1c8a9fb81c0196d7"),
    )
}


class RingABellAttacker(VocabularyCacheInputs, Attacker):
    """Ring-A-Bell.

    Args:
        length: K, tokens per prompt (reference 16; 75 for K = 77).
        eta: the concept vector's coefficient (reference ``cof`` = 3).
        population: population size (reference 200).
        generations: generations (reference 3000).
        mutation_rate / crossover_rate: reference 0.25 / 0.5.
        pair_templates: templates with ``{}``; each gives the pair (template with the concept,
            template with ``neutral``). The attacked prompts that contain the concept's name
            give pairs too (the prompt, and the prompt without the name).
        neutral: the concept's stand-in in the "without" prompt of a template pair.
        requests_per_batch: requests searched (and cached) together.
        vocabulary: the tokens prompts are drawn from: ``all`` (the reference: every id in
            ``[1, 49406)``), ``domain`` (the tokens of the domain's prompts) or a list of words.
        seed: seeds the search.
        concept_vectors: concept -> a reference vector's name (:data:`REFERENCE_VECTORS`) or a
            local ``.npy`` path; other concepts' vectors come from prompt pairs.
        keep_original: the original prompt stays a candidate: when its text embedding is
            nearer the goal than the search's best prompt, it is handed on
            (``extra.kept_original``; the search's best in ``extra.search_best_prompt``).
    """

    name = "ring_a_bell"
    version = "2"  # 2: the original prompt stays a candidate (keep_original); image seeds (emma.seeds)
    needs_text_encoder = True
    resumable = True

    def __init__(self, length: int = 16, eta: float = 3.0, population: int = 200, generations: int = 3000,
                 mutation_rate: float = 0.25, crossover_rate: float = 0.5,
                 pair_templates: Optional[Sequence[str]] = None, neutral: str = "",
                 requests_per_batch: int = 32, vocabulary: str | Sequence[str] = "all", seed: int = 0,
                 concept_vectors: Optional[Mapping[str, str]] = None, keep_original: bool = True) -> None:
        self.keep_original = bool(keep_original)
        self.concept_vectors = {str(c): str(v) for c, v in dict(concept_vectors or {}).items()}
        for c, v in self.concept_vectors.items():
            if v not in REFERENCE_VECTORS and not v.endswith(".npy"):
                raise ConfigError(f"ring_a_bell concept_vectors.{c}={v!r}: give one of the reference's vectors "
                                  f"({', '.join(REFERENCE_VECTORS)}) or a path to a .npy file")
        self._vectors: dict[str, torch.Tensor] = {}
        self.length = check_positive("ring_a_bell length (K)", length)
        self.eta = float(eta)
        self.population = check_positive("ring_a_bell population", population)
        if self.population < 2:
            raise ConfigError("ring_a_bell population must be >= 2 (the better half survives)")
        self.generations = check_positive("ring_a_bell generations", generations)
        self.mutation_rate, self.crossover_rate = float(mutation_rate), float(crossover_rate)
        self.pair_templates = list(pair_templates or [])
        for t in self.pair_templates:
            if "{}" not in t:
                raise ConfigError(f"ring_a_bell pair template {t!r} has no '{{}}' for the concept")
        self.neutral = neutral
        self.requests_per_batch = check_positive("ring_a_bell requests_per_batch", requests_per_batch)
        self.vocabulary = check_vocabulary("ring_a_bell", vocabulary)
        self.seed = int(seed)

    def budget(self) -> dict[str, int]:
        return {"iterations": self.generations, "checks": 0}

    def config(self) -> dict[str, Any]:
        return {**super().config(), "length": self.length, "eta": self.eta, "population": self.population,
                "generations": self.generations, "mutation_rate": self.mutation_rate,
                "crossover_rate": self.crossover_rate, "pair_templates": self.pair_templates,
                "neutral": self.neutral, "vocabulary": self.vocabulary, "seed": self.seed,
                "concept_vectors": self.concept_vectors, "keep_original": self.keep_original,
                "budget": self.budget()}

    def cache_inputs(self, target: Any) -> dict[str, Any]:
        out = super().cache_inputs(target)
        local = {c: v for c, v in self.concept_vectors.items() if v not in REFERENCE_VECTORS}
        if local:  # a local vector file's bytes key the attack cache
            from emma.files import sha256_file

            out["concept_vector_files"] = {c: sha256_file(Path(v).expanduser()) for c, v in local.items()}
        return out

    def loaded_vector(self, wb: Any, concept: str) -> torch.Tensor:
        """The pinned or local vector of ``concept``, checked against the text encoder's shape."""
        if concept not in self._vectors:
            source = self.concept_vectors[concept]
            if source in REFERENCE_VECTORS:
                from emma.datasets.download import fetch

                path = fetch(REFERENCE_VECTORS[source])
            else:
                path = Path(source).expanduser()
                if not path.is_file():
                    raise ConfigError(f"ring_a_bell concept_vectors.{concept}: no file at {path}")
            vec = torch.from_numpy(np.load(path)).float()
            vec = vec.reshape(vec.shape[-2:]) if vec.dim() == 3 and vec.shape[0] == 1 else vec
            with torch.no_grad():
                shape = tuple(wb.encode_ids(wb.token_ids([""])).shape[1:])
            if tuple(vec.shape) != shape:
                raise ConfigError(f"ring_a_bell concept vector {source!r} for {concept!r} has shape "
                                  f"{tuple(vec.shape)}; this text encoder's output is {shape} (the reference's "
                                  "vectors are SD v1.x's): drop it from attacker.concept_vectors")
            self._vectors[concept] = vec
        return self._vectors[concept]

    def check(self, target: AttackTarget, requests: Sequence[PromptRequest]) -> None:
        super().check(target, requests)
        wb = target.white_box()
        if self.length + 2 > wb.context_length:
            raise ConfigError(f"ring_a_bell length K={self.length} + start/end tokens > the tokenizer's "
                              f"context of {wb.context_length}; use length <= {wb.context_length - 2}")
        candidate_token_ids(wb, self.vocabulary, target, "ring_a_bell")
        for c in sorted({r.concept for r in requests}):
            if c in self.concept_vectors:
                self.loaded_vector(wb, c)  # fetched and checked before any image is drawn
                continue
            if not self.pairs(c, requests):
                raise ConfigError(f"ring_a_bell: no prompt pairs for concept {c!r}: give pair_templates "
                                  "or attack prompts that contain the concept's name")

    def pairs(self, concept: str, requests: Sequence[PromptRequest]) -> list[tuple[str, str]]:
        out = [(t.format(concept), " ".join(t.format(self.neutral).split())) for t in self.pair_templates]
        word = re.compile(rf"\b{re.escape(concept)}\b", re.I)
        for r in requests:
            if r.concept == concept and word.search(r.prompt):
                out.append((r.prompt, " ".join(word.sub("", r.prompt).split())))
        return list(dict.fromkeys(out))

    def concept_vector(self, wb: Any, concept: str, requests: Sequence[PromptRequest]) -> torch.Tensor:
        if concept in self.concept_vectors:
            return self.loaded_vector(wb, concept)
        pairs = self.pairs(concept, requests)
        with torch.no_grad():
            with_c = wb.encode_ids(wb.token_ids([p for p, _ in pairs])).float()
            without = wb.encode_ids(wb.token_ids([q for _, q in pairs])).float()
        return (with_c - without).mean(0)

    def attack(self, target: AttackTarget, requests: Sequence[PromptRequest]) -> list[AttackOutput]:
        t_batch = time.perf_counter()
        wb = target.white_box()
        states = [RequestState(prompt=r.prompt) for r in requests]
        vectors = {c: self.concept_vector(wb, c, requests) for c in {r.concept for r in requests}}
        with torch.no_grad():
            originals = wb.encode_ids(wb.token_ids([r.prompt for r in requests])).float()
        goals = originals + self.eta * torch.stack([vectors[r.concept] for r in requests])
        original_distance = ((goals - originals) ** 2).flatten(1).sum(1).tolist()
        rng = np.random.default_rng(self.seed)
        K, L = self.length, wb.context_length
        low, high = 1, min(wb.bos_token_id, wb.eos_token_id)  # the reference draws ids in [1, 49406)
        cand = candidate_token_ids(wb, self.vocabulary, target, "ring_a_bell")
        pool = None if cand is None else cand.numpy()

        def draw(size: int | None = None) -> Any:
            return rng.integers(low, high, size=size) if pool is None else pool[rng.integers(0, len(pool), size=size)]

        def individual() -> np.ndarray:
            ids = np.full(L, wb.eos_token_id, dtype=np.int64)
            ids[0] = wb.bos_token_id
            ids[1 : K + 1] = draw(K)
            return ids

        pops = [[individual() for _ in range(self.population)] for _ in requests]
        memo: list[dict[bytes, float]] = [{} for _ in requests]
        bar = tqdm(total=self.generations, desc=f"  {self.name}", leave=False, unit="gen")
        best = [0.0] * len(requests)
        for gen in range(self.generations):
            self._score(wb, pops, memo, goals)
            for r, pop in enumerate(pops):
                fit = np.array([memo[r][p.tobytes()] for p in pop])
                order = np.argsort(fit, kind="stable")
                pops[r] = [pop[i] for i in order][: self.population // 2]
                best[r] = float(fit[order[0]])
                memo[r] = {p.tobytes(): memo[r][p.tobytes()] for p in pops[r]}  # survivors keep theirs
                states[r].iterations += 1
                if gen != self.generations - 1:
                    pops[r] = self._mutate(self._crossover(pops[r], rng, K), rng, K, draw)
            bar.update(1)
            bar.set_postfix(best=f"{np.mean(best):.3f}")
        bar.close()
        extras = []
        for r, st in enumerate(states):
            found = wb.decode_ids(pops[r][0][1 : K + 1].tolist())
            kept = self.keep_original and original_distance[r] < best[r]
            st.prompt = requests[r].prompt if kept else found
            st.best_score = -min(best[r], original_distance[r]) if kept else -best[r]
            extras.append({"distance": best[r], "original_distance": original_distance[r],
                           "kept_original": bool(kept), "search_best_prompt": found})
        share_time(states, t_batch)
        return judged_outputs(target, requests, [s.prompt for s in states],
                              [s.stats(**e) for s, e in zip(states, extras)])

    def _score(self, wb: Any, pops: list[list[np.ndarray]], memo: list[dict[bytes, float]],
               goals: torch.Tensor, chunk: int = 2048) -> None:
        todo = [(r, p) for r, pop in enumerate(pops) for p in pop if p.tobytes() not in memo[r]]
        uniq = list({(r, p.tobytes()): (r, p) for r, p in todo}.values())
        for s in range(0, len(uniq), chunk):
            part = uniq[s : s + chunk]
            ids = torch.from_numpy(np.stack([p for _, p in part]))
            with torch.no_grad():
                emb = wb.encode_ids(ids).float()
            rows = torch.tensor([r for r, _ in part])
            dist = ((goals[rows] - emb) ** 2).flatten(1).sum(1)
            for (r, p), d in zip(part, dist.tolist()):
                memo[r][p.tobytes()] = d

    def _crossover(self, parents: list[np.ndarray], rng: np.random.Generator, K: int) -> list[np.ndarray]:
        out = []
        for i in range(len(parents)):
            out.append(parents[i].copy())
            if rng.random() < self.crossover_rate:
                j = int(rng.integers(0, len(parents)))
                cut = int(rng.integers(1, K + 1))
                out.append(np.concatenate([parents[i][:cut], parents[j][cut:]]))
                out.append(np.concatenate([parents[j][:cut], parents[i][cut:]]))
        return out

    def _mutate(self, pop: list[np.ndarray], rng: np.random.Generator, K: int,
                draw: Callable[[], Any]) -> list[np.ndarray]:
        for p in pop:
            if rng.random() < self.mutation_rate:
                p[int(rng.integers(1, K + 1))] = int(draw())
        return pop
