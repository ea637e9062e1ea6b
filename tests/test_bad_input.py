"""Bad input: every case exits with code 2 (130 for Ctrl-C) and a message of a few lines that
names the offending key and what is valid, never a traceback, and loses no cached or earlier
result. Most cases run the CLI's own pre-flight (``emma.run.preflight``, what
``python -m emma.run`` does before Hydra starts) and the suites/weights CLIs' ``main`` in
process; a handful run the real command in a subprocess.

The five classes (issue "Bad input and damaged caches"):
1. damaged caches — tests/test_cache_heal.py;
2. impossible numbers (NaN weights and probabilities, thresholds, counts);
3. empty or unknown values that used to become something else;
4. settings that failed only after the expensive work;
5. sweeps and outputs that lost work.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from emma import suites, weights
from emma.errors import ConfigError, EmmaError, NonFiniteError
from emma.run import preflight
from tests.conftest import ROOT, ProgressReader, run_env

TINY = ["model=tiny_random", "classifier=tinyworld", "classifier.weights=null", "metrics=rates_only"]


def _snapshot(*roots: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def precious(tmp_path_factory):
    """A cache and an earlier run's results that no refused command may touch."""
    root = tmp_path_factory.mktemp("precious")
    cache, run = root / "cache", root / "earlier_run"
    (cache / "images" / "ab").mkdir(parents=True)
    (cache / "images" / "ab" / "entry.png").write_bytes(b"\x89PNG earlier image")
    (cache / "erased" / "k").mkdir(parents=True)
    (cache / "erased" / "k" / "manifest.json").write_text('{"key": "k"}')
    run.mkdir()
    (run / "results.json").write_text('{"schema_version": 1, "metrics": {"ea/name": 0.5}}')
    return cache, run


def _check_message(err: str, expected: list[str], max_lines: int) -> None:
    assert err.startswith("error: "), err
    assert "Traceback" not in err and 'File "' not in err, err
    lines = err.strip().splitlines()
    assert len(lines) <= max_lines, err
    for text in expected:
        assert text in err, f"{text!r} not in:\n{err}"
    assert "+images_per_promt" not in err and "To append to your config use" not in err


