"""The agents' single door to an LLM: per-role settings, prompt templates, schema-checked
replies with one repair round, a temperature-0 response cache, token and cost accounting,
a budget cap, and a redacted trace of every call.

An agent asks ``gateway.ask("critic", "critic", {...}, Critique)``: the template
``stace/prompts/critic.md`` is rendered with the variables, sent to the role's model at the
role's temperature, and the reply is parsed and validated against ``Critique``. A reply that
fails validation gets one repair round (the error and the schema are sent back); a call that
still fails returns ``None`` and is counted — it never ends the run. Only the budget and the
cell's LLM time (``llm.deadline_s``) do; whether the failures left the attack without its
result is the attacker's call (:func:`failure_error`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import jinja2
from pydantic import BaseModel, ValidationError

from emma.cache import stable_hash
from emma.errors import ConfigError, EmmaError
from emma.files import atomic_write_text
from emma.results import is_secret_name, strip_url_credentials, url_credentials
from stace.llm import ChatResult, LLMError, parse_json_reply, positive

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
T = TypeVar("T", bound=BaseModel)
#: the cell's LLM time when the LLM config sets no ``deadline_s``
DEFAULT_DEADLINE_S = 7200.0


class BudgetExhausted(EmmaError):
    """The run spent its token or dollar budget; STACE stops and reports what it has."""


class LLMDeadline(BudgetExhausted):
    """The cell's LLM time (``llm.deadline_s``) is spent: no more calls are made."""


class LLMFailureError(EmmaError):
    """LLM calls failed and left the attack without its result; the cell records nothing."""


def build_backend(llm_cfg: dict[str, Any]) -> Any:
    """The LLM backend of a ``conf/llm`` dict; a setting it refuses raises its own one-line
    :class:`EmmaError` (not Hydra's wrapper)."""
    import hydra.utils
    from hydra.errors import InstantiationException

    try:
        return hydra.utils.instantiate(llm_cfg)
    except InstantiationException as err:
        if isinstance(err.__cause__, EmmaError):
            raise err.__cause__ from None
        raise


def pop_deadline(llm_cfg: dict[str, Any]) -> float:
    """Remove and validate ``deadline_s`` (the cell's LLM time; a cell setting the gateway
    enforces, not a backend's) from an LLM config dict."""
    value = llm_cfg.pop("deadline_s", DEFAULT_DEADLINE_S)
    return positive(value, "llm.deadline_s")


def check_budget(budget: Mapping[str, Any] | None, where: str = "attacker.budget") -> dict[str, Any]:
    """``{max_usd, max_tokens}`` validated: each null (no limit) or > 0 (max_tokens an integer)."""
    budget = dict(budget or {})
    unknown = sorted(set(budget) - {"max_usd", "max_tokens"})
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown budget key; valid: max_usd, max_tokens")
    if budget.get("max_usd") is not None:
        budget["max_usd"] = positive(budget["max_usd"], f"{where}.max_usd")
    if budget.get("max_tokens") is not None:
        budget["max_tokens"] = positive(budget["max_tokens"], f"{where}.max_tokens", integer=True)
    return budget


def check_tolerate(value: Any, where: str = "attacker.tolerate_llm_failures") -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}={value!r}: must be true or false")
    return value


def time_bound_line(backend: Any, deadline_s: float) -> str:
    """The line printed when an attack starts: how long its LLM calls may take at most."""
    line = f"LLM time bounded by {deadline_s:g} s (llm.deadline_s)"
    if hasattr(backend, "connect_timeout"):
        line += (f"; per request: connect {backend.connect_timeout:g} s, reply {backend.timeout:g} s, "
                 f"{backend.max_retries} retries; endpoint {backend.endpoint}")
    return line


@dataclasses.dataclass
class RoleSettings:
    """Model, temperature and length limit of one agent role."""

    model: str
    temperature: float = 0.7
    max_tokens: int = 1024


