"""The typed, versioned schema of a cell's files: ``results.json``, its flat ``metrics.csv``
and the rows of ``samples.jsonl``.

Result files are the source of truth: leaderboards and W&B tables are derived from them.
Bump :data:`SCHEMA_VERSION` whenever a field changes meaning.

Loading them with the ecosystem's tools (one line each)::

    pd.read_csv("outputs/.../metrics.csv")                 # one cell, one row per metric
    emma.results.load_frame("multirun/2026-12-05_10-00-00")   # every cell under a folder
    datasets.load_dataset("json", data_files="multirun/2026-12-05_10-00-00/*/samples.jsonl")
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from emma.errors import EmmaError
from emma.files import atomic_write_text
from emma.metrics.base import MetricValue

SCHEMA_VERSION = 3
#: versions :meth:`CellResult.from_json` still reads. 1 -> 2: metrics gained ``method``,
#: ``n_clusters``, ``note``, ``n_excluded``; results gained ``provenance``. A version-1 file
#: loads with those fields empty (its intervals are the older percentile bootstrap over images).
#: 2 -> 3: results gained ``budget`` (what a number may be compared with) and
#: ``served_from_cache``; image rates' intervals are the beta-binomial profile likelihood.
READABLE_SCHEMA_VERSIONS = (1, 2, 3)
#: names that hold a secret: ``api_key``, ``token``, ``hf_token``, ``secret``, ``password``,
#: ``authorization`` ... as whole words (``_`` and ``-`` separate words), so ``max_tokens``,
#: ``prompt_tokens`` or ``tokenizer`` are not secrets; ``*_env`` names an environment
#: variable (``api_key_env: OPENAI_API_KEY``), not its value.
SECRET_KEY = re.compile(r"(?<![a-z])(api[_-]?key|token|secret|password|passwd|authorization)(?![a-z])", re.I)
REDACTED = "***"
#: ``scheme://user:password@`` in a URL: the credential part is replaced with ``***``
URL_CREDENTIALS = re.compile(r"\b([a-z][a-z0-9+.-]*://)[^/\s@?#]+@", re.I)


class ResultsFileError(EmmaError, ValueError):
    """A results.json this harness cannot read: not JSON, or a schema version it does not know."""


def check_schema_version(data: Any, where: str = "results.json") -> int:
    """The schema version of a results.json dict, or :class:`ResultsFileError` naming the
    versions this harness reads (:data:`READABLE_SCHEMA_VERSIONS`)."""
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version not in READABLE_SCHEMA_VERSIONS:
        raise ResultsFileError(
            f"{where}: schema_version {version!r} is unknown; this harness reads schema versions "
            f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))} (re-run the cell, or read the file with "
            "the harness that wrote it)")
    return int(version)


def read_results_json(path: str | Path) -> dict[str, Any]:
    """The dict of one results.json, its schema version checked: what every reader of result
    files (:meth:`CellResult.load`, the leaderboards) goes through, so all accept the same
    versions. Raises :class:`ResultsFileError` naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # ValueError: invalid JSON or text
        raise ResultsFileError(f"{path}: not a readable results.json ({err})") from None
    check_schema_version(data, str(path))
    return data


@dataclasses.dataclass
class CellInfo:
    model: str
    method: str
    domain: str
    concept: str
    attacker: str
    classifier: str


