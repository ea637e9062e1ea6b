"""Content-addressed caches, written atomically, verified on read.

Every file is written under a temporary name carrying the writer's pid and renamed into
place (``os.replace`` is atomic on POSIX), so a killed process leaves either the complete
file or a ``*.tmp`` that :func:`sweep_stale_tmp` removes when no live process owns it.

Every entry carries a small JSON record of what it should hold (``ENTRY_FORMAT``; the
entry's key and the sha256 of its content, plus any fields a writer adds): images in a PNG
text chunk, judge scores beside the probabilities in the ``.npz``, erased models in their
manifest, FID statistics in the ``.npz``. A read that finds a truncated, unreadable or
different entry moves it to ``<cache>/quarantine/`` (:func:`quarantine`), logs the path
and answers "not cached", so the caller recomputes it; the repairs of a run are listed by
:func:`repairs_since` and reported in the cell's results.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image, PngImagePlugin

from emma.files import TMP_SUFFIX, atomic_write_bytes, sha256_bytes

if TYPE_CHECKING:  # torch is imported where used: result readers (leaderboards) need no torch
    import torch

META_CHUNK = "emma"  # PNG text chunk holding an image's record (key, sha256, generation timing)
ENTRY_FORMAT = 1
QUARANTINE = "quarantine"
WARN_PER_KIND = 20
log = logging.getLogger("emma.cache")


# --------------------------------------------------------------------------- damaged entries
@dataclasses.dataclass(frozen=True)
class Repair:
    """A damaged cache entry moved aside for recomputation.

    Args:
        kind: ``image``, ``score``, ``erased_model``, ``fid_statistics``.
        path: where the entry was.
        moved_to: where it is now (``None`` if a concurrent reader moved it first).
        reason: what was wrong.
    """

    kind: str
    path: str
    moved_to: str | None
    reason: str


_REPAIRS: list[Repair] = []
_REPAIRS_LOCK = threading.Lock()


class DamagedEntry(Exception):
    """Raised by an entry's reader when the entry fails verification (internal)."""


def repair_mark() -> int:
    """A position in this process's repair log, for :func:`repairs_since`."""
    return len(_REPAIRS)


def repairs_since(mark: int) -> list[Repair]:
    """The repairs made since :func:`repair_mark` returned ``mark``."""
    with _REPAIRS_LOCK:
        return list(_REPAIRS[mark:])


def repair_note(repairs: list[Repair]) -> str:
    """One line for a cell's notes."""
    kinds: dict[str, int] = {}
    for r in repairs:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    where = _quarantine_root(repairs)
    return (f"cache repaired: {len(repairs)} damaged entr{'y' if len(repairs) == 1 else 'ies'} "
            f"({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}) moved to {where} and recomputed; "
            f"first: {repairs[0].path} ({repairs[0].reason})")


def _quarantine_root(repairs: list[Repair]) -> str:
    for r in repairs:
        if r.moved_to:
            parts = Path(r.moved_to).parts
            if QUARANTINE in parts:
                return str(Path(*parts[: parts.index(QUARANTINE) + 1]))
    return QUARANTINE


def quarantine(path: str | os.PathLike, cache_root: str | os.PathLike, kind: str, reason: str) -> Repair:
    """Move a damaged file or folder to ``<cache_root>/quarantine/<date>/<its path>`` (never
    delete: a user may want to look at it), log it, and record the repair."""
    path, cache_root = Path(path), Path(cache_root)
    try:
        rel = path.resolve().relative_to(cache_root.resolve())
    except ValueError:
        rel = Path(path.name)
    stamp = time.strftime("%Y%m%d")
    dest = cache_root / QUARANTINE / stamp / rel.parent / f"{rel.name}.{time.strftime('%H%M%S')}-{os.getpid()}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(path, dest)
        moved: str | None = str(dest)
    except FileNotFoundError:  # a concurrent reader quarantined it first
        moved = None
    except OSError:  # a folder onto an existing one, or another filesystem
        try:
            shutil.move(str(path), str(dest))
            moved = str(dest)
        except OSError:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            moved = None
    repair = Repair(kind=kind, path=str(path), moved_to=moved, reason=reason)
    with _REPAIRS_LOCK:
        _REPAIRS.append(repair)
        seen = sum(r.kind == kind for r in _REPAIRS)
    # a cache written by an older harness can hold thousands: name the first few of each kind
    level = logging.WARNING if seen <= WARN_PER_KIND else logging.DEBUG
    log.log(level, "cache: damaged %s entry %s (%s): moved to %s; recomputing", kind, path, reason,
            moved or "(gone)")
    if seen == WARN_PER_KIND:
        log.warning("cache: further damaged %s entries are logged at debug level; the cell's notes count them",
                    kind)
    return repair


