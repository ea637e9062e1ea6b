"""The finished-cell cache verifies what it serves: every stored file is checked against the
entry's manifest (sha256 and size) before anything is copied into a run directory. A
truncated, edited or incomplete entry (or one stored without checksums) is moved to the
quarantine, the cell is computed again with the metrics of the clean run, and its notes say
the cache was repaired. A sweep being resumed runs again a cell whose results.json is not a
finished cell's results."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from emma import finished
from emma.cell import run_cell
from emma.registry import register_configs
from tests.conftest import ROOT, run_env

CELL = ["model=tiny_random", "classifier=tinyworld", "classifier.weights=null", "metrics=rates_only",
        "prompt_types=[name]", "images_per_prompt=1"]
DAMAGES = ("truncate_results", "edit_value", "truncate_samples", "missing_key_file", "no_manifest", "edit_evidence")


def _cfg(cache: Path):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=[*CELL, f"paths.cache_dir={cache}"])


def _rates(metrics: dict) -> dict:
    return {k: v.to_json() for k, v in metrics.items() if not k.startswith("time/")}


def _samples(run_dir: Path) -> list[dict]:
    """samples.jsonl less ``cached`` (a recomputed cell finds its images in the cache)."""
    lines = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if k != "cached"} for x in lines]


def _unserved(path: Path) -> dict:
    """A results.json less its ``served_from_cache`` record (a served copy says when it was served)."""
    return {k: v for k, v in json.loads(path.read_text()).items() if k != "served_from_cache"}


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _entry(cache: Path) -> Path:
    (found,) = (cache / "results").iterdir()
    return found


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """One computed cell: its cache (the template each case damages), run directory and metrics."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("finished")
    try:
        mp.setenv("EMMA_CACHE", str(root / "cache"))
        result = run_cell(_cfg(root / "cache"), root / "clean")
    finally:
        mp.undo()
    assert result.counts["cache_repairs"] == 0 and "ea/name" in result.metrics
    entry = _entry(root / "cache")
    assert sorted(p.name for p in entry.iterdir()) == ["evidence", "key.json", "manifest.json", "results.json",
                                                       "samples.jsonl"]
    return root / "cache", root / "clean", _rates(result.metrics)


