"""The leaderboard groups cells by their recorded settings and validates what it reads.

One real sweep — the README's ``-m method=none,uce concept=circle,star`` on the tiny world,
one image per prompt — gives real result files; the other cases are copies of its cells with
one recorded value changed (a seed, a budget, a metric value), as a user's folders would hold.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_env

SMALL = ["images_per_prompt=1", "prompt_types=[name]", "metrics=rates_only", "threads=1"]


@pytest.fixture(scope="module")
def readme_sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    proc = subprocess.run([sys.executable, "-m", "emma.run", "-m", "method=none,uce", "concept=circle,star", *SMALL,
                           f"hydra.sweep.dir={root / 'sweep'}"],
                          cwd=ROOT, env=run_env(root / "cache"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return root / "sweep"


def _cell(sweep: Path, method: str, concept: str) -> Path:
    (found,) = [p for p in sweep.iterdir() if f"method={method}," in p.name and f"concept={concept}," in p.name]
    return found


def _copy(src: Path, dst: Path, edit=None) -> Path:
    shutil.copytree(src, dst)
    if edit is not None:
        data = json.loads((dst / "results.json").read_text())
        edit(data)
        (dst / "results.json").write_text(json.dumps(data, indent=2))
    return dst


def _rows(board, kind="methods"):
    return next(t for t in board.tables if t.kind == kind).rows


# ------------------------------------------------------------------ the README's sweep builds
def test_readme_sweep_builds_with_one_row_per_method_and_concept(readme_sweep, tmp_path, capsys):
    from leaderboards.build import main

    uce = json.loads((_cell(readme_sweep, "uce", "circle") / "results.json").read_text())
    # the preset's preserve list follows the concept: different values, one setting
    star = json.loads((_cell(readme_sweep, "uce", "star") / "results.json").read_text())
    pc, ps = (d["versions"]["components"]["method"]["preserve_concepts"]["tinyworld"] for d in (uce, star))
    assert pc != ps and "circle" not in pc and "star" not in ps
    assert uce["versions"]["concept_dependent"]["method"] == ["preserve_concepts.tinyworld",
                                                              "preserve_concepts.tinyworld_style"]
    assert main([str(readme_sweep), "--out", str(tmp_path / "board")]) == 0
    out = capsys.readouterr()
    assert "different versions" not in out.err
    assert "leaderboard: 4 cell(s), 0 failed, 0 invalid, 0 missing; 4 row(s)" in out.out
    md = (tmp_path / "board" / "tinyworld_methods.md").read_text()
    for method in ("none", "uce"):
        for concept in ("circle", "star"):
            assert f"| tinyworld | {method} | {concept} | static | 1 |" in md


def test_results_without_the_record_are_resolved_from_the_cells(readme_sweep, tmp_path):
    """Result files written before ``versions.concept_dependent``: a list that is "every
    concept but the cell's own" in each cell is recognised; a list that differs otherwise is not."""
    from leaderboards.build import build
    from leaderboards.collect import LeaderboardError

    def old(data):
        data["versions"].pop("concept_dependent")

    a = _copy(_cell(readme_sweep, "uce", "circle"), tmp_path / "a", old)
    b = _copy(_cell(readme_sweep, "uce", "star"), tmp_path / "b", old)
    board = build([a, b], tmp_path / "board")
    assert sorted(r["concept"] for r in _rows(board)) == ["circle", "star"]

    def dropped(data):  # one more concept left out: another setting, not the concept's
        old(data)
        data["versions"]["components"]["method"]["preserve_concepts"]["tinyworld"].pop()

    c = _copy(_cell(readme_sweep, "uce", "star"), tmp_path / "c", dropped)
    with pytest.raises(LeaderboardError, match="method 'uce' appears in 2 different versions"):
        build([a, c], tmp_path / "board2")


def test_a_real_setting_difference_is_still_refused(readme_sweep, tmp_path):
    from leaderboards.build import build
    from leaderboards.collect import LeaderboardError

    def scale(data):
        data["versions"]["components"]["method"]["erase_scale"] = 3.0

    other = _copy(_cell(readme_sweep, "uce", "star"), tmp_path / "scaled", scale)
    with pytest.raises(LeaderboardError, match="method 'uce' appears in 2 different versions"):
        build([_cell(readme_sweep, "uce", "circle"), other], tmp_path / "board")


