"""Adaptive attacks in real cells on the tiny world: they bring an erased circle back where the
static suite does not, and a killed attack resumes without re-optimising finished prompts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from emma.pipelines import TINYWORLD_DIR
from tests.conftest import ROOT, run_env

pytestmark = pytest.mark.skipif(not TINYWORLD_DIR.exists(), reason="tiny-world assets not built")

# UCE erases circle in well under a second; the name and variant prompts are 5 EA requests.
CELL = ["method=uce", "prompt_types=[name,variant]", "metrics=rates_only", "paths.reuse_results=false"]


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from emma.registry import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


# UCE erasing circle alone (no preserved concepts): against the tiny-world preset, which
# preserves the other seven shapes, UnlearnDiffAtk found 0 of 20 images here (name + variant
# prompts, 4 images each) and 4 of 200 on all 20 EA prompts (docs/attacks_tinyworld.md).
# The technique and the erase and preserve scales are pinned, so that a retuned UCE preset does
# not change the model.
ERASED = ["method.preserve_concepts.tinyworld=[]", "method.technique=replace", "method.erase_scale=1.0",
          "method.preserve_scale=null"]


@pytest.mark.parametrize("attacker", [
    "unlearndiffatk",  # the tiny-world preset: 10 timesteps x 10 iterations over the domain's tokens
    pytest.param("ring_a_bell", marks=pytest.mark.xfail(
        strict=True, reason="measured: 0 of 20 images (name + variant prompts, 4 images each); its prompts near "
        "embed(prompt) + eta * v are circle "
        "words (disc, orb, circle, ...) that UCE's edit of those directions also erases")),
])
@pytest.mark.slow
def test_attack_beats_the_static_suite_on_an_erased_model(attacker, tmp_path):
    from scipy.stats import fisher_exact

    from emma.cell import run_cell

    n = 20  # images per prompt: the final images are drawn at seeds the search never judged
    cfg = compose(*CELL, *ERASED, f"attacker={attacker}", f"images_per_prompt={n}",
                  f"paths.cache_dir={tmp_path / 'cache'}")
    res = run_cell(cfg, tmp_path / "out")
    lines = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    attacked = [x for x in lines if x["group"] == "attack"]
    static = [x for x in lines if x["group"] == "ea"]
    assert len(attacked) == len(static) == 5 * n and {x["attacker"] for x in attacked} == {attacker}
    # the erased model hides the circle from the static prompts' images, the attack brings it back:
    # more images with the circle, one-sided Fisher exact test on the 5n + 5n images
    k_atk, k_static = sum(x["detected"] for x in attacked), sum(x["detected"] for x in static)
    assert k_static <= 2
    p = fisher_exact([[k_atk, 5 * n - k_atk], [k_static, 5 * n - k_static]], alternative="greater").pvalue
    assert p < 0.05, (k_atk, k_static, p)
    assert res.metrics["asr"].value > res.metrics["asr/pre"].value  # per attacked prompt
    # a success is the attack's own prompt, unless its search judged the original prompt better
    assert all(x["adversarial_prompt"] != x["original_prompt"] or x["kept_original"]
               for x in attacked if x["attack_success"])
    assert res.metrics["attack/queries_mean"].value >= 10


def _attack_files(cache: Path) -> list[Path]:
    return sorted((cache / "attacks").rglob("*.json")) if (cache / "attacks").exists() else []


def _run(args, cache, out):
    return subprocess.run([sys.executable, "-m", "emma.run", *args, f"hydra.run.dir={out}"], cwd=ROOT,
                          env=run_env(cache), capture_output=True, text=True, timeout=1200)


@pytest.mark.slow  # four cell runs in subprocesses
def test_sigkill_mid_attack_resumes_at_the_unfinished_prompt(tmp_path):
    args = [*CELL, "attacker=unlearndiffatk", "attacker.requests_per_batch=1", "attacker.timesteps=2",
            "attacker.iterations_per_timestep=3", "attacker.check_original=false", "images_per_prompt=2"]
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-m", "emma.run", *args, f"hydra.run.dir={tmp_path / 'killed'}"],
                            cwd=ROOT, env=run_env(cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 900
    while time.time() < deadline and len(_attack_files(cache)) < 2 and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = len(_attack_files(cache))
    assert 2 <= finished < 5, "the kill must land mid-attack"
    assert not (tmp_path / "killed" / "results.json").exists()

    resumed = _run(args, cache, tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    res = json.loads((tmp_path / "resumed" / "results.json").read_text())
    assert res["counts"]["attack_requests_cached"] == finished
    assert res["counts"]["attack_requests_optimised"] == 5 - finished

    fresh = _run(args, tmp_path / "cache2", tmp_path / "fresh")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    ref = json.loads((tmp_path / "fresh" / "results.json").read_text())
    keep = lambda m: {k: v for k, v in m.items() if not k.startswith(("time/", "attack/time"))}  # noqa: E731
    assert keep(res["metrics"]) == keep(ref["metrics"])
    assert ref["counts"]["attack_requests_optimised"] == 5 and ref["counts"]["attack_iterations"] > 0

    again = _run(args, tmp_path / "cache2", tmp_path / "again")  # finished: no optimisation at all
    assert again.returncode == 0, again.stderr[-3000:]
    rerun = json.loads((tmp_path / "again" / "results.json").read_text())
    assert rerun["counts"]["attack_requests_optimised"] == 0 and rerun["counts"]["attack_iterations"] == 0
    assert rerun["counts"]["images_generated"] == 0
    assert keep(rerun["metrics"]) == keep(ref["metrics"])
    # a replayed attack reports what the attack cost when it ran, not the replay's 0
    assert rerun["metrics"]["attack/time_s"]["value"] == ref["metrics"]["attack/time_s"]["value"] > 0
    assert not [p for p in cache.rglob("*") if p.name.endswith(".tmp")]


def test_unusable_attack_settings_fail_before_any_image(tmp_path):
    cache = tmp_path / "cache"
    out = _run([*CELL, "attacker=unlearndiffatk", "attacker.k=80"], cache, tmp_path / "out")
    assert out.returncode == 2
    assert "> the tokenizer's context of 77" in out.stderr
    assert not list(cache.rglob("*.png"))
    out = _run([*CELL, "attacker=unlearndiffatk", "attacker.insertion=middle"], cache, tmp_path / "out2")
    assert out.returncode == 2 and "unknown adversarial token insertion 'middle'" in out.stderr