def _copy_cache(clean, tmp_path: Path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(clean[0], cache)
    monkeypatch.setenv("EMMA_CACHE", str(cache))
    return cache


def _damage(entry: Path, how: str) -> None:
    if how == "truncate_results":
        data = (entry / "results.json").read_bytes()
        (entry / "results.json").write_bytes(data[: len(data) // 2])
    elif how == "edit_value":  # valid JSON, same size: only the checksum tells
        data = json.loads((entry / "results.json").read_text())
        value = data["metrics"]["ea/name"]["value"]
        text = (entry / "results.json").read_text()
        old = f'"value": {json.dumps(value)}'
        new = f'"value": {json.dumps(1.0 if value != 1.0 else 0.0)}'
        new += " " * (len(old) - len(new)) if len(new) < len(old) else ""
        assert text.count(old) >= 1
        (entry / "results.json").write_text(text.replace(old, new, 1))
    elif how == "truncate_samples":
        data = (entry / "samples.jsonl").read_bytes()
        (entry / "samples.jsonl").write_bytes(data[: len(data) // 2])
    elif how == "missing_key_file":
        (entry / "key.json").unlink()
    elif how == "no_manifest":  # an entry stored before manifests existed: unverifiable
        (entry / "manifest.json").unlink()
    elif how == "edit_evidence":  # an evidence image with other pixels, same size
        image = sorted((entry / "evidence").glob("*.png"))[0]
        data = bytearray(image.read_bytes())
        data[-20] ^= 0xFF
        image.write_bytes(bytes(data))
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_entry_is_quarantined_and_recomputed(clean, how, tmp_path, monkeypatch):
    cache = _copy_cache(clean, tmp_path, monkeypatch)
    entry = _entry(cache)
    _damage(entry, how)
    damaged = _files(entry)
    cfg = _cfg(cache)
    # a pre-flight lookup only declines a damaged entry; the cell's own lookup repairs it
    assert finished.entry(cfg) is None and entry.is_dir()

    result = run_cell(cfg, tmp_path / "run")
    assert _rates(result.metrics) == clean[2]
    assert result.counts["cache_repairs"] == 1
    (note,) = [n for n in result.notes if n.startswith("cache repaired")]
    assert "finished_result 1" in note and str(entry) in note
    written = json.loads((tmp_path / "run" / "results.json").read_text())
    assert written["counts"]["cache_repairs"] == 1 and note in written["notes"]
    assert {k: v for k, v in written["metrics"].items() if not k.startswith("time/")} == clean[2]
    assert _samples(tmp_path / "run") == _samples(clean[1])

    # the damaged entry is kept, as it was, in the quarantine; a verified one replaces it
    (moved,) = (cache / "quarantine").rglob(f"{entry.name}.*")
    assert _files(moved) == damaged
    assert finished.entry(cfg) == entry
    served = run_cell(cfg, tmp_path / "again")
    assert served.counts["cache_repairs"] == 1  # the stored result of the repaired run, as it was
    assert _unserved(tmp_path / "again" / "results.json") == _unserved(tmp_path / "run" / "results.json")
    assert json.loads((tmp_path / "again" / "results.json").read_text())["served_from_cache"]["key"] == entry.name
    assert len(list((cache / "quarantine").rglob(f"{entry.name}.*"))) == 1  # nothing more quarantined


def test_an_intact_entry_is_served_and_repairs_nothing(clean, tmp_path, monkeypatch):
    cache = _copy_cache(clean, tmp_path, monkeypatch)
    result = run_cell(_cfg(cache), tmp_path / "run")
    assert result.counts["cache_repairs"] == 0 and _rates(result.metrics) == clean[2]
    assert _unserved(tmp_path / "run" / "results.json") == _unserved(clean[1] / "results.json")
    assert (tmp_path / "run" / "samples.jsonl").read_bytes() == (clean[1] / "samples.jsonl").read_bytes()
    assert not (cache / "quarantine").exists()


@pytest.mark.parametrize("name", finished.FILES)
def test_serve_copies_nothing_of_an_entry_damaged_after_lookup(clean, name, tmp_path, monkeypatch):
    cache = _copy_cache(clean, tmp_path, monkeypatch)
    found = finished.entry(_cfg(cache))
    assert found is not None
    data = (found / name).read_bytes()
    (found / name).write_bytes(data[: len(data) // 2])  # damaged between the lookup and the copy
    out = tmp_path / "run"
    with pytest.raises(finished.StoredResultChanged, match=f"{name} is {len(data) // 2} bytes"):
        finished.serve(found, out)
    assert list(out.iterdir()) == []  # not a half-copied file, not a temporary one
    assert not found.exists() and len(list((cache / "quarantine").rglob(f"{found.name}.*"))) == 1


def _sweep(cache: Path, sweep_dir: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "emma.run", "-m", *CELL, "concept=circle",
                           f"hydra.sweep.dir={sweep_dir}"],
                          cwd=ROOT, env=run_env(cache), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_resumed_sweep_reruns_a_cell_with_a_truncated_results_json(tmp_path):
    cache, sweep = tmp_path / "cache", tmp_path / "sweep"
    _sweep(cache, sweep)
    (done,) = sweep.glob("*/results.json")
    first = done.read_bytes()
    kept = _sweep(cache, sweep)  # an intact cell of a resumed sweep is kept as it is
    assert "finished cell of this sweep, kept" in kept.stdout and done.read_bytes() == first

    done.write_bytes(first[: len(first) // 3])
    resumed = _sweep(cache, sweep)
    warnings = [line for line in resumed.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and str(done) in warnings[0] and "running the cell again" in warnings[0]
    assert "kept" not in resumed.stdout
    # served again from the finished-cell cache, whole (and saying so)
    assert _unserved(done) == {k: v for k, v in json.loads(first).items() if k != "served_from_cache"}
    assert json.loads(done.read_text())["served_from_cache"] is not None


def test_resumed_sweep_reruns_a_cell_measured_with_other_settings(tmp_path):
    """A finished cell whose recorded settings differ from what the sweep would run now (a preset
    changed between the launches) runs again, saying which settings differ; paths do not count."""
    cache, sweep = tmp_path / "cache", tmp_path / "sweep"
    _sweep(cache, sweep)
    (done,) = sweep.glob("*/results.json")
    data = json.loads(done.read_text())
    data["config"]["paths"] = {"moved": "elsewhere"}  # not a setting: the cell is kept
    done.write_text(json.dumps(data))
    assert "finished cell of this sweep, kept" in _sweep(cache, sweep).stdout

    data["config"]["images_per_prompt"] = 7  # as if the sweep had run with another setting
    done.write_text(json.dumps(data))
    resumed = _sweep(cache, sweep)
    warnings = [line for line in resumed.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and str(done) in warnings[0] and "running the cell again" in warnings[0]
    assert "images_per_prompt: 7 -> 1" in warnings[0] and "kept" not in resumed.stdout
    assert json.loads(done.read_text())["config"]["images_per_prompt"] == 1

    data = json.loads(done.read_text())
    method_version = data["versions"]["components"]["method"]["version"]
    data["versions"]["components"]["method"]["version"] = "0"  # measured by older code of the method
    done.write_text(json.dumps(data))
    resumed = _sweep(cache, sweep)
    warnings = [line for line in resumed.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"method version: '0' -> {method_version!r}" in warnings[0]
    assert json.loads(done.read_text())["versions"]["components"]["method"]["version"] == method_version


def test_changed_settings_names_each_differing_key_and_ignores_the_rest():
    from emma.run import changed_settings

    old = {"method": {"la_strength": 200.0, "rank": 1}, "seed": 0, "paths": {"cache": "/a"}, "threads": 1}
    new = {"method": {"la_strength": 25.0, "rank": 1, "facilitated_transport": True}, "seed": 0,
           "paths": {"cache": "/b"}, "threads": 2}
    assert changed_settings(old, new) == ["method.facilitated_transport: '(unset)' -> True",
                                          "method.la_strength: 200.0 -> 25.0"]
    assert changed_settings(old, old) == []


def test_changed_versions_compares_the_recorded_component_versions_with_the_code():
    from emma.methods.esd import ESDMethod
    from emma.run import changed_versions

    current = {"method": {"_target_": "emma.methods.esd.ESDMethod"}, "attacker": {"_target_": "no.such.Class"}}
    recorded = {"components": {"method": {"version": ESDMethod.version}, "attacker": {"version": "1"}}}
    assert changed_versions(recorded, current) == []  # the attacker's class no longer imports: the run says so
    recorded["components"]["method"]["version"] = "0"
    assert changed_versions(recorded, current) == [f"method version: '0' -> {ESDMethod.version!r}"]
    assert changed_versions({}, current) == []  # a cell that recorded no versions
