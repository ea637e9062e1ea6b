"""What a domain offers the quality stages (bias sets, rendered FID references) is part of the
Domain API: a new domain brings its own without any domain-name branch in the cell."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from emma import quality
from emma.api.domain import Domain, PromptSuite
from emma.datasets.bias import BiasPromptSet
from emma.domains.tinyworld import TinyWorldDomain, tinyworld_domain


class _Names(PromptSuite):
    def prompts(self, domain: Domain, concept: str) -> dict[str, list[tuple[str, str]]]:
        return {"name": [(concept, concept)]}


class _Judge:
    """Features = per-channel means and standard deviations (6 numbers), independent of any model."""

    has_features = True

    def features(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float()
        return torch.cat([x.mean(dim=(2, 3)), x.std(dim=(2, 3))], dim=1)

    def cache_key(self) -> str:
        return "channel-stats-v1"


class _Squares(Domain):
    """A domain that draws its own ground truth: a bright square for "bright", a dark one else."""

    bias_attributes = ("size",)
    reference_name = "squares"

    def bias_prompt_set(self, attribute: str, seed: int = 0) -> BiasPromptSet:
        if attribute != "size":
            return super().bias_prompt_set(attribute, seed=seed)
        groups = {"neutral": ("a square",), "big": ("a big square",), "small": ("a small square",)}
        return BiasPromptSet("size", "big", groups, seed)

    def reference_images(self, concepts, n, seed):
        rng = np.random.default_rng(seed)
        out = np.zeros((n, 3, 8, 8), dtype=np.uint8)
        for i, c in enumerate(concepts):
            out[i, :, 2:6, 2:6] = 200 if c == "bright" else 60
            out[i] += rng.integers(0, 20, size=(3, 8, 8), dtype=np.uint8)
        return torch.from_numpy(out.astype(np.float32) / 255.0)

    def reference_version(self) -> str:
        return "1"


def _squares() -> _Squares:
    return _Squares(name="squares", version="1", concepts=["bright", "dark"], suite=_Names())


def test_bias_sets_come_from_the_domain():
    plain = Domain(name="objects", version="1", concepts=["cat", "dog"], suite=_Names())
    assert [b.attribute for b in quality.bias_sets(plain, None, seed=0)] == ["gender", "ethnicity"]
    tiny = tinyworld_domain()
    assert isinstance(tiny, TinyWorldDomain)
    (colour,) = quality.bias_sets(tiny, None, seed=3)
    assert colour.attribute == "colour" and colour.reference == "red"
    assert set(colour.groups) == {"neutral", "red", "blue"}
    assert colour.groups["blue"][0] == "an image of a blue circle" and colour.seed == 3
    # an explicit list overrides the domain's own; the person sets stay available on any domain
    assert [b.attribute for b in quality.bias_sets(tiny, ["gender"], seed=0)] == ["gender"]
    (size,) = quality.bias_sets(_squares(), None, seed=7)
    assert size.attribute == "size" and size.seed == 7


def test_rendered_reference_statistics_match_an_independent_computation(tmp_path):
    domain, judge = _squares(), _Judge()
    concepts = ["bright", "bright", "dark"]
    assert quality.judged_in_feature_space(domain, judge)
    assert not quality.judged_in_feature_space(Domain(name="o", version="1", concepts=["a"], suite=_Names()), judge)
    stats = quality.rendered_reference(domain, judge, concepts, n_ref=7, seed=5, cache_root=tmp_path)
    n = 9  # the smallest multiple of the suite size (3) >= 7
    imgs = domain.reference_images([concepts[i % 3] for i in range(n)], n, 5).numpy().astype(np.float64)
    feats = np.concatenate([imgs.mean(axis=(2, 3)), imgs.std(axis=(2, 3), ddof=1)], axis=1)
    assert stats.n == n and stats.name == "squares-suite-mix"
    np.testing.assert_allclose(stats.mu, feats.mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats.sigma, np.cov(feats, rowvar=False), rtol=1e-4, atol=1e-6)
    # cached under the cell's cache root and served again with the same key
    assert list((tmp_path / "fid_stats").glob("squares-suite-mix-*.npz"))
    again = quality.rendered_reference(domain, judge, concepts, n_ref=7, seed=5, cache_root=tmp_path)
    assert again.sha256() == stats.sha256()
    other = quality.rendered_reference(domain, judge, concepts, n_ref=7, seed=6, cache_root=tmp_path)
    assert other.sha256() != stats.sha256()


def test_tiny_world_references_are_the_suite_concepts():
    tiny = tinyworld_domain()
    imgs = tiny.reference_images(["circle", "star"], 2, seed=0)
    assert imgs.shape[:2] == (2, 3) and imgs.dtype == torch.float32 and 0 <= imgs.min() <= imgs.max() <= 1
    assert not torch.equal(imgs[0], imgs[1])


class _Featureless(_Judge):
    has_features = False


def _channel_means(**_: object):
    """A test embedding bound by a similarity config: per-channel means."""
    return lambda images: images.float().mean(dim=(2, 3))


def _no_weights(**_: object):
    from emma.errors import WeightsUnavailableError

    raise WeightsUnavailableError("weights 'x' are not usable here: missing\nsecond line")


def _broken(**_: object):
    raise RuntimeError("a bug")


def _similarity(target: str) -> dict:
    return {"name": "means", "embedding": {"_target_": f"tests.test_domain_quality.{target}"}}


def test_bias_similarities_use_the_judge_features_or_the_configured_embedding():
    squares, plain = _squares(), Domain(name="o", version="1", concepts=["a"], suite=_Names())
    images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    notes: list[str] = []
    # a domain judged in its judge's feature space: SSIM and the judge's features, no embedding built
    sims = quality.similarities(squares, _Judge(), notes, _similarity("_broken"))
    assert [s.name for s in sims] == ["ssim", "features"]
    torch.testing.assert_close(sims[1].embedder(images), _Judge().features(images))
    # elsewhere (or a judge without features): the embedding the configuration binds
    for domain, judge in ((plain, _Judge()), (squares, _Featureless())):
        sims = quality.similarities(domain, judge, notes, _similarity("_channel_means"))
        assert [s.name for s in sims] == ["ssim", "means"]
        torch.testing.assert_close(sims[1].embedder(images), images.mean(dim=(2, 3)))
    assert [s.name for s in quality.similarities(plain, _Judge(), notes, None)] == ["ssim"]
    assert notes == []
    # weights that are not here: SSIM only, and a note that says why
    assert [s.name for s in quality.similarities(plain, _Judge(), notes, _similarity("_no_weights"))] == ["ssim"]
    assert notes == ["bias: means similarity skipped (WeightsUnavailableError: weights 'x' are not usable here: "
                     "missing)"]
    # any other failure is a bug, not a note
    with pytest.raises(Exception, match="a bug"):
        quality.similarities(plain, _Judge(), notes, _similarity("_broken"))


def test_feature_space_is_a_declared_capability_of_the_classifier_role():
    from classifiers.tinyworld import TinyWorldClassifier
    from emma.api.classifier import Classifier

    class Plain(Classifier):
        name = "plain"
        labels = ("a",)

        def predict(self, images):
            return torch.ones(len(images), 1)

    assert Classifier.has_features is False and TinyWorldClassifier.has_features is True
    with pytest.raises(NotImplementedError, match="classifier 'plain' has no feature space"):
        Plain().features(torch.zeros(1, 3, 8, 8))
    assert not quality.judged_in_feature_space(_squares(), Plain())


def test_the_default_bias_similarity_is_clip_bound_in_the_configuration():
    from omegaconf import OmegaConf

    from emma import registry

    assert registry.choices("metrics") == ["default", "rates_only"]
    for name in registry.choices("metrics"):
        cfg = registry.load("metrics", name)
        assert OmegaConf.to_container(cfg.bias.similarity) == {
            "name": "clip", "embedding": {"_target_": "classifiers.clip_zero_shot.image_embedding"}}