@dataclasses.dataclass
class RoleUsage:
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    retries: int = 0
    repairs: int = 0
    failures: int = 0    # calls that ended with no usable reply: no_reply + invalid
    cache_hits: int = 0
    no_reply: int = 0    # the endpoint never answered usably (refused, timeout, HTTP error, not a completion)
    invalid: int = 0     # it answered, and the reply failed its schema after the repair round
    # failed calls by what went wrong: empty (a completion without content), http_400, http_5xx,
    # timeout, unreachable, malformed, deadline, backend (an in-process model's error), invalid
    kinds: dict[str, int] = dataclasses.field(default_factory=dict)


class Redactor:
    """Replaces secret values with ``***`` in everything STACE writes.

    The secrets are the values of the API-key variable the LLM config names, every
    environment variable whose name holds a credential (``*_API_KEY``, ``*_TOKEN``, ...:
    :func:`emma.results.is_secret_name`) and the ``user:password`` of the endpoint's URL;
    any ``user:password@`` in a URL is removed too.
    """

    def __init__(self, key_envs: list[str | None] = (), urls: list[str | None] = ()) -> None:
        names = {n for n in key_envs if n} | {n for n in os.environ if is_secret_name(n)}
        secrets = {os.environ[n] for n in names if len(os.environ.get(n, "")) >= 6}
        secrets |= {c for u in urls if u for c in url_credentials(u) if len(c) >= 4}
        self.secrets = sorted(secrets, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, "***")
        return strip_url_credentials(text)

    def obj(self, value: Any) -> Any:
        return json.loads(self(json.dumps(value, default=str)))


class Trace:
    """Append-only JSONL of a STACE run (one event per line, secrets redacted)."""

    def __init__(self, path: Path, redact: Redactor) -> None:
        self.path = Path(path)
        self.redact = redact
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **data: Any) -> None:
        line = self.redact(json.dumps({"event": event, "time": time.time(), **data}, default=str))
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def events(self, event: str | None = None) -> list[dict[str, Any]]:
        """Every complete event (a line torn by a kill is skipped)."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if event is None or rec.get("event") == event:
                out.append(rec)
        return out


def load_template(name: str, directory: Path | None = None) -> tuple[str, str]:
    """(system, user) Jinja templates of ``<name>.md``: the text under ``## system`` and
    ``## user`` headings."""
    path = Path(directory or PROMPTS_DIR) / f"{name}.md"
    if not path.exists():
        valid = sorted(p.stem for p in Path(directory or PROMPTS_DIR).glob("*.md"))
        raise EmmaError(f"no prompt template {name!r} in {path.parent}; available: {', '.join(valid)}")
    text = path.read_text(encoding="utf-8")
    parts = re.split(r"^## (system|user)\s*$", text, flags=re.M)
    found = {parts[i]: parts[i + 1].strip() for i in range(1, len(parts) - 1, 2)}
    if set(found) != {"system", "user"}:
        raise EmmaError(f"prompt template {path.name} needs a '## system' and a '## user' section")
    return found["system"], found["user"]


