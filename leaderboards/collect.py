"""Collect result folders into cell records, refusing to merge incomparable cells.

A record is one ``results.json`` (plus its ``samples.jsonl`` and ``evidence/``), or one
``error.json`` of a cell that crashed. Everything here is a pure function of those files.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from emma.cache import stable_hash
from emma.errors import EmmaError
from emma.results import ResultsFileError, read_results_json


class LeaderboardError(EmmaError):
    """Result files that cannot be put on one leaderboard (the message says why)."""


@dataclasses.dataclass
class Cell:
    """One finished cell, as the leaderboard sees it."""

    path: Path  # the folder holding results.json
    model: str
    method: str
    domain: str
    concept: str
    attacker: str
    classifier: str
    metrics: dict[str, dict[str, Any]]  # key -> {value, ci_low, ci_high, n, ...}
    signatures: dict[str, str]  # component kind -> short hash of what determines its numbers
    versions: dict[str, Any]
    counts: dict[str, Any]
    notes: list[str]
    mtime: float
    label: str = ""  # the method's name on the board (``esd`` or ``esd@1a2b3c`` when split)
    config: str = ""  # the method's config name (``esd_100``) when it differs from the class's


    @property
    def key(self) -> tuple[str, ...]:
        return (self.model, self.label or self.method, self.domain, self.concept, self.attacker, self.classifier)

    @property
    def anchor(self) -> str:
        return "cell-" + stable_hash([str(self.path)])[:12]


@dataclasses.dataclass
class FailedCell:
    path: Path
    error: str
    overrides: str


def _short(obj: Any) -> str:
    return stable_hash(obj)[:8]


def signatures(data: dict[str, Any]) -> dict[str, str]:
    """What makes two cells comparable: per component, a hash of its version and settings,
    of the model's weights (fingerprint) and of the judges' weights."""
    v = data.get("versions", {})
    comps = v.get("components", {})
    model = v.get("model", {})
    return {
        "method": _short(comps.get("method")),
        "attacker": _short(comps.get("attacker")),
        "classifier": _short(comps.get("classifiers")),
        "model": _short(model.get("base_fingerprint")),
        "domain": _short(comps.get("domain")),
    }


def method_config(data: dict[str, Any]) -> str:
    """The config file the cell's method came from (``esd_100``, ``ca_model``): recorded in
    ``versions.choices``; older results name it through their preset (``esd_100_tiny``)."""
    v = data.get("versions", {})
    choice = (v.get("choices") or {}).get("method")
    if choice:
        return str(choice)
    presets = v.get("presets") or {}
    preset, scale = presets.get("method"), presets.get("scale")
    if preset and scale and str(preset).endswith(f"_{scale}"):
        return str(preset)[: -len(scale) - 1]
    return ""


def parse_results(path: Path) -> Cell:
    """One results.json -> :class:`Cell`, or a :class:`LeaderboardError` naming the file."""
    try:
        data = read_results_json(path)
    except ResultsFileError as err:
        raise LeaderboardError(str(err)) from None
    missing = {"cell", "metrics", "versions"} - set(data)
    if missing:
        raise LeaderboardError(f"{path}: results.json lacks {sorted(missing)}")
    c = data["cell"]
    metrics = {}
    for k, m in data["metrics"].items():
        if not isinstance(m, dict) or "value" not in m:
            raise LeaderboardError(f"{path}: metric {k!r} has no 'value' ({m!r})")
        metrics[k] = dict(m)
    return Cell(path=path.parent, model=c["model"], method=c["method"], domain=c["domain"],
                concept=c["concept"], attacker=c["attacker"], classifier=c["classifier"], metrics=metrics,
                signatures=signatures(data), versions=data["versions"], counts=data.get("counts", {}),
                notes=list(data.get("notes", [])), mtime=path.stat().st_mtime, config=method_config(data))


def find_result_files(runs: Iterable[str | os.PathLike]) -> tuple[list[Path], list[Path]]:
    """``results.json`` files and ``error.json`` files (of cells without results) under ``runs``."""
    results, errors = [], []
    for run in runs:
        run = Path(run)
        if run.is_file():
            (results if run.name == "results.json" else errors).append(run)
            continue
        if not run.exists():
            raise LeaderboardError(f"{run}: no such file or folder")
        for p in sorted(run.rglob("results.json")):
            if ".submitit" not in p.parts:
                results.append(p)
        for p in sorted(run.rglob("error.json")):
            if not (p.parent / "results.json").exists():
                errors.append(p)
    return results, errors


def parse_error(path: Path) -> FailedCell:
    try:
        data = json.loads(path.read_text())
        error = str(data.get("error", "?"))
    except (OSError, json.JSONDecodeError) as err:
        error = f"unreadable error.json ({err})"
    overrides = ""
    ov = path.parent / ".hydra" / "overrides.yaml"
    if ov.exists():
        overrides = " ".join(line.lstrip("- ").strip() for line in ov.read_text().splitlines() if line.strip())
    return FailedCell(path=path.parent, error=error.splitlines()[0][:500] if error else "?", overrides=overrides)


def _component_name(cell: Cell, kind: str) -> str:
    return {"method": cell.label or cell.method, "attacker": cell.attacker, "classifier": cell.classifier,
            "model": cell.model, "domain": cell.domain}[kind]


def _describe(cell: Cell, kind: str) -> str:
    comps = cell.versions.get("components", {})
    if kind == "method":
        m = comps.get("method") or {}
        return f"version {m.get('version', '?')}, settings {_short(m)}"
    if kind == "model":
        return f"fingerprint {str(cell.versions.get('model', {}).get('base_fingerprint'))[:12]}"
    if kind == "classifier":
        cls = comps.get("classifiers") or {}
        return ", ".join(f"{n} v{d.get('version', '?')} weights {str(d.get('weights_sha256'))[:12]}"
                         for n, d in cls.items()) or "?"
    return f"settings {_short(comps.get(kind))}"


def check_comparable(cells: list[Cell], split_versions: bool = False) -> list[str]:
    """Refuse (or, with ``split_versions``, separate) cells whose method, attacker, classifier,
    model or domain differ in version, settings or weights under the same name.

    Returns notes on what was split; sets each cell's ``label``.
    """
    notes: list[str] = []
    for cell in cells:  # configs of one class (esd, esd_100, esd_u) are rows of their own
        cell.label = cell.config or cell.method
    for kind in ("method", "attacker", "classifier", "model", "domain"):
        by_name: dict[str, dict[str, list[Cell]]] = defaultdict(lambda: defaultdict(list))
        for cell in cells:
            by_name[_component_name(cell, kind)][cell.signatures[kind]].append(cell)
        for name, variants in sorted(by_name.items()):
            if len(variants) < 2:
                continue
            lines = [f"  {_describe(group[0], kind)}: {len(group)} cell(s), e.g. {group[0].path}"
                     for sig, group in sorted(variants.items())]
            if not split_versions or kind not in ("method", "attacker"):
                how = ("build them separately, or pass --split-versions to give each version its own rows"
                       if kind in ("method", "attacker") else "build them separately")
                raise LeaderboardError(
                    f"{kind} '{name}' appears in {len(variants)} different versions/settings; cells that "
                    f"differ are never merged ({how}):\n" + "\n".join(lines))
            for sig, group in variants.items():
                for cell in group:
                    if kind == "method":
                        cell.label = f"{name}@{sig[:6]}"
                    else:
                        cell.attacker = f"{cell.attacker}@{sig[:6]}"
            notes.append(f"{kind} '{name}' split into {len(variants)} versions:\n" + "\n".join(lines))
    return notes


def dedupe(cells: list[Cell]) -> tuple[list[Cell], list[str]]:
    """The same cell (same coordinates and signatures) found twice -> the newest copy."""
    newest: dict[tuple, Cell] = {}
    notes = []
    for cell in sorted(cells, key=lambda c: c.mtime):
        k = (cell.key, tuple(sorted(cell.signatures.items())))
        if k in newest:
            notes.append(f"{cell.path} repeats {newest[k].path}; the newer one is shown")
        newest[k] = cell
    return list(newest.values()), notes
