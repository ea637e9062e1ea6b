"""One cell: (model, method, domain, concept, attacker, seeds) -> results.json + samples.jsonl.

A cell is :func:`emma.stages.setup.setup` followed by the stages of :data:`STAGES`, each
with its own cache; a killed cell run again picks up every finished image, score, erased
model and attack.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from omegaconf import DictConfig

from emma import finished, startup
from emma.results import CellResult, summary_text
from emma.stages.attack import attack
from emma.stages.context import CellContext
from emma.stages.erasure import erase
from emma.stages.metrics import draw_base_bias, quality_metrics, rate_metrics, timing_metrics
from emma.stages.model import load_model
from emma.stages.record import record
from emma.stages.setup import setup
from emma.stages.suite import draw_suite

Stage = Callable[[CellContext], None]

#: The stages of a cell after :func:`~emma.stages.setup.setup`, in order.
STAGES: tuple[Stage, ...] = (
    load_model,       # base pipeline, fingerprint; the attacker refuses what it cannot attack
    draw_base_bias,   # bias images of the base model (the erase stage edits the pipeline in place)
    erase,            # erased model (cached), or an inference-time guidance
    draw_suite,       # EA/RA prompts drawn and judged (cached per image)
    attack,           # the attacker on the EA prompts (cached per request)
    rate_metrics,     # EA, RA, ASR and the attacker's own metrics
    quality_metrics,  # FID, bias
    timing_metrics,   # unlearning and inference time
    record,           # results.json, samples.jsonl, evidence; stored under the finished key
)


def run_cell(cfg: DictConfig, output_dir: str | Path) -> CellResult:
    """Run one cell and write ``results.json`` and ``samples.jsonl`` into ``output_dir``."""
    return run_stages(setup(cfg), output_dir)


def erased_cell(cfg: DictConfig) -> CellContext:
    """The cell's stages up to its erased model, for tools that need the model a cell erases
    (a probe, a sample grid, an attack benchmark): set up without the finished-cell lookup,
    the model loaded, the erasure run or read from the cache. ``ctx.erased.pipe`` is the
    erased pipeline, ``ctx.generator`` draws with it at the cell's sampler settings."""
    ctx = setup(cfg, lookup=False)
    load_model(ctx)
    erase(ctx)
    return ctx


def run_stages(ctx: CellContext, output_dir: str | Path) -> CellResult:
    """The stages of a cell whose :func:`~emma.stages.setup` has run: a finished cell's stored
    files are copied into ``output_dir``; any other cell runs every stage."""
    ctx.output_dir = Path(output_dir)
    ctx.output_dir.mkdir(parents=True, exist_ok=True)
    if ctx.finished is not None:  # a finished cell with these inputs: its stored result, no pipeline
        return CellResult.load(finished.serve(ctx.finished, ctx.output_dir))
    try:
        for stage in STAGES:
            stage(ctx)
    finally:
        startup.end()  # what the model stage froze for the command line's start-up is collectable again
    return ctx.result


def describe(result: CellResult) -> str:
    """The cell's coordinates, metrics table, counts and notes (:func:`emma.results.summary_text`)."""
    return summary_text(result.to_json())