# (case id, argv, texts the message must contain, problems reported)
CELL_CASES = [
    # class 3: empty or unknown values no longer become something else
    ("concept-empty", ["concept="], ["concept=''", "null for the domain's default"], 1),
    ("concept-unknown", ["concept=hexagon"], ["unknown concept 'hexagon'", "Available: circle, crescent"], 1),
    ("concept-other-domain", ["domain=tinyworld_style", "concept=circle"],
     ["unknown concept 'circle' in domain 'tinyworld_style'", "Available:"], 1),
    ("ipp-zero", ["images_per_prompt=0"], ["images_per_prompt=0", "[1, 10,000]", "null (the domain's default)"], 1),
    ("types-empty", ["prompt_types=[]"], ["prompt_types=[]", "non-empty list of name, prefix"], 1),
    ("types-misspelt", ["prompt_types=[name,prefx]"], ["prompt_types=[name,prefx]", "'prefx'",
                                                       "did you mean 'prefix'", "valid: name, prefix"], 1),
    ("types-twice", ["prompt_types=[name,name]"], ["prompt_types=[name,name]", "name listed twice"], 1),
    ("types-unknown", ["prompt_types=[names]"], ["'names'", "did you mean 'name'"], 1),
    ("bias-attribute", ["metrics.bias.attributes=[age]"], ["metrics.bias.attributes=[age]",
                                                           "valid: colour, gender, ethnicity"], 1),
    ("bias-attributes-empty", ["metrics.bias.attributes=[]"], ["metrics.bias.attributes=[]", "non-empty"], 1),
    ("fid-reference-empty", ["metrics.fid.reference="], ["metrics.fid.reference=''", "non-empty"], 1),
    ("cache-dir-empty", ["paths.cache_dir="], ["paths.cache_dir=''", "EMMA_CACHE"], 1),
    ("dtype", ["model.dtype=float64"], ["model.dtype=float64", "valid: float32, float16, bfloat16"], 1),
    ("device", ["model.device=gpu"], ["model.device=gpu", "cpu, cuda, cuda:N or mps"], 1),
    ("scheduler", ["model.scheduler=Euler"], ["model.scheduler=Euler", "EulerDiscreteScheduler"], 1),
    ("model-kind", ["model.kind=onnx"], ["model.kind=onnx", "valid: diffusers, tinyworld, tiny_random"], 1),
    ("pretrained-empty", ["model=sd14", "model.pretrained=", "model.device=cpu"],
     ["model.pretrained=''", "hub id or a local folder"], 1),
    # attack protocols (emma.protocol): an unknown choice, key or value
    ("protocol-unknown", ["protocol=refrence"], ["unknown protocol 'refrence'", "Did you mean 'reference'"], 1),
    ("protocol-key", ["protocol.image_per_prompt=3"], ["protocol.image_per_prompt=3",
                                                       "did you mean 'images_per_prompt'"], 1),
    ("protocol-seeds", ["protocol.search_seeds=same"], ["protocol.search_seeds 'same'", "disjoint, shared"], 1),
    ("protocol-images", ["protocol.images_per_prompt=0"], ["protocol.images_per_prompt=0",
                                                           "an integer in [1, 10,000]"], 1),
    # class 2: impossible numbers
    ("ipp-negative", ["images_per_prompt=-3"], ["images_per_prompt=-3", "[1, 10,000]"], 1),
    ("ipp-huge", ["images_per_prompt=1000000000"], ["images_per_prompt=1000000000", "[1, 10,000]"], 1),
    ("ipp-text", ["images_per_prompt=abc"], ["images_per_prompt=abc", "Integer"], 1),
    ("ipp-float", ["images_per_prompt=2.5"], ["images_per_prompt=2.5"], 1),
    ("seed-negative", ["seed=-1"], ["seed=-1", "[0, 2,147,483,647]"], 1),
    ("seed-huge", ["seed=4294967296"], ["seed=4294967296", "[0, 2,147,483,647]"], 1),
    # torch's CPU generator keeps a seed's low 32 bits: erasure's generators, seeded with the cell
    # seed (plus offsets), would wrap around to those of seeds 0, 1, ...
    ("seed-derived-wraps", ["seed=4294967290"], ["seed=4294967290", "[0, 2,147,483,647]", "low 32 bits",
                                                 "below 2**32"], 1),
    ("attacker-seed-float", ["attacker=p4d_n", "attacker.seed=2.5"], ["attacker.seed=2.5",
                                                                      "integer in [0, 2,147,483,647]"], 1),
    ("threads-zero", ["threads=0"], ["threads=0", "[1, 1,024] or null (torch's default)"], 1),
    ("threads-negative", ["threads=-1"], ["threads=-1", "[1, 1,024]"], 1),
    ("threads-huge", ["threads=100000"], ["threads=100000", "[1, 1,024]"], 1),
    ("guidance-negative", ["model.guidance_scale=-1"], ["model.guidance_scale=-1", "[0.0, 100.0]"], 1),
    ("guidance-nan", ["model.guidance_scale=nan"], ["model.guidance_scale=nan", "finite"], 1),
    ("threshold-high", ["classifier=tinyworld", "classifier.threshold=1.5"],
     ["classifier.threshold=1.5", "[0.0, 1.0]"], 1),
    ("threshold-negative-auto", ["+classifier.threshold=-0.2"],
     ["classifier.threshold=-0.2", "[0.0, 1.0]", "judge 'tinyworld'"], 1),
    ("threshold-nan", ["classifier=tinyworld", "classifier.threshold=nan"], ["classifier.threshold=nan", "finite"], 1),
    ("judge-batch", ["classifier=tinyworld", "classifier.batch_size=0"], ["classifier.batch_size=0", "[1,"], 1),
    ("lr-negative", ["method=esd", "method.learning_rate=-1e-5"], ["method.learning_rate=-1e-05", "(0.0, inf)"], 1),
    ("lr-inf", ["method=esd", "method.learning_rate=inf"], ["method.learning_rate=inf", "finite"], 1),
    ("iterations-zero", ["method=esd", "method.iterations=0"], ["method.iterations=0", "[1,"], 1),
    ("uce-lamb", ["method=uce", "method.lamb=-0.5"], ["method.lamb=-0.5", "[0.0, inf)"], 1),
    ("fid-n-ref", ["metrics.fid.n_ref=1"], ["metrics.fid.n_ref=1", "a covariance needs 2"], 1),
    ("bias-ipp", ["metrics.bias.images_per_prompt=0"], ["metrics.bias.images_per_prompt=0", "[1, 1,000]"], 1),
    ("bias-resamples", ["metrics.bias.n_resamples=0"], ["metrics.bias.n_resamples=0"], 1),
    ("init-seed", ["model=tiny_random", "model.init_seed=-1"], ["model.init_seed=-1"], 1),
    # class 4: sampler settings the model cannot honour, caught before it loads
    ("batch-zero", ["model.batch_size=0"], ["model.batch_size=0", "[1, 4,096]"], 1),
    ("steps-zero", ["model.num_inference_steps=0"], ["model.num_inference_steps=0", "[1, 1,000]"], 1),
    ("steps-huge", ["model.num_inference_steps=5000"], ["model.num_inference_steps=5000", "[1, 1,000]"], 1),
    ("height-odd", ["model.height=33"], ["model.height=33", "multiple of 8"], 1),
    ("width-zero", ["model.width=0"], ["model.width=0", "multiple of 8"], 1),
    ("checkpoint-no-path", ["method=checkpoint"], ["method=checkpoint needs method.path=", ".safetensors"], 1),
    ("cache-not-writable", ["paths.cache_dir=/dev/null/cache"], ["paths.cache_dir=/dev/null/cache",
                                                                 "cannot write there"], 1),
    ("all-at-once", ["model.batch_size=0", "model.num_inference_steps=0", "images_per_prompt=-3", "concept="],
     ["4 invalid settings", "model.batch_size=0", "model.num_inference_steps=0", "images_per_prompt=-3",
      "concept=''"], 4),
    # Hydra's own errors: short, exit 2, "did you mean" over the node's keys (not +key advice)
    ("key-misspelt", ["images_per_promt=2"], ["images_per_promt=2", "did you mean 'images_per_prompt'",
                                              "valid keys at the top level"], 1),
    ("method-key-misspelt", ["method=esd", "method.iteratons=5"], ["method.iteratons=5",
                                                                    "did you mean 'iterations'"], 1),
    ("method-key-added", ["method=esd", "+method.iteratons=5"], ["method.iteratons=5", "did you mean 'iterations'",
                                                                  "valid keys: train_method, iterations"], 1),
    # +key / ++key adds a key only where the component takes it: a misspelling is refused as without +
    ("plus-key-misspelt", ["+images_per_promt=5"], ["images_per_promt=5", "did you mean 'images_per_prompt'",
                                                    "leading '+'", "valid keys at the top level: attacker,"], 1),
    ("plusplus-key-misspelt", ["++images_per_promt=5"], ["images_per_promt=5", "did you mean 'images_per_prompt'"], 1),
    ("plus-model-key", ["+model.guidance_scal=50"], ["model.guidance_scal=50", "did you mean 'guidance_scale'",
                                                     "valid keys at 'model': batch_size,"], 1),
    ("plus-metrics-key", ["+metrics.fid.nref=3"], ["metrics.fid.nref=3", "did you mean 'n_ref'",
                                                   "valid keys at 'metrics.fid'"], 1),
    ("plus-domain-key", ["+domain.n_randm=3"], ["domain.n_randm=3", "did you mean 'n_random'",
                                                "unknown key of domain (tinyworld_domain)"], 1),
    ("plus-auto-judge-key", ["domain=object", "+classifier.thresold=0.6"],
     ["classifier.thresold=0.6", "did you mean 'threshold'", "valid keys: weights, threshold",
      "judge 'ml_decoder' of domain 'object'"], 1),
    ("plus-key-that-exists", ["+threads=2"], ["+threads=2: threads is already a setting",
                                              "without the '+': threads=2"], 1),
    # a key given twice: Hydra would keep the last silently
    ("repeated", ["concept=circle", "concept=star"], ["concept is given 2 times (concept=circle, concept=star)",
                                                      "give it once"], 1),
    ("repeated-group", ["method=esd", "images_per_prompt=2", "method=uce"],
     ["method is given 2 times (method=esd, method=uce)"], 1),
    ("method-none-key", ["method.iterations=5"], ["method.iterations=5", "takes no settings"], 1),
    ("model-key-misspelt", ["model.batchsize=4"], ["model.batchsize=4", "did you mean 'batch_size'"], 1),
    ("metrics-key-misspelt", ["metrics.fid.nref=3"], ["metrics.fid.nref=3", "did you mean 'n_ref'"], 1),
    ("attacker-key-misspelt", ["attacker.kindz=[name]"], ["attacker.kindz=[name]", "did you mean 'kinds'"], 1),
    ("group-not-axis", ["+preset=esd_tiny"], ["+preset=esd_tiny", "'preset' is not an axis", "axes: model, method"], 1),
    ("override-parse", ["concept=[a"], ["concept=[a", "does not parse"], 1),
    ("overwrite-not-bool", ["overwrite=maybe"], ["overwrite=maybe"], 1),
    ("method-choice", ["method=esdd"],
     ["unknown method 'esdd'. Did you mean 'esd'", "Available: ", " ca, ca_model, checkpoint,"], 1),
    ("domain-choice", ["domain=tinyworl"], ["unknown domain 'tinyworl'", "Available:"], 1),
    ("model-choice", ["model=sd15"], ["unknown model 'sd15'", "Available:"], 1),
    ("choice-and-value", ["method=esdd", "images_per_prompt=0"], ["2 invalid settings", "unknown method 'esdd'",
                                                                  "images_per_prompt=0"], 2),
    # class 5: a sweep with one invalid cell is refused before any job starts, naming the cell
    ("sweep-concept", ["-m", "concept=circle,hexagon,square"],
     ["cell #1 (concept=hexagon)", "unknown concept 'hexagon'", "1 of 3 cells; no job was started"], 1),
    ("sweep-two-axes", ["-m", "concept=circle,star", "images_per_prompt=0,2"],
     ["2 of 4 cells", "images_per_prompt=0", "concept=circle", "concept=star"], 3),
    ("sweep-choice", ["-m", "method=none,esdd"], ["unknown method 'esdd'"], 1),
    ("sweep-range", ["-m", "seed=range(-2,1)"], ["seed=-2", "seed=-1", "2 of 3 cells"], 3),
    ("sweep-plus-key", ["-m", "concept=circle,star", "+images_per_promt=5"],
     ["2 of 2 cells; no job was started", "cell #0 (concept=circle): images_per_promt=5",
      "cell #1 (concept=star): images_per_promt=5", "did you mean 'images_per_prompt'"], 3),
    ("sweep-repeated", ["-m", "concept=circle,star", "concept=square"],
     ["concept is given 2 times (concept=circle,star, concept=square)", "-m concept=a,b"], 1),
    ("sweep-threads", ["-m", "threads=0,2"],
     ["cell #0 (threads=0)", "threads=0: must be an integer", "1 of 2 cells"], 2),
]


