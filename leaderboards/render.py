"""Tables -> Markdown, CSV, plots (PNG) and one self-contained HTML page."""

from __future__ import annotations

import base64
import csv
import io
import math
from pathlib import Path
from typing import Any, Sequence

from emma.evidence import EVIDENCE_DIR, EvidenceError, missing_evidence, read_evidence
from emma.results import higher_is_better
from leaderboards.collect import Cell, FailedCell, InvalidCell, MissingCell
from leaderboards.tables import Table, fmt, sort_value


def markdown(table: Table) -> str:
    """The table in Markdown, headed by its budgets and what may be compared; metric columns
    carry their direction (↑ higher is better, ↓ lower)."""
    head = "| " + " | ".join(_header(table, c) for c in table.columns) + " |"
    sep = "|" + "|".join("---" if c not in table.metric_columns else "---:" for c in table.columns) + "|"
    lines = [f"### {table.title}", ""]
    if table.budgets:
        lines += ["Budget: " + table.budgets[0]] if len(table.budgets) == 1 else \
            ["Budgets:", *[f"- {b}" for b in table.budgets]]
        lines.append("")
    if table.comparable:
        lines += [f"Compare: {table.comparable}", ""]
    lines += [head, sep]
    for row in table.rows:
        lines.append("| " + " | ".join(fmt(row.get(c)) if c in table.metric_columns else str(row.get(c, ""))
                                       for c in table.columns) + " |")
    return "\n".join(lines) + "\n"


#: per metric, the CSV (and W&B) columns: the value, its interval and count; for a table
#: with rows pooled over seeds also the range and the sample sd over seeds
METRIC_FIELDS = ("value", "ci_low", "ci_high", "n")
POOLED_FIELDS = ("min", "max", "sd")


def metric_fields(table: Table) -> tuple[str, ...]:
    pooled = any(isinstance(row.get(m), dict) and row[m].get("pooled")
                 for row in table.rows for m in table.metric_columns)
    return METRIC_FIELDS + (POOLED_FIELDS if pooled else ())


def metric_header(table: Table) -> list[str]:
    """Coordinates, then ``<metric>``, ``<metric>_ci_low``, ``_ci_high``, ``_n`` (``_min``,
    ``_max``, ``_sd`` when rows are pooled over seeds)."""
    coords = [c for c in table.columns if c not in table.metric_columns]
    return coords + [m if f == "value" else f"{m}_{f}" for m in table.metric_columns for f in metric_fields(table)]


def metric_values(table: Table, row: dict[str, Any]) -> list[Any]:
    out = [row.get(c) for c in table.columns if c not in table.metric_columns]
    fields = metric_fields(table)
    for m in table.metric_columns:
        v = row.get(m) or {}
        out += [v.get(f) for f in fields]
    return out


def csv_text(table: Table) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(metric_header(table))
    for row in table.rows:
        w.writerow(["" if x is None else x for x in metric_values(table, row)])
    return buf.getvalue()


def _interval(m: dict[str, Any] | None) -> tuple[float, float, float] | None:
    """(value, low, high) of a metric record for a plot: its interval, or for a row pooled
    over seeds its range; ``None`` without a finite value."""
    if not isinstance(m, dict) or not _finite(m.get("value")):
        return None
    v = float(m["value"])
    lo, hi = (m.get("min"), m.get("max")) if m.get("pooled") else (m.get("ci_low"), m.get("ci_high"))
    return v, float(lo) if _finite(lo) else v, float(hi) if _finite(hi) else v


