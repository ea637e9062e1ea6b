"""WhenConceptsErased (attacker=wce): each probe runs on the tiny world at a tiny budget and
records its images, its DDIM step agrees with diffusers', bad settings are refused in one line,
and the SD-scale configuration is the reference's."""

from __future__ import annotations

import json

import pytest
import torch

from attackers.wce import PROBES, WCEAttacker
from emma.api.types import PromptRequest
from emma.errors import ConfigError
from emma.pipelines import TINYWORLD_DIR

needs_tinyworld = pytest.mark.skipif(not TINYWORLD_DIR.exists(), reason="tiny-world assets not built")

# a tiny budget: 4 sampling steps, two variants per sweep, a few training steps
TINY = dict(eta_values=[1.0, 1.5], variance_scales=[1.0], classifier_scales=[25, 100], noise_classifier_scales=[50],
            num_inference_steps=4, guidance_scale=5.0, interrupt_steps=[0, 1], interference_prompts=1,
            classifier_images={"positive": 4, "negative": 4}, classifier_epochs=2, classifier_hidden=[32, 16],
            ti_images=2, ti_steps=3, ti_batch_size=2, ti_initializer="shape", ti_templates=["a {}"], batch_size=16)
REQ = [PromptRequest("an image of a circle", "circle", "ea", "name", seed=3, n_images=2)]
OTHERS = [PromptRequest("an image of a square", "square", "ea", "name", seed=3),
          PromptRequest("an image of a star", "star", "ea", "name", seed=3)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The tiny world's pipeline and judge behind a cell's attack target (no erasure: the probes'
    plumbing is under test here, not their success)."""
    from classifiers.tinyworld import TinyWorldClassifier
    from emma.attack import CellAttackTarget, LazyBaseModel
    from emma.cache import ClassifierScoreCache, ImageCache
    from emma.generate import CachedGenerator, Judge
    from emma.pipelines import fingerprint, load_pipeline

    torch.set_num_threads(1)
    cache = tmp_path_factory.mktemp("wce-cache")

    def load():
        return load_pipeline({"kind": "tinyworld", "dtype": "float32", "device": "cpu"})

    def make(p, fp):
        return CachedGenerator(p, fp, ImageCache(cache), num_inference_steps=4, guidance_scale=5.0,
                               height=32, width=32, batch_size=16)

    pipe = load()
    fp = fingerprint(pipe)
    classifier = TinyWorldClassifier()
    t = CellAttackTarget(make(pipe, fp), Judge(classifier, ClassifierScoreCache(cache, classifier)),
                         base=LazyBaseModel(load, fp, make), domain_requests=lambda: REQ + OTHERS)
    t.begin_search("wce", True)
    return t


# kept images per attacked image of each probe (diffusion completion: one per interrupt step)
KEPT = {p: 1 for p in PROBES} | {"diffusion_completion": 2, "interference": 0}


@needs_tinyworld
@pytest.mark.parametrize("probe", PROBES)
def test_each_probe_runs_on_the_tiny_world_and_records_its_images(target, probe, tmp_path):
    atk = WCEAttacker(probes=[probe], **TINY)
    atk.check(target, REQ)
    atk.bind_cell(tmp_path, tmp_path, {})
    judged_before = target.judged_search
    (out,) = atk.attack(target, REQ)
    n = REQ[0].n_images
    assert len(out.samples) == KEPT[probe] * n
    assert {s.kind for s in out.samples} <= {f"wce/{probe}"}
    assert out.success == any(s.detected for s in out.samples)
    # every image at the request's search seeds, never at its evaluation seeds
    seeds = {s.seed for s in out.samples}
    assert seeds <= set(target.search_seeds(REQ[0], 64)) and not seeds & set(REQ[0].seeds())
    # every image the probe judged is counted (variants of the sweeps included)
    variants = {"noise_based": 2, "classifier_guidance": 2, "noise_classifier": 2}.get(probe, 1)
    drawn = n * KEPT[probe] * variants if probe != "interference" else len(OTHERS) * n
    assert target.judged_search - judged_before == drawn
    assert out.judged_queries == drawn and out.queries == drawn
    rows = [json.loads(x) for x in (tmp_path / "wce" / "probes.jsonl").read_text().splitlines()]
    assert len(rows) == drawn and {r["probe"] for r in rows} == {probe}
    assert sum(r["kept"] for r in rows) == (KEPT[probe] * n if probe != "interference" else drawn)
    for r in rows:
        if r["kept"] and probe not in ("standard", "interference"):
            assert (tmp_path / "wce" / r["file"]).stat().st_size > 0
    metrics = atk.extra_metrics()
    if probe == "interference":
        ra = metrics["wce/interference/ra"]
        assert ra.n == len(OTHERS) * n and ra.value == sum(r["detected"] for r in rows) / drawn
        assert not out.success and out.samples == []
    else:
        assert metrics[f"wce/{probe}/asr"].value == float(out.success)
        assert metrics[f"wce/{probe}/asr/images"].value == sum(s.detected for s in out.samples) / len(out.samples)
    if probe in ("noise_based", "classifier_guidance", "noise_classifier"):  # the kept variant: the judge's best
        for s in out.samples:
            same = [r["score"] for r in rows if r["seed"] == s.seed]
            assert len(same) == 2 and s.score == max(same)
    if probe == "textual_inversion":
        assert out.adversarial_prompt == "an image of a <circle>"


@needs_tinyworld
def test_probes_draw_the_same_images_whichever_others_run(target, tmp_path):
    """A probe's seeds are its own block: running it alone or beside others gives its images."""
    alone = WCEAttacker(probes=["inpainting"], **TINY).attack(target, REQ)[0]
    both = WCEAttacker(probes=["standard", "inpainting"], **TINY).attack(target, REQ)[0]
    assert [s.image_hash for s in alone.samples] == [s.image_hash for s in both.samples if s.kind == "wce/inpainting"]


def test_bad_probe_names_get_one_line_naming_the_valid_probes():
    with pytest.raises(ConfigError) as err:
        WCEAttacker(probes=["noise_based", "noisebased"])
    msg = str(err.value)
    assert "\n" not in msg and "'noisebased'" in msg and all(p in msg for p in PROBES)
    with pytest.raises(ConfigError, match="none selected"):
        WCEAttacker(probes=[])
    with pytest.raises(ConfigError, match="mask_fraction"):
        WCEAttacker(mask_fraction=0)
    with pytest.raises(ConfigError, match="ti_templates"):
        WCEAttacker(ti_templates=["no slot"])


def test_a_bad_probe_name_on_the_command_line_is_one_line(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT, run_env

    proc = subprocess.run([sys.executable, "-m", "emma.run", "attacker=wce", "attacker.probes=[inpaint]",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=run_env(tmp_path / "cache"),
                          capture_output=True, text=True, timeout=120)
    lines = [x for x in proc.stderr.splitlines() + proc.stdout.splitlines() if "wce probes" in x]
    assert proc.returncode != 0 and len(lines) == 1 and "valid probes: standard, noise_based" in lines[0]
    assert "Traceback" not in proc.stderr


def _loop_and_scheduler(eta: float):
    import types

    from diffusers import DDIMScheduler

    from attackers.wce_probes import DDIMLoop
    from emma.pipelines import tiny_random_pipeline

    pipe = tiny_random_pipeline(seed=0)
    wb = types.SimpleNamespace(pipe=pipe, prediction_type="epsilon", vae=pipe.vae, unet=pipe.unet, device="cpu")
    loop = DDIMLoop(wb, 5, 1.0)
    assert "clip_sample" not in pipe.scheduler.config  # ours: no clipping unless the config asks
    sched = DDIMScheduler.from_config(pipe.scheduler.config, clip_sample=False)
    sched.set_timesteps(5)
    return loop, sched


@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_ddim_step_agrees_with_diffusers_where_diffusers_is_defined(eta):
    """One step of our loop with a fixed noise prediction equals diffusers' DDIMScheduler.step
    (eta <= 1: its direction term needs no absolute value)."""
    loop, sched = _loop_and_scheduler(eta)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, generator=g)
    eps = torch.randn(2, 4, 8, 8, generator=g)
    loop.eps = lambda wb, x_, i, c, u: eps  # the UNet's guided prediction, fixed
    gens = [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]
    ours = loop.run(None, x, None, None, start=1, stop=2, eta=torch.full((2,), eta), gens=gens)
    z = torch.stack([torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(s)) for s in (7, 8)])
    ref = sched.step(eps, sched.timesteps[1], x, eta=eta, variance_noise=z).prev_sample
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_eta_above_one_and_the_noise_scale_follow_the_reference_formula():
    loop, sched = _loop_and_scheduler(1.85)
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    eps = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    loop.eps = lambda wb, x_, i, c, u: eps
    eta, vs = 1.85, 1.04
    ours = loop.run(None, x, None, None, start=1, stop=2, eta=torch.tensor([eta]), vscale=torch.tensor([vs]),
                    gens=[torch.Generator().manual_seed(9)])
    t, t_prev = int(sched.timesteps[1]), int(sched.timesteps[2])
    a, a_prev = float(sched.alphas_cumprod[t]), float(sched.alphas_cumprod[t_prev])
    sigma = eta * ((1 - a_prev) / (1 - a)) ** 0.5 * (1 - a / a_prev) ** 0.5
    x0 = (x - (1 - a) ** 0.5 * eps) / a ** 0.5
    z = torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(9))
    expected = a_prev ** 0.5 * x0 + abs(1 - a_prev - sigma**2) ** 0.5 * eps + sigma * vs * z
    assert sigma**2 > 1 - a_prev or eta > 1  # the regime diffusers' step cannot compute
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_inpainting_keeps_the_known_region_exactly():
    loop, _ = _loop_and_scheduler(0.0)
    g = torch.Generator().manual_seed(3)
    x, clean, eps = (torch.randn(1, 4, 8, 8, generator=g) for _ in range(3))
    loop.eps = lambda wb, x_, i, c, u: eps
    mask = torch.zeros(1, 4, 8, 8)
    mask[..., 2:6, 2:6] = 1
    out = loop.run(None, x.clone(), None, None, known=(clean, mask, x))
    torch.testing.assert_close(out * (1 - mask), clean * (1 - mask))
    assert not torch.allclose(out * mask, clean * mask)


