"""EMMA's efficiency metrics: unlearning time per concept and inference time per image.

- ``time/unlearning_s``: the average wall-clock seconds to erase one concept (EMMA §efficiency
  "Unlearning (time)"); :class:`UnlearningTime` takes one measurement per erasure run, divided
  by the number of concepts that run erased.
- ``time/inference_s_per_image``: the average seconds the (erased) model needs to generate one
  image (EMMA "Inference (time)"); :class:`InferenceTime` takes ``(seconds, n_images)`` per
  generation batch and reports total seconds / total images (a ratio of sums, so batches of
  different sizes weigh by their images). Cached images must not be fed to it: they cost no
  generation time.

Intervals are percentile bootstraps over the measurements (runs / batches); a single
measurement has no interval.
"""

from __future__ import annotations

import platform
import time
from functools import cache
from typing import Any, ClassVar

import numpy as np

from emma.metrics.base import Metric, MetricValue, bootstrap_ci


@cache
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what ``platform`` knows of it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description(device: Any = "cpu") -> str:
    """The hardware a time was measured on: device (GPU name), CPU model, torch threads.
    Stored with every timing so a replayed time says where it was measured."""
    import torch

    dev = str(device)
    if dev.startswith("cuda") and torch.cuda.is_available():
        dev = f"{dev} ({torch.cuda.get_device_name(torch.device(dev))})"
    return f"{dev}; {cpu_model()}; torch threads {torch.get_num_threads()}"


class Stopwatch:
    """``with Stopwatch() as sw: ...``; then ``sw.seconds`` (``time.perf_counter``)."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.seconds: float = 0.0

    def __enter__(self) -> Stopwatch:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.start is not None
        self.seconds = time.perf_counter() - self.start


class UnlearningTime(Metric):
    """Mean seconds to erase one concept (``time/unlearning_s``)."""

    name: ClassVar[str] = "time/unlearning_s"
    higher_is_better: ClassVar[bool | None] = False

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = int(seed)
        self.add_state("per_concept", [])

    def update(self, seconds: float, n_concepts: int = 1) -> None:
        """Args:
        seconds: wall-clock time of one erasure run.
        n_concepts: concepts erased by that run (multi-concept methods such as MACE).
        """
        if n_concepts < 1 or seconds < 0:
            raise ValueError(f"need seconds >= 0 and n_concepts >= 1, got {seconds}, {n_concepts}")
        self.per_concept.append(float(seconds) / int(n_concepts))

    def compute(self) -> MetricValue:
        x = np.asarray(self.per_concept, dtype=np.float64)
        if x.size == 0:
            return MetricValue(value=float("nan"), n=0)
        lo, hi = bootstrap_ci(x, seed=self.seed) if x.size > 1 else (None, None)
        return MetricValue(value=float(x.mean()), ci_low=lo, ci_high=hi, n=int(x.size))


class InferenceTime(Metric):
    """Seconds per generated image (``time/inference_s_per_image``)."""

    name: ClassVar[str] = "time/inference_s_per_image"
    higher_is_better: ClassVar[bool | None] = False

    def __init__(self, n_resamples: int = 1000, seed: int = 0) -> None:
        super().__init__()
        self.n_resamples, self.seed = int(n_resamples), int(seed)
        self.add_state("seconds", [])
        self.add_state("images", [])

    def update(self, seconds: float, n_images: int) -> None:
        """Args:
        seconds: wall-clock time of one generation call.
        n_images: images that call generated (not served from a cache).
        """
        if n_images < 1 or seconds < 0:
            raise ValueError(f"need seconds >= 0 and n_images >= 1, got {seconds}, {n_images}")
        self.seconds.append(float(seconds))
        self.images.append(int(n_images))

    def compute(self) -> MetricValue:
        s = np.asarray(self.seconds, dtype=np.float64)
        n = np.asarray(self.images, dtype=np.float64)
        if s.size == 0:
            return MetricValue(value=float("nan"), n=0)
        value = float(s.sum() / n.sum())
        lo = hi = None
        if s.size > 1:
            rng = np.random.default_rng(self.seed)
            idx = rng.integers(0, s.size, size=(self.n_resamples, s.size))
            reps = s[idx].sum(axis=1) / n[idx].sum(axis=1)
            lo, hi = (float(q) for q in np.quantile(reps, [0.025, 0.975]))
        return MetricValue(value=value, ci_low=lo, ci_high=hi, n=int(n.sum()))
