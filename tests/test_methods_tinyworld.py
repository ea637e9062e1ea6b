"""Each method really erases a shape from the trained tiny world (looser floors than the
documented table, fewer images): EA on name prompts high where the base model draws the
shape, RA on other shapes close to the base model's. The same settings as the table; about
four minutes on 2 CPU cores, ESD-u (800 iterations) two of them."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("eval_methods_tinyworld",
                                               ROOT / "scripts" / "eval_methods_tinyworld.py")
ev = importlib.util.module_from_spec(_spec)
sys.modules["eval_methods_tinyworld"] = ev
_spec.loader.exec_module(ev)

PIPELINE, CLASSIFIER = ev.default_assets()
pytestmark = pytest.mark.skipif(
    not (PIPELINE.exists() and CLASSIFIER.exists()),
    reason="the trained tiny world is not available (python scripts/train_tinyworld.py)",
)

CONCEPT = "circle"
SEEDS = 6
TYPES = ("name", "random")
# Floors per method: EA on name prompts, and RA on random shapes relative to the base model.
# (The documented run, docs/methods_tinyworld.md, 16 images per prompt, reaches EA >= 0.8 and
# RA >= 0.8 x base for every method.)
FLOORS = {  # EA on 6 name images: at most 2 show the circle (the base model draws it in all 6)
    name: (0.65, 0.75) for name in ("uce", "esd-x", "esd-u", "mace", "ca", "ca-model", "fmn")
}


@pytest.fixture(scope="module")
def world():
    from classifiers.tinyworld import TinyWorldClassifier

    base = ev.load_tinyworld(PIPELINE)
    classifier = TinyWorldClassifier(weights=str(CLASSIFIER))
    row = ev.evaluate_method(base, classifier, None, CONCEPT, SEEDS, types=TYPES)
    return base, classifier, row.rates


def test_the_base_model_draws_the_concept(world):
    _, _, base_rates = world
    assert base_rates["name"] <= 0.2  # else erasure would not be measurable
    assert base_rates["random"] >= 0.6


def check(world, name: str) -> None:
    base, classifier, base_rates = world
    row = ev.evaluate_method(base, classifier, name, CONCEPT, SEEDS, types=TYPES)
    ea_floor, ra_floor = FLOORS[name]
    assert row.rates["name"] >= ea_floor, row
    assert row.rates["random"] >= ra_floor * base_rates["random"], row


@pytest.mark.parametrize("name", list(FLOORS))
def test_each_method_erases_the_circle(world, name):
    check(world, name)
