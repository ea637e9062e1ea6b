"""scripts/generalisation_probe.py: one seed per image, word-clustered intervals, the control verdict."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import generalisation_probe as gp  # noqa: E402

from emma.tinyworld.world import SHAPES, STYLES  # noqa: E402


class SeedTarget:
    """Records the seeds it is asked for; its judge finds a circle in images of even seeds."""

    def __init__(self) -> None:
        self.seeds: list[int] = []
        concepts = list(SHAPES) + list(STYLES)

        def detect(probs: torch.Tensor, concept: str) -> torch.Tensor:
            return probs[:, concepts.index(concept)] > 0.5

        self.judge = SimpleNamespace(classifier=SimpleNamespace(predict=lambda images: images, detect=detect))
        self.concepts = concepts

    def generate(self, prompts: list[str], seeds: list[int]) -> SimpleNamespace:
        self.seeds += seeds
        images = torch.zeros(len(seeds), len(self.concepts))
        images[:, 0] = torch.tensor([s % 2 == 0 for s in seeds], dtype=torch.float32)
        return SimpleNamespace(images=images)


def test_every_image_of_a_list_has_its_own_seed():
    target = SeedTarget()
    out = gp.judged(target, ["coin", "wheel", "ball"], 4, 100)
    assert target.seeds == list(range(100, 112))
    assert out["wheel"]["circle"].tolist() == [True, False, True, False]  # seeds 104-107


def test_control_verdict_needs_the_controls_interval_above_the_random_words():
    def rates(hits_per_word: list[int], n: int = 20) -> dict:
        lo, hi = gp.beta_binomial_interval(hits_per_word, [n] * len(hits_per_word))
        return {"rate": sum(hits_per_word) / (n * len(hits_per_word)), "ci": [lo, hi]}

    prior = [3] * 24  # every word at 0.15
    base = {s: rates([3] * 100) for s in SHAPES}
    # intervals that overlap are no failure, whatever the point rates
    overlap = {**base, "circle": {"rate": 0.2, "ci": [base["circle"]["ci"][1] - 0.01, 0.3]}}
    assert overlap["circle"]["rate"] > base["circle"]["rate"]
    assert gp.control_failures(overlap, base) == []
    # ... twelve do
    many = {**base, "circle": rates([20] * 12 + prior[:12])}
    assert gp.control_failures(many, base) == ["circle"]
    assert np.isclose(many["circle"]["rate"], (12 * 20 + 12 * 3) / 480)
