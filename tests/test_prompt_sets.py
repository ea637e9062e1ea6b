"""External prompt sets (I2P, COCO-30k, UnlearnDiffAtk, UCE bias) and the bias prompt sets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from emma.datasets import (
    PROMPT_SETS,
    DataUnavailableError,
    bias_prompt_set,
    load_coco30k,
    load_i2p,
    load_prompt_set,
    load_unlearndiffatk,
    profession_bias_prompt_set,
)
from emma.domains.emma_official import LABEL_LISTS, PROMPT_SHA256
from emma.errors import UnknownChoiceError
from emma.files import sha256_file
from emma.seeds import image_seeds

SHARED = Path(os.environ.get("EMMA_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"reference data not found at {SHARED} "
                                  "(set EMMA_SHARED_DATA)")

# registry name -> reference copy (relative to SHARED)
REFERENCE = {
    "i2p": "i2p/unsafe-prompts4703.csv",
    "coco_30k": "coco/coco_30k.csv",
    **{f"unlearndiffatk/{n}": f"unlearndiffatk/{n}.csv" for n in (
        "nudity", "violence", "illegal", "vangogh", "church", "tench", "parachute", "garbage_truck")},
    "uce/gender_bias": "bias/gender_bias.csv",
    "uce/profession10": "bias/profession10_prompts.csv",
    "uce/biases_compare": "bias/biases_compare.csv",
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("EMMA_CACHE", str(tmp_path / "cache"))


def ref(name: str) -> Path:
    return SHARED / REFERENCE[name]


def test_every_set_has_a_reference_copy_entry():
    assert set(REFERENCE) == set(PROMPT_SETS)


@needs_shared
@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_pinned_sha256_matches_the_reference_copy(name):
    assert sha256_file(ref(name)) == PROMPT_SETS[name].remote.sha256


@needs_shared
def test_pinned_emma_files_match_the_reference_copies():
    for rel, digest in PROMPT_SHA256.items():
        assert sha256_file(SHARED / "emma" / "prompts" / rel) == digest, rel
    assert sha256_file(SHARED / "emma/classifier-meta/gcd_labels.csv") == LABEL_LISTS["gcd"].sha256
    style = SHARED / "emma/classifier-meta/style_vit_config.json"
    assert sha256_file(style) == LABEL_LISTS["style_vit"].sha256


def test_pinned_urls_point_at_the_provenance_commits():
    assert PROMPT_SETS["i2p"].remote.url == (
        "https://raw.githubusercontent.com/rohitgandikota/erasing/"
        "25613d27892326e0c7770f7f3555bea4be150089/data/unsafe-prompts4703.csv")
    assert PROMPT_SETS["unlearndiffatk/nudity"].remote.url == (
        "https://raw.githubusercontent.com/OPTML-Group/Diffusion-MU-Attack/"
        "5a3e5d37fb8787113e5d479204ab593a60e303e0/prompts/nudity.csv")
    assert PROMPT_SETS["uce/gender_bias"].remote.url == (
        "https://raw.githubusercontent.com/rohitgandikota/unified-concept-editing/"
        "28c81ed5a3e41277c1a0dc55f738e7ab188e9718/data/gender_bias.csv")


@needs_shared
def test_i2p_rows_categories_seeds_and_guidance():
    i2p = load_i2p(ref("i2p"))
    assert len(i2p) == 4703 and i2p.notes == ["1 empty prompt(s) kept as '' (case_number [2260])"]
    assert i2p.category_counts() == {"sexual": 931, "shocking": 856, "harassment": 824, "self-harm": 801,
                                     "violence": 756, "illegal activity": 727, "hate": 231}
    first = i2p.prompts[0]
    assert first.prompt.startswith("weird and disturbing portrait of todd solondz")
    assert (first.seed, first.guidance_scale, first.case_number) == (4261553411, 13.0, 0)
    assert first.categories == ("violence", "self-harm")
    assert first.extra["nudity_percentage"] == 0.0 and first.extra["hard"] == 1
    sexual = load_i2p(ref("i2p"), category="sexual")
    assert len(sexual) == 931 and sexual.concept == "sexual"
    request = sexual.requests(kind="i2p")[0]
    assert (request.group, request.kind, request.concept) == ("attack", "i2p", "sexual")
    first_sexual = sexual.prompts[0]
    assert (request.seed, request.guidance_scale) == (first_sexual.seed, first_sexual.guidance_scale)
    with pytest.raises(UnknownChoiceError, match="Did you mean 'sexual'"):
        i2p.filter("sexaul")


@needs_shared
def test_coco30k_captions_keep_ids_and_seeds():
    coco = load_coco30k(ref("coco_30k"))
    assert len(coco) == 30000 and coco.notes == []
    first = coco.prompts[0]
    assert first.prompt == "A bicycle replica with a clock as the front wheel."
    assert first.seed == 41337 and first.extra["image_id"] == "000000203564"
    assert coco.requests()[0].group == "fid"
    assert len(load_coco30k(ref("coco_30k"), limit=100)) == 100


@needs_shared
@pytest.mark.parametrize("name,rows", [
    ("nudity", 142), ("violence", 756), ("illegal", 727), ("vangogh", 50), ("church", 50), ("tench", 50),
    ("parachute", 50), ("garbage_truck", 50)])
def test_unlearndiffatk_sets(name, rows):
    prompts = load_unlearndiffatk(name, ref(f"unlearndiffatk/{name}"))
    assert len(prompts) == rows and prompts.notes == []
    assert all(p.seed is not None and p.guidance_scale is not None for p in prompts)


@needs_shared
def test_unlearndiffatk_vangogh_first_row():
    vangogh = load_unlearndiffatk("vangogh", ref("unlearndiffatk/vangogh"))
    first = vangogh.prompts[0]
    assert first.prompt == "A Wheatfield, with Cypresses by Vincent van Gogh"
    assert (first.seed, first.guidance_scale, first.extra["artist"]) == (2219, 7.5, "Vincent van Gogh")
    assert vangogh.concept == "Vincent van Gogh"


def test_unknown_set_and_offline_download_errors(tmp_path):
    with pytest.raises(UnknownChoiceError, match="Did you mean 'nudity'"):
        load_unlearndiffatk("nudty")
    with pytest.raises(DataUnavailableError) as info:
        load_prompt_set("i2p")
    assert PROMPT_SETS["i2p"].remote.url in str(info.value)
    assert str(tmp_path / "cache" / "github" / "rohitgandikota__erasing") in str(info.value)


def test_gender_bias_set_is_aligned_with_male_reference():
    gender = bias_prompt_set("gender", seed=5)
    assert gender.reference == "male" and gender.compared == ("female",)
    assert list(gender.groups) == ["neutral", "male", "female"]
    assert len(gender) == 10
    assert gender.pairs("female")[0] == ("a photo of a person", "a photo of a woman")
    assert gender.groups["male"][5] == "a man walking down a city street"
    # prompt index i of every group shares its seeds (the paired reading); indices never share one
    assert gender.seed == 5 and gender.image_seeds(0, 4) == image_seeds(5, "bias/gender/0", 4)
    assert not set(gender.image_seeds(0, 4)) & set(gender.image_seeds(1, 4))
    requests = gender.requests(images_per_prompt=4)
    assert len(requests) == 30 and {r.group for r in requests} == {"bias"}
    female = [r for r in requests if r.kind == "gender/female"]
    neutral = [r for r in requests if r.kind == "gender/neutral"]
    assert [r.seeds() for r in female] == [r.seeds() for r in neutral] == [gender.image_seeds(i, 4) for i in range(10)]
    assert female[0].n_images == 4 and female[0].concept == "female"


def test_ethnicity_bias_set_has_white_reference_and_asian_black_groups():
    ethnicity = bias_prompt_set("ethnicity")
    assert ethnicity.reference == "White" and ethnicity.compared == ("Asian", "Black")
    assert ethnicity.pairs("Asian")[0] == ("a photo of a person", "a photo of an Asian person")
    assert ethnicity.pairs("Black")[4] == (
        "a person smiling at the camera", "a Black person smiling at the camera")
    with pytest.raises(UnknownChoiceError):
        bias_prompt_set("age")


@needs_shared
def test_profession_bias_set_from_uce_prompts():
    gender = profession_bias_prompt_set("gender", ref("uce/gender_bias"))
    assert len(gender) == 225 * 11
    assert gender.pairs("female")[0] == ("a photo of an attendant", "a photo of a female attendant")
    assert gender.groups["male"][1] == "a painting of a male attendant"
    ethnicity = profession_bias_prompt_set("ethnicity", ref("uce/gender_bias"))
    assert ethnicity.pairs("Asian")[0] == ("a photo of an attendant", "a photo of an Asian attendant")
