"""The reference stages the SD-scale configs turn on, on the tiny random pipeline: SalUn's
fixed pseudo label, SPM's Facilitated Transport, MACE's prior/domain caches and templates,
CA's caption anchors with flips and resize augmentation, and the per-domain spellings the
methods read (labels, ``<others>``, ``<data:...>``)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import changed

from emma.domains import load_domain
from emma.errors import ConfigError
from emma.methods._common import domain_concept_names, expand_others, for_domain
from emma.pipelines import fingerprint

TINY = load_domain("tinyworld")


# --------------------------------------------------------------------------- spellings
def test_others_are_labels_and_drop_every_spelling_of_the_erased_concept():
    style = load_domain("style")
    names = domain_concept_names(style)
    assert "Vincent van Gogh" in names and "vincent-van-gogh" not in names
    # the erased artist goes in any spelling the domain knows (name, label, alias)
    for spelling in ("Vincent van Gogh", "vincent-van-gogh", "Van Gogh"):
        kept = expand_others(["<others>", "Van Gogh", "Claude Monet"], style, [spelling])
        assert "Vincent van Gogh" not in kept and "Van Gogh" not in kept and "Claude Monet" in kept
    assert domain_concept_names(TINY) == list(TINY.concepts)  # the tiny world's labels are its names


def test_reference_data_is_resolved_by_the_per_domain_lookups():
    table = {"default": [], "style": ["<data:artists1734>"]}
    assert for_domain(table, "object", what="x") == []
    artists = for_domain(table, "style", what="x")
    assert len(artists) == 1734 and artists[0] == "A.J.Casson"
    kept = expand_others(["<data:artists1734>"], load_domain("style"), ["Vincent van Gogh"])
    assert len(kept) == 1733 and "Vincent Van Gogh" not in kept  # UCE's spelling, matched lower-cased
    supers = for_domain({"object": "<data:coco_supercategories>"}, "object", what="x")
    assert supers["hot dog"] == "food" and supers["_default"] == "object"


# --------------------------------------------------------------------------- SalUn
def test_salun_fixed_pseudo_label_is_the_next_concept_of_the_domain():
    from emma.methods.salun import next_concept

    others = expand_others(["<others>"], TINY, ["circle"])
    assert next_concept("circle", others, TINY) == "square"  # (c + 1) mod N
    assert next_concept("diamond", expand_others(["<others>"], TINY, ["diamond"]), TINY) == "circle"  # wraps
    # a pseudo list the domain does not order (nudity's clothed person): its first entry
    assert next_concept("sexual", ["person wearing clothes"], load_domain("nsfw")) == "person wearing clothes"


@pytest.mark.parametrize("label", ["next", "random"])
def test_salun_pseudo_prompts_follow_the_label_rule(base, label):
    from emma.methods._common import cpu_generator
    from emma.methods.salun import SalUnMethod

    m = SalUnMethod(num_images=6, train_batch_size=2, epochs=0, sample_steps=1, pseudo_label=label,
                    prompt_templates="a {}", progress=False)
    captured = {}
    import emma.methods.salun as salun

    real = salun.encode_text

    def spy(pipe, prompts):
        captured.setdefault("calls", []).append(list(prompts))
        return real(pipe, prompts)

    salun.encode_text = spy
    try:
        m._training_set(copy.deepcopy(base), ["circle"], TINY, cpu_generator(0))
    finally:
        salun.encode_text = real
    pseudo = captured["calls"][1]
    if label == "next":
        assert pseudo == ["a square"] * 6
    else:
        assert len(set(pseudo)) > 1 and "a circle" not in pseudo


def test_salun_rejects_an_unknown_pseudo_label():
    from emma.errors import UnknownChoiceError
    from emma.methods.salun import SalUnMethod

    with pytest.raises(UnknownChoiceError, match="random"):
        SalUnMethod(pseudo_label="fixed")


# --------------------------------------------------------------------------- SPM
def small_spm(**kw):
    from emma.methods.spm import SPMMethod

    return SPMMethod(iterations=3, max_denoising_steps=3, sampling_batch_size=1, lr_warmup_steps=0,
                     learning_rate=5e-2, progress=False, **kw)


def test_spm_matching_scores_are_high_for_the_concept_and_low_elsewhere(base):
    from emma.methods.spm import matching_scores

    s = matching_scores(base, ["circle"], "clipcos_tokenuni", prompts=["a circle", "circle", "a square"])
    assert s.shape == (3, 1)
    assert s[1, 0] == pytest.approx(1.0) and s[0, 0] == pytest.approx(1.0)  # token share 1
    assert s[2, 0] < 1.0
    tok = matching_scores(base, ["red circle"], "tokenuni", prompts=["a circle"])
    assert tok[0, 0] == pytest.approx(0.5)  # one of the concept's two tokens
    emb = matching_scores(base, ["circle"], "clipcos_tokenuni", prompt_embeds=torch.zeros(1, 77, 32) + 1)
    assert emb.shape == (1, 1)  # embeddings only: cosine alone


def test_spm_facilitated_transport_scales_per_prompt_and_restores_the_weights(base, pipe, tmp_path):
    from emma.methods.spm import FacilitatedTransport

    method = small_spm(facilitated_transport=True)
    method.erase(pipe, ["circle"], seed=0, domain=TINY)
    erased = fingerprint(pipe)
    guidance = method.inference_guidance(pipe, ["circle"], domain=TINY)
    assert isinstance(guidance, FacilitatedTransport)
    gens = [torch.Generator().manual_seed(s) for s in (0, 1)]
    kw = dict(num_inference_steps=2, guidance_scale=5.0, height=32, width=32)
    ft = guidance.sample(pipe, prompt=["a circle", "a square"], generator=gens, **kw)
    assert fingerprint(pipe) == erased  # weights put back exactly
    full = pipe(prompt=["a circle", "a square"], generator=[torch.Generator().manual_seed(s) for s in (0, 1)],
                output_type="pt", **kw).images
    untouched = base(prompt=["a square"], generator=[torch.Generator().manual_seed(1)], output_type="pt", **kw).images
    m = guidance.multipliers(pipe, ["a circle", "a square"])[:, 0]
    assert m[0] == pytest.approx(1.0) and m[1] < 1.0
    assert torch.allclose(ft[0], full[0], atol=1e-5)  # the concept's own prompt: full strength
    # another prompt is drawn between the base model and the full membrane
    assert not torch.allclose(ft[1], full[1], atol=1e-6)
    d_ft, d_full = (ft[1] - untouched[0]).abs().mean(), (full[1] - untouched[0]).abs().mean()
    assert d_ft < d_full
    # off (the tiny world's setting): no guidance, full strength
    assert small_spm().inference_guidance(pipe, ["circle"], domain=TINY) is None


def test_spm_membranes_survive_a_cached_erasure(base, tmp_path):
    from emma.erase import erase_cached

    first = small_spm(facilitated_transport=True)
    a = copy.deepcopy(base)
    res = erase_cached(a, first, ["circle"], tmp_path, base_fingerprint="b", domain=TINY, seed=0)
    assert not res.cached and (tmp_path / "erased" / res.key / "method_state" / "spm_adapter.safetensors").exists()
    again = small_spm(facilitated_transport=True)
    b = copy.deepcopy(base)
    hit = erase_cached(b, again, ["circle"], tmp_path, base_fingerprint="b", domain=TINY, seed=0)
    assert hit.cached and again.concepts == ["circle"] and len(again.adapters) == 1
    g1 = first.inference_guidance(a, ["circle"], domain=TINY).multipliers(a, ["a square"])
    g2 = again.inference_guidance(b, ["circle"], domain=TINY).multipliers(b, ["a square"])
    assert torch.equal(g1, g2)
    assert torch.equal(first.adapters[0].up[0], again.adapters[0].up[0])


# --------------------------------------------------------------------------- MACE
def small_mace(**kw):
    from emma.methods.mace import MACEMethod

    args = dict(mapping_concepts="shape", num_images=1, aug_length=2, max_train_steps=1, sample_steps=1,
                segmenter="attention", progress=False, prompt_templates=["a {}", "an image of a {}", "a red {}"])
    args.update(kw)
    return MACEMethod(**args)


def test_mace_prior_and_domain_caches_change_the_edit(base):
    plain = copy.deepcopy(base)
    small_mace().erase(plain, ["circle"], domain=TINY)
    prior = copy.deepcopy(base)
    small_mace(train_preserve_scale=1e-3, fuse_preserve_scale=1e-3, prior_prompts=["a dog", "a cat on a bed"],
               prior_prompt_count=1000).erase(prior, ["circle"], domain=TINY)
    both = copy.deepcopy(base)
    small_mace(train_preserve_scale=1e-3, fuse_preserve_scale=1e-3, prior_prompts=["a dog", "a cat on a bed"],
               prior_prompt_count=1000, preserve_concepts=["<others>"], preserve_weight=10.0
               ).erase(both, ["circle"], domain=TINY)
    fps = {fingerprint(p) for p in (plain, prior, both)}
    assert len(fps) == 3
    # preservation keeps the edited layers nearer the base weights than no preservation
    def dist(p):
        return sum((a - b).double().norm() for a, b in zip(p.unet.parameters(), base.unet.parameters()))
    assert dist(prior) < dist(plain)


def test_mace_preservation_statistics_are_the_token_gram(base):
    from emma.methods._common import attn2_modules, encode_text
    from emma.methods.mace import MACEMethod

    m = MACEMethod(prior_prompts=["a dog"], prior_prompt_count=4, train_preserve_scale=1.0,
                   preserve_concepts=["<others>"], preserve_weight=0.5, segmenter="attention")
    layer = attn2_modules(base.unet)[0][1].to_k
    templates = ["a {}", "the {}"]
    stats = m._preserve_stats(base, m.hparams, TINY, ["circle"], [layer], templates)
    c = encode_text(base, ["a dog"]).double().reshape(-1, layer.in_features)
    others = [t.format(o) for o in expand_others(["<others>"], TINY, ["circle"]) for t in templates]
    d = encode_text(base, others).double().reshape(-1, layer.in_features)
    want = 4 * (c.T @ c) + 0.5 * (d.T @ d)
    assert torch.allclose(stats[0][1], want, rtol=1e-6)
    assert torch.allclose(stats[0][0], layer.weight.double() @ want, rtol=1e-6)
    none = MACEMethod(segmenter="attention")._preserve_stats(base, MACEMethod(segmenter="attention").hparams,
                                                             TINY, ["circle"], [layer], templates)
    assert none == [(None, None)]


def test_mace_prompt_len_limits_the_templates_drawn_from():
    m = small_mace(prompt_templates=["a {}", "b {}", "c {}", "d {}"], aug_length=2, prompt_len=3)
    assert m.templates(m.hparams, TINY) == ["a {}", "b {}", "c {}"]
    with pytest.raises(ConfigError, match="prompt_len"):
        small_mace(aug_length=5, prompt_len=3)


def test_mace_grounded_sam_weights_are_refused_offline_at_build():
    from emma.errors import WeightsUnavailableError
    from emma.methods.mace import GROUNDING_DINO_ID, MACEMethod

    assert GROUNDING_DINO_ID == "IDEA-Research/grounding-dino-tiny"  # Swin-T, MACE's checkpoint
    with pytest.raises(WeightsUnavailableError, match="huggingface-cli download"):
        MACEMethod(segmenter="grounded_sam")


# --------------------------------------------------------------------------- CA
def test_ca_augmentation_masks_the_image_region_and_names_its_size():
    from emma.methods._common import cpu_generator
    from emma.methods.ca import augment_latent

    x = torch.arange(4 * 8 * 8, dtype=torch.float32).reshape(4, 8, 8)
    out, mask, words = augment_latent(x, cpu_generator(0), augment=False, hflip=False)
    assert torch.equal(out, x) and words == ""
    assert mask[0, 0].sum() == 0 and mask[0, 1:-1, 1:-1].all() and mask.sum() == 36  # 1-px border out
    flips = {bool(torch.equal(augment_latent(x, cpu_generator(s), augment=False, hflip=True)[0], x.flip(-1)))
             for s in range(8)}
    assert flips == {True, False}
    seen = set()
    for s in range(40):
        out, mask, words = augment_latent(x, cpu_generator(s), augment=True, hflip=False)
        assert out.shape == x.shape and mask.shape == (1, 8, 8)
        seen.add(words)
        if words in ("zoomed in ", "close up "):
            assert mask.all()
        else:
            assert mask.sum() < 64
    assert {"zoomed in ", "close up "} & seen and {"a far away ", "very small "} & seen


def test_ca_style_captions_and_phrasings(base, pipe):
    from emma.methods.ca import ConceptAblationMethod

    captions = ["a garden at dawn", "a harbour painting"]
    m = ConceptAblationMethod(anchor_concepts="painting", anchor_prompts=captions, target_prompts="style",
                              num_class_images=2, train_batch_size=2, max_train_steps=2, sample_steps=1,
                              hflip=True, progress=False)
    assert m.prompt_pairs(["striped"], None) == [(c, "striped") for c in captions]
    m.erase(pipe, ["striped"], domain=load_domain("tinyworld_style"))
    assert changed(base, pipe)
    replace = ConceptAblationMethod(anchor_concepts="shape", anchor_prompts=["a shape on a table"],
                                    target_prompts="replace")
    assert replace.prompt_pairs(["circle"], None) == [("a shape on a table", "a circle on a table")]


def test_ca_negative_prompt_reaches_the_anchor_images(base, monkeypatch):
    import emma.methods.ca as ca

    seen = {}

    def fake(pipe, prompts, seeds, **kw):
        seen.update(kw)
        return torch.zeros(len(prompts), 4, 4, 4)

    monkeypatch.setattr(ca, "generate_latents", fake)
    m = ca.ConceptAblationMethod(anchor_concepts="people", anchor_prompts=["people at a table"],
                                 target_prompts="nudity", anchor_negative_prompt="{}", num_class_images=2,
                                 train_batch_size=1, max_train_steps=0, progress=False)
    m.erase(copy.deepcopy(base), ["circle"], domain=TINY)
    assert seen["negative_prompts"] == ["circle", "circle"]


def test_ca_rejects_an_unknown_target_phrasing():
    from emma.errors import UnknownChoiceError
    from emma.methods.ca import ConceptAblationMethod

    with pytest.raises(UnknownChoiceError, match="nudity"):
        ConceptAblationMethod(target_prompts={"default": "rewrite"})
