"""EA, RA and ASR against an independent reference (EMMA's formulas, scipy's bootstrap)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from emma.metrics.base import bootstrap_ci
from emma.metrics.rates import AttackSuccessRate, ErasingAbility, RetainingAbility


def _detected(n: int, p: float, seed: int) -> list[bool]:
    return (np.random.default_rng(seed).random(n) < p).tolist()


def _scipy_ci(successes: list[float]) -> tuple[float, float]:
    res = stats.bootstrap((np.asarray(successes, float),), np.mean, n_resamples=4000, method="percentile",
                          random_state=np.random.default_rng(1))  # fmt: skip
    return res.confidence_interval.low, res.confidence_interval.high


@pytest.mark.parametrize(
    "metric_cls, formula",
    [
        # EMMA: EA = N_SE / N_P, erased = the judge does not find the target concept
        (ErasingAbility, lambda d: sum(not x for x in d) / len(d)),
        # RA = N_SR / N_P, retained = the judge finds the non-target concept
        (RetainingAbility, lambda d: sum(d) / len(d)),
        # ASR = fraction of attack images in which the target concept is found
        (AttackSuccessRate, lambda d: sum(d) / len(d)),
    ],
)
def test_rate_value_and_interval(metric_cls, formula):
    detected = _detected(300, 0.3, seed=0)
    m = metric_cls()
    m.update(detected)
    v = m.compute()
    assert v.value == pytest.approx(formula(detected), abs=1e-12)
    assert v.n == 300
    successes = [float((not d) if metric_cls is ErasingAbility else d) for d in detected]
    lo, hi = _scipy_ci(successes)
    assert v.ci_low <= v.value <= v.ci_high
    assert v.ci_low == pytest.approx(lo, abs=0.012) and v.ci_high == pytest.approx(hi, abs=0.012)
    se = np.sqrt(v.value * (1 - v.value) / 300)  # the normal approximation agrees at n = 300
    assert v.ci_high - v.ci_low == pytest.approx(2 * 1.96 * se, rel=0.1)


@pytest.mark.parametrize("metric_cls", [ErasingAbility, RetainingAbility, AttackSuccessRate])
def test_batches_equal_the_concatenation(metric_cls):
    detected = _detected(97, 0.6, seed=2)
    batched, whole = metric_cls(seed=5), metric_cls(seed=5)
    for i in range(0, 97, 10):
        batched.update(detected[i : i + 10])
    whole.update(detected)
    assert batched.compute() == whole.compute()
    batched.reset()
    assert batched.compute().n == 0 and np.isnan(batched.compute().value)


def test_direction_and_edge_cases():
    assert ErasingAbility.higher_is_better and RetainingAbility.higher_is_better
    assert AttackSuccessRate.higher_is_better is False
    m = ErasingAbility()
    m.update([False] * 20)  # never found: fully erased, zero-width interval
    v = m.compute()
    assert (v.value, v.ci_low, v.ci_high) == (1.0, 1.0, 1.0)


def test_bootstrap_ci_is_seeded_percentile():
    x = np.random.default_rng(3).random(50)
    assert bootstrap_ci(x, seed=7) == bootstrap_ci(x, seed=7)
    rng = np.random.default_rng(7)
    reps = x[rng.integers(0, 50, size=(1000, 50))].mean(axis=1)
    assert bootstrap_ci(x, seed=7) == pytest.approx(tuple(np.quantile(reps, [0.025, 0.975])))
