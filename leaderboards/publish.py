"""Publish a built leaderboard to Weights & Biases as ``wandb.Table`` s with images.

Offline (``WANDB_MODE=offline``, the default when no key is configured) the run lands in
``<out>/wandb/offline-run-*`` for ``wandb sync``, the staged table artifacts (rows with their
evidence images) in ``<out>/wandb/data`` unless ``WANDB_DATA_DIR`` is set; online it needs
``WANDB_API_KEY`` in the environment. ``python -m leaderboards.wandb_read`` reads a run back.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

from emma.evidence import EVIDENCE_DIR, EvidenceError, read_evidence
from emma.loggers import image_grid


def wandb_columns(table: Any) -> list[str]:
    """Coordinates, then each metric as value, ``_ci_low``, ``_ci_high`` and ``_n`` (and
    ``_min``, ``_max``, ``_sd`` for rows pooled over seeds), as the CSV."""
    from leaderboards.render import metric_header

    return metric_header(table)


def wandb_values(table: Any, row: dict[str, Any]) -> list[Any]:
    from leaderboards.render import metric_values

    return metric_values(table, row)


def publish_wandb(board: Any, project: str = "emma-leaderboard", entity: str | None = None) -> str:
    """One W&B run holding every table of ``board``; returns the run's local folder."""
    mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    if mode == "offline" and not os.environ.get("WANDB_DATA_DIR"):
        # a table's rows with their images are an artifact, staged until `wandb sync` uploads
        # it; by default the staging folder is the user's (~/.local/share/wandb): keep it
        # beside the run so that the offline run folder is complete and can be moved
        with _env("WANDB_DATA_DIR", str(Path(board.out) / "wandb" / "data")):
            return _publish(board, project, entity, mode)
    return _publish(board, project, entity, mode)


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


def _publish(board: Any, project: str, entity: str | None, mode: str) -> str:
    import wandb

    run = wandb.init(project=project, entity=entity, job_type="leaderboard", mode=mode, dir=str(board.out),
                     config={"cells": len(board.cells), "failed": len(board.failed)},
                     settings=wandb.Settings(silent=True, console="off"), reinit="finish_previous")
    try:
        grids: dict[str, Any] = {}
        for c in board.cells:
            try:
                items = read_evidence(c.path)
            except EvidenceError:  # the build warned about it
                items = []
            if items:
                grids[c.anchor] = wandb.Image(
                    image_grid([c.path / EVIDENCE_DIR / e["file"] for e in items]),
                    caption=" | ".join(f"{'+' if e['detected'] else '-'} {e['prompt']}" for e in items[:8]))
        logged: dict[str, Any] = {}
        for t in board.tables:
            cols = wandb_columns(t) + (["evidence"] if t.kind != "asr" else [])
            table = wandb.Table(columns=cols)
            for row in t.rows:
                values = wandb_values(t, row)
                if t.kind != "asr":
                    values.append(grids.get(row.get("_anchor")))
                table.add_data(*values)
            logged[f"leaderboard/{t.name}"] = table
        # the grids also as plain images: a table's image cells may live only in artifacts
        logged.update({f"evidence/{anchor}": img for anchor, img in grids.items()})
        for paths in board.plots.values():
            for p in paths:
                logged[f"plots/{p.stem}"] = wandb.Image(str(p))
        run.log(logged)
        if board.failed:
            run.summary["failed_cells"] = [f"{f.overrides or f.path}: {f.error}" for f in board.failed]
        return run.dir
    finally:
        run.finish()
