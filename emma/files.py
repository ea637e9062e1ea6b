"""Files written atomically and hashed in chunks: the one implementation every part of the
harness uses (caches, results, downloads, the finished-cell lookup, leaderboards, STACE).

A file is written under a temporary name carrying the writer's pid (``.<name>.<pid>.tmp``)
and renamed into place (``os.replace`` is atomic on POSIX), so a reader sees the old file or
the complete new one, and a killed writer leaves only a ``*.tmp`` that
:func:`emma.cache.sweep_stale_tmp` removes once no live process owns it.

Standard library only: :mod:`emma.finished` (the hit path of ``python -m emma.run``) and
result readers import this without numpy or torch.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".tmp"
CHUNK = 1 << 20  # bytes read at a time when hashing a file


def tmp_name(path: Path) -> Path:
    """Where :func:`atomic_write_bytes` writes ``path`` before the rename."""
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def atomic_write_bytes(path: str | os.PathLike, data: bytes, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` via a temporary file and a rename.

    The rename makes the write atomic for readers and against a killed process; ``fsync``
    additionally makes it durable against power loss (costly for many small files).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` encoded as UTF-8."""
    atomic_write_bytes(path, text.encode())


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def update_with_file(h: Any, path: str | os.PathLike) -> None:
    """Feed the bytes of ``path`` to the hash object ``h`` (``hashlib``), a chunk at a time."""
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            h.update(chunk)


def sha256_file(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    update_with_file(h, path)
    return h.hexdigest()
