"""STACE's tables in the paper's layout, from result files (pure functions and a CLI).

    python -m leaderboards.stace_tables multirun/stace_table2/<stamp> --table table2 --out board

- ``table2`` (STACE Table 2): rows = attackers, columns = concepts, cells = SIR_I (STACE's
  ``stace/sir_i``; a baseline's ``sir_i``, detected images over its image budget; another
  attacker's ``asr/images``), then the average over concepts and the LLM cost per image.
- ``table3`` (Tables 3, B1-B3): rows = erasure methods (ESD split by training iterations:
  ``esd-100``), columns = concepts, cells = SIR_H; then average SIR_H, SER and EII.
- ``debate`` (Table 4): rows = debate rounds M, columns = concepts, cells = SIR_H; then average
  SIR_H and novelty Nov(H).
- ``asr``: rows = methods, columns = concepts, cells = ``asr`` (per attacked prompt), one
  table per attacker (the direction of Table 3 with attackers that need no LLM).

Every table with STACE rows adds the cost study (Table D1): dollars and tokens per iteration
and per successful hypothesis, pooled over the row's cells (total cost / total iterations;
total cost / total successful hypotheses, empty when none succeeded). Averages are plain means
over the concepts a row has (``n`` says how many). Seeds of one concept are pooled (mean,
min–max, number of seeds); cells at another budget are rows of their own.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence

from emma import exit_codes
from emma.files import atomic_write_text
from leaderboards.collect import Cell, LeaderboardError, find_result_files, parse_results, split_settings
from leaderboards.render import csv_text, markdown
from leaderboards.tables import Table, pool

KINDS = ("table2", "table3", "debate", "asr")


def _value(m: Any) -> float | None:
    v = m.get("value") if isinstance(m, dict) else None
    return float(v) if isinstance(v, (int, float)) and v == v else None


def sir_i(cell: Cell) -> dict[str, Any] | None:
    """SIR_I of a cell: STACE's, a baseline's (over its budget), else image-level ASR."""
    for key in ("stace/sir_i", "sir_i", "asr/images"):
        if key in cell.metrics:
            return cell.metrics[key]
    return None


def _config(cell: Cell) -> dict[str, Any]:
    path = cell.path / "results.json"
    try:
        return json.loads(path.read_text()).get("config", {})
    except (OSError, ValueError):
        return {}


def method_label(cell: Cell, config: dict[str, Any]) -> str:
    """The method's name, with ESD's strength (training iterations) as the paper writes it."""
    m = config.get("method") or {}
    if cell.method == "esd" and m.get("iterations") is not None:
        return f"esd-{m['iterations']}"
    return cell.method


def debate_label(cell: Cell, config: dict[str, Any]) -> str:
    a = config.get("attacker") or {}
    return f"M={a.get('debate_rounds', '?')}"


def _mean(values: Sequence[float]) -> dict[str, Any] | None:
    return {"value": sum(values) / len(values), "n": len(values)} if values else None


def _cost_columns(cells: Sequence[Cell]) -> dict[str, Any]:
    """Pooled cost of a row: STACE's per iteration and per successful hypothesis, a
    baseline's per image."""
    stace = [c for c in cells if "stace/sir_h" in c.metrics]
    out: dict[str, Any] = {}
    if stace:
        iters = sum(int(c.metrics["stace/sir_h"].get("n") or 0) for c in stace)
        wins = sum(round((_value(c.metrics["stace/sir_h"]) or 0) * int(c.metrics["stace/sir_h"].get("n") or 0))
                   for c in stace)
        usd = sum(_value(c.metrics.get("stace/cost_usd")) or 0.0 for c in stace)
        tokens = sum(_value(m) or 0 for c in stace for k, m in c.metrics.items() if k.startswith("stace/tokens/"))
        out["$/iter"] = {"value": usd / iters, "n": iters} if iters else None
        out["$/success"] = {"value": usd / wins, "n": wins} if wins else None
        out["tokens/iter"] = {"value": tokens / iters, "n": iters} if iters else None
        out["tokens/success"] = {"value": tokens / wins, "n": wins} if wins else None
    base = [c for c in cells if "llm/cost_usd" in c.metrics and "sir_i" in c.metrics]
    if base:
        images = sum(int(c.metrics["sir_i"].get("n") or 0) for c in base)
        usd = sum(_value(c.metrics["llm/cost_usd"]) or 0.0 for c in base)
        tokens = sum(_value(c.metrics.get("llm/tokens")) or 0 for c in base)
        out["$/image"] = {"value": usd / images, "n": images} if images else None
        out["tokens/image"] = {"value": tokens / images, "n": images} if images else None
    return out


def paper_table(cells: Sequence[Cell], kind: str, configs: dict[Path, dict[str, Any]] | None = None) -> list[Table]:
    """The tables of ``kind`` (one per attacker for ``asr``, else one) for ``cells``.

    Args:
        cells: finished cells.
        kind: ``table2`` | ``table3`` | ``debate`` | ``asr``.
        configs: each cell's resolved config (by cell path); read from results.json if absent.
    """
    if kind not in KINDS:
        raise LeaderboardError(f"unknown STACE table {kind!r}; valid: {', '.join(KINDS)}")
    configs = configs if configs is not None else {c.path: _config(c) for c in cells}
    if kind == "asr":
        return [t for a in sorted({c.attacker for c in cells})
                for t in _grid([c for c in cells if c.attacker == a], configs, "method",
                               lambda c, cfg: method_label(c, cfg), lambda c: c.metrics.get("asr"),
                               title=f"ASR (per attacked prompt) of attacker={a}: methods x concepts",
                               name=f"asr_{a}", extra=_asr_extra)]
    if kind == "table2":
        return _grid(cells, configs, "attacker", lambda c, cfg: c.attacker, sir_i,
                     title="STACE Table 2 layout: SIR_I by attacker x concept (same image budget per concept)",
                     name="table2", extra=lambda cs: _cost_columns(cs))
    if kind == "table3":
        return _grid(cells, configs, "method", method_label, lambda c: c.metrics.get("stace/sir_h"),
                     title="STACE Table 3 / B1-B3 layout: SIR_H by erasure method x concept; average SIR_H, SER, EII",
                     name="table3", extra=_stace_extra)
    return _grid(cells, configs, "debate rounds", debate_label, lambda c: c.metrics.get("stace/sir_h"),
                 title="STACE Table 4 layout: SIR_H by debate rounds x concept; average SIR_H and novelty",
                 name="debate", extra=_debate_extra)


