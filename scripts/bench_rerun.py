"""First run of a cell vs its re-run on a warm cache, measured side by side in one process.

    python scripts/bench_rerun.py                      # the default cell (tiny world)
    python scripts/bench_rerun.py model=tiny_random classifier=tinyworld classifier.weights=null

Prints both wall times, the images each generated, and the speed-up (target >= 20x).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402

from emma.cell import run_cell  # noqa: E402
from emma.config import register_configs  # noqa: E402


def main(overrides: list[str]) -> None:
    register_configs()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["EMMA_CACHE"] = str(Path(tmp) / "cache")
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        times, generated = [], []
        for run in ("first", "rerun"):
            t0 = time.perf_counter()
            result = run_cell(cfg, Path(tmp) / run)
            times.append(time.perf_counter() - t0)
            generated.append(result.counts["images_generated"])
    print(f"cell: {' '.join(overrides) or '(defaults)'}")
    print(f"first run: {times[0]:8.2f} s, images generated {generated[0]}")
    print(f"re-run:    {times[1]:8.2f} s, images generated {generated[1]}")
    print(f"speed-up:  {times[0] / times[1]:8.1f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
