"""Metric base class (torchmetrics-style) and the typed value every metric reports."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar, Sequence

import numpy as np


@dataclasses.dataclass
class MetricValue:
    """A metric's value with its 95% confidence interval and sample count.

    Attributes:
        value: the point estimate.
        ci_low / ci_high: the interval (``None``: no interval, ``note`` says why).
        n: the population the value is over (images, prompts, batches: docs/metrics.md).
        method: how the interval was computed (``wilson``, ``cluster-bootstrap-percentile``,
            ...; ``None`` without an interval).
        n_clusters: the independent units the interval resamples or counts (prompts,
            batches); ``None`` where not applicable.
        note: why an interval is absent, or another caveat of this value.
        n_excluded: items left out of the denominator (e.g. images without a face for GCD).
    """

    value: float
    ci_low: float | None = None
    ci_high: float | None = None
    n: int = 0
    method: str | None = None
    n_clusters: int | None = None
    note: str | None = None
    n_excluded: int | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    *,
    statistic=np.mean,
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of ``statistic`` over ``values``.

    Seeded, so a result file is reproducible. A constant sample gives a zero-width interval.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_resamples, x.size))
    stats = statistic(x[idx], axis=1)
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(stats, [alpha, 1 - alpha])
    return (float(lo), float(hi))


class Metric(abc.ABC):
    """torchmetrics-style metric: ``update()`` with batches, ``compute()`` once.

    State lives in attributes registered with :meth:`add_state`; :meth:`reset` restores
    their defaults. ``higher_is_better`` states the metric's direction.
    """

    higher_is_better: ClassVar[bool | None] = None
    name: ClassVar[str] = "metric"

    def __init__(self) -> None:
        self._defaults: dict[str, Any] = {}

    def add_state(self, name: str, default: Any) -> None:
        self._defaults[name] = default
        setattr(self, name, _fresh(default))

    def reset(self) -> None:
        for name, default in self._defaults.items():
            setattr(self, name, _fresh(default))

    @abc.abstractmethod
    def update(self, *args: Any, **kwargs: Any) -> None:
        """Accumulate a batch."""

    @abc.abstractmethod
    def compute(self) -> MetricValue:
        """The value over everything seen since the last reset."""


def _fresh(default: Any) -> Any:
    if isinstance(default, list):
        return list(default)
    if isinstance(default, dict):
        return dict(default)
    if isinstance(default, np.ndarray):
        return default.copy()
    return default