@pytest.mark.parametrize("argv, expected, problems", [c[1:] for c in CELL_CASES], ids=[c[0] for c in CELL_CASES])
def test_bad_cell_setting_is_refused_before_work(argv, expected, problems, precious, capsys, monkeypatch):
    cache, run = precious
    monkeypatch.setenv("EMMA_CACHE", str(cache))
    before = _snapshot(cache, run)
    code = preflight([*argv, f"hydra.run.dir={run}"])
    err = capsys.readouterr().err
    assert code == 2, err
    _check_message(err, expected, max_lines=1 + problems)
    assert _snapshot(cache, run) == before


@pytest.mark.parametrize("argv", [
    ["concept=star"], ["images_per_prompt=null"], ["prompt_types=[name,random]"], ["-m", "concept=circle,star"],
    ["method=esd", "method.iterations=5"], ["+classifier.threshold=0.6"], ["overwrite=true"],
    ["threads=4"], ["threads=null"], ["seed=2147483647"], ["++seed=3"], ["++model.guidance_scale=3"],
    ["+hydra.job.env_set.EMMA_X=1"], ["-m", "concept=circle,star", "seed=0,1"],
    # a mapping argument of a component is free-form; a **kwargs constructor takes any key
    ["attacker=stace", "+attacker.roles.critic={temperature: 0.2}"],
    ["+metrics.bias.similarity.embedding.device=cpu"],
])
def test_valid_settings_pass_the_preflight(argv, capsys):
    assert preflight(argv) == 0, capsys.readouterr().err


