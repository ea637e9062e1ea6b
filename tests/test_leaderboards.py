"""Local sweeps (hydra/launcher=local), W&B logging, and the leaderboard built from result files."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_env

# plumbing cells (random tiny pipeline and judge): these tests check how results travel
MISSING_WEIGHTS = "missing-judge.safetensors"  # no "/": the value names the job folder
CELL = ["model=tiny_random", "classifier=tinyworld", "classifier.weights=null", "metrics=rates_only",
        "prompt_types=[name,random]", "images_per_prompt=2"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A local two-process sweep: the tiny-world circle cell (logged to W&B offline) and a
    cell with a misspelt concept that crashes."""
    root = tmp_path_factory.mktemp("sweep")
    # every setting is valid (a sweep with an invalid one starts no job), but the second cell's
    # judge weights are missing: it fails when it runs
    cells = [c for c in CELL if not c.startswith("classifier.weights=")]
    cmd = [sys.executable, "-m", "emma.run", "-m", "hydra/launcher=local", *cells, "logger=wandb",
           f"classifier.weights=null,{MISSING_WEIGHTS}", f"hydra.sweep.dir={root / 'sweep'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=run_env(root / "cache", WANDB_MODE="offline"),
                          capture_output=True, text=True, timeout=900)
    return root, proc


def test_a_crashing_cell_does_not_stop_the_sweep_and_is_reported(sweep):
    root, proc = sweep
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((root / "sweep" / "sweep_report.json").read_text())
    assert (report["completed"], report["failed"]) == (1, 1)
    bad = [c for c in report["cells"] if c["status"] == "failed"][0]
    assert f"classifier.weights={MISSING_WEIGHTS}" in bad["overrides"]
    assert f"weights not found at {MISSING_WEIGHTS}" in bad["error"]
    log = proc.stdout + proc.stderr
    assert "cell #1 (" in log and "weights not found" in log
    res = json.loads(next((root / "sweep").glob("0_*/results.json")).read_text())
    assert res["cell"]["concept"] == "circle" and res["counts"]["images"] == 12
    err = json.loads(next((root / "sweep").glob("1_*/error.json")).read_text())
    assert "WeightsUnavailableError" in err["error"] and MISSING_WEIGHTS in err["error"]