# ------------------------------------------------------------------ seeds are replicates
def _seeded(seed: int, ea: float, n: int = 10):
    def edit(data):
        data["config"]["seed"] = seed
        data["metrics"]["ea/name"].update(value=ea, n=n, ci_low=max(0.0, ea - 0.2), ci_high=min(1.0, ea + 0.2))
    return edit


def test_three_seeds_pool_into_one_row_with_their_spread(readme_sweep, tmp_path, capsys):
    from leaderboards.build import build, main

    src = _cell(readme_sweep, "uce", "circle")
    runs = [_copy(src, tmp_path / "runs" / f"s{s}", _seeded(s, ea)) for s, ea in [(0, 0.2), (1, 0.5), (2, 0.8)]]
    board = build([tmp_path / "runs"], tmp_path / "board")
    (row,) = _rows(board)
    assert row["n_seeds"] == 3 and row["_seeds"] == [0, 1, 2]
    ea = row["ea/name"]
    assert ea["pooled"] and ea["n_seeds"] == 3 and ea["n"] == 10
    assert ea["value"] == pytest.approx(0.5) and (ea["min"], ea["max"]) == (0.2, 0.8)
    assert ea["sd"] == pytest.approx(0.3)
    md = (tmp_path / "board" / "tinyworld_methods.md").read_text()
    assert "0.500 (0.200–0.800, 3 seeds)" in md and "mean over seeds (min–max, n seeds)" in md
    header, line = (tmp_path / "board" / "tinyworld_methods.csv").read_text().splitlines()[:2]
    cols = dict(zip(header.split(","), line.split(",")))
    assert (cols["n_seeds"], cols["ea/name"], cols["ea/name_min"], cols["ea/name_max"]) == ("3", "0.5", "0.2", "0.8")
    assert not any("newer" in n for n in board.notes)
    html = (tmp_path / "board" / "index.html").read_text()
    assert all(f"seed {s}" in html for s in (0, 1, 2))  # each replicate's evidence stays
    assert main([str(tmp_path / "runs"), "--out", str(tmp_path / "board2")]) == 0
    assert "3 cell(s), 0 failed, 0 invalid, 0 missing; 1 row(s)" in capsys.readouterr().out
    assert len(runs) == 3


def test_the_same_seed_twice_counts_once_and_different_numbers_are_both_kept(readme_sweep, tmp_path):
    from leaderboards.build import build

    src = _cell(readme_sweep, "uce", "circle")
    _copy(src, tmp_path / "runs" / "a", _seeded(0, 0.4))
    _copy(src, tmp_path / "runs" / "b", _seeded(0, 0.4))
    board = build([tmp_path / "runs"], tmp_path / "board")
    (row,) = _rows(board)
    assert row["n_seeds"] == 1 and row["ea/name"]["value"] == 0.4 and not row["ea/name"].get("pooled")
    assert any("repeats" in n and "counted once" in n for n in board.notes)

    _copy(src, tmp_path / "runs" / "c", _seeded(0, 0.6))
    board = build([tmp_path / "runs"], tmp_path / "board")
    (row,) = _rows(board)
    assert row["ea/name"]["value"] == pytest.approx(0.5) and row["ea/name"]["n_seeds"] == 2
    assert any("different numbers" in n and "both are pooled" in n for n in board.notes)


# ------------------------------------------------------------------ budgets never replace each other
@pytest.mark.parametrize("edit, shown", [
    (lambda d: (d["config"].update(images_per_prompt=12), d["budget"].update(images_per_prompt=12)),
     "images_per_prompt=12"),
    (lambda d: (d["config"].update(prompt_types=["name", "random"]),
                d["budget"].update(prompt_types=["name", "random"])), "prompt_types=name,random"),
    (lambda d: d["counts"].update(attack_budget_iterations=5), "attack_budget_iterations=5"),
    (lambda d: d["config"]["model"].update(guidance_scale=7.5), "model.guidance_scale=7.5"),
])
def test_a_cell_at_another_budget_is_its_own_row_with_the_reason(readme_sweep, tmp_path, edit, shown):
    from leaderboards.build import build

    src = _cell(readme_sweep, "uce", "circle")

    def budget(data):
        edit(data)
        data["metrics"]["ea/name"]["value"] = 0.25

    _copy(src, tmp_path / "runs" / "full")
    _copy(src, tmp_path / "runs" / "small", budget)
    board = build([tmp_path / "runs"], tmp_path / "board")
    rows = _rows(board)
    assert len(rows) == 2 and sorted(r["ea/name"]["value"] for r in rows) == [0.25, 1.0]
    small = next(r for r in rows if r["ea/name"]["value"] == 0.25)
    assert shown in small["setting"] and "setting" in next(t for t in board.tables if t.kind == "methods").columns
    (note,) = [n for n in board.notes if "never merged" in n]
    assert "method 'uce'" in note and shown.split("=")[0] in note and "separate rows" in note
    md = (tmp_path / "board" / "tinyworld_methods.md").read_text()
    assert f"| {small['setting']} |" in md
    asr = next(t for t in board.tables if t.kind == "asr")
    assert len(asr.metric_columns) == 2  # one ASR column per setting, never one mixing them


