"""RECE, SLD, SalUn and SPM on the tiny random pipeline: which weights change (and which do
not), RECE's closed forms against independent least-squares solves, SLD against diffusers'
StableDiffusionPipelineSafe, SalUn's mask against an independent ranking, SPM's adapter
round trip, and the ``model=sd14`` plumbing of every new config file."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from conftest import changed

from emma.cache import ImageCache, from_uint8, to_uint8
from emma.domains import load_domain
from emma.errors import ConfigError, EmmaError, WeightsUnavailableError
from emma.generate import CachedGenerator
from emma.methods.rece import RECEMethod, rece_adversarial_embedding
from emma.methods.salun import SalUnMethod, saliency_mask
from emma.methods.sld import SLD_DEFAULT_SAFETY_CONCEPT, SafeLatentGuidance, SLDMethod
from emma.methods.spm import SPMMethod, load_spm_adapter, spm_target_modules
from emma.methods.uce import UCEMethod
from emma.pipelines import fingerprint, tiny_random_pipeline

DOMAIN = load_domain("tinyworld")
CONF = Path(__file__).resolve().parent.parent / "conf"


def method_cfg(name: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(overrides=[f"+method={name}"]).method


def kv_weights(pipe) -> set[str]:
    return {k for k in pipe.unet.state_dict() if k.endswith((".attn2.to_k.weight", ".attn2.to_v.weight"))}


def gens(seeds=(0, 1)):
    return [torch.Generator("cpu").manual_seed(s) for s in seeds]


def images(pipe, prompt: str = "a circle", seeds=(0, 1)) -> torch.Tensor:
    return pipe([prompt] * len(seeds), generator=gens(seeds), num_inference_steps=3, guidance_scale=5.0,
                output_type="pt").images


def small_salun(**kw):
    return SalUnMethod(num_images=4, train_batch_size=2, epochs=1, sample_steps=2, learning_rate=1e-3,
                       progress=False, **kw)


def small_spm(**kw):
    return SPMMethod(iterations=3, max_denoising_steps=3, lr_warmup_steps=0, learning_rate=1e-2,
                     sampling_batch_size=2, progress=False, **kw)


def embed(pipe, text: str) -> torch.Tensor:
    tok = pipe.tokenizer
    ids = tok(text, padding="max_length", max_length=tok.model_max_length, return_tensors="pt").input_ids
    with torch.no_grad():
        return pipe.text_encoder(ids)[0][0].double()


# --------------------------------------------------------------------------- RECE
def test_rece_changes_exactly_cross_attention_keys_and_values(base, pipe):
    RECEMethod(preserve_concepts=["<others>"], epochs=2).erase(pipe, ["circle"], domain=DOMAIN)
    assert changed(base, pipe) == kv_weights(base)
    assert not changed(base, pipe, "text_encoder") and not changed(base, pipe, "vae")


def test_rece_adversarial_embedding_equals_stacked_least_squares():
    g = torch.Generator().manual_seed(0)
    d_in, gamma = 7, 1e-3
    ws = [torch.randn(5, d_in, generator=g, dtype=torch.float64) for _ in range(3)]
    w0s = [torch.randn(5, d_in, generator=g, dtype=torch.float64) for _ in range(3)]
    c = torch.randn(4, d_in, generator=g, dtype=torch.float64)
    got = rece_adversarial_embedding(ws, w0s, c, regular_scale=gamma)
    # min_e sum_l |W_l e - W0_l c|^2 + gamma |e|^2 per token: one stacked least squares
    a = torch.cat(ws + [gamma**0.5 * torch.eye(d_in, dtype=torch.float64)])
    b = torch.cat([c @ w0.T for w0 in w0s] + [torch.zeros(4, d_in, dtype=torch.float64)], dim=1).T
    ref = torch.linalg.lstsq(a, b).solution.T
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(("technique", "keep_erased"), [("replace", False), ("tensor", True)])
def test_rece_one_round_equals_independent_solves_on_the_pipeline(base, pipe, technique, keep_erased):
    lamb, s_e, s_p, gamma = 0.1, 1.0, 0.1, 1e-3
    RECEMethod(epochs=1, lamb=lamb, erase_scale=s_e, preserve_scale=s_p, regular_scale=gamma,
               technique=technique, keep_erased=keep_erased).erase(pipe, ["circle"], domain=DOMAIN)
    uce = copy.deepcopy(base)
    UCEMethod(guide_concepts="").erase(uce, ["circle"], domain=DOMAIN)
    names = sorted(kv_weights(base))
    # RECE's layer order: every to_v, then every to_k
    order = sorted([n for n in names if ".to_v." in n]) + sorted([n for n in names if ".to_k." in n])
    w_uce = {n: uce.unet.state_dict()[n].double() for n in names}
    w_0 = {n: base.unet.state_dict()[n].double() for n in names}
    c = embed(base, "circle")
    # adversarial embedding: torch.linalg.lstsq on the stacked system
    a = torch.cat([w_uce[n] for n in order] + [gamma**0.5 * torch.eye(c.shape[1], dtype=torch.float64)])
    b = torch.cat([c @ w_0[n].T for n in order] + [torch.zeros_like(c)], dim=1).T
    adv = torch.linalg.lstsq(a, b).solution.T
    guide, keep = embed(base, " "), embed(base, "")
    if keep_erased:  # the erased prompt's current (UCE-edited) outputs are kept too
        keep = torch.cat([keep, c])
    for n in names:
        w = w_uce[n]
        target = guide @ w.T
        if technique == "tensor":  # less the component along the adversarial outputs (one unit vector)
            u = (adv @ w.T).flatten()
            u = u / torch.linalg.vector_norm(u)
            target = (target.flatten() - torch.dot(u, target.flatten()) * u).reshape(target.shape)
        a = torch.cat([s_e**0.5 * adv, s_p**0.5 * keep, lamb**0.5 * torch.eye(w.shape[1], dtype=torch.float64)])
        b = torch.cat([s_e**0.5 * target, s_p**0.5 * keep @ w.T, lamb**0.5 * w.T])
        ref = torch.linalg.lstsq(a, b).solution.T
        torch.testing.assert_close(pipe.unet.state_dict()[n].double(), ref, rtol=1e-4, atol=1e-5)


def test_rece_without_rounds_is_uce_towards_the_unconditional_prompt(base, pipe):
    RECEMethod(epochs=0).erase(pipe, ["circle"], domain=DOMAIN)
    uce = copy.deepcopy(base)
    UCEMethod(guide_concepts="").erase(uce, ["circle"], domain=DOMAIN)
    assert fingerprint(pipe) == fingerprint(uce)


def test_rece_without_rounds_is_uce_with_the_uce_settings_it_is_given(base, pipe):
    # the tiny-world presets' UCE: guide "shape", template expansion, "tensor" at erase scale 10
    RECEMethod(epochs=0, guide_concepts="shape", preserve_concepts=["<others>"], uce_erase_scale=10.0,
               uce_technique="tensor", uce_add_prompts=True).erase(pipe, ["circle"], domain=DOMAIN)
    uce = copy.deepcopy(base)
    others = ["square", "triangle", "star", "heart", "cross", "crescent", "diamond"]
    UCEMethod(guide_concepts="shape", preserve_concepts=others, erase_scale=10.0, technique="tensor",
              add_prompts=True).erase(uce, ["circle"], domain=DOMAIN)
    assert fingerprint(pipe) == fingerprint(uce)
    plain_uce = copy.deepcopy(base)
    UCEMethod(guide_concepts="shape", preserve_concepts=others).erase(plain_uce, ["circle"], domain=DOMAIN)
    assert fingerprint(plain_uce) != fingerprint(uce)


def test_rece_rejects_an_unknown_technique():
    with pytest.raises(EmmaError, match="replace"):
        RECEMethod(technique="project")
    with pytest.raises(EmmaError, match="tensor"):
        RECEMethod(uce_technique="project")


def test_rece_preserve_others_expands_to_the_domain_s_shapes():
    m = RECEMethod(preserve_concepts={"tinyworld": ["<others>"]})
    assert m.preserve_prompts(["circle"], DOMAIN) == [
        "", "square", "triangle", "star", "heart", "cross", "crescent", "diamond"]


# --------------------------------------------------------------------------- SLD
def test_sld_edits_no_weight_and_returns_its_guidance(base, pipe):
    m = SLDMethod()
    assert m.edited_components == ()
    assert m.erase(pipe, ["circle"], domain=DOMAIN) is pipe
    assert fingerprint(pipe) == fingerprint(base)
    g = m.inference_guidance(pipe, ["circle"], domain=DOMAIN)
    assert isinstance(g, SafeLatentGuidance) and g.safety_concept == "circle"
    assert g.config()["sld_guidance_scale"] == 1000.0
    with pytest.raises(ConfigError, match="list of strings"):
        m.inference_guidance(pipe, "circle", domain=DOMAIN)


@pytest.mark.parametrize("preset", ["sld_weak", "sld", "sld_strong", "sld_max"])
def test_sld_matches_diffusers_stable_diffusion_pipeline_safe(base, preset):
    from diffusers import EulerAncestralDiscreteScheduler, StableDiffusionPipelineSafe
    from hydra.utils import instantiate

    method = instantiate(method_cfg(preset))
    pipe = copy.deepcopy(base)
    pipe.scheduler = EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config)
    hp = {k: v for k, v in method.hparams.items() if k != "safety_concepts"}
    # a 20-step run crosses every preset's warm-up (0, 7, 10, 15 steps)
    kw = dict(num_inference_steps=20, guidance_scale=5.0, height=32, width=32)
    ours = method.inference_guidance(pipe, ["circle"], domain=DOMAIN).sample(
        pipe, prompt=["a circle", "a star"], generator=gens(), **kw)
    safe = StableDiffusionPipelineSafe(vae=pipe.vae, text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer,
                                       unet=pipe.unet, scheduler=pipe.scheduler, safety_checker=None,
                                       feature_extractor=None, requires_safety_checker=False)
    safe.set_progress_bar_config(disable=True)
    safe._safety_text_concept = "circle"
    ref = safe(["a circle", "a star"], generator=gens(), output_type="np", **kw, **hp).images
    torch.testing.assert_close(ours, torch.from_numpy(ref).permute(0, 3, 1, 2), rtol=0, atol=1e-5)
    plain_images = pipe(["a circle", "a star"], generator=gens(), output_type="pt", **kw).images
    # the safety term acts (on this random model weak/medium move images by ~1e-7/1e-4 only)
    assert (ours - plain_images).abs().max() > (1e-3 if preset in ("sld_strong", "sld_max") else 0)


def test_sld_disabled_is_the_pipeline_s_own_sampling(base):
    pipe = copy.deepcopy(base)
    off = SafeLatentGuidance("circle", sld_guidance_scale=1.0).sample(
        pipe, prompt=["a circle", "a star"], generator=gens(), num_inference_steps=3, guidance_scale=5.0,
        height=32, width=32)
    plain_images = pipe(["a circle", "a star"], generator=gens(), num_inference_steps=3, guidance_scale=5.0,
                        height=32, width=32, output_type="pt").images
    assert torch.equal(off, plain_images)


def test_generator_with_guidance_draws_and_caches_other_images(base, tmp_path):
    fp = fingerprint(base)
    kw = dict(num_inference_steps=3, guidance_scale=5.0, height=32, width=32)
    plain_gen = CachedGenerator(base, fp, ImageCache(tmp_path), **kw)
    sld = SafeLatentGuidance("circle", sld_guidance_scale=5000, sld_warmup_steps=0, sld_threshold=1.0)
    guided = CachedGenerator(base, fp, ImageCache(tmp_path), guidance=sld, **kw)
    assert plain_gen.image_key("a circle", 0, None) != guided.image_key("a circle", 0, None)
    assert "inference_guidance" not in plain_gen.settings()  # plain keys are unchanged
    b = guided.generate(["a circle"], [0]).images
    direct = sld.sample(copy.deepcopy(base), prompt=["a circle"], generator=gens((0,)), **kw)
    assert torch.equal(b, from_uint8(to_uint8(direct)))  # drawn by the guidance, stored as 8 bit
    again = CachedGenerator(base, fp, ImageCache(tmp_path), guidance=sld, **kw)
    c = again.generate(["a circle"], [0])
    assert c.cached == [True] and torch.equal(c.images, b)


def test_sld_nsfw_safety_concept_is_the_paper_s():
    m = SLDMethod(**{k: v for k, v in method_cfg("sld").items() if k != "_target_"})
    assert m.safety_concept(["nudity"], load_domain("nsfw")) == SLD_DEFAULT_SAFETY_CONCEPT
    assert m.safety_concept(["circle"], DOMAIN) == "circle"


def test_sld_cell_records_inference_time_guidance(tmp_path):
    from hydra import compose, initialize_config_dir

    from emma.cell import run_cell
    from emma.registry import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=tiny_random", "method=sld", "metrics=rates_only", "prompt_types=[name]",
            "images_per_prompt=1", f"paths.cache_dir={tmp_path / 'cache'}"])
    res = run_cell(cfg, tmp_path / "out")
    model = res.versions["model"]
    assert model["base_fingerprint"] == model["erased_fingerprint"]
    assert model["inference_guidance"]["name"] == "sld"
    assert model["inference_guidance"]["safety_concept"] == "circle"
    assert res.metrics["time/unlearning_s"].value == 0.0
    assert any("inference-time guidance" in n for n in res.notes)
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["versions"]["model"]["inference_guidance"]["sld_warmup_steps"] == 10


# --------------------------------------------------------------------------- SalUn
def test_saliency_mask_keeps_the_largest_gradients_over_all_tensors():
    g = torch.Generator().manual_seed(0)
    grads = {"a": torch.randn(10, 3, generator=g), "b": torch.randn(7, generator=g)}
    mask = saliency_mask(grads, 0.4)
    flat = np.concatenate([grads["a"].abs().flatten().numpy(), grads["b"].abs().flatten().numpy()])
    k = int(round(0.4 * flat.size))
    ref = np.zeros(flat.size, bool)
    ref[np.argsort(-flat)[:k]] = True
    got = np.concatenate([mask["a"].flatten().numpy(), mask["b"].flatten().numpy()])
    assert (got == ref).all() and got.sum() == k


def test_saliency_mask_breaks_ties_at_the_threshold_in_order():
    # 6 entries above 0.5, 5 at it, the rest below: a mask of 8 takes the 6 and the first 2 ties
    grads = {"a": torch.tensor([[0.9, -0.5], [0.1, 0.5]]), "b": torch.tensor([-0.7, 0.5, 0.8, 0.0]),
             "c": torch.tensor([0.5, 2.0, -3.0, 0.6, 0.5, 0.2])}
    mask = saliency_mask(grads, 8 / 14)
    assert mask["a"].tolist() == [[True, True], [False, True]]
    assert mask["b"].tolist() == [True, False, True, False]
    assert mask["c"].tolist() == [False, True, True, True, False, False]
    assert all(m.dtype == torch.bool for m in mask.values())
    assert not any(m.any() for m in saliency_mask(grads, 0.01).values())  # rounds to 0 entries
    assert all(m.all() for m in saliency_mask(grads, 1.0).values())


def test_saliency_mask_refuses_a_non_finite_gradient():
    with pytest.raises(ConfigError, match="not finite"):
        saliency_mask({"w": torch.tensor([1.0, float("nan")])}, 0.5)


def test_salun_changes_only_masked_weights(base, pipe):
    m = small_salun(mask_ratio=0.3)
    m.erase(pipe, ["circle"], seed=0, domain=DOMAIN)
    after, before = pipe.unet.state_dict(), base.unet.state_dict()
    n_changed = n_outside = n_total = n_mask = 0
    for k, mk in m.last_mask.items():
        d = after[k] != before[k]
        n_changed += int(d.sum())
        n_outside += int((d & ~mk).sum())
        n_total += mk.numel()
        n_mask += int(mk.sum())
    assert n_outside == 0 and n_changed > 0.5 * n_mask
    assert n_mask == round(0.3 * n_total)
    assert not changed(base, pipe, "text_encoder") and not changed(base, pipe, "vae")


def test_salun_xattn_group_stays_in_cross_attention(base, pipe):
    small_salun(parameter_group="xattn").erase(pipe, ["circle"], seed=0, domain=DOMAIN)
    ch = changed(base, pipe)
    assert ch and all(".attn2." in k for k in ch)


def delta_summary(a, b, component: str) -> torch.Tensor:
    """Σ|Δ|, ΣΔ, Δ·r (a fixed random direction) and |Δ| of ``component``'s weights, ``a`` - ``b``:
    numbers that any change in what a method draws, or in what order, moves far, and that
    another machine's float rounding moves by well under 1e-3 of |Δ|."""
    sa, sb = getattr(a, component).state_dict(), getattr(b, component).state_dict()
    d = torch.cat([(sa[k].double() - sb[k].double()).flatten() for k in sorted(sa)])
    r = torch.randn(d.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return torch.stack([d.abs().sum(), d.sum(), (d * r).sum(), d.norm()])


def test_salun_erased_weights_are_pinned(base, pipe):
    """The weights SalUn erases on the tiny random pipeline (seed 0, one thread), summarised;
    recorded from the implementation before its steps were split into functions."""
    small_salun().erase(pipe, ["circle"], seed=0, domain=DOMAIN)
    got = delta_summary(pipe, base, "unet")
    ref = [13.800838559698605, -0.13830663228145568, 0.008510647503868193, 0.1505671328514463]
    torch.testing.assert_close(got, torch.tensor(ref, dtype=torch.float64), rtol=1e-4, atol=1e-3 * ref[3])


def test_salun_needs_another_concept(pipe):
    with pytest.raises(ConfigError, match="pseudo_concepts"):
        small_salun(pseudo_concepts=["circle"]).erase(pipe, ["circle"], domain=DOMAIN)


# --------------------------------------------------------------------------- SPM
def test_spm_changes_only_its_adapted_layers_by_rank_one(base, pipe):
    m = small_spm()
    m.erase(pipe, ["circle"], seed=0, domain=DOMAIN)
    adapted = {f"{n}.weight" for n in spm_target_modules(base.unet)}
    ch = changed(base, pipe)
    assert ch and ch <= adapted
    assert not any(k.endswith(".bias") for k in ch)
    after, before = pipe.unet.state_dict(), base.unet.state_dict()
    for k in ch:
        delta = (after[k] - before[k]).double().reshape(after[k].shape[0], -1)
        sv = torch.linalg.svdvals(delta)  # rank 1 up to the float32 rounding of the fused weight
        assert sv[0] > 0 and (len(sv) == 1 or sv[1] <= 1e-2 * sv[0]), (k, sv[:3])
    assert not changed(base, pipe, "text_encoder")


def test_spm_adapter_round_trips_into_a_fresh_base_pipeline(base, pipe, tmp_path):
    m = small_spm()
    m.erase(pipe, ["circle"], seed=0, domain=DOMAIN)
    path = m.save_adapter(tmp_path / "adapter")
    assert path.name == "spm_adapter.safetensors" and path.stat().st_size < 200_000
    fresh = tiny_random_pipeline(seed=0)
    fresh.set_progress_bar_config(disable=True)
    info = load_spm_adapter(fresh, tmp_path / "adapter")
    assert info["concepts"] == ["circle"] and info["rank"] == 1
    assert fingerprint(fresh) == fingerprint(pipe) != fingerprint(base)
    assert torch.equal(images(fresh), images(pipe))
    with pytest.raises(ConfigError, match="no SPM adapter"):
        load_spm_adapter(fresh, tmp_path / "nowhere")


def test_spm_same_seed_same_adapter(base):
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    small_spm().erase(a, ["circle"], seed=1, domain=DOMAIN)
    small_spm().erase(b, ["circle"], seed=1, domain=DOMAIN)
    assert fingerprint(a) == fingerprint(b) != fingerprint(base)


def test_spm_concept_template_is_the_membrane_s_training_prompt(base):
    """concept_templates puts the concept in the prompt its membrane is trained on: "circle" in
    "an image of a {}" trains the membrane that the prompt "an image of a circle" trains; the
    name alone (the default) another."""
    a, b, c = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    small_spm(concept_templates={"tinyworld": "an image of a {}"}).erase(a, ["circle"], seed=1, domain=DOMAIN)
    small_spm().erase(b, ["an image of a circle"], seed=1, domain=DOMAIN)
    small_spm().erase(c, ["circle"], seed=1, domain=DOMAIN)
    assert fingerprint(a) == fingerprint(b) != fingerprint(c)
    with pytest.raises(ConfigError, match="SPM concept_templates for domain 'tinyworld' must be a string with one"):
        small_spm(concept_templates={"tinyworld": "{} and {}"}).erase(copy.deepcopy(base), ["circle"], domain=DOMAIN)


# --------------------------------------------------------------------------- model=sd14
SMALL_SD = {
    "rece": [], "sld": [], "sld_max": [],
    "salun": ["method.num_images=2", "method.train_batch_size=2", "method.epochs=1", "method.sample_steps=2"],
    "spm": ["method.iterations=2", "method.max_denoising_steps=3", "method.sampling_batch_size=1",
            "method.lr_warmup_steps=0"],
    "eap": ["method.iterations=2", "method.ddim_steps=3", "method.vocabulary=[disc,ring,square,box,star]",
            "method.k_closest=4", "method.num_centers=2"],
    "advunlearn": ["method.iterations=2", "method.warmup_iter=1", "method.attack_step=1", "method.ddim_steps=3",
                   "method.retain_batch=1"],
}


@pytest.mark.parametrize("name", list(SMALL_SD))
def test_sd14_configs_erase_a_tiny_sd_of_the_same_classes(base, tmp_path, name):
    from hydra import compose, initialize_config_dir

    from emma.cell import run_cell
    from emma.registry import register_configs

    register_configs()
    folder = tmp_path / "sd14-like"
    base.save_pretrained(folder)
    # domain=tinyworld: an SD model's default domain is object, whose prompt files are downloads
    common = ["model=sd14", "domain=tinyworld", f"method={name}", "model.device=cpu", "model.dtype=float32",
              "metrics=rates_only",
              "prompt_types=[name]", "images_per_prompt=1", "model.num_inference_steps=2",
              "model.height=32", "model.width=32", f"paths.cache_dir={tmp_path / 'cache'}", *SMALL_SD[name]]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        offline = compose(config_name="config", overrides=common)
        local = compose(config_name="config", overrides=[*common, f"model.pretrained={folder}"])
    assert offline.method.get("_target_")  # the paper's defaults, no tiny-world preset
    with pytest.raises(WeightsUnavailableError, match="huggingface-cli download"):
        run_cell(offline, tmp_path / "offline")
    res = run_cell(local, tmp_path / "out")
    model = res.versions["model"]
    if name.startswith("sld"):
        assert model["erased_fingerprint"] == model["base_fingerprint"] and model["inference_guidance"]
    else:
        assert model["erased_fingerprint"] != model["base_fingerprint"]
