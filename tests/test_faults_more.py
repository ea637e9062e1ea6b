"""More hostile but fair input: cache folders replaced by files, damaged attack records and
erased models, empty output paths, a judge setting under ``classifier=auto``, local model
folders in a sweep, and damaged result folders on the leaderboard. Each is healed, or refused
in one line with a documented exit code (README, "Exit codes"); none is a traceback."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from emma import exit_codes
from emma.cache import ImageCache, ScoreCache, repair_mark, repairs_since
from emma.errors import ConfigError
from tests.erasure_fixtures import Shift


def _one_line(text: str) -> str:
    assert "Traceback" not in text and 'File "' not in text, text
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


# ------------------------------------------------------------------ a cache folder that is a file
@pytest.mark.parametrize("folder, make", [
    ("images", lambda root: ImageCache(root)),
    ("scores", lambda root: ScoreCache(root, "judge")),
])
def test_a_cache_folder_replaced_by_a_file_is_quarantined_and_recreated(tmp_path, folder, make):
    (tmp_path / folder).write_bytes(b"not a folder")
    mark = repair_mark()
    cache = make(tmp_path)
    assert (tmp_path / folder).is_dir()
    (repair,) = repairs_since(mark)
    assert repair.path == str(tmp_path / folder) and "is a file where the cache keeps its folder" in repair.reason
    assert Path(repair.moved_to).read_bytes() == b"not a folder"
    if isinstance(cache, ImageCache):
        img = np.full((4, 4, 3), 7, dtype=np.uint8)
        cache.put("k" * 64, img)
        assert np.array_equal(cache.get("k" * 64), img)
    else:
        cache.put("a" * 64, np.array([0.25, 0.75]))
        assert np.allclose(cache.get("a" * 64), [0.25, 0.75])


def test_erased_folder_a_file_and_an_entry_that_is_a_file_are_healed(base, tmp_path):
    import copy

    from emma.erase import erase_cached
    from emma.pipelines import fingerprint

    fp = fingerprint(base)
    (tmp_path / "erased").write_text("x")
    first = erase_cached(copy.deepcopy(base), Shift(), ["circle"], tmp_path, base_fingerprint=fp)
    assert not first.cached and (tmp_path / "erased").is_dir()
    entry = tmp_path / "erased" / first.key
    shutil.rmtree(entry)
    entry.write_text("a file where the erased model's folder was")
    mark = repair_mark()
    again = erase_cached(copy.deepcopy(base), Shift(), ["circle"], tmp_path, base_fingerprint=fp)
    assert not again.cached and again.fingerprint == first.fingerprint and entry.is_dir()
    assert [r.kind for r in repairs_since(mark)] == ["erased_model"]
    assert erase_cached(copy.deepcopy(base), Shift(), ["circle"], tmp_path, base_fingerprint=fp).cached


# ------------------------------------------------------------------ damaged attack records
@pytest.mark.parametrize("content, why", [
    ('{"adversarial_prompt": "a cir', "unreadable record"),
    ("[1, 2]", "holds a list"),
    ('{"adversarial_prompt": "x", "queries": 3}', "lacks iterations"),
    ('{"adversarial_prompt": 5, "queries": 3, "iterations": 1}', "not text"),
    ('{"adversarial_prompt": "x", "queries": -1, "iterations": 1}', "not counts"),
    ('{"adversarial_prompt": "x", "queries": 1, "iterations": 1, "extra": [1]}', "extra is not a mapping"),
])
def test_a_damaged_attack_record_is_quarantined_and_attacked_again(tmp_path, content, why):
    from emma.attack import AttackCache

    cache = AttackCache(tmp_path)
    good = {"adversarial_prompt": "x", "queries": 4, "iterations": 2, "extra": {}}
    cache.put("b" * 64, good)
    assert cache.get("b" * 64) == good
    cache.path("c" * 64).parent.mkdir(parents=True, exist_ok=True)
    cache.path("c" * 64).write_text(content)
    mark = repair_mark()
    assert cache.get("c" * 64) is None and not cache.path("c" * 64).exists()
    (repair,) = repairs_since(mark)
    assert repair.kind == "attack" and why in repair.reason


# ------------------------------------------------------------------ output paths and settings
@pytest.mark.parametrize("override, multirun", [("hydra.run.dir=", False), ("hydra.sweep.dir=''", True)])
def test_an_empty_run_or_sweep_dir_is_refused(override, multirun, tmp_path, monkeypatch):
    from emma.validate import check_output_dirs

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"is empty; give a folder"):
        check_output_dirs([override], multirun=multirun)
    assert list(tmp_path.iterdir()) == []  # nothing written into the current folder


@pytest.mark.parametrize("sub, says", [("", "is a file"), ("below", "is inside")])
def test_a_cache_dir_that_is_a_file_is_named(tmp_path, sub, says):
    from emma.validate import _check_cache

    f = tmp_path / "file"
    f.write_text("x")
    out: list = []
    _check_cache({"cache_dir": str(f / sub) if sub else str(f)}, out)
    (v,) = out
    assert v.key == "paths.cache_dir" and says in v.valid and f.read_text() == "x"


def test_a_judge_setting_under_classifier_auto_names_the_concrete_judge(capsys):
    from emma.run import preflight

    assert preflight(["classifier.threshold=0.9", "domain=tinyworld_style"]) == exit_codes.USER_ERROR
    line = _one_line(capsys.readouterr().err)
    assert "classifier=auto takes no settings of its own" in line
    assert "(domain 'tinyworld_style': 'tinyworld')" in line
    assert "classifier=tinyworld classifier.threshold=0.9" in line


def test_local_model_folders_of_a_sweep_are_checked_before_any_job(tmp_path, capsys):
    from emma.run import preflight

    bad = tmp_path / "pipe"
    bad.mkdir()
    (bad / "model_index.json").write_text("")
    sweep = tmp_path / "sweep"
    argv = ["-m", "model=sd14", "model.device=cpu", f"model.pretrained={bad},{tmp_path / 'nowhere'}",
            "classifier=tinyworld", "classifier.weights=null", f"hydra.sweep.dir={sweep}"]
    assert preflight(argv) == exit_codes.USER_ERROR
    err = capsys.readouterr().err
    assert "(2 of 2 cells; no job was started)" in err
    assert f"model.pretrained folder '{bad}' is not a diffusers pipeline folder" in err
    assert f"model.pretrained '{tmp_path / 'nowhere'}' looks like a local path but does not exist" in err
    assert not sweep.exists() and "Traceback" not in err


def test_a_failing_error_json_write_is_a_warning(tmp_path, monkeypatch, capsys):
    import emma.files
    from emma.errors import DiskFullError
    from emma.run import _write_error

    def full(path, text, what="a file"):
        raise DiskFullError(path, what, len(text))

    monkeypatch.setattr(emma.files, "atomic_write_text", full)
    _write_error(tmp_path, RuntimeError("the cell's own error"))
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"warning: could not write {tmp_path / 'error.json'} (no space left")


# ------------------------------------------------------------------ the leaderboard reads damaged folders
def _result(folder: Path, **changes: Any) -> Path:
    folder.mkdir(parents=True)
    data = {"schema_version": 2, "config": {"seed": 0}, "versions": {"components": {}}, "timing": {},
            "counts": {"evidence_images": 1}, "notes": [],
            "cell": {"model": "m", "method": "none", "domain": "d", "concept": "c", "attacker": "static",
                     "classifier": "j"},
            "metrics": {"ea/name": {"value": 0.5, "ci_low": 0.2, "ci_high": 0.8, "n": 10}}}
    data.update(changes)
    (folder / "results.json").write_text(json.dumps(data))
    ev = folder / "evidence"
    ev.mkdir()
    from PIL import Image

    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(ev / "img.png")
    (ev / "index.json").write_text(json.dumps([{"file": "img.png", "prompt": "a c", "seed": 0, "group": "ea",
                                                "kind": "name", "concept": "c", "detected": True, "score": 0.9}]))
    return folder


def test_damaged_evidence_and_error_files_are_warnings_not_tracebacks(tmp_path, capsys):
    from leaderboards.build import main

    runs = tmp_path / "runs"
    _result(runs / "ok")
    (_result(runs / "index") / "evidence" / "index.json").write_text("{trunc")
    (_result(runs / "png") / "evidence" / "img.png").unlink()
    traversal = _result(runs / "escape", config={"seed": 3})
    secret = tmp_path / "secret.png"
    shutil.copy(traversal / "evidence" / "img.png", secret)
    index = json.loads((traversal / "evidence" / "index.json").read_text())
    index[0]["file"] = "../../../secret.png"
    (traversal / "evidence" / "index.json").write_text(json.dumps(index))
    (runs / "crashed").mkdir()
    (runs / "crashed" / "error.json").write_text("[1, 2]")
    _result(runs / "counts", counts=[1], config={"seed": 9})
    assert main([str(runs), "--out", str(tmp_path / "board")]) == exit_codes.OK
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    assert f"warning: {runs / 'index' / 'evidence' / 'index.json'}: unreadable evidence index" in out.err
    assert f"warning: {runs / 'png' / 'evidence'}: 1 image file(s) of the evidence index are missing" in out.err
    assert f"warning: {runs / 'counts' / 'results.json'}: counts is a list, not an object" in out.err
    assert f"failed cell: {runs / 'crashed'}: error.json holds a list" in out.err
    assert "4 cell(s), 1 failed, 1 invalid, 0 missing" in out.out
    html = (tmp_path / "board" / "index.html").read_text()
    # the image outside the folder is never embedded; the good cell's is
    assert html.count("data:image/png;base64,") == 1 + len(list((tmp_path / "board" / "plots").glob("*.png")))


def test_an_unwritable_out_is_one_line_with_exit_2(tmp_path, capsys):
    from leaderboards.build import main

    _result(tmp_path / "runs" / "ok")
    out = "/proc/emma-no-such-board"
    assert main([str(tmp_path / "runs"), "--out", out]) == exit_codes.USER_ERROR
    line = _one_line(capsys.readouterr().err)
    assert line.startswith(f"error: cannot write the leaderboard to --out '{out}'")


def test_a_full_disk_while_writing_the_board_exits_3(tmp_path, monkeypatch, capsys):
    from leaderboards.build import main

    _result(tmp_path / "runs" / "ok")
    real = os.replace

    def full(src, dst, *a, **k):
        if str(dst).endswith(".md"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", full)
    assert main([str(tmp_path / "runs"), "--out", str(tmp_path / "board")]) == exit_codes.DISK_FULL
    err = capsys.readouterr().err
    assert "error: no space left on the device while storing a file at" in err and "Traceback" not in err
    assert not [p for p in (tmp_path / "board").rglob("*.tmp")]


@pytest.mark.parametrize("cell, says", [
    ({"model": "m"}, "results.json's cell lacks ['method', 'domain', 'concept', 'attacker', 'classifier']"),
    ([1], "must be objects"),
])
def test_a_results_json_without_a_cell_is_one_line_with_exit_2(tmp_path, capsys, cell, says):
    from leaderboards.build import main

    _result(tmp_path / "runs" / "bad", cell=cell)
    assert main([str(tmp_path / "runs"), "--out", str(tmp_path / "board")]) == exit_codes.USER_ERROR
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("error: ") and says in line and str(tmp_path / "runs" / "bad") in line
