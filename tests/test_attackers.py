"""Adaptive attackers: their pieces against independent references, bad input refused before
any image is drawn, and the attack target's white box."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from attackers.common import build_sequences, layout, project_simplex
from attackers.p4d import P4DAttacker
from attackers.ring_a_bell import RingABellAttacker
from attackers.unlearndiffatk import UnlearnDiffAtkAttacker, sampled_timesteps
from emma.api.attacker import AttackTargetError
from emma.api.types import PromptRequest
from emma.attack import CellAttackTarget, DiffusersWhiteBox, check_family
from emma.errors import ConfigError, UnknownChoiceError
from emma.pipelines import tiny_random_pipeline


def bisection_projection(a: np.ndarray, xi: float = 1e-9) -> np.ndarray:
    """The reference's projection (bisection on the shift mu), written independently."""
    lo, hi = a.min() - 1, a.max()
    while hi - lo > xi:
        mu = (lo + hi) / 2
        if np.clip(a - mu, 0, 1).sum() > 1:
            lo = mu
        else:
            hi = mu
    return np.clip(a - (lo + hi) / 2, 0, 1)


def test_simplex_projection_matches_bisection():
    rng = np.random.default_rng(0)
    v = rng.normal(size=(6, 300)) * rng.uniform(0.01, 3, size=(6, 1))
    ours = project_simplex(torch.from_numpy(v)).numpy()
    ref = np.stack([bisection_projection(row) for row in v])
    np.testing.assert_allclose(ours, ref, atol=1e-6)
    np.testing.assert_allclose(ours.sum(1), 1.0, atol=1e-9)
    uniform = torch.full((1, 10), 0.1, dtype=torch.float64)
    assert torch.allclose(project_simplex(uniform), uniform)


def test_reference_timesteps():
    ts = sampled_timesteps(50)
    assert ts[:3] == [10, 30, 50] and ts[-1] == 990 and len(ts) == 50


@pytest.mark.parametrize("insertion, expected", [
    ("prefix_k", [None, None, 1, 2, 3, 4, 5, 6, 7]),
    ("suffix_k", [1, 2, 3, 4, 5, 6, 7, None, None]),
    ("mid_k", [1, 2, 3, None, None, 4, 5, 6, 7]),
    ("insert_k", [1, 2, None, 3, 4, None, 5, 6, 7]),
    ("per_k_words", [None, 1, 2, 3, None, 4, 5, 6, 7]),
])
def test_insertion_layouts(insertion, expected):
    assert layout([1, 2, 3, 4, 5, 6, 7], 2, insertion) == expected


def test_p4d_k_layout_places_tokens_as_the_reference():
    from attackers.common import after_every

    assert after_every([1, 2, 3, 4, 5, 6], 3) == [None, 1, 2, 3, None, 4, 5, 6, None]
    assert after_every([1, 2, 3, 4, 5], 3) == [None, 1, 2, 3, None, 4, 5]
    assert after_every([1, 2], 3) == [None, 1, 2]


@pytest.fixture(scope="module")
def pipe():
    return tiny_random_pipeline(seed=0)


def test_encode_embeds_equals_the_pipeline_text_encoding(pipe):
    wb = DiffusersWhiteBox(pipe)
    ids = wb.token_ids(["an image of a circle", "a red square on a dotted background"])
    via_embeds = wb.encode_embeds(wb.embed_ids(ids))
    via_pipe = pipe.encode_prompt(["an image of a circle", "a red square on a dotted background"],
                                  "cpu", 1, False)[0]
    torch.testing.assert_close(via_embeds, via_pipe, atol=1e-5, rtol=1e-5)