class Gateway:
    """Role-aware structured LLM calls.

    Args:
        backend: an object with ``complete(messages, model=, temperature=, max_tokens=,
            seed=, schema=) -> ChatResult`` (:class:`stace.llm.LLMClient`,
            :class:`stace.embedded.EmbeddedLLM`).
        roles: role name -> :class:`RoleSettings`.
        prices: model -> ``[input, output]`` US dollars per million tokens; a model not in
            the table costs 0 and is listed in :attr:`unpriced`.
        trace: where every call is recorded.
        cache_dir: temperature-0 replies are cached here (``None``: no cache).
        max_usd / max_tokens: the budget (``None``: unlimited).
        prompts_dir: another folder of prompt templates (domain adaptation).
        seed: sampling seed sent with every call (varied per call by a counter).
        deadline_s: the LLM time of the whole run, from now (``None``: unbounded); the
            backend's requests are cut at it (``set_deadline``) and no call starts after it.
    """

    def __init__(self, backend: Any, roles: dict[str, RoleSettings], *, prices: dict[str, Any] | None = None,
                 trace: Trace, cache_dir: Path | None = None, max_usd: float | None = None,
                 max_tokens: int | None = None, prompts_dir: Path | None = None, seed: int = 0,
                 deadline_s: float | None = None) -> None:
        self.backend = backend
        self.roles = roles
        self.prices = {k: tuple(v) for k, v in (prices or {}).items()}
        self.trace = trace
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.max_usd = max_usd
        self.max_tokens = max_tokens
        self.prompts_dir = prompts_dir
        self.seed = int(seed)
        self.usage: dict[str, RoleUsage] = {}
        self.unpriced: set[str] = set()
        self._env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False,
                                       keep_trailing_newline=False)
        self._calls = 0
        self.asked = 0  # ask() calls: one request, its retries and its repair round
        self.errors: list[str] = []  # the distinct final errors of failed calls, first ones first
        self.deadline_s = deadline_s
        self.deadline = None if deadline_s is None else time.monotonic() + float(deadline_s)
        self.deadline_passed = False
        if hasattr(backend, "set_deadline"):
            backend.set_deadline(self.deadline)

    # -- accounting ------------------------------------------------------------------------
    def spent_usd(self) -> float:
        return sum(u.cost_usd for u in self.usage.values())

    def spent_tokens(self) -> int:
        return sum(u.prompt_tokens + u.completion_tokens for u in self.usage.values())

    def _check_budget(self) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.deadline_passed = True
            raise LLMDeadline(f"the LLM time bound of {self.deadline_s:g} s (llm.deadline_s) passed")
        if self.max_usd is not None and self.spent_usd() >= self.max_usd:
            raise BudgetExhausted(f"dollar budget spent: ${self.spent_usd():.4f} of ${self.max_usd}")
        if self.max_tokens is not None and self.spent_tokens() >= self.max_tokens:
            raise BudgetExhausted(f"token budget spent: {self.spent_tokens()} of {self.max_tokens}")

    def _cost(self, model: str, result: ChatResult) -> float:
        price = self.prices.get(model)
        if price is None:
            if not getattr(self.backend, "is_local", False):
                self.unpriced.add(model)
            return 0.0
        return (result.prompt_tokens * price[0] + result.completion_tokens * price[1]) / 1e6

    def _account(self, role: str, model: str, result: ChatResult, cached: bool) -> None:
        u = self.usage.setdefault(role, RoleUsage())
        u.calls += 1
        if cached:
            u.cache_hits += 1
            return
        u.prompt_tokens += result.prompt_tokens
        u.completion_tokens += result.completion_tokens
        u.retries += result.retries
        u.cost_usd += self._cost(model, result)

    # -- calls -----------------------------------------------------------------------------
    def render(self, template: str, variables: dict[str, Any]) -> list[dict[str, str]]:
        system, user = load_template(template, self.prompts_dir)
        return [{"role": "system", "content": self._env.from_string(system).render(**variables)},
                {"role": "user", "content": self._env.from_string(user).render(**variables)}]

    def _complete(self, role: str, messages: list[dict[str, str]], schema: dict[str, Any]) -> tuple[ChatResult, bool]:
        s = self.roles[role]
        self._calls += 1
        seed = self.seed + self._calls
        key = None
        if self.cache_dir is not None and s.temperature == 0:
            key = stable_hash({"model": s.model, "messages": messages, "schema": schema,
                               "max_tokens": s.max_tokens, "backend": type(self.backend).__name__})
            path = self.cache_dir / f"{key}.json"
            if path.exists():
                data = json.loads(path.read_text())
                return ChatResult(**data), True
        self._check_budget()
        result = self.backend.complete(messages, model=s.model, temperature=s.temperature,
                                       max_tokens=s.max_tokens, seed=seed, schema=schema)
        if key is not None:
            atomic_write_text(self.cache_dir / f"{key}.json",
                              json.dumps({**dataclasses.asdict(result), "retries": 0, "errors": []}))
        return result, False

    def ask(self, role: str, template: str, variables: dict[str, Any], schema: type[T],
            check: Callable[[T], None] | None = None) -> T | None:
        """The role's validated reply, or ``None`` after a failed call or a failed repair.

        Args:
            role: the agent role (its model, temperature and length limit).
            template: the prompt template's name (``stace/prompts/<template>.md``).
            variables: the template's variables.
            schema: the pydantic model the reply must satisfy.
            check: extra validation; raises ``ValueError`` to trigger the repair round.

        Raises:
            BudgetExhausted: the budget is spent (the only error that stops a run).
        """
        messages = self.render(template, variables)
        json_schema = schema.model_json_schema()
        u = self.usage.setdefault(role, RoleUsage())
        self.asked += 1
        for attempt in (0, 1):
            try:
                result, cached = self._complete(role, messages, json_schema)
            except LLMError as exc:
                self._failed(u, "no_reply", exc, exc.label)
                self.trace.write("llm_call", role=role, model=self.roles[role].model,
                                 temperature=self.roles[role].temperature, messages=messages,
                                 error=str(exc), error_kind=exc.label, attempt=attempt)
                if getattr(exc, "kind", None) == "deadline":
                    self.deadline_passed = True
                    raise LLMDeadline(f"the LLM time bound of {self.deadline_s:g} s (llm.deadline_s) "
                                      "passed") from exc
                return None
            except BudgetExhausted:
                raise
            except EmmaError as exc:  # e.g. an embedded-model failure
                self._failed(u, "no_reply", exc, "backend")
                self.trace.write("llm_call", role=role, model=self.roles[role].model, error=str(exc),
                                 error_kind="backend")
                return None
            self._account(role, self.roles[role].model, result, cached)
            error = None
            value = None
            try:
                value = schema.model_validate(parse_json_reply(result.text))
                if check is not None:
                    check(value)
            except (LLMError, ValidationError, ValueError) as exc:
                error = str(exc)[:600]
            self.trace.write("llm_call", role=role, model=result.model,
                             temperature=self.roles[role].temperature, messages=messages,
                             response=result.text, prompt_tokens=result.prompt_tokens,
                             completion_tokens=result.completion_tokens, latency_s=result.latency_s,
                             retries=result.retries, retry_errors=result.errors, cached=cached,
                             attempt=attempt, invalid=error)
            if error is None:
                return value
            if attempt == 0:
                u.repairs += 1
                messages = messages + [
                    {"role": "assistant", "content": result.text},
                    {"role": "user", "content": (
                        f"Your reply is not valid: {error}\nReply again with only a JSON object "
                        f"that follows this JSON schema:\n{json.dumps(json_schema)}")}]
        self._failed(u, "invalid", f"{role}: invalid reply after the repair round: {error}", "invalid")
        return None

    def _failed(self, u: RoleUsage, kind: str, error: Any, label: str) -> None:
        u.failures += 1
        setattr(u, kind, getattr(u, kind) + 1)
        u.kinds[label] = u.kinds.get(label, 0) + 1
        line = " ".join(str(error).split())[:300]
        if line not in self.errors and len(self.errors) < 5:
            self.errors.append(line)

    def failure_counts(self) -> dict[str, int]:
        """``asked`` calls, of which ``failed`` (= ``no_reply`` + ``invalid``)."""
        usage = self.usage.values()
        return {"asked": self.asked, "failed": sum(u.failures for u in usage),
                "no_reply": sum(u.no_reply for u in usage), "invalid": sum(u.invalid for u in usage)}

    def failure_kinds(self) -> dict[str, int]:
        """Failed calls by kind over every role (``empty``, ``http_400``, ``timeout``, ...)."""
        out: dict[str, int] = {}
        for u in self.usage.values():
            for k, n in u.kinds.items():
                out[k] = out.get(k, 0) + n
        return dict(sorted(out.items()))

    def usage_json(self) -> dict[str, Any]:
        return {r: dataclasses.asdict(u) for r, u in sorted(self.usage.items())}


