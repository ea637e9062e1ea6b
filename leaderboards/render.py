"""Tables -> Markdown, CSV, plots (PNG) and one self-contained HTML page."""

from __future__ import annotations

import base64
import csv
import html
import io
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from emma.evidence import EVIDENCE_DIR, EvidenceError, missing_evidence, read_evidence
from leaderboards.collect import Cell, FailedCell, InvalidCell, MissingCell
from leaderboards.tables import Table, fmt, mean_metric, sort_value


def markdown(table: Table) -> str:
    head = "| " + " | ".join(table.columns) + " |"
    sep = "|" + "|".join("---" if c not in table.metric_columns else "---:" for c in table.columns) + "|"
    lines = [f"### {table.title}", "", head, sep]
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


def plot_tradeoff(rows: list[list[Cell]], path: Path) -> bool:
    """EA (mean over prompt types) vs RA (mean over types), one point per method (mean over
    concepts) and a faint point per row (a concept; the mean over its seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        eas = [v for c in r if (v := mean_metric(c, "ea/")) is not None]
        ras = [v for c in r if (v := mean_metric(c, "ra/")) is not None]
        if eas and ras:
            pts[r[0].display].append((sum(ras) / len(ras), sum(eas) / len(eas)))
    if not pts:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4), dpi=110)
    cmap, markers = plt.get_cmap("tab20"), "osD^vP*Xh<>p"
    for i, (method, xy) in enumerate(sorted(pts.items())):
        color = cmap(i % 20)
        ax.scatter([p[0] for p in xy], [p[1] for p in xy], color=color, alpha=0.25, s=14)
        mx, my = sum(p[0] for p in xy) / len(xy), sum(p[1] for p in xy) / len(xy)
        # methods at the same point stay visible: each is drawn smaller, on top of the ones before
        size = max(20.0, 150.0 - 9.0 * i)
        ax.scatter([mx], [my], color=color, s=size, marker=markers[i % len(markers)],
                   label=f"{method} (n={len(xy)})", edgecolor="k")
    ax.set_xlabel("RA (retaining ability, mean over prompt types)")
    ax.set_ylabel("EA (erasing ability, mean over prompt types)")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{rows[0][0].domain}: erasing vs retaining")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_asr(table: Table, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    attackers = [r["attacker"] for r in table.rows]
    methods = table.metric_columns
    grid = np.array([[sort_value(r.get(m)) if r.get(m) else np.nan for m in methods] for r in table.rows],
                    dtype=float)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.5 + 0.8 * len(methods)), max(3.0, 1.5 + 0.5 * len(attackers))), dpi=110)
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="Reds")
    ax.set_xticks(range(len(methods)), methods, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(attackers)), attackers, fontsize=8)
    for i in range(len(attackers)):
        for j in range(len(methods)):
            if not math.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if grid[i, j] > 0.6 else "black")
    ax.set_title(f"{table.domain}: ASR (attacker x method)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


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
});
"""

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table.board { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 13px; }
table.board th, table.board td { border: 1px solid #ccc; padding: 3px 7px; }
table.board th { background: #eef; cursor: pointer; white-space: nowrap; }
table.board th.asc::after { content: ' \\25B2'; } table.board th.desc::after { content: ' \\25BC'; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.grid { display: flex; flex-wrap: wrap; gap: 6px; }
.grid figure { margin: 0; width: 112px; font-size: 10px; }
.grid img { width: 96px; height: 96px; image-rendering: pixelated; border: 3px solid #aaa; }
.grid figure.hit img { border-color: #c00; }
.evidence { border-top: 1px solid #ddd; padding-top: 0.5em; margin-top: 1em; }
.failed { color: #a00; } .note { color: #555; font-size: 12px; }
img.plot { max-width: 520px; margin-right: 1em; }
"""


def _table_html(table: Table, with_links: bool) -> str:
    out = [f"<h3>{html.escape(table.title)}</h3>", f'<table class="board" id="{table.name}">', "<thead><tr>"]
    cols = table.columns + (["evidence"] if with_links else [])
    out += [f"<th>{html.escape(c)}</th>" for c in cols] + ["</tr></thead><tbody>"]
    for row in table.rows:
        out.append("<tr>")
        for c in table.columns:
            if c in table.metric_columns:
                sv = sort_value(row.get(c))
                sv = "" if isinstance(sv, float) and math.isnan(sv) else sv
                out.append(f'<td class="num" data-sort="{sv}">{html.escape(fmt(row.get(c)))}</td>')
            else:
                out.append(f"<td>{html.escape(str(row.get(c, '')))}</td>")
        if with_links:
            n = row.get("_evidence", 0)
            out.append(f'<td data-sort="{n}"><a href="#{row["_anchor"]}">{n} image(s)</a></td>')
        out.append("</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def evidence_problem(cell: Cell) -> str | None:
    """Why a cell's images cannot all be shown (a damaged index, image files gone), or None."""
    try:
        read_evidence(cell.path)
    except EvidenceError as err:
        return f"{err}; the cell is shown without its images"
    gone = missing_evidence(cell.path)
    return f"{cell.path / EVIDENCE_DIR}: {gone} image file(s) of the evidence index are missing" if gone else None


def _evidence_html(cell: Cell) -> str:
    try:
        items = read_evidence(cell.path)
    except EvidenceError:
        items = []
    head = (f'<div class="evidence" id="{cell.anchor}"><h4>{html.escape(cell.domain)} / '
            f"{html.escape(cell.label or cell.method)} / {html.escape(cell.concept)} / "
            f"{html.escape(cell.attacker)}{f' / seed {cell.seed}' if cell.seed is not None else ''}"
            f"{f' / {html.escape(cell.variant)}' if cell.variant else ''} "
            f"<span class='note'>({html.escape(str(cell.path))})</span></h4>")
    if not items:
        return head + "<p class='note'>no images stored with this cell</p></div>"
    hits = sum(1 for e in items if e["detected"])
    figs = []
    for e in items:
        uri = _data_uri(cell.path / EVIDENCE_DIR / e["file"])
        cls = "hit" if e["detected"] else "miss"
        cap = (f"{'CAME BACK' if e['detected'] else 'erased'} ({e['score']:.2f}) [{e['group']}/{e['kind']}] "
               f"{e['prompt']} (seed {e['seed']})")
        figs.append(f'<figure class="{cls}"><img src="{uri}" alt="{html.escape(e["prompt"])}">'
                    f"<figcaption>{html.escape(cap)}</figcaption></figure>")
    return (head + f"<p class='note'>{hits} image(s) in which the judge found '{html.escape(cell.concept)}' "
            "(red frame), then images where it did not</p>"
            + '<div class="grid">' + "".join(figs) + "</div></div>")


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


def page(tables: list[Table], cells: list[Cell], failed: list[FailedCell], plots: dict[str, list[Path]],
         notes: list[str], invalid: Sequence[InvalidCell] = (), missing: Sequence[MissingCell] = ()) -> str:
    pooled = any(isinstance(r.get(m), dict) and r[m].get("pooled") for t in tables for r in t.rows
                 for m in t.metric_columns)
    body = ["<h1>EMMA leaderboard</h1>",
            f"<p class='note'>{summary(cells, failed, invalid, missing)}. Click a column header to sort; "
            "values are point estimates with 95% intervals"
            + ("; rows of several seeds show the mean over seeds with its range (min–max) and the number of seeds"
               if pooled else "") + ".</p>"]
    for title, lines in problem_lines(failed, invalid, missing):
        body.append(f"<h2 class='failed'>{html.escape(title)}</h2><ul class='failed'>")
        body += [f"<li>{html.escape(line)}</li>" for line in lines]
        body.append("</ul>")
    for n in notes:
        body.append(f"<pre class='note'>{html.escape(n)}</pre>")
    domains = sorted({t.domain for t in tables})
    for d in domains:
        body.append(f"<h2>{html.escape(d)}</h2>")
        for p in plots.get(d, []):
            body.append(f'<img class="plot" src="{_data_uri(p)}" alt="{html.escape(p.stem)}">')
        for t in tables:
            if t.domain == d:
                body.append(_table_html(t, with_links=t.kind != "asr"))
    body.append("<h2>Image evidence</h2>")
    body += [_evidence_html(c) for c in sorted(cells, key=lambda c: (c.domain, c.label, c.concept, c.attacker,
                                                                     c.variant, str(c.seed)))]
    return ("<!doctype html><html><head><meta charset='utf-8'><title>EMMA leaderboard</title>"
            f"<style>{STYLE}</style><script>{SCRIPT}</script></head><body>"
            + "\n".join(body) + "</body></html>\n")


def row_dicts(table: Table) -> list[dict[str, Any]]:
    """Flat rows (coordinates + metric values) for W&B tables and tests."""
    return [{c: (row.get(c) or {}).get("value") if c in table.metric_columns else row.get(c)
             for c in table.columns} for row in table.rows]
