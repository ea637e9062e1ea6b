"""Confidence intervals for the harness's metrics (docs/metrics.md states each formula).

* :func:`wilson_interval`: a proportion of *independent* trials (prompt-level ASR, a rate of
  single images of distinct prompts). Wilson's score interval (Wilson 1927) keeps a non-zero
  width at 0/n and n/n, where a percentile bootstrap collapses to a point.
* :func:`cluster_bootstrap_ratio`: a rate over images where the images of one prompt are
  correlated (same prompt, different seeds). Whole prompts (clusters) are resampled with
  replacement and the ratio of summed successes to summed images is recomputed; the
  percentile interval of those replicates is reported. When every replicate is equal (the
  observed rate is 0 or 1) the bootstrap carries no information, and the Wilson interval over
  the clusters (the smallest effective sample size a clustered design can have) is used.
* Fewer than :data:`MIN_CLUSTERS` prompts: no interval, and a note saying so.

Every interval is 95% by default, two-sided, and seeded so a result file is reproducible.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
from scipy.stats import norm

from emma.metrics.base import MetricValue

MIN_CLUSTERS = 2
WILSON = "wilson"
CLUSTER_BOOTSTRAP = "cluster-bootstrap-percentile"
WILSON_CLUSTERS = "wilson-over-clusters"
FEW_CLUSTERS_NOTE = ("fewer than 2 prompts: no interval (an interval over one prompt's seeds says "
                     "nothing about other prompts)")


def wilson_interval(k: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of ``k`` successes in ``n`` independent trials (``k`` may be
    fractional: ``p * n`` for a rate measured on clusters).

    ``(p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)`` with ``p = k/n`` and ``z``
    the ``1 - (1-confidence)/2`` normal quantile.
    """
    if n <= 0:
        return (float("nan"), float("nan"))
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    z = float(norm.ppf(1 - (1 - confidence) / 2))
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, float(centre - half)), min(1.0, float(centre + half)))


def cluster_bootstrap_replicates(successes: np.ndarray, sizes: np.ndarray, n_resamples: int, seed: int) -> np.ndarray:
    """Replicates of ``sum(successes) / sum(sizes)`` over clusters drawn with replacement:
    ``idx = default_rng(seed).integers(0, K, size=(n_resamples, K))``."""
    k = len(successes)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, k, size=(n_resamples, k))
    return successes[idx].sum(axis=1) / sizes[idx].sum(axis=1)


def percentile(replicates: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(replicates, [alpha, 1 - alpha])
    return float(lo), float(hi)


def proportion(successes: Sequence[bool], confidence: float = 0.95) -> MetricValue:
    """A rate of independent trials (one per prompt): value, Wilson interval, n = trials."""
    n = len(successes)
    if n == 0:
        return MetricValue(value=float("nan"), n=0, n_clusters=0)
    k = int(sum(bool(s) for s in successes))
    value = k / n
    if n < MIN_CLUSTERS:
        return MetricValue(value=value, n=n, n_clusters=n, note=FEW_CLUSTERS_NOTE)
    lo, hi = wilson_interval(k, n, confidence)
    return MetricValue(value=value, ci_low=lo, ci_high=hi, n=n, method=WILSON, n_clusters=n)


def clustered_rate(
    successes: Sequence[bool],
    clusters: Sequence[Hashable],
    *,
    n_resamples: int = 1000,
    seed: int = 0,
    confidence: float = 0.95,
) -> MetricValue:
    """A rate over images grouped in clusters (images of one prompt): value = successes /
    images, cluster-bootstrap interval over the clusters, n = images, n_clusters = prompts."""
    if len(successes) != len(clusters):
        raise ValueError(f"{len(successes)} outcomes but {len(clusters)} cluster ids")
    n = len(successes)
    if n == 0:
        return MetricValue(value=float("nan"), n=0, n_clusters=0)
    order: dict[Hashable, int] = {}
    for c in clusters:
        order.setdefault(c, len(order))
    k = len(order)
    succ = np.zeros(k)
    size = np.zeros(k)
    for s, c in zip(successes, clusters):
        succ[order[c]] += bool(s)
        size[order[c]] += 1
    value = float(succ.sum() / size.sum())
    if k < MIN_CLUSTERS:
        return MetricValue(value=value, n=n, n_clusters=k, note=FEW_CLUSTERS_NOTE)
    reps = cluster_bootstrap_replicates(succ, size, n_resamples, seed)
    if np.ptp(reps) == 0:  # e.g. 0/n or n/n: the bootstrap is a point; Wilson over the clusters
        lo, hi = wilson_interval(value * k, k, confidence)
        return MetricValue(value=value, ci_low=lo, ci_high=hi, n=n, method=WILSON_CLUSTERS, n_clusters=k)
    lo, hi = percentile(reps, confidence)
    return MetricValue(value=value, ci_low=lo, ci_high=hi, n=n, method=CLUSTER_BOOTSTRAP, n_clusters=k)
