"""Pieces the optimising attackers share: candidate vocabularies, budgets and per-request
bookkeeping; the token-level pieces (insertion layouts, simplex projection) live in
:mod:`emma.token_search`, which methods that train against attacks use too."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import torch

from emma.cache import stable_hash
from emma.errors import ConfigError, UnknownChoiceError
from emma.token_search import (  # noqa: F401 (re-exported: the attackers' shared pieces)
    INSERTIONS,
    Sequences,
    StraightThroughSample,
    after_every,
    build_sequences,
    check_insertion,
    layout,
    project_simplex,
)

# Candidate tokens of a token search: the tokenizer's whole vocabulary (the references), or the
# tokens of the domain's prompts (every concept and prompt type of the cell's domain), or the
# tokens of a given list of words / texts.
VOCABULARIES: tuple[str, ...] = ("all", "domain")


def check_vocabulary(what: str, vocabulary: Any) -> str | list[str]:
    if isinstance(vocabulary, str):
        if vocabulary not in VOCABULARIES:
            raise UnknownChoiceError(f"{what} vocabulary", vocabulary, (*VOCABULARIES, "[word, ...]"))
        return vocabulary
    words = [str(w) for w in (vocabulary or [])]
    if not words:
        raise ConfigError(f"{what} vocabulary: give 'all', 'domain' or a non-empty list of words")
    return words


class VocabularyCacheInputs:
    """``cache_inputs`` of an attacker with a ``vocabulary`` setting: with ``"domain"`` the
    candidate tokens come from the domain's prompts, so they key the attack cache."""

    vocabulary: str | list[str]

    def cache_inputs(self, target: Any) -> dict[str, Any]:
        if self.vocabulary == "domain":
            return {"domain_prompts": stable_hash(list(target.domain_prompts()))}
        return {}


def candidate_token_ids(wb: Any, vocabulary: str | Sequence[str], target: Any, what: str) -> torch.Tensor | None:
    """Sorted ids a token search may use (start/end/padding excluded), or ``None`` for the
    whole vocabulary. ``domain``: the tokens of ``target.domain_prompts()``."""
    if vocabulary == "all":
        return None
    texts = list(target.domain_prompts()) if vocabulary == "domain" else list(vocabulary)
    special = {wb.bos_token_id, wb.eos_token_id, wb.pad_token_id}
    ids = sorted({int(i) for t in texts for i in wb.tokenizer(t, truncation=False).input_ids} - special)
    if len(ids) < 2:
        raise ConfigError(f"{what} vocabulary {vocabulary if isinstance(vocabulary, str) else 'list'}: "
                          f"{len(ids)} token(s); a search needs at least 2")
    return torch.tensor(ids, dtype=torch.long)


def check_positive(what: str, value: Any) -> int:
    if int(value) < 1:
        raise ConfigError(f"{what} must be >= 1 (got {value}): an attack with no budget cannot run")
    return int(value)


@dataclasses.dataclass
class RequestState:
    """Per-request progress of a batched attack."""

    prompt: str = ""
    done: bool = False
    success_check: bool = False
    iterations: int = 0
    queries: int = 0
    best_score: float = -1.0
    time_s: float = 0.0
    judged: int = 0  # images the search had judged (checks, reference / target images)

    def stats(self, **extra: Any) -> dict[str, Any]:
        return {"queries": self.queries, "iterations": self.iterations, "time_s": self.time_s,
                "judged_queries": self.judged, "check_success": self.success_check,
                "best_check_score": self.best_score, **extra}


def share_time(states: Sequence[RequestState], t0: float) -> None:
    """A batch's wall time, shared equally by its requests (so per-request times add up)."""
    each = (time.perf_counter() - t0) / max(1, len(states))
    for s in states:
        s.time_s = each
