"""scripts/style_fallback.py: the style the tiny world draws when a style word means nothing.

Plain is the tiny world's fallback style: a style prompt whose style word is a control word of
the generalisation probe draws plain in about two thirds of its images (32 images per word:
0.67, interval 0.58-0.76), while the empty prompt draws plain in about one sixth. An eraser that
only removes the word "plain" leaves that fallback, which is why plain is the one style where a
partial erasure shows as a miss (docs/methods_tinyworld_limits.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import style_fallback as sf  # noqa: E402

from emma.domains.tinyworld import TinyWorldStyleSuite, tinyworld_domain  # noqa: E402
from emma.tinyworld.generalisation import CONTROLS  # noqa: E402
from emma.tinyworld.world import STYLES  # noqa: E402


def test_the_prompts_are_the_style_suites_name_prompt_with_another_word() -> None:
    suite = TinyWorldStyleSuite()
    dom = tinyworld_domain(name="tinyworld_style", kind="style")
    for s in STYLES:
        assert suite.prompts(dom, s)["name"] == [(suite.name_prompt(s), s)]
    sets = sf.prompt_sets(suite)
    assert sets["controls"][CONTROLS.index("silence")] == "a star in silence style"
    assert sets["references"][:2] == ["", "a star"]
    assert sets["references"][2:] == [f"a star in {s} style" for s in STYLES]


@pytest.fixture(scope="module")
def measured() -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return sf.run(n=4)
    finally:
        torch.set_num_threads(threads)


def test_a_meaningless_style_word_draws_plain(measured: dict) -> None:
    # 24 words x 4 images; measured 0.65 (one and two threads), 0.67 over 32 images a word
    rates = {s: measured["controls"][s]["rate"] for s in STYLES}
    assert measured["controls"]["plain"]["images"] == 4 * len(CONTROLS)
    assert rates["plain"] >= 0.45, rates
    assert all(rates["plain"] >= 2 * rates[s] for s in STYLES if s != "plain"), rates
    lo, hi = measured["controls"]["plain"]["ci"]
    assert lo <= rates["plain"] <= hi


def test_each_style_word_draws_its_style(measured: dict) -> None:
    by_prompt = {r["prompt"]: r["counts"] for r in measured["references"]}
    for s in STYLES:
        assert by_prompt[f"a star in {s} style"][s] >= 3, (s, by_prompt[f"a star in {s} style"])
    # the empty prompt is not the fallback: it draws plain no more often than a meaningless word
    assert by_prompt[""]["plain"] <= 2


def test_bad_image_count_is_one_line_error(capsys) -> None:
    assert sf.main(["--n", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: --n must be at least 1, got 0"


def test_summary_reads_each_measurement_into_one_row() -> None:
    """A measurement of known counts (4 images a prompt) gives the row those counts make."""
    def counts(plain: int, striped: int = 0, dotted: int = 0, checkered: int = 0) -> dict[str, int]:
        return {"plain": plain, "striped": striped, "dotted": dotted, "checkered": checkered}

    refs = {"": counts(0, 4), "a star": counts(3, 1), "a star in plain style": counts(1, 3),
            "a star in striped style": counts(2, 2), "a star in dotted style": counts(0, 0, 4),
            "a star in checkered style": counts(0, 0, 1, 3)}
    res = {"model": {"method": "spm", "concept": "plain", "overrides": ["method.rank=2", "seed=2"]},
           "n_per_prompt": 4, "styles": list(STYLES),
           "controls": {s: {"rate": 0.5, "ci": [0.4, 0.6]} for s in STYLES},
           "references": [{"prompt": p, "counts": c} for p, c in refs.items()]}
    assert sf.summary([res]).splitlines()[2] == "| spm / plain, seed 2 | 0.25 | 0.50 (0.40-0.60) | 0.75 | 0.00 | 0.50 |"
    base = {**res, "model": {"assets": "shipped"}}
    assert sf.summary([base]).splitlines()[2].startswith("| base (plain) | 0.25 |")


@pytest.mark.parametrize("args, message", [
    (["--method", "esd", "--concept", "circle"],
     "error: unknown tiny-world style 'circle'; valid: plain, striped, dotted, checkered"),
    (["--method", "esd"], "error: --method and --concept go together (the cell whose erased model is measured)"),
    (["--summary", "no_such.json"], "error: no measurement file no_such.json; pass files written with --json"),
    (["--cell-seed", "2", "--cache", "x"],
     "error: --cell-seed, --cache describe the erasing cell; give them with --method and --concept"),
])
def test_bad_arguments_are_one_line_errors(args: list[str], message: str, capsys) -> None:
    assert sf.main(args) == 2
    assert capsys.readouterr().err.strip() == message


def test_an_erased_style_is_measured_through_the_cells_generator(tmp_path) -> None:
    """SLD at its own settings does not erase plain (the methods page: EA 0.00 at seeds 0-2), and
    its guidance is applied: the measurement names it and the name prompt still draws plain."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = sf.run(n=2, erased=("sld", "plain", ["seed=0"]), erase_cache=tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert res["model"]["method"] == "sld" and res["model"]["guidance"]
    by_prompt = {r["prompt"]: r["counts"] for r in res["references"]}
    assert by_prompt["a star in plain style"]["plain"] == 2
