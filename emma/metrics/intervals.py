"""Confidence intervals for the harness's rates: one method per kind of rate (docs/metrics.md
states each formula and shows their coverage, ``scripts/interval_coverage.py``).

* :func:`proportion` — a proportion of *independent* trials (prompt-level ASR, a rate of
  single images of distinct prompts): Wilson's score interval (Wilson 1927), which keeps a
  non-zero width at 0/n and n/n.
* :func:`clustered_rate` — a rate over images where the images of one prompt are correlated
  (same prompt, different seeds): the likelihood-ratio interval of the mean rate ``p`` under
  a beta-binomial model (each prompt has its own rate, drawn from a beta distribution of mean
  ``p`` and intra-prompt correlation ``rho``; its images are binomial given that rate),
  profiled over ``rho``. ``rho = 0`` is the binomial (independent images); ``rho -> 1``
  counts each prompt once. The data choose between them, so the interval is one continuous
  function of the counts: it neither collapses at 0 or 1 nor jumps when one image flips.
* Fewer than :data:`MIN_CLUSTERS` prompts: no interval, and a note saying so.

Every interval is 95% by default and two-sided; none is random, so a result file is
reproducible bit for bit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from functools import lru_cache
from statistics import NormalDist

import numpy as np

from emma.metrics.base import MetricValue

# scipy (special functions, optimisers) is imported where an interval is computed: a cell
# imports this module long before it has a rate to bound, and scipy.stats alone costs seconds

MIN_CLUSTERS = 2
WILSON = "wilson"
BETA_BINOMIAL = "beta-binomial-profile-likelihood"
FEW_CLUSTERS_NOTE = ("fewer than 2 prompts: no interval (an interval over one prompt's seeds says "
                     "nothing about other prompts)")

#: the intra-prompt correlations the profile maximises over: 0 (binomial) and 96 values
#: spaced evenly in logit(rho) from 1e-4 to 1 - 1e-4 (spacing 0.19 in logit: the profile's
#: error from the grid is far below the third decimal of a bound)
RHO_GRID = np.concatenate([[0.0], 1.0 / (1.0 + np.exp(-np.linspace(-9.2, 9.2, 96)))])
#: the rates scanned to bracket each bound before it is refined with Brent's method
_P_GRID = 1.0 / (1.0 + np.exp(-np.linspace(-12.0, 12.0, 121)))


def wilson_interval(k: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of ``k`` successes in ``n`` independent trials.

    ``(p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)`` with ``p = k/n`` and ``z``
    the ``1 - (1-confidence)/2`` normal quantile.
    """
    if n <= 0:
        return (float("nan"), float("nan"))
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # at 0/n and n/n the bound is exactly 0 (1); the formula leaves a rounding residue there
    lo = 0.0 if k == 0 else max(0.0, float(centre - half))
    hi = 1.0 if k == n else min(1.0, float(centre + half))
    return (lo, hi)


