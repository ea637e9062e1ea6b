"""Command to first image: seconds from starting ``python -m emma.run`` to its first cached image.

    python scripts/bench_startup.py                                # this checkout, 5 cold runs
    python scripts/bench_startup.py --before ../main-checkout      # and another, side by side
    python scripts/bench_startup.py --before ../old --breakdown    # and where the imports go

What "first image" means here, exactly: the clock starts just before the child process is
spawned (``python -m emma.run <cell> hydra.run.dir=<tmp> paths.cache_dir=<tmp>``, with
``PYTHONPATH`` set to the checkout) and stops at the first poll (every 20 ms) that finds a
``*.png`` file anywhere under ``<cache>/images``. The image cache writes each PNG to a
temporary name and renames it into place, so that file is a complete, decodable image: the
first image of the cell's first generation batch (the default cell draws its base-model bias
images first, 16 in one batch). The time covers interpreter start, imports, Hydra's
composition, validation, the finished-cell lookup, building the domain, judges and method,
loading and fingerprinting the pipeline, and that whole first batch. The child is then killed.

Every run is cold in the harness's sense: a new, empty cache and run directory. Python's own
byte-code cache is warmed once before (a first import after an install compiles every module,
which is not the cell's cost), and the operating system's file cache is whatever it is.

The checkouts run interleaved, their order alternating from round to round (ABBA...), so that a
machine whose load drifts weighs on both alike. Each run gets ``--threads`` intra-op threads
(``OMP_NUM_THREADS``/``MKL_NUM_THREADS``; default 1: this project's 2-core machine runs a
training on the other core, and two threads there measure the contention more than the code).
Reported per checkout: the median, the range and the interquartile range of its runs; with
``--before``, the ratio of the medians (after / before) and the median of the per-round
differences (the paired comparison, robust to slow drifts of the machine's load).

``--breakdown`` adds one run per checkout under ``python -X importtime`` and reports the
seconds spent importing each top-level package before the first image (the sum of the
modules' own times, which importtime inflates by a few percent); the rest of the time is
Hydra composition, validation, loading weights and the first batch itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def first_image(checkout: Path, args: list[str], *, threads: int = 1, importtime: bool = False,
                timeout: float = 300.0) -> tuple[float, str]:
    """Seconds from starting the cell in ``checkout`` to its first cached image, and the
    child's stderr up to then (its ``-X importtime`` report when ``importtime``)."""
    with tempfile.TemporaryDirectory(prefix="emma-bench-") as tmp:
        cache, run_dir, err_path = Path(tmp) / "cache", Path(tmp) / "run", Path(tmp) / "stderr"
        env = {**os.environ, "EMMA_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(checkout)}
        if threads:
            env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        command = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "emma.run", *args,
                   f"hydra.run.dir={run_dir}", f"paths.cache_dir={cache}"]
        images = cache / "images"
        with open(err_path, "w") as err:
            t0 = time.perf_counter()
            proc = subprocess.Popen(command, cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=err)
            try:
                while time.perf_counter() - t0 < timeout:
                    if images.exists() and next(images.rglob("*.png"), None) is not None:
                        return time.perf_counter() - t0, err_path.read_text(errors="replace")
                    if proc.poll() is not None:
                        raise RuntimeError(f"the cell in {checkout} ended before drawing an image:\n"
                                           f"{err_path.read_text(errors='replace')[-2000:]}")
                    time.sleep(0.02)
                raise TimeoutError(f"no image after {timeout:.0f} s")
            finally:
                proc.kill()
                proc.wait()


def import_seconds(report: str) -> dict[str, float]:
    """Seconds of ``-X importtime`` self time per top-level package, largest first."""
    totals: dict[str, float] = defaultdict(float)
    for line in report.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        try:
            self_us, _, name = line[len("import time:"):].split("|")
            seconds = int(self_us) / 1e6
        except ValueError:  # a line of the cell's own output, interleaved
            continue
        totals[name.strip().split(".")[0]] += seconds
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def spread(ts: list[float]) -> str:
    """``min-max, IQR x`` of a list of run times."""
    q = statistics.quantiles(ts, n=4) if len(ts) >= 2 else [ts[0]] * 3
    return f"range {min(ts):.2f}-{max(ts):.2f}, IQR {q[2] - q[0]:.2f}"


def cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def load_average() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, help="another checkout of the harness, measured the same way")
    ap.add_argument("--runs", type=int, default=5, help="cold runs per checkout (default 5)")
    ap.add_argument("--threads", type=int, default=1,
                    help="OMP/MKL threads of each run (default 1; 0 leaves the environment's)")
    ap.add_argument("--breakdown", action="store_true", help="one more run each under -X importtime")
    ap.add_argument("cell", nargs="*", help="overrides of the cell (default: the default cell)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs must be at least 1, got {args.runs}")
    checkouts = ([("before", args.before.resolve())] if args.before else []) + [("after", ROOT)]
    for name, path in checkouts:
        if not (path / "emma" / "run.py").is_file():
            ap.error(f"{name} checkout {path} has no emma/run.py")
        # compile every module once: a fresh install's one-time cost
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(path / "emma"), str(path / "classifiers")],
                       check=False, capture_output=True)
    times: dict[str, list[float]] = {name: [] for name, _ in checkouts}
    loads = [load_average()]
    for r in range(args.runs):  # interleaved, alternating order: a drifting load weighs on both alike
        for name, path in (checkouts if r % 2 == 0 else checkouts[::-1]):
            times[name].append(first_image(path, args.cell, threads=args.threads)[0])
        loads.append(load_average())
    print(f"command to first image, {' '.join(args.cell) or 'default cell'}; {cpu()}, {os.cpu_count()} CPUs, "
          f"{args.threads or 'default'} thread(s) per run; load average {loads[0]} at start, {' '.join(loads[1:])} "
          f"after each round; {args.runs} cold runs each, interleaved")
    width = max(len(n) for n in times)
    for name, ts in times.items():
        print(f"  {name:<{width}}  median {statistics.median(ts):6.2f} s  ({spread(ts)})  "
              f"runs [{', '.join(f'{t:.2f}' for t in ts)}]")
    if args.before:
        before, after = times["before"], times["after"]
        deltas = [a - b for a, b in zip(after, before)]
        print(f"  after / before = {statistics.median(after) / statistics.median(before):.3f} (medians); "
              f"paired after - before: median {statistics.median(deltas):+.2f} s, "
              f"range {min(deltas):+.2f} to {max(deltas):+.2f}")
    if args.breakdown:
        print("imports before the first image, seconds of -X importtime self time by top-level package:")
        for name, path in checkouts:
            seconds, report = first_image(path, args.cell, threads=args.threads, importtime=True)
            packages = import_seconds(report)
            top = ", ".join(f"{pkg} {s:.2f}" for pkg, s in list(packages.items())[:10])
            print(f"  {name:<{width}}  first image {seconds:.2f} s, imports {sum(packages.values()):.2f} s: {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
