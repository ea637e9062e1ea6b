"""Errors that teach: what was wrong and what is valid."""

from __future__ import annotations

import difflib
import errno
import os
import shutil
from pathlib import Path
from typing import ClassVar, Iterable

from emma import exit_codes


def first_line(err: BaseException) -> str:
    """The first line of an error's message (its type's name when the message is empty)."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


class EmmaError(Exception):
    """Base class of the harness's user-facing errors (printed without a traceback); the
    command exits with the class's :attr:`exit_code` (:mod:`emma.exit_codes`)."""

    exit_code: ClassVar[int] = exit_codes.USER_ERROR


class UnknownChoiceError(EmmaError, KeyError):
    """An unknown name for something that has a fixed set of valid names."""

    def __init__(self, what: str, given: str, valid: Iterable[str], where: str = "") -> None:
        self.what, self.given, self.where = what, given, where
        self.valid = sorted(str(v) for v in valid)
        super().__init__(self.__str__())

    def __str__(self) -> str:
        msg = f"unknown {self.what} {self.given!r}{f' in {self.where}' if self.where else ''}."
        close = difflib.get_close_matches(str(self.given), self.valid, n=3, cutoff=0.5)
        if close:
            msg += f" Did you mean {' or '.join(repr(c) for c in close)}?"
        shown = self.valid if len(self.valid) <= 40 else self.valid[:40] + ["..."]
        return msg + f" Available: {', '.join(shown)}"


class WeightsUnavailableError(EmmaError):
    """Model weights that cannot be loaded here (offline, missing, or wrong hash)."""


class ConfigError(EmmaError):
    """A configuration value that cannot work."""


class NonFiniteError(EmmaError):
    """NaN/inf where a number must be finite (weights, images, probabilities): the cell
    stops rather than write a plausible-looking result."""


#: ``OSError.errno`` values that mean "the storage is full": no space left, disk quota exceeded
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"  # unreachable


class DiskFullError(EmmaError):
    """No space left on the device (or the quota is full) while storing ``path``: exit code
    :data:`emma.exit_codes.DISK_FULL`, one line naming the path, the space needed (where
    known) and the space free there."""

    exit_code: ClassVar[int] = exit_codes.DISK_FULL

    def __init__(self, path: str | os.PathLike, what: str = "a file", needed: int | None = None) -> None:
        self.path, self.what, self.needed = Path(path), what, needed
        free = None
        for p in (self.path, *self.path.parents):
            try:
                free = shutil.disk_usage(p).free
                break
            except OSError:
                continue
        need = f"it needs about {_size(needed)}, " if needed is not None else ""
        left = f"{_size(free)} free there" if free is not None else "free space unknown"
        super().__init__(f"no space left on the device while storing {what} at {self.path} ({need}{left}); "
                         "nothing half-written was kept: free space (or set paths.cache_dir / $EMMA_CACHE "
                         "to a larger disk) and run the same command again")


#: how libraries that wrap the OS error in their own type say it (safetensors' Rust writer:
#: ``SafetensorError: ... I/O error: No space left on device (os error 28)``)
DISK_FULL_TEXTS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


def is_disk_full(err: BaseException | None) -> bool:
    """Whether ``err`` (or an error it was raised from) says the storage is full: an
    ``OSError`` with :data:`DISK_FULL_ERRNOS`, or a library's error with that text."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, OSError) and err.errno in DISK_FULL_ERRNOS:
            return True
        if not isinstance(err, OSError) and any(t in str(err) for t in DISK_FULL_TEXTS):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False