def _profiles(ps: np.ndarray, s: np.ndarray, f: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The beta-binomial log-likelihood at each mean rate of ``ps`` of clusters with
    successes ``s`` and failures ``f`` (``w`` clusters of each kind), maximised over
    :data:`RHO_GRID` (binomial coefficients dropped: they depend on neither ``p`` nor ``rho``)."""
    from scipy.special import betaln, xlog1py, xlogy

    ps = np.atleast_1d(np.asarray(ps, dtype=float))
    out = np.empty(len(ps))
    inner = (ps > 0) & (ps < 1)
    out[ps <= 0] = 0.0 if not s.any() else -np.inf
    out[ps >= 1] = 0.0 if not f.any() else -np.inf
    p = ps[inner][:, None, None]
    binomial = np.sum(w * (xlogy(s, p[:, 0]) + xlog1py(f, -p[:, 0])), axis=-1)
    t = (1.0 / RHO_GRID[1:] - 1.0)[None, :, None]  # alpha + beta
    a, b = p * t, (1.0 - p) * t
    beta_binomial = np.sum(w * (betaln(s + a, f + b) - betaln(a, b)), axis=-1)
    out[inner] = np.maximum(binomial, beta_binomial.max(axis=1))
    return out


@lru_cache(maxsize=4096)
def _beta_binomial_bounds(counts: tuple[tuple[int, int, int], ...], confidence: float) -> tuple[float, float]:
    from scipy.optimize import brentq, minimize_scalar

    s, f, w = (np.array([c[i] for c in counts], dtype=float) for i in range(3))
    n = float(np.sum(w * (s + f)))

    def profile(p: float) -> float:
        return float(_profiles(np.array([p]), s, f, w)[0])

    grid = np.unique(np.concatenate([[0.0, 1.0, np.sum(w * s) / n], _P_GRID]))
    prof = _profiles(grid, s, f, w)
    best = int(np.argmax(prof))
    top, p_top = float(prof[best]), float(grid[best])
    if 0 < best < len(grid) - 1:  # refine the maximum between its neighbours
        res = minimize_scalar(lambda p: -profile(p), bounds=(grid[best - 1], grid[best + 1]),
                              method="bounded", options={"xatol": 1e-10})
        if -res.fun > top:
            top, p_top = float(-res.fun), float(res.x)
    cut = top - NormalDist().inv_cdf((1 + confidence) / 2) ** 2 / 2.0  # chi2_1 quantile = z^2

    def bound(idx: np.ndarray) -> float:
        # the first grid rate, walking away from the maximum, whose profile drops below the
        # cut; the bound lies between it and the rate before it (or the maximum)
        below = np.flatnonzero(prof[idx] < cut)
        if not len(below):
            return float(grid[idx[-1]])
        k = int(below[0])
        outside, inside = grid[idx[k]], (grid[idx[k - 1]] if k else p_top)
        return float(brentq(lambda p: profile(p) - cut, min(outside, inside), max(outside, inside), xtol=1e-12))

    order = np.arange(len(grid))
    lo = bound(order[grid < p_top][::-1]) if p_top > 0 else 0.0
    hi = bound(order[grid > p_top]) if p_top < 1 else 1.0
    return lo, hi


def beta_binomial_interval(successes: Sequence[float], sizes: Sequence[float],
                           confidence: float = 0.95) -> tuple[float, float]:
    """Profile-likelihood interval of the mean rate of clustered binary outcomes.

    Model: cluster ``c`` (a prompt) has rate ``p_c ~ Beta(p (1-rho)/rho, (1-p)(1-rho)/rho)``
    (mean ``p``, intra-cluster correlation ``rho``) and ``s_c ~ Binomial(m_c, p_c)``;
    ``rho = 0`` is the binomial. The profile log-likelihood ``l(p) = max_rho l(p, rho)``
    (``rho`` over :data:`RHO_GRID`) gives the interval
    ``{p : 2 (max l - l(p)) <= chi2_1(confidence)}`` (Wilks).

    Args:
        successes: per cluster, the outcomes counted as successes.
        sizes: per cluster, its outcomes.
        confidence: two-sided level.
    """
    pairs = Counter((int(round(k)), int(round(m - k))) for k, m in zip(successes, sizes))
    counts = tuple(sorted((k, f, w) for (k, f), w in pairs.items()))
    if not counts or sum(k + f for k, f, _ in counts) == 0:
        return (float("nan"), float("nan"))
    return _beta_binomial_bounds(counts, float(confidence))


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
    confidence: float = 0.95,
    **_ignored: object,
) -> MetricValue:
    """A rate over images grouped in clusters (images of one prompt): value = successes /
    images, the beta-binomial profile-likelihood interval (:func:`beta_binomial_interval`),
    n = images, n_clusters = prompts. (``n_resamples``/``seed`` of the former bootstrap are
    accepted and unused: the interval involves no randomness.)"""
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
    lo, hi = beta_binomial_interval(succ, size, confidence)
    # the interval is about the model's mean rate; the value shown is the ratio of sums (the
    # two differ slightly when prompts have different image counts): the interval holds it
    return MetricValue(value=value, ci_low=min(lo, value), ci_high=max(hi, value), n=n,
                       method=BETA_BINOMIAL, n_clusters=k)
