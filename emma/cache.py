"""Content-addressed caches, written atomically.

Every file is written under a temporary name carrying the writer's pid and renamed into
place (``os.replace`` is atomic on POSIX), so a killed process leaves either the complete
file or a ``*.tmp`` that :func:`sweep_stale_tmp` removes when no live process owns it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

if TYPE_CHECKING:  # torch is imported where used: result readers (leaderboards) need no torch
    import torch

TMP_SUFFIX = ".tmp"
META_CHUNK = "emma"  # PNG text chunk holding an image's generation record


def stable_hash(obj: Any) -> str:
    """sha256 of a JSON-serialisable object with sorted keys."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def tensor_hash(t: torch.Tensor) -> str:
    import torch

    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def atomic_write_bytes(path: Path, data: bytes, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` via a temporary file and a rename.

    The rename makes the write atomic for readers and against a killed process; ``fsync``
    additionally makes it durable against power loss (costly for many small files).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_tmp(root: Path) -> int:
    """Remove temporary files/folders under ``root`` whose writer is no longer running."""
    removed = 0
    if not root.exists():
        return 0
    for p in root.rglob(f"*{TMP_SUFFIX}"):
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
    """PNG images keyed by the sha256 of everything that determines them."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root) / "images"
        self.root.mkdir(parents=True, exist_ok=True)
        sweep_stale_tmp(self.root)

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.png"

    def get(self, key: str) -> np.ndarray | None:
        entry = self.get_entry(key)
        return None if entry is None else entry[0]

    def get_entry(self, key: str) -> tuple[np.ndarray, dict[str, Any] | None] | None:
        """The image and the record stored with it (generation timing; ``None`` for entries
        written before records existed), or ``None`` when the key is not cached."""
        p = self.path(key)
        if not p.exists():
            return None
        with Image.open(p) as im:
            text = getattr(im, "text", {}).get(META_CHUNK)
            return np.asarray(im.convert("RGB")), (json.loads(text) if text else None)

    def put(self, key: str, image: np.ndarray, meta: dict[str, Any] | None = None) -> str:
        """Store a (H, W, 3) uint8 image, with ``meta`` (JSON) in a PNG text chunk of the
        same file; returns the sha256 of the pixels."""
        from PIL.PngImagePlugin import PngInfo

        buf = io.BytesIO()
        info = None
        if meta is not None:
            info = PngInfo()
            info.add_text(META_CHUNK, json.dumps(meta, sort_keys=True))
        Image.fromarray(image).save(buf, format="PNG", compress_level=1, pnginfo=info)
        atomic_write_bytes(self.path(key), buf.getvalue(), fsync=False)
        return pixel_hash(image)


def pixel_hash(image: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(image).tobytes()).hexdigest()


class ScoreCache:
    """Classifier outputs keyed by image pixel hash + classifier cache key."""

    def __init__(self, root: str | os.PathLike, classifier_key: str) -> None:
        self.root = Path(root) / "scores" / classifier_key
        self.root.mkdir(parents=True, exist_ok=True)
        sweep_stale_tmp(self.root)

    def path(self, image_hash: str) -> Path:
        return self.root / image_hash[:2] / f"{image_hash}.npy"

    def get(self, image_hash: str) -> np.ndarray | None:
        p = self.path(image_hash)
        if not p.exists():
            return None
        return np.load(p)

    def put(self, image_hash: str, probs: np.ndarray) -> None:
        buf = io.BytesIO()
        np.save(buf, np.asarray(probs, dtype=np.float32))
        atomic_write_bytes(self.path(image_hash), buf.getvalue(), fsync=False)


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

    def get(self, image_hash: str) -> np.ndarray | None:
        return self._cache().get(image_hash)

    def put(self, image_hash: str, probs: np.ndarray) -> None:
        self._cache().put(image_hash, probs)


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
