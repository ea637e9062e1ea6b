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

import contextlib
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

from emma.errors import DiskFullError, is_disk_full

TMP_SUFFIX = ".tmp"
CHUNK = 1 << 20  # bytes read at a time when hashing a file


def tmp_name(path: Path) -> Path:
    """Where :func:`atomic_write_bytes` writes ``path`` before the rename."""
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def atomic_write_bytes(path: str | os.PathLike, data: bytes, fsync: bool = True, what: str = "a file") -> None:
    """Write ``data`` to ``path`` via a temporary file and a rename.

    The rename makes the write atomic for readers and against a killed process; ``fsync``
    additionally makes it durable against power loss (costly for many small files). A write
    that fails removes its temporary file; a full disk raises :class:`DiskFullError` naming
    ``path`` and the bytes needed.
    """
    path = Path(path)
    with storing(path, what, needed=len(data)):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = tmp_name(path)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise


@contextlib.contextmanager
def storing(path: str | os.PathLike, what: str = "a file", needed: int | None = None,
            cleanup: str | os.PathLike | None = None) -> Iterator[None]:
    """Turn a full disk (``ENOSPC``, ``EDQUOT``) inside the block into a one-line
    :class:`DiskFullError` naming ``path``, ``what`` is stored there and the ``needed`` bytes,
    after removing ``cleanup`` (a temporary file or folder the block was writing) whatever the
    error."""
    try:
        yield
    except BaseException as err:
        if cleanup is not None:
            remove_path(cleanup)
        if is_disk_full(err):
            raise DiskFullError(path, what, needed) from None
        raise


def remove_path(path: str | os.PathLike) -> None:
    """Remove a file or a folder tree, if there; never raises."""
    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            p.unlink()


def atomic_write_text(path: str | os.PathLike, text: str, what: str = "a file") -> None:
    """:func:`atomic_write_bytes` of ``text`` encoded as UTF-8."""
    atomic_write_bytes(path, text.encode(), what=what)


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