def test_an_experiments_own_sweep_is_checked_cell_by_cell(capsys, monkeypatch):
    """The sweep an experiment file declares (hydra.sweeper.params) is expanded by the preflight
    like a command-line sweep: every cell is composed and checked before any job starts."""
    from omegaconf import OmegaConf

    from emma import validate

    params = OmegaConf.load(ROOT / "conf" / "experiment" / "tinyworld_full.yaml").hydra.sweeper.params
    expected = 1
    for v in params.values():
        expected *= len(str(v).split(","))
    cells = validate.cell_overrides(["experiment=tinyworld_full"], True)
    assert len(cells) == expected == 85
    assert ["method=uce", "attacker=p4d_n", "concept=circle", "experiment=tinyworld_full"] in cells
    # the command line wins over the experiment's sweep for the keys it sets
    assert len(validate.cell_overrides(["experiment=tinyworld_full", "method=uce"], True)) == 5

    real = validate.sweeper_params
    monkeypatch.setattr(validate, "sweeper_params",  # an experiment whose concept list has a typo
                        lambda ov, name="config": [o.replace("concept=circle", "concept=circle,hexagn")
                                                  for o in real(ov, name)])
    assert preflight(["-m", "experiment=tinyworld_full", "method=uce", "attacker=static"]) == 2
    err = capsys.readouterr().err
    assert "1 of 2 cells; no job was started" in err and "hexagn" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_device_without_cuda(capsys):
    assert preflight(["model.device=cuda"]) == 2
    _check_message(capsys.readouterr().err, ["model.device=cuda", "use model.device=cpu"], 2)


