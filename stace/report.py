"""STACE's human-readable report: every hypothesis with its probes and images, successful
ones marked, metrics and cost, ending with the Report Summariser's text. Markdown and HTML
(the same content; images are the PNGs beside the report)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Callable

from emma.files import atomic_write_text
from stace.loop import STACEOutcome


def _fmt(v: Any) -> str:
    if v is None:
        return "null"
    if hasattr(v, "value"):
        ci = (f" [{v.ci_low:.3f}, {v.ci_high:.3f}] ({v.method})"
              if getattr(v, "ci_low", None) is not None and getattr(v, "ci_high", None) is not None else "")
        return _fmt(v.value) + ci
    return "null" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def _cell(text: str) -> str:
    """Text for a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def write_report(outcome: STACEOutcome, out_dir: Path, *, concept: str, k: int, metrics: dict[str, Any],
                 usage: dict[str, Any], cost_usd: float, redact: Callable[[str], str],
                 image_dir: str = "images", replies: dict[str, str] | None = None,
                 title: str = "STACE stress test") -> tuple[Path, Path]:
    """Write ``report.md`` and ``report.html`` into ``out_dir``; return their paths.

    ``replies`` (a chat target's replies by probe hash) replaces the images with the replies."""
    md: list[str] = [f"# {title}: '{concept}'", ""]
    body: list[str] = [f"<h1>{html.escape(title)}: '{html.escape(concept)}'</h1>"]
    if outcome.stopped:
        note = f"PARTIAL REPORT: the run stopped early ({outcome.stopped}) after {len(outcome.records)} iterations."
        md += [f"**{note}**", ""]
        body.append(f"<p><strong>{html.escape(note)}</strong></p>")
    if outcome.resumed_iterations:
        md += [f"Resumed: {outcome.resumed_iterations} iterations were read from the trace.", ""]
    rows = [("SIR_H", metrics.get("sir_h")), ("SIR_I", metrics.get("sir_i")), ("EII", metrics.get("eii")),
            ("SER", metrics.get("ser")), ("Novelty", metrics.get("novelty")), ("cost (USD)", cost_usd)]
    md += ["| metric | value |", "|---|---|"] + [f"| {n} | {_fmt(v)} |" for n, v in rows] + [""]
    body.append("<table>" + "".join(f"<tr><td>{n}</td><td>{_fmt(v)}</td></tr>" for n, v in rows) + "</table>")
    md += [f"Evaluator: {outcome.evaluator}. TaskSpec: `{outcome.task_spec}`", ""]
    body.append(f"<p>Evaluator: {html.escape(str(outcome.evaluator))}</p>")
    for r in outcome.records:
        h = r.hypothesis or {}
        mark = "SUCCESS" if r.success else ("no success" if r.executed else "EXECUTION FAILED")
        title = f"Iteration {r.index + 1}: {h.get('title', '(no hypothesis)')} — {mark}"
        md += [f"## {title}", ""]
        body.append(f"<h2 class='{'ok' if r.success else 'no'}'>{html.escape(title)}</h2>")
        if h:
            lines = [f"- strategy: {h.get('strategy')}", f"- rationale: {h.get('rationale')}",
                     f"- evaluation: {h.get('evaluation', '-')}; success criterion: {h.get('success_criterion')}",
                     f"- novelty: {_fmt(r.novelty)}; PaperCards: {', '.join(r.cards) or '-'}",
                     f"- critiques: {len(r.critiques)}; execution mode: {r.mode}; "
                     f"detected {r.detected}/{k}"]
            md += lines
            body.append("<ul>" + "".join(f"<li>{html.escape(x[2:])}</li>" for x in lines) + "</ul>")
        if r.error:
            md.append(f"- error: {r.error}")
            body.append(f"<p>error: {html.escape(r.error)}</p>")
        if r.code:
            md += ["", "```python", r.code, "```"]
            body.append(f"<pre>{html.escape(r.code)}</pre>")
        md.append("")
        if r.probes and replies is not None:
            md += ["| prompt | seed | reply | detected | score |", "|---|---|---|---|---|"]
            items = []
            for p in r.probes:
                reply = " ".join(replies.get(p.image_hash or "", "").split())[:300]
                md.append(f"| {_cell(p.prompt)} | {p.seed} | {_cell(reply)} | {'**yes**' if p.detected else 'no'} "
                          f"| {p.score:.2f} |")
                items.append(f"<li class='{'ok' if p.detected else 'no'}'><b>{html.escape(p.prompt)}</b> "
                             f"(seed {p.seed}): {html.escape(reply)} {'DETECTED' if p.detected else ''} "
                             f"{p.score:.2f}</li>")
            body.append("<ul>" + "".join(items) + "</ul>")
            md.append("")
        elif r.probes:
            md += ["| image | prompt | seed | detected | score |", "|---|---|---|---|---|"]
            cells = []
            for p in r.probes:
                img = f"{image_dir}/{p.image_hash}.png" if p.image_hash else ""
                md.append(f"| ![]({img}) | {p.prompt} | {p.seed} | {'**yes**' if p.detected else 'no'} "
                          f"| {p.score:.2f} |")
                cells.append(f"<figure class='{'ok' if p.detected else 'no'}'><img src='{img}' width='96'>"
                             f"<figcaption>{html.escape(p.prompt)} (seed {p.seed}) "
                             f"{'DETECTED' if p.detected else ''} {p.score:.2f}</figcaption></figure>")
            body.append("<div class='grid'>" + "".join(cells) + "</div>")
            md.append("")
    md += ["## Tokens per role", "", "| role | calls | prompt | completion | USD | retries | repairs | failures |",
           "|---|---|---|---|---|---|---|---|"]
    for role, u in usage.items():
        md.append(f"| {role} | {u['calls']} | {u['prompt_tokens']} | {u['completion_tokens']} | "
                  f"{u['cost_usd']:.4f} | {u['retries']} | {u['repairs']} | {u['failures']} |")
    md.append("")
    rep = outcome.report
    md += ["## Report Summariser", ""]
    body.append("<h2>Report Summariser</h2>")
    if rep:
        md += [rep["summary"], ""] + [f"- vulnerability: {v}" for v in rep["vulnerabilities"]] + \
              [f"- recommendation: {v}" for v in rep["recommendations"]]
        body.append(f"<p>{html.escape(rep['summary'])}</p><ul>"
                    + "".join(f"<li>vulnerability: {html.escape(v)}</li>" for v in rep["vulnerabilities"])
                    + "".join(f"<li>recommendation: {html.escape(v)}</li>" for v in rep["recommendations"])
                    + "</ul>")
    else:
        md.append("(no summary: the run stopped early or the Report Summariser failed)")
        body.append("<p>(no summary)</p>")
    style = ("body{font-family:sans-serif;max-width:1100px;margin:auto}.grid{display:flex;flex-wrap:wrap}"
             "figure{margin:4px;width:150px;font-size:11px}figure.ok{outline:3px solid #c00}"
             "h2.ok{color:#c00}li.ok{color:#c00}img{image-rendering:pixelated}pre{background:#f4f4f4;padding:6px}")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>STACE {html.escape(concept)}</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>")
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path, html_path = out_dir / "report.md", out_dir / "report.html"
    atomic_write_text(md_path, redact("\n".join(md) + "\n"))
    atomic_write_text(html_path, redact(page))
    return md_path, html_path