def test_a_full_cell_and_a_12_image_cell_are_split_with_their_budgets_shown(readme_sweep, tmp_path):
    """A quick 12-image run beside the full run: never merged, never one replacing the other;
    each table and the page state both budgets and that only rows of one setting compare."""
    from leaderboards.build import build

    src = _cell(readme_sweep, "uce", "circle")
    full_ipp = json.loads((src / "results.json").read_text())["config"]["domain"]["images_per_prompt"]
    assert full_ipp != 12

    def full(data):
        data["config"]["images_per_prompt"] = None  # the domain's default, as a default cell records it
        data["budget"].update(images_per_prompt=full_ipp, n={"ea/name": full_ipp, "fid": 9 * full_ipp})
        data["metrics"]["fid"] = {"value": 7.2, "ci_low": 6.0, "ci_high": 8.9, "n": 9 * full_ipp}

    def quick(data):
        data["config"]["images_per_prompt"] = 12
        data["budget"].update(images_per_prompt=12, n={"ea/name": 12, "fid": 12})
        data["metrics"]["fid"] = {"value": 30.1, "ci_low": 25.0, "ci_high": 41.0, "n": 12}
        data["metrics"]["ea/name"]["value"] = 0.5

    _copy(src, tmp_path / "runs" / "full", full)
    _copy(src, tmp_path / "runs" / "quick", quick)
    board = build([tmp_path / "runs"], tmp_path / "board")
    main = next(t for t in board.tables if t.kind == "main")
    assert sorted(r["fid"]["value"] for r in main.rows) == [7.2, 30.1] and "setting" in main.columns
    assert {r["setting"] for r in main.rows} == {f"images_per_prompt={full_ipp}", "images_per_prompt=12"}
    assert any(f"{full_ipp} images per prompt" in b for b in main.budgets)
    assert any("12 images per prompt" in b for b in main.budgets)
    assert "compare numbers only between rows of the same setting" in main.comparable
    assert "FID's n differs between rows" in main.comparable
    (note,) = [n for n in board.notes if "never merged" in n]
    assert "images_per_prompt" in note
    page = (tmp_path / "board" / "index.html").read_text()
    assert "images_per_prompt=12" in page and "12 images per prompt" in page
    assert "compare numbers only between rows of the same setting" in page
    md = (tmp_path / "board" / "tinyworld_main.md").read_text()
    assert "Budgets:" in md and "12 images per prompt" in md and "FID ↓" in md and "EA ↑" in md


def test_a_sweep_loads_in_one_line_with_pandas_and_datasets(readme_sweep, tmp_path):
    """Folder names a glob reads literally; every cell's metrics in one pandas frame; every
    judged image of the sweep in one ``datasets`` table with one schema."""
    import datasets
    import pandas as pd

    from emma.results import SAMPLE_FIELDS, load_frame, load_samples

    names = [p.name for p in readme_sweep.iterdir() if p.is_dir()]
    assert names and not any(ch in n for n in names for ch in "[]{}*? '\"")
    assert any("prompt_types=name" in n for n in names)
    frame = load_frame(readme_sweep)
    assert len(frame) == sum(len(json.loads(p.read_text())["metrics"]) for p in readme_sweep.glob("*/results.json"))
    assert set(frame["method"]) == {"none", "uce"} and set(frame["concept"]) == {"circle", "star"}
    flat = pd.concat(map(pd.read_csv, sorted(readme_sweep.glob("*/metrics.csv"))))
    assert sorted(flat["value"].round(9).tolist()) == sorted(frame["value"].round(9).tolist())
    ds = datasets.load_dataset("json", data_files=str(readme_sweep / "*" / "samples.jsonl"), split="train",
                               cache_dir=str(tmp_path / "hf"))
    lines = [json.loads(x) for p in readme_sweep.glob("*/samples.jsonl") for x in p.read_text().splitlines()]
    assert ds.num_rows == len(lines) > 0 and list(ds.column_names) == list(SAMPLE_FIELDS)
    assert set(ds["method"]) == {"none", "uce"} and set(ds["group"]) >= {"ea", "attack"}
    typed = load_samples(readme_sweep, cache_dir=tmp_path / "hf2")  # the same, its schema stated
    assert typed.num_rows == ds.num_rows and typed.features["score"].dtype == "float64"
    exported = [(p.parent / r["image"]) for p in readme_sweep.glob("*/samples.jsonl")
                for r in map(json.loads, p.read_text().splitlines()) if r["image"]]
    assert exported and all(path.is_file() for path in exported)  # the image beside its row


