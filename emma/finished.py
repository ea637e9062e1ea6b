"""Finished cells, content-addressed: a cell whose inputs hash to a stored result is served
from the cache without loading a pipeline.

The key is the sha256 of everything a cell's numbers depend on:

- the resolved configuration (without ``paths``: where the caches live moves no number; and
  without ``logger``: where the results are reported moves none either, and a cell served
  from the cache is reported to the logger of the run that asked for it);
- the harness's code and shipped data: every file of the packages ``emma``, ``methods``,
  ``attackers``, ``classifiers``, ``stace`` and ``conf`` (so any component's version, any
  metric's definition and the tiny-world weights are in it);
- the content of every local file or folder the configuration names (``model.pretrained``,
  a classifier's ``weights``, ...), memoised by (path, size, mtime) so a 4 GB checkpoint is
  read once; a hub id enters as its name, revision and variant;
- the versions of the numerical libraries (torch, diffusers, transformers, numpy, scipy).

Layout: ``<cache>/results/<key>/{results.json, samples.jsonl, key.json, manifest.json}``
(+ ``bias_images.jsonl`` and ``evidence/`` where the cell wrote them), written to a temporary
folder and renamed into place. ``manifest.json`` (written last) holds the key and the sha256
and size of every other file; an entry is served only after every file matches it, and each
copy in the run directory is checked again before it is renamed into place, so a truncated or
edited stored file never reaches a run directory. A served ``results.json`` says so
(``served_from_cache``: the key and when), and its ``metrics.csv`` is written from it. A
damaged or incomplete entry goes through the caches' quarantine (:func:`emma.cache.quarantine`,
kind ``finished_result``) and the cell is computed again, its notes saying so.

This module imports no torch (nor numpy: :mod:`emma.cache` only on the repair path), so the
hit path of ``python -m emma.run`` stays cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from emma import registry
from emma.errors import EmmaError
from emma.files import atomic_write_text, sha256_file, storing, update_with_file

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("emma", "methods", "attackers", "classifiers", "stace")
LIBRARIES = ("torch", "diffusers", "transformers", "numpy", "scipy", "clean-fid", "scikit-image")
FILES = ("results.json", "samples.jsonl")  # copied into a run directory
OPTIONAL = ("bias_images.jsonl",)  # copied too where the cell wrote them
EVIDENCE = "evidence"  # the folder of evidence images, stored and copied whole
KEY_FILE = "key.json"
MANIFEST = "manifest.json"
STORED = (*FILES, KEY_FILE)  # what every manifest vouches for (besides the optional files it lists)
MANIFEST_FORMAT = 1
REPAIR_KIND = "finished_result"


class StoredResultChanged(EmmaError):
    """A stored result that verified at lookup no longer matches its manifest when copied."""


def _tree_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and not p.name.endswith((".pyc", ".tmp")))


def tree_hash(root: Path) -> str:
    """sha256 over (relative path, content) of every file under ``root`` (or of the file)."""
    h = hashlib.sha256()
    for p in _tree_files(root):
        h.update(str(p.relative_to(root) if p != root else p.name).encode() + b"\0")
        update_with_file(h, p)
    return h.hexdigest()


_CODE_HASH: dict[tuple[Path, ...], str] = {}


def code_hash() -> str:
    """The harness's code and every config folder (the shipped ``conf/`` and the
    ``$EMMA_INCLUDE`` folders, whose modules are components too)."""
    confs = tuple(registry.conf_dirs())
    if confs not in _CODE_HASH:
        h = hashlib.sha256()
        for d in CODE_DIRS:
            if (ROOT / d).exists():
                h.update(d.encode() + b"\0" + tree_hash(ROOT / d).encode())
        for i, folder in enumerate(confs):
            h.update(f"config folder {i}".encode() + b"\0" + tree_hash(folder).encode())
        _CODE_HASH[confs] = h.hexdigest()
    return _CODE_HASH[confs]


def local_fingerprint(path: Path, cache_root: Path) -> str:
    """Content hash of a local file or folder, memoised by the (path, size, mtime) of its files."""
    files = _tree_files(path)
    stat = [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    memo = cache_root / "fingerprints" / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()}.json"
    try:
        rec = json.loads(memo.read_text())
        if rec.get("stat") == stat:
            return str(rec["sha256"])
    except (OSError, ValueError):
        pass
    digest = tree_hash(path)
    atomic_write_text(memo, json.dumps({"stat": stat, "sha256": digest}))
    return digest


def _paths_in(obj: Any, prefix: str = "") -> dict[str, str]:
    """Config values that name an existing local file or folder (``key.path -> value``)."""
    out: dict[str, str] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_paths_in(v, f"{prefix}{k}."))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(_paths_in(v, f"{prefix}{i}."))
    elif isinstance(obj, str) and ("/" in obj or obj.startswith("~")):
        p = Path(obj).expanduser()
        if p.exists():
            out[prefix.rstrip(".")] = str(p)
    return out


def cell_inputs(cfg: Any) -> dict[str, Any]:
    """What the key hashes (also stored next to the result as ``key.json``)."""
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else dict(cfg)
    config = {k: v for k, v in config.items() if k not in NOT_IN_KEY}
    cache_root = cache_dir(cfg)
    return {
        "config": config,
        "code": code_hash(),
        "local_files": {k: local_fingerprint(Path(p), cache_root) for k, p in sorted(_paths_in(config).items())},
        "libraries": {n: _version(n) for n in LIBRARIES},
        "python": sys.version.split()[0],
    }


#: top-level settings that move no number: where files go, and where results are reported
NOT_IN_KEY = ("paths", "logger")


def cache_dir(cfg: Any) -> Path:
    return Path(str(cfg["paths"]["cache_dir"])).expanduser()


def cell_key(cfg: Any) -> str:
    return hashlib.sha256(json.dumps(cell_inputs(cfg), sort_keys=True, default=str).encode()).hexdigest()


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def enabled(cfg: Any) -> bool:
    return bool(cfg["paths"].get("reuse_results", True))


def repair_mark() -> int:
    """:func:`emma.cache.repair_mark` without importing :mod:`emma.cache` (numpy, PIL) on the
    hit path: a process that has not imported it has recorded no repair yet."""
    cache = sys.modules.get("emma.cache")
    return cache.repair_mark() if cache is not None else 0


def damage(found: Path) -> str | None:
    """What is wrong with the stored entry ``found`` (``None``: every file matches its
    manifest). An entry without a manifest was stored by a harness that recorded no
    checksums: it cannot be verified, so it counts as damaged and the cell is computed again."""
    try:
        manifest = json.loads((found / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST} (unverifiable: stored without checksums)"
    except (OSError, ValueError) as err:
        return f"{MANIFEST} unreadable ({type(err).__name__})"
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return f"{MANIFEST} has an unknown format"
    if manifest.get("key") != found.name:
        return f"{MANIFEST} is of key {manifest.get('key')!r}"
    files = manifest.get("files")
    if not isinstance(files, dict):
        return f"{MANIFEST} lists no files"
    for name in STORED:
        if not isinstance(files.get(name), dict):
            return f"{MANIFEST} does not list {name}"
    for name, want in files.items():
        if not isinstance(want, dict) or not _stored_name(name):
            return f"{MANIFEST} lists {name!r}, which is not a file of a stored result"
        reason = _mismatch(found / name, want, name)
        if reason:
            return reason
    return None


def _stored_name(name: str) -> bool:
    """A name a manifest may list: a stored file, or an image of the evidence folder (never a
    path out of the entry)."""
    parts = name.split("/")
    if len(parts) == 1:
        return name in (*STORED, *OPTIONAL)
    return len(parts) == 2 and parts[0] == EVIDENCE and parts[1] not in ("", ".", "..")


def _mismatch(path: Path, want: dict[str, Any], name: str) -> str | None:
    """Why the file ``path`` is not the one the manifest record ``want`` describes."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{name} missing"
    if size != want.get("size"):
        return f"{name} is {size} bytes, the manifest says {want.get('size')}"
    if sha256_file(path) != want.get("sha256"):
        return f"{name} differs from its sha256 in the manifest"
    return None


