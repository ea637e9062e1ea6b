"""A small OpenAI-compatible chat client, shared by STACE's agents and the data scripts.

Any endpoint that speaks the OpenAI chat-completions API works (OpenAI, OpenRouter, vLLM,
llama.cpp servers, ...). The ``openai`` package is imported lazily, so the harness runs
without it; the API key is read from the environment variable the config names and is
never logged, printed or stored in configs::

    client = LLMClient(model="openai/gpt-5-mini", base_url="https://openrouter.ai/api/v1",
                       api_key_env="OPENROUTER_API_KEY")
    text = client.chat([{"role": "user", "content": "Say hi"}])
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from emma.errors import ConfigError, EmmaError
from emma.results import strip_url_credentials

Message = Mapping[str, str]


class LLMError(EmmaError):
    """An LLM call that failed or returned something unusable.

    Attributes:
        kind: ``unreachable`` (no connection), ``timeout``, ``http`` (an HTTP error status),
            ``empty`` (a chat completion without content), ``malformed`` (a response that is
            not a chat completion), ``deadline`` (the cell's LLM time is spent) or ``invalid``
            (a reply that fails its schema; set by :class:`stace.gateway.Gateway`).
        status: the HTTP status of an ``http`` error (400: the endpoint refused the request,
            often a parameter the model does not take).
    """

    def __init__(self, message: str, kind: str = "malformed", status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status

    @property
    def label(self) -> str:
        """``http_400``, ``http_5xx`` ..., else the kind: what the failure counts are keyed by."""
        if self.kind == "http" and self.status is not None:
            return f"http_{self.status}" if 400 <= self.status < 500 else "http_5xx"
        return self.kind


def error_kind(exc: BaseException) -> str:
    """The :attr:`LLMError.kind` of an exception the openai client raised."""
    if isinstance(getattr(exc, "status_code", None), int):
        return "http"
    name = type(exc).__name__
    if "Timeout" in name:
        return "timeout"
    if "Connection" in name:
        return "unreachable"
    return "malformed"


#: model names (provider prefix allowed) of reasoning models: they take no ``temperature`` and
#: limit their output with ``max_completion_tokens`` (reasoning included), not ``max_tokens``
REASONING_MODELS = (r"(^|/)o[1-9](-|$)", r"(^|/)gpt-5(?!-chat)(\.\d+)?(-|$)")


def model_family(model: str, extra_reasoning: Sequence[str] = ()) -> str:
    """``reasoning`` (OpenAI's o-series and GPT-5, and names matching ``extra_reasoning``
    regexes) or ``chat``: which request parameters the model takes."""
    return "reasoning" if any(re.search(p, model) for p in (*REASONING_MODELS, *extra_reasoning)) else "chat"


def request_params(model: str, temperature: float | None, limit: int | None,
                   extra_reasoning: Sequence[str] = ()) -> dict[str, Any]:
    """The sampling parameters of one request, per model family: a chat model gets
    ``temperature`` and ``max_tokens``; a reasoning model no temperature (it takes only its
    default) and ``max_completion_tokens``, which bounds reasoning and reply together."""
    if model_family(model, extra_reasoning) == "reasoning":
        return {} if limit is None else {"max_completion_tokens": int(limit)}
    out: dict[str, Any] = {}
    if temperature is not None:
        out["temperature"] = float(temperature)
    if limit is not None:
        out["max_tokens"] = int(limit)
    return out


def positive(value: Any, name: str, *, integer: bool = False, zero: bool = False) -> Any:
    """``value`` as a finite number > 0 (``zero``: >= 0), else a one-line :class:`ConfigError`
    naming the setting ``name``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    ok = math.isfinite(number) and (number >= 0 if zero else number > 0)
    if integer:
        ok = ok and number == int(number) and not isinstance(value, bool)
    if not ok:
        what = "an integer" if integer else "a finite number"
        raise ConfigError(f"{name}={value!r}: must be {what} {'>= 0' if zero else '> 0'}")
    return int(number) if integer else number


@dataclasses.dataclass
class ChatResult:
    """One completed chat call.

    Attributes:
        text: the assistant's reply.
        model: the model that answered.
        prompt_tokens / completion_tokens: usage as the endpoint reported it (0 if not).
        latency_s: wall seconds of the successful attempt plus the waits before it.
        retries: transient failures (429, 5xx, timeouts, connection errors) retried first.
        errors: one line per retried failure.
    """

    text: str
    model: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    retries: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: rate limits (429), server errors (5xx), timeouts, lost connections."""
    status = getattr(exc, "status_code", None)
    if isinstance(status, int):
        return status == 429 or status >= 500
    name = type(exc).__name__
    return name in ("APITimeoutError", "APIConnectionError", "Timeout", "TimeoutError",
                    "ConnectionError", "ReadTimeout")


class LLMClient:
    """Chat completions against an OpenAI-compatible endpoint.

    Args:
        model: model name as the endpoint knows it (``"gpt-4o-mini"``,
            ``"openai/gpt-5-mini"`` on OpenRouter, ...).
        base_url: the endpoint (``None``: OpenAI's default).
        api_key_env: name of the environment variable holding the key (``None``: a
            key-less local server; the client then sends the placeholder ``"EMPTY"``).
        temperature: default sampling temperature.
        max_tokens: default completion length limit (``None``: the endpoint's default).
        timeout: seconds a request may wait for the reply (the read timeout; > 0).
        connect_timeout: seconds to open a connection (> 0).
        deadline_s: seconds all requests together may take, from the first one (> 0; ``None``:
            unbounded); :meth:`set_deadline` replaces it (STACE's gateway: from the attack's start).
        max_retries: retries of transient failures (429, 5xx, timeouts), with exponential
            backoff and jitter; each retry is counted in :class:`ChatResult`.
        seed: default sampling seed, for endpoints that honour it.
        backoff_s: first backoff wait; doubles per retry (capped at 30 s).
        per_role_models: the endpoint serves many models (OpenRouter), so STACE may give each
            agent role its preset's model; otherwise every role uses ``model``.
        reasoning_models: regexes of further model names to treat as reasoning models
            (:func:`model_family`; OpenAI's o-series and GPT-5 always are).
    """

    is_local = False
    probe_mode = "code"  # STACE: models behind an API write probe code

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key_env: str | None = "OPENAI_API_KEY",
        temperature: float = 0.0,
        max_tokens: int | None = None,
        timeout: float = 60.0,
        max_retries: int = 3,
        seed: int | None = None,
        backoff_s: float = 1.0,
        per_role_models: bool = False,
        connect_timeout: float = 10.0,
        deadline_s: float | None = None,
        reasoning_models: Sequence[str] | None = None,
    ) -> None:
        if not model or not isinstance(model, str):
            raise ConfigError(f"llm.model={model!r}: must name the model the endpoint serves")
        if base_url is not None and not (isinstance(base_url, str)
                                         and base_url.startswith(("http://", "https://"))):
            raise ConfigError(f"llm.base_url={strip_url_credentials(str(base_url))!r}: must be an "
                              "http:// or https:// URL, or null (OpenAI's API)")
        self.model = model
        self.base_url = base_url
        self.api_key_env = api_key_env
        self.temperature = positive(temperature, "llm.temperature", zero=True)
        self.max_tokens = None if max_tokens is None else positive(max_tokens, "llm.max_tokens", integer=True)
        self.timeout = positive(timeout, "llm.timeout")
        self.connect_timeout = positive(connect_timeout, "llm.connect_timeout")
        self.max_retries = positive(max_retries, "llm.max_retries", integer=True, zero=True)
        self.seed = seed
        self.backoff_s = positive(backoff_s, "llm.backoff_s", zero=True)
        self.per_role_models = bool(per_role_models)
        self.deadline_s = None if deadline_s is None else positive(deadline_s, "llm.deadline_s")
        self.deadline: float | None = None  # time.monotonic() past which no request is sent
        self.reasoning_models = tuple(str(p) for p in (reasoning_models or ()))
        for pattern in self.reasoning_models:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(f"llm.reasoning_models: {pattern!r} is no regular expression ({exc})") from None
        self._client: Any = None

    @property
    def endpoint(self) -> str:
        """The endpoint's URL without credentials (for messages and records)."""
        return strip_url_credentials(self.base_url) if self.base_url else "https://api.openai.com/v1"

    def __repr__(self) -> str:  # never shows the key
        return (f"LLMClient(model={self.model!r}, base_url={self.endpoint!r}, "
                f"api_key_env={self.api_key_env!r})")

    def config(self) -> dict[str, Any]:
        """What to record in results (no secret: credentials in the URL are removed)."""
        return {"model": self.model, "base_url": strip_url_credentials(self.base_url) if self.base_url else None,
                "api_key_env": self.api_key_env, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "seed": self.seed, "family": model_family(self.model,
                                                                                         self.reasoning_models),
                "reasoning_models": list(self.reasoning_models)}

    def set_deadline(self, deadline: float | None) -> None:
        """No request is sent, and none waits, past ``deadline`` (a ``time.monotonic()``)."""
        self.deadline = deadline

    def _time_left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    def _api_key(self) -> str:
        if self.api_key_env is None:
            return "EMPTY"
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ConfigError(
                f"the LLM API key is read from the environment variable {self.api_key_env}, "
                f"which is not set; export it, or run offline with llm=embedded (in-process "
                f"model) or llm=local (an OpenAI-compatible server such as vLLM or llama.cpp)")
        return key

    def check_available(self) -> None:
        """Raise :class:`ConfigError` now if the key is missing (before any model loads)."""
        self._api_key()

    def _openai(self) -> Any:
        if self._client is None:
            try:
                import openai
            except ImportError as exc:
                raise EmmaError("the LLM client needs the `openai` package: "
                                "pip install 'emma-harness[llm]'") from exc
            # retries are ours (counted, traced); the openai client's own are switched off
            self._client = openai.OpenAI(api_key=self._api_key(), base_url=self.base_url,
                                         timeout=self.timeout, max_retries=0)  # each request sets its own
        return self._client

    def complete(
        self,
        messages: Sequence[Message],
        *,
        model: str | None = None,
        temperature: float | None = None,
        max_tokens: int | None = None,
        seed: int | None = None,
        schema: dict[str, Any] | None = None,
    ) -> ChatResult:
        """One chat completion with retries of transient failures.

        Args:
            messages: OpenAI-style messages.
            model: overrides the default model (per-role models share one client).
            temperature / max_tokens / seed: override the defaults.
            schema: a JSON schema the reply must follow; sent as ``response_format``
                (``json_schema``), which OpenAI, OpenRouter, vLLM and llama.cpp servers
                enforce; the caller still validates the reply.

        Raises:
            LLMError: a non-transient failure, transient ones past ``max_retries``, a response
                that is no chat completion, or the deadline (:meth:`set_deadline`) reached.
        """
        name = model or self.model
        kwargs: dict[str, Any] = {"model": name, "messages": [dict(m) for m in messages]}
        limit = self.max_tokens if max_tokens is None else max_tokens
        kwargs.update(request_params(name, self.temperature if temperature is None else float(temperature),
                                     limit, self.reasoning_models))
        if (seed if seed is not None else self.seed) is not None:
            kwargs["seed"] = int(seed if seed is not None else self.seed)
        if schema is not None:
            kwargs["response_format"] = {"type": "json_schema", "json_schema": {
                "name": str(schema.get("title", "reply")), "schema": schema}}
        if self.deadline is None and self.deadline_s is not None:
            self.deadline = time.monotonic() + self.deadline_s
        client = self._openai()
        import httpx  # the openai package's HTTP client

        errors: list[str] = []
        t0 = time.perf_counter()
        where = f"{kwargs['model']} at {self.endpoint}"
        for attempt in range(self.max_retries + 1):
            left = self._time_left()
            if left <= 0:
                raise LLMError(f"{where}: the cell's LLM time is spent (llm.deadline_s)", "deadline")
            try:
                timeout = httpx.Timeout(min(self.timeout, left), connect=min(self.connect_timeout, left))
                response = client.chat.completions.create(**kwargs, timeout=timeout)
                break
            except Exception as exc:  # the openai package's error classes vary across versions
                line = f"{type(exc).__name__}: {strip_url_credentials(' '.join(str(exc).split()))[:160]}"
                if not is_transient(exc) or attempt == self.max_retries:
                    status = getattr(exc, "status_code", None)
                    raise LLMError(f"{where} failed after {attempt} retries: {line}", error_kind(exc),
                                   status if isinstance(status, int) else None) from exc
                errors.append(line)
                wait = min(30.0, self.backoff_s * 2 ** attempt) * (0.5 + random.random() / 2)
                time.sleep(max(0.0, min(wait, self._time_left())))
        try:
            content = response.choices[0].message.content if response.choices else None
        except (AttributeError, IndexError, TypeError) as exc:  # e.g. an HTML page instead of JSON
            raise LLMError(f"{where} answered with something that is not a chat completion: "
                           f"{' '.join(str(response).split())[:120]!r}", "malformed") from exc
        if not content:
            finish = getattr(response.choices[0], "finish_reason", None) if response.choices else None
            hint = ""
            if finish == "length":
                hint = (f" (finish_reason=length: the limit of {limit} tokens was spent"
                        + (" on reasoning; raise attacker.max_tokens for this role)"
                           if model_family(kwargs["model"], self.reasoning_models) == "reasoning" else ")"))
            elif finish:
                hint = f" (finish_reason={finish})"
            raise LLMError(f"{where} returned an empty reply{hint}", "empty")
        usage = getattr(response, "usage", None)
        return ChatResult(text=content, model=getattr(response, "model", None) or kwargs["model"],
                          prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
                          completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
                          latency_s=time.perf_counter() - t0, retries=len(errors), errors=errors)

    def chat(
        self,
        messages: Sequence[Message] | str,
        *,
        temperature: float | None = None,
        max_tokens: int | None = None,
        seed: int | None = None,
        json_mode: bool = False,
    ) -> str:
        """The assistant's reply to ``messages``.

        Args:
            messages: OpenAI-style ``{"role", "content"}`` messages, or one user message.
            temperature: overrides the default temperature.
            max_tokens: overrides the default length limit.
            seed: overrides the default seed.
            json_mode: ask the endpoint for a JSON object (``response_format``).

        Raises:
            LLMError: the request failed or the reply is empty.
        """
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        schema = {"type": "object", "title": "reply"} if json_mode else None
        return self.complete(messages, temperature=temperature, max_tokens=max_tokens, seed=seed,
                             schema=schema).text

    def chat_json(self, messages: Sequence[Message] | str, **kwargs: Any) -> Any:
        """Like :meth:`chat`, parsing the reply as JSON (a fenced ```json block is accepted)."""
        return parse_json_reply(self.chat(messages, **kwargs))


def parse_json_reply(text: str) -> Any:
    """JSON from an LLM reply, tolerating a Markdown code fence around it.

    Raises:
        LLMError: the reply holds no valid JSON (the message quotes its start).
    """
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.DOTALL)
    body = fenced.group(1) if fenced else text
    try:
        return json.loads(body)
    except ValueError as exc:
        raise LLMError(f"the reply is not valid JSON ({exc}): {text[:200]!r}") from exc
