"""First run of a cell vs its re-runs, each a separate ``python -m emma.run`` process timed
end to end (interpreter start, imports, compose, run, write).

    python scripts/bench_rerun.py                      # the default cell (tiny world)
    python scripts/bench_rerun.py metrics=rates_only images_per_prompt=2

Three processes share a fresh cache: the first run; a re-run of the finished cell (served
from ``<cache>/results`` without loading a pipeline; target <= 4 s); and a re-run with
``paths.reuse_results=false`` that recomputes every metric from the image and score caches.
Prints the wall times (and CPU seconds, which a loaded machine inflates less), the images
each generated, whether the results files match the first
run's metrics, and the speed-up ratios.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(overrides: list[str], run_dir: Path, cache: Path) -> tuple[float, float, dict]:
    env = {**os.environ, "EMMA_CACHE": str(cache), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "emma.run", *overrides, f"hydra.run.dir={run_dir}"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)
    if proc.returncode != 0:
        sys.exit(f"run failed ({run_dir.name}):\n{proc.stderr[-3000:]}")
    return wall, cpu, json.loads((run_dir / "results.json").read_text())


def main(overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        first_s, first_cpu, first = run(overrides, Path(tmp) / "first", cache)
        served_s, served_cpu, served = run(overrides, Path(tmp) / "served", cache)
        replay_s, replay_cpu, replay = run([*overrides, "paths.reuse_results=false"], Path(tmp) / "replay", cache)
    print(f"cell: {' '.join(overrides) or '(defaults)'}")
    print(f"first run:             {first_s:8.2f} s ({first_cpu:.2f} s CPU), "
          f"images generated {first['counts']['images_generated']}")
    print(f"finished-cell re-run:  {served_s:8.2f} s ({served_cpu:.2f} s CPU), "
          f"results.json metrics equal: {served['metrics'] == first['metrics']}")
    print(f"recomputed from cache: {replay_s:8.2f} s ({replay_cpu:.2f} s CPU), "
          f"images generated {replay['counts']['images_generated']}, "
          f"metrics equal: {replay['metrics'] == first['metrics']}")
    print(f"speed-up (first / finished re-run):  {first_s / served_s:8.1f}x")
    print(f"speed-up (first / recomputed):       {first_s / replay_s:8.1f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