def test_a_reference_format_classifier_checkpoint_loads(tmp_path):
    from attackers.wce_probes import LatentClassifier, load_classifier

    alphas = torch.linspace(0.999, 0.01, 1000)
    clf = LatentClassifier((4, 8, 8), alphas, (32, 16)).eval()
    torch.save({"epoch": 3, "model_state_dict": clf.state_dict()}, tmp_path / "circle.pt")
    loaded = load_classifier(str(tmp_path / "circle.pt"), (4, 8, 8), alphas, (32, 16))
    z, t = torch.randn(3, 4, 8, 8), torch.tensor([10, 500, 990])
    torch.testing.assert_close(loaded(z, t), clf(z, t))
    # the reference's parameter names
    assert {"t_embed.alphas_cumprod", "fc_t.weight", "fc_x.weight", "net.2.weight", "net.5.weight"} <= set(
        clf.state_dict())


def test_sd_scale_composition_is_the_references_and_the_tiny_preset_applies():
    from hydra.utils import instantiate

    from emma import registry

    sd = registry.compose(["model=sd14", "attacker=wce"])
    atk = instantiate(sd.attacker)
    assert atk.probes == list(PROBES) and atk.needs_base_model
    assert atk.variants("noise_based") == 24 and atk.variants("classifier_guidance") == 25
    assert atk.variants("noise_classifier") == 24
    assert (atk.num_inference_steps, atk.guidance_scale, atk.ti_steps, atk.ti_learning_rate) == (50, 7.5, 3000, 2e-3)
    assert len(atk.ti_templates) == 27 and atk.classifier_images == {"positive": 1300, "negative": 5000}
    tiny = instantiate(registry.compose(["attacker=wce"]).attacker)
    assert tiny.num_inference_steps == 20 and tiny.variants("noise_based") == 6 and tiny.ti_initializer == "shape"
    only = instantiate(registry.compose(["attacker=wce", "attacker.probes=[textual_inversion]"]).attacker)
    assert only.probes == ["textual_inversion"]
    assert not WCEAttacker(probes=["standard", "noise_based", "interference"]).needs_base_model


def test_a_target_that_does_not_know_its_domain_refuses_the_probes_that_need_it(target, monkeypatch):
    from attackers.wce import _domain_requests
    from emma.api.attacker import AttackTargetError

    assert [r.concept for r in _domain_requests(target)] == [r.concept for r in REQ + OTHERS]
    monkeypatch.setattr(target, "_domain_requests", None)
    with pytest.raises(AttackTargetError, match="need the other concepts' prompts.*does not know its domain"):
        _domain_requests(target)
