"""One cell: (model, method, domain, concept, attacker, seeds) -> results.json + samples.jsonl.

A cell is :func:`emma.stages.setup` followed by the stages of :data:`emma.stages.STAGES`
(load, bias of the base model, erase, suite, attack, metrics, record), each with its own
cache; a killed cell run again picks up every finished image, score, erased model and attack.
"""

from __future__ import annotations

import math
from pathlib import Path

from omegaconf import DictConfig

from emma import finished
from emma.results import CellResult
from emma.stages import STAGES, CellContext, setup


def run_cell(cfg: DictConfig, output_dir: str | Path) -> CellResult:
    """Run one cell and write ``results.json`` and ``samples.jsonl`` into ``output_dir``."""
    return run_stages(setup(cfg), output_dir)


def run_stages(ctx: CellContext, output_dir: str | Path) -> CellResult:
    """The stages of a cell whose :func:`~emma.stages.setup` has run: a finished cell's stored
    files are copied into ``output_dir``; any other cell runs every stage."""
    ctx.output_dir = Path(output_dir)
    ctx.output_dir.mkdir(parents=True, exist_ok=True)
    if ctx.finished is not None:  # a finished cell with these inputs: its stored result, no pipeline
        return CellResult.load(finished.serve(ctx.finished, ctx.output_dir))
    for stage in STAGES:
        stage(ctx)
    return ctx.result


def summary_table(result: CellResult) -> str:
    """A short plain-text table of the metrics."""
    rows = [f"{'metric':<44}{'value':>10}{'95% CI':>22}{'n':>8}"]
    for k, v in sorted(result.metrics.items()):
        ci = f"[{v.ci_low:.3f}, {v.ci_high:.3f}]" if v.ci_low is not None and not math.isnan(v.ci_low) else ""
        value = f"{v.value:>10.4f}" if v.value is not None else f"{'null':>10}"
        rows.append(f"{k:<44}{value}{ci:>22}{v.n:>8}")
    return "\n".join(rows)


def describe(result: CellResult) -> str:
    c = result.cell
    head = (f"cell: model={c.model} method={c.method} domain={c.domain} concept={c.concept} "
            f"attacker={c.attacker} classifier={c.classifier}")
    counts = ", ".join(f"{k}={v}" for k, v in result.counts.items())
    return "\n".join([head, summary_table(result), counts] + [f"NOTE: {n}" for n in result.notes])
