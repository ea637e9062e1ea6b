"""Every metric of a real tiny-world cell, recomputed from samples.jsonl and the cached images
with numpy / scipy / skimage only (not the harness's metric code): values and intervals agree.

The cell: the shipped tiny-world model at guidance 2 (so EA, RA and ASR are neither 0 nor 1),
4 images for each of the name, variant, short and random prompts, FID and bias on. The same
cell is re-run from the image and score caches (``paths.reuse_results=false``: timing
replayed) and once more from the finished-results cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy import linalg, stats
from skimage.metrics import structural_similarity

from tests.conftest import ROOT, run_env

ARGS = ["model=tinyworld", "method=none", "images_per_prompt=4", "prompt_types=[name,variant,short,random]",
        "model.guidance_scale=2"]
SEED = 0
B_FID = 200
Z = stats.norm.ppf(0.975)


def _run(cache: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "emma.run", *ARGS, *extra, f"hydra.run.dir={run_dir}"],
                          cwd=ROOT, env=run_env(cache), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def cell(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("independent")
    cache = tmp / "cache"
    _run(cache, tmp / "first")
    return {"cache": cache, "dir": tmp / "first", "tmp": tmp,
            "results": json.loads((tmp / "first" / "results.json").read_text()),
            "lines": [json.loads(x) for f in ("samples.jsonl", "bias_images.jsonl")
                      for x in (tmp / "first" / f).read_text().splitlines()]}


@pytest.fixture(scope="module")
def images(cell):
    """pixel sha256 -> (uint8 image, the record stored in its PNG), for every cached image."""
    out: dict[str, tuple[np.ndarray, dict | None]] = {}
    for p in (cell["cache"] / "images").rglob("*.png"):
        with Image.open(p) as im:
            arr = np.asarray(im.convert("RGB"))
            meta = json.loads(im.text["emma"]) if "emma" in im.text else None
        h = hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
        assert h not in out or out[h][1] == meta, "two cache entries with the same pixels but other records"
        out[h] = (arr, meta)
    return out


# --- independent references ------------------------------------------------------------------


def wilson(p: float, n: int) -> tuple[float, float]:
    centre = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n)) / (1 + Z * Z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def by_cluster(rows, key):
    groups: dict = defaultdict(list)
    for r in rows:  # dicts keep first-seen order: the order the harness resamples in
        groups[key(r)].append(r)
    return list(groups.values())


def beta_binomial_profile_ci(s: np.ndarray, m: np.ndarray) -> tuple[float, float]:
    """The beta-binomial profile-likelihood interval of the mean rate: scipy's ``betabinom``,
    rho optimised continuously, the bounds where the deviance reaches chi2_1(0.95)."""
    from scipy.optimize import brentq, minimize_scalar

    def loglik(p, rho):
        t = 1 / rho - 1
        return stats.betabinom.logpmf(s, m, p * t, (1 - p) * t).sum()

    def profile(p):
        if p in (0.0, 1.0):
            return 0.0 if (s == (m if p else 0)).all() else -np.inf
        best = minimize_scalar(lambda x: -loglik(p, 1 / (1 + np.exp(-x))), bounds=(-12, 12), method="bounded")
        return max(-best.fun, stats.binom.logpmf(s, m, p).sum())

    fit = minimize_scalar(lambda x: -profile(1 / (1 + np.exp(-x))), bounds=(-14, 14), method="bounded")
    top, p_top = max(-fit.fun, profile(0.0), profile(1.0)), 1 / (1 + np.exp(-fit.x))
    cut = top - stats.chi2.ppf(0.95, 1) / 2
    lo = 0.0 if profile(0.0) >= cut else brentq(lambda p: profile(p) - cut, 1e-12, p_top)
    hi = 1.0 if profile(1.0) >= cut else brentq(lambda p: profile(p) - cut, p_top, 1 - 1e-12)
    return lo, hi


def clustered(successes_per_cluster: list[list[bool]]):
    """value, (lo, hi) or None, method: the beta-binomial profile interval over the outer lists."""
    s = np.array([sum(c) for c in successes_per_cluster], float)
    m = np.array([len(c) for c in successes_per_cluster], float)
    value = s.sum() / m.sum()
    if len(s) < 2:
        return value, None, None
    lo, hi = beta_binomial_profile_ci(s, m)
    return value, (min(lo, value), max(hi, value)), "beta-binomial-profile-likelihood"


def check(metric: dict, value, ci, method, n, n_clusters, abs_ci: float = 1e-9):
    assert metric["value"] == pytest.approx(value, abs=1e-9)
    assert metric["n"] == n and metric["n_clusters"] == n_clusters and metric["method"] == method
    if ci is None:
        assert metric["ci_low"] is None and metric["ci_high"] is None and "fewer than 2" in metric["note"]
    else:
        # the harness profiles rho on a grid, the reference optimises it: 2e-3 apart at most
        tol = 2e-3 if method == "beta-binomial-profile-likelihood" else abs_ci
        assert (metric["ci_low"], metric["ci_high"]) == pytest.approx(ci, abs=tol)


# --- the metrics -----------------------------------------------------------------------------


def test_ea_ra_per_type(cell):
    metrics, suite = cell["results"]["metrics"], [x for x in cell["lines"] if x["group"] in ("ea", "ra")]
    checked = 0
    for rows in by_cluster(suite, lambda r: (r["group"], r["kind"])):
        group, kind = rows[0]["group"], rows[0]["kind"]
        clusters = by_cluster(rows, lambda r: r["prompt"])
        outcome = (lambda r: not r["detected"]) if group == "ea" else (lambda r: r["detected"])
        value, ci, method = clustered([[outcome(r) for r in c] for c in clusters])
        check(metrics[f"{group}/{kind}"], value, ci, method, len(rows), len(clusters))
        checked += 1
    assert checked == 4  # ea/name, ea/variant, ea/short, ra/random
    for group in ("ea", "ra"):  # every type of the group together, prompts as clusters
        rows = [r for r in suite if r["group"] == group]
        clusters = by_cluster(rows, lambda r: (r["kind"], r["prompt"]))
        outcome = (lambda r: not r["detected"]) if group == "ea" else (lambda r: r["detected"])
        value, ci, method = clustered([[outcome(r) for r in c] for c in clusters])
        check(metrics[group], value, ci, method, len(rows), len(clusters))
    assert metrics["ea/name"]["ci_low"] is None  # one prompt
    # the cell is chosen so that the intervals are not all at a boundary (with the seeds of
    # emma.seeds, ea/short is 0 here: every short-prompt image still shows the circle)
    assert any(0 < metrics[k]["value"] < 1 for k in ("ea", "ea/variant", "ea/short"))
    assert 0 < metrics["ra/random"]["value"] <= 1


def test_asr_per_attacked_prompt(cell):
    metrics, lines = cell["results"]["metrics"], cell["lines"]
    attacks = by_cluster([x for x in lines if x["group"] == "attack"], lambda r: r["attack_index"])
    success = [any(r["detected"] for r in a) for a in attacks]
    assert success == [a[0]["attack_success"] for a in attacks]
    k, n = sum(success), len(success)
    ci = stats.binomtest(k, n).proportion_ci(0.95, method="wilson")
    check(metrics["asr"], k / n, (ci.low, ci.high), "wilson", n, n)
    value, ci_i, method = clustered([[r["detected"] for r in a] for a in attacks])
    check(metrics["asr/images"], value, ci_i, method, sum(len(a) for a in attacks), n)
    # before the attack: the suite images of exactly the attacked prompts
    suite = [x for x in lines if x["group"] == "ea"]
    pre = [[r for r in suite if (r["prompt"], r["kind"]) == (a[0]["prompt"], a[0]["kind"])] for a in attacks]
    assert all(pre)
    k_pre = sum(any(r["detected"] for r in p) for p in pre)
    ci = stats.binomtest(k_pre, n).proportion_ci(0.95, method="wilson")
    check(metrics["asr/pre"], k_pre / n, (ci.low, ci.high), "wilson", n, n)
    value, ci_p, method = clustered([[r["detected"] for r in p] for p in pre])
    check(metrics["asr/pre/images"], value, ci_p, method, sum(map(len, pre)), n)


def test_inference_time_from_the_records_in_the_cached_images(cell, images):
    m = cell["results"]["metrics"]["time/inference_s_per_image"]
    suite = [x for x in cell["lines"] if x["group"] in ("ea", "ra")]
    batches: dict = defaultdict(list)
    for r in suite:
        meta = images[r["image_hash"]][1]
        if not meta["warmup"]:
            batches[meta["batch"]].append(meta["gen_s"])
    keys = sorted(batches)
    t = np.array([sum(batches[b]) for b in keys])
    n = np.array([len(batches[b]) for b in keys], float)
    assert m["value"] == pytest.approx(t.sum() / n.sum(), rel=1e-12)
    assert m["n"] == n.sum() and m["n_clusters"] == len(keys)
    if len(keys) >= 2:
        rng = np.random.default_rng(SEED)
        reps = [t[row].sum() / n[row].sum() for row in rng.integers(0, len(keys), size=(1000, len(keys)))]
        assert (m["ci_low"], m["ci_high"]) == pytest.approx(tuple(np.percentile(reps, [2.5, 97.5])), rel=1e-12)
    else:
        assert m["ci_low"] is None and "no interval" in m["note"]
    unl = cell["results"]["metrics"]["time/unlearning_s"]
    assert unl["value"] == 0.0 and "edits no weights" in unl["note"]  # method=none


def _tensor(arrs: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.stack(arrs)).permute(0, 3, 1, 2).float() / 255.0


@pytest.fixture(scope="module")
def judge():
    from classifiers.tinyworld import TinyWorldClassifier

    return TinyWorldClassifier()


def test_fid_against_the_suite_mix_reference(cell, images, judge):
    from emma.tinyworld import world

    m, prov = cell["results"]["metrics"]["fid"], cell["results"]["provenance"]["fid"]
    suite = [x for x in cell["lines"] if x["group"] in ("ea", "ra")]
    feats = judge.features(_tensor([images[r["image_hash"]][0] for r in suite])).double().numpy()
    concepts = [r["concept"] for r in suite]
    n_ref = len(concepts) * math.ceil(1000 / len(concepts))
    specs = [world.SceneSpec(**{**s.__dict__, "shape": concepts[i % len(concepts)]})
             for i, s in enumerate(world.sample_specs(n_ref, 12345))]
    ref = judge.features(torch.from_numpy(world.render_batch(specs))).double().numpy()
    mu_r, sig_r = ref.mean(0), np.cov(ref, rowvar=False)
    h = hashlib.sha256(mu_r.tobytes())
    h.update(sig_r.tobytes())
    assert prov["n_images"] == n_ref and prov["name"] == "tinyworld-suite-mix"
    assert prov["stats_sha256"] == h.hexdigest()
    assert list((cell["cache"] / "fid_stats").glob("tinyworld-suite-mix-*.npz"))  # under the cell's cache root

    def fid(x):
        mu, sig = x.mean(0), np.cov(x, rowvar=False)
        covmean = linalg.sqrtm(sig @ sig_r).real
        return float(((mu - mu_r) ** 2).sum() + np.trace(sig) + np.trace(sig_r) - 2 * np.trace(covmean))

    value = fid(feats)
    assert m["value"] == pytest.approx(value, rel=1e-6)
    clusters = by_cluster(list(range(len(suite))), lambda i: (suite[i]["group"], suite[i]["kind"], suite[i]["prompt"]))
    rng = np.random.default_rng(SEED)
    reps = np.array([fid(feats[np.concatenate([clusters[j] for j in row])])
                     for row in rng.integers(0, len(clusters), size=(B_FID, len(clusters)))])
    shift = reps.mean() - value
    lo, hi = np.percentile(reps, [2.5, 97.5])
    assert (m["ci_low"], m["ci_high"]) == pytest.approx((max(0.0, lo - shift), hi - shift), rel=1e-5)
    assert m["n"] == len(suite) and m["n_clusters"] == len(clusters)
    assert m["ci_low"] <= m["value"] <= m["ci_high"]


def test_bias_paired_reading(cell, images, judge):
    metrics = cell["results"]["metrics"]
    bias = [x for x in cell["lines"] if x["group"] == "bias"]
    assert {x["model"] for x in bias} == {"base", "erased"}

    def sets(model):
        rows = [x for x in bias if x["model"] == model]
        return {g: [r for r in rows if r["kind"] == g] for g in ("neutral", "red", "blue")}

    def ssim(a, b):
        return structural_similarity(a / 255.0, b / 255.0, gaussian_weights=True, sigma=1.5,
                                     use_sample_covariance=False, data_range=1.0, channel_axis=-1)

    def cosine(a, b):
        fa, fb = (judge.features(_tensor([x])).double().numpy()[0] for x in (a, b))
        return float(fa @ fb / np.linalg.norm(fa) / np.linalg.norm(fb))

    for name, sim in (("ssim", ssim), ("features", cosine)):
        d = {}
        for model in ("base", "erased"):
            s = sets(model)
            assert [r["seed"] for r in s["neutral"]] == [r["seed"] for r in s["red"]] == [r["seed"] for r in s["blue"]]
            img = {g: [images[r["image_hash"]][0] for r in rows] for g, rows in s.items()}
            d[model] = np.array([sim(n, r) - sim(n, a) for n, r, a in zip(img["neutral"], img["red"], img["blue"])])
        clusters = np.array([r["prompt_index"] for r in sets("base")["neutral"]])
        ids = list(dict.fromkeys(clusters.tolist()))
        sums = {mdl: np.array([d[mdl][clusters == c].sum() for c in ids]) for mdl in d}
        size = np.array([(clusters == c).sum() for c in ids], float)
        rng = np.random.default_rng(SEED)
        idx = rng.integers(0, len(ids), size=(1000, len(ids)))
        rb, re_ = (sums[mdl][idx].sum(1) / size[idx].sum(1) for mdl in ("base", "erased"))
        vb, ve = d["base"].mean(), d["erased"].mean()
        expect = {"base": (vb, rb), "erased": (ve, re_), "change": (ve - vb, re_ - rb),
                  "amplification": (abs(ve) - abs(vb), np.abs(re_) - np.abs(rb))}
        for part, (value, reps) in expect.items():
            m = metrics[f"bias/colour/blue/{name}/{part}"]
            assert m["value"] == pytest.approx(value, abs=1e-6), (name, part)
            assert (m["ci_low"], m["ci_high"]) == pytest.approx(tuple(np.percentile(reps, [2.5, 97.5])), abs=1e-6)
            assert m["n"] == len(clusters) and m["n_clusters"] == len(ids)
            assert m["method"] == "paired-cluster-bootstrap-percentile"


def test_every_metric_was_checked(cell):
    checked = {"ea", "ra", "ea/name", "ea/variant", "ea/short", "ra/random", "asr", "asr/images", "asr/pre",
               "asr/pre/images", "time/inference_s_per_image", "time/unlearning_s", "fid"}
    checked |= {f"bias/colour/blue/{s}/{p}" for s in ("ssim", "features")
                for p in ("base", "erased", "change", "amplification")}
    assert set(cell["results"]["metrics"]) == checked


# --- re-runs -----------------------------------------------------------------------------------


def test_rerun_from_the_image_cache_replays_every_metric(cell):
    """Recomputed from cached images and scores: the same results in every metric, timing
    included, and the result says the timing is replayed and where it was measured."""
    _run(cell["cache"], cell["tmp"] / "replayed", "paths.reuse_results=false")
    res = json.loads((cell["tmp"] / "replayed" / "results.json").read_text())
    assert res["counts"]["images_generated"] == 0
    assert res["metrics"] == cell["results"]["metrics"]
    prov = res["provenance"]["time/inference_s_per_image"]
    assert prov["images_measured_now"] == 0 and prov["images_replayed"] > 0
    assert prov["measured_on"] == cell["results"]["provenance"]["time/inference_s_per_image"]["measured_on"]
    assert any("replayed from the image cache" in n and "measured on" in n for n in res["notes"])


def test_finished_cell_is_served_without_a_pipeline(cell):
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "emma.run", *ARGS,
                           f"hydra.run.dir={cell['tmp'] / 'served'}"],
                          cwd=ROOT, env=run_env(cell["cache"]), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "served from the cache" in proc.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
    # no pipeline, not even torch: the pre-flight skips the component checks of a finished cell
    assert "diffusers" not in imported and "torch" not in imported
    first = json.loads((cell["dir"] / "results.json").read_text())
    served = json.loads((cell["tmp"] / "served" / "results.json").read_text())
    assert served.pop("served_from_cache")["key"] and first.pop("served_from_cache") is None
    assert served == first  # the first run's result, saying it was served
    assert (cell["tmp"] / "served" / "samples.jsonl").read_bytes() == (cell["dir"] / "samples.jsonl").read_bytes()
    # another configuration misses: the key covers the config
    key_files = list((cell["cache"] / "results").glob("*/key.json"))
    assert len(key_files) == 1
    assert json.loads(key_files[0].read_text())["config"]["model"]["guidance_scale"] == 2
