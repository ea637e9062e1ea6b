"""STACE's metrics (§3.4), as pure functions of per-iteration records.

- ``SIR_H`` (Eq. 4): share of the N hypotheses with at least one image showing the concept;
  hypotheses are independent trials: Wilson 95% (:func:`emma.metrics.intervals.proportion`).
- ``SIR_I`` (Eq. 5): share of the N·k images showing the concept. An instantiation that was
  never rendered (a failed execution, a program that requested fewer than k images) counts
  as not showing it, so the denominator is always N·k. The k images of one hypothesis are
  correlated, so the interval treats hypotheses as clusters (the beta-binomial
  profile-likelihood interval; Wilson where every image is its own cluster), as the harness
  does for images of one prompt (:func:`emma.metrics.intervals.clustered_rate`).
- ``EII`` (Eq. 6): the first (1-based) iteration whose hypothesis succeeded; ``N + 1`` when
  none did (the paper's convention: Table B3 enters 11 for N = 10, and averages it).
- ``SER`` (§3.4.3): share of iterations whose hypothesis was executed successfully; Wilson.
- ``Nov(H)`` (Eq. 7): mean over hypotheses of ``1 - max_P cos(H, P)``, with a seeded
  percentile bootstrap over hypotheses.

Every value with an interval names its ``method``; a value without one has a ``note``.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from emma.metrics.base import MetricValue, bootstrap_ci
from emma.metrics.intervals import MIN_CLUSTERS, clustered_rate, proportion

BOOTSTRAP = "bootstrap-percentile"
EII_NONE_NOTE = "no hypothesis was effective: EII = N + 1 (the STACE paper's convention, Table B3)"


def wilson(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float | None, float | None]:
    """95% Wilson score interval of ``successes`` out of ``n`` (``(None, None)`` for n = 0)."""
    if n <= 0:
        return (None, None)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # with no (all) successes the bound is exactly 0 (1); the formula leaves rounding residue
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return (lo, hi)


def _rate(flags: Sequence[bool]) -> MetricValue:
    """A rate of independent trials (Wilson), with exact bounds at 0/n and n/n."""
    m = proportion([bool(f) for f in flags])
    if m.ci_low is not None:
        m.ci_low, m.ci_high = wilson(round(m.value * m.n), m.n)
    return m


def sir_h(success: Sequence[bool]) -> MetricValue:
    return _rate(success)


def sir_i(detected_per_iteration: Sequence[int], k: int, seed: int = 0) -> MetricValue:
    """Detected images over N·k, each hypothesis a cluster of its k instantiations."""
    outcomes: list[bool] = []
    clusters: list[int] = []
    for i, d in enumerate(detected_per_iteration):
        d = int(d)
        if not 0 <= d <= int(k):
            raise ValueError(f"iteration {i + 1}: {d} detected images, but k = {k}")
        outcomes += [True] * d + [False] * (int(k) - d)
        clusters += [i] * int(k)
    if not outcomes:
        return MetricValue(value=float("nan"), n=0, n_clusters=0, note="no iteration ran")
    if int(k) == 1:
        return _rate(outcomes)
    return image_rate(outcomes, clusters, seed=seed)


def image_rate(outcomes: Sequence[bool], clusters: Sequence[object], seed: int = 0) -> MetricValue:
    """A rate over images grouped in clusters (the images of one prompt or hypothesis): Wilson
    when every image is its own cluster (independent trials), else the beta-binomial
    profile-likelihood interval over clusters."""
    if len(set(clusters)) == len(clusters) == len(outcomes):
        return _rate(outcomes)
    m = clustered_rate([bool(o) for o in outcomes], list(clusters), seed=seed)
    if m.ci_low is not None:  # exact bounds at 0 and 1 (the score formula leaves rounding residue)
        m.ci_low = 0.0 if m.value == 0 else m.ci_low
        m.ci_high = 1.0 if m.value == 1 else m.ci_high
    return m


def eii(success: Sequence[bool], n_iterations: int | None = None) -> int:
    """The first effective iteration (1-based); ``N + 1`` when none was, ``N`` being the
    run's configured iterations (default: the iterations recorded)."""
    for i, s in enumerate(success, start=1):
        if s:
            return i
    return int(n_iterations if n_iterations is not None else len(success)) + 1


def eii_value(success: Sequence[bool], n_iterations: int | None = None) -> MetricValue:
    """:func:`eii` as a result value: no interval (one run gives one first success)."""
    value = eii(success, n_iterations)
    found = any(success)
    return MetricValue(value=value, n=len(success),
                       note=None if found else EII_NONE_NOTE)


def mean_eii(values: Sequence[int | float | None], n_iterations: int = 10) -> float:
    """The average EII over runs (concepts), as the paper's tables average it: a run with no
    effective hypothesis (``None`` in older results) enters as ``N + 1``."""
    vals = [float(n_iterations + 1 if v is None else v) for v in values]
    if not vals:
        raise ValueError("no EII values to average")
    return sum(vals) / len(vals)


def ser(executed: Sequence[bool]) -> MetricValue:
    return _rate(executed)


def novelty(scores: Sequence[float | None], seed: int = 0) -> MetricValue | None:
    """Mean novelty over hypotheses, 95% percentile bootstrap over hypotheses."""
    vals = [float(s) for s in scores if s is not None]
    if not vals:
        return None
    value = sum(vals) / len(vals)
    if len(vals) < MIN_CLUSTERS:
        return MetricValue(value=value, n=len(vals), n_clusters=len(vals),
                           note="fewer than 2 hypotheses: no interval")
    lo, hi = bootstrap_ci(np.asarray(vals), seed=seed)
    return MetricValue(value=value, ci_low=lo, ci_high=hi, n=len(vals), method=BOOTSTRAP, n_clusters=len(vals))
