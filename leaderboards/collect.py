"""Collect result folders into cell records, refusing to merge incomparable cells.

A record is one ``results.json`` (plus its ``samples.jsonl`` and ``evidence/``), or one
``error.json`` of a cell that crashed. Everything here is a pure function of those files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Sequence

from emma.cache import stable_hash
from emma.errors import EmmaError
from emma.files import sha256_bytes
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
    seed: int | None = None  # the cell's seed (cells that differ only in it are replicates)
    setting: dict[str, Any] = dataclasses.field(default_factory=dict)  # what else sets its numbers
    problems: list[str] = dataclasses.field(default_factory=list)  # invalid values: left off the board
    digest: str = ""  # sha256 of its results.json
    variant: str = ""  # the settings that set it apart from cells of the same coordinates ("" if none)
    budget: dict[str, Any] = dataclasses.field(default_factory=dict)  # results.json's budget (or from its config)
    served: bool = False  # the results.json was served from the results cache

    @property
    def key(self) -> tuple[str, ...]:
        return (self.model, self.label or self.method, self.domain, self.concept, self.attacker, self.classifier)

    @property
    def anchor(self) -> str:
        return "cell-" + stable_hash([str(self.path)])[:12]

    @property
    def display(self) -> str:
        """The method as plots and the ASR matrix name it: with its settings when split."""
        name = self.label or self.method
        return f"{name} [{self.variant}]" if self.variant else name


@dataclasses.dataclass
class FailedCell:
    path: Path
    error: str
    overrides: str


@dataclasses.dataclass
class InvalidCell:
    """A results.json whose values cannot be shown (a metric that is no number, NaN, inf)."""

    path: Path
    problems: list[str]


@dataclasses.dataclass
class MissingCell:
    """A cell folder with neither results.json nor error.json (killed, still running, or lost),
    or jobs of a sweep that left no folder at all (``count`` of them)."""

    path: Path
    reason: str
    count: int = 1


def _short(obj: Any) -> str:
    return stable_hash(obj)[:8]


#: what a concept-dependent value is replaced with before settings are compared
CONCEPT_DEPENDENT = "<depends on the concept>"


def _replace_path(node: Any, path: Sequence[str]) -> Any:
    """A copy of ``node`` with the value at ``path`` (dotted keys) replaced by
    :data:`CONCEPT_DEPENDENT`."""
    if not path or not isinstance(node, dict) or path[0] not in node:
        return CONCEPT_DEPENDENT if not path else node
    return {**node, path[0]: _replace_path(node[path[0]], path[1:])}


def _list_paths(node: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], list[Any]]]:
    """Every list value under ``node`` with its path of keys."""
    if isinstance(node, dict):
        return [found for k, v in node.items() for found in _list_paths(v, (*prefix, str(k)))]
    if isinstance(node, list):
        return [(prefix, node)]
    return []


def concept_free(data: dict[str, Any], kind: str) -> Any:
    """The recorded settings of component ``kind`` (``versions.components.<kind>``) with every
    value that follows the cell's concept replaced by :data:`CONCEPT_DEPENDENT`: the paths the
    cell recorded (``versions.concept_dependent``: settings given as
    ``${emma.other_concepts:...}`` or ``${concept}``), so that one preset run on two concepts
    is one setting."""
    comp = (data.get("versions", {}).get("components") or {}).get(kind)
    for dotted in (data.get("versions", {}).get("concept_dependent") or {}).get(kind, []):
        comp = _replace_path(comp, str(dotted).split("."))
    return comp


def infer_concept_dependent(cells: Sequence[Cell]) -> None:
    """For result files written before ``versions.concept_dependent``: a list setting of a
    method that, in every cell of that method, is "every concept of one set but the cell's
    own" (the list plus the cell's concept is the same set in each cell, and never holds the
    cell's concept) depends on the concept; it is replaced and the signature recomputed."""
    by_method: dict[str, list[Cell]] = defaultdict(list)
    for c in cells:
        if "concept_dependent" not in c.versions:
            by_method[c.config or c.method].append(c)
    for group in by_method.values():
        if len({c.concept for c in group}) < 2:
            continue
        comps = [(c, (c.versions.get("components") or {}).get("method")) for c in group]
        paths = {p for p, _ in _list_paths(comps[0][1])}
        dependent = []
        for path in sorted(paths):
            sets, ok = set(), True
            for c, comp in comps:
                node = comp
                for k in path:
                    node = node.get(k) if isinstance(node, dict) else None
                if not isinstance(node, list) or c.concept in node or not all(isinstance(x, str) for x in node):
                    ok = False
                    break
                sets.add(frozenset([*node, c.concept]))
            if ok and len(sets) == 1:
                dependent.append(".".join(path))
        if dependent:
            for c in group:
                c.versions = {**c.versions, "concept_dependent": {"method": dependent}}
                c.signatures = signatures({"versions": c.versions})


