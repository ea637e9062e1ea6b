"""Erasure methods on the tiny random pipeline: which weights change, the UCE closed form
against an independent least-squares solve, determinism, save/load round trips, bad input.
"""

from __future__ import annotations

import contextlib
import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from conftest import changed

from emma.domains import load_domain
from emma.errors import ConfigError, UnknownChoiceError, WeightsUnavailableError
from emma.methods._common import concept_positions
from emma.methods.ca import ConceptAblationMethod, start_token_detached
from emma.methods.checkpoint import CheckpointMethod
from emma.methods.esd import ESDMethod
from emma.methods.fmn import ForgetMeNotMethod
from emma.methods.mace import MACEMethod, mapping_list, matching_token_indices
from emma.methods.uce import UCEMethod, uce_closed_form
from emma.pipelines import fingerprint

DOMAIN = load_domain("tinyworld")


def small(name: str, **kw):
    """Each method at a few steps (seconds on a CPU)."""
    common = dict(progress=False)
    table = {
        "esd-x": lambda: ESDMethod(iterations=3, ddim_steps=4, **common, **kw),
        "esd-u": lambda: ESDMethod(train_method="esd-u", iterations=2, ddim_steps=4, **common, **kw),
        "uce": lambda: UCEMethod(guide_concepts="shape", **kw),
        "mace": lambda: MACEMethod(mapping_concepts="shape", num_images=2, aug_length=3, max_train_steps=3,
                                   sample_steps=2, learning_rate=1e-2, segmenter="attention", **common, **kw),
        "ca": lambda: ConceptAblationMethod(anchor_concepts="shape", num_class_images=2, max_train_steps=2,
                                            train_batch_size=2, sample_steps=2, **common, **kw),
        "ca-model": lambda: ConceptAblationMethod(loss="model", anchor_concepts="shape", num_class_images=2,
                                                  max_train_steps=2, train_batch_size=2, sample_steps=2,
                                                  learning_rate=1e-3, **common, **kw),
        "fmn": lambda: ForgetMeNotMethod(num_images=2, max_train_steps=3, sample_steps=2, learning_rate=1e-3,
                                         **common, **kw),
    }
    return table[name]()


def attn2_names(pipe, kinds=("to_q", "to_k", "to_v", "to_out")) -> set[str]:
    return {k for k in pipe.unet.state_dict() if ".attn2." in k and any(f".attn2.{x}" in k for x in kinds)}


def kv_weights(pipe) -> set[str]:
    return {k for k in pipe.unet.state_dict() if k.endswith((".attn2.to_k.weight", ".attn2.to_v.weight"))}


def images(pipe, prompt: str = "a circle", seeds=(0, 1)) -> torch.Tensor:
    gens = [torch.Generator("cpu").manual_seed(s) for s in seeds]
    return pipe([prompt] * len(seeds), generator=gens, num_inference_steps=3, guidance_scale=5.0,
                output_type="pt").images


# --------------------------------------------------------------------------- changed parameters
def test_esd_x_changes_only_cross_attention(base, pipe):
    small("esd-x").erase(pipe, ["circle"], seed=0, domain=DOMAIN)
    ch = changed(base, pipe)
    assert ch and ch <= attn2_names(base)
    # every projection kind of cross-attention is trained
    assert {k.split(".attn2.")[1].split(".")[0] for k in ch} == {"to_q", "to_k", "to_v", "to_out"}
    assert not changed(base, pipe, "text_encoder") and not changed(base, pipe, "vae")
    # the frozen weights got no gradient (the pipeline loads with every parameter requiring one)
    assert all(p.requires_grad for p in base.unet.parameters())
    assert ch <= {n for n, p in pipe.unet.named_parameters() if p.grad is not None} <= attn2_names(base)


def test_train_only_thaws_exactly_the_selected_parameters(base, pipe):
    from emma.methods._common import train_only

    params = train_only(pipe.unet, lambda n: ".attn2.to_k." in n)
    assert set(params) == {n for n in kv_weights(base) if ".to_k." in n}
    assert {n for n, p in pipe.unet.named_parameters() if p.requires_grad} == set(params)
    with pytest.raises(ConfigError, match="matched no UNet parameter"):
        train_only(pipe.unet, lambda n: False)