def heal_shard(folder: Path, cache_root: Path, kind: str) -> None:
    """Quarantine a file standing where the shard folder ``folder`` of an entry should be
    (every write into it would fail), so the entry's write can create the folder."""
    if folder.exists() and not folder.is_dir():
        quarantine(folder, cache_root, kind, f"{folder.name} is a file where the cache keeps a folder of entries")


def cache_folder(cache_root: str | os.PathLike, name: str, kind: str) -> Path:
    """``<cache_root>/<name>``, the folder of one kind of entry, created; a file standing
    there (nothing could be stored under it) is quarantined first, like a damaged entry."""
    cache_root = Path(cache_root)
    folder = cache_root / name
    if folder.exists() and not folder.is_dir():
        quarantine(folder, cache_root, kind, f"{name} is a file where the cache keeps its folder of {kind} entries")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def stable_hash(obj: Any) -> str:
    """sha256 of a JSON-serialisable object with sorted keys."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def tensor_hash(t: torch.Tensor) -> str:
    import torch

    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_tmp(root: Path) -> int:
    """Remove temporary files/folders under ``root`` whose writer is no longer running.

    Other processes write and rename their temporaries while this walks: a folder that vanishes
    under the walk is skipped (``os.walk`` ignores it), and a temporary folder is judged whole,
    never entered."""
    removed = 0
    if not root.exists():
        return 0
    found: list[Path] = []
    for parent, dirs, files in os.walk(root):
        found += [Path(parent, n) for n in (*dirs, *files) if n.endswith(TMP_SUFFIX)]
        dirs[:] = [d for d in dirs if not d.endswith(TMP_SUFFIX)]
    for p in found:
        try:
            pid = int(p.name[: -len(TMP_SUFFIX)].rsplit(".", 1)[1])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed += 1
    return removed


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(N, 3, H, W) float in [0, 1] -> (N, H, W, 3) uint8, rounding as PIL does."""
    import torch
    arr = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return arr.permute(0, 2, 3, 1).cpu().numpy()


def from_uint8(arr: np.ndarray) -> torch.Tensor:
    """(N, H, W, 3) uint8 -> (N, 3, H, W) float in [0, 1]."""
    import torch
    return torch.from_numpy(np.ascontiguousarray(arr)).permute(0, 3, 1, 2).float() / 255.0


class ImageCache:
    """PNG images keyed by the sha256 of everything that determines them.

    Each PNG carries a text chunk ``emma`` holding a JSON record ``{"format", "key",
    "sha256", "shape", ...}``: the entry's own key and the sha256 of its pixels. A read
    verifies both, so a truncated file, a file that is no PNG, and a valid image that is not
    the one stored (another entry's, a black square) are all caught, quarantined and
    regenerated. Writers may add fields to the record (``put(..., meta=...)``); readers get
    them from :meth:`get_entry`.
    """

    CHUNK = META_CHUNK

    def __init__(self, root: str | os.PathLike) -> None:
        self.cache_root = Path(root)
        self.root = cache_folder(self.cache_root, "images", "image")
        sweep_stale_tmp(self.root)

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.png"

    def get(self, key: str) -> np.ndarray | None:
        """The verified image, or ``None`` (absent, or damaged and now quarantined)."""
        entry = self.get_entry(key)
        return None if entry is None else entry[0]

    def get_entry(self, key: str) -> tuple[np.ndarray, dict[str, Any]] | None:
        """``(image, record)`` of a verified entry, or ``None``."""
        p = self.path(key)
        if not p.exists():
            return None
        try:
            return self._read(p, key)
        except DamagedEntry as err:
            quarantine(p, self.cache_root, "image", str(err))
            return None

    @classmethod
    def _read(cls, p: Path, key: str) -> tuple[np.ndarray, dict[str, Any]]:
        try:
            with Image.open(p) as im:
                im.load()
                text = dict(getattr(im, "text", {}) or {})
                arr = np.asarray(im.convert("RGB"))
        except Exception as err:  # noqa: BLE001 - PIL raises many types for broken files
            raise DamagedEntry(f"unreadable PNG: {type(err).__name__}: {err}") from None
        try:
            meta = json.loads(text[cls.CHUNK])
        except (KeyError, ValueError):
            raise DamagedEntry("no emma record in the PNG (not written by this cache)") from None
        if meta.get("key") != key:
            raise DamagedEntry(f"holds entry {str(meta.get('key'))[:12]}..., not {key[:12]}...")
        if meta.get("sha256") != pixel_hash(arr):
            raise DamagedEntry("pixels differ from the stored sha256")
        return arr, meta

    def put(self, key: str, image: np.ndarray, meta: dict[str, Any] | None = None) -> str:
        """Store a (H, W, 3) uint8 image; returns the sha256 of the pixels.

        Args:
            key: the entry's key.
            image: the pixels.
            meta: extra JSON-serialisable fields for the entry's record.
        """
        digest = pixel_hash(image)
        record = {**(meta or {}), "format": ENTRY_FORMAT, "key": key, "sha256": digest,
                  "shape": list(image.shape)}
        info = PngImagePlugin.PngInfo()
        info.add_text(self.CHUNK, json.dumps(record, sort_keys=True))
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="PNG", compress_level=1, pnginfo=info)
        heal_shard(self.path(key).parent, self.cache_root, "image")
        atomic_write_bytes(self.path(key), buf.getvalue(), fsync=False, what="an image")
        return digest