def _quarantine(found: Path, reason: str) -> None:
    """Move the entry ``found`` (``<cache>/results/<key>``) to the caches' quarantine."""
    from emma.cache import quarantine  # numpy, PIL: only when a stored result is damaged

    quarantine(found, found.parent.parent, REPAIR_KIND, reason)


def entry(cfg: Any, key: str | None = None, *, repair: bool = False) -> Path | None:
    """The stored result of a cell whose inputs hash to a finished one, verified against its
    manifest, else ``None``.

    Args:
        cfg: the cell's configuration.
        key: the cell's key when the caller has computed it.
        repair: move a damaged or incomplete entry to the quarantine (recorded for the cell's
            notes; the cell then computes and stores it again). Without it a damaged entry is
            only not served: a pre-flight check leaves the repair to the cell itself.
    """
    if not enabled(cfg):
        return None
    found = cache_dir(cfg) / "results" / (key or cell_key(cfg))
    if not found.is_dir():
        return None
    reason = damage(found)
    if reason is None:
        return found
    if repair:
        _quarantine(found, reason)
    return None


def lookup(cfg: Any, output_dir: str | os.PathLike) -> Path | None:
    """If the cell's inputs hash to a stored result, copy its files into ``output_dir`` and
    return the path of the copied ``results.json``; else ``None`` (a damaged entry is
    quarantined)."""
    found = entry(cfg, repair=True)
    return None if found is None else serve(found, output_dir)