def test_esd_u_changes_no_cross_attention(base, pipe):
    small("esd-u").erase(pipe, ["circle"], seed=0, domain=DOMAIN)
    ch = changed(base, pipe)
    assert len(ch) > 50
    assert not any(".attn2." in k for k in ch)
    assert not any(k.startswith(("time_embedding.", "conv_out.", "conv_norm_out.")) for k in ch)
    assert any(".attn1." in k for k in ch) and any(".resnets." in k for k in ch)


def test_uce_changes_exactly_cross_attention_keys_and_values(base, pipe):
    small("uce").erase(pipe, ["circle"], domain=DOMAIN)
    assert changed(base, pipe) == kv_weights(base)
    only_v = copy.deepcopy(base)
    UCEMethod(guide_concepts="shape", with_to_k=False).erase(only_v, ["circle"], domain=DOMAIN)
    assert changed(base, only_v) == {k for k in kv_weights(base) if ".to_v." in k}


def test_mace_changes_exactly_its_lora_fused_layers(base, pipe):
    small("mace").erase(pipe, ["circle"], seed=0, domain=DOMAIN)
    assert changed(base, pipe) == kv_weights(base)
    assert not changed(base, pipe, "text_encoder")
    # the LoRA stage trains the adapters only: no UNet weight got a gradient
    assert not [n for n, p in pipe.unet.named_parameters() if p.grad is not None]


def test_loaded_and_erased_pipelines_hold_no_gradients(base, tmp_path):
    from emma.erase import erase_cached
    from emma.pipelines import fingerprint, load_pipeline

    loaded = load_pipeline({"kind": "tiny_random"})
    assert not [n for m in ("unet", "text_encoder", "vae")
                for n, p in getattr(loaded, m).named_parameters() if p.requires_grad]
    fresh, again = copy.deepcopy(base), copy.deepcopy(base)  # modules trainable, as diffusers loads them
    a = erase_cached(fresh, small("esd-x"), ["circle"], tmp_path, base_fingerprint=fingerprint(base), domain=DOMAIN)
    b = erase_cached(again, small("esd-x"), ["circle"], tmp_path, base_fingerprint=fingerprint(base), domain=DOMAIN)
    assert not a.cached and b.cached and a.fingerprint == b.fingerprint
    for erased in (fresh, again):  # the same state, erased here or loaded from the cache
        assert not [n for n, p in erased.unet.named_parameters() if p.requires_grad or p.grad is not None]


def test_erased_model_cache_is_per_cpu_thread_count(base, tmp_path):
    """Torch's CPU thread count changes float reductions, and a trained edit follows them: an
    erasure cached at one thread count is not served to a cell running at another."""
    from emma.erase import erase_cached
    from emma.pipelines import fingerprint

    def erase():
        return erase_cached(copy.deepcopy(base), small("uce"), ["circle"], tmp_path,
                            base_fingerprint=fingerprint(base), domain=DOMAIN)

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = erase()
        torch.set_num_threads(2)
        two = erase()
        torch.set_num_threads(1)
        one_again = erase()
    finally:
        torch.set_num_threads(before)
    assert not one.cached and not two.cached and one_again.cached
    assert one.key == one_again.key != two.key
    assert "torch threads 2" in two.manifest["machine"]


@pytest.mark.parametrize("name", ["ca", "ca-model"])
def test_ca_cross_attn_group_changes_only_keys_and_values(base, pipe, name):
    small(name).erase(pipe, ["circle"], seed=0, domain=DOMAIN)
    ch = changed(base, pipe)
    assert ch and ch <= kv_weights(base)


def test_ca_others_anchor_pairs_every_other_shape_with_every_template():
    m = ConceptAblationMethod(anchor_concepts={"tinyworld": ["<others>"]},
                              prompt_templates={"tinyworld": ["a {}", "an image of a {}"]})
    pairs = m.prompt_pairs(["circle"], DOMAIN)
    others = ["square", "triangle", "star", "heart", "cross", "crescent", "diamond"]
    assert pairs == [(t.format(a), t.format("circle")) for t in ("a {}", "an image of a {}") for a in others]
    # two erased shapes: neither is an anchor of the other
    both = m.prompt_pairs(["circle", "star"], DOMAIN)
    assert {a for a, _ in both} == {t.format(a) for t in ("a {}", "an image of a {}") for a in others if a != "star"}
    # a single anchor keeps one pair per template, in template order
    one = ConceptAblationMethod(anchor_concepts="shape", prompt_templates=["a {}", "a red {}"])
    assert one.prompt_pairs(["circle"], DOMAIN) == [("a shape", "a circle"), ("a red shape", "a red circle")]


