"""scripts/generalisation_probe.py: one seed per image, word-clustered intervals, the control verdict."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
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


def _result(rates: dict[str, float]) -> dict:
    words = [{"word": w, "expected": "circle", "rate": r, "n": 20, "ci": [0.0, 1.0], "drawn": "circle"}
             for w, r in rates.items()]
    return {"words": words, "passed": sum(r >= 0.5 for r in rates.values()), "total": len(words),
            "pass_rate": 0.5, "n_per_word": 20, "random_words": [], "control_words": {},
            "controls": {s: {"rate": 0.1, "ci": [0.0, 0.2]} for s in SHAPES},
            "random": {s: {"rate": 0.1, "ci": [0.0, 0.2]} for s in SHAPES}}


def test_compare_puts_the_other_runs_rate_beside_each_word():
    erased, base = _result({"coin": 0.0, "wheel": 0.25}), _result({"coin": 1.0})
    text = gp.markdown(erased, compare=base)
    assert "**0 of 2** (0%); compared run: 1 of 1." in text
    assert "| coin | circle | 0.00 | [0.00, 1.00] | circle | 1.00 | circle |" in text
    assert "| wheel | circle | 0.25 | [0.00, 1.00] | circle | - | - |" in text  # not in the compared run
    assert "compared" not in gp.markdown(erased)


def test_erase_options_are_checked_before_any_work(capsys):
    for argv, says in ((["--method", "uce"], "--method and --concept go together"),
                       (["--method", "uce", "--concept", "circel"], "unknown --concept 'circel'; valid: circle"),
                       (["--method", "uce", "--concept", "circle", "--assets", "elsewhere"],
                        "erases the shipped world"),
                       (["--method", "ucee", "--concept", "circle"], "unknown --method 'ucee'. Did you mean 'uce'")):
        with pytest.raises(SystemExit) as exit_:
            gp.main(argv)
        assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_words_that_evoke_an_erased_shape_are_erased_with_it(tmp_path):
    """UCE erasing the circle by its name (the cell's own stages and presets) also stops
    "wheel", "clock" and "tire", which never occur in a caption, from drawing circles (tiny
    world 3: base 24 of 24 images, erased 1 of 24 at seed 5000, one thread); "gem" keeps drawing
    diamonds (8 of 8 both)."""
    from classifiers.tinyworld import TinyWorldClassifier
    from emma.tinyworld.quality import make_target

    torch.set_num_threads(1)
    clf = TinyWorldClassifier(weights=gp.DEFAULT_ASSETS / "classifier.safetensors")
    words = ["wheel", "clock", "tire", "gem"]
    base = gp.judged(make_target(gp.DEFAULT_ASSETS / "pipeline", clf, tmp_path / "base"), words, 8, 5000)
    gen, model = gp.erased_generator("uce", "circle", [], tmp_path / "erase")
    erased = gp.judged(gp.judged_by(gen, clf, tmp_path / "erased"), words, 8, 5000)
    assert model["method"] == "uce" and len(model["erased_fingerprint"]) == 64 and model["guidance"] is None
    circles = lambda table: sum(int(table[w]["circle"].sum()) for w in words[:3])  # noqa: E731
    assert circles(base) >= 20 and circles(erased) <= 8
    assert int(base["gem"]["diamond"].sum()) >= 5 and int(erased["gem"]["diamond"].sum()) >= 5


def test_an_erased_model_is_drawn_with_its_sampling_guidance(tmp_path) -> None:
    """SLD (and SPM's Facilitated Transport) act at sampling: the probe draws the erased model
    through the cell's generator, which applies the guidance, not through the bare pipeline."""
    gen, model = gp.erased_generator("sld", "circle", [], tmp_path / "erase")
    assert model["guidance"] == gen.guidance.name
    assert model["guidance"]
