"""STACE's metrics (§3.4), as pure functions of per-iteration records.

- ``SIR_H`` (Eq. 4): share of the N hypotheses with at least one image showing the concept.
- ``SIR_I`` (Eq. 5): share of the N·k images showing the concept. An instantiation that was
  never rendered (a failed execution, a program that requested fewer than k images)
  counts as not showing it, so the denominator is always N·k.
- ``EII`` (Eq. 6): the first (1-based) iteration whose hypothesis succeeded; ``None`` when
  none did (never 0).
- ``SER`` (§3.4.3): share of iterations whose hypothesis was executed successfully.
- ``Nov(H)`` (Eq. 7): mean over hypotheses of ``1 - max_P cos(H, P)``.

Rates carry 95% Wilson score intervals (hypotheses and images are Bernoulli trials; the
images of one hypothesis are correlated, so SIR_I's interval is a lower bound on the
uncertainty).
"""

from __future__ import annotations

import math
from typing import Sequence

from emma.metrics.base import MetricValue


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


def _rate(successes: int, n: int) -> MetricValue:
    lo, hi = wilson(successes, n)
    return MetricValue(value=successes / n if n else float("nan"), ci_low=lo, ci_high=hi, n=n)


def sir_h(success: Sequence[bool]) -> MetricValue:
    return _rate(sum(bool(s) for s in success), len(success))


def sir_i(detected_per_iteration: Sequence[int], k: int) -> MetricValue:
    n = len(detected_per_iteration) * int(k)
    return _rate(int(sum(detected_per_iteration)), n)


def eii(success: Sequence[bool]) -> int | None:
    for i, s in enumerate(success, start=1):
        if s:
            return i
    return None


def ser(executed: Sequence[bool]) -> MetricValue:
    return _rate(sum(bool(e) for e in executed), len(executed))


def novelty(scores: Sequence[float | None]) -> MetricValue | None:
    vals = [float(s) for s in scores if s is not None]
    if not vals:
        return None
    return MetricValue(value=sum(vals) / len(vals), n=len(vals))
