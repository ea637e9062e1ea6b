"""The command line's start-up: Python's cyclic garbage collector paused while it imports.

Importing torch, diffusers and transformers (what a cell needs before its first image) creates
about a million Python objects. With CPython's default thresholds (a young collection every
700 net allocations, older ones every 10 of those) the collector runs over a thousand times
while they import, its full collections traversing everything imported so far; on this
project's 2-core machine that was about 15% of the import time, and it frees nearly nothing
(what an import creates lives as long as the process).

:func:`defer_gc` raises the young generation's threshold while the command starts, and
:func:`restore_gc` puts the thresholds back once the cell's model is loaded (the ``model``
stage), moving everything alive then into the collector's permanent generation
(``gc.freeze``): the modules, the configuration and the model live as long as the cell, and
later full collections no longer traverse them (otherwise one comes due during the first
generation batch and walks the million import-time objects). :func:`end` unfreezes them when
the cell ends (or the command), so that what a cell drops can be collected: a sweep's later
cells in the same process, a test session that runs the command line again.

Only *when* unreachable reference cycles are freed changes: no image, score or number
depends on it. Memory stays bounded: young collections still run (every 100,000
allocations), objects without cycles are freed at once as always, and the cycles alive at the
freeze (a few hundred small objects for the default cell) wait for :func:`end`. Only the
command line defers and freezes; a library caller's stages leave the collector alone.
"""

from __future__ import annotations

import gc

START_THRESHOLDS = (100_000, 50, 1_000)
"""``gc.set_threshold`` while the command starts: a young collection every 100,000 net
allocations, an older one every 50 of those, a full one every 1,000 older ones."""

_saved: tuple[int, int, int] | None = None
_frozen = False


def defer_gc() -> None:
    """Collect rarely from now until :func:`restore_gc` (idempotent; the thresholds in force
    now are the ones restored)."""
    global _saved
    if _saved is None:
        _saved = gc.get_threshold()
        gc.set_threshold(*START_THRESHOLDS)


def restore_gc() -> None:
    """Freeze what is alive and put back the thresholds of :func:`defer_gc` (no-op without it,
    e.g. when a library caller runs the ``model`` stage)."""
    global _saved, _frozen
    if _saved is not None:
        gc.freeze()
        _frozen = True
        gc.set_threshold(*_saved)
        _saved = None


def end() -> None:
    """The cell (or the command) is over: thresholds restored, and what :func:`restore_gc` froze
    can be collected again."""
    global _frozen
    restore_gc()
    if _frozen:
        gc.unfreeze()
        _frozen = False


def gc_deferred() -> bool:
    """Whether :func:`defer_gc` is in force."""
    return _saved is not None
