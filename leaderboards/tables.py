"""Per-domain leaderboard tables from cell records (pure functions).

- ``methods``: one row per cell (model, method, concept, attacker), EMMA-style columns: EA
  per prompt type, RA, FID, bias, timing — every metric the cells carry except attack ones.
- ``attacks``: one row per cell that ran an attacker other than the static suite, or that has
  STACE metrics: ASR before/after the attack, SIR_H / SIR_I / EII / SER and the LLM's cost
  (``stace/cost_*``, the LLM baselines' ``llm/*``) when present.
- ``asr``: attacker x method, ASR averaged over the concepts (the plotted matrix).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from typing import Any

from leaderboards.collect import Cell

ATTACK_KEYS = re.compile(r"^(asr($|/)|stace/|llm/|sir_h|sir_i|eii|ser($|/))", re.I)
STACE_KEYS = re.compile(r"(^|/)(sir_h|sir_i|eii|ser)($|/)", re.I)
ORDER = ["ea/", "ra/", "fid", "bias/", "time/"]


@dataclasses.dataclass
class Table:
    kind: str  # methods | attacks | asr
    domain: str
    columns: list[str]  # coordinate columns then metric columns
    metric_columns: list[str]
    rows: list[dict[str, Any]]  # coordinate values (str) and metric dicts {value, ci_low, ci_high, n}
    title: str = ""

    @property
    def name(self) -> str:
        return f"{self.domain}_{self.kind}"


def metric_order(key: str) -> tuple:
    for i, prefix in enumerate(ORDER):
        if key.startswith(prefix):
            return (i, key)
    return (len(ORDER), key)


def fmt(m: Any, digits: int = 3) -> str:
    """``0.812 [0.700, 0.900]`` for a metric with an interval; the value alone otherwise."""
    if m is None:
        return ""
    if not isinstance(m, dict):
        return str(m)
    v = m.get("value")
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    lo, hi = m.get("ci_low"), m.get("ci_high")
    s = f"{v:.{digits}f}" if isinstance(v, (int, float)) else str(v)
    if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and not (math.isnan(lo) or math.isnan(hi)):
        s += f" [{lo:.{digits}f}, {hi:.{digits}f}]"
    return s


def sort_value(m: Any) -> float | str:
    if isinstance(m, dict):
        v = m.get("value")
        return float(v) if isinstance(v, (int, float)) and not math.isnan(v) else float("nan")
    return "" if m is None else str(m)


def _coords(cell: Cell) -> dict[str, Any]:
    return {"model": cell.model, "method": cell.label or cell.method, "concept": cell.concept,
            "attacker": cell.attacker, "_anchor": cell.anchor, "_path": str(cell.path),
            "_evidence": cell.counts.get("evidence_images", 0)}


def build_tables(cells: list[Cell]) -> list[Table]:
    tables: list[Table] = []
    by_domain: dict[str, list[Cell]] = defaultdict(list)
    for c in cells:
        by_domain[c.domain].append(c)
    for domain, group in sorted(by_domain.items()):
        group = sorted(group, key=lambda c: (c.model, c.label or c.method, c.concept, c.attacker))
        mkeys = sorted({k for c in group for k in c.metrics if not ATTACK_KEYS.match(k)}, key=metric_order)
        coords = ["model", "method", "concept", "attacker"]
        tables.append(Table(
            "methods", domain, coords + mkeys, mkeys,
            [{**_coords(c), **{k: c.metrics.get(k) for k in mkeys}} for c in group],
            title=f"{domain}: methods (95% CIs)"))
        attacked = [c for c in group if c.attacker != "static" or any(STACE_KEYS.search(k) for k in c.metrics)]
        if attacked:
            akeys = sorted({k for c in attacked for k in c.metrics if ATTACK_KEYS.match(k)}, key=metric_order)
            tables.append(Table(
                "attacks", domain, coords + akeys, akeys,
                [{**_coords(c), **{k: c.metrics.get(k) for k in akeys}} for c in attacked],
                title=f"{domain}: attacks (ASR, STACE metrics)"))
        asr = asr_matrix(group)
        if asr is not None:
            tables.append(asr)
    return tables


def asr_matrix(cells: list[Cell]) -> Table | None:
    """Attacker x method ASR, the mean over concepts (n = number of concepts)."""
    vals: dict[tuple[str, str], list[float]] = defaultdict(list)
    for c in cells:
        m = c.metrics.get("asr")
        if m is not None and isinstance(m.get("value"), (int, float)):
            vals[(c.attacker, c.label or c.method)].append(float(m["value"]))
    if not vals:
        return None
    methods = sorted({m for _, m in vals})
    rows = []
    for attacker in sorted({a for a, _ in vals}):
        row: dict[str, Any] = {"attacker": attacker}
        for method in methods:
            v = vals.get((attacker, method))
            row[method] = {"value": sum(v) / len(v), "n": len(v)} if v else None
        rows.append(row)
    domain = cells[0].domain
    return Table("asr", domain, ["attacker"] + methods, methods, rows,
                 title=f"{domain}: ASR by attacker x method (mean over concepts)")


def mean_metric(cell: Cell, prefix: str) -> float | None:
    vals = [m["value"] for k, m in cell.metrics.items()
            if k.startswith(prefix) and isinstance(m.get("value"), (int, float)) and not math.isnan(m["value"])]
    return sum(vals) / len(vals) if vals else None