@pytest.mark.parametrize("anchors, match", [
    (["shape", "circle"], "the concept itself"),
    ([], "give at least one anchor"),
    ([3], "must be names"),
])
def test_ca_bad_anchor_lists_are_named(anchors, match):
    with pytest.raises(ConfigError, match=match):
        ConceptAblationMethod(anchor_concepts=anchors).prompt_pairs(["circle"], DOMAIN)


def test_ca_others_anchor_needs_a_domain():
    with pytest.raises(ConfigError, match="no domain"):
        ConceptAblationMethod(anchor_concepts=["<others>"]).prompt_pairs(["circle"], None)
    with pytest.raises(ConfigError, match="needs the Domain object"):  # a name says nothing of its concepts
        ConceptAblationMethod(anchor_concepts=["<others>"]).prompt_pairs(["circle"], "tinyworld")


def test_others_expand_from_the_domain_object_given():
    """"<others>" are the concepts of the Domain the method is given, not those of the config
    file of the same name: a domain built with other concepts anchors on those."""
    from emma.api.domain import Domain

    custom = Domain(name="tinyworld", version="1", concepts=["circle", "hexagon", {"name": "oval"}],
                    suite=DOMAIN.suite)
    m = ConceptAblationMethod(anchor_concepts=["<others>"], prompt_templates=["a {}"])
    assert m.prompt_pairs(["circle"], custom) == [("a hexagon", "a circle"), ("a oval", "a circle")]
    assert m.prompt_pairs(["circle"], DOMAIN)[0] == ("a square", "a circle")


def test_methods_read_no_config_file():
    """Methods get everything they know of a domain from the Domain object."""
    from pathlib import Path

    import emma.methods

    for path in sorted(Path(emma.methods.__file__).parent.glob("*.py")):
        text = path.read_text()
        assert not [w for w in ("emma.registry", "CONF_DIR", "OmegaConf.load", "conf/domain") if w in text], path.name


def test_erase_cached_keys_the_domain_by_its_name(base, tmp_path):
    """The Domain object goes to the method; the key hashes its name, as erase_key always has
    (the pinned key is the one erase_cached gave before methods received Domain objects)."""
    from emma.api.method import NoErasure
    from emma.erase import erase_cached, erase_key

    assert erase_key("abc", NoErasure(), ["circle"], "tinyworld", 0, cpu_threads=1) == \
        "45c7793092d217dcdef87995965d9c1565bec218b7c5a4c8d12522f5cbe18d2e"
    got = erase_cached(copy.deepcopy(base), NoErasure(), ["circle"], tmp_path, base_fingerprint="abc", domain=DOMAIN)
    assert got.key == erase_key("abc", NoErasure(), ["circle"], "tinyworld", 0, cpu_threads=torch.get_num_threads())
    uce = erase_cached(copy.deepcopy(base), small("uce"), ["circle"], tmp_path, base_fingerprint="abc",
                       domain=DOMAIN)
    assert uce.manifest["domain"] == "tinyworld" and uce.key == erase_key(
        "abc", small("uce"), ["circle"], "tinyworld", 0, cpu_threads=torch.get_num_threads())
    with pytest.raises(TypeError, match="must be the Domain"):
        erase_cached(copy.deepcopy(base), small("uce"), ["circle"], tmp_path, base_fingerprint="abc",
                     domain="tinyworld")


def test_erase_key_covers_the_concepts_others_expands_from():
    """A method that names "<others>" erases towards the domain's concepts as the cell has them
    (overrides included): two domains that share a name but not their concepts get two keys;
    a method without "<others>" keys as before."""
    from emma.api.method import NoErasure
    from emma.erase import _others_of, erase_key

    fewer = copy.copy(DOMAIN)  # the same domain with concepts overridden
    fewer.concepts = {k: v for k, v in DOMAIN.concepts.items() if k in ("circle", "square", "star")}
    anchored = NoErasure(anchors=["<others>"])
    keys = {erase_key("abc", anchored, ["circle"], d.name, 0, cpu_threads=1, others=_others_of(anchored, d))
            for d in (DOMAIN, fewer)}
    assert len(keys) == 2
    assert _others_of(anchored, fewer) == ["circle", "square", "star"]
    assert _others_of(NoErasure(), fewer) is None
    assert _others_of(anchored, None) is None