def plot_tradeoff(main: Table, path: Path) -> bool:
    """EA against RA (both over every prompt type), one point per row of the main table (a
    method and concept at one setting) with its 95% intervals as error bars, labelled; one
    colour and marker per method. Axes reach past 0 and 1 so that no point is cut."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = []
    for r in main.rows:
        ea, ra = _interval(r.get("ea")), _interval(r.get("ra"))
        if ea and ra:
            pts.append((r.get("_display") or r["method"], r["concept"], ra, ea))
    if not pts:
        return False
    methods = sorted({p[0] for p in pts})
    fig, ax = plt.subplots(figsize=(7.0, 5.0), dpi=110)
    cmap, markers = plt.get_cmap("tab10"), "osD^vP*Xh<>p"
    label_points = len(pts) <= 24
    placed: dict[tuple[float, float], int] = {}
    for i, method in enumerate(methods):
        mine = [p for p in pts if p[0] == method]
        xs, ys = [p[2][0] for p in mine], [p[3][0] for p in mine]
        xerr = [[p[2][0] - p[2][1] for p in mine], [p[2][2] - p[2][0] for p in mine]]
        yerr = [[p[3][0] - p[3][1] for p in mine], [p[3][2] - p[3][0] for p in mine]]
        ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, fmt=markers[i % len(markers)], color=cmap(i % 10),
                    ecolor=cmap(i % 10), elinewidth=1, capsize=2, markersize=7, markeredgecolor="k",
                    alpha=0.9, label=method)
        if label_points:
            for x, y, p in zip(xs, ys, mine):
                # labels of points at one place are stacked, not drawn over each other
                spot = (round(x, 2), round(y, 2))
                row = placed.get(spot, 0)
                placed[spot] = row + 1
                right = x < 0.75  # near the right edge the label goes to the left of its point
                ax.annotate(f"{method} · {p[1]}", (x, y), xytext=(6 if right else -6, 4 - 10 * row),
                            textcoords="offset points", fontsize=7, color=cmap(i % 10),
                            ha="left" if right else "right")
    ax.set_xlabel("RA ↑ (retaining ability, every prompt type)")
    ax.set_ylabel("EA ↑ (erasing ability, every prompt type)")
    ax.set_xlim(-0.06, 1.12)
    ax.set_ylim(-0.06, 1.08)
    ax.set_title(f"{main.domain}: erasing against retaining (95% intervals)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left", framealpha=0.85)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_asr(table: Table, path: Path) -> bool:
    """The attacker x method ASR matrix as a heat map (for leaderboard.md; the page draws it as
    an HTML table): cells sized so that labels and values stay legible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    attackers = [r["attacker"] for r in table.rows]
    methods = table.metric_columns
    grid = np.array([[sort_value(r.get(m)) if r.get(m) else np.nan for m in methods] for r in table.rows],
                    dtype=float)
    width = min(16.0, 2.5 + 1.1 * len(methods))
    fig, ax = plt.subplots(figsize=(width, 1.6 + 0.45 * len(attackers)), dpi=110)
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="Reds", aspect="auto")
    ax.set_xticks(range(len(methods)), methods, rotation=30, ha="right", fontsize=9)
    ax.set_yticks(range(len(attackers)), attackers, fontsize=9)
    for i in range(len(attackers)):
        for j in range(len(methods)):
            if not math.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=9,
                        color="white" if grid[i, j] > 0.6 else "black")
    ax.set_title(f"{table.domain}: ASR ↓ (attacker x method, mean over concepts)", fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


SCRIPT = """
function sortTable(th) {
  const table = th.closest('table'), body = table.tBodies[0];
  const idx = Array.from(th.parentNode.children).indexOf(th);
  const asc = th.dataset.dir !== 'asc';
  table.querySelectorAll('th').forEach(h => { h.dataset.dir = ''; h.classList.remove('asc', 'desc'); });
  th.dataset.dir = asc ? 'asc' : 'desc';
  th.classList.add(asc ? 'asc' : 'desc');
  const key = tr => {
    const td = tr.children[idx], v = td.dataset.sort;
    return v === undefined ? td.textContent.trim() : (v === '' ? NaN : parseFloat(v));
  };
  const rows = Array.from(body.rows);
  rows.sort((a, b) => {
    const x = key(a), y = key(b);
    if (typeof x === 'number' && typeof y === 'number') {
      if (isNaN(x)) return 1; if (isNaN(y)) return -1;
      return asc ? x - y : y - x;
    }
    return asc ? String(x).localeCompare(String(y)) : String(y).localeCompare(String(x));
  });
  rows.forEach(r => body.appendChild(r));
}
document.addEventListener('DOMContentLoaded', () => {
  document.querySelectorAll('table.board th').forEach(th => th.addEventListener('click', () => sortTable(th)));
  // a link to a cell's evidence opens it
  document.querySelectorAll('a[href^="#cell-"]').forEach(a => a.addEventListener('click', () => {
    const d = document.getElementById(a.getAttribute('href').slice(1)); if (d) d.open = true;
  }));
});
"""

#: the page's style sheet
STYLE_SHEET = "page.css"


def _header(table: Table, column: str) -> str:
    """A column's heading: metric columns carry their direction (↑ higher is better, ↓ lower)."""
    if column not in table.metric_columns:
        return {"asr_by": "ASR by", "n_seeds": "seeds"}.get(column, column)
    key = "asr" if table.kind == "asr" else column
    arrow = {True: " ↑", False: " ↓"}.get(higher_is_better(key), "")
    name = {"ea": "EA", "ra": "RA", "asr": "ASR", "fid": "FID"}.get(column, column) if table.kind == "main" else column
    return name + arrow


def _header_title(table: Table, column: str) -> str:
    return {"ea": "erasing ability over every EA prompt type: share of target images without the concept",
            "ra": "retaining ability over every RA prompt type: share of other-concept images that keep it",
            "asr": "attack success rate of the strongest attacker that ran (ASR by names it)",
            "fid": "Fréchet distance to the domain's reference (lower is closer)",
            "asr_by": "the attacker whose ASR is shown"}.get(column, "") if table.kind == "main" else ""


def _value(m: Any, digits: int = 3) -> str:
    return fmt(m, digits) if isinstance(m, dict) else ("" if m is None else str(m))


def _sort_key(m: Any) -> Any:
    sv = sort_value(m)
    return "" if isinstance(sv, float) and math.isnan(sv) else sv


def _cell_title(m: Any) -> str:
    """The hover text of a value: its n, interval method and note."""
    if not isinstance(m, dict):
        return ""
    parts = [f"n = {m['n']}" if m.get("n") is not None else ""]
    if m.get("n_clusters") is not None:
        parts.append(f"{m['n_clusters']} prompts/batches")
    if m.get("method"):
        parts.append(f"interval: {m['method']}")
    if m.get("note"):
        parts.append(str(m["note"]))
    return "; ".join(p for p in parts if p)


def _heat_style(m: Any) -> str:
    v = sort_value(m) if isinstance(m, dict) else float("nan")
    if not isinstance(v, float) or math.isnan(v):
        return "background:#f4f4f4;color:#999"
    v = min(1.0, max(0.0, v))
    shade = int(255 - 175 * v)  # white -> red as ASR rises
    return f"background:rgb(255,{shade},{shade});color:{'#fff' if v > 0.65 else '#222'}"


def evidence_problem(cell: Cell) -> str | None:
    """Why a cell's images cannot all be shown (a damaged index, image files gone), or None."""
    try:
        read_evidence(cell.path)
    except EvidenceError as err:
        return f"{err}; the cell is shown without its images"
    gone = missing_evidence(cell.path)
    return f"{cell.path / EVIDENCE_DIR}: {gone} image file(s) of the evidence index are missing" if gone else None


#: evidence images per cell on the page (a cell run with ``evidence_images=null`` exports all)
PAGE_EVIDENCE = 24


def _evidence(cell: Cell) -> dict[str, Any]:
    """One cell's evidence for the page: its heading (coordinates only, never a build path)
    and each image with the base model's twin where stored."""
    try:
        items = read_evidence(cell.path)
    except EvidenceError:
        items = []
    folder = cell.path / EVIDENCE_DIR
    heading = " / ".join([cell.domain, cell.label or cell.method, cell.concept, cell.attacker]
                         + ([f"seed {cell.seed}"] if cell.seed is not None else [])
                         + ([cell.variant] if cell.variant else []))
    hits = sum(1 for e in items if e["detected"])
    out = []
    for e in items[:PAGE_EVIDENCE]:
        base = e.get("base_file")
        base_ok = isinstance(base, str) and base == Path(base).name and (folder / base).is_file()
        out.append({"src": _data_uri(folder / e["file"]), "base": _data_uri(folder / base) if base_ok else "",
                    "detected": bool(e["detected"]),
                    "label": f"{e['concept']} found" if e["detected"] else f"{e['concept']} not found",
                    "score": float(e["score"]), "prompt": e["prompt"], "seed": e["seed"], "group": e["group"],
                    "kind": e["kind"]})
    summary_text = (f"{len(items)} image(s), the concept found in {hits}" if items else "no images")
    if len(items) > PAGE_EVIDENCE:
        summary_text += f"; the first {PAGE_EVIDENCE} shown, every one is in {EVIDENCE_DIR}/ of the cell"
    return {"anchor": cell.anchor, "heading": heading, "summary": summary_text, "images": out,
            "model_label": f"{cell.label or cell.method}"}


def summary(cells: Sequence[Cell], failed: Sequence[FailedCell], invalid: Sequence[InvalidCell] = (),
            missing: Sequence[MissingCell] = ()) -> str:
    """``3 cell(s), 1 failed, 1 invalid, 2 missing``: every cell found is counted somewhere."""
    return (f"{len(cells)} cell(s), {len(failed)} failed, {len(invalid)} invalid, "
            f"{sum(m.count for m in missing)} missing")


def problem_lines(failed: Sequence[FailedCell], invalid: Sequence[InvalidCell],
                  missing: Sequence[MissingCell]) -> list[tuple[str, list[str]]]:
    """The sections listing the cells that are not on the board: (title, one line each)."""
    out = []
    if failed:
        out.append(("Failed cells", [f"`{f.overrides or f.path}`: {f.error}" for f in failed]))
    if invalid:
        out.append(("Invalid cells (left off the tables)", [f"`{c.path}`: {'; '.join(c.problems)}" for c in invalid]))
    if missing:
        out.append(("Missing cells", [f"`{m.path}`: {m.reason}" for m in missing]))
    return out


def _environment() -> Any:
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.globals.update(header=_header, header_title=_header_title, value=_value, sort_key=_sort_key,
                       cell_title=_cell_title, heat_style=_heat_style)
    return env


TEMPLATES = Path(__file__).parent / "templates"


def page(tables: list[Table], cells: list[Cell], failed: list[FailedCell], plots: dict[str, list[Path]],
         notes: list[str], invalid: Sequence[InvalidCell] = (), missing: Sequence[MissingCell] = ()) -> str:
    """The self-contained HTML page (``leaderboards/templates/page.html.j2``): per domain the
    main table with its budget, the EA-vs-RA plot and the ASR heat map, the full tables folded
    below; then every cell's image evidence, folded."""
    pooled = any(isinstance(r.get(m), dict) and r[m].get("pooled") for t in tables for r in t.rows
                 for m in t.metric_columns)
    domains = []
    for d in sorted({t.domain for t in tables}):
        mine = [t for t in tables if t.domain == d]
        tradeoff = next((p for p in plots.get(d, []) if p.stem.endswith("_ea_vs_ra")), None)
        domains.append({"name": d, "main": next((t for t in mine if t.kind == "main"), None),
                        "asr": next((t for t in mine if t.kind == "asr"), None),
                        "details": [t for t in mine if t.kind in ("methods", "attacks")],
                        "tradeoff": _data_uri(tradeoff) if tradeoff is not None else ""})
    evidence = [_evidence(c) for c in sorted(cells, key=lambda c: (c.domain, c.label, c.concept, c.attacker,
                                                                   c.variant, str(c.seed)))]
    return _environment().get_template("page.html.j2").render(
        style=(TEMPLATES / STYLE_SHEET).read_text(encoding="utf-8"), script=SCRIPT,
        summary=summary(cells, failed, invalid, missing), pooled=pooled,
        problems=[{"title": title, "lines": lines} for title, lines in problem_lines(failed, invalid, missing)],
        notes=notes, domains=domains, evidence=evidence)


def row_dicts(table: Table) -> list[dict[str, Any]]:
    """Flat rows (coordinates + metric values) for W&B tables and tests."""
    return [{c: (row.get(c) or {}).get("value") if c in table.metric_columns else row.get(c)
             for c in table.columns} for row in table.rows]
