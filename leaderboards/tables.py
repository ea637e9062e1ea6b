"""Per-domain leaderboard tables from cell records (pure functions).

- ``main``: the compact table a reader starts from: one row per method, concept and setting,
  with EA and RA over every prompt type of the suite (``ea``, ``ra``), FID, and the ASR of the
  strongest attacker that ran (with its name), each with its interval and direction.
- ``methods``: one row per setting (model, method, concept, attacker; ``setting`` when cells
  of one method differ in budget or settings), EMMA-style columns: EA per prompt type, RA,
  FID, bias, timing — every metric the cells carry except attack ones. Cells that differ
  only in their seed are one row: the mean over seeds with its range (min–max) and
  ``n_seeds`` (:func:`pool`); a single seed shows its value with its 95% interval.
- ``attacks``: one row per cell that ran an attacker other than the static suite, or that has
  STACE metrics: ASR before/after the attack, SIR_H / SIR_I / EII / SER and the LLM's cost
  (``stace/cost_*``, the LLM baselines' ``llm/*``) when present.
- ``asr``: attacker x method, ASR averaged over the concepts (the plotted matrix; a row's
  pooled mean counts once).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from typing import Any

from leaderboards.collect import Cell

#: how a pooled value (several seeds) is written: mean, then (min–max, n seeds)
POOLED = "mean over seeds (min–max, n seeds)"

ATTACK_KEYS = re.compile(r"^(asr($|/)|stace/|llm/|sir_h|sir_i|eii|ser($|/))", re.I)
STACE_KEYS = re.compile(r"(^|/)(sir_h|sir_i|eii|ser)($|/)", re.I)
ORDER = ["ea/", "ra/", "fid", "bias/", "time/"]


@dataclasses.dataclass
class Table:
    kind: str  # main | methods | attacks | asr
    domain: str
    columns: list[str]  # coordinate columns then metric columns
    metric_columns: list[str]
    rows: list[dict[str, Any]]  # coordinate values (str) and metric dicts {value, ci_low, ci_high, n}
    title: str = ""
    budgets: list[str] = dataclasses.field(default_factory=list)  # the budget of each setting shown
    comparable: str = ""  # which numbers of the table may be compared

    @property
    def name(self) -> str:
        return f"{self.domain}_{self.kind}"


def metric_order(key: str) -> tuple:
    for i, prefix in enumerate(ORDER):
        if key.startswith(prefix) or key == prefix.rstrip("/"):
            return (i, key)
    return (len(ORDER), key)


def fmt(m: Any, digits: int = 3) -> str:
    """``0.812 [0.700, 0.900]`` for a metric with an interval; the value alone otherwise;
    ``0.800 (0.700–0.900, 3 seeds)`` for a value pooled over seeds (:func:`pool`)."""
    if m is None:
        return ""
    if not isinstance(m, dict):
        return str(m)
    v = m.get("value")
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    s = f"{v:.{digits}f}" if isinstance(v, (int, float)) else str(v)
    if m.get("pooled"):
        k = m.get("n_seeds", 0)
        if k > 1:
            return s + f" ({m['min']:.{digits}f}–{m['max']:.{digits}f}, {k} seeds)"
        return s + f" ({k} seed{'s' if k != 1 else ''})"
    lo, hi = m.get("ci_low"), m.get("ci_high")
    if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and not (math.isnan(lo) or math.isnan(hi)):
        s += f" [{lo:.{digits}f}, {hi:.{digits}f}]"
    return s


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def pool(metrics: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One metric over the replicates (seeds) of a row: the record itself for one replicate;
    else ``{value: mean, min, max, sd (sample, n-1), n_seeds, n, pooled: True}`` over the
    replicates with a value (``n`` the per-replicate count when all agree)."""
    present = [m for m in metrics if m is not None]
    if not present:
        return None
    if len(metrics) == 1:
        return present[0]
    vals = [float(m["value"]) for m in present if _finite(m.get("value"))]
    ns = {m.get("n") for m in present}
    out: dict[str, Any] = {"pooled": True, "n_seeds": len(vals), "n": ns.pop() if len(ns) == 1 else None}
    if not vals:
        return {**out, "value": None, "min": None, "max": None, "sd": None}
    mean = sum(vals) / len(vals)
    sd = math.sqrt(sum((x - mean) ** 2 for x in vals) / (len(vals) - 1)) if len(vals) > 1 else None
    return {**out, "value": mean, "min": min(vals), "max": max(vals), "sd": sd}


def sort_value(m: Any) -> float | str:
    if isinstance(m, dict):
        v = m.get("value")
        return float(v) if isinstance(v, (int, float)) and not math.isnan(v) else float("nan")
    return "" if m is None else str(m)


