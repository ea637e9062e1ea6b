"""W&B offline runs read back with wandb's own record format: a cell logged with
``logger=wandb`` and a leaderboard published with ``--wandb`` hold the values of the result
files, the image grids hold the evidence pixels, and no secret of the environment is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, run_env

pytest.importorskip("wandb")

CELL = ["model=tiny_random", "classifier=tinyworld", "classifier.weights=null", "metrics=rates_only",
        "prompt_types=[name,random]", "images_per_prompt=2"]
# planted in the environment of every process below; none may reach a written file
SECRETS = {"WANDB_API_KEY": "0123456789abcdef0123456789abcdefplanted1",
           "OPENAI_API_KEY": "sk-planted-emma-secret-7f3a9c",
           "HF_TOKEN": "hf_plantedEmmaSecret42"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("wandb")
    env = run_env(root / "cache", WANDB_MODE="offline", **SECRETS)
    cell = subprocess.run([sys.executable, "-m", "emma.run", *CELL, "logger=wandb", f"hydra.run.dir={root / 'cell'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert cell.returncode == 0, cell.stdout[-2000:] + cell.stderr[-3000:]
    board = subprocess.run([sys.executable, "-m", "leaderboards.build", str(root / "cell"), "--out",
                            str(root / "board"), "--wandb"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert board.returncode == 0, board.stdout[-2000:] + board.stderr[-3000:]
    # the same cell again: served from the results cache, and logged all the same
    served = subprocess.run([sys.executable, "-m", "emma.run", *CELL, "logger=wandb",
                             f"hydra.run.dir={root / 'served'}"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert served.returncode == 0, served.stdout[-2000:] + served.stderr[-3000:]
    assert "served from the cache" in served.stdout
    return root, cell.stdout + cell.stderr + board.stdout + board.stderr + served.stdout + served.stderr


def _run_dir(folder: Path) -> Path:
    (run_dir,) = list((folder / "wandb").glob("offline-run-*"))
    return run_dir


def _pixels(path: Path) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"))


def test_cell_run_holds_config_metrics_and_evidence(runs):
    from emma.evidence import EVIDENCE_DIR, read_evidence
    from emma.loggers import image_grid
    from leaderboards.wandb_read import read_run

    root, _ = runs
    res = json.loads((root / "cell" / "results.json").read_text())
    run = read_run(_run_dir(root / "cell"))
    assert (run.project, run.job_type) == ("emma", "cell")
    assert run.display_name == "tiny_random/none/tinyworld/circle/static"
    # config: the cell, the resolved config and the versions exactly as results.json has them
    assert run.config["cell"] == res["cell"]
    assert run.config["config"] == res["config"]
    assert run.config["versions"]["components"] == res["versions"]["components"]
    # metrics with their intervals, in the logged step and in the summary
    (step,) = [h for h in run.history if "ea/name" in h]
    assert res["metrics"]["ra/random"]["ci_low"] is not None  # one interval to compare at least
    for key, m in res["metrics"].items():
        assert step[key] == m["value"] and run.summary[key] == m["value"]
        if m["ci_low"] is None:  # no interval (e.g. EA over a single name prompt): none logged
            assert f"{key}/ci_low" not in step
        else:
            assert (step[f"{key}/ci_low"], step[f"{key}/ci_high"]) == (m["ci_low"], m["ci_high"])
    assert step["counts/images"] == res["counts"]["images"] == 12
    # evidence: one image per evidence file (same pixels) and their grid
    evidence = read_evidence(root / "cell")
    assert len(evidence) == res["counts"]["evidence_images"] > 0
    files = [root / "cell" / EVIDENCE_DIR / e["file"] for e in evidence]
    logged = step["evidence"]
    assert logged["_type"] == "images/separated" and logged["count"] == len(files)
    grid = run.media_path(step["evidence_grid"])
    assert step["evidence_grid"]["_type"] == "image-file" and grid.is_file()
    assert np.array_equal(_pixels(grid), np.asarray(image_grid(files)))


def test_a_cell_served_from_the_cache_has_its_evidence_and_its_wandb_run(runs):
    """The served copy says so, keeps the evidence images of the first run (same bytes) and
    logs the same metrics and evidence grid to W&B as the first run did."""
    from emma.evidence import EVIDENCE_DIR, read_evidence
    from emma.loggers import image_grid
    from leaderboards.wandb_read import read_run

    root, _ = runs
    first, again = (json.loads((root / d / "results.json").read_text()) for d in ("cell", "served"))
    assert first["served_from_cache"] is None and again["served_from_cache"]["key"]
    assert {k: v for k, v in again.items() if k != "served_from_cache"} == \
        {k: v for k, v in first.items() if k != "served_from_cache"}
    files = sorted(p.name for p in (root / "cell" / EVIDENCE_DIR).iterdir())
    assert files and sorted(p.name for p in (root / "served" / EVIDENCE_DIR).iterdir()) == files
    for name in files:
        served_image, first_image = (root / d / EVIDENCE_DIR / name for d in ("served", "cell"))
        assert served_image.read_bytes() == first_image.read_bytes()
    runs_logged = [read_run(_run_dir(root / d)) for d in ("cell", "served")]
    steps = [next(h for h in r.history if "ea/name" in h) for r in runs_logged]
    assert {k: steps[1][k] for k in first["metrics"]} == {k: steps[0][k] for k in first["metrics"]}
    grid = runs_logged[1].media_path(steps[1]["evidence_grid"])
    served_files = [root / "served" / EVIDENCE_DIR / e["file"] for e in read_evidence(root / "served")]
    assert np.array_equal(_pixels(grid), np.asarray(image_grid(served_files)))
    # the flat table beside it, as pandas reads it
    import pandas as pd

    table = pd.read_csv(root / "served" / "metrics.csv")
    assert set(table["metric"]) == set(first["metrics"]) and table["served_from_cache"].all()


def test_leaderboard_run_holds_tables_with_intervals_and_grids(runs):
    from emma.evidence import EVIDENCE_DIR, read_evidence
    from emma.loggers import image_grid
    from leaderboards.wandb_read import read_run

    root, _ = runs
    res = json.loads((root / "cell" / "results.json").read_text())
    run = read_run(_run_dir(root / "board"))
    assert run.job_type == "leaderboard" and run.config == {"cells": 1, "failed": 0}
    table = run.table("leaderboard/tinyworld_methods")
    cols = table["columns"]
    assert cols[:4] == ["model", "method", "concept", "attacker"] and cols[-1] == "evidence"
    (row,) = table["data"]
    assert row[:4] == ["tiny_random", "none", "circle", "static"]
    for key in ("ea/name", "ra/random"):
        m = res["metrics"][key]
        got = [row[cols.index(f"{key}{s}")] for s in ("", "_ci_low", "_ci_high", "_n")]
        assert got == [m["value"], m["ci_low"], m["ci_high"], m["n"]]
    # the table's evidence cell and the plain image are the grid of the cell's evidence images
    files = [root / "cell" / EVIDENCE_DIR / e["file"] for e in read_evidence(root / "cell")]
    evidence_cell = row[-1]
    assert evidence_cell["_type"] == "image-file"
    # the table artifact is staged beside the run, not in the user's data folder
    assert Path(evidence_cell["local_path"]).is_relative_to(root / "board" / "wandb" / "data")
    assert np.array_equal(_pixels(Path(evidence_cell["local_path"])), np.asarray(image_grid(files)))
    (step,) = [h for h in run.history if "leaderboard/tinyworld_methods" in h]
    (grid,) = [v for k, v in step.items() if k.startswith("evidence/")]
    assert np.array_equal(_pixels(run.media_path(grid)), np.asarray(image_grid(files)))
    assert run.media_path(step["plots/tinyworld_ea_vs_ra"]).stat().st_size > 1000


def test_no_planted_secret_in_any_written_file_or_log(runs):
    root, log = runs
    written = [p for p in root.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in written) and len(written) > 20
    for name, value in SECRETS.items():
        assert value not in log, name
        leaked = [str(p.relative_to(root)) for p in written if value.encode() in p.read_bytes()]
        assert not leaked, f"{name} written to {leaked}"


def test_reader_rejects_a_file_that_is_not_a_wandb_log(tmp_path):
    from leaderboards.wandb_read import WandbReadError, main, read_run

    (tmp_path / "run-x.wandb").write_bytes(b"not a log at all")
    with pytest.raises(WandbReadError, match="not a .wandb log"):
        read_run(tmp_path)
    assert main([str(tmp_path / "missing")]) == 2
