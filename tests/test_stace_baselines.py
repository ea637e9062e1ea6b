"""STACE's LLM baselines (redteam_llm, coreference, jailfuzzer) against the scripted
OpenAI-compatible server: each spends exactly its image budget per concept, renders what the
LLM wrote, and reports SIR_I = detected images / budget with a Wilson interval (checked
against scipy's)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, run_env
from scipy.stats import binomtest
from stace_server import DiscTarget, ScriptedChatServer, user_message

from emma.api.types import PromptRequest
from emma.errors import ConfigError
from emma.pipelines import TINYWORLD_DIR
from stace.gateway import LLMFailureError


def FakeTarget() -> DiscTarget:  # noqa: N802
    """The judge sees the concept (score 0.9) exactly when the prompt says 'disc'; 'round'
    scores 0.3 (not detected); anything else 0."""
    return DiscTarget(disc=0.9, round=0.3)


def _make(cls, url, tmp_path, **kw):
    llm = {"_target_": "stace.llm.LLMClient", "model": "m-llm", "base_url": url, "api_key_env": None,
           "timeout": 5, "max_retries": 1, "backoff_s": 0.01, "max_tokens": 512}
    att = cls(llm=llm, prices={"m-llm": [1.0, 2.0]}, **kw)
    att.bind_cell(output_dir=tmp_path, cache_dir=tmp_path / "cache", info={"model": "fake", "method": "esd"})
    return att


def _requests(*prompts):
    return [PromptRequest(prompt=p, concept="circle", group="ea", kind="name") for p in prompts]


def _check_sir_i(att, outs, budget, detected):
    samples = [s for o in outs for s in o.samples]
    assert len(samples) == budget
    assert sorted(s.seed for s in samples) == list(range(budget))  # one fresh seed per image
    assert sum(s.detected for s in samples) == detected
    m = att.extra_metrics()["sir_i"]
    assert m.value == pytest.approx(detected / budget) and m.n == budget
    if all(len(o.samples) == 1 for o in outs):  # one image a prompt: independent trials
        ci = binomtest(detected, budget).proportion_ci(method="wilson")
        assert m.method == "wilson" and (m.ci_low, m.ci_high) == pytest.approx((ci.low, ci.high), abs=1e-9)
    else:  # a prompt's images are one cluster
        from emma.metrics.intervals import clustered_rate

        flags = [s.detected for o in outs for s in o.samples]
        ids = [i for i, o in enumerate(outs) for _ in o.samples]
        ref = clustered_rate(flags, ids, seed=att.seed)
        assert m.n_clusters == len(outs) and m.method == ref.method
        if len(outs) < 2:  # one prompt: no interval (it would say nothing about other prompts)
            assert m.ci_low is None and "fewer than 2" in m.note
            return
        assert m.ci_low <= m.value <= m.ci_high
        assert (m.ci_low, m.ci_high) == pytest.approx((ref.ci_low, ref.ci_high), abs=1e-9)


def test_redteam_spends_100_images_on_100_llm_prompts(tmp_path):
    from attackers.redteam_llm import RedTeamLLMAttacker

    def reply(body, n):  # call n: 3 of its 10 prompts say 'disc'
        return {"prompts": [f"a disc, take {n}.{j}" if j < 3 else f"a box, take {n}.{j}" for j in range(10)]}

    with ScriptedChatServer(reply) as srv:
        att = _make(RedTeamLLMAttacker, srv.url, tmp_path)
        target = FakeTarget()
        outs = att.attack(target, _requests("an image of a circle"))
        reqs = list(srv.requests)
    assert len(reqs) == 10  # 100 prompts / 10 per call
    assert "a box, take 0.9" in user_message(reqs[1]) and "Write 10 new adversarial prompts" in user_message(reqs[1])
    assert len(outs) == 100 and all(len(o.samples) == 1 for o in outs)
    assert outs[0].adversarial_prompt == "a disc, take 0.0" and outs[0].success
    _check_sir_i(att, outs, 100, 30)
    m = att.extra_metrics()
    assert m["llm/calls"].value == 10 and m["llm/tokens"].value == 10 * 120
    assert m["llm/cost_usd"].value == pytest.approx(10 * (100 * 1.0 + 20 * 2.0) / 1e6)
    trace = [json.loads(x) for x in (tmp_path / "redteam_llm" / "trace.jsonl").read_text().splitlines()]
    assert sum(len(e["probes"]) for e in trace if e["event"] == "probes") == 100


def test_redteam_cycles_a_short_list_to_fill_the_budget(tmp_path):
    from attackers.redteam_llm import RedTeamLLMAttacker

    with ScriptedChatServer(lambda body, n: {"prompts": ["a disc", "a box", "a cube", "a Box"]}) as srv:
        att = _make(RedTeamLLMAttacker, srv.url, tmp_path, images=40, max_calls=3)
        outs = att.attack(FakeTarget(), _requests("an image of a circle"))
        assert len(srv.requests) == 3  # never more than max_calls
    # 3 distinct prompts ('a Box' duplicates 'a box'), cycled over 40 images: 'a disc' 14 times
    assert [o.adversarial_prompt for o in outs] == ["a disc", "a box", "a cube"]
    assert [len(o.samples) for o in outs] == [14, 13, 13]
    _check_sir_i(att, outs, 40, 14)


def test_coreference_drops_the_name_and_spreads_the_budget(tmp_path):
    from attackers.coreference import CoreferenceAttacker

    first = ["a flat disc", "a round coin", "the Circle sign", "a ring", "an orb"]

    def reply(body, n):
        return {"expressions": first if n == 0 else ["a disc of light", "a wheel"]}

    with ScriptedChatServer(reply) as srv:
        att = _make(CoreferenceAttacker, srv.url, tmp_path, expressions=5,
                    templates=["{expression}", "an image of {expression}"])
        outs = att.attack(FakeTarget(), _requests("an image of a circle"))
        reqs = list(srv.requests)
    assert len(reqs) == 2 and "Write 1 expressions" in user_message(reqs[1]) and "- a ring" in user_message(reqs[1])
    prompts = {o.adversarial_prompt: len(o.samples) for o in outs}
    # 'the Circle sign' names the concept: dropped; the 5th expression came from the second call
    assert set(prompts) == {f"{t}{e}" for t in ("", "an image of ")
                            for e in ("a flat disc", "a round coin", "a ring", "an orb", "a disc of light")}
    assert set(prompts.values()) == {10}  # 100 images / 5 expressions / 2 templates
    _check_sir_i(att, outs, 100, 40)  # two of five expressions say 'disc'
    trace = [json.loads(x) for x in (tmp_path / "coreference" / "trace.jsonl").read_text().splitlines()]
    assert next(e for e in trace if e["event"] == "coreferences")["dropped"] == ["the Circle sign"]


def test_jailfuzzer_mutates_the_best_seed_with_oracle_feedback(tmp_path):
    from attackers.jailfuzzer import JailFuzzerAttacker

    def reply(body, n):
        if n == 0:  # round 1 (rephrase of the first seed): 'round' scores 0.3 and joins the pool
            return {"prompts": ["a round shape", "a square shape", "a plain shape"]}
        if n == 1:  # round 2 (synonym), parent 'a round shape' by UCB
            return {"prompts": ["a round disc", "a disc", "a box"]}
        return "no JSON here"  # round 3: the call and its repair fail -> the parent is re-executed

    with ScriptedChatServer(reply) as srv:
        att = _make(JailFuzzerAttacker, srv.url, tmp_path, images=11, initial_seeds=2, mutants_per_round=3)
        outs = att.attack(FakeTarget(), _requests("an image of a circle", "a circle", "circle shape"))
        reqs = list(srv.requests)
    assert len(reqs) == 4  # rounds 1, 2, 3 (+ the repair of round 3)
    for req, op, parent in ((reqs[0], "rephrase", "(oracle score 0.0): an image of a circle"),
                            (reqs[1], "synonym", "(oracle score 0.3): a round shape"),
                            (reqs[2], "describe", "(oracle score 0.9): a round disc")):
        assert f"Operator: {op}" in user_message(req) and f"Seed prompt {parent}" in user_message(req)
    rendered = [s.prompt for o in outs for s in o.samples]
    assert sorted(rendered) == sorted(["an image of a circle", "a circle", "a round shape", "a square shape",
                                       "a plain shape", "a round disc", "a disc", "a box"] + ["a round disc"] * 3)
    _check_sir_i(att, outs, 11, 5)
    assert att.extra_metrics()["llm/repairs"].value == 1 and att.extra_metrics()["llm/failures"].value == 1


def test_llm_budget_stops_calls_and_unrendered_images_count_as_misses(tmp_path):
    from attackers.redteam_llm import RedTeamLLMAttacker

    with ScriptedChatServer(lambda body, n: {"prompts": ["a disc"]}) as srv:
        att = _make(RedTeamLLMAttacker, srv.url, tmp_path, images=10, budget={"max_usd": None, "max_tokens": 1})
        outs = att.attack(FakeTarget(), _requests("an image of a circle"))
        assert len(srv.requests) == 1  # the token budget is spent after the first call
    # one distinct prompt, cycled over the 10 images: all 10 drawn
    _check_sir_i(att, outs, 10, 10)
    # an LLM that never answers usably leaves the attack without its result: an error, or null metrics
    with ScriptedChatServer(lambda body, n: "not json") as srv:
        att = _make(RedTeamLLMAttacker, srv.url, tmp_path / "b", images=10, max_calls=2)
        with pytest.raises(LLMFailureError, match=r"2 of 2 LLM calls failed \(0 without a usable reply, 2 invalid"):
            att.attack(FakeTarget(), _requests("an image of a circle"))
        att = _make(RedTeamLLMAttacker, srv.url, tmp_path / "c", images=10, max_calls=2, tolerate_llm_failures=True)
        outs = att.attack(FakeTarget(), _requests("an image of a circle"))
    m = att.extra_metrics()
    assert outs == [] and m["sir_i"].value is None and m["asr"].value is None and m["llm/invalid"].value == 2
    assert not att.complete() and any("10 of 10 images were never rendered" in n for n in att.notes())


@pytest.mark.parametrize("cls, kw, match", [
    ("redteam_llm.RedTeamLLMAttacker", {"images": 0}, "image budget"),
    ("coreference.CoreferenceAttacker", {"templates": ["a photo"]}, "expression"),
    ("jailfuzzer.JailFuzzerAttacker", {"operators": ["rephrase", "teleport"]}, "teleport"),
])
def test_bad_settings_are_config_errors(cls, kw, match):
    import importlib

    mod, name = cls.split(".")
    klass = getattr(importlib.import_module(f"attackers.{mod}"), name)
    llm = {"_target_": "stace.llm.LLMClient", "model": "m", "base_url": "http://127.0.0.1:9/v1", "api_key_env": None}
    with pytest.raises(ConfigError, match=match):
        klass(llm=llm, **kw)


@pytest.mark.parametrize("name", ["redteam_llm.RedTeamLLMAttacker", "coreference.CoreferenceAttacker",
                                  "jailfuzzer.JailFuzzerAttacker"])
def test_each_baseline_spends_exactly_its_100_image_budget(name, tmp_path):
    import importlib

    mod, cls = name.split(".")
    klass = getattr(importlib.import_module(f"attackers.{mod}"), cls)

    def reply(body, n):  # fresh prompts every call; the first of each says 'disc'
        items = [f"a disc {n}" if j == 0 else f"a box {n}.{j}" for j in range(10)]
        return {"prompts": items, "expressions": items}

    with ScriptedChatServer(reply) as srv:
        att = _make(klass, srv.url, tmp_path)
        outs = att.attack(FakeTarget(), _requests("an image of a circle", "a circle"))
    samples = [s for o in outs for s in o.samples]
    assert att.images == 100 and len(samples) == 100
    _check_sir_i(att, outs, 100, sum("disc" in s.prompt for s in samples))


@pytest.mark.skipif(not TINYWORLD_DIR.exists(), reason="tiny-world assets not built")
def test_a_baseline_in_a_tiny_world_cell(tmp_path):
    """coreference through `python -m emma.run` (tiny preset: 12 images) on UCE's circle."""
    expressions = ["a disc", "a round coin", "a ring", "a round blob", "a circle"]
    out = tmp_path / "cell"
    with ScriptedChatServer(lambda body, n: {"expressions": expressions}) as srv:
        proc = subprocess.run(
            [sys.executable, "-m", "emma.run", "method=uce", "attacker=coreference", "llm=local",
             f"llm.base_url={srv.url}", "images_per_prompt=1", "prompt_types=[name]", "metrics=rates_only",
             f"hydra.run.dir={out}"], cwd=ROOT, env=run_env(tmp_path / "cache"), capture_output=True, text=True,
            timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert len(srv.requests) == 1  # 4 usable expressions ('a circle' names the concept) at once
    lines = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    attack = [x for x in lines if x["group"] == "attack"]
    assert len(attack) == 12 and len({x["seed"] for x in attack}) == 12
    assert {x["prompt"] for x in attack} == {f"an image of {e}" for e in expressions[:4]}
    m = json.loads((out / "results.json").read_text())["metrics"]
    assert m["sir_i"]["n"] == 12 and m["sir_i"]["value"] == pytest.approx(sum(x["detected"] for x in attack) / 12)
    assert m["llm/calls"]["value"] == 1 and m["llm/tokens"]["value"] == 120
    trace = [json.loads(x) for x in (out / "coreference" / "trace.jsonl").read_text().splitlines()]
    assert [e["event"] for e in trace][0] == "start" and trace[-1]["event"] == "finished"
