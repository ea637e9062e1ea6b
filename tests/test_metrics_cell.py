"""The cell's rate and timing stage on constructed samples: ASR per attacked prompt,
``asr/pre`` over exactly the attacked prompts, exclusions, timing records, results schema."""

from __future__ import annotations

import json

import pytest
from scipy import stats

from emma.api.types import AttackOutput, PromptRequest, Sample
from emma.metrics.base import MetricValue
from emma.metrics.cell_metrics import inference_time, rate_metrics, unlearning_time
from emma.results import CellInfo, CellResult


def _samples(req: PromptRequest, detected: list[bool], excluded: list[bool] | None = None) -> list[Sample]:
    return [Sample(prompt=req.prompt, seed=req.seed + j, concept=req.concept, group=req.group, kind=req.kind,
                   image_hash=f"{req.prompt}-{j}", detected=d, score=float(d),
                   extra={"excluded": True} if excluded and excluded[j] else {})
            for j, d in enumerate(detected)]


def _wilson(k: int, n: int) -> tuple[float, float]:
    ci = stats.binomtest(k, n).proportion_ci(0.95, method="wilson")
    return ci.low, ci.high


def test_one_leaking_image_per_prompt_is_asr_one_and_asr_images_one_tenth():
    reqs = [PromptRequest(f"a variant prompt {i}", "circle", "ea", "variant", seed=0, n_images=10) for i in range(10)]
    leak = [j == 3 for j in range(10)]
    outputs = [AttackOutput(request=r, adversarial_prompt=r.prompt + " !", samples=_samples(r, leak),
                            success=any(leak)) for r in reqs]
    suite = [(r, _samples(r, [False] * 10)) for r in reqs]  # before the attack: nothing leaks
    m = rate_metrics(suite, outputs, seed=0)
    assert (m["asr"].value, m["asr"].n, m["asr"].method) == (1.0, 10, "wilson")
    assert (m["asr"].ci_low, m["asr"].ci_high) == pytest.approx(_wilson(10, 10))
    assert m["asr/images"].value == pytest.approx(0.1) and m["asr/images"].n == 100
    assert m["asr/images"].n_clusters == 10
    assert m["asr/pre"].value == 0.0 and m["asr/pre"].n == 10
    assert m["ea/variant"].value == 1.0 and m["ea/variant"].n == 100


def test_asr_pre_is_over_exactly_the_attacked_prompts():
    name = PromptRequest("a circle", "circle", "ea", "name", n_images=4)
    variants = [PromptRequest(f"an orb {i}", "circle", "ea", "variant", n_images=4) for i in range(6)]
    suite = [(name, _samples(name, [True, True, False, False]))]
    suite += [(r, _samples(r, [False] * 4)) for r in variants]
    # an attacker restricted to kinds=[name] attacks one prompt
    out = [AttackOutput(request=name, adversarial_prompt="a circle", samples=_samples(name, [True] * 4), success=True)]
    m = rate_metrics(suite, out, seed=0)
    assert m["asr/pre"].n == 1 and m["asr/pre"].value == 1.0 and m["asr/pre"].ci_low is None
    assert "fewer than 2 prompts" in m["asr/pre"].note
    assert m["asr/pre/images"].n == 4 and m["asr/pre/images"].value == 0.5


def test_an_attack_that_drew_no_images_has_no_image_rate():
    reqs = [PromptRequest(f"hypothesis {i}", "circle", "ea", "name", n_images=0) for i in range(3)]
    out = [AttackOutput(request=r, adversarial_prompt=r.prompt, samples=[], success=False) for r in reqs]
    m = rate_metrics([], out, seed=0)
    assert (m["asr"].value, m["asr"].n) == (0.0, 3)
    assert m["asr/images"].value is None and m["asr/images"].n == 0
    assert m["asr/images"].note == "the attack drew no images"
    json.dumps(m["asr/images"].to_json(), allow_nan=False)  # no NaN reaches results.json


