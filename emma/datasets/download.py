"""Pinned downloads: a fixed URL at a fixed commit, checked by sha256, cached atomically.

Every public file the harness reads at run time (EMMA's prompt files, I2P, COCO-30k,
UnlearnDiffAtk's attack sets, bias prompt sets, classifier label lists) is described by a
:class:`RemoteFile`: a GitHub repository, a commit and a path, plus the sha256 of the bytes.
:func:`fetch` returns a local path to the verified file, downloading it on first use into
the cache folder (``$EMMA_CACHE``, default ``~/.cache/emma``).

Offline machines (``EMMA_OFFLINE=1`` or ``HF_HUB_OFFLINE=1``) never touch the network; a
file that is not cached then raises :class:`DataUnavailableError`, which names the URL to
download and the exact path to put the file at.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from emma.errors import EmmaError
from emma.files import atomic_write_bytes, sha256_bytes, sha256_file

logger = logging.getLogger(__name__)

_OFFLINE_VARS: tuple[str, ...] = ("EMMA_OFFLINE", "HF_HUB_OFFLINE")
_TRUE = ("1", "true", "yes", "on")


class DataUnavailableError(EmmaError):
    """A pinned data file that is neither cached nor downloadable here."""


class ChecksumError(EmmaError):
    """A data file whose sha256 differs from the pinned one."""


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    """A public file at a fixed commit of a GitHub repository, checked by sha256.

    Args:
        repo: ``"owner/name"`` of the GitHub repository.
        commit: the full 40-hex commit the file is pinned at.
        path: the file's path inside the repository.
        sha256: the expected sha256 of the file's bytes.
        description: a short human description (shown by the CLI and in errors).
    """

    repo: str
    commit: str
    path: str
    sha256: str
    description: str = ""

    @property
    def url(self) -> str:
        """The raw download URL at the pinned commit."""
        return f"https://raw.githubusercontent.com/{self.repo}/{self.commit}/{self.path}"

    @property
    def cache_relpath(self) -> Path:
        """Where the file lives under the cache folder (one folder per repo and commit)."""
        owner, name = self.repo.split("/", 1)
        return Path("github") / f"{owner}__{name}" / self.commit / self.path

    def cache_path(self, cache: str | os.PathLike | None = None) -> Path:
        """Absolute cache path of the file (whether or not it exists)."""
        return (Path(cache) if cache is not None else cache_dir()) / self.cache_relpath


def cache_dir() -> Path:
    """The download cache: ``$EMMA_CACHE`` or ``~/.cache/emma``."""
    return Path(os.environ.get("EMMA_CACHE") or Path.home() / ".cache" / "emma").expanduser()


def is_offline() -> bool:
    """Whether downloads are forbidden (``EMMA_OFFLINE`` or ``HF_HUB_OFFLINE`` set to 1)."""
    return any(os.environ.get(v, "").strip().lower() in _TRUE for v in _OFFLINE_VARS)


def _http_get(url: str, timeout: float = 60.0) -> bytes:
    """GET ``url`` and return the body (tests replace this function)."""
    import requests  # lazy: only needed when something is really downloaded

    response = requests.get(url, timeout=timeout)
    response.raise_for_status()
    return response.content


def _unavailable(remote: RemoteFile, dest: Path, reason: str) -> DataUnavailableError:
    what = remote.description or remote.path
    return DataUnavailableError(
        f"{what} is not available: {reason}. Download {remote.url} and save it as {dest} "
        f"(sha256 {remote.sha256}), or point EMMA_CACHE at a folder that holds "
        f"{remote.cache_relpath}."
    )


def fetch(remote: RemoteFile, *, cache: str | os.PathLike | None = None) -> Path:
    """Return the local path of ``remote``, downloading and verifying it on first use.

    Args:
        remote: the pinned file.
        cache: cache folder (default :func:`cache_dir`).

    Returns:
        The path of the cached file, whose sha256 equals ``remote.sha256``.

    Raises:
        DataUnavailableError: offline (or the download failed) and the file is not cached.
        ChecksumError: the downloaded bytes, or a cached file while offline, do not match
            the pinned sha256.
    """
    dest = remote.cache_path(cache)
    if dest.exists():
        digest = sha256_file(dest)
        if digest == remote.sha256:
            return dest
        if is_offline():
            raise ChecksumError(
                f"cached file {dest} has sha256 {digest}, expected {remote.sha256} "
                f"({remote.url}). Delete it and download the file again."
            )
        logger.warning("cached %s has the wrong sha256 (%s); downloading it again", dest, digest)
    if is_offline():
        raise _unavailable(remote, dest, "it is not cached and downloads are disabled "
                           "(EMMA_OFFLINE or HF_HUB_OFFLINE is set)")
    try:
        data = _http_get(remote.url)
    except Exception as exc:  # any transport error: the message is what matters
        raise _unavailable(remote, dest, f"downloading failed ({type(exc).__name__}: {exc})") from exc
    digest = sha256_bytes(data)
    if digest != remote.sha256:
        raise ChecksumError(
            f"{remote.url} has sha256 {digest}, expected {remote.sha256}; refusing to cache it. "
            "The pinned file may have been rewritten upstream."
        )
    atomic_write_bytes(dest, data)
    logger.info("downloaded %s -> %s", remote.url, dest)
    return dest
