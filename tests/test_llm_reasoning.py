"""Reasoning models on OpenAI-compatible endpoints: parameters per model family, and empty
replies and HTTP 400s counted and reported (trace, metrics, notes), never silent."""

from __future__ import annotations

import json

import pytest
from stace_server import DiscTarget, Fault, ScriptedChatServer, stace_attacker

from emma.errors import ConfigError
from stace.llm import LLMClient, LLMError, model_family, request_params


@pytest.mark.parametrize("model, family", [
    ("gpt-5", "reasoning"), ("openai/gpt-5-mini", "reasoning"), ("openai/gpt-5-nano", "reasoning"),
    ("openai/gpt-5.1", "reasoning"), ("o3-mini", "reasoning"), ("openai/o1", "reasoning"), ("o4-mini", "reasoning"),
    ("gpt-5-chat-latest", "chat"), ("openai/gpt-4.1", "chat"), ("gpt-4o-mini", "chat"), ("x-ai/grok-4", "chat"),
    ("google/gemini-2.5-flash", "chat"), ("Qwen/Qwen2.5-7B-Instruct", "chat"), ("my-o1-clone", "chat"),
])
def test_model_family(model, family):
    assert model_family(model) == family


def test_request_params_per_family():
    assert request_params("gpt-4o-mini", 0.7, 512) == {"temperature": 0.7, "max_tokens": 512}
    assert request_params("openai/gpt-5", 0.7, 512) == {"max_completion_tokens": 512}
    assert request_params("openai/gpt-5", 0.0, None) == {}
    assert request_params("deepseek/deepseek-r1", 0.3, 64, [r"deepseek-r1"]) == {"max_completion_tokens": 64}
    with pytest.raises(ConfigError, match=r"llm.reasoning_models: '\(' is no regular expression"):
        LLMClient(model="m", base_url="http://127.0.0.1:9/v1", api_key_env=None, reasoning_models=["("])


def _client(url: str, **kw) -> LLMClient:
    return LLMClient(model="gpt-4o-mini", base_url=url, api_key_env=None, temperature=0.5, max_tokens=300,
                     max_retries=2, backoff_s=0.0, **kw)


def test_the_request_body_follows_the_model_family():
    with ScriptedChatServer(lambda body, n: "ok") as srv:
        client = _client(srv.url)
        client.complete([{"role": "user", "content": "hi"}])
        client.complete([{"role": "user", "content": "hi"}], model="openai/gpt-5-mini", temperature=0.7,
                        max_tokens=900)
        chat, reasoning = srv.requests
    assert chat["temperature"] == 0.5 and chat["max_tokens"] == 300 and "max_completion_tokens" not in chat
    assert "temperature" not in reasoning and "max_tokens" not in reasoning
    assert reasoning["max_completion_tokens"] == 900


def test_an_empty_reply_and_an_http_400_are_told_apart():
    def reply(body, n):
        if body["model"] == "openai/gpt-5-nano":
            return Fault(empty=True, finish_reason="length")
        if body["model"] == "bad":
            return Fault(status=400)
        return Fault(empty=True)

    with ScriptedChatServer(reply) as srv:
        client = _client(srv.url)
        with pytest.raises(LLMError) as cut:
            client.complete([{"role": "user", "content": "hi"}], model="openai/gpt-5-nano")
        with pytest.raises(LLMError) as refused:
            client.complete([{"role": "user", "content": "hi"}], model="bad")
        with pytest.raises(LLMError) as empty:
            client.complete([{"role": "user", "content": "hi"}])
        assert len(srv.by_model("bad")) == 1  # a 400 is not retried
    assert cut.value.label == "empty" and "finish_reason=length" in str(cut.value)
    assert "300 tokens was spent on reasoning; raise attacker.max_tokens" in str(cut.value)
    assert refused.value.label == "http_400" and refused.value.status == 400 and "400" in str(refused.value)
    assert empty.value.label == "empty" and "finish_reason=stop" in str(empty.value)


def test_stace_counts_and_reports_empty_replies_and_400s(tmp_path):
    from test_llm_failures import _by_schema

    from emma.api.types import PromptRequest

    def reply(body, n):
        if body["model"] == "m-critic":
            return Fault(empty=True, finish_reason="length")  # a reasoning critic that ran out
        if body["model"] == "m-query":
            return Fault(status=400)  # a parameter the endpoint refuses
        return _by_schema(body, n)

    roles = {"task_verification": "m-task", "hypothesis": "m-hyp", "critic": "m-critic", "query": "m-query",
             "code": "m-code", "experience": "m-exp", "report": "m-report"}
    with ScriptedChatServer(reply) as srv:
        att = stace_attacker(srv.url, tmp_path, roles, iterations=2, k=2, debate_rounds=1, probe_mode="plan")
        att.attack(DiscTarget(), [PromptRequest("an image of a circle", "circle", "ea", "name")])
        n_critic, n_query = len(srv.by_model("m-critic")), len(srv.by_model("m-query"))
    m = att.extra_metrics()
    # the Critic's and the Query Generator's fallbacks kept the run going; the failures still count
    assert m["stace/llm_failed/empty"].value == n_critic == 2  # one Critic call an iteration
    assert m["stace/llm_failed/http_400"].value == n_query
    assert m["stace/sir_h"].value is not None and att.complete()
    note = next(x for x in att.notes() if "empty reply" in x)
    assert "2 got an empty reply" in note and f"{n_query} got HTTP 400" in note and n_query >= 2
    assert "trace's llm_call events" in note
    calls = [json.loads(x) for x in (tmp_path / "stace" / "trace.jsonl").read_text().splitlines()
             if json.loads(x)["event"] == "llm_call" and json.loads(x).get("error_kind")]
    assert {c["error_kind"] for c in calls} == {"empty", "http_400"}


def test_a_baseline_reports_failure_kinds_even_at_zero(tmp_path):
    from attackers.redteam_llm import RedTeamLLMAttacker
    from emma.api.types import PromptRequest

    with ScriptedChatServer(lambda body, n: {"prompts": ["a disc"]}) as srv:
        llm = {"_target_": "stace.llm.LLMClient", "model": "m", "base_url": srv.url, "api_key_env": None}
        att = RedTeamLLMAttacker(llm=llm, images=2, max_calls=1)
        att.bind_cell(output_dir=tmp_path, cache_dir=tmp_path / "cache", info={"model": "fake", "method": "esd"})
        att.attack(DiscTarget(), [PromptRequest("an image of a circle", "circle", "ea", "name")])
    m = att.extra_metrics()
    assert m["llm/failed/empty"].value == 0 and m["llm/failed/http_400"].value == 0
    assert not any("empty reply" in x for x in att.notes())
