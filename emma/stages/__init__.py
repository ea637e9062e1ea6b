"""The stages of a cell, one module each, over one :class:`~emma.stages.context.CellContext`.

``setup`` (:mod:`emma.stages.setup`) builds the context: finished-cell lookup, validation,
components; each later stage reads what earlier stages filled and fills its own part.
:data:`emma.cell.STAGES` lists them in order and :func:`emma.cell.run_cell` is the loop.
Scripts and tests that need part of a cell call the stages they need (``setup`` +
``load_model`` + ``erase`` gives an erased model and its generator).

This package imports nothing itself: serving a finished cell imports ``setup`` alone, and
with it no torch.
"""