def _coords(cells: list[Cell]) -> dict[str, Any]:
    c = cells[0]
    seeds = sorted({x.seed for x in cells if x.seed is not None})
    return {"model": c.model, "method": c.label or c.method, "concept": c.concept, "attacker": c.attacker,
            "setting": c.variant, "n_seeds": len({x.seed for x in cells}), "_anchor": c.anchor, "_path": str(c.path),
            "_evidence": c.counts.get("evidence_images", 0), "_seeds": seeds, "_cells": [str(x.path) for x in cells],
            "_display": c.display}


def describe_budget(budget: dict[str, Any]) -> str:
    """One line for a cell's budget: ``10 images per prompt; prompt types name, short (prompts:
    ea/name 1, ea/short 5); attack budget iterations=20; FID against tinyworld-suite-mix
    (1008 images)``."""
    parts = []
    ipp = budget.get("images_per_prompt")
    parts.append(f"{ipp if ipp is not None else '?'} images per prompt")
    types = budget.get("prompt_types")
    if types:
        shown = ", ".join(map(str, types)) if isinstance(types, list) else str(types)
        prompts = budget.get("prompts") or {}
        parts.append(f"prompt types {shown}" + (f" (prompts: {', '.join(f'{k} {v}' for k, v in prompts.items())})"
                                                 if prompts else ""))
    if budget.get("attack"):
        parts.append("attack budget " + ", ".join(f"{k}={v}" for k, v in sorted(budget["attack"].items())))
    if budget.get("protocol") is not None:
        protocol = budget["protocol"]
        parts.append(f"protocol {protocol.get('name', protocol) if isinstance(protocol, dict) else protocol}")
    ref = budget.get("fid_reference") or {}
    if ref.get("name"):
        parts.append(f"FID against {ref['name']}" + (f" ({ref['n_images']} images)" if ref.get("n_images") else ""))
    return "; ".join(parts)


def _spread(cells: list[Cell], key: str) -> str:
    ns = sorted({n for c in cells if isinstance(n := (c.budget.get("n") or {}).get(key), int)})
    return "" if len(ns) < 2 else f"{ns[0]}–{ns[-1]}"


def comparability(kind: str, cells: list[Cell], keys: list[str]) -> tuple[list[str], str]:
    """The budgets of a table's rows (one line per setting) and the sentence that says which of
    its numbers may stand side by side."""
    by_variant: dict[str, set[str]] = defaultdict(set)
    for c in cells:
        by_variant[c.variant].add(describe_budget(c.budget))
    budgets = [f"{v or 'all rows'}: {' | '.join(sorted(d))}" for v, d in sorted(by_variant.items())]
    if kind == "asr":
        rule = ("Each column is one method at one setting (ASR is the mean over concepts): compare attackers within "
                "a column; compare methods only at equal images per prompt and attack budget (ASR counts a prompt "
                "as broken when any of its images shows the concept, so it rises with images per prompt).")
    elif len(by_variant) > 1:
        rule = ("Rows differ in budget or settings (column 'setting'): compare numbers only between rows of the same "
                "setting. ASR rises with images per prompt; FID falls as its n grows.")
    elif len(next(iter(by_variant.values()), ())) > 1:  # one setting, several attackers' budgets
        rule = ("The rows share one setting but not one budget: the attackers' budgets differ (listed above). "
                "Suite numbers (EA, RA, FID) may be compared across rows of equal images per prompt; attack "
                "numbers only between rows of the same attacker.")
    else:
        rule = "Every row was measured at the same budget: the numbers of one column may be compared across rows."
    fid = _spread(cells, "fid") if "fid" in keys else ""
    if fid:
        rule += (f" FID's n differs between rows ({fid} images): FID is biased upward by about 1/n, so compare "
                 "FID only between rows of equal n.")
    return budgets, rule


def _suite_row(rows: list[list[Cell]]) -> list[Cell]:
    """Of the rows of one method, concept and setting (one per attacker), the one whose suite
    metrics (EA, RA, FID: the same under every attacker) the main table shows."""
    return next((r for r in rows if r[0].attacker == "static"), rows[0])


def _headline(cells: list[Cell], key: str, prefix: str) -> dict[str, Any] | None:
    """``key`` (``ea``) pooled over seeds; for files without it, the mean over ``prefix``
    (``ea/``) types, marked as such (no interval)."""
    if any(key in c.metrics for c in cells):
        return pool([c.metrics.get(key) for c in cells])
    vals = [v for c in cells if (v := mean_metric(c, prefix)) is not None]
    return {"value": sum(vals) / len(vals), "note": "mean over prompt types"} if vals else None


#: the main table's metric columns (key -> the metric it shows)
MAIN_METRICS = ("ea", "ra", "asr", "fid")


