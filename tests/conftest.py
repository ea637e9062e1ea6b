"""Shared test setup: offline, single-threaded, caches in temporary folders."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

# Tests run offline: nothing may reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(autouse=True, scope="session")
def _session_cache(tmp_path_factory):
    """Every test session gets its own cache unless EMMA_CACHE is set explicitly."""
    if "EMMA_CACHE" not in os.environ or os.environ.get("EMMA_TEST_KEEP_CACHE") != "1":
        os.environ["EMMA_CACHE"] = str(tmp_path_factory.mktemp("emma-cache"))
    yield


@pytest.fixture(autouse=True)
def _root_logging():
    """Each test leaves the root logger as it found it. A test that runs Hydra's entry in this
    process gets Hydra's job logging: INFO on the root, a console handler on the stream pytest
    captured for that test and closes after it. Left in place, a later test's INFO record
    (matplotlib's "generated new fontManager" on a fresh machine) goes to the closed stream,
    and logging prints a "Logging error" traceback into that test's stderr."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in [h for h in root.handlers if h not in handlers
                    and not type(h).__module__.startswith("_pytest")]:  # pytest's own: its phases
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level)


def run_env(cache: Path | str, **extra: str) -> dict[str, str]:
    """Environment for a ``python -m emma.run`` subprocess."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", EMMA_CACHE=str(cache), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


# -- a tiny random SD pipeline for the erasure methods' unit tests ---------------------------

@pytest.fixture(scope="module")
def base():
    """A tiny random Stable Diffusion pipeline of the real classes (seed 0, one torch thread),
    built once per test module; tests that change weights take ``pipe``, a fresh copy."""
    import torch

    from emma.pipelines import tiny_random_pipeline

    torch.set_num_threads(1)
    pipe = tiny_random_pipeline(seed=0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def pipe(base):
    import copy

    return copy.deepcopy(base)


def changed(a, b, component: str = "unet") -> set[str]:
    """Names of the parameters of ``component`` that differ between pipelines ``a`` and ``b``
    (text encoders' without their ``text_model.`` prefix)."""
    import torch

    sa, sb = getattr(a, component).state_dict(), getattr(b, component).state_dict()
    return {k.removeprefix("text_model.") for k in sa if not torch.equal(sa[k], sb[k])}


class ProgressReader:
    """Drains a cell subprocess's stderr (``text=True`` pipe) in a thread, so a test can act
    when the progress bar shows ``n`` of ``total`` images drawn: the cache's image files can lag
    far behind the generator on a quiet machine, so counting them is no clock."""

    def __init__(self, proc) -> None:
        import threading

        self.proc, self.chunks = proc, []
        self.thread = threading.Thread(target=lambda: self.chunks.extend(iter(lambda: proc.stderr.read(256), "")),
                                       daemon=True)
        self.thread.start()

    def wait_drawn(self, total: int, at_least: int, timeout: float = 600) -> bool:
        """Whether a bar of ``total`` reached ``at_least`` before the run ended or ``timeout``."""
        import re
        import time

        deadline = time.time() + timeout
        while time.time() < deadline and self.proc.poll() is None:
            drawn = [int(n) for n in re.findall(rf"(\d+)/{total} ", "".join(self.chunks[-40:]))]
            if max(drawn, default=0) >= at_least:
                return True
            time.sleep(0.02)
        return False

    def text(self) -> str:
        self.thread.join(timeout=10)
        return "".join(self.chunks)