@dataclasses.dataclass
class CellResult:
    """One cell's results.

    Attributes:
        metrics: key (``ea/name``, ``ra/random``, ``asr``, ``fid``, ``time/...``) -> value
            with 95% bootstrap CI and sample count.
        cell: the cell's coordinates.
        config: the resolved configuration, secrets redacted.
        versions: package, components (with ``version``), data-file hashes, git hash.
        timing: wall seconds per stage.
        counts: ``images_generated``, ``images_cached``, ...
        notes: caveats a reader must see (e.g. random weights: plumbing only).
        provenance: where replayed measurements come from (``time/...``: machine, replayed
            or measured now; ``fid``: the reference statistics).
        protocol: how the attack's success was measured (:mod:`emma.protocol`): name,
            images per attacked prompt, judge and sampler, search seeds, ``uses_judge``;
            empty in results written before protocols existed.
        budget: what the numbers may be compared with (:func:`budget_block`): images per
            prompt, prompt types and prompts per type, ``n`` per metric, the attack budget and
            protocol, the FID reference's identity. Cells whose budgets differ are not
            comparable (the leaderboard splits them).
        served_from_cache: ``None`` when the cell was computed in this run directory; else the
            finished-cell key and time it was served from the results cache.
    """

    metrics: dict[str, MetricValue]
    cell: CellInfo
    config: dict[str, Any]
    versions: dict[str, Any]
    timing: dict[str, float]
    counts: dict[str, int]
    notes: list[str] = dataclasses.field(default_factory=list)
    provenance: dict[str, Any] = dataclasses.field(default_factory=dict)
    protocol: dict[str, Any] = dataclasses.field(default_factory=dict)
    budget: dict[str, Any] = dataclasses.field(default_factory=dict)
    served_from_cache: dict[str, Any] | None = None
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "cell": dataclasses.asdict(self.cell),
            "metrics": {k: v.to_json() for k, v in sorted(self.metrics.items())},
            "config": redact(self.config),
            "versions": self.versions,
            "timing": self.timing,
            "counts": self.counts,
            "notes": self.notes,
            "provenance": self.provenance,
            "protocol": self.protocol,
            "budget": self.budget,
            "served_from_cache": self.served_from_cache,
        }

    def save(self, path: str | Path) -> None:
        atomic_write_text(Path(path), json.dumps(self.to_json(), indent=2, default=str) + "\n")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "CellResult":
        version = check_schema_version(data)
        fields = {f.name for f in dataclasses.fields(MetricValue)}
        for key, v in data.get("metrics", {}).items():
            unknown = set(v) - fields
            if unknown:
                raise ValueError(f"results.json metric {key!r} has unknown fields {sorted(unknown)}")
        missing = {"cell", "metrics", "config", "versions", "timing", "counts"} - set(data)
        if missing:
            raise ValueError(f"results.json lacks {sorted(missing)}")
        return cls(
            metrics={k: MetricValue(**v) for k, v in data["metrics"].items()},
            cell=CellInfo(**data["cell"]),
            config=data["config"],
            versions=data["versions"],
            timing=data["timing"],
            counts=data["counts"],
            notes=list(data.get("notes", [])),
            provenance=dict(data.get("provenance", {})),
            protocol=dict(data.get("protocol", {})),
            budget=dict(data.get("budget") or {}),
            served_from_cache=data.get("served_from_cache"),
            schema_version=version,
        )

    @classmethod
    def load(cls, path: str | Path) -> "CellResult":
        return cls.from_json(read_results_json(path))


def is_secret_name(name: str) -> bool:
    """Whether a config key or environment variable named ``name`` holds a secret
    (:data:`SECRET_KEY`)."""
    name = str(name)
    return bool(SECRET_KEY.search(name)) and not name.lower().endswith("_env")


def strip_url_credentials(text: str) -> str:
    """``text`` with the ``user:password@`` of every URL in it replaced by ``***@``."""
    return URL_CREDENTIALS.sub(rf"\1{REDACTED}@", text)


def url_credentials(text: str) -> list[str]:
    """The ``user:password`` parts of the URLs in ``text`` (and their password alone), to
    scrub wherever they might be echoed."""
    found = []
    for m in re.finditer(r"\b[a-z][a-z0-9+.-]*://([^/\s@?#]+)@", text, re.I):
        found.append(m.group(1))
        if ":" in m.group(1):
            found.append(m.group(1).split(":", 1)[1])
    return [f for f in found if f]


