"""``python -m emma.run``: run one cell (or a Hydra multirun sweep of cells).

    python -m emma.run                                    # the tiny world, offline, on a CPU
    python -m emma.run method=esd concept=circle
    python -m emma.run -m method=none,esd,uce domain=tinyworld,tinyworld_style

Exit codes: 0 done; 2 a user error (bad setting, missing weights, a run directory that already
holds results), reported in a few lines without a traceback, before any work where it can be
known then; 130 interrupted (Ctrl-C; the cache keeps every finished image); 1 a bug.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from emma.config import GROUPS, register_configs
from emma.errors import EmmaError, UnknownChoiceError
from emma.validate import check_output_dir, check_output_dirs, split_argv, validate_overrides

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
log = logging.getLogger("emma.run")


def group_choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_overrides(argv: list[str]) -> None:
    """Reject an unknown choice of a config group before Hydra composes anything, with the
    valid choices and a "did you mean" (Hydra's own message is a long traceback-like text)."""
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key not in GROUPS or key == "experiment" and value in ("null", ""):
            continue
        valid = group_choices(key)
        for choice in value.split(","):  # multirun: method=esd,uce
            if choice and choice != "null" and choice not in valid:
                raise UnknownChoiceError(key, choice, valid)


register_configs()


class CellFailedError(Exception):
    """A sweep cell's failure, carried as text: the launcher unpickles it in another process,
    where an error class with a richer constructor would not rebuild."""


def _write_error(out: str | Path, err: BaseException) -> None:
    """``error.json`` next to where results.json would be: the sweep report and the
    leaderboard show it (a crashed cell is listed, never silently missing)."""
    import json
    import traceback

    from emma.cache import atomic_write_text

    atomic_write_text(Path(out) / "error.json", json.dumps({
        "error": f"{type(err).__name__}: {err}",
        "traceback": "".join(traceback.format_exception(err))[-8000:],
    }, indent=2) + "\n")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> dict | None:
    from hydra.errors import InstantiationException
    from hydra.types import RunMode

    from emma import finished

    hc = HydraConfig.get()
    out = hc.runtime.output_dir
    multirun = hc.mode == RunMode.MULTIRUN
    done = Path(out) / "results.json"
    if multirun and done.exists() and not cfg.get("overwrite", False):
        # re-running a sweep resumes it: a finished cell keeps its results.json untouched
        data = json.loads(done.read_text())
        print(f"results: {done} (finished cell of this sweep, kept)")
        return {k: v["value"] for k, v in data["metrics"].items()}
    try:
        check_output_dir(out, bool(cfg.get("overwrite", False)))
    except EmmaError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    from emma.loggers import log_cell

    try:
        # the finished-cell key hashes local weight files: a missing one fails here, recorded
        # like any other failure of the cell
        hit = finished.lookup(cfg, out)
        if hit is not None:  # a finished cell with the same inputs: no pipeline, no heavy imports
            data = json.loads(hit.read_text())
            print(finished.describe_json(data))
            print(f"results: {hit} (finished cell served from the cache)")
            return {k: v["value"] for k, v in data["metrics"].items()}
        from emma.cell import describe, run_cell

        result = run_cell(cfg, out)
    except KeyboardInterrupt:
        cache = Path(str(cfg.paths.cache_dir)).expanduser()
        print(f"interrupted: no results.json was written to {out}; every image, score and erased model "
              f"finished so far is kept in the cache {cache}; run the same command again to resume",
              file=sys.stderr)
        sys.exit(130)
    except Exception as err:
        cause = err.__cause__ if isinstance(err, InstantiationException) else err
        if multirun:
            # one cell of a sweep: record and raise, so the launcher lists it and goes on
            # (sys.exit would take a submitit job down without its reason)
            _write_error(out, err)
            raise CellFailedError(f"{type(cause).__name__}: {cause}") from err
        if isinstance(cause, EmmaError):
            # a component refused its configuration: show its own message, not a traceback
            print(f"error: {cause}", file=sys.stderr)
            sys.exit(2)
        raise
    log_cell(cfg, result, out)  # never raises: results.json is already written
    print(describe(result))
    print(f"results: {Path(out) / 'results.json'}")
    return {k: v.value for k, v in result.metrics.items()}


def scale_alias(argv: list[str]) -> list[str]:
    """``scale=sd`` -> ``scale@_global_=sd``: the model scale whose presets apply
    (conf/preset/README.md); Hydra needs the package in the override's key."""
    out = []
    for arg in argv:
        if arg.startswith("scale="):
            value = arg.split("=", 1)[1]
            valid = group_choices("scale")
            for choice in value.split(","):
                if choice not in valid:
                    raise UnknownChoiceError("scale", choice, valid)
            arg = "scale@_global_=" + value
        out.append(arg)
    return out


def preflight(argv: list[str]) -> int:
    """Validate every cell of the command line before Hydra starts (see :mod:`emma.validate`);
    the exit code (0: go on, 2: refused), the error printed to stderr."""
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
        return 2
    return 0


def cli() -> None:
    try:
        code = preflight(sys.argv[1:])
        if not code:
            sys.argv[1:] = scale_alias(sys.argv[1:])
    except KeyboardInterrupt:
        print("interrupted before any cell started; nothing was written", file=sys.stderr)
        sys.exit(130)
    if code:
        sys.exit(code)
    main()


if __name__ == "__main__":
    cli()
