"""Sweeps through ``hydra/launcher=slurm`` on a real (local, single-node) Slurm cluster.

.ci/run starts one with scripts/slurm_local.sh and sets EMMA_REQUIRE_SLURM=1, so there a
missing cluster fails instead of skipping. Elsewhere: ``eval "$(scripts/slurm_local.sh start)"``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_env

pytestmark = pytest.mark.slurm

CELL = ["metrics=rates_only", "prompt_types=[name,random]", "images_per_prompt=2"]
SLURM = ["hydra/launcher=slurm", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2",
         "hydra.launcher.timeout_min=20"]


def _cluster_up() -> str | None:
    if shutil.which("sinfo") is None:
        return "sinfo not found"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    if out.returncode != 0 or not out.stdout.strip():
        return f"no Slurm cluster answers ({out.stderr.strip()[:200]})"
    return None


@pytest.fixture(scope="module")
def slurm():
    why = _cluster_up()
    if why:
        if os.environ.get("EMMA_REQUIRE_SLURM") == "1":
            pytest.fail(f"EMMA_REQUIRE_SLURM=1 but {why}")
        pytest.skip(f"{why}: start one with `eval \"$(scripts/slurm_local.sh start)\"`")


def sweep(args, cache, sweep_dir, **kw):
    cmd = [sys.executable, "-m", "emma.run", "-m", *SLURM, *CELL, *args, f"hydra.sweep.dir={sweep_dir}"]
    return subprocess.Popen(cmd, cwd=ROOT, env=run_env(cache), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def cell_results(sweep_dir: Path) -> dict[str, dict]:
    """concept -> results.json of every finished cell of the sweep."""
    out = {}
    for p in sorted(sweep_dir.glob("*/results.json")):
        res = json.loads(p.read_text())
        out[res["cell"]["concept"]] = res
    return out


def test_two_cells_through_slurm_land_and_make_a_two_row_leaderboard(slurm, tmp_path):
    proc = sweep(["concept=circle,star"], tmp_path / "cache", tmp_path / "sweep")
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log[-4000:]
    results = cell_results(tmp_path / "sweep")
    assert sorted(results) == ["circle", "star"]
    for res in results.values():
        assert res["counts"]["images"] == 12 and res["counts"]["images_generated"] > 0
    report = json.loads((tmp_path / "sweep" / "sweep_report.json").read_text())
    assert (report["jobs"], report["completed"], report["failed"]) == (2, 2, 0)
    # the jobs ran under Slurm: submitit's per-job folders carry the array job ids
    assert all(re.fullmatch(r"\d+_[01]", c["job_id"]) for c in report["cells"])

    from leaderboards.build import build

    board = build([tmp_path / "sweep"], tmp_path / "board")
    rows = [r for t in board.tables if t.kind == "methods" for r in t.rows]
    assert sorted(r["concept"] for r in rows) == ["circle", "star"]
    assert (tmp_path / "board" / "index.html").exists()


def _squeue_state(job_id: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip()


def test_scancel_mid_sweep_then_rerun_completes_without_recomputing(slurm, tmp_path):
    cache, sweep_dir = tmp_path / "cache", tmp_path / "sweep"
    proc = sweep(["concept=circle,heart"], cache, sweep_dir)
    cancelled = None
    deadline = time.time() + 600
    while cancelled is None and time.time() < deadline and proc.poll() is None:
        for d in (sweep_dir / ".submitit").glob("*_1") if (sweep_dir / ".submitit").exists() else []:
            if _squeue_state(d.name) == "RUNNING":
                subprocess.run(["scancel", d.name], check=True)
                cancelled = d.name
        time.sleep(0.5)
    assert cancelled, "job 1 of the sweep never ran"
    log, _ = proc.communicate(timeout=900)
    # the sweep waited for the other cell, then reported the cancelled one and failed
    assert proc.returncode != 0
    report = json.loads((sweep_dir / "sweep_report.json").read_text())
    assert [c["status"] for c in report["cells"]] == ["completed", "failed"]
    assert "CANCELLED" in (report["cells"][1].get("state") or "") + report["cells"][1]["error"]
    assert "cell #1 (" in log and "failed" in log
    first = cell_results(sweep_dir)
    assert sorted(first) == ["circle"]

    proc = sweep(["concept=circle,heart"], cache, sweep_dir)
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log[-4000:]
    again = cell_results(sweep_dir)
    assert sorted(again) == ["circle", "heart"]
    # the finished cell was not recomputed: its results (down to the measured stage timings)
    # are the first run's, served from the finished-cell cache
    assert again["circle"]["timing"] == first["circle"]["timing"]
    assert again["circle"]["counts"] == first["circle"]["counts"]
    assert again["circle"]["metrics"] == first["circle"]["metrics"]
    assert again["heart"]["counts"]["images"] == 12


def _cached_images(cache: Path) -> int:
    return sum(1 for _ in (cache / "images").rglob("*.png")) if (cache / "images").exists() else 0


def test_preempted_job_requeues_itself_and_resumes_from_the_cache(slurm, tmp_path):
    """Preemption as Slurm delivers it (SIGTERM, then the USR2 that submitit asks for before
    the kill): the job checkpoints, `scontrol requeue`s itself, runs again and finishes the
    cell, drawing only the images the first run had not cached."""
    cache, sweep_dir = tmp_path / "cache", tmp_path / "sweep"
    # 6 prompts x 40 images: long enough to interrupt after the first batches
    cell = ["metrics=rates_only", "prompt_types=[name,random]", "images_per_prompt=40", "concept=circle"]
    cmd = [sys.executable, "-m", "emma.run", "-m", *SLURM, *cell, f"hydra.sweep.dir={sweep_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=run_env(cache), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    job, job_dir, at_signal = None, None, 0
    deadline = time.time() + 600
    while job is None and time.time() < deadline and proc.poll() is None:
        # one cell is one plain job (no array): .submitit/<job id>/<job id>_0_log.out
        for out in sweep_dir.glob(".submitit/*/*_0_log.out"):
            task = out.parent.name
            if _squeue_state(task) == "RUNNING" and _cached_images(cache) >= 8:
                # what submitit's SlurmJob._interrupt sends for a preemption
                subprocess.run(["scancel", task, "--signal", "SIGTERM"], check=True)
                subprocess.run(["scancel", task, "--signal", "USR2"], check=True)
                job, job_dir = task, out.parent
                at_signal = _cached_images(cache)
        time.sleep(0.2)
    if job is None:
        proc.kill()
        pytest.fail("the sweep's job was never seen running with images cached:\n" + proc.communicate()[0][-3000:])
    # Slurm holds a requeued job ~2 minutes (BeginTime); let it start as soon as it is pending
    for _ in range(600):
        if _squeue_state(job) == "PENDING":
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)
            break
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log[-4000:]
    report = json.loads((sweep_dir / "sweep_report.json").read_text())
    assert (report["completed"], report["failed"]) == (1, 0)
    job_log = "".join(p.read_text() for p in job_dir.glob(f"{job}_0_log.*"))
    assert "this job is preempted" in job_log and f"Requeued job {job}" in job_log, job_log[-3000:]

    (counts,) = [json.loads(p.read_text())["counts"] for p in sweep_dir.glob("*/results.json")]
    assert counts["images"] == 240
    # the requeued run reused every image the interrupted run had cached, and the interrupted
    # run had not finished (each image of the cell is drawn once and cached once)
    total = _cached_images(cache)
    assert 8 <= at_signal < total
    assert counts["images_cached"] >= at_signal
    assert counts["images_generated"] <= total - at_signal