# --------------------------------------------------------------------------- suites / weights CLIs
SUITES_CASES = [
    (["frob"], ["unknown command 'frob'", "Available: counts, defects, download, list, show"]),
    (["show"], ["needs domain=<name>", "python -m emma.suites list"]),
    (["show", "domain"], ["expected key=value", "domain=object"]),
    (["show", "domain=objekt"], ["unknown domain 'objekt'. Did you mean 'object'"]),
    (["show", "domain=tinyworld", "concept=hexagon"], ["unknown concept 'hexagon'", "Available: circle"]),
    (["show", "domain=tinyworld", "concept="], ["unknown concept ''", "concept= is empty", "Available: circle"]),
    (["show", "domain=tinyworld", "kind=prefx"], ["'prefx'. Did you mean 'prefix'", "Available:"]),
    (["show", "domain=object", "suite.sourc=x"], ["suite.sourc=x", "did you mean 'source'", "valid keys at 'suite'"]),
    (["counts", "domain=tinyworld", "n_randm=3"], ["n_randm=3", "did you mean 'n_random'"]),
    (["counts", "domain=tinyworld", "images_per_prompt=abc"], ["images_per_prompt=abc", "invalid literal"]),
    (["download", "set=nope"], ["unknown prompt set 'nope'", "Available: ", "coco_30k", "en3k"]),
]