def redact(obj: Any) -> Any:
    """Replace the values of secret keys (:func:`is_secret_name`: api_key, token, password,
    ...; not max_tokens) with ``***`` and remove credentials from URLs
    (:func:`strip_url_credentials`)."""
    if isinstance(obj, dict):
        return {k: (REDACTED if is_secret_name(k) and v not in (None, "") else redact(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    if isinstance(obj, str):
        return strip_url_credentials(obj)
    return obj


# --- comparability ---------------------------------------------------------------------------

#: per metric key prefix, whether a higher value is better (``None``: neither: signed bias parts)
DIRECTIONS: tuple[tuple[str, bool | None], ...] = (
    ("ea", True), ("ra", True), ("asr", False), ("sir_h", False), ("sir_i", False), ("ser", None),
    ("eii", True), ("fid", False), ("time/", False), ("llm/", False), ("stace/cost", False),
)


def higher_is_better(key: str) -> bool | None:
    """The direction of metric ``key`` (``ea/name`` -> True, ``fid`` -> False; the bias
    parts: ``amplification`` lower is better, the signed ones neither)."""
    if key.startswith("bias/"):
        return False if key.endswith("/amplification") else None
    for prefix, better in DIRECTIONS:
        if key == prefix or key.startswith(prefix if prefix.endswith("/") else prefix + "/"):
            return better
    return None


def budget_block(*, images_per_prompt: int | None, prompt_types: list[str], prompts: dict[str, int],
                 metrics: dict[str, MetricValue], attack: dict[str, Any] | None = None,
                 protocol: Any = None, fid_reference: dict[str, Any] | None = None,
                 bias_images_per_prompt: int | None = None) -> dict[str, Any]:
    """The ``budget`` of a results.json: everything a number depends on besides the method
    and the model, in one place, so that a reader (and the leaderboard) can tell which numbers
    may stand side by side.

    Args:
        images_per_prompt: images drawn per prompt (seeds ``seed .. seed + k - 1``).
        prompt_types: the prompt types the suite drew (``name``, ..., ``random``).
        prompts: prompts per ``group/type`` (``ea/short: 5``).
        metrics: the cell's metrics (their ``n`` and ``n_clusters`` are copied).
        attack: the attacker's budget (``steps``, ``queries``, ...), ``None`` for none.
        protocol: the attack protocol the cell ran under, where one is configured.
        fid_reference: the identity of the reference FID was computed against (name, image
            count, feature extractor, sha256 of its statistics).
        bias_images_per_prompt: images per bias prompt (``None``: bias off).
    """
    return {
        "images_per_prompt": images_per_prompt,
        "prompt_types": list(prompt_types),
        "prompts": dict(prompts),
        "n": {k: v.n for k, v in sorted(metrics.items())},
        "n_clusters": {k: v.n_clusters for k, v in sorted(metrics.items()) if v.n_clusters is not None},
        "attack": dict(attack) if attack else None,
        "protocol": protocol,
        "fid_reference": fid_reference,
        "bias_images_per_prompt": bias_images_per_prompt,
    }


# --- samples.jsonl: one row per judged image, one schema ------------------------------------------

#: the version of the row schema below (every row of every cell has exactly these fields)
SAMPLES_SCHEMA = 1
#: field -> (type, value when it does not apply). No field is ever ``null``: Arrow (and so
#: ``datasets.load_dataset("json", ...)``) then reads the files of a whole sweep as one table.
SAMPLE_FIELDS: dict[str, tuple[type, Any]] = {
    "model": (str, ""), "method": (str, ""), "attacker": (str, ""), "domain": (str, ""),
    "classifier": (str, ""),
    "cell_concept": (str, ""),    # the concept the cell erases
    "cell_seed": (int, 0),
    "group": (str, ""),           # ea | ra | attack
    "kind": (str, ""),            # the prompt type: name, prefix, variant, short, long, random, similar
    "prompt": (str, ""),          # the text drawn (an attack's adversarial prompt)
    "concept": (str, ""),         # the concept the judge checked in this image
    "seed": (int, 0),
    "image_hash": (str, ""),      # sha256 of the pixels (the image cache's key)
    "image": (str, ""),           # the image's path relative to the cell folder ("" when not exported)
    "detected": (bool, False),
    "score": (float, 0.0),
    "excluded": (bool, False),    # the judge could not decide (GCD: no face); left out of the rates
    "cached": (bool, False),
    "attack_index": (int, -1),    # the attacked prompt's index (-1: a suite image)
    "original_prompt": (str, ""),  # the suite prompt the attack started from (a suite image: its prompt)
    "adversarial_prompt": (str, ""),  # the attack's prompt text ("" for a suite image)
    "attack_success": (bool, False),
    "queries": (int, 0),
    "judged_queries": (int, 0),    # images the attack's search had the judge score for this prompt
    "iterations": (int, 0),
    "attack_time_s": (float, 0.0),
    "attack_cached": (bool, False),
    "kept_original": (bool, False),  # the attack handed on the original prompt (its search judged it better)
    "search_seeds": (str, "[]"),  # the seeds the attack's search drew for this prompt, as JSON text
    "extra": (str, "{}"),         # whatever else the judge or attacker recorded, as JSON text
}


def sample_row(**values: Any) -> dict[str, Any]:
    """One ``samples.jsonl`` row with every field of :data:`SAMPLE_FIELDS`, in that order, each
    of its type (``None`` or absent: the field's "does not apply" value). Unknown fields are
    refused, so the schema stays one."""
    unknown = set(values) - set(SAMPLE_FIELDS)
    if unknown:
        raise ValueError(f"samples.jsonl has no field(s) {sorted(unknown)}; fields: {', '.join(SAMPLE_FIELDS)}")
    row = {}
    for name, (kind, default) in SAMPLE_FIELDS.items():
        v = values.get(name)
        if v is None:
            row[name] = default
        elif name in ("extra", "search_seeds") and not isinstance(v, str):
            row[name] = json.dumps(v, sort_keys=True, default=str)
        else:
            row[name] = kind(v)
    return row


# --- metrics.csv: one row per metric, the cell's coordinates and budget on each ------------------

METRICS_TABLE = "metrics.csv"
#: the columns of ``metrics.csv`` (and of :func:`load_frame`)
METRIC_TABLE_FIELDS = ("model", "method", "domain", "concept", "attacker", "classifier", "seed",
                       "images_per_prompt", "prompt_types", "protocol", "metric", "value", "ci_low", "ci_high",
                       "n", "n_clusters", "interval", "higher_is_better", "n_excluded", "note",
                       "served_from_cache", "schema_version")


def metric_table_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of ``metrics.csv`` for one results.json dict."""
    cell, budget, cfg = data.get("cell") or {}, data.get("budget") or {}, data.get("config") or {}
    protocol = budget.get("protocol")
    if isinstance(protocol, dict):
        protocol = protocol.get("name", json.dumps(protocol, sort_keys=True))
    ipp = budget.get("images_per_prompt", cfg.get("images_per_prompt"))
    types = budget.get("prompt_types", cfg.get("prompt_types"))
    base = {k: cell.get(k) for k in ("model", "method", "domain", "concept", "attacker", "classifier")}
    base.update(seed=cfg.get("seed"), images_per_prompt=ipp,
                prompt_types=",".join(map(str, types)) if isinstance(types, list) else types, protocol=protocol,
                served_from_cache=data.get("served_from_cache") is not None,
                schema_version=data.get("schema_version"))
    rows = []
    for key, m in sorted((data.get("metrics") or {}).items()):
        rows.append({**base, "metric": key, "value": m.get("value"), "ci_low": m.get("ci_low"),
                     "ci_high": m.get("ci_high"), "n": m.get("n"), "n_clusters": m.get("n_clusters"),
                     "interval": m.get("method"), "higher_is_better": higher_is_better(key),
                     "n_excluded": m.get("n_excluded"), "note": m.get("note")})
    return rows


def write_metrics_table(data: dict[str, Any], out: str | Path) -> Path:
    """Write ``metrics.csv`` (:data:`METRIC_TABLE_FIELDS`) for the results.json dict ``data``
    into the folder ``out``: ``pandas.read_csv`` reads it as is."""
    import csv
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=METRIC_TABLE_FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(metric_table_rows(data))
    path = Path(out) / METRICS_TABLE
    atomic_write_text(path, buf.getvalue())
    return path


def load_frame(*paths: str | Path) -> Any:
    """Every results.json under ``paths`` (folders searched recursively, or files) as one
    ``pandas.DataFrame`` of :data:`METRIC_TABLE_FIELDS` plus ``path`` (the cell folder): one
    row per cell and metric. Schema versions are checked (:func:`read_results_json`)."""
    import pandas as pd

    files: list[Path] = []
    for p in map(Path, paths):
        files += [p] if p.is_file() else sorted(q for q in p.rglob("results.json") if ".submitit" not in q.parts)
    rows = [{**r, "path": str(f.parent)} for f in files for r in metric_table_rows(read_results_json(f))]
    return pd.DataFrame(rows, columns=[*METRIC_TABLE_FIELDS, "path"])


def summary_text(data: dict[str, Any], width: int = 110) -> str:
    """What a run prints about its cell (from a results.json dict): its coordinates, a table of
    the metrics (value, 95% interval, n, prompts or batches, direction; drawn with ``rich``),
    the counts and the notes. Plain text, so that ``run.log`` holds it as the console shows it."""
    import io

    from rich import box
    from rich.console import Console
    from rich.table import Table

    c = data["cell"]
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name, justify in (("metric", "left"), ("value", "right"), ("95% CI", "right"), ("n", "right"),
                          ("prompts/batches", "right"), ("", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for key, m in sorted(data["metrics"].items()):
        v, lo, hi = m.get("value"), m.get("ci_low"), m.get("ci_high")
        shown = "null" if v is None else f"{v:.4f}"
        ci = f"[{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None and lo == lo and hi == hi else ""
        arrow = {True: "↑", False: "↓"}.get(higher_is_better(key), "")
        table.add_row(key, shown, ci, str(m.get("n", "")), str(m.get("n_clusters") or ""), arrow)
    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False, highlight=False)
    console.print(table)
    rows = [f"cell: model={c['model']} method={c['method']} domain={c['domain']} concept={c['concept']} "
            f"attacker={c['attacker']} classifier={c['classifier']}",
            console.file.getvalue().rstrip(),  # type: ignore[attr-defined]
            ", ".join(f"{k}={v}" for k, v in (data.get("counts") or {}).items())]
    rows += [f"NOTE: {n}" for n in data.get("notes", [])]
    return "\n".join(rows)


def load_samples(*paths: str | Path, cache_dir: str | Path | None = None) -> Any:
    """Every judged image of the cells under ``paths`` (folders searched for ``samples.jsonl``,
    or the files) as one ``datasets.Dataset`` with the columns of :data:`SAMPLE_FIELDS`
    (``datasets.load_dataset("json", data_files=...)``; the schema is stated, so a sweep whose
    cells add nothing to a column still loads)."""
    import datasets

    files = []
    for p in map(Path, paths):
        files += [p] if p.is_file() else sorted(q for q in p.rglob("samples.jsonl") if ".submitit" not in q.parts)
    if not files:
        raise ResultsFileError(f"no samples.jsonl under {', '.join(map(str, paths))}")
    kinds = {str: "string", int: "int64", float: "float64", bool: "bool"}
    features = datasets.Features({k: datasets.Value(kinds[kind]) for k, (kind, _) in SAMPLE_FIELDS.items()})
    return datasets.load_dataset("json", data_files=[str(f) for f in files], split="train", features=features,
                                 cache_dir=None if cache_dir is None else str(cache_dir))
