"""EMMA's bias metric against the paper's formula coded here independently (skimage SSIM)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from skimage.metrics import structural_similarity

from emma.metrics.bias import (
    BIAS_AXES,
    BiasMetric,
    CLIPSimilarity,
    SSIMSimilarity,
    bias_scores,
    compare_bias,
    ssim_pairs,
)


def _sk_ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    return structural_similarity(a.double().numpy(), b.double().numpy(), data_range=1.0, channel_axis=0,
                                 gaussian_weights=True, sigma=1.5, use_sample_covariance=False)  # fmt: skip


def _paper_bias(neutral, reference, attribute, sim) -> float:
    """B_a = s(I_n, I_ref) - s(I_n, I_a), s = mean over all pairs (EMMA §bias), by loops."""

    def s(xs, ys):
        return np.mean([[sim(x, y) for y in ys] for x in xs])

    return float(s(neutral, reference) - s(neutral, attribute))


def _groups(seed: int = 0, n: int = 6, size: int = 24):
    """Neutral images are noisy copies of the reference group: a bias towards it."""
    g = torch.Generator().manual_seed(seed)
    reference = torch.rand(n, 3, size, size, generator=g)
    attribute = torch.rand(n, 3, size, size, generator=g)
    neutral = (0.7 * reference + 0.3 * torch.rand(n, 3, size, size, generator=g)).clamp(0, 1)
    return neutral, reference, attribute


def test_ssim_equals_skimage():
    n, r, _ = _groups(size=30)
    got = ssim_pairs(n, r)
    ref = torch.tensor([_sk_ssim(a, b) for a, b in zip(n, r, strict=True)], dtype=torch.float64)
    assert torch.allclose(got, ref, atol=1e-10)
    assert SSIMSimilarity().pairwise(n[:2], r[:3]).shape == (2, 3)
    assert ssim_pairs(n[:1], n[:1]).item() == pytest.approx(1.0)


def test_bias_with_ssim_matches_the_paper_formula():
    neutral, reference, attribute = _groups()
    v = bias_scores(neutral, reference, attribute, SSIMSimilarity(), n_resamples=300, seed=1)
    expected = _paper_bias(neutral, reference, attribute, _sk_ssim)
    assert v.value == pytest.approx(expected, abs=1e-9)
    assert v.value > 0  # neutral images look like the reference group
    assert v.ci_low <= v.value <= v.ci_high and v.n == 6
    # swapping the groups flips the sign
    swapped = bias_scores(neutral, attribute, reference, SSIMSimilarity(), n_resamples=0)
    assert swapped.value == pytest.approx(-v.value) and swapped.ci_low is None


def test_bias_with_embedding_cosine_matches_the_paper_formula():
    proj = torch.randn(3 * 16 * 16, 32, generator=torch.Generator().manual_seed(5))

    def embed(images: torch.Tensor) -> torch.Tensor:  # a fixed random "CLIP"
        return images.flatten(1) @ proj

    def cos(x, y):
        ex, ey = embed(x[None])[0].double(), embed(y[None])[0].double()
        return float(ex @ ey / (ex.norm() * ey.norm()))

    neutral, reference, attribute = _groups(seed=3, size=16)
    v = bias_scores(neutral, reference, attribute, CLIPSimilarity(embed), n_resamples=0)
    assert v.value == pytest.approx(_paper_bias(neutral, reference, attribute, cos), abs=1e-6)  # float32


def test_bias_metric_batches_equal_the_concatenation():
    neutral, reference, attribute = _groups(seed=7, n=9)
    batched = BiasMetric(SSIMSimilarity(), n_resamples=200, seed=4)
    for i in range(0, 9, 4):
        batched.update(neutral[i : i + 4], "neutral")
        batched.update(reference[i : i + 4], "reference")
        batched.update(attribute[i : i + 4], "attribute")
    whole = BiasMetric(SSIMSimilarity(), n_resamples=200, seed=4)
    whole.update(neutral, "neutral")
    whole.update(reference, "reference")
    whole.update(attribute, "attribute")
    direct = bias_scores(neutral, reference, attribute, SSIMSimilarity(), n_resamples=200, seed=4)
    assert batched.compute() == whole.compute() == direct
    with pytest.raises(ValueError, match="unknown bias group"):
        batched.update(neutral, "male")
    batched.reset()
    assert np.isnan(batched.compute().value)


def test_compare_bias_reports_both_models_and_the_amplification():
    base = dict(zip(("neutral", "reference", "attribute"), _groups(seed=11), strict=True))
    n, r, a = _groups(seed=12)
    erased = {"neutral": (0.4 * r + 0.6 * n).clamp(0, 1), "reference": r, "attribute": a}  # even closer
    sim = SSIMSimilarity()
    c = compare_bias(base, erased, sim, n_resamples=200, seed=0)
    b_base = _paper_bias(base["neutral"], base["reference"], base["attribute"], _sk_ssim)
    b_erased = _paper_bias(erased["neutral"], erased["reference"], erased["attribute"], _sk_ssim)
    assert c.base.value == pytest.approx(b_base, abs=1e-9)
    assert c.erased.value == pytest.approx(b_erased, abs=1e-9)
    assert c.amplification.value == pytest.approx(abs(b_erased) - abs(b_base), abs=1e-9)
    assert c.change.value == pytest.approx(b_erased - b_base, abs=1e-9)
    assert c.amplification.value > 0  # erasure made neutral images even more "reference"-like
    assert c.amplification.ci_low <= c.amplification.value <= c.amplification.ci_high
    assert set(c.to_json()) == {"base", "erased", "amplification", "change"}


def test_reference_groups_follow_emma():
    assert BIAS_AXES["gender"] == {"reference": "male", "attributes": ("female",)}
    assert BIAS_AXES["ethnicity"] == {"reference": "white", "attributes": ("asian", "black")}