def test_the_default_images_per_prompt_is_the_same_setting_as_its_value(readme_sweep, tmp_path):
    from leaderboards.build import build

    src = _cell(readme_sweep, "uce", "circle")
    domain_default = json.loads((src / "results.json").read_text())["config"]["domain"]["images_per_prompt"]

    def explicit(data):
        data["config"]["images_per_prompt"] = domain_default

    def default(data):
        data["config"]["images_per_prompt"] = None
        data["config"]["seed"] = 1

    _copy(src, tmp_path / "runs" / "a", explicit)
    _copy(src, tmp_path / "runs" / "b", default)
    (row,) = _rows(build([tmp_path / "runs"], tmp_path / "board"))
    assert row["n_seeds"] == 2 and row["setting"] == ""


# ------------------------------------------------------------------ values are validated
@pytest.mark.parametrize("value, says", [
    ("lots", "value 'lots' is not a number"),
    (float("nan"), "value is NaN over n=1"),
    (float("inf"), "value inf is infinite"),
    (True, "value True is not a number"),
    ([0.5], "value [0.5] is not a number"),
])
def test_a_metric_that_is_no_number_is_a_warning_and_the_cell_is_invalid(readme_sweep, tmp_path, capsys,
                                                                         value, says):
    from leaderboards.build import build, main

    good = _copy(_cell(readme_sweep, "none", "circle"), tmp_path / "runs" / "good")
    bad = _copy(_cell(readme_sweep, "uce", "circle"), tmp_path / "runs" / "bad",
                lambda d: d["metrics"]["ea/name"].update(value=value))
    assert main([str(tmp_path / "runs"), "--out", str(tmp_path / "board")]) == 0
    out = capsys.readouterr()
    warning = f"warning: {bad / 'results.json'}: metric 'ea/name' {says}"
    assert warning in out.err and "listed as invalid" in out.err
    assert "1 cell(s), 0 failed, 1 invalid, 0 missing" in out.out
    board = build([tmp_path / "runs"], tmp_path / "board")
    assert [r["method"] for r in _rows(board)] == ["none"] and board.invalid[0].path == bad
    for name in ("index.html", "leaderboard.md"):
        text = (tmp_path / "board" / name).read_text()
        assert "Invalid cells" in text and str(bad) in text
    assert good.exists()


def test_nan_over_nothing_measured_and_null_values_are_shown_as_na(readme_sweep, tmp_path):
    from leaderboards.build import build

    def empty(data):
        data["metrics"]["ea/name"].update(value=float("nan"), n=0)
        data["metrics"]["asr"].update(value=None)

    _copy(_cell(readme_sweep, "uce", "circle"), tmp_path / "runs" / "c", empty)
    board = build([tmp_path / "runs"], tmp_path / "board")
    assert not board.invalid and math.isnan(_rows(board)[0]["ea/name"]["value"])
    assert "| n/a |" in (tmp_path / "board" / "tinyworld_methods.md").read_text()


# ------------------------------------------------------------------ missing cells are counted
def test_a_cell_folder_without_results_or_error_is_missing(readme_sweep, tmp_path, capsys):
    from leaderboards.build import main

    sweep = tmp_path / "sweep"
    shutil.copytree(readme_sweep, sweep)
    killed = _cell(sweep, "uce", "star")
    (killed / "results.json").unlink()  # killed before it wrote its results
    assert main([str(sweep), "--out", str(tmp_path / "board")]) == 0
    out = capsys.readouterr()
    assert "3 cell(s), 0 failed, 0 invalid, 1 missing" in out.out
    assert f"missing cell: {killed}: neither results.json nor error.json" in out.err
    assert "Missing cells" in (tmp_path / "board" / "index.html").read_text()