def serve(found: Path, output_dir: str | os.PathLike) -> Path:
    """Copy a stored result's files (and its evidence images) into ``output_dir``; the path of
    the copied results.json, which then records ``served_from_cache`` (the key and when); its
    ``metrics.csv`` is written from it.

    Each copy is checked against the manifest before any is renamed into place: a stored file
    damaged since :func:`entry` verified it leaves the run directory as it was, moves the
    entry to the quarantine and raises :class:`StoredResultChanged`."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        files = json.loads((found / MANIFEST).read_text())["files"]
        names = [f for f in files if f != KEY_FILE and _stored_name(f)]
    except (OSError, ValueError, KeyError, TypeError):
        files, names = {}, list(FILES)
    tmps = {f: out / (f".{f}.{os.getpid()}.tmp" if "/" not in f else
                      f"{EVIDENCE}/.{f.split('/', 1)[1]}.{os.getpid()}.tmp") for f in names}
    had_evidence = (out / EVIDENCE).exists()
    try:
        try:
            needed = sum(int(files[f].get("size") or 0) for f in names if isinstance(files.get(f), dict))
            with storing(out, "the finished cell's results", needed=needed):
                for f, tmp in tmps.items():
                    tmp.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(found / f, tmp)
            reason = next((r for f, tmp in tmps.items() if (r := _mismatch(tmp, files[f], f))), None)
        except (OSError, ValueError, KeyError, TypeError) as err:
            reason = f"unreadable while served ({type(err).__name__}: {err})"
        if reason is not None:
            _quarantine(found, reason)
            raise StoredResultChanged(
                f"the stored result {found} changed while it was served ({reason}); it was moved to the "
                "quarantine and nothing was written to the run directory: run the same command again "
                "to compute the cell")
        for f in sorted(names, key=lambda f: f == "results.json"):  # results.json last: it marks a finished cell
            if f == "results.json":
                _mark_served(tmps[f], found.name)
            os.replace(tmps[f], out / f)
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
        if not had_evidence and (out / EVIDENCE).is_dir() and not any((out / EVIDENCE).iterdir()):
            (out / EVIDENCE).rmdir()  # nothing served: no folder made for it either
    return out / "results.json"


def _mark_served(path: Path, key: str) -> None:
    """Record in the copied results.json (before it is renamed into place) that it was served
    from the cache, and write the cell's ``metrics.csv`` from it."""
    import time

    from emma.results import write_metrics_table

    data = json.loads(path.read_text())
    data["served_from_cache"] = {"key": key, "served_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with storing(path.parent, "the finished cell's results"):
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        write_metrics_table(data, path.parent)


def store(cfg: Any, output_dir: str | os.PathLike, key: str | None = None) -> Path:
    """Store a finished cell's files under its key (``key`` as computed before the run), with
    the manifest that :func:`entry` verifies (an intact entry with this key is kept, a damaged
    one quarantined and replaced)."""
    from emma.cache import cache_folder  # numpy, PIL: the cell ran, they are loaded

    key = key or cell_key(cfg)
    root = cache_folder(cache_dir(cfg), "results", "results")
    dest = root / key
    if dest.exists():
        reason = damage(dest)
        if reason is None:
            return dest
        _quarantine(dest, reason)
    tmp = root / f".{key}.{os.getpid()}.tmp"
    src = Path(output_dir)
    names = [*FILES, *(f for f in OPTIONAL if (src / f).is_file())]
    if (src / EVIDENCE).is_dir():
        names += sorted(f"{EVIDENCE}/{p.name}" for p in (src / EVIDENCE).iterdir()
                        if p.is_file() and not p.name.startswith("."))
    needed = sum((src / f).stat().st_size for f in names)
    with storing(dest, "the finished cell", needed=needed, cleanup=tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / EVIDENCE).mkdir(parents=True)
        for f in names:
            shutil.copyfile(src / f, tmp / f)
        atomic_write_text(tmp / KEY_FILE, json.dumps(cell_inputs(cfg), sort_keys=True, indent=1, default=str))
        # last, hashed from the stored copies: the manifest vouches for what the entry holds
        manifest = {"format": MANIFEST_FORMAT, "key": key,
                    "files": {f: {"sha256": sha256_file(tmp / f), "size": (tmp / f).stat().st_size}
                              for f in (*names, KEY_FILE)}}
        atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    try:
        os.replace(tmp, dest)
    except OSError:  # stored concurrently by another job: identical inputs, identical entry
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def describe_json(data: dict[str, Any]) -> str:
    """The summary a run prints, from a results.json dict (no torch import)."""
    from emma.results import summary_text

    return summary_text(data)
