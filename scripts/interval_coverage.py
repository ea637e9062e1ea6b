"""Coverage of the intervals for clustered rates (EA, RA, ``asr/images``), by simulation.

    python scripts/interval_coverage.py                  # the table of docs/metrics.md
    python scripts/interval_coverage.py --cells 200      # a quick look

Each simulated cell has ``K`` prompts of ``m`` images; prompt ``c`` has its own rate
``p_c ~ Beta(p (1-rho)/rho, (1-p)(1-rho)/rho)`` (mean ``p``, intra-prompt correlation
``rho``; ``rho = 0``: every image independent) and ``s_c ~ Binomial(m, p_c)`` of its images
count. An interval covers when it holds ``p``, the rate over the population of prompts.
Methods:

- ``beta-binomial`` — the harness's interval (:func:`emma.metrics.intervals.clustered_rate`);
- ``before`` — the harness's interval before schema 3: a percentile cluster bootstrap over
  prompts (1000 replicates), Wilson over the K prompts when every replicate is equal;
- ``wilson-deff`` — Wilson with the effective sample size ``n / deff``, ``deff`` the
  cluster-robust variance of the ratio over the binomial one (clamped to [1, m]; 1 at 0/n
  and n/n, where both variances vanish);
- ``wilson-images`` — Wilson over the images as if independent.

The output is the Markdown table pasted into docs/metrics.md (coverage in %, then the mean
width of the interval).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from emma.metrics.intervals import beta_binomial_interval, wilson_interval  # noqa: E402

METHODS = ("beta-binomial", "before", "wilson-deff", "wilson-images")


def draw(rng: np.random.Generator, k: int, m: int, p: float, rho: float) -> np.ndarray:
    """Successes per prompt of one simulated cell."""
    if rho == 0:
        rates = np.full(k, p)
    else:
        t = (1 - rho) / rho
        rates = rng.beta(p * t, (1 - p) * t, size=k)
    return rng.binomial(m, rates)


def before(s: np.ndarray, m: int, rng_seed: int) -> tuple[float, float]:
    """The cluster bootstrap of schema 2 (seeded as the cell seeded it)."""
    k = len(s)
    idx = np.random.default_rng(rng_seed).integers(0, k, size=(1000, k))
    reps = s[idx].sum(axis=1) / (m * k)
    if np.ptp(reps) == 0:
        return wilson_interval(s.sum() / m, k)
    lo, hi = np.quantile(reps, [0.025, 0.975])
    return float(lo), float(hi)


def wilson_deff(s: np.ndarray, m: int) -> tuple[float, float]:
    k, n = len(s), m * len(s)
    p = s.sum() / n
    binomial = p * (1 - p) / n
    robust = k / (k - 1) * np.sum((s - p * m) ** 2) / n**2
    deff = min(max(robust / binomial, 1.0), float(m)) if binomial > 0 else 1.0
    n_eff = n / deff
    return wilson_interval(p * n_eff, n_eff)  # type: ignore[arg-type]


def intervals(s: np.ndarray, m: int) -> dict[str, tuple[float, float]]:
    return {"beta-binomial": beta_binomial_interval(s, np.full(len(s), m)),
            "before": before(s, m, 0),
            "wilson-deff": wilson_deff(s, m),
            "wilson-images": wilson_interval(int(s.sum()), m * len(s))}


def simulate(cells: int, k: int, m: int, p: float, rho: float, seed: int) -> dict[str, tuple[float, float]]:
    """Per method: (coverage, mean width) over ``cells`` simulated cells."""
    rng = np.random.default_rng(seed)
    hit = dict.fromkeys(METHODS, 0)
    width = dict.fromkeys(METHODS, 0.0)
    for _ in range(cells):
        for name, (lo, hi) in intervals(draw(rng, k, m, p, rho), m).items():
            hit[name] += lo <= p <= hi
            width[name] += hi - lo
    return {name: (hit[name] / cells, width[name] / cells) for name in METHODS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", type=int, default=1000, help="simulated cells per setting")
    ap.add_argument("--images", type=int, default=10, help="images per prompt (m)")
    ap.add_argument("--prompts", type=int, nargs="+", default=[3, 10, 30], help="prompts per cell (K)")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.02, 0.1, 0.5, 0.9, 0.98])
    ap.add_argument("--rho", type=float, nargs="+", default=[0.0, 0.3, 0.8], help="intra-prompt correlations")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    head = ["K prompts", "rho", "p"] + [f"{m} %" for m in METHODS] + [f"{m} width" for m in METHODS]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---:" for _ in head) + "|")
    worst = dict.fromkeys(METHODS, 1.0)
    all_cov: dict[str, list[float]] = {m: [] for m in METHODS}
    for i, (k, rho, p) in enumerate(itertools.product(args.prompts, args.rho, args.rates)):
        res = simulate(args.cells, k, args.images, p, rho, args.seed + i)
        for name, (cov, _) in res.items():
            worst[name] = min(worst[name], cov)
            all_cov[name].append(cov)
        print("| " + " | ".join([str(k), f"{rho:g}", f"{p:g}"]
                                + [f"{100 * res[name][0]:.1f}" for name in METHODS]
                                + [f"{res[name][1]:.3f}" for name in METHODS]) + " |", flush=True)
    print()
    print(f"{args.cells} simulated cells per setting, {args.images} images per prompt, nominal 95%; "
          f"{time.perf_counter() - t0:.0f} s.")
    for name in METHODS:
        cov = np.array(all_cov[name])
        print(f"- {name}: median coverage {100 * np.median(cov):.1f}%, lowest {100 * worst[name]:.1f}%, "
              f"settings below 90%: {int(np.sum(cov < 0.9))} of {len(cov)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
