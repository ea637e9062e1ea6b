"""The typed, versioned schema of a cell's ``results.json``.

Result files are the source of truth: leaderboards and W&B tables are derived from them.
Bump :data:`SCHEMA_VERSION` whenever a field changes meaning.
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

SCHEMA_VERSION = 2
#: versions :meth:`CellResult.from_json` still reads. 1 -> 2: metrics gained ``method``,
#: ``n_clusters``, ``note``, ``n_excluded``; results gained ``provenance``. A version-1 file
#: loads with those fields empty (its intervals are the older percentile bootstrap over images).
READABLE_SCHEMA_VERSIONS = (1, 2)
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
