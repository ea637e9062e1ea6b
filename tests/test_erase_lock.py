"""Two jobs that need the same erased model: the first erases, the other waits and loads it."""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

import torch

from emma.api.domain import Domain
from emma.api.method import ErasureMethod
from emma.domains import load_domain
from emma.erase import erase_cached
from emma.pipelines import fingerprint, tiny_random_pipeline


class SlowShift(ErasureMethod):
    """Adds a constant to one UNet bias, slowly; counts its calls."""

    name = "slow_shift"
    version = "1"
    calls: list[float] = []

    def erase(self, pipe: Any, concepts: Sequence[str], *, seed: int = 0, domain: Domain | None = None) -> Any:
        SlowShift.calls.append(time.perf_counter())
        time.sleep(1.0)
        with torch.no_grad():
            pipe.unet.conv_out.bias.add_(self.hparams["shift"])
        return pipe


def test_concurrent_jobs_erase_once_and_load_the_same_weights(tmp_path):
    SlowShift.calls.clear()
    pipes = [tiny_random_pipeline(), tiny_random_pipeline()]
    base = fingerprint(pipes[0])
    results: list[Any] = [None, None]

    def job(i):
        results[i] = erase_cached(pipes[i], SlowShift(shift=0.25), ["circle"], tmp_path,
                                  base_fingerprint=base, domain=load_domain("tinyworld"))

    threads = [threading.Thread(target=job, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(SlowShift.calls) == 1  # erased once
    assert sorted(r.cached for r in results) == [False, True]
    assert results[0].fingerprint == results[1].fingerprint != base
    b0, b1 = (p.unet.conv_out.bias.detach() for p in pipes)
    assert torch.equal(b0, b1)
    assert len(list((tmp_path / "erased").glob("*/manifest.json"))) == 1
