"""Faults a user can run into with a local model folder, a damaged image cache or a
leaderboard output path: each is a one-line error with exit code 2, or is healed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from emma import weights
from emma.errors import EmmaError, WeightsUnavailableError
from emma.pipelines import load_pipeline
from tests.conftest import ROOT, run_env

FAST = ["classifier=tinyworld", "classifier.weights=null", "metrics=rates_only", "prompt_types=[name]",
        "images_per_prompt=1"]
TINY = ["model=tiny_random", *FAST]


def emma_run(args: list[str], cache: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "emma.run", *args], cwd=ROOT, env=run_env(cache),
                          capture_output=True, text=True, timeout=timeout)


def _one_line(msg: str) -> str:
    assert "Traceback" not in msg and 'File "' not in msg, msg
    lines = msg.strip().splitlines()
    assert len(lines) == 1, msg
    return lines[0]


# --------------------------------------------------------------------------- 1. invalid model_index.json
@pytest.mark.parametrize("index, problem", [
    ("", "not valid JSON"),
    ("{not json", "not valid JSON"),
    ("{}", "no `_class_name`"),
    ('{"unet": ["diffusers", "UNet2DConditionModel"]}', "no `_class_name`"),
    ("[]", "holds a list, not an object"),
    (None, "has no model_index.json"),
])
def test_local_folder_with_invalid_model_index_is_a_one_line_error(index, problem, tmp_path):
    folder = tmp_path / "pipe"
    folder.mkdir()
    if index is not None:
        (folder / "model_index.json").write_text(index)
    with pytest.raises(EmmaError) as info:  # printed by the CLI as one line, exit 2
        load_pipeline({"kind": "diffusers", "pretrained": str(folder)})
    line = _one_line(str(info.value))
    assert f"folder {str(folder)!r} is not a diffusers pipeline folder" in line
    assert problem in line and "model_index.json" in line and "`_class_name`" in line and "subfolder" in line
    assert "huggingface-cli" not in line


def test_local_folder_missing_a_component_subfolder_names_it(tmp_path):
    folder = tmp_path / "pipe"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusionPipeline", "safety_checker": [None, None],
        "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"]}))
    (folder / "vae").mkdir()
    with pytest.raises(WeightsUnavailableError) as info:
        load_pipeline({"kind": "diffusers", "pretrained": str(folder)})
    assert "it lacks the subfolder unet;" in _one_line(str(info.value))


def test_cli_invalid_model_index_exits_2_with_one_line(tmp_path):
    folder = tmp_path / "pipe"
    folder.mkdir()
    (folder / "model_index.json").write_text("{}")
    proc = emma_run(["model=sd14", "domain=tinyworld", "model.device=cpu", f"model.pretrained={folder}", *FAST,
                     f"hydra.run.dir={tmp_path / 'run'}"], tmp_path / "cache")
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = _one_line(proc.stderr)
    assert line.startswith("error: ") and str(folder) in line and "no `_class_name`" in line
    assert not (tmp_path / "run" / "results.json").exists()


# --------------------------------------------------------------------------- 2. missing local folder
@pytest.mark.parametrize("spec", ["/no/such/emma-dir", "./no-such-emma-dir", "~/no-such-emma-dir",
                                  "../no-such-emma-dir", "a/b/no-such-emma-dir"])
def test_missing_local_path_is_told_as_a_path_not_a_download(spec):
    with pytest.raises(WeightsUnavailableError) as info:
        load_pipeline({"kind": "diffusers", "pretrained": spec})
    line = _one_line(str(info.value))
    assert "does not exist" in line and "huggingface-cli" not in line
    assert repr(str(Path(spec).expanduser()) if spec.startswith("~") else spec) in line


def test_hub_id_keeps_the_download_advice():
    with pytest.raises(WeightsUnavailableError) as info:
        load_pipeline({"kind": "diffusers", "pretrained": "emma-test-org/no-such-model"})
    msg = str(info.value)
    assert "huggingface-cli download emma-test-org/no-such-model" in msg and "does not exist" not in msg


def test_looks_like_path():
    for spec in ("/abs", "./x", "../x", "~/x", "a/b/c", "C:\\models\\sd", "."):
        assert weights.looks_like_path(spec), spec
    for spec in ("CompVis/stable-diffusion-v1-4", "gpt2", "nudenet_320"):
        assert not weights.looks_like_path(spec), spec


def test_missing_classifier_weights_path_is_told_as_a_path(tmp_path):
    missing = tmp_path / "nope.pth"
    with pytest.raises(WeightsUnavailableError, match=f"weights path {str(missing)!r} does not exist"):
        weights.resolve_weights(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsUnavailableError, match="holds no files"):
        weights.resolve_weights(tmp_path / "empty")
    with pytest.raises(WeightsUnavailableError, match="neither a registry entry"):
        weights.resolve_weights("nudenet320")


def test_cli_missing_local_folder_exits_2_with_one_line(tmp_path):
    proc = emma_run(["model=sd14", "domain=tinyworld", "model.device=cpu", "model.pretrained=/no/such/emma-dir", *FAST,
                     f"hydra.run.dir={tmp_path / 'run'}"], tmp_path / "cache")
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = _one_line(proc.stderr)
    assert line.startswith("error: ") and "'/no/such/emma-dir'" in line and "does not exist" in line
    assert "huggingface-cli" not in line


# --------------------------------------------------------------------------- 3. image shard replaced by a file
def test_image_shard_replaced_by_a_file_is_healed(tmp_path):
    clean = emma_run([*TINY, f"hydra.run.dir={tmp_path / 'clean'}"], tmp_path / "clean_cache")
    assert clean.returncode == 0, clean.stderr[-2000:]
    shards = sorted(p.name for p in (tmp_path / "clean_cache" / "images").iterdir() if p.is_dir())
    assert shards
    cache = tmp_path / "cache"
    (cache / "images").mkdir(parents=True)
    for name in shards:
        (cache / "images" / name).write_bytes(b"not a folder")

    healed = emma_run([*TINY, f"hydra.run.dir={tmp_path / 'healed'}"], cache)
    assert healed.returncode == 0, healed.stderr[-2000:]
    ref = json.loads((tmp_path / "clean" / "results.json").read_text())
    res = json.loads((tmp_path / "healed" / "results.json").read_text())

    def rates(r):
        return {k: v for k, v in r["metrics"].items() if not k.startswith("time/")}

    assert rates(res) == rates(ref) and rates(ref)
    assert res["counts"]["cache_repairs"] == len(shards)
    (note,) = [n for n in res["notes"] if n.startswith("cache repaired")]
    assert f"(image {len(shards)})" in note and "is a file where the cache keeps a folder" in note
    assert all((cache / "images" / name).is_dir() for name in shards)
    moved = [p for p in (cache / "quarantine").rglob("*") if p.is_file()]
    assert len(moved) == len(shards) and all(p.read_bytes() == b"not a folder" for p in moved)


# --------------------------------------------------------------------------- 4. leaderboard --out is a file
@pytest.mark.parametrize("sub", ["", "board"])
def test_leaderboard_out_that_is_a_file_exits_2_with_one_line(sub, tmp_path):
    out = tmp_path / "taken"
    out.write_text("precious")
    target = out / sub if sub else out
    proc = subprocess.run([sys.executable, "-m", "leaderboards.build", str(tmp_path), "--out", str(target)],
                          cwd=ROOT, env=run_env(tmp_path / "cache"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = _one_line(proc.stderr)
    assert line.startswith("error: --out ") and repr(str(target)) in line and "a file" in line
    assert out.read_text() == "precious"