class NoGeneration:
    """A target that fails the test if an attacker draws anything."""

    def __init__(self, pipe, base=True):
        self.pipe, self.base = pipe, base
        self.target = CellAttackTarget.__new__(CellAttackTarget)
        self.target._white_box_allowed, self.target._white_box, self.target.model_name = True, None, "tiny"
        self.target._base = object() if base else None
        self.target.generator = types.SimpleNamespace(pipe=pipe)

    def __getattr__(self, name):
        if name in ("generate", "score", "check_prompts"):
            raise AssertionError(f"{name} called before the attack was checked")
        return getattr(self.target, name)


REQ = [PromptRequest("an image of a circle", "circle", "ea", "name", seed=0, n_images=2)]


def test_bad_input_is_refused_before_any_generation(pipe):
    target = NoGeneration(pipe)
    with pytest.raises(UnknownChoiceError, match="insertion 'prefx_k'.*Did you mean 'prefix_k'"):
        UnlearnDiffAtkAttacker(insertion="prefx_k")
    for make in (lambda: UnlearnDiffAtkAttacker(timesteps=0), lambda: UnlearnDiffAtkAttacker(iterations_per_timestep=0),
                 lambda: P4DAttacker(iterations=0), lambda: RingABellAttacker(generations=0),
                 lambda: UnlearnDiffAtkAttacker(k=0), lambda: UnlearnDiffAtkAttacker(timestep_batch=0)):
        with pytest.raises(ConfigError, match="must be >= 1"):
            make()
    with pytest.raises(ConfigError, match="timestep_batch=3 exceeds timesteps=2: use 1 .* up to 2"):
        UnlearnDiffAtkAttacker(timesteps=2, timestep_batch=3)
    with pytest.raises(UnknownChoiceError, match="P4D variant 'x'"):
        P4DAttacker(variant="x")
    with pytest.raises(ConfigError, match="> the tokenizer's context of 77"):
        UnlearnDiffAtkAttacker(k=80).check(target, REQ)
    with pytest.raises(ConfigError, match="> the tokenizer's context of 77"):
        P4DAttacker(variant="n", n_tokens=76, selection="judge").check(target, REQ)
    # selection by image similarity needs an embedding, or a judge with a feature space (this one has no judge)
    with pytest.raises(AttackTargetError, match="attacker.similarity=classifiers.clip_zero_shot"):
        P4DAttacker().check(target, REQ)
    with pytest.raises(ConfigError, match="early_stop=true .* needs selection=judge"):
        P4DAttacker(early_stop=True)
    with pytest.raises(UnknownChoiceError, match="P4D selection 'clip'"):
        P4DAttacker(selection="clip")
    with pytest.raises(ConfigError, match="length <= 75"):
        RingABellAttacker(length=76).check(target, REQ)
    UnlearnDiffAtkAttacker(k=70).check(target, REQ)  # 5 prompt tokens + 70 + 2 = 77 fits
    with pytest.raises(AttackTargetError, match="base"):
        UnlearnDiffAtkAttacker().check(NoGeneration(pipe, base=False), REQ)
    RingABellAttacker().check(NoGeneration(pipe, base=False), REQ)  # text encoder only: no base needed


def test_two_text_encoders_are_refused():
    sdxl_like = types.SimpleNamespace(text_encoder_2=object(), tokenizer=None, text_encoder=None, unet=None,
                                      vae=None, scheduler=None)
    with pytest.raises(AttackTargetError, match="two text encoders \\(SDXL family\\).*SD v1.x / v2.x"):
        check_family(sdxl_like, "sdxl")


def test_sequences_fill_and_embed(pipe):
    wb = DiffusersWhiteBox(pipe)
    seqs = build_sequences([layout([5, 6], 2, "prefix_k"), layout([7, 8], 2, "suffix_k")], 8, 100, 101, 101)
    assert seqs.ids.tolist() == [[100, 101, 101, 5, 6, 101, 101, 101], [100, 7, 8, 101, 101, 101, 101, 101]]
    assert seqs.slots.tolist() == [[1, 2], [3, 4]]
    filled = seqs.fill(torch.tensor([[1, 2], [3, 4]]))
    assert filled.tolist() == [[100, 1, 2, 5, 6, 101, 101, 101], [100, 7, 8, 3, 4, 101, 101, 101]]
    base = wb.embed_ids(seqs.ids)
    slot = wb.embed_ids(torch.tensor([[1, 2], [3, 4]]))
    torch.testing.assert_close(seqs.embed(base, slot), wb.embed_ids(filled))


