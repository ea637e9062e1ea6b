"""The command line's start-up (emma.startup) and the bench that measures it
(scripts/bench_startup.py): what they do, never how fast (no timed assertions)."""

from __future__ import annotations

import gc
import importlib.util
import sys
import textwrap

import pytest

from emma import startup
from tests.conftest import ROOT

FAST = ["model=tiny_random", "classifier=tinyworld", "classifier.weights=null", "metrics=rates_only",
        "prompt_types=[name]", "images_per_prompt=1"]


@pytest.fixture
def thresholds():
    """The collector's thresholds before the test, put back after it whatever it did."""
    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    yield before
    startup.end()
    gc.set_threshold(*before)
    gc.unfreeze()


def test_defer_restore_and_end(thresholds):
    startup.defer_gc()
    assert gc.get_threshold() == startup.START_THRESHOLDS and startup.gc_deferred()
    startup.defer_gc()  # idempotent: restores the thresholds of the first call, not the raised ones
    startup.restore_gc()
    assert gc.get_threshold() == thresholds and not startup.gc_deferred()
    assert gc.get_freeze_count() > 0  # what was alive at the end of the start-up: frozen
    startup.restore_gc()  # again, or without a defer: nothing
    assert gc.get_threshold() == thresholds
    startup.end()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds


def test_without_a_defer_nothing_is_frozen(thresholds):
    """A library caller's model stage (no command line) leaves the collector alone."""
    startup.restore_gc()
    startup.end()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds


def test_the_cli_defers_gc_until_the_model_is_loaded(tmp_path, monkeypatch, thresholds):
    """Composition, validation and loading the pipeline run with the raised thresholds; the
    first image is drawn with the collector's own thresholds and the start-up frozen, and the
    command leaves the collector as it found it (nothing frozen)."""
    from emma import run
    from emma.generate import CachedGenerator
    from emma.stages import model

    seen: dict[str, tuple[int, int, int]] = {}
    real_load, real_run = model.load_pipeline, CachedGenerator._run

    def load(*args, **kwargs):
        seen.setdefault("load", gc.get_threshold())
        return real_load(*args, **kwargs)

    def draw(self, *args, **kwargs):
        seen.setdefault("draw", gc.get_threshold())
        seen.setdefault("frozen", gc.get_freeze_count() > 0)
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(model, "load_pipeline", load)
    monkeypatch.setattr(CachedGenerator, "_run", draw)
    monkeypatch.setenv("EMMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", ["emma.run", *FAST, f"paths.cache_dir={tmp_path / 'cache'}",
                                      f"hydra.run.dir={tmp_path / 'run'}"])
    run.cli()
    assert (tmp_path / "run" / "results.json").is_file()
    assert seen == {"load": startup.START_THRESHOLDS, "draw": thresholds, "frozen": True}
    assert gc.get_threshold() == thresholds and not startup.gc_deferred() and gc.get_freeze_count() == 0


def test_the_cli_restores_gc_when_it_refuses(monkeypatch, capsys, thresholds):
    from emma import run

    monkeypatch.setattr(sys, "argv", ["emma.run", "method=nosuchmethod"])
    with pytest.raises(SystemExit) as exc:
        run.cli()
    assert exc.value.code == 2 and "nosuchmethod" in capsys.readouterr().err
    assert gc.get_threshold() == thresholds and not startup.gc_deferred()


# -- scripts/bench_startup.py -------------------------------------------------------------------

def _bench():
    spec = importlib.util.spec_from_file_location("bench_startup", ROOT / "scripts" / "bench_startup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_import_seconds_sums_self_times_by_top_level_package():
    report = textwrap.dedent("""\
        import time: self [us] | cumulative | imported package
        import time:      1500 |       1500 |     torch._C
        import time:      2500 |       4000 |   torch
        import time:       300 |        300 | hydra
        loading weights: 100%|##########| 52/52
        import time:      1000 |       1000 |     diffusers.models
        import time:      garbage | x | y
        import time:       200 |       1200 | diffusers
        """)
    assert _bench().import_seconds(report) == pytest.approx({"torch": 0.004, "diffusers": 0.0012, "hydra": 0.0003})
    assert list(_bench().import_seconds(report)) == ["torch", "diffusers", "hydra"]


FAKE_RUN = '''
import os, sys, time
from pathlib import Path
cache = Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("paths.cache_dir=")))
shard = cache / "images" / "ab"
shard.mkdir(parents=True)
print("threads", os.environ.get("OMP_NUM_THREADS"), "path", os.environ.get("PYTHONPATH"), file=sys.stderr, flush=True)
if "no-image" in sys.argv:
    sys.exit(3)
(shard / ".abc.png.1.tmp").write_bytes(b"partial")  # the cache's temporary name: not an image yet
time.sleep(0.3)
(shard / ".abc.png.1.tmp").rename(shard / "abc.png")
time.sleep(60)  # the bench stops the cell at its first image
'''


def test_first_image_is_the_first_renamed_png(tmp_path):
    """The bench's clock stops at the first complete ``*.png`` under ``<cache>/images`` (not at
    the cache's temporary file) and ends the cell; a cell that ends without one is an error."""
    checkout = tmp_path / "checkout"
    (checkout / "emma").mkdir(parents=True)
    (checkout / "emma" / "__init__.py").write_text("")
    (checkout / "emma" / "run.py").write_text(FAKE_RUN)
    bench = _bench()
    seconds, stderr = bench.first_image(checkout, [], threads=1)
    assert seconds >= 0.3  # not before the rename, which the fake cell does 0.3 s after the temporary file
    assert f"threads 1 path {checkout}" in stderr
    with pytest.raises(RuntimeError, match="ended before drawing an image"):
        bench.first_image(checkout, ["no-image"], threads=1)
