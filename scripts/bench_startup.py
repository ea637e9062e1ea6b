"""Command to first image: seconds from ``python -m emma.run`` to the first image in the cache.

    python scripts/bench_startup.py                          # this checkout, 3 cold runs
    python scripts/bench_startup.py --before ../main-checkout   # and another one, side by side

Each run starts the default cell (the tiny world, ``method=none``) with an empty cache and
run directory, watches ``<cache>/images`` and stops the cell when the first image file lands
there: what it measures is interpreter start, imports, composition, validation, loading the
pipeline and judge, and the first generation batch. The median of the runs is reported, with
the CPU it ran on. Python's own byte-code cache is warmed once before (a first import after an
install compiles every module; that is not the cell's cost).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def first_image_s(checkout: Path, args: list[str], timeout: float = 300.0) -> float:
    """Seconds from starting the cell in ``checkout`` to its first cached image."""
    with tempfile.TemporaryDirectory(prefix="emma-bench-") as tmp:
        cache, run_dir = Path(tmp) / "cache", Path(tmp) / "run"
        env = {**os.environ, "EMMA_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(checkout)}
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "emma.run", *args, f"hydra.run.dir={run_dir}",
                                 f"paths.cache_dir={cache}"], cwd=checkout, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            while time.perf_counter() - t0 < timeout:
                images = cache / "images"
                if images.exists() and any(p.suffix == ".png" for p in images.rglob("*.png")):
                    return time.perf_counter() - t0
                if proc.poll() is not None:
                    raise RuntimeError(f"the cell ended before drawing an image: {proc.stderr.read()[-2000:]}")
                time.sleep(0.02)
            raise TimeoutError(f"no image after {timeout:.0f} s")
        finally:
            proc.kill()
            proc.wait()


def cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, help="another checkout of the harness, measured the same way")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("cell", nargs="*", help="overrides of the cell (default: the default cell)")
    args = ap.parse_args(argv)
    checkouts = ([("before", args.before.resolve())] if args.before else []) + [("after", ROOT)]
    for _, path in checkouts:  # compile every module once: a fresh install's one-time cost
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(path / "emma"), str(path / "classifiers")],
                       check=False, capture_output=True)
    times: dict[str, list[float]] = {name: [] for name, _ in checkouts}
    for _ in range(args.runs):  # interleaved, so that a busy machine weighs on both alike
        for name, path in checkouts:
            times[name].append(first_image_s(path, args.cell))
    print(f"command to first image, default cell{' ' + ' '.join(args.cell) if args.cell else ''}; "
          f"{cpu()}, {os.cpu_count()} CPUs; {args.runs} cold runs each (median, then every run)")
    width = max(len(n) for n in times)
    for name, ts in times.items():
        print(f"  {name:<{width}}  {statistics.median(ts):6.2f} s   [{', '.join(f'{t:.2f}' for t in ts)}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