def test_a_resumed_sweep_submits_no_job_for_a_finished_cell(sweep, tmp_path):
    """The same sweep again into a copy of its folder: the finished cell is kept without a job
    (no new submitit folder for it), the failed one runs again; progress is printed as it goes."""
    root, first = sweep
    again = tmp_path / "sweep"
    shutil.copytree(root / "sweep", again)
    before = {p.name for p in (again / ".submitit").iterdir()}
    cells = [c for c in CELL if not c.startswith("classifier.weights=")]
    proc = subprocess.run([sys.executable, "-m", "emma.run", "-m", "hydra/launcher=local", *cells, "logger=wandb",
                           f"classifier.weights=null,{MISSING_WEIGHTS}", f"hydra.sweep.dir={again}"],
                          cwd=ROOT, env=run_env(root / "cache", WANDB_MODE="offline"), capture_output=True,
                          text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log[-3000:]  # the failing cell still fails
    report = json.loads((again / "sweep_report.json").read_text())
    kept, rerun = report["cells"]
    assert kept["kept"] is True and kept["job_id"] is None and kept["status"] == "completed"
    assert rerun["status"] == "failed" and rerun["job_id"]
    new = {p.name for p in (again / ".submitit").iterdir()} - before
    assert new == {str(rerun["job_id"])}  # one job: the unfinished cell's
    assert "(finished: " in log and "no job)" in log
    assert "sweep: 1 done (1 kept), " in log and ", 1 failed" in log
    first_log = first.stdout + first.stderr
    assert "sweep: 0 done, " in first_log and "sweep: 1 done, 0 running, 0 waiting, 1 failed" in first_log


def _wandb_files(run_dir: Path) -> dict[str, Path]:
    return {p.relative_to(run_dir).as_posix(): p for p in run_dir.rglob("*") if p.is_file()}


def test_wandb_logger_offline_run_holds_the_evidence_images_and_grid(sweep):
    root, _ = sweep
    cell = next((root / "sweep").glob("0_*"))
    (run_dir,) = list((cell / "wandb").glob("offline-run-*"))
    files = _wandb_files(run_dir)
    res = json.loads((cell / "results.json").read_text())
    assert any(k.endswith(".wandb") for k in files)  # the run's record (metrics, config)
    images = [k for k in files if k.startswith("files/media/images/") and k.endswith(".png")]
    n_evidence = res["counts"]["evidence_images"]
    assert n_evidence > 0 and len(images) == n_evidence + 1  # each evidence image + the grid


def test_failing_wandb_keeps_results(sweep, caplog):
    from omegaconf import OmegaConf

    from emma.loggers import log_cell
    from emma.results import CellResult

    root, _ = sweep
    cell = next((root / "sweep").glob("0_*"))
    before = (cell / "results.json").read_bytes()
    cfg = OmegaConf.create({"logger": {"name": "wandb", "project": "emma", "mode": "no-such-mode"}})
    with caplog.at_level(logging.WARNING, logger="emma.loggers"):
        log_cell(cfg, CellResult.load(cell / "results.json"), cell)
    assert "logger wandb failed" in caplog.text and "results.json is unaffected" in caplog.text
    assert (cell / "results.json").read_bytes() == before


def test_leaderboard_rows_failed_cells_and_incremental_rebuild(sweep, tmp_path):
    from leaderboards.build import build, main

    root, _ = sweep
    board = build([root / "sweep"], tmp_path / "board")
    methods = next(t for t in board.tables if t.kind == "methods")
    res = json.loads(next((root / "sweep").glob("0_*/results.json")).read_text())
    (row,) = methods.rows
    assert (row["method"], row["concept"]) == ("none", "circle")
    assert row["ea/name"]["value"] == res["metrics"]["ea/name"]["value"]
    assert [f.error for f in board.failed] and "missing-judge" in board.failed[0].overrides
    md = (tmp_path / "board" / "tinyworld_methods.md").read_text()
    ra = res["metrics"]["ra/random"]
    assert f"{ra['value']:.3f} [{ra['ci_low']:.3f}, {ra['ci_high']:.3f}]" in md
    csv = (tmp_path / "board" / "tinyworld_methods.csv").read_text().splitlines()
    assert csv[0].startswith("model,method,concept,attacker,n_seeds,ea,ea_ci_low,ea_ci_high,ea_n,"
                             "ea/name,ea/name_ci_low")
    html = (tmp_path / "board" / "index.html").read_text()
    assert "Failed cells" in html and MISSING_WEIGHTS in html
    # the evidence images (method none: no base-model twins) + the EA-vs-RA plot (the ASR map is a table)
    assert html.count("data:image/png;base64,") == res["counts"]["evidence_images"] + 1
    assert (tmp_path / "board" / "plots" / "tinyworld_ea_vs_ra.png").stat().st_size > 1000

    again = build([root / "sweep"], tmp_path / "board")
    assert again.up_to_date and again.parsed == 0
    assert main([str(root / "sweep"), "--out", str(tmp_path / "board")]) == 0


def _copy_cell(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("wandb"))
    data = json.loads((dst / "results.json").read_text())
    edit(data)
    (dst / "results.json").write_text(json.dumps(data))
    return dst


def test_two_versions_of_a_method_are_never_merged(sweep, tmp_path, capsys):
    from leaderboards.build import build, main
    from leaderboards.collect import LeaderboardError

    root, _ = sweep
    cell = next((root / "sweep").glob("0_*"))

    def bump(data):
        data["versions"]["components"]["method"]["version"] = 99
        data["metrics"]["ea/name"]["value"] = 0.5

    _copy_cell(cell, tmp_path / "v99", bump)
    with pytest.raises(LeaderboardError, match=r"method 'none' appears in 2 different versions"):
        build([cell, tmp_path / "v99"], tmp_path / "board")
    assert main([str(cell), str(tmp_path / "v99"), "--out", str(tmp_path / "board")]) == 2
    err = capsys.readouterr().err
    assert "never merged" in err and "version 99" in err and "--split-versions" in err

    board = build([cell, tmp_path / "v99"], tmp_path / "board", split_versions=True)
    rows = next(t for t in board.tables if t.kind == "methods").rows
    assert len(rows) == 2 and len({r["method"] for r in rows}) == 2
    assert sorted(r["ea/name"]["value"] for r in rows) == sorted(
        [0.5, json.loads((cell / "results.json").read_text())["metrics"]["ea/name"]["value"]])


def test_configs_of_one_class_are_rows_of_their_own(sweep, tmp_path):
    """esd and esd_100 share the class ESDMethod with other settings: each config is its own
    row, named as the user typed it; cells of one config that differ are still refused."""
    from leaderboards.build import build
    from leaderboards.collect import LeaderboardError

    root, _ = sweep
    cell = next((root / "sweep").glob("0_*"))
    assert json.loads((cell / "results.json").read_text())["versions"]["choices"]["method"] == "none"

    def config(name, choices=True):
        def edit(data):
            data["versions"]["components"]["method"]["strength"] = name
            if choices:
                data["versions"]["choices"]["method"] = name
            else:  # results written before versions.choices: the preset names the config
                data["versions"].pop("choices")
                data["versions"]["presets"] = {"method": f"{name}_tiny", "scale": "tiny"}
        return edit

    _copy_cell(cell, tmp_path / "a", config("none_100"))
    _copy_cell(cell, tmp_path / "b", config("none_500", choices=False))
    board = build([cell, tmp_path / "a", tmp_path / "b"], tmp_path / "board")
    rows = next(t for t in board.tables if t.kind == "methods").rows
    assert sorted(r["method"] for r in rows) == ["none", "none_100", "none_500"]

    def newer(data):
        config("none_100")(data)
        data["versions"]["components"]["method"]["version"] = 99

    _copy_cell(cell, tmp_path / "c", newer)
    with pytest.raises(LeaderboardError, match=r"method 'none_100' appears in 2 different versions"):
        build([tmp_path / "a", tmp_path / "c"], tmp_path / "board2")


def test_unknown_schema_version_is_a_clear_error(sweep, tmp_path, capsys):
    from leaderboards.build import main

    root, _ = sweep
    cell = next((root / "sweep").glob("0_*"))
    _copy_cell(cell, tmp_path / "future", lambda d: d.update(schema_version=7))
    assert main([str(tmp_path / "future"), "--out", str(tmp_path / "board")]) == 2
    err = capsys.readouterr().err
    assert "schema_version 7 is unknown; this harness reads schema versions 1, 2, 3 " in err
    assert (cell / "results.json").exists()


def test_wandb_publish_offline_holds_tables_and_grids(sweep, tmp_path, monkeypatch):
    from leaderboards.build import main

    monkeypatch.setenv("WANDB_MODE", "offline")
    root, _ = sweep
    assert main([str(root / "sweep"), "--out", str(tmp_path / "board"), "--wandb"]) == 0
    (run_dir,) = list((tmp_path / "board" / "wandb").glob("offline-run-*"))
    files = _wandb_files(run_dir)
    tables = {k: json.loads(p.read_text()) for k, p in files.items() if k.endswith(".table.json")}
    methods = next(v for k, v in tables.items() if "tinyworld_methods" in k)
    assert methods["columns"][:4] == ["model", "method", "concept", "attacker"]
    assert methods["columns"][-1] == "evidence"
    (row,) = methods["data"]
    res = json.loads(next((root / "sweep").glob("0_*/results.json")).read_text())
    assert row[methods["columns"].index("ea/name")] == res["metrics"]["ea/name"]["value"]
    assert row[-1] is not None  # the evidence grid cell
    grids = [k for k in files if k.startswith("files/media/images/evidence/") and k.endswith(".png")]
    assert len(grids) == 1


def test_judges_with_different_weights_are_a_clear_error_and_files_stay(sweep, tmp_path, capsys):
    """Cells judged by classifiers with different weights cannot share a row or a column:
    the build stops (no --split-versions for judges) and names both weight hashes."""
    from leaderboards.build import main

    root, _ = sweep
    cell = next((root / "sweep").glob("0_*"))

    def reweigh(data):
        for d in data["versions"]["components"]["classifiers"].values():
            d["weights_sha256"] = "f" * 64

    other = _copy_cell(cell, tmp_path / "other-judge", reweigh)
    before = (other / "results.json").read_bytes()
    for extra in ([], ["--split-versions"]):
        assert main([str(cell), str(other), "--out", str(tmp_path / "board"), *extra]) == 2
        err = capsys.readouterr().err
        assert "classifier 'tinyworld' appears in 2 different versions" in err and "ffffffffffff" in err
        assert "build them separately" in err
    assert (other / "results.json").read_bytes() == before and (cell / "results.json").exists()


@pytest.mark.parametrize("version", [1, 2])
def test_every_readable_schema_version_loads_in_the_harness_and_on_the_board(tmp_path, version):
    from emma.results import CellResult
    from leaderboards.collect import parse_results

    data = {"schema_version": version, "config": {}, "versions": {}, "timing": {}, "counts": {"images": 4},
            "cell": {"model": "m", "method": "none", "domain": "d", "concept": "c", "attacker": "static",
                     "classifier": "j"},
            "metrics": {"ea/name": {"value": 0.25, "ci_low": 0.1, "ci_high": 0.4, "n": 4}}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(data))
    result = CellResult.load(path)
    assert result.schema_version == version and result.metrics["ea/name"].value == 0.25
    cell = parse_results(path)
    assert (cell.method, cell.concept, cell.metrics["ea/name"]["value"]) == ("none", "c", 0.25)


def test_an_unknown_schema_version_fails_in_both_readers_naming_the_valid_ones(tmp_path):
    from emma.results import CellResult, ResultsFileError
    from leaderboards.collect import LeaderboardError, parse_results

    path = tmp_path / "results.json"
    path.write_text(json.dumps({"schema_version": 99, "cell": {}, "metrics": {}, "versions": {}}))
    expected = f"{path}: schema_version 99 is unknown; this harness reads schema versions 1, 2, 3 "
    with pytest.raises(ResultsFileError) as harness:
        CellResult.load(path)
    with pytest.raises(LeaderboardError) as board:
        parse_results(path)
    for err in (harness.value, board.value):
        assert str(err).startswith(expected) and "\n" not in str(err)
