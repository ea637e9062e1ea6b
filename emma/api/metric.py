"""The Metric role, torchmetrics-style: ``update`` with batches, ``compute`` at the end."""

from __future__ import annotations

from emma.metrics.base import Metric, MetricValue

__all__ = ["Metric", "MetricValue"]