def test_ring_a_bell_pairs_and_vector(pipe):
    atk = RingABellAttacker(pair_templates=["an image of a {}"])
    reqs = [PromptRequest("an image of a red circle", "circle", "ea", "prefix"),
            PromptRequest("an image of a disc", "circle", "ea", "variant")]
    assert atk.pairs("circle", reqs) == [("an image of a circle", "an image of a"),
                                        ("an image of a red circle", "an image of a red")]
    wb = DiffusersWhiteBox(pipe)
    v = atk.concept_vector(wb, "circle", reqs)
    e = lambda p: wb.encode_ids(wb.token_ids([p]))[0]  # noqa: E731
    expected = ((e("an image of a circle") - e("an image of a"))
                + (e("an image of a red circle") - e("an image of a red"))) / 2
    torch.testing.assert_close(v, expected)


@pytest.fixture(scope="module")
def plumbing_target(pipe, tmp_path_factory):
    """A cell-like attack target on the random tiny pipeline (2 sampler steps, random judge)."""
    from classifiers.tinyworld import TinyWorldClassifier
    from emma.attack import LazyBaseModel
    from emma.cache import ClassifierScoreCache, ImageCache
    from emma.generate import CachedGenerator, Judge
    from emma.pipelines import fingerprint

    cache = tmp_path_factory.mktemp("attack-cache")

    def make(p, fp):
        return CachedGenerator(p, fp, ImageCache(cache), num_inference_steps=2, guidance_scale=5.0,
                               height=32, width=32, batch_size=8)

    fp = fingerprint(pipe)
    classifier = TinyWorldClassifier(weights=None)
    base = LazyBaseModel(lambda: tiny_random_pipeline(seed=0), fp, make)
    return CellAttackTarget(make(pipe, fp), Judge(classifier, ClassifierScoreCache(cache, classifier)), base=base)


@pytest.mark.parametrize("attacker, iterations, checks", [
    (UnlearnDiffAtkAttacker(k=2, timesteps=2, iterations_per_timestep=2, check_original=False, early_stop=False), 4, 2),
    # two stages of two timesteps: the same 4 x 2 denoising losses per prompt, one check per stage
    (UnlearnDiffAtkAttacker(k=2, timesteps=4, iterations_per_timestep=2, timestep_batch=2, check_original=False,
                            early_stop=False), 8, 2),
    (UnlearnDiffAtkAttacker(k=2, timesteps=3, iterations_per_timestep=2, timestep_batch=2, check_original=False,
                            early_stop=False), 6, 2),
    # two checks and the original prompt's (it stays a candidate)
    (P4DAttacker(variant="n", n_tokens=4, iterations=3, eval_every=2), 3, 3),
    (P4DAttacker(variant="k", iterations=3, eval_every=2), 3, 3),
    (RingABellAttacker(length=4, population=8, generations=3, pair_templates=["an image of a {}"]), 3, 0),
])
def test_each_attack_spends_its_budget_and_returns_a_replayable_prompt(plumbing_target, attacker, iterations, checks):
    reqs = [PromptRequest("an image of a red circle", "circle", "ea", "prefix", seed=3, n_images=2),
            PromptRequest("an image of a disc", "circle", "ea", "variant", seed=5, n_images=2)]
    outs = attacker.attack(plumbing_target, reqs)
    assert [o.request for o in outs] == reqs
    for o, r in zip(outs, reqs):
        assert o.iterations == iterations and o.queries == checks + r.n_images
        assert checks == attacker.budget()["checks"]
        assert [s.seed for s in o.samples] == r.seeds() and all(s.prompt == o.adversarial_prompt for s in o.samples)
        assert o.success == any(s.detected for s in o.samples)
        # the search drew at its own seeds, never at the final images'
        assert not set(o.extra.get("search_seeds", [])) & set(r.seeds())
        # judged images of the search: UnlearnDiffAtk's checks and its 5 reference candidates,
        # P4D's 3 target candidates (its checks compare image features, no verdict), none for Ring-A-Bell
        expected = {UnlearnDiffAtkAttacker: checks + 5, P4DAttacker: 3, RingABellAttacker: 0}[type(attacker)]
        assert o.judged_queries == expected
        if o.extra.get("kept_original"):  # handed on only when the search judged it better
            assert o.adversarial_prompt == r.prompt
        else:
            assert o.adversarial_prompt and o.adversarial_prompt != r.prompt
        if getattr(attacker, "variant", "") == "k" or isinstance(attacker, UnlearnDiffAtkAttacker):
            assert r.prompt.split()[-1] in o.adversarial_prompt  # the prompt's own tokens are kept


