"""A real local HTTP server speaking OpenAI's chat-completions protocol, with scripted replies.

Tests start it in a thread, point ``llm=local`` at it, and read what it received. Replies
are chosen per request by a Python function of the parsed request body; a reply may be a
fault: an HTTP status (429, 500), a delay longer than the client's timeout, or text that is
not JSON.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


def user_message(body: dict) -> str:
    """The last user message of a chat-completions request body."""
    return [m["content"] for m in body["messages"] if m["role"] == "user"][-1]


class Fault:
    """A scripted failure: ``status`` (an HTTP error), ``delay_s`` (then the ``text``),
    ``raw`` (an HTTP 200 whose body is these bytes, as ``text/html``: not a chat completion) or
    ``empty`` (a chat completion whose content is empty, with ``finish_reason``)."""

    def __init__(self, status: int | None = None, delay_s: float = 0.0, text: str | None = None,
                 raw: bytes | None = None, empty: bool = False, finish_reason: str = "stop") -> None:
        self.status, self.delay_s, self.text, self.raw = status, delay_s, text, raw
        self.empty, self.finish_reason = empty, finish_reason


class ScriptedChatServer:
    """``with ScriptedChatServer(reply) as srv: ... srv.url ... srv.requests``.

    Args:
        reply: ``reply(body, n_for_model) -> str | Fault``; ``n_for_model`` counts earlier
            requests with the same ``model``.
        key: the bearer token the server demands (401 otherwise).
        port: the port to listen on (0: any free one).
    """

    def __init__(self, reply: Callable[[dict[str, Any], int], Any], key: str | None = None, port: int = 0) -> None:
        self.reply = reply
        self.key = key
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with outer._lock:
                    n = sum(1 for r in outer.requests if r.get("model") == body.get("model"))
                    outer.requests.append(body)
                    outer.headers.append(dict(self.headers))
                if outer.key is not None and self.headers.get("Authorization") != f"Bearer {outer.key}":
                    return self._send(401, {"error": {"message": "bad key"}})
                if not self.path.endswith("/chat/completions"):
                    return self._send(404, {"error": {"message": self.path}})
                out = outer.reply(body, n)
                finish = "stop"
                if isinstance(out, Fault):
                    finish = out.finish_reason
                    if out.delay_s:
                        time.sleep(out.delay_s)
                    if out.status:
                        return self._send(out.status, {"error": {"message": f"scripted {out.status}"}})
                    if out.raw is not None:
                        return self._send(200, out.raw)
                    out = "" if out.empty else (out.text or "")
                text = out if isinstance(out, str) else json.dumps(out)
                self._send(200, {
                    "id": f"c{len(outer.requests)}", "object": "chat.completion", "created": 0,
                    "model": body.get("model"),
                    "choices": [{"index": 0, "finish_reason": finish,
                                 "message": {"role": "assistant", "content": text}}],
                    "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}})

            def _send(self, status: int, payload: dict[str, Any] | bytes) -> None:
                raw = isinstance(payload, bytes)
                data = payload if raw else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "text/html" if raw else "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out first
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> "ScriptedChatServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    def by_model(self, model: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r.get("model") == model]


def stace_attacker(url: str, out: Any, role_models: dict[str, str], llm: dict[str, Any] | None = None,
                   **settings: Any) -> Any:
    """A STACEAttacker on conf/attacker/stace.yaml's settings, talking to the scripted server
    at ``url`` with one model name per role, bound to a cell folder ``out``; ``settings``
    override the config's (iterations, k, probe_mode, ...), ``llm`` the LLM config's."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from attackers.stace import STACEAttacker

    conf = OmegaConf.load(Path(__file__).resolve().parent.parent / "conf" / "attacker" / "stace.yaml")
    args = {k: v for k, v in OmegaConf.to_container(conf).items()
            if k not in ("defaults", "_target_", "_recursive_", "llm")}
    args["roles"] = {r: {"model": m} for r, m in role_models.items()}
    args.update(settings)  # a test may replace the roles too
    llm = {"_target_": "stace.llm.LLMClient", "model": "m-default", "base_url": url, "api_key_env": None,
           "timeout": 5, "max_retries": 1, "backoff_s": 0.01, **(llm or {})}
    att = STACEAttacker(llm=llm, **args)
    att.bind_cell(output_dir=out, cache_dir=out / "cache", info={"model": "fake", "method": "none"})
    return att


class DiscTarget:
    """A generation target without diffusion for the STACE tests: an image is a constant whose
    value is the judge's probability of the concept — ``disc`` for prompts saying 'disc'
    (detected: > 0.5), ``round`` for prompts saying 'round', 0 otherwise. Hashes are the
    (prompt, seed) pairs; ``calls`` records every generate call."""

    class judge:  # noqa: N801 (mimics GenerationTarget.judge.classifier)
        class classifier:  # noqa: N801
            name = "fake"
            labels = ["circle", "square"]

            @staticmethod
            def label_index(c: str) -> int:
                return ["circle", "square"].index(c)

    def __init__(self, disc: float = 1.0, round: float = 0.0) -> None:  # noqa: A002
        self.disc, self.round = disc, round
        self.calls: list[tuple[list[str], list[int]]] = []

    @property
    def prompts(self) -> list[str]:
        return [p for prompts, _ in self.calls for p in prompts]

    def _score(self, prompt: str) -> float:
        return self.disc if "disc" in prompt else self.round if "round" in prompt else 0.0

    def generate(self, prompts, seeds, negative_prompt=None):
        import torch

        from emma.api.types import GeneratedImages

        self.calls.append((list(prompts), list(seeds)))
        images = torch.stack([torch.full((3, 4, 4), self._score(p)) for p in prompts])
        return GeneratedImages(images=images, hashes=[f"{p}|{s}" for p, s in zip(prompts, seeds)],
                               cached=[False] * len(prompts))

    def score(self, images, hashes=None):
        import torch

        v = images.mean(dim=(1, 2, 3))
        return torch.stack([v, 1 - v], dim=1)

    def detect(self, probs, concept):
        return probs[:, 0] > 0.5
