"""``python -m leaderboards.build RUNS... --out DIR [--wandb]``: the leaderboard of result files.

    python -m leaderboards.build multirun/2026-12-04_10-00-00 --out leaderboard
    python -m leaderboards.build outputs/ multirun/ --out board --wandb --wandb-project emma

RUNS are result folders (searched recursively for ``results.json``; cells that crashed leave
an ``error.json`` and are listed as failed; a cell folder with neither, or a sweep's job that
left no folder, is listed as missing) or results.json files. A metric value that is no
number (or NaN where something was measured, or infinite) is a warning naming the file and
key, and its cell is listed as invalid, never shown. DIR receives, per domain,
``<domain>_methods.{md,csv}``, ``<domain>_attacks.{md,csv}`` (cells with attackers or STACE
metrics), ``<domain>_asr.{md,csv}`` (attacker x method), ``plots/<domain>_ea_vs_ra.png`` and
``plots/<domain>_asr.png``; ``leaderboard.md`` with all tables; and ``index.html``, one
self-contained page (sortable tables, plots, each cell's image evidence with its prompts).

Cells are grouped by their recorded settings, with values that follow the concept (a preset's
``${emma.other_concepts:...}``) resolved. Cells that differ only in their seed are one row:
the mean over seeds, its range (min–max) and ``n_seeds``. Cells of one method that differ in
budget or settings (images per prompt, prompt types, sampler, attack budget) are rows of their
own with a ``setting`` column, and a note says why. Cells whose method, attacker, classifier,
model or domain differ in version, settings or weights are never merged: the build stops
and names them (``--split-versions`` gives each method/attacker version its own rows).
Rebuilds re-read only result files whose content (sha256) changed and skip the rendering when
nothing changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from emma import exit_codes
from emma.cache import stable_hash
from emma.errors import DiskFullError, EmmaError, is_disk_full
from emma.files import atomic_write_text, sha256_file
from leaderboards.collect import (
    Cell,
    FailedCell,
    InvalidCell,
    LeaderboardError,
    MissingCell,
    check_comparable,
    find_missing,
    find_result_files,
    group_replicates,
    infer_concept_dependent,
    parse_error,
    parse_results,
    split_settings,
)
from leaderboards.render import (
    csv_text,
    evidence_problem,
    markdown,
    page,
    plot_asr,
    plot_tradeoff,
    problem_lines,
    summary,
)
from leaderboards.tables import Table, build_tables

STATE = ".build_state.json"
FORMAT = 4  # bump when the outputs change for the same inputs
PLOTS = 3  # bump when a plot is drawn differently from the same data


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
    invalid: list[InvalidCell] = dataclasses.field(default_factory=list)  # values that cannot be shown
    missing: list[MissingCell] = dataclasses.field(default_factory=list)  # cells with no file at all
    rows: list[list[Cell]] = dataclasses.field(default_factory=list)  # replicates (seeds) per row
    warnings: list[str] = dataclasses.field(default_factory=list)  # one line each, naming file and key

    @property
    def summary(self) -> str:
        return summary(self.cells, self.failed, self.invalid, self.missing)


def _stamp(path: Path) -> str:
    """The content of a result file and of its evidence index: a rebuild re-reads a cell whose
    bytes changed, whatever its size and modification time say."""
    ev = path.parent / "evidence" / "index.json"
    return sha256_file(path) + ("+" + sha256_file(ev) if ev.exists() else "")


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
    missing = find_missing(runs)
    if not results and not errors and not missing:
        raise LeaderboardError(f"no results.json under {', '.join(map(str, runs))}")
    state_path = out / STATE
    state: dict[str, Any] = {}
    if state_path.exists() and not force:
        try:
            state = json.loads(state_path.read_text())
        except (OSError, ValueError):
            state = {}
        if not isinstance(state, dict):
            state = {}
    stamps = {str(p): _stamp(p) for p in results + errors}
    digest = stable_hash({"format": FORMAT, "plots": PLOTS, "stamps": stamps, "split": split_versions,
                          "missing": [(str(m.path), m.reason) for m in missing]})
    cached_cells = state.get("cells", {}) if state.get("format") == FORMAT else {}

    parsed_cells, parsed = [], 0
    as_read: dict[str, dict[str, Any]] = {}  # each cell as parsed, before the steps below label it
    for p in results:
        entry = cached_cells.get(str(p))
        if isinstance(entry, dict) and entry.get("stamp") == stamps[str(p)]:
            try:
                parsed_cells.append(_cell_from_json(entry["cell"]))
                as_read[str(p)] = entry["cell"]
                continue
            except (KeyError, TypeError, ValueError):
                pass
        parsed_cells.append(parse_results(p))
        as_read[str(p)] = _cell_to_json(parsed_cells[-1])
        parsed += 1
    failed = [parse_error(p) for p in errors]
    invalid = [InvalidCell(c.path, c.problems) for c in parsed_cells if c.problems]
    warnings = [f"{c.path / 'results.json'}: {problem}; the cell is listed as invalid, not shown"
                for c in parsed_cells for problem in c.problems]
    cells = [c for c in parsed_cells if not c.problems]
    warnings += [w for c in cells if (w := evidence_problem(c))]
    infer_concept_dependent(cells)
    notes = check_comparable(cells, split_versions)
    notes += split_settings(cells)
    rows, repeat_notes = group_replicates(cells)
    notes += repeat_notes
    tables = build_tables(rows)
    plots = _plot_paths(out, tables)
    board = Board(out, tables, cells, failed, notes, plots, parsed=parsed, invalid=invalid, missing=missing,
                  rows=rows, warnings=warnings)
    if state.get("digest") == digest and (out / "index.html").exists():
        board.up_to_date = True
        return board

    try:
        _write(board, state, state_path, digest, as_read, stamps)
    except OSError as err:
        if is_disk_full(err):  # a plot (the files are DiskFullErrors already)
            raise DiskFullError(out, "the leaderboard") from None
        raise LeaderboardError(f"cannot write the leaderboard to --out {str(out)!r}: {type(err).__name__}: "
                               f"{err.strerror or err}; give a folder you can write to") from None
    return board


def _write(board: Board, state: dict[str, Any], state_path: Path, digest: str, as_read: dict[str, Any],
           stamps: dict[str, str]) -> None:
    out, tables, cells = board.out, board.tables, board.cells
    failed, invalid, missing, notes = board.failed, board.invalid, board.missing, board.notes
    out.mkdir(parents=True, exist_ok=True)
    plot_hashes = state.get("plots", {}) if state.get("format") == FORMAT else {}
    new_plot_hashes = _render_plots(out, tables, plot_hashes)
    board.plots = _plot_paths(out, tables)
    md = ["# EMMA leaderboard", "", f"{board.summary}.", ""]
    for title, lines in problem_lines(failed, invalid, missing):
        md += [f"## {title}", ""] + [f"- {line}" for line in lines] + [""]
    for t in tables:
        text = markdown(t)
        atomic_write_text(out / f"{t.name}.md", text)
        atomic_write_text(out / f"{t.name}.csv", csv_text(t))
        md.append(text)
    for paths in board.plots.values():
        md += [f"![{p.stem}](plots/{p.name})" for p in paths]
    atomic_write_text(out / "leaderboard.md", "\n".join(md) + "\n")
    atomic_write_text(out / "index.html", page(tables, cells, failed, board.plots, notes, invalid, missing))
    atomic_write_text(state_path, json.dumps({
        "format": FORMAT, "digest": digest, "plots": new_plot_hashes,
        "cells": {p: {"stamp": stamps[p], "cell": cell} for p, cell in as_read.items()},
    }, default=str))


def _plot_paths(out: Path, tables: list[Table]) -> dict[str, list[Path]]:
    plots: dict[str, list[Path]] = {}
    for d in sorted({t.domain for t in tables}):
        paths = [out / "plots" / f"{d}_ea_vs_ra.png", out / "plots" / f"{d}_asr.png"]
        plots[d] = [p for p in paths if p.exists()]
    return plots


def _render_plots(out: Path, tables: list[Table], old: dict[str, str]) -> dict[str, str]:
    """Re-draw only the plots whose data changed."""
    new: dict[str, str] = {}
    for d in sorted({t.domain for t in tables}):
        main = next(t for t in tables if t.domain == d and t.kind == "main")
        key = f"{d}_ea_vs_ra"
        new[key] = stable_hash([PLOTS, [{k: r.get(k) for k in ("_display", "method", "concept", "ea", "ra")}
                                        for r in main.rows]])
        path = out / "plots" / f"{key}.png"
        if old.get(key) != new[key] or not path.exists():
            path.unlink(missing_ok=True)
            plot_tradeoff(main, path)
        asr = next((t for t in tables if t.domain == d and t.kind == "asr"), None)
        key = f"{d}_asr"
        path = out / "plots" / f"{key}.png"
        if asr is None:
            path.unlink(missing_ok=True)
            continue
        new[key] = stable_hash([PLOTS, asr.columns, [{k: (v or {}).get("value") if isinstance(v, dict) else v
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
    except EmmaError as err:  # a LeaderboardError (2), or a full disk (3)
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    for w in board.warnings:
        print(f"warning: {w}", file=sys.stderr)
    for f in board.failed:
        print(f"failed cell: {f.overrides or f.path}: {f.error}", file=sys.stderr)
    for m in board.missing:
        print(f"missing cell: {m.path}: {m.reason}", file=sys.stderr)
    for n in board.notes:
        print(f"note: {n}", file=sys.stderr)
    state = "up to date" if board.up_to_date else f"built ({board.parsed} result file(s) read)"
    print(f"leaderboard: {board.summary}; {len(board.rows)} row(s), {len(board.tables)} table(s); "
          f"{state} in {time.perf_counter() - t0:.2f}s -> {Path(args.out) / 'index.html'}")
    if args.wandb:
        from leaderboards.publish import publish_wandb

        try:
            where = publish_wandb(board, project=args.wandb_project, entity=args.wandb_entity)
        except Exception as err:  # noqa: BLE001  (the files above are written either way)
            print(f"error: publishing to W&B failed ({type(err).__name__}: {err}); the leaderboard files "
                  f"in {args.out} are complete", file=sys.stderr)
            return exit_codes.PUBLISH_FAILED
        print(f"wandb: {where}")
    return exit_codes.OK


def cli() -> None:
    """The ``emma-leaderboard`` command."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