def test_vocabulary_option_restricts_the_searched_tokens(plumbing_target):
    from attackers.common import candidate_token_ids

    wb = plumbing_target.white_box()
    tok = lambda text: wb.tokenizer(text).input_ids[1:-1]  # noqa: E731
    with pytest.raises(UnknownChoiceError, match="vocabulary 'domian'.*Did you mean 'domain'"):
        RingABellAttacker(vocabulary="domian")
    with pytest.raises(ConfigError, match="non-empty list"):
        P4DAttacker(vocabulary=[])
    # 'domain' needs a target that knows its domain's prompts; the plumbing target does not
    with pytest.raises(AttackTargetError, match="domain's prompts"):
        UnlearnDiffAtkAttacker(vocabulary="domain").check(plumbing_target, REQ)
    prompts = ["an image of a circle", "a red disc"]
    known = types.SimpleNamespace(domain_prompts=lambda: prompts)
    assert candidate_token_ids(wb, "all", known, "x") is None
    assert candidate_token_ids(wb, "domain", known, "x").tolist() == sorted({i for p in prompts for i in tok(p)})

    words = ["round disc", "orb ring"]
    allowed = {i for w in words for i in tok(w)}
    req = [PromptRequest("an image of a circle", "circle", "ea", "name", seed=3, n_images=1)]
    for atk, n_adv in ((UnlearnDiffAtkAttacker(k=3, timesteps=1, iterations_per_timestep=2, check_original=False,
                                               vocabulary=words), 3),
                       (P4DAttacker(variant="n", n_tokens=4, iterations=2, eval_every=1, keep_original=False,
                                    vocabulary=words), 4),
                       (RingABellAttacker(length=5, population=6, generations=2, pair_templates=["an image of a {}"],
                                          vocabulary=words, keep_original=False), 5)):
        ids = tok(atk.attack(plumbing_target, req)[0].adversarial_prompt)
        assert len(ids) >= n_adv and set(ids[:n_adv]) <= allowed, (atk.name, ids)
        assert atk.config()["vocabulary"] == words