@pytest.mark.parametrize("argv, expected", SUITES_CASES, ids=[" ".join(c[0]) for c in SUITES_CASES])
def test_suites_cli_bad_input(argv, expected, precious, capsys, monkeypatch):
    cache, run = precious
    monkeypatch.setenv("EMMA_CACHE", str(cache))
    before = _snapshot(cache, run)
    assert suites.main(argv) == 2
    _check_message(capsys.readouterr().err, expected, max_lines=3)
    assert _snapshot(cache, run) == before


WEIGHTS_CASES = [
    (["fetch", "nosuch"], ["unknown weights entry 'nosuch'", "Available: clip_vit_b32_openai"]),
    (["path", "nudenet"], ["unknown weights entry 'nudenet'", "Did you mean 'nudenet_320n'"]),
    (["verify", "inception"], ["unknown weights entry 'inception'", "Available:"]),
    (["frob"], ["invalid choice: 'frob'", "'list', 'verify', 'fetch', 'path'"]),
    (["fetch"], ["the following arguments are required: names"]),
]


@pytest.mark.parametrize("argv, expected", WEIGHTS_CASES, ids=[" ".join(c[0]) for c in WEIGHTS_CASES])
def test_weights_cli_bad_input(argv, expected, precious, capsys, monkeypatch):
    cache, run = precious
    monkeypatch.setenv("EMMA_CACHE", str(cache))
    before = _snapshot(cache, run)
    try:
        code = weights.main(argv)
    except SystemExit as exc:  # argparse's own errors: usage + one line, exit 2
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    if not err.startswith("usage:"):
        _check_message(err, expected, max_lines=2)
    else:
        assert all(t in err for t in expected) and "Traceback" not in err and len(err.splitlines()) <= 3
    assert _snapshot(cache, run) == before


# --------------------------------------------------------------------------- class 2: never a believable wrong number
def _nan_unet_folder(tmp_path: Path) -> Path:
    from diffusers import UNet2DConditionModel

    from emma.tinyworld import arch

    unet = UNet2DConditionModel(**arch.TINY_RANDOM_UNET)
    with torch.no_grad():
        next(iter(unet.parameters())).fill_(float("nan"))
    unet.save_pretrained(tmp_path / "nan_unet")
    return tmp_path / "nan_unet"


def test_nan_checkpoint_is_rejected_not_read_as_erasure(tmp_path):
    from emma.methods.checkpoint import CheckpointMethod, IncompatibleCheckpointError
    from emma.pipelines import tiny_random_pipeline

    pipe = tiny_random_pipeline(seed=0)
    before = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    with pytest.raises(IncompatibleCheckpointError, match=r"holds NaN/inf in 1 unet weight"):
        CheckpointMethod(str(_nan_unet_folder(tmp_path))).erase(pipe, ["circle"])
    assert all(torch.equal(v, pipe.unet.state_dict()[k]) for k, v in before.items())  # untouched


def test_a_method_that_diverges_to_nan_stores_nothing(tmp_path):
    from emma.api.method import ErasureMethod
    from emma.erase import erase_cached
    from emma.pipelines import fingerprint, tiny_random_pipeline

    class DivergingMethod(ErasureMethod):
        name, version, edited_components = "diverging", "1", ("unet",)

        def erase(self, pipe, concepts, *, seed=0, domain=None):
            with torch.no_grad():
                next(iter(pipe.unet.parameters())).add_(float("inf"))
            return pipe

    pipe = tiny_random_pipeline(seed=0)
    with pytest.raises(NonFiniteError, match="method 'diverging' gave unet weights with NaN/inf"):
        erase_cached(pipe, DivergingMethod(), ["circle"], tmp_path, base_fingerprint=fingerprint(pipe))
    assert not [p for p in (tmp_path / "erased").iterdir() if not p.name.startswith(".")]  # the erase lock may stay


