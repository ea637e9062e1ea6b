"""``python -m emma.run``: run one cell (or a Hydra multirun sweep of cells).

    python -m emma.run                                    # the tiny world, offline, on a CPU
    python -m emma.run method=esd concept=circle
    python -m emma.run -m method=none,esd,uce domain=tinyworld,tinyworld_style

Exit codes (:mod:`emma.exit_codes`, the README's table): 0 done; 2 a user error (bad setting,
missing weights, a run directory that already holds results), reported in a few lines without
a traceback, before any work where it can be known then; 3 the disk is full; 130 interrupted
(Ctrl-C; the cache keeps every finished image); 1 a bug, or a sweep with failed cells.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from emma import exit_codes, registry
from emma.errors import ConfigError, EmmaError, UnknownChoiceError, first_line
from emma.registry import register_configs
from emma.validate import (
    check_output_dir,
    check_output_dirs,
    split_argv,
    validate_overrides,
    without_hydra,
)

log = logging.getLogger("emma.run")


def check_overrides(argv: list[str]) -> None:
    """Reject an unknown choice of a config group before Hydra composes anything, with the
    valid choices and a "did you mean" (Hydra's own message is a long traceback-like text)."""
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key not in registry.GROUPS or key == "experiment" and value in registry.NULL_CHOICES:
            continue
        for choice in value.split(","):  # multirun: method=esd,uce
            if choice and choice != "null":
                registry.check_choice(key, choice)


register_configs()


class CellFailedError(Exception):
    """A sweep cell's failure, carried as text: the launcher unpickles it in another process,
    where an error class with a richer constructor would not rebuild."""


def _write_error(out: str | Path, err: BaseException) -> None:
    """``error.json`` next to where results.json would be: the sweep report and the
    leaderboard show it (a crashed cell is listed, never silently missing)."""
    import traceback

    from emma.files import atomic_write_text

    try:
        atomic_write_text(Path(out) / "error.json", json.dumps({
            "error": f"{type(err).__name__}: {err}",
            "traceback": "".join(traceback.format_exception(err))[-8000:],
        }, indent=2) + "\n")
    except (OSError, EmmaError) as write_err:  # e.g. the disk that stopped the cell is still full
        print(f"warning: could not write {Path(out) / 'error.json'} ({first_line(write_err)}); the sweep "
              "report still lists the cell's error", file=sys.stderr)


RUN_DIR_LOCK = ".emma-cell.lock"


def _lock_holder(fd: int) -> str:
    """Who holds a run directory's lock, from what it wrote into the lock file."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode())
        return f"pid {info['pid']} on {info['host']}, cell: {info['cell'] or '(defaults)'}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not written its pid yet)"


@contextlib.contextmanager
def claim_run_dir(out: str | Path, cell: str) -> Iterator[None]:
    """Hold ``<out>/.emma-cell.lock`` while a cell runs there, so that a second cell started
    into the same directory is refused instead of mixing its images and results into this
    one's. The lock is an exclusive ``flock``: the kernel releases it when its process ends,
    however it ends, so a lock file left by a dead process is simply taken over. The file
    holds the holder's pid, host and overrides for the refusal's message.

    Not ``filelock``: its Unix lock truncates the lock file when a contender opens it (3.x),
    so the refusal could not name the cell that holds the folder, and it leaves the file in
    the run directory when released; this lock is the same ``flock`` with both kept."""
    import fcntl
    import socket

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RUN_DIR_LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise ConfigError(f"run directory {out} is in use by another cell ({holder}); wait for it to "
                              "end, or choose another hydra.run.dir") from None
        try:
            current = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)  # the holder ended and removed this file while we opened it: lock the new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "cell": cell})
                       + "\n").encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.close(fd)


def _metric_values(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v["value"] for k, v in data["metrics"].items()}


def _interrupted(cfg: DictConfig, out: str | Path) -> None:
    cache = Path(str(cfg.paths.cache_dir)).expanduser()
    print(f"interrupted: no results.json was written to {out}; every image, score and erased model "
          f"finished so far is kept in the cache {cache}; run the same command again to resume",
          file=sys.stderr)
    sys.exit(exit_codes.INTERRUPTED)


def _user_error(err: BaseException) -> EmmaError | None:
    """The harness's own error behind ``err`` (Hydra wraps a constructor's error), if any."""
    from hydra.errors import InstantiationException

    cause = err.__cause__ if isinstance(err, InstantiationException) else err
    return cause if isinstance(cause, EmmaError) else None


def banner(cfg: DictConfig, out: str | Path, served: bool = False) -> str:
    """The lines a cell prints before any work: which cell, where its results go, where its
    caches are (and whether it is served from them)."""
    choices = dict(HydraConfig.get().runtime.choices) if HydraConfig.initialized() else {}
    cell = " ".join(f"{k}={choices.get(k) or OmegaConf.select(cfg, f'{k}.name', default='?')}"
                    for k in ("model", "method", "domain", "attacker"))
    cache = Path(str(cfg.paths.cache_dir)).expanduser()
    return (f"cell: {cell} concept={cfg.get('concept') or '(domain default)'} seed={cfg.seed}\n"
            f"run dir: {out}\n"
            f"cache dir: {cache}" + (" (this cell's results are served from it)" if served else ""))


def execute(cfg: DictConfig, out: str | Path, ctx: Any = None, multirun: bool = False) -> dict | None:
    """Run a cell into ``out`` and report it (console and ``run.log``, then the configured
    logger): from ``ctx`` when the command line set it up already, else from ``cfg`` (a
    sweep's job). Errors: exit 2 for a user error, 130 on Ctrl-C; in a sweep, ``error.json``
    and a :class:`CellFailedError` for the launcher."""
    from emma import finished
    from emma.stages.setup import setup

    try:
        ctx = ctx if ctx is not None else setup(cfg)
        log.info(banner(cfg, out, served=ctx.finished is not None))
        if ctx.finished is not None:  # same inputs as a finished cell: no pipeline, not even torch
            from emma.loggers import log_cell
            from emma.results import CellResult

            data = json.loads(finished.serve(ctx.finished, out).read_text())
            log.info(finished.describe_json(data))
            log.info(f"results: {Path(out) / 'results.json'} (finished cell served from the cache, "
                     f"key {ctx.finished.name[:12]})")
            log_cell(cfg, CellResult.from_json(data), out)  # the logger of this run, as for a computed cell
            return _metric_values(data)
        from emma.cell import describe, run_stages

        result = run_stages(ctx, out)
    except KeyboardInterrupt:
        _interrupted(cfg, out)
    except Exception as err:
        if multirun:
            # one cell of a sweep: record and raise, so the launcher lists it and goes on
            # (sys.exit would take a submitit job down without its reason)
            _write_error(out, err)
            cause = _user_error(err) or err
            raise CellFailedError(f"{type(cause).__name__}: {cause}") from err
        if (user := _user_error(err)) is not None:
            # a component refused its configuration: show its own message, not a traceback
            _exit_with(user)
        raise
    from emma.loggers import log_cell

    log_cell(cfg, result, out)  # never raises: results.json is already written
    log.info(describe(result))
    log.info(f"results: {Path(out) / 'results.json'}")
    return {k: v.value for k, v in result.metrics.items()}


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> dict | None:
    """Hydra's entry: the jobs of a sweep, and commands with Hydra's own flags."""
    from hydra.types import RunMode

    hc = HydraConfig.get()
    out = hc.runtime.output_dir
    multirun = hc.mode == RunMode.MULTIRUN
    with contextlib.ExitStack() as claimed:
        _claim_or_exit(claimed, out, list(hc.overrides.task))
        return _job(cfg, out, multirun)


def _claim_or_exit(stack: contextlib.ExitStack, out: str | Path, overrides: list[str]) -> None:
    """Claim the run directory for the rest of ``stack`` (:func:`claim_run_dir`), or exit 2 with
    a one-line error naming the cell that holds it."""
    try:
        stack.enter_context(claim_run_dir(out, " ".join(overrides)))
    except EmmaError as err:
        _exit_with(err)


def _exit_with(err: EmmaError) -> None:
    """Print the harness error ``err`` as ``error: ...`` and exit with its code
    (:attr:`EmmaError.exit_code`: 2 a user error, 3 a full disk)."""
    _close_progress_bars()
    print(f"error: {err}", file=sys.stderr)
    sys.exit(err.exit_code)


def _close_progress_bars() -> None:
    """End the progress bars a failed stage left open, so that the error starts its own line."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", None) or []):
        with contextlib.suppress(Exception):
            bar.close()


