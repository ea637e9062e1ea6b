"""Hydra launchers for EMMA sweeps (``hydra/launcher=slurm`` and ``hydra/launcher=local``).

They are hydra-submitit-launcher's launchers with one change: a job that ends without a
result (a cell that raised, a job cancelled with ``scancel``, killed for memory, or out of
requeues) no longer stops the collection of the others. Every job is waited for, the sweep
writes ``sweep_report.json`` into the sweep folder and logs one line per failed cell with its
error, and only then does Hydra fail the multirun (exit code 1).

Hydra accepts launcher classes only from the ``hydra_plugins`` namespace, hence this package.
"""