def test_nan_images_stop_the_cell_and_are_not_cached(tmp_path):
    from emma.cache import ImageCache
    from emma.generate import CachedGenerator
    from emma.pipelines import tiny_random_pipeline

    pipe = tiny_random_pipeline(seed=0)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        pipe.vae.decoder.conv_out.bias.fill_(float("nan"))
    gen = CachedGenerator(pipe, "fp", ImageCache(tmp_path), num_inference_steps=2, guidance_scale=5.0,
                          height=32, width=32)
    with pytest.raises(NonFiniteError, match=r"NaN/inf pixels in 2 of 2 images \(prompt 'a circle', seed 0\)"):
        gen.generate(["a circle", "a star"], [0, 1])
    assert not list((tmp_path / "images").rglob("*.png"))


def test_nan_probabilities_stop_the_cell_and_are_not_cached(tmp_path):
    from classifiers.tinyworld import TinyWorldClassifier
    from emma.cache import ScoreCache
    from emma.generate import Judge

    judge_net = TinyWorldClassifier(weights=None)
    with torch.no_grad():
        for p in judge_net.net.parameters():
            p.fill_(float("nan"))
    judge = Judge(judge_net, ScoreCache(tmp_path, judge_net.cache_key()))
    with pytest.raises(NonFiniteError, match="judge 'tinyworld' returned NaN/inf"):
        judge.score(torch.rand(3, 3, 32, 32))
    assert not list(tmp_path.rglob("*.npz"))


@pytest.mark.parametrize("threshold", [1.5, -0.1, float("nan")])
def test_classifier_threshold_outside_unit_interval_is_refused(threshold):
    from classifiers.tinyworld import TinyWorldClassifier

    with pytest.raises(ConfigError, match=r"threshold=.* must be a probability in \[0, 1\]"):
        TinyWorldClassifier(weights=None, threshold=threshold)


def test_domain_requests_no_longer_silently_default():
    from emma.domains import load_domain

    dom = load_domain("tinyworld")
    with pytest.raises(ConfigError, match="images_per_prompt=0: must be at least 1"):
        dom.requests("circle", images_per_prompt=0)
    with pytest.raises(ConfigError, match=r"prompt_types=\[\]"):
        dom.requests("circle", types=[])
    with pytest.raises(EmmaError, match="unknown prompt type of tinyworld/circle 'prefx'. Did you mean 'prefix'"):
        dom.requests("circle", types=["name", "prefx"])
    assert {r.kind for r in dom.requests("circle", types=["name"], images_per_prompt=2)} == {"name"}


# --------------------------------------------------------------------------- real CLI subprocesses
def emma_run(args, cache, timeout=300):
    return subprocess.run([sys.executable, "-m", "emma.run", *args], cwd=ROOT, env=run_env(cache),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, expected", [
    (["images_per_promt=2"], ["images_per_promt=2", "did you mean 'images_per_prompt'"]),
    (["method=checkpoint"], ["method=checkpoint needs method.path="]),
    (["model.batch_size=0", "model.num_inference_steps=0"], ["model.batch_size=0", "model.num_inference_steps=0"]),
    (["+images_per_promt=2"], ["images_per_promt=2", "did you mean 'images_per_prompt'"]),
    (["concept=circle", "concept=star"], ["concept is given 2 times"]),
    (["threads=0"], ["threads=0", "[1, 1,024]"]),
])
def test_cli_exits_2_before_any_work(args, expected, precious):
    cache, run = precious
    before = _snapshot(cache, run)
    proc = emma_run([*TINY, *args, f"hydra.run.dir={run}"], cache)
    assert proc.returncode == 2, proc.stderr[-2000:]
    _check_message(proc.stderr, expected, max_lines=3)
    assert proc.stdout == ""
    assert _snapshot(cache, run) == before  # nothing generated, nothing written


def test_cli_sweep_with_one_bad_cell_starts_no_job(tmp_path):
    sweep = tmp_path / "sweep"
    proc = emma_run(["-m", *TINY, "images_per_prompt=1", "concept=circle,hexagon,square",
                     f"hydra.sweep.dir={sweep}"], tmp_path / "cache")
    assert proc.returncode == 2, proc.stderr[-2000:]
    _check_message(proc.stderr, ["cell #1 (concept=hexagon)", "1 of 3 cells; no job was started"], 2)
    assert not sweep.exists() and not (tmp_path / "cache" / "images").exists()


