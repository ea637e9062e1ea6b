"""A cell as a short list of stages over one :class:`~emma.stages.context.CellContext`.

``setup`` builds the context (finished-cell lookup, validation, components); each stage then
reads what earlier stages filled and fills its own part. :func:`emma.cell.run_cell` is the
loop over :data:`STAGES`; scripts and tests that need part of a cell call the stages they need
(``setup`` + ``load_model`` + ``erase`` gives an erased model and its generator).
"""

from __future__ import annotations

from typing import Callable

from emma.stages.attack import attack
from emma.stages.context import CellContext
from emma.stages.erasure import erase
from emma.stages.metrics import draw_base_bias, quality_metrics, rate_metrics, timing_metrics
from emma.stages.model import attack_target, load_model
from emma.stages.record import record
from emma.stages.setup import setup
from emma.stages.suite import draw_suite

Stage = Callable[[CellContext], None]

#: The stages of a cell after :func:`setup`, in order.
STAGES: tuple[Stage, ...] = (
    load_model,      # base pipeline, fingerprint; the attacker refuses what it cannot attack
    draw_base_bias,  # bias images of the base model (the erase stage edits the pipeline in place)
    erase,           # erased model (cached), or an inference-time guidance
    draw_suite,      # EA/RA prompts drawn and judged (cached per image)
    attack,          # the attacker on the EA prompts (cached per request)
    rate_metrics,    # EA, RA, ASR and the attacker's own metrics
    quality_metrics,  # FID, bias
    timing_metrics,  # unlearning and inference time
    record,          # results.json, samples.jsonl, evidence; stored under the finished key
)

__all__ = ["STAGES", "CellContext", "Stage", "attack_target", "setup"]