def pixel_hash(image: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(image).tobytes()).hexdigest()


class ScoreCache:
    """Classifier outputs keyed by image pixel hash + classifier cache key.

    An entry is an ``.npz`` of ``probs`` (float32) and ``record``, a JSON string
    ``{"format", "image", "sha256"}``: the image hash it belongs to and the sha256 of the
    probabilities. A read verifies the record, that the values are finite probabilities,
    and (when given) the number of labels; a damaged entry is quarantined and re-scored.
    """

    def __init__(self, root: str | os.PathLike, classifier_key: str) -> None:
        self.cache_root = Path(root)
        self.root = cache_folder(cache_folder(self.cache_root, "scores", "score"), classifier_key, "score")
        sweep_stale_tmp(self.root)

    def path(self, image_hash: str) -> Path:
        return self.root / image_hash[:2] / f"{image_hash}.npz"

    def get(self, image_hash: str, n_labels: int | None = None) -> np.ndarray | None:
        """The verified probabilities, or ``None`` (absent, or damaged and now quarantined)."""
        p = self.path(image_hash)
        if not p.exists():
            return None
        try:
            return self._read(p, image_hash, n_labels)
        except DamagedEntry as err:
            quarantine(p, self.cache_root, "score", str(err))
            return None

    @staticmethod
    def _read(p: Path, image_hash: str, n_labels: int | None) -> np.ndarray:
        try:
            with np.load(p, allow_pickle=False) as z:
                probs = np.array(z["probs"])
                record = json.loads(str(z["record"]))
        except Exception as err:  # noqa: BLE001 - zip, npy and JSON errors all mean "damaged"
            raise DamagedEntry(f"unreadable score file: {type(err).__name__}: {err}") from None
        if record.get("image") != image_hash:
            raise DamagedEntry(f"scores of image {str(record.get('image'))[:12]}..., not {image_hash[:12]}...")
        if probs.dtype != np.float32 or probs.ndim != 1:
            raise DamagedEntry(f"expected a float32 vector, got {probs.dtype} {probs.shape}")
        if record.get("sha256") != sha256_bytes(probs.tobytes()):
            raise DamagedEntry("probabilities differ from the stored sha256")
        if n_labels is not None and len(probs) != n_labels:
            raise DamagedEntry(f"{len(probs)} probabilities for a judge with {n_labels} labels")
        if not np.isfinite(probs).all() or (probs < 0).any() or (probs > 1 + 1e-6).any():
            raise DamagedEntry("values are not finite probabilities in [0, 1]")
        return probs

    def put(self, image_hash: str, probs: np.ndarray) -> None:
        probs = np.ascontiguousarray(probs, dtype=np.float32).reshape(-1)
        record = {"format": ENTRY_FORMAT, "image": image_hash, "sha256": sha256_bytes(probs.tobytes())}
        buf = io.BytesIO()
        np.savez(buf, probs=probs, record=np.array(json.dumps(record, sort_keys=True)))
        heal_shard(self.path(image_hash).parent, self.cache_root, "score")
        atomic_write_bytes(self.path(image_hash), buf.getvalue(), fsync=False, what="judge scores")


class ClassifierScoreCache:
    """A :class:`ScoreCache` whose folder follows the classifier's *current*
    ``cache_key()`` at every read and write, so an open-vocabulary judge whose labels grow
    after construction (``can_detect``) never reads rows scored under another label set."""

    def __init__(self, root: str | os.PathLike, classifier: Any) -> None:
        self.root_dir, self.classifier = Path(root), classifier
        self._caches: dict[str, ScoreCache] = {}

    def _cache(self) -> ScoreCache:
        key = self.classifier.cache_key()
        if key not in self._caches:
            self._caches[key] = ScoreCache(self.root_dir, key)
        return self._caches[key]

    @property
    def root(self) -> Path:
        return self._cache().root

    def path(self, image_hash: str) -> Path:
        return self._cache().path(image_hash)

    def get(self, image_hash: str, n_labels: int | None = None) -> np.ndarray | None:
        return self._cache().get(image_hash, n_labels)

    def put(self, image_hash: str, probs: np.ndarray) -> None:
        self._cache().put(image_hash, probs)