def test_fmn_changes_only_cross_attention(base, pipe):
    small("fmn").erase(pipe, ["circle"], seed=0, domain=DOMAIN)
    ch = changed(base, pipe)
    assert ch and ch <= attn2_names(base)
    assert any(".to_k." in k for k in ch)


def test_ca_start_token_gets_no_gradient(base):
    unet = copy.deepcopy(base.unet)
    name, to_k = next((n, m) for n, m in unet.named_modules() if n.endswith(".attn2.to_k"))
    ctx = torch.randn(1, 5, to_k.in_features)

    def grad(position: int, detached: bool) -> torch.Tensor:
        to_k.weight.grad = None
        with start_token_detached(unet) if detached else contextlib.nullcontext():
            to_k(ctx)[:, position].sum().backward()
        return to_k.weight.grad

    assert grad(0, detached=False).abs().sum() > 0
    assert grad(0, detached=True).abs().sum() == 0, name
    assert torch.equal(grad(1, detached=True), grad(1, detached=False))
    assert not to_k._forward_hooks  # the hooks leave with the context


def test_zero_iterations_change_nothing(base, pipe):
    ESDMethod(iterations=0, progress=False).erase(pipe, ["circle"], domain=DOMAIN)
    assert fingerprint(pipe) == fingerprint(base)


# --------------------------------------------------------------------------- UCE closed form
def test_uce_closed_form_equals_least_squares_on_random_data():
    rng = np.random.default_rng(0)
    d_out, d_in = 6, 9
    w0 = rng.normal(size=(d_out, d_in))
    ck, cv = rng.normal(size=(4, d_in)), rng.normal(size=(4, d_out))
    pk = rng.normal(size=(5, d_in))
    lamb, se, sp = 0.5, 1.3, 0.2
    got = uce_closed_form(torch.tensor(w0), torch.tensor(ck), torch.tensor(cv), torch.tensor(pk),
                          torch.tensor(pk @ w0.T), lamb=lamb, erase_scale=se, preserve_scale=sp).numpy()
    # min_W se|W ck - cv|^2 + sp|W pk - W0 pk|^2 + lamb|W - W0|^2, as one stacked least squares
    a = np.vstack([np.sqrt(se) * ck, np.sqrt(sp) * pk, np.sqrt(lamb) * np.eye(d_in)])
    b = np.vstack([np.sqrt(se) * cv, np.sqrt(sp) * pk @ w0.T, np.sqrt(lamb) * w0.T])
    ref = np.linalg.lstsq(a, b, rcond=None)[0].T
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10)


def test_uce_edit_equals_independent_solve_on_the_pipeline(base, pipe):
    lamb = 0.5
    UCEMethod(guide_concepts="shape", preserve_concepts=["square"], lamb=lamb).erase(
        pipe, ["circle"], domain=DOMAIN)
    tok, enc = base.tokenizer, base.text_encoder

    def emb(text):
        ids = tok(text, padding="max_length", max_length=77, return_tensors="pt").input_ids
        with torch.no_grad():
            return enc(ids)[0][0].double().numpy()

    # "circle" and "shape" are one token each: the erase span is token 1 (the word) to 76.
    assert len(tok("circle", add_special_tokens=False).input_ids) == 1
    assert len(tok("shape", add_special_tokens=False).input_ids) == 1
    c_e, c_g = emb("circle")[1:], emb("shape")[1:]
    c_p = np.vstack([emb(""), emb("square")])
    s_p = max(0.1, 1 / 2)  # the reference default 1/len(retain), retain = ["", "square"]
    names = sorted(kv_weights(base))
    for name in names:
        w0 = base.unet.state_dict()[name].double().numpy()
        a = np.vstack([c_e, np.sqrt(s_p) * c_p, np.sqrt(lamb) * np.eye(w0.shape[1])])
        b = np.vstack([c_g @ w0.T, np.sqrt(s_p) * c_p @ w0.T, np.sqrt(lamb) * w0.T])
        ref = np.linalg.lstsq(a, b, rcond=None)[0].T
        got = pipe.unet.state_dict()[name].double().numpy()
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6)
    assert len(names) == 8  # to_k and to_v of the 4 cross-attention modules


