"""The erase stage: run an erasure method once, store the result as diffusers subfolders,
reuse it by hash.

Layout of one entry (``<cache>/erased/<key>/``)::

    manifest.json        method, version, hyper-parameters, base fingerprint, concepts,
                         wall time, peak memory, erased fingerprint
    unet/                the method's edited components, saved with save_pretrained
    text_encoder/

The key is the sha256 of (base-model fingerprint, method config, concepts, domain, seed). An
entry is built in a temporary folder and renamed into place, so a killed erase leaves no
half-written entry. Load one into any compatible base with
``StableDiffusionPipeline.from_pretrained(base, unet=UNet2DConditionModel.from_pretrained(entry / "unet"))``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import resource
import shutil
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from emma.api.method import ErasureMethod
from emma.cache import TMP_SUFFIX, atomic_write_text, stable_hash, sweep_stale_tmp
from emma.errors import ConfigError
from emma.metrics.timing import machine_description
from emma.pipelines import fingerprint

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EraseResult:
    pipe: Any
    key: str
    fingerprint: str
    unlearning_s: float
    cached: bool
    manifest: dict[str, Any]


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def erase_key(base_fingerprint: str, method: ErasureMethod, concepts: Sequence[str],
              domain: str | None, seed: int) -> str:
    return stable_hash({"base": base_fingerprint, "method": method.config(),
                        "concepts": list(concepts), "domain": domain, "seed": int(seed)})


def _load_component(pipe: Any, name: str, folder: Path) -> None:
    current = getattr(pipe, name)
    module = type(current).from_pretrained(folder, dtype=current.dtype)
    setattr(pipe, name, module.to(current.device))


def erase_cached(
    pipe: Any,
    method: ErasureMethod,
    concepts: Sequence[str],
    cache_root: str | os.PathLike,
    *,
    base_fingerprint: str,
    domain: str | None = None,
    seed: int = 0,
) -> EraseResult:
    """Erase ``concepts`` from ``pipe`` with ``method``, or load the stored result.

    ``pipe`` is edited in place either way. The identity method (no edited components)
    stores nothing.
    """
    concepts = list(concepts)
    if not concepts:
        raise ConfigError("no concept to erase: give at least one concept (concept=...)")
    key = erase_key(base_fingerprint, method, concepts, domain, seed)
    if not method.edited_components:
        return EraseResult(pipe, key, base_fingerprint, 0.0, True, {"method": method.config()})
    root = Path(cache_root) / "erased"
    root.mkdir(parents=True, exist_ok=True)
    sweep_stale_tmp(root)
    entry = root / key
    if (entry / "manifest.json").exists():
        return _load_entry(pipe, key, entry)
    # Jobs of a sweep that need the same erased model: the first erases, the others wait
    # for it and load its entry instead of erasing again.
    with erase_lock(root, key):
        if (entry / "manifest.json").exists():
            return _load_entry(pipe, key, entry)
        return _erase_and_store(pipe, method, concepts, root, key, base_fingerprint, domain, seed)


def _load_entry(pipe: Any, key: str, entry: Path) -> EraseResult:
    manifest = json.loads((entry / "manifest.json").read_text())
    for comp in manifest["components"]:
        _load_component(pipe, comp, entry / comp)
    return EraseResult(pipe, key, manifest["fingerprint"], float(manifest["wall_time_s"]), True, manifest)


@contextlib.contextmanager
def erase_lock(root: Path, key: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``<root>/.<key>.lock`` (works across processes and, through
    the kernel's lock manager, across NFS clients)."""
    path = root / f".{key}.lock"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("erase: another job is erasing %s; waiting for it", key[:12])
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _erase_and_store(pipe: Any, method: ErasureMethod, concepts: list[str], root: Path, key: str,
                     base_fingerprint: str, domain: str | None, seed: int) -> EraseResult:
    entry = root / key
    device = pipe.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    pipe = method.erase(pipe, concepts, seed=seed, domain=domain)
    wall = time.perf_counter() - t0
    fp = fingerprint(pipe)
    manifest = {
        "key": key,
        "method": method.name,
        "version": method.version,
        "hyperparameters": method.config(),
        "base_fingerprint": base_fingerprint,
        "fingerprint": fp,
        "concepts": concepts,
        "domain": domain,
        "seed": seed,
        "components": list(method.edited_components),
        "wall_time_s": wall,
        "peak_memory_mb": _peak_memory_mb(device),
        "device": str(device),
        "machine": machine_description(device),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    tmp = root / f".{key}.{os.getpid()}{TMP_SUFFIX}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for comp in method.edited_components:
        getattr(pipe, comp).save_pretrained(tmp / comp, safe_serialization=True)
    atomic_write_text(tmp / "manifest.json", json.dumps(manifest, indent=2, default=str))
    try:
        os.replace(tmp, entry)
    except OSError:  # a concurrent job stored the same entry first; both are identical
        shutil.rmtree(tmp, ignore_errors=True)
    return EraseResult(pipe, key, fp, wall, False, manifest)
