"""`python -m emma.run` end to end: choices, results schema, caching, kill and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import ROOT, ProgressReader, run_env

# A plumbing cell: random tiny pipeline, random judge, few images.
TINY = ["model=tiny_random", "classifier=tinyworld", "classifier.weights=null"]


def emma_run(args, cache, timeout=600, **popen):
    return subprocess.run([sys.executable, "-m", "emma.run", *args], cwd=ROOT, env=run_env(cache),
                          capture_output=True, text=True, timeout=timeout, **popen)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("method=nonee", "unknown method 'nonee'. Did you mean 'none'?"),
        ("domain=tinyworl", "unknown domain 'tinyworl'. Did you mean 'tinyworld'"),
        ("attacker=statc", "unknown attacker 'statc'. Did you mean 'static' or 'stace'?"),
        ("model=sd15", "unknown model 'sd15'."),
    ],
)
def test_unknown_group_choice_exits_with_valid_choices(override, expected, tmp_path):
    proc = emma_run([override, *TINY], tmp_path, timeout=120)
    assert proc.returncode == 2
    assert expected in proc.stderr
    group = override.split("=")[0]
    valid = sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))
    assert f"Available: {', '.join(valid)}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_concept_exits_with_valid_concepts(tmp_path):
    proc = emma_run(["concept=circel", *TINY, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "unknown concept 'circel' in domain 'tinyworld'. Did you mean 'circle'" in proc.stderr
    assert "Available: circle, crescent, cross, diamond, heart, square, star, triangle" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "results.json").exists()


def test_misspelt_key_fails_at_compose_time(tmp_path):
    proc = emma_run(["images_per_promt=2", *TINY], tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "images_per_promt" in proc.stderr


def _cell_args(run_dir, n=2):
    return [*TINY, f"images_per_prompt={n}", "prompt_types=[name,variant,random]", "metrics=rates_only",
            f"hydra.run.dir={run_dir}"]


def test_cell_writes_schema_and_rerun_generates_nothing(tmp_path):
    cache = tmp_path / "cache"
    first = emma_run(_cell_args(tmp_path / "a"), cache)
    assert first.returncode == 0, first.stderr[-3000:]
    res = json.loads((tmp_path / "a" / "results.json").read_text())
    assert res["schema_version"] == 3
    # the budget says what these numbers may be compared with
    budget = res["budget"]
    assert budget["images_per_prompt"] == 2 and budget["prompt_types"] == ["name", "variant", "random"]
    assert budget["prompts"] == {"ea/name": 1, "ea/variant": 4, "ra/random": 5}
    assert budget["n"] == {k: m["n"] for k, m in res["metrics"].items()} and res["served_from_cache"] is None
    assert {"numpy", "scipy", "clean-fid", "torch", "diffusers"} <= set(res["versions"]["libraries"])
    assert isinstance(res["versions"]["git_dirty"], bool)
    # before the first loading bar: which cell, where its files and caches go; all of it in run.log
    assert first.stdout.splitlines()[:3] == [
        "cell: model=tiny_random method=none domain=tinyworld attacker=static concept=(domain default) seed=0",
        f"run dir: {tmp_path / 'a'}", f"cache dir: {cache}"]
    log = (tmp_path / "a" / "run.log").read_text()
    assert "cell: model=tiny_random" in log and f"results: {tmp_path / 'a' / 'results.json'}" in log
    assert "LinAlgWarning" not in first.stderr
    assert (tmp_path / "a" / "metrics.csv").read_text().startswith("model,method,domain,concept,attacker")
    assert res["cell"] == {"model": "tiny_random", "method": "none", "domain": "tinyworld",
                           "concept": "circle", "attacker": "static", "classifier": "tinyworld"}
    # 1 name + 4 variant EA prompts, 5 random RA prompts, 2 images each
    assert res["counts"]["images"] == 20
    assert res["counts"]["images_generated"] == 20
    assert set(res["metrics"]) >= {"ea/name", "ea/variant", "ra/random", "asr", "asr/pre",
                                   "time/unlearning_s", "time/inference_s_per_image"}
    for key in ("ea/name", "ea/variant", "ra/random", "asr"):
        m = res["metrics"][key]
        assert set(m) == {"value", "ci_low", "ci_high", "n", "method", "n_clusters", "note", "n_excluded"}
        if key == "ea/name":  # one prompt: no interval, and a note that says so
            assert m["ci_low"] is None and "fewer than 2 prompts" in m["note"]
        else:
            assert m["ci_low"] <= m["value"] <= m["ci_high"] and m["method"]
    assert res["metrics"]["ea/name"]["n"] == 2 and res["metrics"]["ea/variant"]["n"] == 8
    assert res["metrics"]["ea/variant"]["n_clusters"] == 4
    assert res["metrics"]["asr"]["n"] == 5 and res["metrics"]["asr/images"]["n"] == 10
    assert res["metrics"]["ra/random"]["n"] == 10
    assert any("PLUMBING ONLY" in n for n in res["notes"])
    assert res["versions"]["components"]["method"]["name"] == "none"
    assert res["versions"]["model"]["base_fingerprint"] == res["versions"]["model"]["erased_fingerprint"]
    assert set(res["timing"]) >= {"load_s", "erase_s", "suite_s", "attack_s"}
    samples = [json.loads(line) for line in (tmp_path / "a" / "samples.jsonl").read_text().splitlines()]
    suite = [s for s in samples if s["group"] in ("ea", "ra")]
    assert len(suite) == 20
    # each prompt's two images have their own seeds, derived from (cell seed 0, prompt, index)
    from emma.seeds import image_seeds
    assert all(s["seed"] in image_seeds(0, s["prompt"], 2) for s in suite)
    assert len({s["seed"] for s in suite}) == 20
    assert all(len(s["image_hash"]) == 64 for s in samples)

    # recompute from the image and score caches, not from the stored finished result
    second = emma_run([*_cell_args(tmp_path / "b"), "paths.reuse_results=false"], cache)
    assert second.returncode == 0, second.stderr[-3000:]
    res2 = json.loads((tmp_path / "b" / "results.json").read_text())
    assert res2["counts"]["images_generated"] == 0
    assert res2["counts"]["images_scored"] == 0
    assert res2["counts"]["images_cached"] == res["counts"]["images_cached"] + 20
    assert res2["metrics"] == res["metrics"]  # timing included: replayed from the image cache
    assert any("replayed from the image cache" in n for n in res2["notes"])
    assert res2["provenance"]["time/inference_s_per_image"]["images_measured_now"] == 0


def _cache_files(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.is_file()]


def test_sigkill_mid_generation_then_resume(tmp_path):
    """Kill a cell while it writes images; the re-run completes with the same metrics as an
    uninterrupted run and the cache holds no partial or corrupt file."""
    cache = tmp_path / "cache"
    args = [*TINY, "images_per_prompt=12", "prompt_types=[name,variant,short,random]",
            "model.batch_size=4", "metrics=rates_only"]
    proc = subprocess.Popen([sys.executable, "-m", "emma.run", *args, f"hydra.run.dir={tmp_path / 'killed'}"],
                            cwd=ROOT, env=run_env(cache), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    images = cache / "images"
    # kill once the progress bar shows 24 of 156 images drawn: the cache's files lag the
    # generator, so on a quiet machine counting them let the cell finish first
    progress = ProgressReader(proc)
    reached = progress.wait_drawn(156, 24, timeout=300)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    err = progress.text()
    assert reached, "the run ended (or timed out) before 24 images were drawn: " + err[-2000:]
    n_before = len(list(images.rglob("*.png"))) if images.exists() else 0
    assert 0 < n_before < 156, "the kill must land mid-generation"
    assert not (tmp_path / "killed" / "results.json").exists()

    resumed = emma_run([*args, f"hydra.run.dir={tmp_path / 'resumed'}"], cache)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    res = json.loads((tmp_path / "resumed" / "results.json").read_text())
    assert res["counts"]["images_generated"] == 156 - n_before

    fresh = emma_run([*args, f"hydra.run.dir={tmp_path / 'fresh'}"], tmp_path / "cache2")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    ref = json.loads((tmp_path / "fresh" / "results.json").read_text())
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("time/")}  # noqa: E731
    assert strip(res["metrics"]) == strip(ref["metrics"])

    files = _cache_files(cache)
    assert not [p for p in files if p.name.endswith(".tmp")]
    pngs = [p for p in files if p.suffix == ".png" and "results" not in p.relative_to(cache).parts]
    assert len(pngs) == 156  # the image cache (the finished cell's stored evidence aside)
    for p in pngs:
        with Image.open(p) as im:
            arr = np.asarray(im.convert("RGB"))
        assert arr.shape == (32, 32, 3)
    # resumed and fresh caches hold the same images under the same keys
    ref_pngs = {p.name: p for p in (tmp_path / "cache2" / "images").rglob("*.png")}
    assert set(ref_pngs) == {p.name for p in pngs}
    for p in pngs[:20]:  # same pixels (the PNG's record also holds each run's generation time)
        with Image.open(p) as a, Image.open(ref_pngs[p.name]) as b:
            assert np.array_equal(np.asarray(a.convert("RGB")), np.asarray(b.convert("RGB")))


def test_missing_classifier_weights_print_the_download_message(tmp_path):
    proc = emma_run(["model=tiny_random", "domain=tinyworld", "classifier=ml_decoder",
                     f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ")
    assert "python -m emma.weights fetch" in proc.stderr
    assert "Traceback" not in proc.stderr


def _cache_bytes(cache: Path) -> dict[str, bytes]:
    return {str(p.relative_to(cache)): p.read_bytes() for p in sorted(cache.rglob("*")) if p.is_file()}


def test_incompatible_checkpoint_is_a_clear_error_and_the_cache_survives(tmp_path):
    """A finished erased cell, then a cell with a checkpoint of the wrong shape: exit 2 with
    the offending key and both shapes, and every cached file (erased model, images, scores)
    is still there, byte for byte, with no temporary file left behind."""
    from diffusers import UNet2DConditionModel

    from emma.tinyworld import arch

    cache = tmp_path / "cache"
    args = [*TINY, "images_per_prompt=1", "prompt_types=[name]", "metrics=rates_only"]
    first = emma_run([*args, "method=uce", f"hydra.run.dir={tmp_path / 'a'}"], cache)
    assert first.returncode == 0, first.stderr[-3000:]
    assert list((cache / "erased").iterdir())  # the erased UNet is cached
    before = _cache_bytes(cache)

    other = UNet2DConditionModel(**{**arch.TINY_RANDOM_UNET, "cross_attention_dim": 16})
    other.save_pretrained(tmp_path / "bad_unet")
    bad = emma_run([*args, "method=checkpoint", f"method.path={tmp_path / 'bad_unet'}",
                    f"hydra.run.dir={tmp_path / 'b'}"], cache)
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert bad.stderr.startswith("error: ")
    assert "attn2.to_k.weight: checkpoint (8, 16)" in bad.stderr
    assert "Traceback" not in bad.stderr
    assert not (tmp_path / "b" / "results.json").exists()
    after = _cache_bytes(cache)
    assert {k: v for k, v in after.items() if k in before} == before
    assert not [k for k in after if k.endswith(".tmp") or ".tmp" in Path(k).parts[0]]


@pytest.mark.parametrize("args, named", [
    (["-m", "--info"], "-m and --info"),
    (["--cfg", "job", "--info"], "--cfg and --info"),
    (["--multirun", "-m", "--info", "method=esd"], "-m and --info"),
])
def test_two_hydra_modes_are_one_line_error(args, named, tmp_path):
    out = emma_run(list(args), tmp_path)
    assert out.returncode == 2
    err = out.stderr.strip()
    assert err.startswith(f"error: {named} cannot be combined;") and "Traceback" not in out.stderr
    assert len(err.splitlines()) == 1


def test_mode_conflict_leaves_single_modes_and_the_sweep_listing():
    from emma.run import mode_conflict

    assert mode_conflict(["-m", "method=esd,uce"]) is None
    assert mode_conflict(["-m", "--cfg", "job"]) is None
    assert mode_conflict(["--info"]) is None
    assert mode_conflict(["-c", "job", "-r"]) is not None
