"""Stale temporaries: a killed writer's ``*.<pid>.tmp`` files and folders are removed, a live
writer's are kept and never entered, and folders that other processes rename away while the
sweep walks do not stop it (two cells sharing one cache)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from emma.cache import TMP_SUFFIX, sweep_stale_tmp


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_dead_writers_temporaries_go_and_live_ones_stay_unentered(tmp_path):
    dead, live = _dead_pid(), os.getpid()
    (tmp_path / "images" / "ab").mkdir(parents=True)
    stale_file = tmp_path / "images" / "ab" / f"x.png.{dead}{TMP_SUFFIX}"
    stale_file.write_bytes(b"half")
    stale_dir = tmp_path / f".entry.{dead}{TMP_SUFFIX}"
    (stale_dir / "unet").mkdir(parents=True)
    (stale_dir / "unet" / "w.safetensors").write_bytes(b"half")
    own = tmp_path / f".mine.{live}{TMP_SUFFIX}"
    own.mkdir()
    inner = own / f"part.{dead}{TMP_SUFFIX}"  # inside a live writer's folder: its business
    inner.write_bytes(b"")
    kept = tmp_path / "images" / "ab" / "y.png"
    kept.write_bytes(b"png")

    assert sweep_stale_tmp(tmp_path) == 2
    assert not stale_file.exists() and not stale_dir.exists()
    assert own.is_dir() and inner.exists() and kept.exists()


def test_a_folder_renamed_away_during_the_walk_does_not_stop_the_sweep(tmp_path, monkeypatch):
    dead = _dead_pid()
    vanishing = tmp_path / "erased" / f".other.{os.getppid()}{TMP_SUFFIX}x"  # not a temporary: entered
    vanishing.mkdir(parents=True)
    stale = tmp_path / "erased" / f"w.{dead}{TMP_SUFFIX}"
    stale.write_bytes(b"")
    real = os.scandir

    def scandir(path=".", *a, **kw):
        if Path(path) == vanishing:  # another process renamed it after its parent was listed
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "scandir", scandir)
    assert sweep_stale_tmp(tmp_path) == 1 and not stale.exists()
