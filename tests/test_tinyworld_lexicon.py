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


def _stem_clash(word: str, other: str) -> bool:
    """Same word, one inside the other, or a shared five-letter start ("stripe" / "stripes")."""
    return (word == other or (len(other) >= 4 and other in word) or (len(word) >= 4 and word in other)
            or (min(len(word), len(other)) >= 5 and word[:5] == other[:5]))


def test_object_words_are_new_words_sharing_no_stem_with_the_probe():
    import re

    from emma.tinyworld.generalisation import FUNCTION_WORDS

    tables = (world.SHAPE_OBJECTS, world.STYLE_OBJECTS)
    assert set(world.SHAPE_OBJECTS) == set(world.SHAPES) and set(world.STYLE_OBJECTS) == set(world.STYLES)
    words = [w for t in tables for things in t.values() for w in things]
    assert min(len(v) for t in tables for v in t.values()) >= 12
    assert len(words) == len(set(words)), "an object word belongs to one concept"
    assert all(re.fullmatch(r"[a-z]+", w) for w in words)
    held = {w for e in list(PROBE) + list(CONTROLS) for w in re.findall(r"[a-z]+", e)} - FUNCTION_WORDS
    clashes = [(w, p) for w in words for p in held if _stem_clash(w, p)]
    assert not clashes
    assert _stem_clash("stripe", "stripes") and _stem_clash("basketball", "ball")  # the rule bites
    # each names one concept: no object word is a word the world uses for another concept
    per_concept: dict[str, set[str]] = {c: {c} for c in (*world.SHAPES, *world.STYLES)}
    for t in (world.SHAPE_VARIANTS, world.SHAPE_SHORT, world.SHAPE_LONG, world.STYLE_PHRASES,
              world.STYLE_VARIANTS, world.STYLE_SHORT):
        for c, v in t.items():
            per_concept[c] |= {w for s in v for w in re.findall(r"[a-z]+", s)}
    neutral = set(world.COLOURS) | {w for v in world.PREFIXES.values() for w in v}
    for t in tables:
        for c, things in t.items():
            elsewhere = set().union(*(ws for k, ws in per_concept.items() if k != c)) | neutral
            assert not set(things) & elsewhere, (c, set(things) & elsewhere)
    assert set(words) <= caption_words()


def test_object_captions_name_things_only_when_asked():
    rng = np.random.default_rng(0)
    spec = world.SceneSpec("circle", "red", "striped", 16, 16, 10, 0)
    things = set(world.SHAPE_OBJECTS["circle"])
    patterns = set(world.STYLE_OBJECTS["striped"])
    others = {w for c, v in world.SHAPE_OBJECTS.items() if c != "circle" for w in v}
    caps = [world.caption(spec, rng, objects=0.3) for _ in range(2000)]
    words = [set(c.replace(",", "").split()) for c in caps]
    named_by_thing = sum(bool(w & things) for w in words) / len(caps)
    pattern = sum(bool(w & patterns) for w in words) / len(caps)
    template_words = {"a", "an", "image", "of", "picture"}
    alone = sum(bool(w & patterns) and len(w - template_words) == 1 for w in words) / len(caps)
    # 0.3 of the 0.925 not alone; 0.075 alone plus 0.3 of the 0.6 style phrases of the rest
    assert 0.24 < named_by_thing < 0.32 and 0.2 < pattern < 0.3 and 0.05 < alone < 0.1
    assert not any(w & others for w in words), "only the spec's own things"
    rng0, rng1 = np.random.default_rng(5), np.random.default_rng(5)
    assert [world.caption(spec, rng0) for _ in range(50)] == [world.caption(spec, rng1, objects=0.0) for _ in range(50)]
    assert not any(set(world.caption(spec, rng0).split()) & (things | patterns) for _ in range(400))


def test_meaning_noise_acts_in_training_only_and_is_seeded():
    feats = normalise(np.random.default_rng(1).standard_normal((30, 16)))
    emb = semantic_embedding(feats, hidden=4, special_ids=(28, 29))
    torch.nn.init.normal_(emb.proj.weight, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[28, 3, 5, 29]])
    clean = emb(ids)
    emb.noise, emb.generator = 0.1, torch.Generator().manual_seed(7)
    noisy = emb(ids)
    emb.generator = torch.Generator().manual_seed(7)
    assert torch.equal(emb(ids), noisy), "seeded"
    shift = (noisy - clean)[0, 1:3].detach()
    assert 0.05 < float(shift.abs().mean()) < 1.0  # noise of scale 0.1 through a 16 -> 4 map
    assert torch.equal(noisy[0, 0], clean[0, 0]) and torch.equal(noisy[0, 3], clean[0, 3]), "special tokens exact"
    emb.eval()
    assert torch.equal(emb(ids), clean) and torch.allclose(emb.weight()[ids[0]], clean[0])


