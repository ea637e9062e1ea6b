"""Every conf/method/*.yaml composes, instantiates offline, carries the papers' defaults and
EMMA's per-domain guide concepts, and erases on the tiny random pipeline (few steps)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from emma.domains import load_domain
from emma.methods._common import for_concept, for_domain
from emma.pipelines import fingerprint

CONF = Path(__file__).resolve().parent.parent / "conf"
METHODS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))
DOMAINS = sorted(p.stem for p in (CONF / "domain").glob("*.yaml")) or [
    "object", "celebrity", "style", "nsfw", "copyright", "ip", "tinyworld", "tinyworld_style"]
# Few steps, so that each file erases in about a second on a CPU.
SMALL = {
    "esd": ["method.iterations=2", "method.ddim_steps=3"],
    "mace": ["method.num_images=1", "method.aug_length=2", "method.max_train_steps=1",
             "method.sample_steps=1", "method.segmenter=attention"],
    "ca": ["method.num_class_images=2", "method.train_batch_size=2", "method.max_train_steps=1",
           "method.sample_steps=1"],
    "fmn": ["method.num_images=1", "method.max_train_steps=1", "method.sample_steps=1", "method.max_train_steps_ti=2"],
    "salun": ["method.num_images=2", "method.train_batch_size=2", "method.epochs=1", "method.sample_steps=1"],
    "spm": ["method.iterations=2", "method.max_denoising_steps=3", "method.sampling_batch_size=1",
            "method.lr_warmup_steps=0"],
    "eap": ["method.iterations=2", "method.ddim_steps=3", "method.vocabulary=[disc,ring,square,box]",
            "method.k_closest=3", "method.num_centers=2"],
    "advunlearn": ["method.iterations=2", "method.warmup_iter=1", "method.attack_step=1", "method.ddim_steps=3",
                   "method.retain_batch=1"],
}


def method_cfg(name: str, overrides: list[str] = ()):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(overrides=[f"+method={name}", *overrides]).method


def small_overrides(name: str) -> list[str]:
    family = name.split("_")[0]
    return SMALL.get(family, [])


def test_the_issue_s_methods_all_have_a_file():
    for name in ("esd", "esd_u", "esd_100", "esd_200", "esd_500", "uce", "mace", "ca", "ca_model", "fmn",
                 "checkpoint", "rece", "sld", "sld_weak", "sld_strong", "sld_max", "salun", "spm", "eap",
                 "advunlearn"):
        assert name in METHODS


@pytest.mark.parametrize("name", [m for m in METHODS if m != "checkpoint"])
def test_every_method_file_erases_on_the_tiny_random_pipeline(base, name):
    method = instantiate(method_cfg(name, small_overrides(name)))
    if hasattr(method, "progress"):
        method.progress = False
    pipe = copy.deepcopy(base)
    out = method.erase(pipe, ["circle"], seed=0, domain=load_domain("tinyworld"))
    assert out is pipe
    if name == "none" or name.startswith("sld"):  # the base model / inference-time guidance
        assert fingerprint(pipe) == fingerprint(base) and method.edited_components == ()
    else:
        edited = ("text_encoder",) if name == "advunlearn" else ("unet",)  # AdvUnlearn trains the text encoder
        kept = tuple(c for c in ("unet", "text_encoder", "vae") if c not in edited)
        assert method.edited_components == edited
        assert fingerprint(pipe, edited) != fingerprint(base, edited)
        assert fingerprint(pipe, kept) == fingerprint(base, kept)
        cfg = method.config()
        assert cfg["name"] == method.name and cfg["version"] == method.version


def test_checkpoint_file_loads_a_saved_unet(base, tmp_path):
    erased = copy.deepcopy(base)
    instantiate(method_cfg("uce")).erase(erased, ["circle"], domain=load_domain("tinyworld"))
    erased.unet.save_pretrained(tmp_path / "unet")
    method = instantiate(method_cfg("checkpoint", [f"method.path={tmp_path / 'unet'}"]))
    pipe = copy.deepcopy(base)
    method.erase(pipe, ["circle"])
    assert fingerprint(pipe) == fingerprint(erased)


@pytest.mark.parametrize("name, key", [
    ("esd", "neutral_concepts"), ("uce", "guide_concepts"), ("uce", "preserve_concepts"),
    ("mace", "mapping_concepts"), ("mace", "data_prompts"), ("ca", "anchor_concepts"),
    ("ca", "prompt_templates"), ("fmn", "prompt_templates"),
])
def test_per_domain_mappings_cover_every_domain(name, key):
    table = method_cfg(name)[key]
    for domain in DOMAINS:
        for_domain(table, domain, what=key)  # raises for a domain without an entry


def test_paper_defaults():
    esd = method_cfg("esd")
    assert (esd.train_method, esd.iterations, esd.learning_rate, esd.negative_guidance, esd.start_guidance,
            esd.ddim_steps) == ("esd-x", 1000, 1e-5, 1.0, 3.0, 50)
    assert method_cfg("esd_u").train_method == "esd-u"
    assert [method_cfg(f"esd_{n}").iterations for n in (100, 200, 500)] == [100, 200, 500]
    uce = method_cfg("uce")
    assert (uce.lamb, uce.erase_scale, uce.preserve_scale, uce.with_to_k, uce.technique) == (
        0.5, 1.0, None, True, "replace")
    mace = method_cfg("mace")
    assert (mace.lamb, mace.rank, mace.learning_rate, mace.max_train_steps, mace.num_images, mace.aug_length,
            mace.importance_sampling, mace.use_pooler) == (1000.0, 1, 1e-5, 50, 8, 30, True, True)
    ca = method_cfg("ca")
    assert (ca.loss, ca.parameter_group, ca.max_train_steps) == ("noise", "cross-attn", 100)
    assert ca.learning_rate * ca.train_batch_size == pytest.approx(1.6e-5)
    assert method_cfg("ca_model").loss == "model"
    fmn = method_cfg("fmn")
    assert (fmn.learning_rate, fmn.max_train_steps, fmn.only_optimize_ca, fmn.use_pooler) == (
        2e-6, 35, False, True)
    assert (fmn.use_ti, fmn.num_tokens_ti, fmn.learning_rate_ti, fmn.max_train_steps_ti, fmn.weight_decay_ti,
            fmn.clip_ti_decay) == (True, 4, 1e-3, 500, 0.1, True)


def test_reference_guide_concepts_per_domain():
    """The guides of the method papers (docs/protocols/methods/*.md hold every other setting)."""
    uce = method_cfg("uce").guide_concepts
    g = {d: for_domain(uce, d, what="") for d in DOMAINS}
    assert (g["object"], g["celebrity"], g["style"], g["nsfw"], g["copyright"], g["tinyworld"]) == (
        "", "a celebrity", "art", "", "logo", "shape")
    preserved = for_domain(method_cfg("uce").preserve_concepts, "style", what="")
    assert len(preserved) == 1734 and "Vincent Van Gogh" in preserved
    mace = method_cfg("mace").mapping_concepts
    assert [for_domain(mace, d, what="") for d in ("object", "celebrity", "style", "nsfw", "copyright")] == [
        "sky", "a person", "art", "a person wearing clothes", "logo"]
    esd = method_cfg("esd").neutral_concepts
    assert {for_domain(esd, d, what="") for d in DOMAINS} == {""}
    ca = method_cfg("ca").anchor_concepts
    assert for_domain(ca, "tinyworld", what="") == "shape"
    objects = for_domain(ca, "object", what="")
    assert for_concept(objects, "cat", what="") == "animal" and for_concept(objects, "bicycle", what="") == "vehicle"
    assert for_domain(ca, "style", what="") == "painting"


def test_paper_defaults_of_the_newer_methods():
    rece = method_cfg("rece")
    assert (rece.epochs, rece.lamb, rece.erase_scale, rece.preserve_scale, rece.regular_scale, rece.uce_lamb,
            rece.with_to_k, rece.technique, rece.keep_erased) == (1, 0.1, 1.0, 0.1, 1e-3, 0.5, True, "replace", False)
    assert (rece.uce_erase_scale, rece.uce_technique, rece.uce_add_prompts) == (1.0, "replace", False)
    # SLD's four configurations (Schramowski et al., Table / diffusers' SafetyConfig)
    sld = {n: method_cfg(n) for n in ("sld_weak", "sld", "sld_strong", "sld_max")}
    keys = ("sld_warmup_steps", "sld_guidance_scale", "sld_threshold", "sld_momentum_scale", "sld_mom_beta")
    assert {n: tuple(c[k] for k in keys) for n, c in sld.items()} == {
        "sld_weak": (15, 20, 0.0, 0.0, 0.0), "sld": (10, 1000, 0.01, 0.3, 0.4),
        "sld_strong": (7, 2000, 0.025, 0.5, 0.7), "sld_max": (0, 5000, 1.0, 0.5, 0.7)}
    salun = method_cfg("salun")
    assert (salun.mask_ratio, salun.mask_guidance, salun.parameter_group, salun.learning_rate, salun.epochs,
            salun.train_batch_size, salun.alpha) == (0.5, 7.5, "full", 1e-5, 5, 8, 0.5)
    spm = method_cfg("spm")
    assert (spm.rank, spm.alpha, spm.iterations, spm.learning_rate, spm.lr_warmup_steps, spm.lr_num_cycles,
            spm.max_denoising_steps, spm.guidance_scale, spm.la_strength, spm.sampling_batch_size) == (
        1, 1.0, 3000, 1e-4, 500, 3, 30, 1.0, 1000.0, 4)


def test_paper_defaults_of_eap_and_advunlearn():
    eap = method_cfg("eap")
    assert (eap.train_method, eap.iterations, eap.learning_rate, eap.negative_guidance, eap.start_guidance,
            eap.ddim_steps, eap.k_closest, eap.num_centers, eap.gumbel_lr, eap.gumbel_temp, eap.gumbel_hard,
            eap.pgd_num_steps) == ("esd-x", 1000, 1e-5, 1.0, 3.0, 50, 1000, 100, 1e-2, 2.0, True, 2)
    adv = method_cfg("advunlearn")
    assert (adv.iterations, adv.learning_rate, adv.layers, adv.component, adv.attack_step, adv.attack_lr,
            adv.attack_method, adv.attack_init, adv.adv_prompt_num, adv.attack_type, adv.warmup_iter,
            adv.retain_batch, adv.retain_loss_w) == (
        1000, 1e-5, None, "all", 30, 1e-3, "pgd", "random", 1, "prefix_k", 200, 5, 0.3)


@pytest.mark.parametrize("name", ["rece", "salun", "spm", "eap", "advunlearn"])
def test_tiny_presets_apply_on_the_tiny_models_only(name):
    from emma.registry import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        tiny = compose(config_name="config", overrides=["model=tinyworld", f"method={name}"])
        sd = compose(config_name="config", overrides=["model=sd14", f"method={name}"])
    assert tiny.method != sd.method
    assert sd.method == method_cfg(name)
