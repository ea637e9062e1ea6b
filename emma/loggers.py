"""Experiment loggers, called once per cell after results.json is written (``logger=``).

``none``: results.json, metrics.csv and samples.jsonl are the record. ``csv``: the same
(every cell writes ``metrics.csv``; the choice is kept for old command lines). ``wandb``: one
W&B run per cell with the redacted config, the metrics (value and CI bounds), the evidence
images and a grid of them. A cell served from the results cache is logged as a computed one
(its evidence images come with it). A logger that fails only logs a warning: the result files
are the source of truth and are already on disk.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from emma.evidence import EVIDENCE_DIR, read_evidence
from emma.results import CellResult, redact, write_metrics_table

log = logging.getLogger(__name__)


def log_csv(result: CellResult, out: Path) -> Path:
    """``metrics.csv`` (:func:`emma.results.write_metrics_table`), as every cell writes it."""
    return write_metrics_table(result.to_json(), out)


def run_name(result: CellResult) -> str:
    c = result.cell
    return f"{c.model}/{c.method}/{c.domain}/{c.concept}/{c.attacker}"


def image_grid(paths: list[Path], columns: int = 8) -> Any:
    """One PIL image with ``paths`` tiled row-major (torchvision's ``make_grid``; all images
    resized to the first one's size), 2 px white between them."""
    import numpy as np
    import torch
    from PIL import Image
    from torchvision.utils import make_grid

    first = Image.open(paths[0]).convert("RGB")
    size = first.size
    tiles = [torch.from_numpy(np.array(Image.open(p).convert("RGB").resize(size))).permute(2, 0, 1)
             for p in paths]
    grid = make_grid(torch.stack(tiles), nrow=min(columns, len(tiles)), padding=2, pad_value=255)
    return Image.fromarray(grid.permute(1, 2, 0).numpy())


def log_wandb(lcfg: DictConfig, result: CellResult, out: Path) -> str:
    import wandb

    settings = wandb.Settings(silent=True, console="off")
    run = wandb.init(project=lcfg.project, entity=lcfg.get("entity"), group=lcfg.get("group"),
                     mode=lcfg.get("mode") or os.environ.get("WANDB_MODE") or "offline",
                     dir=str(out), name=run_name(result), job_type="cell",
                     tags=list(lcfg.get("tags") or []),
                     config=redact({"cell": vars(result.cell), "config": result.config,
                                    "versions": result.versions}),
                     reinit="finish_previous", settings=settings)
    try:
        flat: dict[str, Any] = {}
        for k, v in result.metrics.items():
            flat[k] = v.value
            if v.ci_low is not None:
                flat[f"{k}/ci_low"], flat[f"{k}/ci_high"] = v.ci_low, v.ci_high
        flat.update({f"counts/{k}": v for k, v in result.counts.items()})
        evidence = read_evidence(out)
        if evidence:
            files = [out / EVIDENCE_DIR / e["file"] for e in evidence]
            flat["evidence"] = [wandb.Image(str(p), caption=f"{e['prompt']} (seed {e['seed']}, "
                                            f"{'detected' if e['detected'] else 'not detected'})")
                                for p, e in zip(files, evidence)]
            flat["evidence_grid"] = wandb.Image(image_grid(files), caption="evidence: " + run_name(result))
        run.log(flat)
        for k, v in flat.items():
            if isinstance(v, (int, float)):
                run.summary[k] = v
        return run.dir
    finally:
        run.finish()


def log_cell(cfg: DictConfig, result: CellResult, out: str | Path) -> None:
    """Send a finished cell to the configured logger; failures are warnings, never errors."""
    lcfg = cfg.get("logger") or OmegaConf.create({"name": "none"})
    name = lcfg.get("name", "none")
    out = Path(out)
    try:
        if name == "csv":
            log_csv(result, out)
        elif name == "wandb":
            log_wandb(lcfg, result, out)
    except Exception as err:  # noqa: BLE001  (the logger is optional; results.json is written)
        log.warning("logger %s failed (%s: %s); results.json is unaffected", name, type(err).__name__, err)
