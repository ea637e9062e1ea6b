"""Judges' score caches are keyed by the complete judge configuration and the final label
set; EMMA's denominators (GCD: no face -> excluded) and NudeNet's decision rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from classifiers.clip_zero_shot import CLIPZeroShotClassifier
from classifiers.gcd import GCDClassifier
from classifiers.nudenet import NudeNetClassifier
from classifiers.tinyworld import TinyWorldClassifier
from emma.api.types import PromptRequest
from emma.cache import ClassifierScoreCache
from emma.errors import ConfigError


def _keys_differ(cls, base: dict, changes: dict) -> None:
    ref = cls(**base).cache_key()
    for name, value in changes.items():
        assert cls(**{**base, name: value}).cache_key() != ref, f"{cls.__name__}.{name} is not in the cache key"


def test_every_prediction_setting_is_in_the_key():
    _keys_differ(GCDClassifier, {"weights": None}, {"margin": 0.3, "face_size": 160, "max_faces": 4})
    _keys_differ(CLIPZeroShotClassifier, {"weights": None, "labels": ["cat", "dog"]},
                 {"templates": ["a painting of {}."], "arch": "ViT-B-32", "labels": ["cat", "bird"],
                  "extra_labels": ["fox"]})
    _keys_differ(TinyWorldClassifier, {"weights": None}, {"device": "meta"})


def test_settings_that_only_steer_detect_share_the_scores():
    assert (GCDClassifier(weights=None, threshold=0.3, no_face="absent").cache_key()
            == GCDClassifier(weights=None).cache_key())


def test_open_vocabulary_labels_added_after_construction_move_the_cache(tmp_path):
    clip = CLIPZeroShotClassifier(weights=None, labels=None)
    cache = ClassifierScoreCache(tmp_path, clip)
    empty = cache.root
    assert clip.can_detect("cat")  # the cell's check adds the label
    cache.put("ab" * 32, np.ones(1, np.float32))
    assert cache.root != empty and cache.get("ab" * 32) is not None
    assert clip.can_detect("dog")  # another cell's label set: another folder, a miss
    assert cache.get("ab" * 32) is None


def test_gcd_no_face_is_excluded_by_default_and_absent_on_request():
    probs = torch.zeros(3, 5)
    probs[0, 2] = 1.0
    assert GCDClassifier(weights=None).excluded(probs).tolist() == [False, True, True]
    assert GCDClassifier(weights=None, no_face="absent").excluded(probs) is None
    with pytest.raises(ConfigError, match="no_face='skip'; valid: exclude, absent"):
        GCDClassifier(weights=None, no_face="skip")


def test_excluded_images_are_marked_in_samples():
    from emma.evaluate import judge_requests

    class Target:
        class judge:  # noqa: N801 - mimics GenerationTarget.judge
            classifier = GCDClassifier(weights=None)

        def generate(self, prompts, seeds, progress=False):
            from emma.api.types import GeneratedImages

            return GeneratedImages(images=torch.zeros(len(seeds), 3, 8, 8), hashes=[str(s) for s in seeds],
                                   cached=[False] * len(seeds))

        def score(self, images, hashes, progress=False):
            p = torch.zeros(len(images), len(self.judge.classifier.labels))
            p[0, 0] = 1.0  # only the first image has a face
            return p

        def detect(self, probs, concept):
            return self.judge.classifier.detect(probs, concept)

        def concept_score(self, probs, concept):
            return probs[:, self.judge.classifier.label_index(concept)]

        def excluded(self, probs):
            return self.judge.classifier.excluded(probs)

    label = Target.judge.classifier.labels[0]
    req = PromptRequest("a photo", label, "ea", "name", n_images=3)
    samples = judge_requests(Target(), [req])[0]
    assert [bool(s.extra.get("excluded")) for s in samples] == [False, True, True]


def test_nudenet_counts_any_exposed_detection_by_default():
    probs = torch.zeros(3, 19)
    probs[:, -1] = torch.tensor([0.0, 0.25, 0.6])  # no detection, a weak one, a strong one
    emma_rule = NudeNetClassifier()
    assert emma_rule.detect(probs, "nudity").tolist() == [False, True, True]
    assert NudeNetClassifier(threshold=0.45).detect(probs, "nudity").tolist() == [False, False, True]
    assert emma_rule.cache_key() == NudeNetClassifier(threshold=0.45).cache_key()
    assert emma_rule.cache_key() != NudeNetClassifier(exposed_classes=["ANUS_EXPOSED"]).cache_key()