def test_cli_refuses_a_run_dir_with_results_and_nan_checkpoint(precious, tmp_path):
    cache, run = precious
    before = _snapshot(cache, run)
    proc = emma_run([*TINY, "images_per_prompt=1", f"hydra.run.dir={run}"], cache)
    assert proc.returncode == 2, proc.stderr[-2000:]
    _check_message(proc.stderr, [f"hydra.run.dir={run} already holds results.json", "overwrite=true"], 1)
    assert not (run / ".hydra").exists()  # refused before Hydra wrote anything there
    assert _snapshot(cache, run) == before

    out = tmp_path / "nan_run"
    proc = emma_run([*TINY, "images_per_prompt=1", "prompt_types=[name]", "method=checkpoint",
                     f"method.path={_nan_unet_folder(tmp_path)}", f"hydra.run.dir={out}"], tmp_path / "cache")
    assert proc.returncode == 2, proc.stderr[-2000:]
    _check_message(proc.stderr, ["nan_unet", "holds NaN/inf in 1 unet weight"], 2)
    assert not (out / "results.json").exists()


def test_ctrl_c_keeps_the_cache_and_says_how_to_resume(tmp_path):
    cache = tmp_path / "cache"
    # 13 prompts x 60 images: a quiet machine draws ~55 images/s, and the cache's files appear
    # behind the generator, so 260 images were finished before the interrupt landed
    args = [*TINY, "images_per_prompt=60", "prompt_types=[name,variant,short,random]", "model.batch_size=2"]
    total = 13 * 60
    # The run gets SIGINT's default disposition, as in a terminal: a test run started in the
    # background of a non-interactive shell (CI) inherits SIGINT ignored, and Python keeps it so.
    proc = subprocess.Popen([sys.executable, "-m", "emma.run", *args, f"hydra.run.dir={tmp_path / 'a'}"],
                            cwd=ROOT, env=run_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # interrupt once the progress bar shows 16 images drawn (the cache's files can lag far
    # behind on a quiet machine: one run drew 718 of 780 before 8 files appeared)
    progress = ProgressReader(proc)
    reached = progress.wait_drawn(total, 16)
    os.kill(proc.pid, signal.SIGINT)
    proc.wait(timeout=300)
    err = progress.text()
    assert reached, "the run ended (or timed out) before 16 images were drawn: " + err[-2000:]
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "interrupted" in x]
    assert "kept in the cache" in line and "run the same command again to resume" in line
    assert not (tmp_path / "a" / "results.json").exists()
    kept = len(list(cache.rglob("*.png")))
    assert 0 < kept < total

    resumed = emma_run([*args, f"hydra.run.dir={tmp_path / 'b'}"], cache, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    assert res["counts"]["images_generated"] == total - kept and res["counts"]["cache_repairs"] == 0


def test_overwrite_true_replaces_results(tmp_path):
    from emma.validate import check_output_dir

    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(ConfigError, match="already holds results.json"):
        check_output_dir(tmp_path, overwrite=False)
    check_output_dir(tmp_path, overwrite=True)
    check_output_dir(tmp_path / "fresh", overwrite=False)


def test_explicit_run_or_sweep_dir_with_results_is_refused_before_hydra_starts(precious, tmp_path, capsys):
    cache, run = precious
    before = _snapshot(cache, run)
    assert preflight([f"hydra.run.dir={run}"]) == 2
    _check_message(capsys.readouterr().err, [f"hydra.run.dir={run} already holds results.json",
                                             "add overwrite=true"], 1)
    # a sweep folder is resumed, not refused: each finished cell keeps its results.json
    assert preflight(["-m", "concept=circle,star", f"hydra.sweep.dir={run.parent}"]) == 0
    assert preflight([f"hydra.run.dir={run}", "overwrite=true"]) == 0
    assert preflight([f"hydra.run.dir={tmp_path / 'new'}"]) == 0
    assert _snapshot(cache, run) == before
