"""The shared file helpers: atomic writes, chunked hashes, and a finished-cell lookup that
imports neither numpy nor torch."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

from emma import files
from tests.conftest import ROOT


def test_sha256_file_reads_every_chunk(tmp_path):
    data = bytes(range(256)) * (3 * files.CHUNK // 256 + 7)  # three full chunks and a partial one
    (tmp_path / "f").write_bytes(data)
    assert files.sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()
    assert files.sha256_bytes(data) == hashlib.sha256(data).hexdigest()
    h = hashlib.sha256(b"prefix")
    files.update_with_file(h, tmp_path / "f")
    assert h.hexdigest() == hashlib.sha256(b"prefix" + data).hexdigest()


def test_atomic_write_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "out.json"
    assert files.tmp_name(path) == tmp_path / "sub" / f".out.json.{os.getpid()}.tmp"
    files.atomic_write_text(path, "first")
    files.atomic_write_text(path, "second é")
    files.atomic_write_bytes(tmp_path / "sub" / "raw", b"\x00\x01", fsync=False)
    assert path.read_bytes() == "second é".encode()
    assert (tmp_path / "sub" / "raw").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.json", "raw"]


def test_finished_lookup_imports_no_numerical_library():
    code = ("import sys, emma.finished; "
            "print(sorted(m for m in ('torch', 'numpy', 'PIL', 'omegaconf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