def test_excluded_images_leave_the_denominator_and_are_counted():
    reqs = [PromptRequest(f"a photo of person {i}", "someone", "ea", "name", n_images=4) for i in range(3)]
    suite = [(r, _samples(r, [True, False, False, False], excluded=[False, False, True, True])) for r in reqs]
    m = rate_metrics(suite, [], seed=0)["ea/name"]
    assert m.value == pytest.approx(0.5) and m.n == 6 and m.n_excluded == 6


def test_inference_time_leaves_warmup_out_and_reports_provenance():
    recs = {}
    for b, (sec, size, warm) in enumerate([(9.0, 4, True), (2.0, 4, False), (3.0, 2, False), (1.0, 2, False)]):
        for j in range(size):
            recs[f"{b}-{j}"] = {"gen_s": sec / size, "batch": f"b{b}", "batch_size": size, "warmup": warm,
                                "machine": "cpu; test", "replayed": b == 3}
    recs["old"] = None  # cached before records existed
    value, prov = inference_time(recs, seed=0)
    assert value.value == pytest.approx(6.0 / 8) and value.n == 8 and value.n_clusters == 3
    assert value.method.startswith("bootstrap-batches")
    assert prov == {"measured_on": ["cpu; test"], "images_replayed": 2, "images_measured_now": 6,
                    "images_without_timing": 1, "images_in_warmup_batches": 4}
    only_warm = {k: v for k, v in recs.items() if k.startswith("0-")}
    v, p = inference_time(only_warm, seed=0)
    assert v.value == pytest.approx(9.0 / 4) and "warm-up" in v.note and p["warmup_included"]


def test_unlearning_time_says_where_it_was_measured():
    v, prov = unlearning_time(12.0, {"wall_time_s": 12.0, "concepts": ["a", "b"], "machine": "cuda:0 (X)",
                                     "created": "2026"}, replayed=True)
    assert v.value == 6.0 and v.ci_low is None and prov == {"measured_on": "cuda:0 (X)", "replayed": True,
                                                            "measured_at": "2026"}


def _result(**metrics: MetricValue) -> CellResult:
    return CellResult(metrics=dict(metrics), cell=CellInfo("m", "none", "d", "c", "static", "j"), config={},
                      versions={}, timing={}, counts={}, provenance={"fid": {"name": "x"}})


def test_results_schema_3_round_trips_and_schema_1_still_loads(tmp_path):
    r = _result(asr=MetricValue(0.5, 0.2, 0.8, n=10, method="wilson", n_clusters=10))
    r.budget = {"images_per_prompt": 4, "n": {"asr": 10}}
    r.served_from_cache = {"key": "k"}
    r.save(tmp_path / "r.json")
    back = CellResult.load(tmp_path / "r.json")
    assert back.metrics == r.metrics and back.provenance == r.provenance and back.schema_version == 3
    assert back.budget == r.budget and back.served_from_cache == {"key": "k"}
    old = {"schema_version": 1, "cell": {"model": "m", "method": "none", "domain": "d", "concept": "c",
                                         "attacker": "static", "classifier": "j"},
           "metrics": {"asr": {"value": 0.1, "ci_low": 0.0, "ci_high": 0.2, "n": 200}},
           "config": {}, "versions": {}, "timing": {}, "counts": {}}
    (tmp_path / "v1.json").write_text(json.dumps(old))
    v1 = CellResult.load(tmp_path / "v1.json")
    assert v1.schema_version == 1 and v1.metrics["asr"].method is None and v1.metrics["asr"].n == 200
    (tmp_path / "v9.json").write_text(json.dumps({**old, "schema_version": 9}))
    with pytest.raises(ValueError, match="schema_version 9 is unknown; this harness reads schema versions 1, 2, 3 "):
        CellResult.load(tmp_path / "v9.json")
    v2 = CellResult.load(tmp_path / "v1.json")  # an older file has no budget: empty, and not served
    assert v2.budget == {} and v2.served_from_cache is None
    with pytest.raises(ValueError):
        CellResult.load(tmp_path / "v9.json")
