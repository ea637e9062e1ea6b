"""The exit codes of the harness's commands (``python -m emma.run``, ``leaderboards.build``,
``emma.weights``, ``emma.suites``, ``leaderboards.stace_tables``, ``leaderboards.wandb_read``).

The README's table "Exit codes" lists the same codes with their meaning;
``tests/test_exit_codes.py`` checks that the two agree and that the commands return these
constants, never a bare number. Standard library only.
"""

from __future__ import annotations

#: the cell (or every cell of a sweep, or the command) finished
OK = 0
#: an unexpected error: a bug in the harness, printed with its traceback (please report it)
BUG = 1
#: a sweep ran to its end but some of its cells failed (each has ``error.json``; the sweep's
#: ``sweep_report.json`` lists them); Hydra's own code for a failed multirun
CELLS_FAILED = 1
#: bad input, refused in one line without a traceback (before any work where it can be known
#: then): a bad setting, a Hydra composition error, missing weights, a run directory in use or
#: holding results, a NaN checkpoint, a failing LLM backend, an unreadable result file
USER_ERROR = 2
#: no space left on the device (or the disk quota is full) while storing a file: the message
#: names the path and, where known, the space needed; nothing half-written is left; free space
#: and run the same command again (everything finished is in the cache)
DISK_FULL = 3
#: ``leaderboards.build --wandb``: the leaderboard files are complete, publishing them failed
PUBLISH_FAILED = 4
#: interrupted (Ctrl-C / SIGINT): the cache keeps everything finished; run again to resume
INTERRUPTED = 130

#: every code above, by name
CODES: dict[str, int] = {
    "OK": OK, "BUG": BUG, "CELLS_FAILED": CELLS_FAILED, "USER_ERROR": USER_ERROR, "DISK_FULL": DISK_FULL,
    "PUBLISH_FAILED": PUBLISH_FAILED, "INTERRUPTED": INTERRUPTED,
}