def _avg_of(cells: Sequence[Cell], key: str) -> dict[str, Any] | None:
    """The mean over concepts of ``key`` (``n`` concepts); a concept's replicates count once,
    with their mean."""
    by_concept: dict[str, list[float]] = defaultdict(list)
    for c in cells:
        if (v := _value(c.metrics.get(key))) is not None:
            by_concept[c.concept].append(v)
    return _mean([sum(vs) / len(vs) for vs in by_concept.values()])


def _stace_extra(cells: Sequence[Cell]) -> dict[str, Any]:
    return {"avg SIR_H": _avg_of(cells, "stace/sir_h"), "avg SER": _avg_of(cells, "stace/ser"),
            "avg EII": _avg_of(cells, "stace/eii"), **_cost_columns(cells)}


def _debate_extra(cells: Sequence[Cell]) -> dict[str, Any]:
    return {"avg SIR_H": _avg_of(cells, "stace/sir_h"), "avg Nov(H)": _avg_of(cells, "stace/novelty"),
            **_cost_columns(cells)}


def _asr_extra(cells: Sequence[Cell]) -> dict[str, Any]:
    return {"avg ASR/images": _avg_of(cells, "asr/images"), "avg ASR before attack": _avg_of(cells, "asr/pre")}


def _grid(cells: Sequence[Cell], configs: dict[Path, dict[str, Any]], row_name: str,
          label: Callable[[Cell, dict[str, Any]], str], metric: Callable[[Cell], Any], *, title: str, name: str,
          extra: Callable[[Sequence[Cell]], dict[str, Any]]) -> list[Table]:
    if not cells:
        return []
    concepts = sorted({c.concept for c in cells})
    rows_cells: dict[str, list[Cell]] = defaultdict(list)
    for c in cells:
        row_label = label(c, configs.get(c.path, {}))
        rows_cells[f"{row_label} [{c.variant}]" if c.variant else row_label].append(c)
    rows, extra_cols = [], []
    for row_label in sorted(rows_cells):
        group = rows_cells[row_label]
        by_concept: dict[str, list[Cell]] = defaultdict(list)
        for c in group:  # replicates (seeds) of a concept are pooled, never "the newest counts"
            by_concept[c.concept].append(c)
        row: dict[str, Any] = {row_name: row_label}
        for concept in concepts:
            row[concept] = pool([metric(c) for c in by_concept[concept]]) if concept in by_concept else None
        vals = [v for concept in concepts if (v := _value(row[concept])) is not None]
        row["avg"] = _mean(vals)
        more = extra(group)
        for k in more:
            if k not in extra_cols:
                extra_cols.append(k)
        row.update(more)
        rows.append(row)
    metric_cols = concepts + ["avg"] + extra_cols
    table = Table(kind=name, domain="stace", columns=[row_name] + metric_cols, metric_columns=metric_cols,
                  rows=rows, title=title)
    return [table]


def build(runs: Sequence[str | Path], kinds: Sequence[str], out: str | Path | None = None,
          notes: list[str] | None = None) -> list[Table]:
    """Read every results.json under ``runs`` and write ``stace_<kind>.{md,csv}`` into ``out``.

    Cells that differ only in their seed are pooled per concept (mean, min–max, n seeds);
    cells at other budgets or settings are rows of their own (``esd-100 [images_per_prompt=12]``);
    a cell with a value that is no number is left out. ``notes`` (when given) receives why."""
    results, _ = find_result_files(runs)
    if not results:
        raise LeaderboardError(f"no results.json under {', '.join(map(str, runs))}")
    parsed = [parse_results(p) for p in results]
    cells = [c for c in parsed if not c.problems]
    said = [f"{c.path / 'results.json'}: {'; '.join(c.problems)}; the cell is left out" for c in parsed if c.problems]
    said += split_settings(cells)
    if notes is not None:
        notes += said
    tables = [t for kind in kinds for t in paper_table(cells, kind)]
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        for t in tables:
            atomic_write_text(out / f"stace_{t.kind}.md", markdown(t))
            atomic_write_text(out / f"stace_{t.kind}.csv", csv_text(t))
    return tables


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m leaderboards.stace_tables", description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="result folders (searched for results.json) or files")
    ap.add_argument("--table", action="append", choices=KINDS, help="which layout(s); default: all")
    ap.add_argument("--out", default=None, help="folder for stace_<table>.md/.csv (default: print only)")
    args = ap.parse_args(argv)
    notes: list[str] = []
    try:
        tables = build(args.runs, args.table or list(KINDS), args.out, notes)
    except LeaderboardError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    for t in tables:
        print(markdown(t))
    return exit_codes.OK


if __name__ == "__main__":
    sys.exit(main())
