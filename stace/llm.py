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

import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from emma.errors import ConfigError, EmmaError

Message = Mapping[str, str]


class LLMError(EmmaError):
    """An LLM call that failed or returned something unusable."""


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
        timeout: seconds per request.
        max_retries: retries of transient failures (the ``openai`` client's own backoff).
        seed: default sampling seed, for endpoints that honour it.
    """

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
    ) -> None:
        self.model = model
        self.base_url = base_url
        self.api_key_env = api_key_env
        self.temperature = float(temperature)
        self.max_tokens = max_tokens
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.seed = seed
        self._client: Any = None

    def __repr__(self) -> str:  # never shows the key
        return (f"LLMClient(model={self.model!r}, base_url={self.base_url!r}, "
                f"api_key_env={self.api_key_env!r})")

    def config(self) -> dict[str, Any]:
        """What to record in results (no secret)."""
        return {"model": self.model, "base_url": self.base_url, "api_key_env": self.api_key_env,
                "temperature": self.temperature, "max_tokens": self.max_tokens, "seed": self.seed}

    def _api_key(self) -> str:
        if self.api_key_env is None:
            return "EMPTY"
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ConfigError(
                f"the LLM API key is read from the environment variable {self.api_key_env}, "
                f"which is not set; export it, or choose another conf/llm config")
        return key

    def _openai(self) -> Any:
        if self._client is None:
            try:
                import openai
            except ImportError as exc:
                raise EmmaError("the LLM client needs the `openai` package: "
                                "pip install 'emma-harness[llm]'") from exc
            self._client = openai.OpenAI(api_key=self._api_key(), base_url=self.base_url,
                                         timeout=self.timeout, max_retries=self.max_retries)
        return self._client

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
        kwargs: dict[str, Any] = {
            "model": self.model, "messages": [dict(m) for m in messages],
            "temperature": self.temperature if temperature is None else temperature,
        }
        limit = self.max_tokens if max_tokens is None else max_tokens
        if limit is not None:
            kwargs["max_tokens"] = limit
        if (seed if seed is not None else self.seed) is not None:
            kwargs["seed"] = seed if seed is not None else self.seed
        if json_mode:
            kwargs["response_format"] = {"type": "json_object"}
        client = self._openai()
        try:
            response = client.chat.completions.create(**kwargs)
        except Exception as exc:  # the openai package's error classes vary across versions
            raise LLMError(f"{self.model} at {self.base_url or 'api.openai.com'} failed: "
                           f"{type(exc).__name__}: {exc}") from exc
        content = response.choices[0].message.content if response.choices else None
        if not content:
            raise LLMError(f"{self.model} returned an empty reply")
        return content

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