def signatures(data: dict[str, Any]) -> dict[str, str]:
    """What makes two cells comparable: per component, a hash of its version and settings
    (concept-dependent values resolved: :func:`concept_free`), of the model's weights
    (fingerprint) and of the judges' weights."""
    v = data.get("versions", {})
    comps = v.get("components", {})
    model = v.get("model", {})
    return {
        "method": _short(concept_free(data, "method")),
        "attacker": _short(concept_free(data, "attacker")),
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


#: top-level config keys that do not set a cell's numbers beyond what the coordinates and
#: the component signatures hold (or that say where things are, not what was measured)
NOT_SETTINGS = {"concept", "seed", "paths", "logger", "overwrite", "experiment", "threads", "hydra", "method",
                "attacker", "classifier", "domain", "llm", "evidence_images"}
#: model keys that the base fingerprint covers, or that do not change what is drawn
NOT_MODEL_SETTINGS = {"name", "kind", "pretrained", "revision", "variant", "device", "batch_size", "init_seed"}


def _flatten(node: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(node, dict) and node:
        for k, v in node.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = ",".join(map(str, node)) if isinstance(node, list) else node


def budget_of(data: dict[str, Any]) -> dict[str, Any]:
    """The cell's budget: results.json's ``budget`` (schema 3), or for older files what their
    config says (images per prompt, the domain's default resolved; prompt types, ``all`` when
    unset; ``n`` per metric)."""
    if isinstance(data.get("budget"), dict) and data["budget"]:
        return data["budget"]
    cfg = data.get("config") or {}
    ipp = cfg.get("images_per_prompt")
    if ipp is None and isinstance(cfg.get("domain"), dict):
        ipp = cfg["domain"].get("images_per_prompt")
    pt = cfg.get("prompt_types")
    return {"images_per_prompt": ipp, "prompt_types": list(pt) if isinstance(pt, list) else (pt or "all"),
            "n": {k: m.get("n") for k, m in (data.get("metrics") or {}).items() if isinstance(m, dict)},
            "attack": {k[len("attack_budget_"):]: v for k, v in (data.get("counts") or {}).items()
                       if k.startswith("attack_budget_")} or None,
            "protocol": _protocol_of(data.get("protocol")), "fid_reference": (data.get("provenance") or {}).get("fid")}


def _protocol_of(record: Any) -> Any:
    """The comparable part of a results.json ``protocol`` record (schema 2 files carry it
    without a budget): its name and images per attacked prompt."""
    if not isinstance(record, dict) or not record:
        return None
    return {k: record[k] for k in ("name", "images_per_prompt", "images_per_attacked_prompt") if k in record}


def _protocol_name(protocol: Any) -> Any:
    if isinstance(protocol, dict):
        return protocol.get("name") or json.dumps(protocol, sort_keys=True)
    return protocol


def settings(data: dict[str, Any]) -> dict[str, Any]:
    """The cell's budget and settings beyond its coordinates and component signatures, flat:
    ``images_per_prompt`` and ``prompt_types`` (from its budget: :func:`budget_of`), the attack
    ``protocol`` and the FID reference's name where recorded, the sampler
    (``model.guidance_scale``, ...), ``metrics.*``, the metric versions and the attack budget
    (``counts.attack_budget_*``). Two cells with the same coordinates and signatures but other
    settings are never merged."""
    cfg = data.get("config") or {}
    budget = budget_of(data)
    out: dict[str, Any] = {}
    if cfg or data.get("budget"):
        out["images_per_prompt"] = budget.get("images_per_prompt")
        pt = budget.get("prompt_types")
        out["prompt_types"] = ",".join(map(str, pt)) if isinstance(pt, list) else pt
    if budget.get("protocol") is not None:
        out["protocol"] = _protocol_name(budget["protocol"])
        record = budget["protocol"] if isinstance(budget["protocol"], dict) else {}
        per_prompt = record.get("images_per_attacked_prompt")
        if per_prompt is not None:  # ASR rises with the images judged per attacked prompt
            out["protocol.images_per_attacked_prompt"] = per_prompt
    if (budget.get("fid_reference") or {}).get("name"):
        out["fid_reference"] = budget["fid_reference"]["name"]
    for k, v in cfg.items():
        if k in NOT_SETTINGS or k in ("images_per_prompt", "prompt_types", "protocol"):
            continue
        if k == "model" and isinstance(v, dict):
            v = {mk: mv for mk, mv in v.items() if mk not in NOT_MODEL_SETTINGS}
        _flatten(v, k, out)
    for k, v in (data.get("versions", {}).get("metrics") or {}).items():
        out[f"metric_version.{k}"] = v
    for k, v in (data.get("counts") or {}).items():
        if k.startswith("attack_budget_"):
            out[k] = v
    return out


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def metric_problems(key: str, m: Any) -> list[str]:
    """What is wrong with one metric record (empty when it can be shown): the value must be a
    number or null (no value, its note says why); NaN only where nothing was measured (n = 0,
    the harness's "empty"); never infinite; the interval bounds numbers or null; ``n`` a count."""
    if not isinstance(m, dict) or "value" not in m:
        return [f"metric {key!r} is not a record with a value ({str(m)[:60]!r})"]
    out = []
    v, n = m["value"], m.get("n")
    if n is not None and (not _number(n) or n < 0 or n != int(n)):
        out.append(f"metric {key!r} has n={n!r}, not a count")
        n = None
    if v is not None:
        if not _number(v):
            out.append(f"metric {key!r} value {v!r} is not a number")
        elif math.isinf(v):
            out.append(f"metric {key!r} value {v} is infinite")
        elif math.isnan(v) and (n or 0) > 0:
            out.append(f"metric {key!r} value is NaN over n={n} (NaN is written only when nothing was measured, n=0)")
    for bound in ("ci_low", "ci_high"):
        b = m.get(bound)
        if b is not None and (not _number(b) or math.isinf(b)):
            out.append(f"metric {key!r} {bound} {b!r} is not a finite number")
    return out


def parse_results(path: Path) -> Cell:
    """One results.json -> :class:`Cell`, or a :class:`LeaderboardError` naming the file when it
    is no results.json at all. A metric value that cannot be shown does not stop the build:
    the cell's ``problems`` name each one (the board lists the cell as invalid)."""
    try:
        raw = path.read_bytes()
        data = read_results_json(path)
    except OSError as err:
        raise LeaderboardError(f"{path}: not a readable results.json ({err})") from None
    except ResultsFileError as err:
        raise LeaderboardError(str(err)) from None
    missing = {"cell", "metrics", "versions"} - set(data)
    if missing:
        raise LeaderboardError(f"{path}: results.json lacks {sorted(missing)}")
    c = data["cell"]
    if not isinstance(c, dict) or not isinstance(data["metrics"], dict) or not isinstance(data["versions"], dict):
        raise LeaderboardError(f"{path}: results.json's cell, metrics and versions must be objects")
    lacks = [k for k in ("model", "method", "domain", "concept", "attacker", "classifier") if k not in c]
    if lacks:
        raise LeaderboardError(f"{path}: results.json's cell lacks {lacks}")
    problems = [f"{where} is a {type(x).__name__}, not an object" for where, x in (
        ("config", data.get("config")), ("counts", data.get("counts")),
        ("versions.components", data["versions"].get("components")), ("versions.model", data["versions"].get("model")))
        if x is not None and not isinstance(x, dict)]
    if data.get("notes") is not None and not isinstance(data["notes"], list):
        problems.append(f"notes is a {type(data['notes']).__name__}, not a list")
    if problems:  # the rest cannot be read as a cell's
        return Cell(path=path.parent, model=str(c["model"]), method=str(c["method"]), domain=str(c["domain"]),
                    concept=str(c["concept"]), attacker=str(c["attacker"]), classifier=str(c["classifier"]),
                    metrics={}, signatures={}, versions={}, counts={}, notes=[], mtime=path.stat().st_mtime,
                    problems=problems, digest=sha256_bytes(raw))
    metrics = {}
    for k, m in data["metrics"].items():
        found = metric_problems(k, m)
        problems += found
        if not found:
            metrics[k] = dict(m)
    seed = (data.get("config") or {}).get("seed")
    return Cell(path=path.parent, model=str(c["model"]), method=str(c["method"]), domain=str(c["domain"]),
                concept=str(c["concept"]), attacker=str(c["attacker"]), classifier=str(c["classifier"]),
                metrics=metrics, signatures=signatures(data), versions=data["versions"],
                counts=data.get("counts") or {}, notes=list(data.get("notes") or []), mtime=path.stat().st_mtime,
                config=method_config(data), seed=seed if _number(seed) else None, setting=settings(data),
                problems=problems, digest=sha256_bytes(raw), budget=budget_of(data),
                served=data.get("served_from_cache") is not None)


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
        error = str(data.get("error", "?")) if isinstance(data, dict) else f"error.json holds a {type(data).__name__}"
    except (OSError, ValueError) as err:
        error = f"unreadable error.json ({err})"
    overrides = ""
    ov = path.parent / ".hydra" / "overrides.yaml"
    try:
        overrides = " ".join(line.lstrip("- ").strip() for line in ov.read_text().splitlines() if line.strip())
    except (OSError, ValueError):  # absent or unreadable: the folder names the cell
        overrides = ""
    return FailedCell(path=path.parent, error=error.splitlines()[0][:500] if error else "?", overrides=overrides)


def _component_name(cell: Cell, kind: str) -> str:
    return {"method": cell.label or cell.method, "attacker": cell.attacker, "classifier": cell.classifier,
            "model": cell.model, "domain": cell.domain}[kind]


def _describe(cell: Cell, kind: str) -> str:
    comps = cell.versions.get("components", {})
    if kind == "method":
        m = concept_free({"versions": cell.versions}, "method") or {}
        return f"version {m.get('version', '?')}, settings {_short(m)}"
    if kind == "model":
        return f"fingerprint {str(cell.versions.get('model', {}).get('base_fingerprint'))[:12]}"
    if kind == "classifier":
        cls = comps.get("classifiers") or {}
        return ", ".join(f"{n} v{d.get('version', '?')} weights {str(d.get('weights_sha256'))[:12]}"
                         for n, d in cls.items()) or "?"
    shown = concept_free({"versions": cell.versions}, kind) if kind == "attacker" else comps.get(kind)
    return f"settings {_short(shown)}"


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


def _differs(cells: Sequence[Cell]) -> list[str]:
    """The setting keys whose values are not the same in all of ``cells``."""
    keys = sorted({k for c in cells for k in c.setting})
    return [k for k in keys if len({json.dumps(c.setting.get(k), sort_keys=True, default=str) for c in cells}) > 1]


def _show_setting(cell: Cell, keys: Sequence[str]) -> str:
    return ", ".join(f"{k}={cell.setting.get(k)}" for k in keys)


def split_settings(cells: list[Cell]) -> list[str]:
    """Cells of one method, attacker, judge and model (any concept and seed) that differ in
    budget or settings (:func:`settings`: images per prompt, prompt types, sampler, attack
    budget, ...) are never merged nor compared as one: each gets a ``variant`` naming the
    keys that differ (``images_per_prompt=12``), shown as its own rows. Returns the notes
    that say why."""
    notes = []
    by_domain: dict[str, list[Cell]] = defaultdict(list)
    for c in cells:
        c.variant = ""
        by_domain[c.domain].append(c)
    for domain, group in sorted(by_domain.items()):
        families: dict[tuple, list[Cell]] = defaultdict(list)
        for c in group:
            families[(c.model, c.label or c.method, c.attacker, c.classifier,
                      tuple(sorted(c.signatures.items())))].append(c)
        keys: list[str] = []
        for (model, method, attacker, _, _), fam in sorted(families.items(), key=lambda kv: kv[0][:4]):
            differ = _differs(fam)
            if differ:
                shown = sorted({_show_setting(c, differ) for c in fam})
                notes.append(f"{domain}: cells of method '{method}', attacker '{attacker}', model '{model}' differ "
                             f"in {', '.join(differ)} ({' | '.join(shown)}): different budgets or settings are shown "
                             "as separate rows (column 'setting'), never merged")
                keys += [k for k in differ if k not in keys]
        if keys:
            for c in group:
                c.variant = _show_setting(c, keys)
    return notes


def group_replicates(cells: list[Cell]) -> tuple[list[list[Cell]], list[str]]:
    """Cells with the same coordinates, signatures and settings that differ only in their seed
    are replicates: one row each group, pooled by :func:`leaderboards.tables.pool`. The same
    cell (same seed) found twice counts once when its numbers agree; when they differ (another
    machine, thread count or library version) both are kept and a note says so."""
    groups: dict[tuple, list[Cell]] = defaultdict(list)
    for cell in sorted(cells, key=lambda c: (str(c.path))):
        k = (cell.key, tuple(sorted(cell.signatures.items())), json.dumps(cell.setting, sort_keys=True, default=str))
        groups[k].append(cell)
    rows, notes = [], []
    for k in sorted(groups, key=lambda k: k[0]):
        kept: list[Cell] = []
        for cell in sorted(groups[k], key=lambda c: (c.seed if c.seed is not None else -1, str(c.path))):
            twin = next((o for o in kept if o.seed == cell.seed), None)
            if twin is None:
                kept.append(cell)
            elif _values(twin) == _values(cell):
                notes.append(f"{cell.path} repeats {twin.path} (seed {cell.seed}, same numbers): counted once")
            else:
                kept.append(cell)
                notes.append(f"{cell.path} and {twin.path}: same setting and seed {cell.seed} but different numbers "
                             "(another machine, thread count or library?); both are pooled")
        rows.append(kept)
    return rows, notes


def _values(cell: Cell) -> dict[str, Any]:
    return {k: m.get("value") for k, m in cell.metrics.items() if not k.startswith("time/")}


#: files or folders that only a cell's run directory holds
CELL_MARKERS = (".hydra", "run.log", ".emma-cell.lock", "samples.jsonl", "evidence")
_NOT_CELLS = {".submitit", "wandb", "evidence", ".hydra", "quarantine"}


def find_missing(runs: Iterable[str | os.PathLike]) -> list[MissingCell]:
    """Cell folders under ``runs`` that hold neither results.json nor error.json, and jobs of a
    sweep (``multirun.yaml``) that left no folder (never started, or their folder was removed)."""
    missing: list[MissingCell] = []
    for run in runs:
        run = Path(run)
        if not run.is_dir():
            continue
        for folder, dirs, files in os.walk(run):
            dirs[:] = sorted(d for d in dirs if d not in _NOT_CELLS)
            here = Path(folder)
            names = set(files) | set(os.listdir(here))
            if "results.json" in names or "error.json" in names:
                continue
            marks = [m for m in CELL_MARKERS if m in names]
            if marks:
                missing.append(MissingCell(here, f"neither results.json nor error.json (it holds {', '.join(marks)}): "
                                                 "the cell was killed, is still running, or its results were removed"))
            if "multirun.yaml" in files:
                missing += _unstarted_jobs(here)
    return missing


def _unstarted_jobs(sweep: Path) -> list[MissingCell]:
    """Jobs of the sweep in ``sweep`` (its ``multirun.yaml``) without a folder of their own."""
    expected = expected_jobs(sweep / "multirun.yaml")
    if expected is None:
        return []
    started = [d for d in sweep.iterdir() if d.is_dir() and d.name not in _NOT_CELLS and
               any((d / m).exists() for m in ("results.json", "error.json", *CELL_MARKERS))]
    if len(started) >= expected:
        return []
    lost = expected - len(started)
    return [MissingCell(sweep, f"{lost} of the sweep's {expected} jobs left no folder (never started: the sweep "
                               "was stopped, or their folders were removed)", count=lost)]


def expected_jobs(multirun_yaml: Path) -> int | None:
    """How many jobs the sweep recorded in ``multirun_yaml`` has (its overrides and its
    sweeper's ``params``, expanded as Hydra's basic sweeper does); ``None`` when unknown."""
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(multirun_yaml)
        task = [str(o) for o in OmegaConf.select(cfg, "hydra.overrides.task", default=[]) or []]
        node = OmegaConf.select(cfg, "hydra.sweeper.params", default=None)
        params = OmegaConf.to_container(node, resolve=False) if node is not None else {}
        parser = OverridesParser.create()
        given = {o.get_key_element() for o in parser.parse_overrides(task)}
        extra = [f"{k}={v}" for k, v in params.items() if k not in given and v is not None]
        batches = BasicSweeper.split_arguments(parser.parse_overrides(extra + task), None)
        return sum(len(b) for b in batches)
    except Exception:  # noqa: BLE001 - another sweeper or a foreign file: no count
        return None
