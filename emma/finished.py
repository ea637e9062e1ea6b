"""Finished cells, content-addressed: a cell whose inputs hash to a stored result is served
from the cache without loading a pipeline.

The key is the sha256 of everything a cell's numbers depend on:

- the resolved configuration (without ``paths``: where the caches live moves no number);
- the harness's code and shipped data: every file of the packages ``emma``, ``methods``,
  ``attackers``, ``classifiers``, ``stace`` and ``conf`` (so any component's version, any
  metric's definition and the tiny-world weights are in it);
- the content of every local file or folder the configuration names (``model.pretrained``,
  a classifier's ``weights``, ...), memoised by (path, size, mtime) so a 4 GB checkpoint is
  read once; a hub id enters as its name, revision and variant;
- the versions of the numerical libraries (torch, diffusers, transformers, numpy, scipy).

Layout: ``<cache>/results/<key>/{results.json, samples.jsonl, key.json}``, written to a
temporary folder and renamed into place. This module imports no torch, so the hit path of
``python -m emma.run`` stays cheap.
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
from emma.files import atomic_write_text, update_with_file

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("emma", "methods", "attackers", "classifiers", "stace")
LIBRARIES = ("torch", "diffusers", "transformers", "numpy", "scipy", "clean-fid", "scikit-image")
FILES = ("results.json", "samples.jsonl")


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
    config = {k: v for k, v in config.items() if k != "paths"}
    cache_root = cache_dir(cfg)
    return {
        "config": config,
        "code": code_hash(),
        "local_files": {k: local_fingerprint(Path(p), cache_root) for k, p in sorted(_paths_in(config).items())},
        "libraries": {n: _version(n) for n in LIBRARIES},
        "python": sys.version.split()[0],
    }


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


def entry(cfg: Any, key: str | None = None) -> Path | None:
    """The stored result of a cell whose inputs hash to a finished one, else ``None``
    (``key``: the cell's key when the caller has computed it)."""
    if not enabled(cfg):
        return None
    found = cache_dir(cfg) / "results" / (key or cell_key(cfg))
    return found if all((found / f).is_file() for f in FILES) else None


def lookup(cfg: Any, output_dir: str | os.PathLike) -> Path | None:
    """If the cell's inputs hash to a stored result, copy its files into ``output_dir`` and
    return the path of the copied ``results.json``; else ``None``."""
    found = entry(cfg)
    return None if found is None else serve(found, output_dir)


def serve(found: Path, output_dir: str | os.PathLike) -> Path:
    """Copy a stored result's files into ``output_dir``; the path of the copied results.json."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in reversed(FILES):  # results.json last: its presence marks a finished cell
        tmp = out / f".{f}.{os.getpid()}.tmp"
        shutil.copyfile(found / f, tmp)
        os.replace(tmp, out / f)
    return out / "results.json"


def store(cfg: Any, output_dir: str | os.PathLike, key: str | None = None) -> Path:
    """Store a finished cell's files under its key (``key`` as computed before the run)."""
    key = key or cell_key(cfg)
    root = cache_dir(cfg) / "results"
    dest = root / key
    if dest.exists():
        return dest
    tmp = root / f".{key}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in FILES:
        shutil.copyfile(Path(output_dir) / f, tmp / f)
    (tmp / "key.json").write_text(json.dumps(cell_inputs(cfg), sort_keys=True, indent=1, default=str))
    try:
        os.replace(tmp, dest)
    except OSError:  # stored concurrently by another job: identical inputs, identical entry
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def describe_json(data: dict[str, Any]) -> str:
    """The summary a run prints, from a results.json dict (no torch import)."""
    c = data["cell"]
    rows = [f"cell: model={c['model']} method={c['method']} domain={c['domain']} concept={c['concept']} "
            f"attacker={c['attacker']} classifier={c['classifier']}",
            f"{'metric':<44}{'value':>10}{'95% CI':>22}{'n':>8}{'clusters':>10}"]
    for k, v in sorted(data["metrics"].items()):
        ci = f"[{v['ci_low']:.3f}, {v['ci_high']:.3f}]" if v.get("ci_low") is not None else ""
        value = v["value"] if v["value"] is not None else float("nan")
        rows.append(f"{k:<44}{value:>10.4f}{ci:>22}{v['n']:>8}{v.get('n_clusters') or '':>10}")
    rows.append(", ".join(f"{k}={v}" for k, v in data["counts"].items()))
    rows += [f"NOTE: {n}" for n in data.get("notes", [])]
    return "\n".join(rows)
