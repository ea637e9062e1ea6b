"""FID against an independent Fréchet distance (scipy's sqrtm), batch by batch and whole."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from scipy import linalg

from emma.errors import ConfigError, WeightsUnavailableError
from emma.metrics.fid import (
    FrechetDistance,
    ReferenceStatistics,
    build_reference_statistics,
    frechet_distance,
    gaussian_statistics,
    reference_statistics,
    tinyworld_fid,
)


def _reference_fid(a: np.ndarray, b: np.ndarray) -> float:
    """||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 sqrtm(S_a S_b)), written out independently."""
    mu_a, mu_b = a.mean(0), b.mean(0)
    s_a, s_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean = linalg.sqrtm(s_a @ s_b).real
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(s_a + s_b - 2 * covmean))


def _features(n: int, d: int, seed: int, shift: float = 0.0, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(d, d)) / np.sqrt(d)
    return rng.normal(size=(n, d)) @ mix * scale + shift


def test_frechet_distance_matches_scipy_sqrtm():
    a, b = _features(400, 12, 0), _features(300, 12, 1, shift=0.3, scale=1.5)
    mu_a, s_a = gaussian_statistics(a)
    mu_b, s_b = gaussian_statistics(b)
    assert frechet_distance(mu_a, s_a, mu_b, s_b) == pytest.approx(_reference_fid(a, b), rel=1e-6)


def test_scipy_fallback_equals_clean_fid():
    pytest.importorskip("cleanfid")
    from emma.metrics.fid import _frechet_distance_scipy

    a, b = _features(100, 5, 8), _features(120, 5, 9, shift=1.0)
    (mu_a, s_a), (mu_b, s_b) = gaussian_statistics(a), gaussian_statistics(b)
    assert _frechet_distance_scipy(mu_a, s_a, mu_b, s_b) == pytest.approx(
        frechet_distance(mu_a, s_a, mu_b, s_b)
    )


def test_fid_batches_equal_the_concatenation():
    fake, real = _features(250, 8, 2, shift=0.2), _features(300, 8, 3)
    batched, whole = (
        FrechetDistance(feature_extractor=lambda x: x),
        FrechetDistance(feature_extractor=lambda x: x),
    )
    for i in range(0, 250, 64):
        batched.update(torch.from_numpy(fake[i : i + 64]))
    for i in range(0, 300, 100):
        batched.update(torch.from_numpy(real[i : i + 100]), real=True)
    whole.update(torch.from_numpy(fake))
    whole.update(torch.from_numpy(real), real=True)
    v_b, v_w = batched.compute(), whole.compute()
    assert v_b.value == v_w.value
    assert v_b.value == pytest.approx(_reference_fid(fake, real), rel=1e-6)
    assert v_b.n == 250 and FrechetDistance.higher_is_better is False


def test_fid_known_values():
    x = _features(200, 6, 4)
    m = FrechetDistance(feature_extractor=lambda t: t)
    m.update(torch.from_numpy(x))
    m.update(torch.from_numpy(x), real=True)
    assert m.compute().value == pytest.approx(0.0, abs=1e-6)
    m = FrechetDistance(feature_extractor=lambda t: t)
    m.update(torch.from_numpy(x + 0.5))  # same covariance, mean moved by 0.5 in 6 dims
    m.update(torch.from_numpy(x), real=True)
    assert m.compute().value == pytest.approx(6 * 0.25, rel=1e-6)


def test_fid_injected_extractor_reference_statistics_and_bootstrap(tmp_path):
    def extractor(images: torch.Tensor) -> torch.Tensor:  # per-channel means and stds
        return torch.cat([images.mean(dim=(2, 3)), images.std(dim=(2, 3))], dim=1)

    g = torch.Generator().manual_seed(0)
    real, fake = torch.rand(64, 3, 8, 8, generator=g), torch.rand(48, 3, 8, 8, generator=g) ** 2
    stats = ReferenceStatistics.from_features(
        extractor(real).double().numpy(), name="toy", extractor="moments"
    )
    stats.save(tmp_path / "toy.npz")
    loaded = ReferenceStatistics.load(tmp_path / "toy.npz")
    assert loaded.n == 64 and loaded.name == "toy" and np.allclose(loaded.sigma, stats.sigma)

    with_stats = FrechetDistance(feature_extractor=extractor, reference=loaded, n_bootstrap=50, seed=3)
    with_stats.update(fake)
    with_images = FrechetDistance(feature_extractor=extractor)
    with_images.update(fake)
    with_images.update(real, real=True)
    v = with_stats.compute()
    assert v.value == pytest.approx(with_images.compute().value, rel=1e-9)
    ref = _reference_fid(extractor(fake).double().numpy(), extractor(real).double().numpy())
    assert v.value == pytest.approx(ref, rel=1e-6)
    assert v.ci_low is not None and v.ci_low <= v.ci_high and v.ci_high > 0

    one = FrechetDistance(feature_extractor=extractor, reference=loaded)
    one.update(fake[:1])
    assert np.isnan(one.compute().value) and one.compute().n == 1  # no covariance from one image
    with pytest.raises(ConfigError, match="no reference"):
        m = FrechetDistance(feature_extractor=extractor)
        m.update(fake)
        m.compute()


def test_reference_statistics_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EMMA_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="python -m emma.metrics.fid build coco30k"):
        reference_statistics("coco30k", "moments")
    g = torch.Generator().manual_seed(1)
    batches = [torch.rand(10, 3, 8, 8, generator=g) for _ in range(3)]
    built = build_reference_statistics(
        batches, lambda x: x.mean(dim=(2, 3)), name="coco30k", extractor_id="moments"
    )
    cached = reference_statistics("coco30k", "moments")
    assert cached.n == 30 and np.allclose(cached.mu, built.mu)
    assert (tmp_path / "fid_stats" / "coco30k__moments.npz").exists()


def test_clean_fid_inception_needs_registry_weights(tmp_path, monkeypatch):
    from emma.metrics.fid import CleanFIDInception

    monkeypatch.setenv("EMMA_CACHE", str(tmp_path))
    with pytest.raises(WeightsUnavailableError, match="python -m emma.weights fetch inception_fid"):
        CleanFIDInception()


@pytest.mark.filterwarnings("ignore::scipy.linalg.LinAlgWarning")  # dead ReLUs of random weights
def test_tinyworld_fid_uses_classifier_features_and_rendered_references():
    from classifiers.tinyworld import TinyWorldClassifier
    from emma.tinyworld.world import render_batch, sample_specs

    torch.manual_seed(0)
    clf = TinyWorldClassifier(weights=None)  # random features still separate the two sets below
    scenes = torch.from_numpy(render_batch(sample_specs(150, seed=1)))
    noise = torch.rand(150, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    fid_scenes = tinyworld_fid(scenes, clf, n_ref=300, seed=7)
    fid_noise = tinyworld_fid(noise, clf, n_ref=300, seed=7)
    assert fid_scenes.n == 150 and fid_scenes.value < fid_noise.value / 5

    refs = torch.from_numpy(render_batch(sample_specs(300, seed=7)))  # the same references, by hand
    ref = _reference_fid(clf.features(scenes).double().numpy(), clf.features(refs).double().numpy())
    assert fid_scenes.value == pytest.approx(ref, rel=1e-5)
