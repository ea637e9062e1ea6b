"""The erase stage: run an erasure method once, store the result as diffusers subfolders,
reuse it by hash.

Layout of one entry (``<cache>/erased/<key>/``)::

    manifest.json        method, version, hyper-parameters, base fingerprint, concepts,
                         wall time, peak memory, erased fingerprint; ``files``: the sha256
                         of every weight/config file; ``checksum``: sha256 of the rest
    unet/                the method's edited components, saved with save_pretrained
    text_encoder/
    method_state/        what the method needs besides them (ErasureMethod.save_state), if any

The key is the sha256 of (base-model fingerprint, method config, concepts, domain, seed). An
entry is built in a temporary folder and renamed into place, so a killed erase leaves no
half-written entry. A read verifies the manifest (key, checksum) and every file's sha256; a
damaged entry is moved to ``<cache>/quarantine/`` and the method runs again. Load one into any compatible base with
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

from emma.api.domain import Domain
from emma.api.method import OTHERS, ErasureMethod
from emma.cache import DamagedEntry, cache_folder, quarantine, stable_hash, sweep_stale_tmp
from emma.errors import ConfigError, NonFiniteError, first_line
from emma.files import TMP_SUFFIX, atomic_write_text, sha256_file, storing
from emma.metrics.timing import machine_description
from emma.pipelines import fingerprint, freeze

log = logging.getLogger(__name__)
#: The entry's folder for what a method keeps besides its edited components (ErasureMethod.save_state).
STATE_DIR = "method_state"


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
              domain: str | None, seed: int, cpu_threads: int | None = None,
              others: Sequence[str] | None = None) -> str:
    """The erased model's cache key. ``domain``: the domain's name. ``cpu_threads``: torch's
    thread count when the erasure runs on the CPU, where it splits float reductions
    differently and a trained edit follows (a 2-thread cell must not reuse a 1-thread
    erasure); ``None`` on a GPU. ``others``: the domain's concepts, when the method's config
    names them as ``"<others>"`` (a domain whose concepts are overridden expands it otherwise)."""
    parts = {"base": base_fingerprint, "method": method.config(), "concepts": list(concepts),
             "domain": domain, "seed": int(seed)}
    if cpu_threads is not None:
        parts["cpu_threads"] = int(cpu_threads)
    if others is not None:
        parts["others"] = list(others)
    return stable_hash(parts)


def _others_of(method: ErasureMethod, domain: Domain | None) -> list[str] | None:
    """The concepts ``"<others>"`` in ``method``'s config expands from, if it has one."""
    if domain is None or OTHERS not in json.dumps(method.config(), default=str):
        return None
    return list(domain.concepts)


def _load_component(pipe: Any, name: str, folder: Path) -> None:
    current = getattr(pipe, name)
    module = type(current).from_pretrained(folder, dtype=current.dtype)
    setattr(pipe, name, module.to(current.device).requires_grad_(False))  # as load_pipeline leaves it


def _manifest_checksum(manifest: dict[str, Any]) -> str:
    return stable_hash({k: v for k, v in manifest.items() if k != "checksum"})


def _verified_manifest(entry: Path, key: str) -> dict[str, Any]:
    """The entry's manifest after checking it and every file it lists (sha256)."""
    try:
        manifest = json.loads((entry / "manifest.json").read_text())
    except (OSError, ValueError) as err:
        raise DamagedEntry(f"manifest.json unreadable: {first_line(err)}") from None
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        raise DamagedEntry("manifest.json belongs to another entry")
    if manifest.get("checksum") != _manifest_checksum(manifest) or not isinstance(manifest.get("files"), dict):
        raise DamagedEntry("manifest.json altered (checksum mismatch) or written by an older harness")
    for rel, digest in manifest["files"].items():
        path = entry / rel
        if not path.is_file():
            raise DamagedEntry(f"{rel} is missing")
        if sha256_file(path) != digest:
            raise DamagedEntry(f"{rel} differs from its recorded sha256")
    return manifest


def check_finite_weights(pipe: Any, components: Sequence[str], source: str) -> None:
    """Refuse NaN/inf weights: they sample black images, which judges read as perfect erasure."""
    for comp in components:
        module = getattr(pipe, comp, None)
        if module is None:
            continue
        bad = [name for name, t in module.state_dict().items()
               if t.is_floating_point() and not torch.isfinite(t).all()]
        if bad:
            raise NonFiniteError(f"{source} gave {comp} weights with NaN/inf in {len(bad)} tensor(s), e.g. "
                                 f"{', '.join(bad[:3])}; such a model draws black images that read as perfect "
                                 "erasure, so the cell stops")