def main_table(domain: str, group: list[list[Cell]]) -> Table:
    """One row per model, method, concept and setting: EA and RA over every prompt type, FID,
    and the highest ASR over the attackers that ran (``asr_by`` names it)."""
    families: dict[tuple, list[list[Cell]]] = defaultdict(list)
    for r in group:
        c = r[0]
        families[(c.model, c.label or c.method, c.concept, c.variant, c.classifier)].append(r)
    rows = []
    for _, fam in sorted(families.items(), key=lambda kv: kv[0][:4]):
        suite = _suite_row(fam)
        row = {**_coords(suite), "attackers": len(fam)}
        row["ea"], row["ra"] = _headline(suite, "ea", "ea/"), _headline(suite, "ra", "ra/")
        row["fid"] = pool([c.metrics.get("fid") for c in suite])
        asrs = [(m, r[0].attacker) for r in fam if (m := pool([c.metrics.get("asr") for c in r])) is not None
                and _finite(m.get("value"))]
        row["asr"], row["asr_by"] = (None, "") if not asrs else max(asrs, key=lambda x: x[0]["value"])
        rows.append(row)
    setting = any(r["setting"] for r in rows)
    coords = ["model", "method", "concept"] + (["setting"] if setting else []) + ["n_seeds"]
    keys = [k for k in MAIN_METRICS if any(r.get(k) is not None for r in rows)]
    cells = [c for r in group for c in r]
    budgets, rule = comparability("main", cells, keys)
    return Table("main", domain, coords + keys + ["asr_by"], keys, rows,
                 title=f"{domain}: EA, RA and FID of the suite; ASR of the strongest attacker",
                 budgets=budgets, comparable=rule)


def build_tables(rows: list[list[Cell]]) -> list[Table]:
    """The tables of the rows :func:`leaderboards.collect.group_replicates` made (each a list
    of replicate cells)."""
    tables: list[Table] = []
    by_domain: dict[str, list[list[Cell]]] = defaultdict(list)
    for r in rows:
        by_domain[r[0].domain].append(r)
    for domain, group in sorted(by_domain.items()):
        group = sorted(group, key=lambda r: (r[0].model, r[0].label or r[0].method, r[0].concept, r[0].attacker,
                                             r[0].variant))
        cells = [c for r in group for c in r]
        tables.append(main_table(domain, group))
        coords = ["model", "method", "concept", "attacker"] + (["setting"] if any(c.variant for c in cells) else [])
        coords.append("n_seeds")
        pooled = any(len(r) > 1 for r in group)
        note = f"; pooled seeds: {POOLED}" if pooled else ""
        mkeys = sorted({k for c in cells for k in c.metrics if not ATTACK_KEYS.match(k)}, key=metric_order)
        tables.append(Table(
            "methods", domain, coords + mkeys, mkeys,
            [{**_coords(r), **{k: pool([c.metrics.get(k) for c in r]) for k in mkeys}} for r in group],
            title=f"{domain}: methods (95% CIs{note})", **_budget_fields("methods", cells, mkeys)))
        attacked = [r for r in group
                    if r[0].attacker != "static" or any(STACE_KEYS.search(k) for c in r for k in c.metrics)]
        if attacked:
            akeys = sorted({k for r in attacked for c in r for k in c.metrics if ATTACK_KEYS.match(k)},
                           key=metric_order)
            tables.append(Table(
                "attacks", domain, coords + akeys, akeys,
                [{**_coords(r), **{k: pool([c.metrics.get(k) for c in r]) for k in akeys}} for r in attacked],
                title=f"{domain}: attacks (ASR, STACE metrics{note})",
                **_budget_fields("attacks", [c for r in attacked for c in r], akeys)))
        asr = asr_matrix(group)
        if asr is not None:
            tables.append(asr)
    return tables


def asr_matrix(rows: list[list[Cell]]) -> Table | None:
    """Attacker x method ASR, the mean over concepts (n = number of concepts); a row pooled
    over seeds counts once, with its mean. Methods split by settings are columns of their own."""
    vals: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in rows:
        m = pool([c.metrics.get("asr") for c in r])
        if m is not None and _finite(m.get("value")):
            vals[(r[0].attacker, r[0].display)].append(float(m["value"]))
    if not vals:
        return None
    methods = sorted({m for _, m in vals})
    out = []
    for attacker in sorted({a for a, _ in vals}):
        row: dict[str, Any] = {"attacker": attacker}
        for method in methods:
            v = vals.get((attacker, method))
            row[method] = {"value": sum(v) / len(v), "n": len(v)} if v else None
        out.append(row)
    domain = rows[0][0].domain
    return Table("asr", domain, ["attacker"] + methods, methods, out,
                 title=f"{domain}: ASR by attacker x method (mean over concepts)",
                 **_budget_fields("asr", [c for r in rows for c in r], ["asr"]))


def _budget_fields(kind: str, cells: list[Cell], keys: list[str]) -> dict[str, Any]:
    budgets, rule = comparability(kind, cells, keys)
    return {"budgets": budgets, "comparable": rule}


def mean_metric(cell: Cell, prefix: str) -> float | None:
    vals = [m["value"] for k, m in cell.metrics.items()
            if k.startswith(prefix) and isinstance(m.get("value"), (int, float)) and not math.isnan(m["value"])]
    return sum(vals) / len(vals) if vals else None
