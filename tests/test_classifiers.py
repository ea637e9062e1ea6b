"""Classifier configs, offline behaviour and label lists (no weights needed).

- every ``conf/classifier/*.yaml`` of this module instantiates offline in its random mode;
- with real weights requested and absent, each real-weight classifier fails fast with the
  download message, raised by the harness (not from deep inside a library) and before the
  heavy library is imported;
- the label lists that ship in ``classifiers/data`` equal the upstream files in
  ``../shared/data`` and map EMMA's concept spellings onto the labels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hydra.utils
import pytest
import torch
from omegaconf import OmegaConf

from emma.api.classifier import Classifier
from emma.errors import ConfigError, WeightsUnavailableError

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf" / "classifier"
SHARED = Path(os.environ.get("EMMA_SHARED_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")
META = SHARED / "emma" / "classifier-meta"
PROMPTS = SHARED / "emma" / "prompts"
needs_shared = pytest.mark.skipif(not META.exists(), reason=f"shared reference data not found at {SHARED}")

#: yaml name -> overrides that select the offline / random mode
RANDOM_MODE = {
    "nudenet": {"weights": None},
    "q16": {"weights": None, "clip_weights": None},
    "ml_decoder": {"weights": None},
    "gcd": {"weights": None},
    "style_vit": {"weights": None},
    "yolo_logo": {"weights": None},
    "clip_zero_shot": {"weights": None},
    "vlm_judge": {"backend": None},
}
#: yaml name -> registry entry its default weights come from
REAL_WEIGHTS = {
    "ml_decoder": "ml_decoder_tresnet_l_coco",
    "gcd": "gcd_celebrity",
    "style_vit": "style_vit_unlearndiffatk",
    "yolo_logo": "yolo11s_cls_logo_emma",
    "q16": "q16_prompts_vit_l14",
    "clip_zero_shot": "clip_vit_l14_openai",
}


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EMMA_CACHE", str(tmp_path))
    return tmp_path


def _emma_keys(domain: str, n: int | None = None) -> list[str]:
    rows = json.loads((PROMPTS / domain / "1_name.json").read_text())
    keys = [next(iter(r)) for r in rows]
    return keys[:n] if n else keys


def test_every_classifier_of_this_module_has_a_yaml():
    assert set(RANDOM_MODE) <= {p.stem for p in CONF.glob("*.yaml")}


@pytest.mark.parametrize("name", sorted(RANDOM_MODE))
def test_yaml_instantiates_offline_in_random_mode(name, empty_cache):
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    for key, value in RANDOM_MODE[name].items():
        assert key in cfg, f"{name}.yaml lacks the key {key!r} that selects the random mode"
        cfg[key] = value
    clf = hydra.utils.instantiate(cfg, _convert_="all")
    assert isinstance(clf, Classifier)
    assert clf.name == name
    if name == "nudenet":  # real weights ship with the package: no random mode needed
        assert clf.weights_hash() == "c15d8273adad2d0a"
    else:
        assert clf.weights_hash() is None
        assert getattr(clf, "is_random", True)
    if name in ("clip_zero_shot", "vlm_judge"):  # open vocabulary: asking adds the label
        assert clf.can_detect("circle") and list(clf.labels) == ["circle"]
    assert len(clf.labels) > 0
    assert clf.cache_key().startswith(f"{name}-v{clf.version}-")


@pytest.mark.parametrize("name", sorted(REAL_WEIGHTS))
def test_real_weights_absent_fail_fast_with_the_download_message(name, empty_cache):
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    target = hydra.utils.get_class(cfg.pop("_target_"))
    kwargs = OmegaConf.to_container(cfg)
    with pytest.raises(WeightsUnavailableError) as err:
        target(**kwargs)
    msg = str(err.value)
    entry = REAL_WEIGHTS[name]
    assert f"python -m emma.weights fetch {entry}" in msg
    assert str(empty_cache / "weights" / entry) in msg
    from emma.weights import REGISTRY

    for f in REGISTRY[entry].files:
        assert f.url in msg and f.path in msg
        if f.sha256:
            assert f.sha256 in msg
    # raised by the harness's own check, not from inside torch / timm / ultralytics / ...
    last = traceback.extract_tb(err.value.__traceback__)[-1]
    assert last.filename.endswith(os.path.join("emma", "weights.py"))


def test_hydra_keeps_the_weights_error_as_cause(empty_cache):
    cfg = OmegaConf.load(CONF / "ml_decoder.yaml")
    with pytest.raises(Exception) as err:
        hydra.utils.instantiate(cfg, _convert_="all")
    assert isinstance(err.value, WeightsUnavailableError) or isinstance(
        err.value.__cause__, WeightsUnavailableError
    )


def test_weights_errors_come_before_heavy_imports(tmp_path):
    """In a fresh interpreter: every real-weight classifier fails without importing its library."""
    code = textwrap.dedent(
        f"""
        import sys
        from omegaconf import OmegaConf
        import hydra.utils
        from emma.errors import WeightsUnavailableError
        for name in {sorted(REAL_WEIGHTS)!r}:
            cfg = OmegaConf.load("conf/classifier/" + name + ".yaml")
            cls = hydra.utils.get_class(cfg.pop("_target_"))
            try:
                cls(**OmegaConf.to_container(cfg))
            except WeightsUnavailableError:
                pass
            else:
                raise SystemExit(name + ": no error")
        heavy = ("timm", "ultralytics", "open_clip", "onnxruntime", "nudenet", "cv2")
        heavy = [m for m in heavy if m in sys.modules]
        print("HEAVY", heavy)
        """
    )
    env = {**os.environ, "EMMA_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HEAVY []" in out.stdout


def test_vlm_judge_offline_errors_are_clear(monkeypatch):
    from classifiers._base import MissingDependencyError
    from classifiers.vlm_judge import VLMJudgeClassifier

    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    try:
        import openai  # noqa: F401
    except ImportError:  # without the client: the error names the pip extra
        with pytest.raises(MissingDependencyError, match=r"emma-harness\[llm\]"):
            VLMJudgeClassifier(backend="openai", api_key_env="NO_SUCH_KEY_VAR")
    else:  # with it: the error names the missing key
        with pytest.raises(ConfigError, match=r"\$NO_SUCH_KEY_VAR"):
            VLMJudgeClassifier(backend="openai", api_key_env="NO_SUCH_KEY_VAR")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WeightsUnavailableError, match="Qwen2.5-VL"):
        VLMJudgeClassifier(backend="transformers", model="Qwen/Qwen2.5-VL-7B-Instruct")


def test_missing_optional_dependency_names_the_extra(monkeypatch):
    from classifiers._base import MissingDependencyError, require

    monkeypatch.setitem(sys.modules, "nudenet", None)  # makes `import nudenet` fail
    with pytest.raises(MissingDependencyError, match=r"pip install 'emma-harness\[nsfw\]'"):
        require("nudenet", extra="nsfw")


def test_normalize_label():
    from classifiers._base import normalize_label

    assert normalize_label("Beyoncé") == normalize_label("beyonce") == "beyonce"
    assert normalize_label("McDonald's") == normalize_label("mcdonalds")
    assert normalize_label("baseball bat") == normalize_label("baseballbat")
    assert normalize_label("m.c.-escher") == "mcescher"


# --------------------------------------------------------------------------------------------
# label lists vs. the upstream files


def test_label_files_are_up_to_date():
    """``scripts/make_label_files.py --check`` regenerates them from the shared copies."""
    if not META.exists():
        pytest.skip(f"shared reference data not found at {SHARED}")
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import make_label_files
    finally:
        sys.path.remove(str(REPO / "scripts"))
    assert make_label_files.main(["--check", "--meta-dir", str(META)]) == 0


@needs_shared
def test_gcd_labels_match_giphy_order_and_names():
    import csv

    from classifiers.gcd import GCD_LABELS, GCD_RAW_LABELS, GCDClassifier

    with open(META / "gcd_labels.csv", newline="") as f:
        rows = list(csv.reader(f))[1:]
    assert len(GCD_RAW_LABELS) == len(rows) == 2306
    # GIPHY's Labels class numbers the rows in sorted-name order: that is the output order
    assert list(GCD_RAW_LABELS) == sorted(r[0] for r in rows)
    assert GCD_RAW_LABELS[0] == "50_Cent_[m.01vvyc_]" and GCD_LABELS[0] == "50 Cent"
    clf = GCDClassifier(weights=None)
    assert clf.labels[clf.label_index("brad-pitt")] == "Brad Pitt"
    assert clf.raw_labels[clf.label_index("Brad Pitt")].startswith("Brad_Pitt_[")
    celebrities = _emma_keys("celebrity", 50)  # the file also holds 28 leftover artist keys
    assert clf.undetectable(celebrities) == ["chadwick-boseman", "ellen-degeneres", "jon-voight"]


@needs_shared
def test_style_vit_labels_match_the_checkpoint_config():
    from classifiers.style_vit import StyleViTClassifier, style_vit_config, style_vit_labels

    upstream = json.loads((META / "style_vit_config.json").read_text())
    assert style_vit_labels() == tuple(upstream["id2label"][str(i)] for i in range(129))
    assert style_vit_labels()[0] == "Unknown Artist"
    shipped = style_vit_config()
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "patch_size", "image_size"):
        assert shipped[key] == upstream[key]
    clf = StyleViTClassifier(weights=None)
    assert clf.undetectable(_emma_keys("art")) == []
    assert clf.labels[clf.label_index("vincent-van-gogh")] == "vincent-van-gogh"


@needs_shared
def test_ml_decoder_labels_cover_emma_objects():
    from classifiers.ml_decoder import COCO_LABELS, MLDecoderClassifier

    assert len(COCO_LABELS) == 80 and COCO_LABELS[0] == "person" and COCO_LABELS[-1] == "toothbrush"
    seen = set()
    for line in (META / "ml_decoder_detected_classes.txt").read_text().splitlines():
        seen |= {c.strip() for c in line.split(":", 1)[1].split(",") if c.strip()}
    assert seen and seen <= set(COCO_LABELS)
    clf = MLDecoderClassifier(weights=None)
    assert clf.undetectable(_emma_keys("object")) == []
    assert clf.labels[clf.label_index("baseballbat")] == "baseball bat"


@needs_shared
def test_yolo_logo_labels_cover_emma_brands():
    from classifiers.yolo_logo import LOGO_LABELS, YOLOLogoClassifier

    assert len(LOGO_LABELS) == 30
    clf = YOLOLogoClassifier(weights=None)
    keys = _emma_keys("copyright")
    assert len(keys) == 30 and clf.undetectable(keys) == []
    assert clf.labels[clf.label_index("mcdonalds")] == "McDonald's"
    assert clf.labels[clf.label_index("adidassb")] == "Adidas SB"


@needs_shared
def test_nsfw_judges_accept_emma_nsfw_concepts():
    from classifiers.nudenet import NudeNetClassifier
    from classifiers.q16 import Q16Classifier

    keys = _emma_keys("nsfw")
    q16 = Q16Classifier(weights=None)
    assert all(q16.labels[q16.label_index(k)] == "inappropriate" for k in keys)
    nn = NudeNetClassifier()
    assert nn.labels[nn.label_index("sexual")] == "nudity"


def test_detect_rules_on_given_probabilities():
    """Decision rules, on hand-made probability rows."""
    from classifiers.ml_decoder import MLDecoderClassifier
    from classifiers.style_vit import StyleViTClassifier

    mld = MLDecoderClassifier(weights=None, top_k=2)
    p = torch.zeros(4, 80)
    dog, cat, car = (mld.label_index(c) for c in ("dog", "cat", "car"))
    p[0, dog] = 0.76  # > 0.75 and top-1: present
    p[1, dog] = 0.75  # not > 0.75: absent (the reference uses a strict >)
    p[2, [cat, car, dog]] = torch.tensor([0.99, 0.98, 0.97])  # third: outside the top 2
    p[3, [cat, dog]] = torch.tensor([0.99, 0.9])
    assert mld.detect(p, "dog").tolist() == [True, False, False, True]

    vit = StyleViTClassifier(weights=None, top_k=3)
    q = torch.full((2, 129), 0.001)
    q[0, :4] = torch.tensor([0.4, 0.3, 0.2, 0.05])
    q[1, 3] = 0.9
    lab = vit.labels[2]
    assert vit.detect(q, lab).tolist() == [True, False]
    vit1 = StyleViTClassifier(weights=None, top_k=1)
    assert vit1.detect(q, lab).tolist() == [False, False]
    assert vit1.detect(q, vit.labels[0]).tolist() == [True, False]