def erase_cached(
    pipe: Any,
    method: ErasureMethod,
    concepts: Sequence[str],
    cache_root: str | os.PathLike,
    *,
    base_fingerprint: str,
    domain: Domain | None = None,
    seed: int = 0,
) -> EraseResult:
    """Erase ``concepts`` from ``pipe`` with ``method``, or load the stored result.

    ``pipe`` is edited in place either way. The identity method (no edited components)
    stores nothing. ``domain`` (the Domain the concepts belong to) goes to the method; the
    key and the manifest record its name.
    """
    concepts = list(concepts)
    if not concepts:
        raise ConfigError("no concept to erase: give at least one concept (concept=...)")
    if domain is not None and not isinstance(domain, Domain):
        raise TypeError(f"erase_cached: domain must be the Domain being erased (emma.api.domain.Domain) or None, "
                        f"got {domain!r} ({type(domain).__name__})")
    on_cpu = torch.device(getattr(pipe, "device", "cpu")).type == "cpu"
    key = erase_key(base_fingerprint, method, concepts, None if domain is None else domain.name, seed,
                    cpu_threads=torch.get_num_threads() if on_cpu else None, others=_others_of(method, domain))
    if not method.edited_components:
        return EraseResult(pipe, key, base_fingerprint, 0.0, True, {"method": method.config()})
    root = cache_folder(cache_root, "erased", "erased_model")
    sweep_stale_tmp(root)
    entry = root / key
    hit = _load_verified(pipe, method, key, entry, cache_root)
    if hit is not None:
        return hit
    # Jobs of a sweep that need the same erased model: the first erases, the others wait
    # for it and load its entry instead of erasing again.
    with erase_lock(root, key):
        hit = _load_verified(pipe, method, key, entry, cache_root)
        if hit is not None:
            return hit
        return _erase_and_store(pipe, method, concepts, root, key, base_fingerprint, domain, seed)


def _load_verified(pipe: Any, method: ErasureMethod, key: str, entry: Path,
                   cache_root: str | os.PathLike) -> EraseResult | None:
    """The stored entry loaded into ``pipe`` after verification, or ``None`` when there is none
    (a damaged entry is quarantined and ``pipe`` put back to the base)."""
    if not entry.exists():
        return None
    originals = {comp: getattr(pipe, comp, None) for comp in method.edited_components}
    try:
        manifest = _verified_manifest(entry, key)
        for comp in manifest["components"]:
            _load_component(pipe, comp, entry / comp)
        check_finite_weights(pipe, manifest["components"], f"cached erased model {entry}")
        if (entry / STATE_DIR).is_dir():
            method.load_state(entry / STATE_DIR)
        return EraseResult(pipe, key, manifest["fingerprint"], float(manifest["wall_time_s"]), True, manifest)
    except (DamagedEntry, NonFiniteError, OSError, ValueError, KeyError, RuntimeError) as err:
        quarantine(entry, cache_root, "erased_model", f"{type(err).__name__}: {first_line(err)}")
        for comp, module in originals.items():  # undo a partial load: back to the base
            setattr(pipe, comp, module)
        return None


@contextlib.contextmanager
def erase_lock(root: Path, key: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``<root>/.<key>.lock`` (works across processes and, through
    the kernel's lock manager, across NFS clients). The lock file is removed when released;
    one left by a killed process holds no lock and is taken over."""
    path = root / f".{key}.lock"
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("erase: another job is erasing %s; waiting for it", key[:12])
            fcntl.flock(f, fcntl.LOCK_EX)
        try:  # the holder before us removes the file when done: lock the file that is there now
            current = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        f.close()
    try:
        yield
    finally:
        # removed while still held (nothing is left behind, whatever the erase did); a waiter
        # that opened this file finds it gone when it gets the lock and takes a new one
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        f.close()


def _erase_and_store(pipe: Any, method: ErasureMethod, concepts: list[str], root: Path, key: str,
                     base_fingerprint: str, domain: Domain | None, seed: int) -> EraseResult:
    entry = root / key
    device = pipe.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    pipe = method.erase(pipe, concepts, seed=seed, domain=domain)
    wall = time.perf_counter() - t0
    for comp in method.edited_components:  # training's gradients are not needed past here
        if isinstance(module := getattr(pipe, comp, None), torch.nn.Module):
            module.zero_grad(set_to_none=True)
    freeze(pipe)  # the state a cached entry loads in
    check_finite_weights(pipe, method.edited_components, f"method '{method.name}'")
    fp = fingerprint(pipe)
    manifest = {
        "key": key,
        "method": method.name,
        "version": method.version,
        "hyperparameters": method.config(),
        "base_fingerprint": base_fingerprint,
        "fingerprint": fp,
        "concepts": concepts,
        "domain": None if domain is None else domain.name,
        "seed": seed,
        "components": list(method.edited_components),
        "wall_time_s": wall,
        "peak_memory_mb": _peak_memory_mb(device),
        "device": str(device),
        "machine": machine_description(device),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    tmp = root / f".{key}.{os.getpid()}{TMP_SUFFIX}"
    # a full disk (or any failure) while storing leaves no temporary folder behind
    with storing(entry, "the erased model", needed=_weights_bytes(pipe, method.edited_components), cleanup=tmp):
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        for comp in method.edited_components:
            getattr(pipe, comp).save_pretrained(tmp / comp, safe_serialization=True)
        method.save_state(tmp / STATE_DIR)  # e.g. SPM's membranes (hashed below with the weights)
        manifest["files"] = {str(f.relative_to(tmp)): sha256_file(f) for f in sorted(tmp.rglob("*")) if f.is_file()}
        manifest["checksum"] = _manifest_checksum(manifest)
        atomic_write_text(tmp / "manifest.json", json.dumps(manifest, indent=2, default=str))
    try:
        os.replace(tmp, entry)
    except OSError:  # a concurrent job stored the same entry first; both are identical
        shutil.rmtree(tmp, ignore_errors=True)
    return EraseResult(pipe, key, fp, wall, False, manifest)


def _weights_bytes(pipe: Any, components: Sequence[str]) -> int:
    """The bytes of the tensors of ``components``: about what storing them takes."""
    total = 0
    for comp in components:
        module = getattr(pipe, comp, None)
        if isinstance(module, torch.nn.Module):
            total += sum(t.numel() * t.element_size() for t in module.state_dict().values())
    return total
