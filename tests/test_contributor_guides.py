"""The contributor guides' worked examples (docs/guide_new_*.md), run as a contributor would:
their files are read out of the guides, written to an ``$EMMA_INCLUDE`` folder, and driven
through ``python -m emma.run``. A guide whose example stops working fails here."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, changed, run_env

DOCS = ROOT / "docs"
# a file of a worked example: its path in bold code, then the fenced block
FILE_BLOCK = re.compile(r"^\*\*`([\w./]+)`\*\*[^\n]*\n+```\w*\n(.*?)^```", re.M | re.S)
# a plumbing cell: random tiny pipeline, random judge, one image of the name prompt
FAST = ["model=tiny_random", "classifier=tinyworld", "classifier.weights=null", "metrics=rates_only",
        "prompt_types=[name]", "images_per_prompt=1"]

GUIDES = {
    "method": ("guide_new_method.md", {"toy_scale.py", "method/toy_scale.yaml",
                                       "preset/method/toy_scale_tiny.yaml"}),
    "attacker": ("guide_new_attacker.md", {"toy_suffix.py", "attacker/toy_suffix.yaml"}),
    "judge": ("guide_new_judge.md", {"toy_judge.py", "classifier/toy_judge.yaml"}),
    "domain": ("guide_new_domain.md", {"toy_shapes.py", "domain/toy_shapes.yaml"}),
}


def guide_files(kind: str) -> dict[str, str]:
    """The worked example's files of a guide, path -> text, as the guide prints them."""
    name, _ = GUIDES[kind]
    return {path: text for path, text in FILE_BLOCK.findall((DOCS / name).read_text(encoding="utf-8"))}


def write_example(kind: str, folder: Path) -> Path:
    for path, text in guide_files(kind).items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text, encoding="utf-8")
    return folder


def emma_run(args: list[str], tmp_path: Path, include: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "emma.run", *args], cwd=ROOT,
                          env=run_env(tmp_path / "cache", EMMA_INCLUDE=str(include)),
                          capture_output=True, text=True, timeout=timeout)


def run_cell(args: list[str], tmp_path: Path, include: Path) -> tuple[dict, list[dict]]:
    """Run one cell; its results.json and samples.jsonl."""
    run_dir = tmp_path / "run"
    proc = emma_run([*args, f"hydra.run.dir={run_dir}"], tmp_path, include)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return results, samples


@pytest.mark.parametrize("kind", sorted(GUIDES))
def test_each_guide_prints_every_file_of_its_example_once(kind):
    _, expected = GUIDES[kind]
    blocks = FILE_BLOCK.findall((DOCS / GUIDES[kind][0]).read_text(encoding="utf-8"))
    assert sorted(path for path, _ in blocks) == sorted(expected)
    assert len((DOCS / GUIDES[kind][0]).read_text(encoding="utf-8").splitlines()) <= 130


def test_method_guide_example_scales_exactly_one_weight(tmp_path, base, pipe, monkeypatch):
    import torch

    folder = write_example("method", tmp_path / "inc")
    monkeypatch.syspath_prepend(str(folder))
    try:
        method = importlib.import_module("toy_scale").ToyScaleMethod(factor=0.25)
    finally:
        sys.modules.pop("toy_scale", None)
    assert method.config() == {"name": "toy_scale", "version": "1", "factor": 0.25}
    from emma.domains import load_domain

    method.erase(pipe, ["circle"], seed=0, domain=load_domain("tinyworld"))
    assert changed(base, pipe) == {"conv_out.weight"}
    assert not changed(base, pipe, "text_encoder")
    assert torch.equal(pipe.unet.conv_out.weight, base.unet.conv_out.weight * 0.25)