def test_a_sweep_job_that_left_no_folder_is_missing(readme_sweep, tmp_path, capsys):
    from leaderboards.build import main

    sweep = tmp_path / "sweep"
    shutil.copytree(readme_sweep, sweep)
    shutil.rmtree(_cell(sweep, "none", "star"))
    assert main([str(sweep), "--out", str(tmp_path / "board")]) == 0
    out = capsys.readouterr()
    assert "3 cell(s), 0 failed, 0 invalid, 1 missing" in out.out
    assert "1 of the sweep's 4 jobs left no folder" in out.err


def test_a_folder_of_only_missing_cells_is_not_no_results(tmp_path, capsys):
    from leaderboards.build import main

    (tmp_path / "runs" / "cell").mkdir(parents=True)
    (tmp_path / "runs" / "cell" / "run.log").write_text("")
    assert main([str(tmp_path / "runs"), "--out", str(tmp_path / "board")]) == 0
    assert "0 cell(s), 0 failed, 0 invalid, 1 missing" in capsys.readouterr().out


# ------------------------------------------------------------------ rebuilds follow the content
def test_an_edit_that_keeps_size_and_mtime_is_rebuilt(readme_sweep, tmp_path):
    from leaderboards.build import build

    cell = _copy(_cell(readme_sweep, "uce", "circle"), tmp_path / "runs" / "c")
    first = build([tmp_path / "runs"], tmp_path / "board")
    assert _rows(first)[0]["ea/name"]["value"] == 1.0
    path = cell / "results.json"
    st = path.stat()
    text = path.read_text()
    at = text.index('"ea/name": {')
    edited = text[:at] + text[at:].replace('"value": 1.0,', '"value": 0.5,', 1)
    assert edited != text and len(edited) == len(text)
    path.write_text(edited)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    again = build([tmp_path / "runs"], tmp_path / "board")
    assert not again.up_to_date and again.parsed == 1
    assert _rows(again)[0]["ea/name"]["value"] == 0.5
    assert build([tmp_path / "runs"], tmp_path / "board").up_to_date


def test_a_damaged_build_state_is_rebuilt(readme_sweep, tmp_path):
    from leaderboards.build import STATE, build

    _copy(_cell(readme_sweep, "uce", "circle"), tmp_path / "runs" / "c")
    build([tmp_path / "runs"], tmp_path / "board")
    for junk in ("[1, 2]", "{not json", '{"format": 2, "cells": {"x": 1}}'):
        (tmp_path / "board" / STATE).write_text(junk)
        board = build([tmp_path / "runs"], tmp_path / "board")
        assert not board.up_to_date and len(_rows(board)) == 1


def test_expected_jobs_counts_an_experiments_sweep(tmp_path):
    """An experiment's ``hydra.sweeper.params`` join the command line's sweep; the command
    line wins for a key both set (as in Hydra's basic sweeper)."""
    from leaderboards.collect import expected_jobs

    path = tmp_path / "multirun.yaml"
    path.write_text("hydra:\n  sweeper:\n    params:\n      method: none,uce,esd\n      attacker: static,p4d_n\n"
                    "  overrides:\n    task:\n    - experiment=tinyworld_full\n    - method=none,uce\n")
    assert expected_jobs(path) == 4
    path.write_text("not: [yaml")
    assert expected_jobs(path) is None


def test_rows_of_one_setting_at_several_attack_budgets_are_not_called_one_budget():
    """A sweep of one method under the static suite and an attacker: one setting, two budgets.
    The table lists both and says that attack numbers compare only within an attacker; a table
    of one budget keeps the plain sentence."""
    from pathlib import Path

    from leaderboards.collect import Cell
    from leaderboards.tables import comparability

    def cell(attacker: str, attack: dict) -> Cell:
        return Cell(path=Path(attacker), model="tinyworld", method="uce", domain="tinyworld", concept="circle",
                    attacker=attacker, classifier="tinyworld", metrics={}, signatures={}, versions={}, counts={},
                    notes=[], mtime=0.0, budget={"images_per_prompt": 2, "attack": attack})

    static, p4d = cell("static", {}), cell("p4d_n", {"iterations": 100, "checks": 6})
    budgets, rule = comparability("methods", [static, p4d], [])
    assert len(budgets) == 1 and budgets[0].count(" | ") == 1 and "iterations=100" in budgets[0]
    assert "not one budget" in rule and "same attacker" in rule and "Every row" not in rule
    budgets, rule = comparability("methods", [static, cell("static", {})], [])
    assert rule.startswith("Every row was measured at the same budget")
