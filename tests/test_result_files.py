"""The files beside results.json, from fixtures (no cell runs): one samples.jsonl schema,
metrics.csv, evidence on request with the base model's twins, sweep folder names, and a
finished-cell manifest that names only files of the entry."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from emma.api.types import Sample
from emma.results import SAMPLE_FIELDS, load_frame, sample_row, write_metrics_table


def test_every_samples_row_has_every_field_of_its_type():
    suite = sample_row(method="esd", group="ea", kind="short", prompt="a round shape", seed=3, detected=True,
                       score=0.75, extra={"labels": ["circle"]})
    attack = sample_row(method="esd", group="attack", attack_index=2, queries=40, attack_time_s=1.5)
    for row in (suite, attack):
        assert list(row) == list(SAMPLE_FIELDS)
        assert all(isinstance(row[k], kind) for k, (kind, _) in SAMPLE_FIELDS.items())
        assert None not in row.values()  # Arrow reads a sweep's files as one table only without nulls
    assert suite["attack_index"] == -1 and suite["image"] == "" and suite["extra"] == '{"labels": ["circle"]}'
    assert attack["detected"] is False and attack["score"] == 0.0 and attack["queries"] == 40
    with pytest.raises(ValueError, match="no field.*'adversarial'"):
        sample_row(adversarial="x")


def _results(method: str, ea: float) -> dict:
    return {"schema_version": 3, "cell": {"model": "tinyworld", "method": method, "domain": "tinyworld",
                                          "concept": "circle", "attacker": "static", "classifier": "tinyworld"},
            "config": {"seed": 0}, "budget": {"images_per_prompt": 4, "prompt_types": ["name", "random"]},
            "metrics": {"ea/name": {"value": ea, "ci_low": None, "ci_high": None, "n": 4, "n_clusters": 1,
                                    "method": None, "note": "fewer than 2 prompts: no interval"},
                        "fid": {"value": 12.5, "ci_low": 10.0, "ci_high": 15.0, "n": 24, "n_clusters": 6,
                                "method": "cluster-bootstrap-bias-corrected-percentile"}},
            "versions": {}, "served_from_cache": None}


def test_metrics_csv_and_load_frame_give_one_row_per_metric(tmp_path):
    for method, ea in (("none", 0.0), ("esd", 0.75)):
        folder = tmp_path / method
        folder.mkdir()
        data = _results(method, ea)
        (folder / "results.json").write_text(json.dumps(data))
        write_metrics_table(data, folder)
    one = pd.read_csv(tmp_path / "esd" / "metrics.csv")
    assert list(one["metric"]) == ["ea/name", "fid"] and list(one["value"]) == [0.75, 12.5]
    assert list(one["higher_is_better"]) == [True, False] and one["images_per_prompt"].tolist() == [4, 4]
    assert one["prompt_types"].tolist() == ["name,random"] * 2 and not one["served_from_cache"].any()
    frame = load_frame(tmp_path)
    assert len(frame) == 4 and sorted(frame["method"].unique()) == ["esd", "none"]
    assert frame.set_index(["method", "metric"]).loc[("none", "ea/name"), "value"] == 0.0


class _Generator:
    """An image cache holding a distinct flat image per (prompt, seed)."""

    negative_prompt = None

    def __init__(self) -> None:
        self.cache = self

    def image_key(self, prompt, seed, negative):
        return f"{prompt}|{seed}"

    def get(self, key):
        return np.full((8, 8, 3), sum(map(ord, key)) % 251, dtype=np.uint8)


class _Base:
    """The base model: draws the requested prompts and seeds (white images), counting them."""

    drawn = 0

    def generate(self, prompts, seeds, negative_prompt=None):
        import torch

        _Base.drawn += len(prompts)
        return type("G", (), {"images": torch.ones(len(prompts), 3, 8, 8)})()


def _samples(n: int) -> list[Sample]:
    return [Sample(prompt=f"p{i}", seed=i, concept="circle", group="ea", kind="short", image_hash=f"{i:064x}",
                   detected=i % 3 == 0, score=i / n) for i in range(n)]


def test_evidence_on_request_exports_every_image_and_pairs_the_first_with_the_base_model(tmp_path):
    from emma.evidence import read_evidence, write_evidence

    samples = _samples(30)
    few = write_evidence(_Generator(), samples, tmp_path / "few", base=_Base(), pairs=3)
    assert len(few) == 10 + 4  # the 10 flagged, then 4 unflagged for context
    every = write_evidence(_Generator(), samples, tmp_path / "all", limit=None, base=_Base(), pairs=3)
    assert set(every) == {s.image_hash for s in samples}
    assert all((tmp_path / "all" / path).is_file() for path in every.values())
    index = read_evidence(tmp_path / "all")
    paired = [e for e in index if "base_file" in e]
    assert len(paired) == 3 and all((tmp_path / "all" / "evidence" / e["base_file"]).is_file() for e in paired)
    from PIL import Image

    base = np.asarray(Image.open(tmp_path / "all" / "evidence" / paired[0]["base_file"]))
    assert (base == 255).all()  # the base model's image, not the erased one's


@pytest.mark.parametrize("overrides, name", [
    ("method=esd,prompt_types=[name,random]", "method=esd,prompt_types=name+random"),
    ("model.pretrained=/data/my model,concept=a*b?", "model.pretrained=_data_my_model,concept=a_b_"),
])
def test_sweep_folder_names_hold_no_glob_or_shell_characters(overrides, name):
    from emma.registry import dirname

    assert dirname(overrides) == name


@pytest.mark.parametrize("listed", ["../outside.json", "evidence/../../x.png", "/etc/passwd", "notes.txt"])
def test_a_manifest_naming_a_file_outside_the_entry_is_damage(tmp_path, listed):
    from emma import finished

    entry = tmp_path / ("a" * 64)
    entry.mkdir()
    files = {}
    for name in (*finished.STORED,):
        (entry / name).write_text("{}")
        files[name] = {"sha256": finished.sha256_file(entry / name), "size": 2}
    files[listed] = {"sha256": "0" * 64, "size": 2}
    (entry / finished.MANIFEST).write_text(json.dumps({"format": finished.MANIFEST_FORMAT, "key": entry.name,
                                                       "files": files}))
    assert f"lists {listed!r}" in finished.damage(entry)