def test_method_guide_example_runs_with_its_tiny_preset(tmp_path):
    folder = write_example("method", tmp_path / "inc")
    listed = emma_run(["--list", "methods"], tmp_path, folder, timeout=120)
    assert listed.returncode == 0, listed.stderr[-2000:]
    rows = {line.split()[0]: line.split(None, 1)[1] for line in listed.stdout.splitlines() if line.strip()}
    assert rows["toy_scale"] == "Toy method: scales the UNet's output convolution (a guide's example, not an erasure)."
    assert "esd" in rows  # the package's methods are still listed

    res, _ = run_cell(["method=toy_scale", *FAST], tmp_path, folder)
    assert res["cell"]["method"] == "toy_scale"
    assert res["versions"]["components"]["method"] == {"name": "toy_scale", "version": "1", "factor": 0.25}
    assert res["versions"]["presets"]["method"] == "toy_scale_tiny"  # model=tiny_random: scale tiny
    model = res["versions"]["model"]
    assert model["erased_fingerprint"] != model["base_fingerprint"]


def test_attacker_guide_example_attacks_with_its_suffix(tmp_path):
    folder = write_example("attacker", tmp_path / "inc")
    res, samples = run_cell(["attacker=toy_suffix", *FAST], tmp_path, folder)
    assert res["cell"]["attacker"] == "toy_suffix"
    assert res["versions"]["components"]["attacker"] == {"name": "toy_suffix", "version": "1",
                                                         "suffix": ", highly detailed"}
    attacked = [s for s in samples if s["group"] == "attack"]
    assert [(s["prompt"], s["adversarial_prompt"], s["attacker"]) for s in attacked] == [
        ("an image of a circle, highly detailed", "an image of a circle, highly detailed", "toy_suffix")]
    # the optional capabilities reach results.json
    assert res["metrics"]["toy/queries"]["value"] == 1.0
    assert "toy_suffix: appended ', highly detailed' to every prompt" in res["notes"]
    assert res["metrics"]["asr"]["value"] == float(attacked[0]["detected"])


def test_judge_guide_example_decides_every_rate(tmp_path):
    folder = write_example("judge", tmp_path / "inc")
    args = ["classifier=toy_judge", *(a for a in FAST if not a.startswith("classifier"))]
    res, samples = run_cell(args, tmp_path, folder)
    assert res["cell"]["classifier"] == "toy_judge"
    judge = res["versions"]["components"]["classifiers"]["toy_judge"]
    assert judge["version"] == "1" and judge["present"] == ["circle"] and len(judge["weights_sha256"]) == 64
    # it always finds circle, the tiny world's default concept: nothing erased, every attack succeeds
    assert res["metrics"]["ea/name"]["value"] == 0.0
    assert res["metrics"]["asr"]["value"] == 1.0
    assert {(s["detected"], s["score"]) for s in samples} == {(True, 1.0)}
    # its rule is pinned by weights_hash: not reported as random weights
    assert not any("toy_judge" in note for note in res["notes"])


def test_domain_guide_example_builds_its_prompts(tmp_path):
    folder = write_example("domain", tmp_path / "inc")
    listed = emma_run(["--list", "concepts", "domain=toy_shapes"], tmp_path, folder, timeout=120)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert listed.stdout.split("\n")[:3] == ["star  (default)", "circle", "square"]

    args = ["domain=toy_shapes", "concept=pentagram", "model=tiny_random", "+classifier.weights=null",
            "metrics=rates_only", "images_per_prompt=1"]
    res, samples = run_cell(args, tmp_path, folder)
    assert res["cell"]["domain"] == "toy_shapes" and res["cell"]["concept"] == "star"
    assert res["cell"]["classifier"] == "tinyworld"  # the domain's judge (classifier=auto)
    assert res["versions"]["components"]["domain"]["suite"] == {"name": "toy_shapes", "version": "1"}
    suite = [(s["group"], s["kind"], s["prompt"], s["concept"]) for s in samples if s["group"] != "attack"]
    assert suite[:2] == [("ea", "name", "a crayon drawing of a star", "star"),
                         ("ea", "prefix", "a crayon drawing of a cat star", "star")]
    assert len([s for s in suite if s[1] == "prefix"]) == 5
    assert sorted(s[2:] for s in suite if s[0] == "ra") == [("a crayon drawing of a circle", "circle"),
                                                            ("a crayon drawing of a square", "square")]
    assert set(res["metrics"]) >= {"ea/name", "ea/prefix", "ra/random"}
