"""Image seeds (emma.seeds): derived per (cell seed, prompt, image index, stream), so cells with
different seeds share no image, search and evaluation never share a seed, and a seed
reproduces its cell's images byte for byte."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from PIL import Image

from emma.api.types import PromptRequest
from emma.pipelines import TINYWORLD_DIR
from emma.seeds import EVALUATION, GENERATOR_SEED_LIMIT, SEARCH, image_seed, image_seeds, stream_of


def test_the_documented_derivation():
    # the module docstring's recipe, written out independently
    text = json.dumps(["emma.seeds", "1", "evaluation", 43, "an image of a circle", 2, 0])
    expected = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") & 0x7FFFFFFF
    assert image_seed(43, "an image of a circle", 2) == expected
    search = image_seed(43, "an image of a circle", 2, SEARCH)
    text = json.dumps(["emma.seeds", "1", "search", 43, "an image of a circle", 2, 0])
    assert search == (int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") & 0x7FFFFFFF) | 2**31


def test_seeds_of_neighbouring_cells_do_not_overlap_and_stay_in_the_generators_range():
    a = image_seeds(43, "an image of a circle", 60)
    b = image_seeds(44, "an image of a circle", 60)
    assert len(set(a)) == 60 and not set(a) & set(b)  # seed + i shared 59 of 60
    # image i's seed does not depend on how many images follow it
    assert image_seeds(43, "an image of a circle", 5) == a[:5] and image_seed(43, "an image of a circle", 7) == a[7]
    for s in a + b:
        assert 0 <= s < 2**31 and stream_of(s) == EVALUATION
    search = image_seeds(43, "an image of a circle", 60, SEARCH)
    assert all(2**31 <= s < GENERATOR_SEED_LIMIT and stream_of(s) == SEARCH for s in search)
    assert not set(search) & set(a)
    # the largest cell seed the validation admits derives seeds in range too (no wrap onto seed 0's)
    top = image_seeds(2**31 - 1, "an image of a circle", 10)
    assert max(top) < 2**31 and not set(top) & set(image_seeds(0, "an image of a circle", 10))
    with pytest.raises(ValueError, match="valid streams are evaluation, search"):
        image_seeds(0, "x", 1, "eval")


def test_requests_derive_their_seeds_from_their_identity():
    r = PromptRequest("an image of a circle", "circle", "ea", "name", seed=43, n_images=4)
    assert r.seeds() == image_seeds(43, "an image of a circle", 4)
    assert r.search_seeds(2) == image_seeds(43, "an image of a circle", 2, SEARCH)
    # an adversarial prompt keeps its original prompt's seeds (paired with the static suite's images)
    adv = PromptRequest("zz circle", "circle", "attack", "name", seed=43, n_images=4, seed_key=r.identity)
    assert adv.seeds() == r.seeds()
    other = PromptRequest("an image of a square", "square", "ea", "name", seed=43, n_images=4)
    assert not set(other.seeds()) & set(r.seeds())


def _cell_pixels(tmp_path, seed: int, cache_name: str) -> tuple[dict[str, str], list[dict]]:
    """Run a tiny-world cell; return {cache PNG file: sha256 of its pixels} and its samples."""
    from emma.cell import run_cell
    from tests.test_attackers_tinyworld import compose

    cache = tmp_path / cache_name
    out = tmp_path / f"out-{cache_name}"
    cfg = compose("method=none", "prompt_types=[name,variant]", "metrics=rates_only", "images_per_prompt=12",
                  f"seed={seed}", "paths.reuse_results=false", f"paths.cache_dir={cache}")
    run_cell(cfg, out)
    pngs = sorted((cache / "images").rglob("*.png"))
    assert pngs, "the cell wrote no images"
    pixels = {p.name: hashlib.sha256(np.asarray(Image.open(p).convert("RGB")).tobytes()).hexdigest() for p in pngs}
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    return pixels, samples


@pytest.mark.skipif(not TINYWORLD_DIR.exists(), reason="tiny-world assets not built")
def test_cells_with_seeds_43_and_44_share_no_image_and_a_seed_reproduces_itself(tmp_path):
    a, samples_a = _cell_pixels(tmp_path, 43, "a")
    b, _ = _cell_pixels(tmp_path, 44, "b")
    again, samples_again = _cell_pixels(tmp_path, 43, "again")
    drawn = [s for s in samples_a if s.get("group") in ("ea", "ra")]
    assert len(drawn) == len(a) >= 60  # every suite image is its own PNG
    assert not set(a.values()) & set(b.values())  # not one image in common
    assert not set(a) & set(b)  # nor one cache entry
    assert again == a  # the same seed: the same images, pixel for pixel, under the same keys
    assert [s["image_hash"] for s in samples_again] == [s["image_hash"] for s in samples_a]
    # samples.jsonl's seeds are the derived ones
    r = drawn[0]
    assert r["seed"] in image_seeds(43, r["prompt"], 12)