#: The parts of a cell's config that set its numbers (paths, logger, threads and the like do not).
SETTING_KEYS = ("model", "method", "domain", "attacker", "protocol", "classifier", "metrics", "concept", "seed",
                "images_per_prompt", "prompt_types")


def changed_settings(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for every setting (:data:`SETTING_KEYS`, dotted paths) in which the
    config a finished cell recorded differs from the one that would run it now (secrets redacted
    on both sides, as results.json stores them)."""
    from emma.results import redact

    def flat(obj: Any, prefix: str) -> dict[str, Any]:
        if isinstance(obj, dict):
            return {k: v for key, val in obj.items() for k, v in flat(val, f"{prefix}.{key}").items()} or {prefix: {}}
        return {prefix: obj}

    old, new = {}, {}
    for key in SETTING_KEYS:
        old.update(flat(recorded.get(key), key))
        new.update(flat(redact(current.get(key)), key))
    return [f"{k}: {old.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}"
            for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]


#: Components whose code carries a ``version`` that moves with their numbers (CHANGELOG).
VERSIONED_KEYS = ("method", "attacker")


def changed_versions(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key version: old -> new`` for each component (:data:`VERSIONED_KEYS`) whose class
    version differs from the one a finished cell recorded in ``versions.components``: its code
    changed the numbers since. A target that no longer imports is left to the run to report."""
    from hydra.utils import get_class

    comps = recorded.get("components") or {}
    out = []
    for key in VERSIONED_KEYS:
        target = (current.get(key) or {}).get("_target_")
        old = (comps.get(key) or {}).get("version")
        if not target or old is None:
            continue
        try:
            new = getattr(get_class(target), "version", None)
        except (ImportError, ValueError, AttributeError):
            continue
        if new is not None and str(new) != str(old):
            out.append(f"{key} version: {old!r} -> {str(new)!r}")
    return out


def _job(cfg: DictConfig, out: str, multirun: bool) -> dict | None:
    done = Path(out) / "results.json"
    overwrite = bool(cfg.get("overwrite", False))
    if multirun and done.exists() and not overwrite:
        # re-running a sweep resumes it: a finished cell keeps its results.json untouched; one
        # that is not a finished cell's results (a truncated or foreign file) runs again over it
        from emma.results import CellResult

        try:
            kept = CellResult.load(done)
        except (EmmaError, ValueError, TypeError, KeyError) as err:
            print(f"warning: {done} is not a finished cell's results ({first_line(err)}); "
                  "running the cell again", file=sys.stderr)
            overwrite = True
        else:
            current = OmegaConf.to_container(cfg, resolve=True)
            changed = changed_settings(kept.config, current) + changed_versions(kept.versions, current)
            if not changed:
                log.info(f"results: {done} (finished cell of this sweep, kept)")
                return {k: v.value for k, v in kept.metrics.items()}
            # a preset or config changed since the cell ran: keeping it would report old settings
            shown = "; ".join(changed[:3]) + (f"; {len(changed) - 3} more" if len(changed) > 3 else "")
            print(f"warning: {done} was measured with other settings ({shown}); running the cell again",
                  file=sys.stderr)
            overwrite = True
    try:
        check_output_dir(out, overwrite)
    except EmmaError as err:
        _exit_with(err)
    return execute(cfg, out, multirun=multirun)


def run_one(overrides: list[str]) -> None:
    """One cell from the command line: composed once, looked up once, validated once (unless
    finished) and its components built — all before Hydra makes the run directory, where the
    stages then run (:func:`hydra.core.utils.run_job`, as ``@hydra.main`` runs a job)."""
    from hydra._internal.callbacks import Callbacks  # no public way to run one composed job
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import run_job
    from hydra.types import HydraContext, RunMode
    from omegaconf import open_dict

    from emma.stages.setup import build_components, setup

    with registry.hydra_context():
        full = validate_overrides(overrides, defer=True)
        cfg = without_hydra(full)
        try:
            ctx = setup(cfg, build=False)  # lookup and validation: cheap
            check_output_dirs(overrides, multirun=False)  # before the judges' weights load
            if ctx.finished is None:
                build_components(ctx)
        except Exception as err:
            if _user_error(err) is None:
                raise
            raise _user_error(err) from None
        with open_dict(full):
            full.hydra.mode = RunMode.RUN
        with contextlib.ExitStack() as claimed:
            try:  # the run directory, fixed now: claimed before Hydra writes its .hydra/ there
                run_dir = str(OmegaConf.select(full, "hydra.run.dir", throw_on_missing=True))
            except Exception:  # noqa: BLE001 - a resolver that needs a running job: claimed in it
                run_dir = None
            if run_dir is not None:
                with open_dict(full):
                    full.hydra.run.dir = run_dir
                _claim_or_exit(claimed, run_dir, overrides)
            job = run_job(hydra_context=HydraContext(config_loader=GlobalHydra.instance().config_loader(),
                                                     callbacks=Callbacks(full)),
                          task_function=lambda task_cfg: _run_task(task_cfg, ctx, run_dir is not None),
                          config=full, job_dir_key="hydra.run.dir", job_subdir_key=None)
    job.return_value  # noqa: B018 - re-raises the task's exception


def _run_task(cfg: DictConfig, ctx: Any, claimed: bool) -> dict | None:
    hc = HydraConfig.get()
    out = hc.runtime.output_dir
    with contextlib.ExitStack() as stack:
        if not claimed:
            _claim_or_exit(stack, out, list(hc.overrides.task))
        try:
            check_output_dir(out, bool(cfg.get("overwrite", False)))
        except EmmaError as err:
            _exit_with(err)
        return execute(cfg, out, ctx)


def scale_alias(argv: list[str]) -> list[str]:
    """``scale=sd`` -> ``scale@_global_=sd``: the model scale whose presets apply
    (conf/preset/README.md); Hydra needs the package in the override's key."""
    out = []
    for arg in argv:
        if arg.startswith("scale="):
            value = arg.split("=", 1)[1]
            for choice in value.split(","):
                registry.check_choice("scale", choice)
            arg = "scale@_global_=" + value
        out.append(arg)
    return out


def preflight(argv: list[str]) -> int:
    """Validate every cell of a sweep, or the choices of a command with Hydra's own flags,
    before Hydra starts (see :mod:`emma.validate`); the exit code (0: go on, 2: refused), the
    error printed to stderr."""
    try:
        argv = scale_alias(list(argv))
        overrides, multirun, checkable = split_argv(argv)
        if checkable:
            validate_overrides(overrides, multirun=multirun)
            check_output_dirs(overrides, multirun=multirun)
        else:  # Hydra flags (--cfg, --help, --config-name): let Hydra compose, check choices only
            check_overrides(argv)
    except EmmaError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return exit_codes.OK


def list_components(argv: list[str]) -> int:
    """``--list methods|attackers|domains|classifiers|models|...`` and ``--list concepts
    domain=D``: what exists, one choice a line."""
    rest = [a for a in argv if a != "--list"]
    what = rest[0] if rest and "=" not in rest[0] else ""
    domain = next((a.split("=", 1)[1] for a in rest if a.startswith("domain=")), None)
    try:
        if not what:
            raise UnknownChoiceError("listing", "", [*registry.LISTABLE, "concepts"], "--list")
        print(registry.listing(what, domain))
    except EmmaError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return exit_codes.OK


def show_sweep(argv: list[str]) -> int:
    """``-m ... --cfg job [--resolve]``: each cell's job configuration, with the sweep an
    experiment file declares, composed as its job would compose it (Hydra refuses ``--cfg``
    with ``-m``); nothing runs."""
    from omegaconf import OmegaConf

    from emma.validate import InvalidConfigError, Violation, cell_overrides, compose_cell

    rest = [a for a in argv if a not in ("-m", "--multirun", "--cfg", "-c", "job", "--resolve")]
    flag = next(i for i, a in enumerate(argv) if a in ("--cfg", "-c"))
    if any(a.startswith("-") for a in rest) or argv[flag + 1:flag + 2] != ["job"]:
        print("error: with -m, only --cfg job [--resolve] is supported", file=sys.stderr)
        return exit_codes.USER_ERROR
    try:
        overrides = scale_alias(rest)
        cells = cell_overrides(overrides, True)
        for i, cell in enumerate(cells):
            found: list[Violation] = []
            cfg = compose_cell(cell, found)
            if cfg is None:
                raise InvalidConfigError(found)
            swept = " ".join(o for o in cell if o not in overrides) or "(no swept key)"
            print(f"# cell {i + 1} of {len(cells)}: {swept}")
            print(OmegaConf.to_yaml(cfg, resolve="--resolve" in argv))
    except EmmaError as err:
        print(f"error: {err}", file=sys.stderr)
        return exit_codes.USER_ERROR
    return exit_codes.OK


def cli() -> None:
    from emma import startup

    startup.defer_gc()  # until the cell's model is loaded (the model stage)
    try:
        _cli(sys.argv[1:])
    finally:
        startup.end()


# Hydra's modes: one per command line (``-m --cfg job`` is the harness's own, :func:`show_sweep`)
HYDRA_MODES = {"--run": "--run", "-r": "--run", "--multirun": "-m", "-m": "-m", "--cfg": "--cfg",
               "-c": "--cfg", "--info": "--info", "-i": "--info", "--shell-completion": "--shell-completion",
               "-sc": "--shell-completion"}


def mode_conflict(argv: list[str]) -> str | None:
    """The one-line error for a command line with two of Hydra's modes (which Hydra reports
    with a traceback), or ``None``."""
    modes = list(dict.fromkeys(HYDRA_MODES[a] for a in argv if a in HYDRA_MODES))
    if len(modes) < 2 or set(modes) == {"-m", "--cfg"}:
        return None
    return (f"error: {' and '.join(modes)} cannot be combined; give one of --run, -m/--multirun, --cfg, "
            "--info, --shell-completion (or -m --cfg job to print a sweep's cells)")


def _cli(argv: list[str]) -> None:
    if "--list" in argv:
        sys.exit(list_components(argv))
    conflict = mode_conflict(argv)
    if conflict:
        print(conflict, file=sys.stderr)
        sys.exit(exit_codes.USER_ERROR)
    if any(a in ("--cfg", "-c") for a in argv) and any(a in ("-m", "--multirun") for a in argv):
        sys.exit(show_sweep(argv))
    try:
        overrides, multirun, checkable = split_argv(scale_alias(list(argv))) if argv else ([], False, True)
        if checkable and not multirun:
            run_one(overrides)
            return
        code = preflight(argv)
        if not code:
            sys.argv[1:] = scale_alias(argv) + registry.searchpath_override()
    except KeyboardInterrupt:
        print("interrupted before any cell started; nothing was written", file=sys.stderr)
        sys.exit(exit_codes.INTERRUPTED)
    except EmmaError as err:
        _exit_with(err)
    if code:
        sys.exit(code)
    main()


if __name__ == "__main__":
    cli()