#: the failure kinds every LLM attacker reports as a metric, even at 0 (never silent)
REPORTED_KINDS = ("empty", "http_400")


def failure_metrics(gateway: Gateway, prefix: str) -> dict[str, Any]:
    """``<prefix>failed/<kind>`` per failure kind (``empty`` and ``http_400`` always), n = calls asked."""
    from emma.metrics.base import MetricValue

    kinds = gateway.failure_kinds()
    return {f"{prefix}failed/{k}": MetricValue(value=kinds.get(k, 0), n=gateway.asked)
            for k in sorted({*REPORTED_KINDS, *kinds})}


def failure_note(gateway: Gateway, name: str) -> str | None:
    """A note naming the calls that got an empty reply or an HTTP 4xx (so that a run whose
    fallbacks hid them still says so), or ``None``."""
    kinds = gateway.failure_kinds()
    parts = []
    if kinds.get("empty"):
        parts.append(f"{kinds['empty']} got an empty reply (a reasoning model may spend the token limit on "
                     "reasoning: raise attacker.max_tokens)")
    http4 = {k: n for k, n in kinds.items() if k.startswith("http_4")}
    if http4:
        parts.append(", ".join(f"{n} got HTTP {k[5:]}" for k, n in http4.items())
                     + " (the endpoint refused the request: a parameter or model the endpoint does not take)")
    if not parts:
        return None
    return f"{name}: of {gateway.asked} LLM calls, " + "; ".join(parts) + " (each in the trace's llm_call events)"


