"""Reference data of the erasure methods (emma/methods/reference_data.py): shipped lists match
their PROVENANCE sha256, pinned downloads parse (tiny fixtures in tests/fixtures/reference_data
stand in for them), and offline a missing set stops a cell before any work with an error that
names the set and the command that fetches it."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import pytest

from emma.datasets.download import DataUnavailableError
from emma.files import sha256_file
from emma.methods import reference_data as rd

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "reference_data"
#: set name -> the fixture standing in for its pinned file
FIXTURE_OF = {"en3k": "english_3000.csv", "mace_templates_object": "cfr_utils.py.fixture",
              "mace_templates_style": "cfr_utils.py.fixture", "ca_captions_painting": "painting.txt",
              "ca_captions_people": "people.txt", "coco_captions_30k": "coco_30k.csv"}


@pytest.fixture
def pinned_fixtures(monkeypatch, tmp_path):
    """Every pinned set served from its tiny fixture: copied to where the cache keeps it, with
    the pin's sha256 swapped for the fixture's."""
    monkeypatch.setenv("EMMA_CACHE", str(tmp_path))
    sets = dict(rd.SETS)
    for name, ref in rd.SETS.items():
        if ref.remote is None:
            continue
        src = FIXTURES / FIXTURE_OF[name]
        remote = dataclasses.replace(ref.remote, sha256=sha256_file(src))
        dest = remote.cache_path()
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        sets[name] = dataclasses.replace(ref, remote=remote)
    monkeypatch.setattr(rd, "SETS", sets)
    return sets


def test_every_pinned_set_has_a_fixture_and_every_shipped_set_its_file():
    for name, ref in rd.SETS.items():
        assert (ref.file is None) != (ref.remote is None), name
        if ref.remote is not None:
            assert (FIXTURES / FIXTURE_OF[name]).is_file(), name
            assert re.fullmatch(r"[0-9a-f]{40}", ref.remote.commit) and re.fullmatch(r"[0-9a-f]{64}", ref.remote.sha256)
        else:
            assert (rd.DATA_DIR / ref.file).is_file(), name
        assert ref.licence, f"{name} states no licence"


def test_shipped_files_match_their_provenance():
    table = (rd.DATA_DIR / "PROVENANCE.md").read_text(encoding="utf-8")
    rows = {cells[1].strip(): cells for line in table.splitlines() if line.startswith("| ")
            and (cells := line.split("|"))[1].strip() in rd.SETS}
    shipped = {n for n, r in rd.SETS.items() if r.file is not None}
    assert set(rows) == shipped
    for name in shipped:
        cells = rows[name]
        assert cells[2].strip() == rd.SETS[name].file
        assert cells[-2].strip() == sha256_file(rd.DATA_DIR / rd.SETS[name].file), f"{name}: sha256 differs"
        assert re.search(r"[0-9a-f]{7,40}", cells[3]) or "this harness" in cells[3], f"{name}: no source commit"


def test_shipped_sets_load():
    artists = rd.load("artists1734")
    assert len(artists) == 1734 == len(set(artists)) and artists[0] == "A.J.Casson"
    retain = rd.load("advunlearn_coco_object_retain")
    assert len(retain) == 243 and retain[0] == "a photo of chair"
    supers = rd.load("coco_supercategories")
    assert len(supers) == 80 and supers["giraffe"] == "animal"  # 79 classes + _default
    from emma.domains import load_domain

    assert set(load_domain("object").concepts) <= set(supers)


def test_pinned_sets_parse_from_their_fixtures(pinned_fixtures):
    assert rd.load("en3k") == ["a", "abandon", "ability", "able", "circle", "square"]
    assert rd.load("mace_templates_object") == ["{} in a photo", "A snapshot of {}", "An image of {}"]
    assert rd.load("mace_templates_style") == ["An artwork by {}", "A sketch by {}"]
    assert rd.load("ca_captions_painting") == ["A painting of a harbour", "Watercolor of a garden"]
    assert rd.load("coco_captions_30k") == ["A dog on a bed.", "Two cats on a sofa."]
    assert rd.resolve(["x", "<data:ca_captions_people>"]) == ["x", "people at a table", "a man reading"]


def test_a_missing_pinned_set_offline_names_the_set_and_the_command(monkeypatch, tmp_path):
    monkeypatch.setenv("EMMA_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataUnavailableError) as info:
        rd.load("en3k")
    msg = str(info.value)
    assert "'en3k'" in msg and "python -m emma.suites download set=en3k" in msg and "\n" not in msg
    with pytest.raises(Exception, match="unknown reference data set 'en3kk'.*Did you mean 'en3k'"):
        rd.load("en3kk")


def test_check_available_looks_only_at_the_domain_s_entries(pinned_fixtures, monkeypatch, tmp_path):
    cfg = {"preserve_concepts": {"default": [], "style": ["<data:artists1734>"]},
           "vocabulary": "<data:en3k>", "prompt_templates": {"default": "<data:mace_templates_object>",
                                                             "tinyworld": ["a {}"]}}
    assert rd.check_available(cfg, "tinyworld") == ["en3k"]
    assert rd.check_available(cfg, "style") == ["artists1734", "en3k", "mace_templates_object"]
    monkeypatch.setenv("EMMA_CACHE", str(tmp_path / "empty"))  # nothing cached, offline
    with pytest.raises(DataUnavailableError, match="download set=en3k"):
        rd.check_available(cfg, "object")


def test_an_sd_cell_needing_a_missing_set_is_refused_before_any_work(tmp_path, monkeypatch):
    """EAP on SD names EN3K: offline and uncached, setup stops with the fetch command."""
    from emma.registry import compose
    from emma.stages.setup import setup

    monkeypatch.setenv("EMMA_CACHE", str(tmp_path))
    cfg = compose(["model=sd14", "domain=tinyworld", "method=eap", "model.device=cpu", f"paths.cache_dir={tmp_path}",
                   "classifier=tinyworld", "classifier.weights=null"])
    with pytest.raises(DataUnavailableError, match=r"'en3k'.*python -m emma.suites download set=en3k"):
        setup(cfg, lookup=False)


def test_the_download_command_knows_the_reference_sets(pinned_fixtures, capsys):
    from emma.suites import main

    assert main(["download", "set=en3k"]) == 0
    assert "english_3000.csv" in capsys.readouterr().out
    assert main(["download", "set=artists1734"]) == 0
    assert "shipped with the package" in capsys.readouterr().out
    assert main(["download", "set=nope"]) == 2
    assert "en3k" in capsys.readouterr().err
