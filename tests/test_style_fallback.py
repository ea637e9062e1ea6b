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


def test_summary_reads_each_measurement_into_one_row(measured: dict) -> None:
    lines = sf.summary([measured]).splitlines()
    assert len(lines) == 3
    n = measured["n_per_prompt"]
    ref = {r["prompt"]: r["counts"] for r in measured["references"]}
    c = measured["controls"]["plain"]
    assert lines[2] == (f"| base (plain) | {ref['a star in plain style']['plain'] / n:.2f} | {c['rate']:.2f} "
                        f"({c['ci'][0]:.2f}-{c['ci'][1]:.2f}) | {ref['a star']['plain'] / n:.2f} | "
                        f"{ref['']['plain'] / n:.2f} | "
                        f"{min(ref[f'a star in {s} style'][s] for s in STYLES if s != 'plain') / n:.2f} |")


@pytest.mark.parametrize("args, message", [
    (["--method", "esd", "--concept", "circle"],
     "error: unknown tiny-world style 'circle'; valid: plain, striped, dotted, checkered"),
    (["--method", "esd"], "error: --method and --concept go together (the cell whose erased model is measured)"),
    (["--summary", "no_such.json"], "error: no measurement file no_such.json; pass files written with --json"),
])
def test_bad_arguments_are_one_line_errors(args: list[str], message: str, capsys) -> None:
    assert sf.main(args) == 2
    assert capsys.readouterr().err.strip() == message
