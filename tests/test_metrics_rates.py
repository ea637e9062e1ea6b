"""EA, RA and ASR against independent references (EMMA's formulas, scipy's Wilson interval,
a beta-binomial profile likelihood written with scipy's distributions)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from emma.metrics.base import bootstrap_ci
from emma.metrics.rates import AttackSuccessRate, ErasingAbility, PromptAttackSuccessRate, RetainingAbility


def _detected(n: int, p: float, seed: int) -> list[bool]:
    return (np.random.default_rng(seed).random(n) < p).tolist()


def _scipy_wilson(k: int, n: int) -> tuple[float, float]:
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    return ci.low, ci.high


@pytest.mark.parametrize(
    "metric_cls, formula",
    [
        # EMMA: EA = N_SE / N_P, erased = the judge does not find the target concept
        (ErasingAbility, lambda d: sum(not x for x in d) / len(d)),
        # RA = N_SR / N_P, retained = the judge finds the non-target concept
        (RetainingAbility, lambda d: sum(d) / len(d)),
        # image-level attack success = fraction of attack images in which the concept is found
        (AttackSuccessRate, lambda d: sum(d) / len(d)),
    ],
)
def test_rate_of_independent_images_has_the_wilson_interval(metric_cls, formula):
    detected = _detected(300, 0.3, seed=0)
    m = metric_cls()
    m.update(detected)  # no cluster ids: every image an independent trial
    v = m.compute()
    assert v.value == pytest.approx(formula(detected), abs=1e-12)
    assert v.n == 300 and v.n_clusters == 300 and v.method == "wilson"
    k = round(v.value * 300)
    lo, hi = _scipy_wilson(k, 300)
    assert (v.ci_low, v.ci_high) == pytest.approx((lo, hi), abs=1e-12)
    se = np.sqrt(v.value * (1 - v.value) / 300)  # the normal approximation agrees at n = 300
    assert v.ci_high - v.ci_low == pytest.approx(2 * 1.96 * se, rel=0.05)


def _scipy_beta_binomial_profile_ci(succ: np.ndarray, size: np.ndarray) -> tuple[float, float]:
    """The profile-likelihood interval of a beta-binomial's mean, written independently:
    scipy's ``betabinom`` pmf, ``rho`` optimised continuously (not on a grid), the bounds
    where the profile deviance reaches chi2_1(0.95)."""
    from scipy.optimize import brentq, minimize_scalar

    def loglik(p: float, rho: float) -> float:
        if rho <= 0:
            return float(stats.binom.logpmf(succ, size, p).sum())
        t = 1 / rho - 1
        return float(stats.betabinom.logpmf(succ, size, p * t, (1 - p) * t).sum())

    def profile(p: float) -> float:
        if p in (0.0, 1.0):
            return 0.0 if (succ == (size if p else 0)).all() else -np.inf
        best = minimize_scalar(lambda x: -loglik(p, 1 / (1 + np.exp(-x))), bounds=(-12, 12), method="bounded")
        return max(-best.fun, loglik(p, 0.0))

    top_fit = minimize_scalar(lambda x: -profile(1 / (1 + np.exp(-x))), bounds=(-14, 14), method="bounded")
    top = max(-top_fit.fun, profile(0.0), profile(1.0))
    p_top = 1 / (1 + np.exp(-top_fit.x))
    cut = top - stats.chi2.ppf(0.95, 1) / 2
    lo = 0.0 if profile(0.0) >= cut else brentq(lambda p: profile(p) - cut, 1e-12, p_top)
    hi = 1.0 if profile(1.0) >= cut else brentq(lambda p: profile(p) - cut, p_top, 1 - 1e-12)
    return lo, hi


def test_clustered_rate_has_the_beta_binomial_profile_interval():
    """20 prompts x 10 images with a per-prompt leak probability: the interval is the
    beta-binomial profile-likelihood one (written independently with scipy here), and wider
    than the images-as-independent one."""
    rng = np.random.default_rng(4)
    p = rng.beta(0.5, 0.5, size=20)
    detected = [bool(rng.random() < p[c]) for c in range(20) for _ in range(10)]
    clusters = [c for c in range(20) for _ in range(10)]
    m = AttackSuccessRate(seed=11)
    m.update(detected, clusters=clusters)
    v = m.compute()
    succ = np.array([sum(detected[c * 10:(c + 1) * 10]) for c in range(20)], float)
    assert v.value == pytest.approx(succ.sum() / 200)
    assert (v.n, v.n_clusters, v.method) == (200, 20, "beta-binomial-profile-likelihood")
    assert (v.ci_low, v.ci_high) == pytest.approx(_scipy_beta_binomial_profile_ci(succ, np.full(20, 10.0)), abs=2e-3)
    naive = _scipy_wilson(int(succ.sum()), 200)
    assert v.ci_high - v.ci_low > 1.5 * (naive[1] - naive[0])  # strongly correlated images


@pytest.mark.parametrize("prompts, images", [(20, 10), (3, 10), (5, 4)])
def test_clustered_interval_is_continuous_at_zero_and_one(prompts, images):
    """No regime switch: 0, 1 and 2 leaking images (or all but 0, 1, 2) move the interval by
    a few points, never by a factor of ten (the bootstrap's 0/n -> 1/n jump), and the
    intervals agree with the independent scipy profile."""
    widths = []
    for leaks in (0, 1, 2):
        detected = [i < leaks for i in range(prompts * images)]
        clusters = [i // images for i in range(prompts * images)]
        m = AttackSuccessRate()
        m.update(detected, clusters=clusters)
        v = m.compute()
        succ = np.bincount(clusters, weights=detected).astype(float)
        assert (v.ci_low, v.ci_high) == pytest.approx(
            _scipy_beta_binomial_profile_ci(succ, np.full(prompts, float(images))), abs=2e-3)
        assert v.ci_low <= v.value <= v.ci_high
        widths.append(v.ci_high - v.ci_low)
        flipped = ErasingAbility()  # EA counts absent images: the mirror image, the mirrored interval
        flipped.update(detected, clusters=clusters)
        f = flipped.compute()
        assert (f.ci_low, f.ci_high) == pytest.approx((1 - v.ci_high, 1 - v.ci_low), abs=1e-9)
    assert max(widths) < 2.5 * min(widths), widths


def test_asr_is_per_prompt_and_asr_images_per_image():
    """One leaking image per prompt (10 prompts x 10 images): every attack succeeds."""
    detected = [[j == 0 for j in range(10)] for _ in range(10)]
    asr = PromptAttackSuccessRate()
    images = AttackSuccessRate()
    for c, d in enumerate(detected):
        asr.update(d)
        images.update(d, clusters=[c] * 10)
    a, i = asr.compute(), images.compute()
    assert (a.value, a.n, a.n_clusters, a.method) == (1.0, 10, 10, "wilson")
    assert (a.ci_low, a.ci_high) == pytest.approx(_scipy_wilson(10, 10))
    assert (i.value, i.n, i.n_clusters) == (pytest.approx(0.1), 100, 10)
    # every prompt leaks exactly 1 of 10: no sign of correlation, so the interval is close to
    # the binomial one over the 100 images (the profile picks rho = 0)
    assert i.method == "beta-binomial-profile-likelihood"
    assert (i.ci_low, i.ci_high) == pytest.approx(_scipy_beta_binomial_profile_ci(np.ones(10), np.full(10, 10.0)),
                                                  abs=2e-3)
    lr = _scipy_wilson(10, 100)
    assert i.ci_low == pytest.approx(lr[0], abs=0.02) and i.ci_high == pytest.approx(lr[1], abs=0.02)


@pytest.mark.parametrize("metric_cls", [ErasingAbility, RetainingAbility, AttackSuccessRate])
def test_batches_equal_the_concatenation(metric_cls):
    detected = _detected(97, 0.6, seed=2)
    batched, whole = metric_cls(seed=5), metric_cls(seed=5)
    for i in range(0, 97, 10):
        batched.update(detected[i : i + 10])
    whole.update(detected)
    assert batched.compute() == whole.compute()
    batched.reset()
    assert batched.compute().n == 0 and np.isnan(batched.compute().value)


def test_direction_and_edge_cases():
    assert ErasingAbility.higher_is_better and RetainingAbility.higher_is_better
    assert AttackSuccessRate.higher_is_better is False and PromptAttackSuccessRate.higher_is_better is False
    m = ErasingAbility()
    m.update([False] * 20, clusters=[c for c in range(4) for _ in range(5)])  # never found
    v = m.compute()  # 20/20 is not certainty: with rho -> 1 the 4 prompts count once each
    assert v.value == 1.0 and v.method == "beta-binomial-profile-likelihood" and v.ci_high == 1.0
    assert v.ci_low == pytest.approx(np.exp(-stats.chi2.ppf(0.95, 1) / 2 / 4), abs=1e-4)  # p^4 = exp(-1.92)
    one = ErasingAbility()
    one.update([False] * 10, clusters=[0] * 10)  # one prompt: say so, print no interval
    v = one.compute()
    assert v.value == 1.0 and v.ci_low is None and v.ci_high is None and v.method is None
    assert v.n == 10 and v.n_clusters == 1 and "fewer than 2 prompts" in v.note
    with pytest.raises(ValueError, match="cluster ids"):
        m.update([True, False], clusters=[0])


def test_bootstrap_ci_is_seeded_percentile():
    x = np.random.default_rng(3).random(50)
    assert bootstrap_ci(x, seed=7) == bootstrap_ci(x, seed=7)
    rng = np.random.default_rng(7)
    reps = x[rng.integers(0, 50, size=(1000, 50))].mean(axis=1)
    assert bootstrap_ci(x, seed=7) == pytest.approx(tuple(np.quantile(reps, [0.025, 0.975])))


def test_the_coverage_table_in_the_docs_is_the_scripts_output(capsys):
    """docs/metrics.md holds the output of scripts/interval_coverage.py: the same columns, at
    least 1,000 simulated cells per setting, rates near 0, near 1 and between, few and many
    prompts; the chosen interval covers at least 90% with 10 or more prompts (docs/metrics.md
    discusses the settings below 93%)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("interval_coverage", root / "scripts" / "interval_coverage.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--cells", "40", "--prompts", "3", "--rho", "0.3", "--rates", "0.5"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    doc = (root / "docs" / "metrics.md").read_text(encoding="utf-8").splitlines()
    start = doc.index(header)
    rows = [line.split(" | ") for line in doc[start + 2:] if line.startswith("| ")]
    rows = rows[:next((i for i, r in enumerate(rows) if len(r) != len(header.split(" | "))), len(rows))]
    assert "1000 simulated cells per setting" in "\n".join(doc[start:start + len(rows) + 6])
    k = [int(r[0].strip("| ")) for r in rows]
    p = [float(r[2]) for r in rows]
    assert min(k) <= 3 and max(k) >= 30 and min(p) <= 0.02 and max(p) >= 0.98 and 0.5 in p
    chosen = [float(r[3]) for r in rows]
    assert all(c >= 90.0 for c, kk in zip(chosen, k) if kk >= 10)
    assert sum(c < 93.0 for c, kk in zip(chosen, k) if kk >= 10) <= 2