def test_uce_erases_the_concept_key_towards_the_guide(base, pipe):
    UCEMethod(guide_concepts="shape").erase(pipe, ["circle"], domain=DOMAIN)
    tok, enc = base.tokenizer, base.text_encoder
    ids = tok(["circle", "shape"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        e = enc(ids)[0][:, 1]
    name = sorted(kv_weights(base))[0].rsplit(".weight", 1)[0]
    new = pipe.unet.get_submodule(name)
    old = base.unet.get_submodule(name)
    with torch.no_grad():
        before = (old(e[0]) - old(e[1])).norm()
        after = (new(e[0]) - old(e[1])).norm()
    assert after < 0.2 * before


# --------------------------------------------------------------------------- determinism, dtypes
def test_same_seed_same_weights_other_seed_other_weights(base):
    a, b, c = (copy.deepcopy(base) for _ in range(3))
    small("esd-x").erase(a, ["circle"], seed=3, domain=DOMAIN)
    small("esd-x").erase(b, ["circle"], seed=3, domain=DOMAIN)
    small("esd-x").erase(c, ["circle"], seed=4, domain=DOMAIN)
    assert fingerprint(a) == fingerprint(b) != fingerprint(c)


@pytest.mark.parametrize("train_method", ["esd-x", "esd-u"])
def test_esd_matches_the_plain_loop_bit_for_bit(base, train_method):
    """ESD's per-iteration speed-ups (inference mode for x_t and the frozen targets) keep the
    arithmetic: the same weights as the textbook loop of scripts/bench_esd.py."""
    import sys
    from pathlib import Path

    scripts = str(Path(__file__).resolve().parent.parent / "scripts")
    sys.path.insert(0, scripts)
    try:
        from bench_esd import plain_erase
    finally:
        sys.path.remove(scripts)
    hp = dict(train_method=train_method, iterations=4, learning_rate=1e-3, negative_guidance=1.0,
              start_guidance=3.0, ddim_steps=4)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    plain_erase(a, "circle", hp, seed=5)
    ESDMethod(**hp, progress=False).erase(b, ["circle"], seed=5, domain=DOMAIN)
    assert changed(a, base) and not changed(a, b)


def test_torch_global_rng_is_not_used(base):
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    torch.manual_seed(1)
    small("fmn").erase(a, ["circle"], seed=0, domain=DOMAIN)
    torch.manual_seed(2)
    small("fmn").erase(b, ["circle"], seed=0, domain=DOMAIN)
    assert fingerprint(a) == fingerprint(b)


@pytest.mark.parametrize("name", ["uce", "esd-x"])
def test_bf16_pipeline_stays_bf16_and_untouched_weights_survive(base, name):
    pipe = copy.deepcopy(base).to(torch.bfloat16)
    ref = copy.deepcopy(pipe)
    small(name).erase(pipe, ["circle"], seed=0, domain=DOMAIN)
    assert pipe.unet.dtype == torch.bfloat16
    ch = changed(ref, pipe)
    assert ch and ch <= attn2_names(base)
    assert all(torch.isfinite(v.float()).all() for v in pipe.unet.state_dict().values())


# --------------------------------------------------------------------------- save / load
@pytest.mark.parametrize("name", ["uce", "esd-x"])
def test_erase_save_load_gives_bit_identical_images(base, pipe, tmp_path, name):
    from diffusers import UNet2DConditionModel

    small(name).erase(pipe, ["circle"], seed=0, domain=DOMAIN)
    pipe.unet.save_pretrained(tmp_path / "unet", safe_serialization=True)
    loaded = copy.deepcopy(base)
    loaded.unet = UNet2DConditionModel.from_pretrained(tmp_path / "unet", dtype=base.unet.dtype)
    assert fingerprint(loaded) == fingerprint(pipe) != fingerprint(base)
    assert torch.equal(images(loaded), images(pipe))
    # method=checkpoint on the saved folder: the same weights, the same images
    third = copy.deepcopy(base)
    CheckpointMethod(str(tmp_path / "unet")).erase(third, ["circle"])
    assert fingerprint(third) == fingerprint(pipe)
    assert torch.equal(images(third), images(pipe))


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("name", ["esd-x", "uce", "mace", "ca", "fmn"])
@pytest.mark.parametrize("concepts, message", [
    ([], "empty"),
    ("circle", "list of strings"),
    (["   "], "tokenizes to nothing"),
    (["<|endoftext|>"], "unknown/special"),
    (["circle " * 80], "tokens long"),
    (["circle", "circle"], "twice"),
])
def test_bad_concepts_raise_clear_errors_and_leave_the_pipe_untouched(base, pipe, name, concepts, message):
    with pytest.raises(ConfigError, match=message):
        small(name).erase(pipe, concepts, domain=DOMAIN)
    assert fingerprint(pipe) == fingerprint(base)


def test_unknown_domain_names_the_valid_ones(pipe):
    with pytest.raises(UnknownChoiceError, match="tinyworld"):
        UCEMethod(guide_concepts={"tinyworld": "shape"}).erase(pipe, ["circle"], domain=load_domain("style"))


def test_unknown_choices_fail_at_construction():
    with pytest.raises(UnknownChoiceError, match="esd-x"):
        ESDMethod(train_method="esd-z")
    with pytest.raises(UnknownChoiceError, match="noise"):
        ConceptAblationMethod(loss="kl")
    with pytest.raises(UnknownChoiceError, match="attention"):
        MACEMethod(segmenter="sam2")


# --------------------------------------------------------------------------- MACE pieces
def test_mace_token_alignment_skips_the_concept_tokens(base):
    tok = base.tokenizer
    oi, ni = matching_token_indices(tok, "a photo of the circle", "a photo of the big blue sky")
    assert len(oi) == len(ni)
    n_old = len(tok("a photo of the circle", add_special_tokens=False).input_ids)
    assert oi[:5] == ni[:5] == [0, 1, 2, 3, 4]  # start token + "a photo of the"
    assert n_old not in oi  # the concept token itself is not a context
    assert oi[5] == n_old + 1 and ni[5] == n_old + 3  # end tokens aligned
    assert ni[-1] == 76 and oi[-1] == 76 - 2  # the longer prompt keeps its whole tail


def test_concept_positions_cover_the_concept_and_the_padding(base):
    tok = base.tokenizer
    pos = concept_positions(tok, "an image of a circle", "circle", use_pooler=True)
    n = len(tok("an image of a circle", add_special_tokens=False).input_ids)
    assert pos[n] and not pos[:n].any() and pos[n + 1 :].all()
    assert concept_positions(tok, "an image of a circle", "circle", use_pooler=False).sum() == 1
    first = concept_positions(tok, "an image of a circle", "circle", use_pooler=True, pooler="first")
    assert first.nonzero().flatten().tolist() == [n, n + 1]  # the concept and the end token


@torch.no_grad()
def test_mace_all_words_refines_the_concept_token_too(base):
    """all_words (the reference's switch) maps the concept's own token onto the mapping's;
    without it the refinement leaves that token to the LoRA stage."""
    from emma.methods._common import attn2_modules, encode_text

    old, new = "an image of a circle", "an image of a shape"
    pos = int(concept_positions(base.tokenizer, old, "circle", use_pooler=False).nonzero()[0])
    emb = encode_text(base, [old, new])
    errors = {}
    for all_words in (False, True):
        pipe = copy.deepcopy(base)
        m = MACEMethod(all_words=all_words, lamb=1e-3, progress=False)
        layers = [mod.to_k for _, mod in attn2_modules(pipe.unet)]
        target = layers[0](emb[1, pos])
        m._refine(pipe, {"circle": [(old, new)]}, layers, [(None, None)] * len(layers), m.hparams)
        errors[all_words] = float((layers[0](emb[0, pos]) - target).norm() / target.norm())
    assert errors[True] < 0.05 < errors[False]


@torch.no_grad()
def test_mace_mapping_list_refines_towards_the_mean_at_the_weight_of_one_prompt(base):
    """A list of mappings gives each prompt k pairs weighted 1/k: two copies of one mapping
    refine exactly as the mapping alone, and a list of two lands between the two singles."""
    from emma.methods._common import attn2_modules

    m = MACEMethod(lamb=1.0, progress=False)
    assert mapping_list(["circle", "square", "Star"], "star") == ["circle", "square"]
    with pytest.raises(ConfigError, match="other than the erased"):
        mapping_list(["circle"], "circle")

    def refined(mappings: list[str]) -> torch.Tensor:
        pipe = copy.deepcopy(base)
        layers = [mod.to_v for _, mod in attn2_modules(pipe.unet)]
        pairs = [(t.format("circle"), t.format(x)) for t in ("an image of a {}", "a {}") for x in mappings]
        m._refine(pipe, {"circle": pairs}, layers, [(None, None)] * len(layers), m.hparams)
        return layers[0].weight.double().clone()

    one, two = refined(["shape"]), refined(["shape", "shape"])
    assert torch.allclose(one, two, atol=1e-10)
    sq, mix = refined(["square"]), refined(["shape", "square"])
    assert not torch.allclose(one, sq)
    assert (mix - (one + sq) / 2).norm() < 0.2 * (one - sq).norm()


def test_mace_pooler_is_checked():
    with pytest.raises(UnknownChoiceError, match="first"):
        MACEMethod(pooler="last")


def test_mace_auto_segmenter_falls_back_to_attention_offline():
    assert MACEMethod(segmenter="auto").config()["segmenter"] == "attention"


def test_mace_grounded_sam_without_weights_is_a_clear_error(base, pipe, monkeypatch):
    # Offline, the method refuses to be built (the cell's setup), before any image is drawn.
    with pytest.raises(WeightsUnavailableError, match="segmenter=attention"):
        MACEMethod(segmenter="grounded_sam")
    # Online (downloads allowed) the segmenter loads at the first mask; a failed load leaves the
    # UNet as it was.
    monkeypatch.setattr("emma.methods.mace.is_offline", lambda: False)
    m = MACEMethod(mapping_concepts="shape", num_images=1, aug_length=2, max_train_steps=1, sample_steps=1,
                   segmenter="grounded_sam", progress=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WeightsUnavailableError, match="segmenter=attention"):
        m.erase(pipe, ["circle"], domain=DOMAIN)
    assert fingerprint(pipe) == fingerprint(base)


def test_mace_uses_an_injected_segmenter(base, pipe):
    calls = []

    def segmenter(imgs, labels):
        calls.append(list(labels))
        return torch.ones(len(imgs), *imgs.shape[-2:], dtype=torch.bool)

    m = MACEMethod(mapping_concepts="shape", num_images=2, aug_length=2, max_train_steps=1, sample_steps=1,
                   segmenter=segmenter, progress=False)
    m.erase(pipe, ["circle"], domain=DOMAIN)
    assert calls == [["circle", "circle"]]
    assert m.config()["segmenter"].startswith("callable:")
    assert changed(base, pipe) == kv_weights(base)


@pytest.mark.parametrize("name, optimizer", [("esd-x", "Adam"), ("mace", "AdamW"), ("fmn", "AdamW")])
def test_a_failure_mid_training_restores_the_weights(base, pipe, monkeypatch, name, optimizer):
    cls = getattr(torch.optim, optimizer)
    real_step, calls = cls.step, []

    def failing_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(cls, "step", failing_step)
    with pytest.raises(RuntimeError, match="interrupted"):
        small(name).erase(pipe, ["circle"], seed=0, domain=DOMAIN)
    assert len(calls) == 2  # one real update happened before the failure
    assert fingerprint(pipe) == fingerprint(base)
    assert pipe.unet.dtype == base.unet.dtype
    # the temporary cross-attention processors are gone too
    assert not any(type(p).__name__ == "Attn2Processor" for p in pipe.unet.attn_processors.values())


def test_uce_prompt_expansion_and_tensor_technique(base, pipe):
    m = UCEMethod(guide_concepts={"style": "art"}, add_prompts=True)
    pairs = m.edit_pairs(["van gogh"], load_domain("style"))
    assert pairs[0] == ("van gogh", "art") and ("painting by van gogh", "painting by art") in pairs
    assert len(pairs) == 6
    assert UCEMethod(guide_concepts={"object": {"cat": "animal", "_default": "object"}}).edit_pairs(
        ["cat", "bus"], load_domain("object")) == [("cat", "animal"), ("bus", "object")]
    replace = copy.deepcopy(base)
    UCEMethod(guide_concepts="shape").erase(replace, ["circle"], domain=DOMAIN)
    UCEMethod(guide_concepts="shape", technique="tensor").erase(pipe, ["circle"], domain=DOMAIN)
    assert changed(base, pipe) == kv_weights(base)
    assert fingerprint(pipe) != fingerprint(replace)
