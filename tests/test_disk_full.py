"""A full disk while a cell stores its erased model, images or results: one line naming the
path and the space needed, exit code 3 (``emma.exit_codes.DISK_FULL``), no temporary file or
folder and no lock left behind, and the same command run again (with space) recovers.

The end-to-end cases run the CLI on a real 8 MiB tmpfs when this machine lets the tests mount
one (root with CAP_SYS_ADMIN), and through an injected ``ENOSPC`` (``sitecustomize``) everywhere.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from emma import exit_codes
from emma.errors import DiskFullError, EmmaError, is_disk_full
from emma.files import atomic_write_bytes, atomic_write_text
from tests.conftest import ROOT, run_env
from tests.erasure_fixtures import Shift

FAST = ["images_per_prompt=1", "prompt_types=[name]", "metrics=rates_only"]


def _error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr and 'File "' not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if "error:" in line]


def _leftovers(root: Path) -> list[Path]:
    """Temporary files or folders and lock files under ``root``."""
    return [p for p in root.rglob("*") if p.name.endswith(".tmp") or p.name.endswith(".lock")]


# ------------------------------------------------------------------ the atomic write
def test_a_full_disk_in_an_atomic_write_names_the_path_and_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "results.json"
    target.write_text("old")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DiskFullError) as info:
        atomic_write_text(target, "x" * 5000, what="results.json")
    msg = str(info.value)
    assert f"while storing results.json at {target} (it needs about 4.9 KiB, " in msg and "free there" in msg
    assert "\n" not in msg and info.value.exit_code == exit_codes.DISK_FULL == 3
    assert target.read_text() == "old" and _leftovers(tmp_path) == []


def test_another_os_error_is_not_called_a_full_disk_and_leaves_nothing(tmp_path, monkeypatch):
    def denied(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "replace", denied)
    with pytest.raises(PermissionError):
        atomic_write_bytes(tmp_path / "a.bin", b"abc")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("err, full", [
    (OSError(errno.ENOSPC, "No space left on device"), True),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
    (RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"), True),
    (OSError(errno.EIO, "Input/output error"), False),
    (ValueError("space"), False),
])
def test_is_disk_full(err, full):
    assert is_disk_full(err) is full
    try:
        try:
            raise err
        except Exception as inner:
            raise RuntimeError("while saving") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer) is full  # a library's wrapper around the OS error


# ------------------------------------------------------------------ the erased model
def test_a_full_disk_while_storing_the_erased_model_leaves_no_tmp_folder_nor_lock(pipe, tmp_path, monkeypatch):
    from diffusers import UNet2DConditionModel

    from emma.erase import erase_cached
    from emma.pipelines import fingerprint

    base = fingerprint(pipe)
    real_save = UNet2DConditionModel.save_pretrained

    def full(self, folder, **kw):  # as safetensors' Rust writer reports it
        real_save(self, folder, **kw)  # some bytes land first
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(UNet2DConditionModel, "save_pretrained", full)
    with pytest.raises(DiskFullError) as info:
        erase_cached(pipe, Shift(), ["circle"], tmp_path, base_fingerprint=base)
    msg = str(info.value)
    assert "while storing the erased model at" in msg and str(tmp_path / "erased") in msg and "it needs about" in msg
    assert list((tmp_path / "erased").iterdir()) == []  # no .tmp folder, no .lock

    monkeypatch.setattr(UNet2DConditionModel, "save_pretrained", real_save)
    again = erase_cached(pipe, Shift(), ["circle"], tmp_path, base_fingerprint=base)  # space again: recovers
    assert not again.cached and [p.name for p in (tmp_path / "erased").iterdir()] == [again.key]


def test_the_erase_lock_is_removed_and_a_stale_one_taken_over(tmp_path):
    from emma.erase import erase_lock

    stale = tmp_path / ".k.lock"
    stale.write_text("")  # left by a killed job: holds no lock
    with erase_lock(tmp_path, "k"):
        assert stale.exists()
    assert not stale.exists()


def test_a_full_disk_while_writing_evidence_is_one_line(tmp_path, monkeypatch):
    import numpy as np

    from emma.api.types import Sample
    from emma.evidence import write_evidence

    class Gen:
        negative_prompt = None

        class cache:  # noqa: N801 - a stand-in for the image cache
            @staticmethod
            def get(key):
                return np.zeros((8, 8, 3), dtype=np.uint8)

        @staticmethod
        def image_key(prompt, seed, negative):
            return "k"

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full)
    sample = Sample(prompt="a circle", seed=0, concept="circle", kind="name", group="ea", image_hash="ab" * 32,
                    score=0.9, detected=True)
    with pytest.raises(DiskFullError, match="storing an evidence image at .*evidence"):
        write_evidence(Gen(), [sample], tmp_path)
    assert _leftovers(tmp_path) == []


# ------------------------------------------------------------------ the CLI: exit 3 and a re-run recovers
INJECT = '''
import errno, os
_replace = os.replace
def _full(src, dst, *a, **k):
    if os.environ.get("EMMA_TEST_FULL", "") in str(dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _replace(src, dst, *a, **k)
if os.environ.get("EMMA_TEST_FULL"):
    os.replace = _full
'''


def _run(args: list[str], cache: Path, **env: str) -> subprocess.CompletedProcess:
    e = run_env(cache, **env)
    return subprocess.run([sys.executable, "-m", "emma.run", *args], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=600)


def test_cli_disk_full_while_storing_images_exits_3_and_a_rerun_recovers(tmp_path):
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(INJECT)
    cache, run = tmp_path / "cache", tmp_path / "run"
    args = ["method=none", *FAST, f"hydra.run.dir={run}"]
    full = _run(args, cache, EMMA_TEST_FULL=f"{os.sep}images{os.sep}",
                PYTHONPATH=f"{tmp_path / 'inject'}{os.pathsep}{ROOT}")
    assert full.returncode == exit_codes.DISK_FULL, full.stderr[-3000:]
    (line,) = _error_lines(full.stderr)
    assert line.startswith("error: no space left on the device while storing an image at ")
    assert f"{cache / 'images'}" in line and "it needs about" in line and "run the same command again" in line
    assert _leftovers(cache) == [] and _leftovers(run) == [] and not (run / "results.json").exists()

    again = _run(args, cache)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((run / "results.json").read_text())["counts"]["images"] == 1


@pytest.fixture
def tmpfs(tmp_path):
    """An 8 MiB tmpfs, if this machine lets the tests mount one; unmounted afterwards."""
    where = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode}); "
                    "the injected ENOSPC tests cover the same paths")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_cli_real_full_disk_while_storing_the_erased_model(tmpfs, tmp_path):
    cache, run = tmpfs / "cache", tmp_path / "run"
    args = ["method=uce", *FAST, f"hydra.run.dir={run}"]
    full = _run(args, cache)
    assert full.returncode == exit_codes.DISK_FULL, full.stderr[-3000:]
    (line,) = _error_lines(full.stderr)
    assert f"while storing the erased model at {cache / 'erased'}" in line
    m = re.search(r"it needs about ([\d.]+) MiB, ([\d.]+) (MiB|KiB|bytes) free there", line)
    assert m and float(m.group(1)) > 8 * 0.9, line  # the tiny world's UNet: more than the 8 MiB there
    assert list((cache / "erased").iterdir()) == [] and _leftovers(run) == []
    # the re-run with space is test_a_full_disk_while_storing_the_erased_model_leaves_no_tmp_folder_nor_lock's


def test_every_disk_full_error_is_an_emma_error():
    assert issubclass(DiskFullError, EmmaError) and DiskFullError("/x").exit_code == 3
