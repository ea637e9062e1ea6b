"""Efficiency metrics: unlearning time per concept, inference time per image."""

from __future__ import annotations

import time

import numpy as np
import pytest

from emma.metrics.timing import InferenceTime, Stopwatch, UnlearningTime


def test_unlearning_time_is_the_mean_per_concept():
    m = UnlearningTime()
    m.update(120.0)  # one concept in 120 s
    m.update(300.0, n_concepts=3)  # a multi-concept run: 100 s per concept
    v = m.compute()
    assert v.value == pytest.approx((120 + 100) / 2) and v.n == 2
    assert v.ci_low <= v.value <= v.ci_high
    assert UnlearningTime.name == "time/unlearning_s" and UnlearningTime.higher_is_better is False


def test_inference_time_is_seconds_over_images_batch_or_whole():
    batches = [(2.0, 4), (1.0, 1), (3.5, 7), (0.9, 2)]
    batched, whole = InferenceTime(seed=1), InferenceTime(seed=1)
    for s, n in batches:
        batched.update(s, n)
    total_s, total_n = sum(s for s, _ in batches), sum(n for _, n in batches)
    whole.update(total_s, total_n)
    assert batched.compute().value == pytest.approx(total_s / total_n)
    assert whole.compute().value == batched.compute().value
    assert batched.compute().n == total_n
    v = batched.compute()
    assert (
        min(s / n for s, n in batches) <= v.ci_low <= v.value <= v.ci_high <= max(s / n for s, n in batches)
    )
    assert whole.compute().ci_low is None  # one measurement: no interval
    assert InferenceTime.name == "time/inference_s_per_image"


def test_invalid_measurements_are_rejected():
    with pytest.raises(ValueError):
        InferenceTime().update(1.0, 0)
    with pytest.raises(ValueError):
        UnlearningTime().update(-1.0)
    assert np.isnan(InferenceTime().compute().value)


def test_stopwatch():
    with Stopwatch() as sw:
        time.sleep(0.02)
    assert 0.015 < sw.seconds < 1.0