def failure_summary(gateway: Gateway, backend: Any) -> str:
    """``7 of 11 LLM calls failed (5 without a usable reply, 2 invalid after repair) at <endpoint>``
    (credentials removed), with the time bound when it passed."""
    c = gateway.failure_counts()
    where = getattr(backend, "endpoint", None) or f"the {type(backend).__name__} backend"
    text = (f"{c['failed']} of {c['asked']} LLM calls failed ({c['no_reply']} without a usable reply, "
            f"{c['invalid']} invalid after the repair round) at {strip_url_credentials(where)}")
    if gateway.deadline_passed:
        text += f"; the LLM time bound of {gateway.deadline_s:g} s (llm.deadline_s) passed"
    return text


def failure_error(name: str, gateway: Gateway, backend: Any, lost: str) -> LLMFailureError:
    """The one-line error of an attack whose LLM failures cost it its result (``lost`` says what)."""
    first = gateway.errors[0] if gateway.errors else "none recorded"
    model = getattr(backend, "model", "?")
    c = gateway.failure_counts()
    checks = []
    if c["no_reply"] or gateway.deadline_passed:
        checks.append(f"that the server is running and serves model {model!r} (llm.base_url, llm.model) "
                      "and that llm.timeout / llm.deadline_s suit it" if hasattr(backend, "endpoint")
                      else "the LLM config (llm=...)")
    if c["invalid"]:
        checks.append(f"that model {model!r} answers in the JSON the prompts ask for (a larger model may)")
    return LLMFailureError(strip_url_credentials(
        f"{name}: {failure_summary(gateway, backend)}; {lost}. First error: {first[:200].rstrip('.')}. "
        f"Check {' and '.join(checks) or 'the LLM config'}, or set attacker.tolerate_llm_failures=true "
        "to record the attack's metrics as null"))


def null_metrics(keys: Any, gateway: Gateway, backend: Any, lost: str) -> dict[str, Any]:
    """Metrics of an attack that did not get its result: each of ``keys`` with value ``None``
    and a note, for ``attacker.tolerate_llm_failures=true``."""
    from emma.metrics.base import MetricValue

    note = f"no result: {failure_summary(gateway, backend)}; {lost}"
    return {k: MetricValue(value=None, n=0, note=note) for k in keys}