def test_word_fillers_are_whole_words_of_the_filler_pool():
    from emma.tinyworld.generalisation import filler_pool

    tok = local_clip_tokenizer()
    every, words = filler_pool(tok), filler_pool(tok, words_only=True)
    assert set(words) < set(every) and 20_000 < len(words) < 35_000
    texts = tok.convert_ids_to_tokens(words)
    assert all(t.endswith("</w>") and t[:-4].isalpha() and len(t) >= 8 for t in texts)
    assert tok.convert_tokens_to_ids("government</w>") in set(words)
    assert tok.convert_tokens_to_ids("philosophy</w>") not in set(words)  # a control word


def test_concept_affinity_reads_meanings_of_unseen_tokens():
    from emma.tinyworld.lexicon import concept_affinity, labelled_words

    tok = local_clip_tokenizer()
    rng = np.random.default_rng(0)
    dim = 48
    feats = rng.standard_normal((len(tok), dim)).astype(np.float32) * 0.3
    direction = {c: rng.standard_normal(dim).astype(np.float32) for c in (*world.SHAPES, *world.STYLES)}
    for c, words in labelled_words().items():
        assert c in words and len(words) >= 12
        for w in words:
            ids = tok(w).input_ids[1:-1]
            feats[ids] = direction[c] + 0.3 * rng.standard_normal((len(ids), dim))
    negatives = list(range(30000, 30300))
    aff = concept_affinity(feats, tok, negatives)
    assert aff.shape == (len(tok), 14) and np.allclose(aff[:, :9].sum(1), 1) and np.allclose(aff[:, 9:].sum(1), 1)
    unseen = tok("coin").input_ids[1]  # a probe word, never fitted: its meaning decides
    feats2 = feats.copy()
    feats2[unseen] = direction["circle"]
    aff2 = concept_affinity(feats2, tok, negatives)
    assert aff2[unseen, 0] > 0.8, "a token meaning 'circle' has the circle's affinity"
    feats2[unseen] = direction["dotted"]
    assert concept_affinity(feats2, tok, negatives)[unseen, 9 + world.STYLES.index("dotted")] > 0.8
    # a word like the negatives gets "none"
    assert aff[30500 % len(tok), 8] > 0.5 and aff[30500 % len(tok), 13] > 0.5
    assert np.array_equal(aff, concept_affinity(feats, tok, negatives)), "deterministic"


def test_training_widens_a_map_fitted_before_the_affinity_columns():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from train_tinyworld import PROJ_KEY, widen_lexicon_map

    class TE(torch.nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.embeddings = torch.nn.Module()
            self.embeddings.token_embedding = semantic_embedding(np.zeros((10, d), np.float32), 4, (8, 9))

    old, new = TE(6), TE(8)
    torch.nn.init.normal_(old.embeddings.token_embedding.proj.weight)
    state = old.state_dict()
    assert widen_lexicon_map(state, new) and state[PROJ_KEY].shape == (4, 8)
    assert torch.equal(state[PROJ_KEY][:, :6], old.state_dict()[PROJ_KEY]) and not state[PROJ_KEY][:, 6:].any()
    new.load_state_dict(state)
    assert not widen_lexicon_map(state, new)
    import pytest

    with pytest.raises(SystemExit, match="does not fit"):
        widen_lexicon_map(TE(9).state_dict(), new)


def test_an_exported_token_table_gives_back_the_lexicon_map(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from train_tinyworld import TABLE_KEY, plain_text_encoder, recover_lexicon_map, text_encoder

    feats = normalise(np.random.default_rng(3).standard_normal((49408, 24))).astype(np.float32)
    np.save(tmp_path / "lexicon.npy", feats.astype(np.float16))
    torch.manual_seed(0)
    trained = text_encoder(tmp_path)
    emb = trained.get_input_embeddings()
    torch.nn.init.normal_(emb.proj.weight)
    torch.nn.init.normal_(emb.proj.bias)
    plain = plain_text_encoder(tmp_path, trained.state_dict())  # what an export holds
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    fresh = text_encoder(tmp_path)
    residual = recover_lexicon_map(state, fresh)
    assert TABLE_KEY not in state and residual < 1e-4
    fresh.load_state_dict(state, strict=False)
    got = fresh.get_input_embeddings()
    assert torch.allclose(got.proj.weight, emb.proj.weight, atol=1e-4)
    assert torch.allclose(got.weight(), emb.weight(), atol=1e-4)
    ids = torch.tensor([[49406, 320, 2728, 49407]])
    with torch.no_grad():
        assert torch.allclose(fresh(ids)[0], plain(ids)[0], atol=1e-4)
    # a table the lexicon cannot produce leaves a residual the caller can see
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    state[TABLE_KEY][:100] += 1.0
    assert recover_lexicon_map(state, text_encoder(tmp_path)) > 0.5
