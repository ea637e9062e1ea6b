"""A cache that heals: every kind of cached artefact (image PNG, judge score, FID statistics,
erased model manifest and weights) is truncated, corrupted, or replaced by a valid but
different file; the re-run moves it to the quarantine, recomputes it, reports the repair, and
yields the same metrics as the clean run.

A regenerated image is drawn in a batch of one where the clean run drew it in a batch of five,
and CPU kernels may round a batch of one differently: on an AMD EPYC machine one pixel of it
moves by one level, which moves FID by 2e-7 of its value and no rate. So rates are compared
exactly, FID to 1e-4 of its value, and a healed image to the original pixel by pixel."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from PIL import Image

from emma.cache import ImageCache, ScoreCache, pixel_hash, repair_mark, repairs_since
from emma.cell import run_cell
from emma.registry import register_configs
from tests.conftest import ROOT

CELL = ["model=tiny_random", "classifier=tinyworld", "classifier.weights=null", "method=uce",
        "images_per_prompt=1", "prompt_types=[name,variant]", "metrics.bias.enabled=false",
        "metrics.fid.n_ref=16", "paths.reuse_results=false"]  # heal, not serve the stored result
KINDS = ("image", "score", "fid_statistics", "erased_manifest", "erased_weights")
MODES = ("truncate", "corrupt", "replace")


def _cfg(cache: Path):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=[*CELL, f"paths.cache_dir={cache}"])


def _run(cache: Path, out: Path, monkeypatch):
    monkeypatch.setenv("EMMA_CACHE", str(cache))  # FID statistics live under $EMMA_CACHE
    return run_cell(_cfg(cache), out)


def _rates(result) -> dict:
    return {k: v.to_json() for k, v in result.metrics.items() if not k.startswith("time/")}


def _assert_same_numbers(got: dict, reference: dict) -> None:
    """Every rate exactly as in ``reference``; FID and its interval to 1e-4 of their values."""
    assert set(got) == set(reference)
    assert {k: v for k, v in got.items() if k != "fid"} == {k: v for k, v in reference.items() if k != "fid"}
    fid, ref = got["fid"], reference["fid"]
    rest = lambda m: {k: v for k, v in m.items() if k not in FID_FLOATS}  # noqa: E731
    assert rest(fid) == rest(ref)
    assert [fid[k] for k in FID_FLOATS] == pytest.approx([ref[k] for k in FID_FLOATS], rel=1e-4)


FID_FLOATS = ("value", "ci_low", "ci_high")


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """One clean cell: its cache (the template every case damages) and its metrics."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("heal")
    try:
        result = _run(root / "cache", root / "clean", mp)
    finally:
        mp.undo()
    assert result.counts["cache_repairs"] == 0
    assert {"ea/name", "ea/variant", "fid"} <= set(result.metrics)
    return root / "cache", _rates(result)


def _target(cache: Path, kind: str) -> Path:
    if kind == "image":
        return sorted((cache / "images").rglob("*.png"))[0]
    if kind == "score":  # not the score of the image the "image" cases damage: a regenerated
        # image that differs by a level of rounding gets a new pixel hash, so its old score
        # would never be read again, and never repaired
        first_image = pixel_hash(np.asarray(Image.open(_target(cache, "image")).convert("RGB")))
        return sorted(p for p in (cache / "scores").rglob("*.npz") if p.stem != first_image)[0]
    if kind == "fid_statistics":
        (path,) = (cache / "fid_stats").glob("*.npz")
        return path
    (entry,) = [p for p in (cache / "erased").iterdir() if not p.name.startswith(".")]  # not the erase lock
    if kind == "erased_manifest":
        return entry / "manifest.json"
    return entry / "unet" / "diffusion_pytorch_model.safetensors"


def _replace_valid(cache: Path, kind: str, path: Path) -> None:
    """A file of the right format, readable by its loader, with other content."""
    if kind in ("image", "score"):
        other = sorted(p for p in path.parent.parent.rglob(f"*{path.suffix}") if p != path)[0]
        shutil.copyfile(other, path)  # another entry's (complete, self-consistent) file
    elif kind == "fid_statistics":
        from emma.metrics.fid import ReferenceStatistics

        feats = np.random.default_rng(1).normal(size=(40, 64))
        ReferenceStatistics.from_features(feats, name="tinyworld", extractor="tinyworld-judge-features").save(path)
    elif kind == "erased_manifest":
        manifest = json.loads(path.read_text())
        manifest["wall_time_s"] = 0.001
        path.write_text(json.dumps(manifest, indent=2))
    else:
        from safetensors.torch import load_file, save_file

        state = load_file(str(path))
        save_file({k: v * 0.5 for k, v in state.items()}, str(path))