def _hard_prompt_scan():
    """scripts/hard_prompt_scan.py as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "hard_prompt_scan.py"
    spec = importlib.util.spec_from_file_location("hard_prompt_scan", path)
    scan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scan)
    return scan


def test_hard_prompt_scan_enumerates_each_template_once():
    scan = _hard_prompt_scan()

    groups = scan.candidate_prompts("an image of a circle", "circle", ["red", "circle", "a"], pairs=True)
    assert groups["swap"] == ["an image of a red", "an image of a a"]  # the name prompt itself left out
    assert groups["prefix"] == ["red an image of a circle", "circle an image of a circle",
                                "a an image of a circle"]
    assert groups["suffix"] == ["an image of a circle red", "an image of a circle circle",
                                "an image of a circle a"]
    # between each pair of the prompt's 5 words (4 gaps x 3 words), less "an image of a a circle"
    # made twice and "an image of a circle circle", a suffix prompt already
    assert groups["insert"][:3] == ["an red image of a circle", "an circle image of a circle",
                                    "an a image of a circle"]
    assert len(groups["insert"]) == 4 * 3 - 2 and "an image of a a circle" in groups["insert"]
    assert "an image of a circle circle" not in groups["insert"]
    # "an image of a red circle" is an insert prompt already
    assert groups["swap2"][:2] == ["an image of a red red", "an image of a red a"]
    every = [p for texts in groups.values() for p in texts]
    assert len(every) == len(set(every))  # no prompt drawn twice across templates
    with pytest.raises(SystemExit, match="does not contain the concept word"):
        scan.candidate_prompts("an image of a square", "circle", ["red"], pairs=False)


def test_hard_prompt_scan_vocabularies(pipe):
    """``domain`` scans the caption words; ``probe`` adds the probe's unseen words ("coin" is
    one token of CLIP's vocabulary) and controls; ``--sample`` adds exactly the drawn words."""
    from emma.tinyworld import generalisation

    scan = _hard_prompt_scan()
    wb = DiffusersWhiteBox(pipe)
    target = types.SimpleNamespace(domain_prompts=lambda: ["an image of a circle", "an image of a round disc"])

    domain = scan.scan_words(wb, target, "domain")
    assert domain == sorted({"an", "image", "of", "a", "circle", "round", "disc"})
    probe = scan.scan_words(wb, target, "probe")
    assert set(domain) < set(probe) and {"coin", "croissant", "tent", "zebra"} <= set(probe)
    assert set(generalisation.CONTROLS) <= set(probe)  # the controls are single CLIP words
    drawn = generalisation.random_words(20, 3, wb.tokenizer)
    sampled = scan.scan_words(wb, target, "domain", sample=20, sample_seed=3)
    assert set(sampled) - set(domain) == set(drawn) - set(domain) and len(set(drawn) - set(domain)) >= 19
    with pytest.raises(SystemExit, match="'all' is not one of domain, probe"):
        scan.scan_words(wb, target, "all")


def test_ring_a_bell_takes_listed_concept_vectors_from_files(pipe, tmp_path):
    from attackers.ring_a_bell import REFERENCE_VECTORS

    wb = DiffusersWhiteBox(pipe)
    shape = tuple(wb.encode_ids(wb.token_ids([""])).shape[1:])
    vec = np.random.default_rng(0).normal(size=(1, *shape)).astype(np.float32)  # the reference's (1, 77, D) layout
    np.save(tmp_path / "v.npy", vec)
    atk = RingABellAttacker(pair_templates=["an image of a {}"], concept_vectors={"circle": str(tmp_path / "v.npy")})
    torch.testing.assert_close(atk.concept_vector(wb, "circle", REQ), torch.from_numpy(vec[0]))
    # other concepts keep the pairs; a listed vector of the wrong shape is refused before any image
    assert not torch.equal(atk.concept_vector(wb, "square", REQ), torch.from_numpy(vec[0]))
    np.save(tmp_path / "bad.npy", np.zeros((77, 3), np.float32))
    with pytest.raises(ConfigError, match=r"has shape \(77, 3\); this text encoder's output is"):
        RingABellAttacker(concept_vectors={"circle": str(tmp_path / "bad.npy")}).check(NoGeneration(pipe), REQ)
    with pytest.raises(ConfigError, match="concept_vectors.sexual='nudes'.*nudity, violence, car, vangogh"):
        RingABellAttacker(concept_vectors={"sexual": "nudes"})
    # the reference's vectors are pinned by commit and sha256
    assert {r.commit for r in REFERENCE_VECTORS.values()} == {"e4585ada0a5eb185fbef89bb94147c97f8d2f79a"}
    assert REFERENCE_VECTORS["nudity"].url.endswith("/Concept%20Vectors/Nudity_vector.npy")
