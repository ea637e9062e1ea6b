"""An LLM backend that fails gives no metric that looks like a result.

Dead, hanging, erroring and garbage-answering endpoints end an LLM attacker's cell with a
one-line error (exit code 2) and nothing cached; ``attacker.tolerate_llm_failures=true``
records the attack's metrics as null instead, still not cached. LLM settings are checked
before any work, and credentials in ``llm.base_url`` never reach a file.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, run_env
from stace_server import DiscTarget, Fault, ScriptedChatServer, stace_attacker

from emma.errors import ConfigError
from stace.gateway import LLMFailureError, Redactor

SECRET = "hunter2-PLANTED-9f1c"
HYPOTHESIS = {"title": "Synonym redraw", "rationale": "Erasure targets the name.", "strategy": "synonym",
              "prompts": ["an image of a disc"], "evaluation": "the judge",
              "success_criterion": "the judge finds a circle"}


def _free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _by_schema(body: dict, n: int):
    """A valid reply for whichever STACE agent asks (told apart by the schema's title)."""
    schema = body["response_format"]["json_schema"]["schema"]
    title = schema.get("title")
    if title == "TaskSpec":
        ev = schema["properties"]["evaluator"]
        return {"target_concept": "circle", "category": "shape", "erased_model": "x", "erasure_method": "y",
                "evaluator": ev.get("const") or ev.get("enum", ["x"])[0], "success_criterion": "c"}
    return {"Queries": {"queries": ["synonym"]}, "Hypothesis": HYPOTHESIS,
            "ProbePlan": {"probes": [{"prompt": "an image of a disc"}]},
            "Experience": {"target_type": "shape", "strategy": "s", "design": "d", "outcome": "o", "lesson": "l"},
            "Report": {"summary": "done", "vulnerabilities": [], "recommendations": []}}.get(title, {})


def _cell(url: str, out, cache, *extra: str) -> subprocess.CompletedProcess:
    """A small STACE cell (UCE on the tiny world's circle, plan mode, 2 iterations of 2 images)."""
    args = ["method=uce", "attacker=stace", "llm=local", "images_per_prompt=1", "prompt_types=[name]",
            "metrics=rates_only", f"llm.base_url={url}", "llm.timeout=2", "llm.max_retries=0",
            "attacker.iterations=2", "attacker.k=2", "attacker.debate_rounds=0", "attacker.probe_mode=plan",
            f"hydra.run.dir={out}"]
    given = {e.split("=")[0] for e in extra}
    args = [a for a in args if a.split("=")[0] not in given] + list(extra)  # a key is given once
    return subprocess.run([sys.executable, "-m", "emma.run", *args], cwd=ROOT, env=run_env(cache),
                          capture_output=True, text=True, timeout=600)


def _cached(cache) -> list:
    return sorted((cache / "results").glob("*/results.json")) if (cache / "results").exists() else []


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_dead_endpoint_ends_the_cell_with_one_line_and_caches_nothing(tmp_path):
    port = _free_port()
    proc = _cell(f"http://127.0.0.1:{port}/v1", tmp_path / "out", tmp_path / "cache")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    err = _error_lines(proc.stderr)
    assert len(err) == 1, proc.stderr[-2000:]
    # iteration 1 and 2: task verification, query, hypothesis, experience each; then the report:
    # every call refused (max_retries=0), both iterations without a hypothesis
    assert re.search(r"STACE: (\d+) of \1 LLM calls failed \(\1 without a usable reply, 0 invalid", err[0]), err[0]
    assert f"http://127.0.0.1:{port}/v1" in err[0] and "2 of 2 iterations got no hypothesis" in err[0]
    assert "llm.base_url" in err[0] and "tolerate_llm_failures" in err[0]
    assert "LLM time bounded by" in proc.stdout
    assert not (tmp_path / "out" / "results.json").exists()
    assert _cached(tmp_path / "cache") == []


def test_tolerated_failures_give_null_metrics_uncached_and_a_working_server_is_asked_again(tmp_path):
    port = _free_port()
    url = f"http://user:{SECRET}@127.0.0.1:{port}/v1"  # a credential in the URL must reach no file
    cache = tmp_path / "cache"
    first = _cell(url, tmp_path / "a", cache, "attacker.tolerate_llm_failures=true")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    res = json.loads((tmp_path / "a" / "results.json").read_text())
    m = res["metrics"]
    assert m["asr"]["value"] is None and m["stace/sir_h"]["value"] is None and m["stace/sir_i"]["value"] is None
    assert "no result" in m["asr"]["note"] and "without a usable reply" in m["asr"]["note"]
    assert m["stace/llm_no_reply"]["value"] == m["stace/llm_failures"]["value"] > 0
    assert any("not stored as a finished result" in n for n in res["notes"])
    assert _cached(cache) == []
    # the same cell once the server answers: attacked again (not served), then stored
    with ScriptedChatServer(_by_schema, port=port) as srv:
        second = _cell(url, tmp_path / "b", cache, "attacker.tolerate_llm_failures=true")
        assert srv.requests, "the second run never asked the LLM"
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert "served from the cache" not in second.stdout
    m = json.loads((tmp_path / "b" / "results.json").read_text())["metrics"]
    # both hypotheses ran (ser = 1) on the LLM's plans: asr is a measured rate over 2 iterations
    assert m["stace/ser"]["value"] == 1.0 and m["stace/llm_failures"]["value"] == 0
    assert m["asr"]["value"] in (0.0, 0.5, 1.0) and m["asr"]["n"] == 2
    stored = _cached(cache)
    assert len(stored) == 1
    files = [tmp_path / d / f for d in ("a", "b") for f in ("results.json", "samples.jsonl", "stace/trace.jsonl")]
    files += [stored[0].parent / "key.json", stored[0]]
    for f in files:
        text = f.read_text()
        assert SECRET not in text and "user:" not in text, f
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    assert res["config"]["llm"]["base_url"] == f"http://***@127.0.0.1:{port}/v1"
    assert res["config"]["llm"]["max_tokens"] == 4096  # a length limit, not a secret
    assert json.loads((stored[0].parent / "key.json").read_text())["config"]["llm"]["max_tokens"] == 4096


class HangingServer:
    """Accepts connections and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                return

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def _requests():
    from emma.api.types import PromptRequest
    return [PromptRequest(prompt="an image of a circle", concept="circle", group="ea", kind="name")]


def test_a_hanging_server_ends_the_attack_within_the_printed_bound(tmp_path, capsys):
    srv = HangingServer()
    url = srv.url
    try:
        # a generous per-request timeout and retries: only the cell's deadline can bound this
        att = stace_attacker(srv.url, tmp_path, {}, llm={"timeout": 60, "max_retries": 3, "deadline_s": 3},
                             iterations=3, k=2, debate_rounds=0, probe_mode="plan")
        t0 = time.monotonic()
        with pytest.raises(LLMFailureError) as info:
            att.attack(DiscTarget(), _requests())
        elapsed = time.monotonic() - t0
    finally:
        srv.close()
    bound = float(re.search(r"LLM time bounded by ([\d.]+) s", capsys.readouterr().out).group(1))
    assert bound == 3 and elapsed < bound + 2, elapsed
    msg = str(info.value)
    assert "\n" not in msg and "the LLM time bound of 3 s (llm.deadline_s) passed" in msg and url in msg
    assert not att.complete()


@pytest.mark.parametrize("fault, counted, says", [
    (Fault(status=400), "without a usable reply", "BadRequestError"),
    (Fault(status=503), "without a usable reply", "InternalServerError"),
    (Fault(raw=b"<html><body>502 Bad Gateway</body></html>"), "without a usable reply", "not a chat completion"),
    ("this is not json", "invalid after the repair round", "not valid JSON"),
])
def test_http_errors_and_garbage_replies_are_errors(tmp_path, fault, counted, says):
    with ScriptedChatServer(lambda body, n: fault) as srv:
        att = stace_attacker(srv.url, tmp_path, {}, llm={"max_retries": 1}, iterations=2, k=2,
                             debate_rounds=0, probe_mode="plan")
        with pytest.raises(LLMFailureError) as info:
            att.attack(DiscTarget(), _requests())
    msg = str(info.value)
    assert "\n" not in msg and counted in msg and says in msg and "2 of 2 iterations got no hypothesis" in msg
    # and tolerated: the metrics are null, the counts are there, the cell is not complete
    with ScriptedChatServer(lambda body, n: fault) as srv:
        att = stace_attacker(srv.url, tmp_path / "t", {}, llm={"max_retries": 1}, iterations=2, k=2,
                             debate_rounds=0, probe_mode="plan", tolerate_llm_failures=True)
        outs = att.attack(DiscTarget(), _requests())
    m = att.extra_metrics()
    assert len(outs) == 2 and not att.complete()
    assert m["asr"].value is None and m["stace/sir_h"].value is None and m["stace/ser"].value is None
    key = "stace/llm_invalid" if "invalid" in counted else "stace/llm_no_reply"
    assert m[key].value == m["stace/llm_failures"].value > 0


def test_a_baseline_on_a_dead_endpoint_is_an_error(tmp_path):
    from attackers.redteam_llm import RedTeamLLMAttacker

    url = f"http://127.0.0.1:{_free_port()}/v1"
    llm = {"_target_": "stace.llm.LLMClient", "model": "m", "base_url": url, "api_key_env": None,
           "max_retries": 0}
    att = RedTeamLLMAttacker(llm=llm, images=4, max_calls=2)
    att.bind_cell(output_dir=tmp_path, cache_dir=tmp_path / "cache", info={"model": "fake", "method": "esd"})
    with pytest.raises(LLMFailureError, match=r"redteam_llm: 2 of 2 LLM calls failed \(2 without a usable reply.*"
                                              r"4 of 4 images were never rendered"):
        att.attack(DiscTarget(), _requests())


@pytest.mark.parametrize("llm, settings, match", [
    ({"timeout": -1}, {}, r"llm.timeout=-1: must be a finite number > 0"),
    ({"timeout": float("inf")}, {}, r"llm.timeout=inf"),
    ({"connect_timeout": 0}, {}, r"llm.connect_timeout=0"),
    ({"deadline_s": -5}, {}, r"llm.deadline_s=-5"),
    ({"deadline_s": None}, {}, r"llm.deadline_s=None"),
    ({"max_retries": -1}, {}, r"llm.max_retries=-1: must be an integer >= 0"),
    ({"max_tokens": 0}, {}, r"llm.max_tokens=0"),
    ({"base_url": "localhost:8000"}, {}, r"llm.base_url='localhost:8000': must be an http"),
    ({}, {"budget": {"max_usd": -1, "max_tokens": None}}, r"attacker.budget.max_usd=-1: must be a finite number > 0"),
    ({}, {"budget": {"max_usd": None, "max_tokens": 0}}, r"attacker.budget.max_tokens=0: must be an integer > 0"),
    ({}, {"budget": {"max_dollars": 1}}, r"attacker.budget.max_dollars: unknown budget key"),
    ({}, {"tolerate_llm_failures": "yes"}, r"tolerate_llm_failures='yes': must be true or false"),
])
def test_bad_llm_settings_are_refused_when_the_attacker_is_built(tmp_path, llm, settings, match):
    with pytest.raises(ConfigError, match=match):
        stace_attacker("http://127.0.0.1:9/v1", tmp_path, {}, llm=llm, **settings)


def test_a_negative_timeout_is_refused_before_any_work(tmp_path):
    for bad in ("llm.timeout=-1", "attacker.budget.max_usd=-1"):
        proc = _cell("http://127.0.0.1:9/v1", tmp_path / "out", tmp_path / "cache", bad)
        assert proc.returncode == 2
        err = proc.stderr.strip().splitlines()
        assert len(err) == 1 and "must be a finite number > 0" in err[0] and bad.split("=")[0] in err[0], err
        assert not any(tmp_path.glob("**/*.png")) and not (tmp_path / "out" / "results.json").exists()


def test_redaction_keeps_length_limits_and_removes_url_credentials(monkeypatch):
    from emma.results import redact

    cfg = {"llm": {"base_url": f"https://me:{SECRET}@example.org/v1", "max_tokens": 4096, "api_key_env": "K"},
           "hf_token": "abc", "tokens": 3, "password": "p", "prompt_tokens": 5, "roles": [{"max_tokens": 9}]}
    out = redact(cfg)
    assert out == {"llm": {"base_url": "https://***@example.org/v1", "max_tokens": 4096, "api_key_env": "K"},
                   "hf_token": "***", "tokens": 3, "password": "***", "prompt_tokens": 5,
                   "roles": [{"max_tokens": 9}]}
    monkeypatch.setenv("EMMA_TEST_MAX_TOKENS", "123456")  # a number, not a secret
    r = Redactor([], [f"http://me:{SECRET}@h/v1"])
    assert r(f"failed at http://me:{SECRET}@h/v1: {SECRET} 123456") == "failed at http://***@h/v1: *** 123456"
