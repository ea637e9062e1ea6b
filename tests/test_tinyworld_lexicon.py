"""Tiny world 2's lexicon and its generalisation probe list."""

from __future__ import annotations

import numpy as np
import torch

from emma.tinyworld import world
from emma.tinyworld.generalisation import CONTROLS, PROBE, caption_words, kind, seen_words
from emma.tinyworld.lexicon import normalise, semantic_embedding, token_texts
from emma.tinyworld.tokenizer import local_clip_tokenizer


def test_probe_lists_hold_only_words_no_caption_contains():
    assert len(PROBE) >= 60 and len(CONTROLS) >= 20
    assert set(PROBE.values()) <= set(world.SHAPES) | set(world.STYLES)
    assert set(PROBE.values()) == set(world.SHAPES) | set(world.STYLES), "every concept is probed"
    assert not set(PROBE) & set(CONTROLS)
    unseen = {w: seen_words(w) for w in list(PROBE) + list(CONTROLS)}
    assert not {w: s for w, s in unseen.items() if s}
    # the check is real: caption words are seen
    assert seen_words("a red disc") == ["red", "disc"] and "moon" in caption_words()
    assert kind("circle") == "shape" and kind("striped") == "style"


def test_token_texts_undo_the_bpe_word_marker():
    tok = local_clip_tokenizer()
    texts = token_texts(tok)
    assert len(texts) == len(tok) == 49408
    coin = tok.convert_tokens_to_ids("coin</w>")
    assert texts[coin] == "coin" and texts[tok.bos_token_id] == "" and texts[tok.eos_token_id] == ""


def test_semantic_embedding_is_a_map_of_meanings_with_free_special_tokens():
    rng = np.random.default_rng(0)
    feats = normalise(rng.standard_normal((50, 12)))
    assert np.allclose(np.linalg.norm(feats, axis=1), 1) and np.allclose(feats.mean(0), 0, atol=0.2)
    emb = semantic_embedding(feats, hidden=8, special_ids=(48, 49))
    assert not emb.proj.weight.any(), "the map starts at zero"
    torch.manual_seed(0)
    torch.nn.init.normal_(emb.proj.weight)
    torch.nn.init.normal_(emb.proj.bias)
    ids = torch.tensor([[0, 3, 48, 49, 7]])
    out = emb(ids)
    table = emb.weight()
    assert out.shape == (1, 5, 8) and torch.allclose(out[0], table[ids[0]])
    expected = torch.from_numpy(feats[[0, 3, 7]]).float() @ emb.proj.weight.T + emb.proj.bias
    assert torch.allclose(out[0, [0, 1, 4]], expected, atol=1e-6)
    assert torch.equal(out[0, 2], emb.special[0].detach()) and torch.equal(out[0, 3], emb.special[1].detach())
    # only the map and the special vectors learn; the meanings are not parameters
    assert {n for n, _ in emb.named_parameters()} == {"proj.weight", "proj.bias", "special"}
    assert "features" not in emb.state_dict()


def test_filler_tokens_never_include_a_caption_probe_control_or_base_rate_word():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from train_tinyworld import insert_fillers

    from emma.tinyworld.generalisation import BASE_RATE_WORDS, filler_pool, random_words

    tok = local_clip_tokenizer()
    pool = filler_pool(tok)
    held = [*caption_words(), *CONTROLS, *random_words(*BASE_RATE_WORDS), "coin", "racing", "flag", "pizza"]
    held_ids = {i for w in held for i in tok(w).input_ids}
    assert not held_ids & set(pool) and not set(tok.all_special_ids) & set(pool)
    assert len(pool) > 45_000  # the rest of the vocabulary
    ids = tok(["a red circle", "", "a star"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    assert torch.equal(insert_fillers(ids, torch.tensor(pool), 0.0, np.random.default_rng(0)), ids)
    out = insert_fillers(ids, torch.tensor(pool), 1.0, np.random.default_rng(0))
    assert out.shape == ids.shape
    for row, new in zip(ids, out):  # one pool token right after the start token, the rest shifted
        assert new[0] == row[0] and int(new[1]) in set(pool) and torch.equal(new[2:], row[1:-1])
