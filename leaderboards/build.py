"""``python -m leaderboards.build RUNS... --out DIR [--wandb]``: the leaderboard of result files.

    python -m leaderboards.build multirun/2026-12-04_10-00-00 --out leaderboard
    python -m leaderboards.build outputs/ multirun/ --out board --wandb --wandb-project emma

RUNS are result folders (searched recursively for ``results.json``; cells that crashed leave
an ``error.json`` and are listed as failed) or results.json files. DIR receives, per domain,
``<domain>_methods.{md,csv}``, ``<domain>_attacks.{md,csv}`` (cells with attackers or STACE
metrics), ``<domain>_asr.{md,csv}`` (attacker x method), ``plots/<domain>_ea_vs_ra.png`` and
``plots/<domain>_asr.png``; ``leaderboard.md`` with all tables; and ``index.html``, one
self-contained page (sortable tables, plots, each cell's image evidence with its prompts).

Cells whose method, attacker, classifier, model or domain differ in version, settings or
weights are never merged: the build stops and names them (``--split-versions`` gives each
method/attacker version its own rows). Rebuilds re-read only changed result files and skip
the rendering when nothing changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from emma.cache import stable_hash
from emma.files import atomic_write_text
from leaderboards.collect import (
    Cell,
    FailedCell,
    LeaderboardError,
    check_comparable,
    dedupe,
    find_result_files,
    parse_error,
    parse_results,
)
from leaderboards.render import csv_text, markdown, page, plot_asr, plot_tradeoff
from leaderboards.tables import Table, build_tables

STATE = ".build_state.json"
FORMAT = 1  # bump when the outputs change for the same inputs


@dataclasses.dataclass
class Board:
    out: Path
    tables: list[Table]
    cells: list[Cell]
    failed: list[FailedCell]
    notes: list[str]
    plots: dict[str, list[Path]]
    up_to_date: bool = False  # nothing changed since the last build: nothing was rewritten
    parsed: int = 0  # result files read this time (the others came from the last build)


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    ev = path.parent / "evidence" / "index.json"
    return [st.st_mtime_ns, st.st_size, ev.stat().st_mtime_ns if ev.exists() else 0]


def _cell_to_json(c: Cell) -> dict[str, Any]:
    return {**dataclasses.asdict(c), "path": str(c.path)}


def _cell_from_json(d: dict[str, Any]) -> Cell:
    return Cell(**{**d, "path": Path(d["path"])})


def build(runs: Sequence[str | Path], out: str | Path, *, split_versions: bool = False,
          force: bool = False) -> Board:
    """Build the leaderboard of ``runs`` into ``out`` (see the module docstring)."""
    out = Path(out)
    _check_out(out)
    results, errors = find_result_files(runs)
    if not results and not errors:
        raise LeaderboardError(f"no results.json under {', '.join(map(str, runs))}")
    state_path = out / STATE
    state: dict[str, Any] = {}
    if state_path.exists() and not force:
        try:
            state = json.loads(state_path.read_text())
        except json.JSONDecodeError:
            state = {}
    stamps = {str(p): _stamp(p) for p in results + errors}
    digest = stable_hash({"format": FORMAT, "stamps": stamps, "split": split_versions})
    cached_cells = state.get("cells", {}) if state.get("format") == FORMAT else {}

    cells, parsed = [], 0
    for p in results:
        entry = cached_cells.get(str(p))
        if entry and entry["stamp"] == stamps[str(p)]:
            cells.append(_cell_from_json(entry["cell"]))
        else:
            cells.append(parse_results(p))
            parsed += 1
    failed = [parse_error(p) for p in errors]
    cells, notes = dedupe(cells)
    notes = check_comparable(cells, split_versions) + notes
    tables = build_tables(cells)
    plots = _plot_paths(out, tables, cells)
    board = Board(out, tables, cells, failed, notes, plots, parsed=parsed)
    if state.get("digest") == digest and (out / "index.html").exists():
        board.up_to_date = True
        return board

    out.mkdir(parents=True, exist_ok=True)
    plot_hashes = state.get("plots", {}) if state.get("format") == FORMAT else {}
    new_plot_hashes = _render_plots(out, tables, cells, plot_hashes)
    board.plots = _plot_paths(out, tables, cells)
    md = ["# EMMA leaderboard", "", f"{len(cells)} cell(s), {len(failed)} failed.", ""]
    if failed:
        md += ["## Failed cells", ""] + [f"- `{f.overrides or f.path}`: {f.error}" for f in failed] + [""]
    for t in tables:
        text = markdown(t)
        atomic_write_text(out / f"{t.name}.md", text)
        atomic_write_text(out / f"{t.name}.csv", csv_text(t))
        md.append(text)
    for paths in board.plots.values():
        md += [f"![{p.stem}](plots/{p.name})" for p in paths]
    atomic_write_text(out / "leaderboard.md", "\n".join(md) + "\n")
    atomic_write_text(out / "index.html", page(tables, cells, failed, board.plots, notes))
    atomic_write_text(state_path, json.dumps({
        "format": FORMAT, "digest": digest, "plots": new_plot_hashes,
        "cells": {str(p): {"stamp": stamps[str(p)], "cell": _cell_to_json(c)}
                  for p, c in zip(results, [_find(cells, p) for p in results]) if c is not None},
    }, default=str))
    return board


def _find(cells: list[Cell], results_path: Path) -> Cell | None:
    for c in cells:
        if c.path == results_path.parent:
            return c
    return None


def _domain_cells(cells: list[Cell], domain: str) -> list[Cell]:
    return [c for c in cells if c.domain == domain]


def _plot_paths(out: Path, tables: list[Table], cells: list[Cell]) -> dict[str, list[Path]]:
    plots: dict[str, list[Path]] = {}
    for d in sorted({t.domain for t in tables}):
        paths = [out / "plots" / f"{d}_ea_vs_ra.png", out / "plots" / f"{d}_asr.png"]
        plots[d] = [p for p in paths if p.exists()]
    return plots


def _render_plots(out: Path, tables: list[Table], cells: list[Cell], old: dict[str, str]) -> dict[str, str]:
    """Re-draw only the plots whose data changed."""
    new: dict[str, str] = {}
    for d in sorted({t.domain for t in tables}):
        dc = _domain_cells(cells, d)
        data = [(c.label, c.concept, c.attacker, {k: m.get("value") for k, m in c.metrics.items()}) for c in dc]
        key = f"{d}_ea_vs_ra"
        new[key] = stable_hash(data)
        path = out / "plots" / f"{key}.png"
        if old.get(key) != new[key] or not path.exists():
            path.unlink(missing_ok=True)
            plot_tradeoff(dc, path)
        asr = next((t for t in tables if t.domain == d and t.kind == "asr"), None)
        key = f"{d}_asr"
        path = out / "plots" / f"{key}.png"
        if asr is None:
            path.unlink(missing_ok=True)
            continue
        new[key] = stable_hash([asr.columns, [{k: (v or {}).get("value") if isinstance(v, dict) else v
                                               for k, v in r.items()} for r in asr.rows]])
        if old.get(key) != new[key] or not path.exists():
            plot_asr(asr, path)
    return new


def _check_out(out: Path) -> None:
    """Refuse an output path that cannot become a folder (it, or the nearest existing folder
    above it, is a file) before any result is read."""
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                what = "is a file" if p == out else f"is under {str(p)!r}, which is a file"
                raise LeaderboardError(f"--out {str(out)!r} {what}; give a folder (new or existing)")
            return


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m leaderboards.build", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="result folders (searched recursively) or results.json files")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--split-versions", action="store_true",
                    help="give each version of a method/attacker its own rows instead of stopping")
    ap.add_argument("--force", action="store_true", help="rebuild everything")
    ap.add_argument("--wandb", action="store_true", help="publish the tables (with images) to W&B")
    ap.add_argument("--wandb-project", default="emma-leaderboard")
    ap.add_argument("--wandb-entity", default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        board = build(args.runs, args.out, split_versions=args.split_versions, force=args.force)
    except LeaderboardError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for f in board.failed:
        print(f"failed cell: {f.overrides or f.path}: {f.error}", file=sys.stderr)
    for n in board.notes:
        print(f"note: {n}", file=sys.stderr)
    state = "up to date" if board.up_to_date else f"built ({board.parsed} result file(s) read)"
    print(f"leaderboard: {len(board.cells)} cell(s), {len(board.failed)} failed, {len(board.tables)} table(s); "
          f"{state} in {time.perf_counter() - t0:.2f}s -> {Path(args.out) / 'index.html'}")
    if args.wandb:
        from leaderboards.publish import publish_wandb

        try:
            where = publish_wandb(board, project=args.wandb_project, entity=args.wandb_entity)
        except Exception as err:  # noqa: BLE001  (the files above are written either way)
            print(f"error: publishing to W&B failed ({type(err).__name__}: {err}); the leaderboard files "
                  f"in {args.out} are complete", file=sys.stderr)
            return 1
        print(f"wandb: {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