def _damage(cache: Path, kind: str, mode: str) -> Path:
    path = _target(cache, kind)
    data = path.read_bytes()
    if mode == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif mode == "corrupt":
        mid = len(data) // 2
        path.write_bytes(data[:mid] + bytes(b ^ 0xFF for b in data[mid : mid + 16]) + data[mid + 16 :])
    else:
        _replace_valid(cache, kind, path)
    assert path.read_bytes() != data
    return path


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_damaged_entry_is_quarantined_recomputed_and_reported(kind, mode, clean, tmp_path, monkeypatch):
    template, reference = clean
    cache = tmp_path / "cache"
    shutil.copytree(template, cache)
    damaged = _damage(cache, kind, mode)
    entry_kind = "erased_model" if kind.startswith("erased") else kind

    result = _run(cache, tmp_path / "rerun", monkeypatch)

    _assert_same_numbers(_rates(result), reference)  # the numbers of the clean run
    assert result.counts["cache_repairs"] == 1
    (note,) = [n for n in result.notes if n.startswith("cache repaired")]
    assert f"{entry_kind} 1" in note
    quarantined = [p for p in (cache / "quarantine").rglob("*") if p.is_file()]
    assert quarantined, "the damaged file is kept in the quarantine, not deleted"
    moved = damaged.parent if kind.startswith("erased") else damaged
    assert any(moved.name in str(p) for p in quarantined)
    healed = _target(cache, kind)  # recomputed in place, and it verifies again
    assert healed.exists()
    if kind == "image":  # the image the clean run drew, up to rounding (a wrong image moves far more)
        original = np.asarray(Image.open(template / healed.relative_to(cache)), dtype=np.int16)
        moved = np.abs(np.asarray(Image.open(healed), dtype=np.int16) - original)
        assert moved.max() <= 2 and (moved > 0).mean() < 0.01  # measured: one pixel, one level
    saved = json.loads((tmp_path / "rerun" / "results.json").read_text())
    assert saved["counts"]["cache_repairs"] == 1 and any("cache repaired" in n for n in saved["notes"])


def test_healed_cache_runs_clean_the_second_time(clean, tmp_path, monkeypatch):
    template, reference = clean
    cache = tmp_path / "cache"
    shutil.copytree(template, cache)
    for kind in ("score", "image", "fid_statistics", "erased_weights"):  # the score reads the intact image
        _damage(cache, kind, "truncate")
    first = _run(cache, tmp_path / "a", monkeypatch)
    assert first.counts["cache_repairs"] == 4
    _assert_same_numbers(_rates(first), reference)
    second = _run(cache, tmp_path / "b", monkeypatch)
    assert second.counts["cache_repairs"] == 0 and second.counts["images_generated"] == 0
    assert _rates(second) == _rates(first)  # served from the healed cache: exactly the first re-run


# ------------------------------------------------------------------ the readers themselves
def test_image_cache_rejects_a_valid_black_png_and_another_entrys_png(tmp_path):
    cache = ImageCache(tmp_path)
    rng = np.random.default_rng(0)
    a, b = (rng.integers(0, 256, (8, 8, 3), dtype=np.uint8) for _ in range(2))
    assert cache.put("a" * 64, a) == pixel_hash(a)
    cache.put("b" * 64, b)
    assert np.array_equal(cache.get("a" * 64), a)
    mark = repair_mark()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(cache.path("a" * 64))  # a valid PNG, no record
    assert cache.get("a" * 64) is None
    shutil.copyfile(cache.path("b" * 64), cache.path("a" * 64))  # a valid entry of another key
    assert cache.get("a" * 64) is None
    reasons = [r.reason for r in repairs_since(mark)]
    assert reasons[0].startswith("no emma record") and reasons[1].startswith("holds entry bbbbbbbbbbbb")
    assert not cache.path("a" * 64).exists() and np.array_equal(cache.get("b" * 64), b)


def test_image_cache_record_takes_extra_fields(tmp_path):
    cache = ImageCache(tmp_path)
    img = np.full((8, 8, 3), 7, np.uint8)
    cache.put("c" * 64, img, meta={"generation_s": 0.25})
    arr, meta = cache.get_entry("c" * 64)
    assert np.array_equal(arr, img) and meta["generation_s"] == 0.25 and meta["sha256"] == pixel_hash(img)


def test_score_cache_rejects_wrong_label_count_and_out_of_range_values(tmp_path):
    scores = ScoreCache(tmp_path, "judge-v1")
    h = "d" * 64
    scores.put(h, np.array([0.2, 0.8], np.float32))
    assert np.allclose(scores.get(h, n_labels=2), [0.2, 0.8])
    assert scores.get(h, n_labels=3) is None  # a judge with 3 labels cannot use it
    scores.put(h, np.array([0.2, 1.7], np.float32))
    assert scores.get(h) is None
