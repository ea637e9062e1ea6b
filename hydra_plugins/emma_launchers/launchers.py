"""Failure-tolerant submitit launchers (see the package docstring)."""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
    BaseSubmititLauncher,
    LocalLauncher,
    SlurmLauncher,
)
from omegaconf import OmegaConf, open_dict

log = logging.getLogger(__name__)
REPORT = "sweep_report.json"
PROGRESS_EVERY_S = 2.0  # how often a waiting sweep looks at its jobs


def _executor(launcher: BaseSubmititLauncher) -> Any:
    """The submitit executor for ``launcher.params``, as hydra-submitit-launcher builds it."""
    import submitit

    kind = launcher._EXECUTOR
    specific_init_keys = {"max_num_timeout"}
    init = {"folder": launcher.params["submitit_folder"]}
    init.update({f"{kind}_{k}": v for k, v in launcher.params.items() if k in specific_init_keys})
    executor = submitit.AutoExecutor(cluster=kind, **init)
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    skip = specific_init_keys | {"submitit_folder", "parallelism"}
    executor.update_parameters(**{(k if k in base else f"{kind}_{k}"): v
                                  for k, v in launcher.params.items() if k not in skip})
    return executor


def _error_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    # submitit wraps a job's traceback; its last line names the error
    tail = [line for line in text if line.strip()][-1:] if text else []
    return f"{type(exc).__name__}: {tail[0] if tail else ''}".strip()


class _TolerantMixin:
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None  # type: ignore[attr-defined]
        sweep_dir = Path(str(self.config.hydra.sweep.dir))  # type: ignore[attr-defined]
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")  # type: ignore[attr-defined]
        params, kept = [], {}
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            done = _finished_cell(self, list(overrides), idx)
            if done is not None:  # a resumed sweep: the finished cell needs no job
                kept[idx] = done
                log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))} (finished: {done[0]}, no job)")
                continue
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        t0 = time.time()
        jobs: list[Any] = []
        if params:
            executor = _executor(self)  # type: ignore[arg-type]
            limit = int(self.params.get("parallelism") or 0)  # type: ignore[attr-defined]
            jobs = _submit_rolling(executor, self, params, limit) if limit else executor.map_array(self, *zip(*params))
            _wait(jobs, len(kept))
        by_idx = {p[2]: (p, job) for p, job in zip(params, jobs)}
        returns: list[JobReturn] = []
        report = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            if idx in kept:
                out, values = kept[idx]
                ret = JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED, _return_value=values)
                report.append({"num": idx, "job_id": None, "overrides": list(overrides), "status": "completed",
                               "kept": True, "output_dir": os.path.relpath(out, sweep_dir)})
                returns.append(ret)
                continue
            (overrides, _, _, _, _), job = by_idx[idx]
            entry: dict[str, Any] = {"num": idx, "job_id": job.job_id, "overrides": overrides}
            try:
                ret = job.results()[0]
            except Exception as exc:  # noqa: BLE001  (cancelled, killed, out of requeues)
                ret = JobReturn(overrides=overrides, status=JobStatus.FAILED, _return_value=exc)
                entry.update(status="failed", error=_error_line(exc), state=_state(job))
            else:
                if ret.status == JobStatus.FAILED:
                    exc = ret._return_value
                    entry.update(status="failed", error=_error_line(exc),
                                 traceback="".join(traceback.format_exception(exc))[-4000:])
                else:
                    entry["status"] = "completed"
                entry["output_dir"] = _output_dir(ret, sweep_dir)
            report.append(entry)
            returns.append(ret)
        _write_report(sweep_dir, report, time.time() - t0)
        return returns


def _finished_cell(launcher: Any, overrides: list[str], idx: int) -> tuple[Path, dict[str, Any]] | None:
    """The folder of job ``idx`` and its metric values when it already holds a finished cell's
    results.json (a sweep run again into its folder), so that no job is submitted just to keep
    it; ``None`` otherwise (and with ``overwrite=true``). A results.json that does not load as
    a finished cell's runs its job, which warns and computes the cell again (emma/run.py)."""
    hydra_config = HydraConfig.instance()
    previous = hydra_config.cfg
    try:
        cfg = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, overrides)
        if cfg.get("overwrite"):
            return None
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = idx
            cfg.hydra.job.id = f"resume_check_{idx}"
        hydra_config.set_config(cfg)  # the sweep's subdir interpolates hydra.job.*
        out = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
        done = out / "results.json"
        if not done.is_file():
            return None
        from emma.results import CellResult

        kept = CellResult.load(done)
    except Exception:  # noqa: BLE001 - anything unclear: the job runs and decides itself
        return None
    finally:
        hydra_config.cfg = previous
    return out, {k: v.value for k, v in kept.metrics.items()}


def _wait(jobs: list[Any], kept: int) -> None:
    """Wait for every job, logging the sweep's progress (done / running / waiting / failed)
    whenever it changes."""
    last = None
    while True:
        done = [j for j in jobs if j.done()]
        failed = sum(1 for j in done if _failed(j))
        running = sum(1 for j in jobs if not j.done() and _state(j) in ("RUNNING", "COMPLETING"))
        state = (len(done), failed, running)
        if state != last:
            waiting = len(jobs) - len(done) - running
            log.info(f"sweep: {len(done) - failed + kept} done{f' ({kept} kept)' if kept else ''}, "
                     f"{running} running, {waiting} waiting, {failed} failed")
            last = state
        if len(done) == len(jobs):
            return
        time.sleep(PROGRESS_EVERY_S)


def _failed(job: Any) -> bool:
    try:
        return job.exception() is not None or job.results()[0].status == JobStatus.FAILED
    except Exception:  # noqa: BLE001  (cancelled, killed: no result to read)
        return True


def _submit_rolling(executor: Any, fn: Any, params: list[tuple], limit: int) -> list[Any]:
    """Submit one job per parameter tuple, keeping at most ``limit`` unfinished at a time."""
    jobs: list[Any] = []
    for args in params:
        while sum(not j.done() for j in jobs) >= limit:
            time.sleep(0.5)
        jobs.append(executor.submit(fn, *args))
    return jobs


def _output_dir(ret: JobReturn, sweep_dir: Path) -> str | None:
    try:
        return os.path.relpath(str(ret.hydra_cfg.hydra.runtime.output_dir), sweep_dir)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001
        return None


def _state(job: Any) -> str | None:
    try:
        return str(job.state)
    except Exception:  # noqa: BLE001
        return None


def _write_report(sweep_dir: Path, entries: list[dict[str, Any]], wall_s: float) -> None:
    from emma.files import atomic_write_text

    failed = [e for e in entries if e["status"] != "completed"]
    atomic_write_text(sweep_dir / REPORT, json.dumps(
        {"jobs": len(entries), "completed": len(entries) - len(failed), "failed": len(failed),
         "wall_s": round(wall_s, 1), "cells": entries}, indent=2, default=str) + "\n")
    log.info(f"sweep: {len(entries) - len(failed)}/{len(entries)} cells completed in {wall_s:.0f}s "
             f"({sweep_dir / REPORT})")
    for e in failed:
        log.error(f"sweep: cell #{e['num']} ({' '.join(e['overrides'])}) failed: {e['error']}")


class EmmaSlurmLauncher(_TolerantMixin, SlurmLauncher):
    """submitit_slurm that waits for every job and reports failed cells at the end."""


class EmmaLocalLauncher(_TolerantMixin, LocalLauncher):
    """submitit_local that waits for every job and reports failed cells at the end."""
