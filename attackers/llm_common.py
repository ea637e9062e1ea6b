"""What STACE's LLM baselines share (``attacker=redteam_llm|coreference|jailfuzzer``).

The baselines of STACE's Table 2 probe the erased model one prompt at a time; they are
compared with STACE at the same image budget (100 images per concept) on the image-level
rate SIR_I. To make that comparison like for like, they run on STACE's own machinery:

- the LLM backend of ``conf/llm`` (:class:`stace.llm.LLMClient` for any OpenAI-compatible
  endpoint, :class:`stace.embedded.EmbeddedLLM` offline) behind :class:`stace.gateway.Gateway`:
  prompt templates, schema-checked replies with one repair round, retries, the
  temperature-0 cache, token and dollar accounting, the budget cap and a redacted trace;
- STACE's evaluator: probes are rendered on the erased model and judged by the cell's judge
  through :class:`stace.loop.Renderer`, exactly as STACE's hypotheses are.

A baseline spends exactly ``images`` images per concept. SIR_I's denominator is that budget
(as STACE's is N·k): images never rendered (the LLM gave nothing usable) count as not
showing the concept. Outputs are one :class:`AttackOutput` per distinct probe prompt.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from pydantic import BaseModel, Field

from emma.api.attacker import Attacker, AttackTarget
from emma.api.types import AttackOutput, PromptRequest, Sample
from emma.config import to_python
from emma.errors import ConfigError
from emma.metrics.base import MetricValue
from stace import metrics as M
from stace.gateway import (
    BudgetExhausted,
    Gateway,
    Redactor,
    RoleSettings,
    Trace,
    build_backend,
    check_budget,
    check_tolerate,
    failure_error,
    failure_metrics,
    failure_note,
    failure_summary,
    null_metrics,
    pop_deadline,
    time_bound_line,
)
from stace.llm import positive
from stace.loop import Probe, Renderer

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
PromptText = Field(min_length=1, max_length=200)


class PromptList(BaseModel):
    """Prompts written by an LLM baseline (each rendered on the erased model)."""

    prompts: list[str] = Field(min_length=1, max_length=20)


def clean_prompts(prompts: Sequence[str], limit: int = 300) -> list[str]:
    """Stripped, non-empty, de-duplicated (case-insensitive) prompts, in order."""
    seen: set[str] = set()
    out = []
    for p in prompts:
        p = " ".join(str(p).split())[:limit]
        if p and p.lower() not in seen:
            seen.add(p.lower())
            out.append(p)
    return out


@dataclasses.dataclass
class Session:
    """One concept's run of a baseline: the LLM door, the evaluator and the image budget.

    Attributes:
        concept: the erased concept.
        seed_prompts: the cell's EA prompts of the concept (a fuzzer's initial pool).
        budget: images to spend.
        probes: every rendered probe so far, in order (``probe.seed`` is unique).
    """

    gateway: Gateway
    renderer: Renderer
    concept: str
    seed_prompts: list[str]
    budget: int
    seed: int
    trace: Trace
    probes: list[Probe] = dataclasses.field(default_factory=list)
    groups: list[tuple[str, list[int]]] = dataclasses.field(default_factory=list)
    stopped: str | None = None  # why no more LLM calls are made (the LLM budget is spent)

    @property
    def left(self) -> int:
        return self.budget - len(self.probes)

    def render(self, prompts: Sequence[str], label: str = "") -> list[Probe]:
        """Render one image per prompt (fresh seeds), at most the images left; returns the
        judged probes (``detected``, ``score`` = the judge's probability of the concept)."""
        prompts = list(prompts)[: self.left]
        if not prompts:
            return []
        start = len(self.probes)
        new = [Probe(prompt=p, seed=self.seed + start + j) for j, p in enumerate(prompts)]
        self.renderer.render(new)
        self.probes += new
        for j, p in enumerate(new):
            idx = start + j
            for prompt, members in self.groups:
                if prompt == p.prompt:
                    members.append(idx)
                    break
            else:
                self.groups.append((p.prompt, [idx]))
        self.trace.write("probes", label=label, probes=[dataclasses.asdict(p) for p in new])
        return new


class LLMBaselineAttacker(Attacker):
    """Base class of the LLM baselines: subclasses implement :meth:`run` for one concept.

    Args:
        llm: the ``conf/llm`` config (backend, default model, key variable, ...).
        images: the image budget per concept (Table 2: 100).
        seed: first image seed (image j of a concept is drawn with ``seed + j``) and LLM seed.
        model: the LLM model (``None``: the LLM config's model).
        temperature: sampling temperature of the baseline's LLM calls.
        max_tokens: completion limit (``None``: the LLM config's).
        prices: model -> ``[input, output]`` USD per million tokens.
        budget: ``{max_usd, max_tokens}`` of LLM spending; once spent, no more LLM calls.
        prompts_dir: another folder of prompt templates (``None``: ``attackers/prompts``).
        tolerate_llm_failures: when LLM failures cost the attack its result, record ``sir_i``
            and ``asr`` as null (with the failure counts and a note) instead of ending the
            cell with an error; either way the cell is not stored as finished.
    """

    role: str = "baseline"
    # its probes are judged as it goes (their images are the result: sir_i over the budget), and
    # JailFuzzer steers its mutations by their scores
    uses_judge = True
    probing = True

    def __init__(self, llm: Mapping[str, Any], images: int = 100, seed: int = 0, model: str | None = None,
                 temperature: float = 0.7, max_tokens: int | None = None,
                 prices: Mapping[str, Sequence[float]] | None = None, budget: Mapping[str, Any] | None = None,
                 prompts_dir: str | None = None, tolerate_llm_failures: bool = False) -> None:
        if int(images) < 1:
            raise ConfigError(f"attacker.images={images}: the image budget per concept must be >= 1")
        self.images = int(images)
        self.seed = int(seed)
        llm_cfg = dict(to_python(llm) or {})
        self.deadline_s = pop_deadline(llm_cfg)
        self.tolerate_llm_failures = check_tolerate(tolerate_llm_failures)
        self.llm_budget = check_budget(to_python(budget))
        if max_tokens is not None:
            max_tokens = positive(max_tokens, "attacker.max_tokens", integer=True)
        self.backend = build_backend(llm_cfg)
        self.backend.check_available()  # a missing key or model fails here, before any model loads
        self.settings = RoleSettings(model=model or self.backend.model, temperature=float(temperature),
                                     max_tokens=int(max_tokens or self.backend.max_tokens or 1024))
        self.prices = {m: list(v) for m, v in dict(to_python(prices) or {}).items()}
        self.prompts_dir = Path(prompts_dir) if prompts_dir else PROMPTS_DIR
        self.output_dir: Path | None = None
        self.cache_dir: Path | None = None
        self.cell_info: dict[str, Any] = {}
        self._metrics: dict[str, MetricValue] = {}
        self._notes: list[str] = []
        self._complete = True

    # -- what subclasses write -------------------------------------------------------------
    def run(self, session: Session) -> None:
        """Spend ``session.budget`` images on ``session.concept`` through ``session.render``."""
        raise NotImplementedError

    def settings_json(self) -> dict[str, Any]:
        """The subclass's own settings (recorded in results and in the attack cache key)."""
        return {}

    # -- the Attacker role -----------------------------------------------------------------
    def bind_cell(self, output_dir: str | Path, cache_dir: str | Path, info: Mapping[str, Any]) -> None:
        """Where the cell writes the trace and caches LLM replies; what the prompts may say."""
        self.output_dir, self.cache_dir, self.cell_info = Path(output_dir), Path(cache_dir), dict(info)

    def budget(self) -> dict[str, int]:
        return {"queries": self.images}

    def config(self) -> dict[str, Any]:
        return {**super().config(), "images": self.images, "seed": self.seed,
                "backend": self.backend.config(), "role": dataclasses.asdict(self.settings),
                "llm_budget": self.llm_budget, **self.settings_json()}

    def attack(self, target: AttackTarget, requests: Sequence[PromptRequest]) -> list[AttackOutput]:
        out = (self.output_dir or Path(tempfile.mkdtemp(prefix=f"{self.name}-"))) / self.name
        cache = self.cache_dir or out / "cache"
        redact = Redactor([getattr(self.backend, "api_key_env", None)], [getattr(self.backend, "base_url", None)])
        trace = Trace(out / "trace.jsonl", redact)
        print(time_bound_line(self.backend, self.deadline_s), flush=True)
        gateway = Gateway(self.backend, {self.role: self.settings}, prices=self.prices, trace=trace,
                          cache_dir=cache / "stace" / "llm", max_usd=self.llm_budget.get("max_usd"),
                          max_tokens=self.llm_budget.get("max_tokens"), prompts_dir=self.prompts_dir,
                          seed=self.seed, deadline_s=self.deadline_s)
        concepts = list(dict.fromkeys(r.concept for r in requests))
        trace.write("start", attacker=self.name, concepts=concepts, config=self.config())
        outputs: list[AttackOutput] = []
        outcomes: list[bool] = []  # one per image of the budget, rendered or not
        clusters: list[str] = []  # the images of one prompt are correlated: one cluster a prompt
        unrendered = 0
        self._notes = []
        self._complete = True
        for concept in concepts:
            session = Session(gateway, Renderer(target, concept, image_dir=None), concept,
                              seed_prompts=[r.prompt for r in requests if r.concept == concept],
                              budget=self.images, seed=self.seed, trace=trace)
            self.run(session)
            unrendered += session.left
            if session.left > 0:
                self._notes.append(f"{self.name}: {session.left} of {self.images} images for {concept!r} were "
                                   "never rendered (the LLM gave no usable prompt); they count as not "
                                   "showing the concept in sir_i")
            for i, (_prompt, members) in enumerate(session.groups):
                outcomes += [session.probes[j].detected for j in members]
                clusters += [f"{concept}/{i}"] * len(members)
            outcomes += [False] * session.left  # never rendered: not showing the concept
            clusters += [f"{concept}/unrendered"] * session.left
            outputs += self._outputs(session)
        n_images = self.images * len(concepts)
        usage = gateway.usage_json()
        cost = gateway.spent_usd()
        tokens = gateway.spent_tokens()
        calls = sum(u["calls"] for u in usage.values())
        rate = M.image_rate(outcomes, clusters, seed=self.seed)
        m: dict[str, MetricValue] = {
            "sir_i": rate,
            "llm/cost_usd": MetricValue(value=cost, n=calls),
            "llm/tokens": MetricValue(value=tokens, n=calls),
            "llm/calls": MetricValue(value=calls, n=len(concepts)),
            "llm/cost_per_image_usd": MetricValue(value=cost / n_images, n=n_images),
        }
        for what in ("retries", "repairs", "failures", "cache_hits", "no_reply", "invalid"):
            m[f"llm/{what}"] = MetricValue(value=sum(u[what] for u in usage.values()), n=calls)
        m.update(failure_metrics(gateway, "llm/"))
        failed = gateway.failure_counts()["failed"]
        if gateway.deadline_passed or (unrendered and failed):
            what = f"{unrendered} of {n_images} images were never rendered"
            trace.write("failed", reason=failure_summary(gateway, self.backend), lost=what)
            self._complete = False
            if not self.tolerate_llm_failures:
                raise failure_error(self.name, gateway, self.backend, what)
            m.update(null_metrics(["sir_i", "asr"], gateway, self.backend, what))
            self._notes = [f"{self.name} has no result: {failure_summary(gateway, self.backend)}; {what}. "
                           "sir_i and asr are null (attacker.tolerate_llm_failures=true) and the cell is "
                           "not stored as a finished result"]
        self._metrics = m
        note = failure_note(gateway, self.name)
        if note:
            self._notes.append(note)
        if gateway.unpriced:
            self._notes.append(f"{self.name}: no price for {sorted(gateway.unpriced)}; their cost counts as 0")
        trace.write("finished", metrics={k: dataclasses.asdict(v) for k, v in m.items()}, usage=usage)
        return outputs

    def _outputs(self, session: Session) -> list[AttackOutput]:
        outs = []
        for i, (prompt, members) in enumerate(session.groups):
            probes = [session.probes[j] for j in members]
            req = PromptRequest(prompt=prompt, concept=session.concept, group="attack", kind=f"{self.name}/{i + 1}",
                                seed=probes[0].seed, n_images=len(probes))
            samples = [Sample(prompt=p.prompt, seed=p.seed, concept=session.concept, group="attack",
                              kind=req.kind, image_hash=p.image_hash or "", detected=p.detected, score=p.score)
                       for p in probes]
            outs.append(AttackOutput(request=req, adversarial_prompt=prompt, samples=samples,
                                     success=any(p.detected for p in probes), queries=len(probes)))
        return outs

    def extra_metrics(self) -> dict[str, MetricValue]:
        """``sir_i`` (detected images / the image budget; 95% Wilson when every prompt has one
        image, else a cluster bootstrap over prompts, whose images are correlated) and the
        LLM's cost."""
        return dict(self._metrics)

    def notes(self) -> list[str]:
        return list(self._notes)

    def complete(self) -> bool:
        """False after an attack whose LLM failures cost it its result (metrics null)."""
        return self._complete

    # -- helpers for subclasses ------------------------------------------------------------
    def ask_prompts(self, session: Session, template: str, variables: dict[str, Any],
                    schema: type[BaseModel] = PromptList, field: str = "prompts") -> list[str]:
        """The prompts of one schema-checked LLM reply (``[]`` after a failed call)."""
        if session.stopped:
            return []
        try:
            reply = session.gateway.ask(self.role, template, {"concept": session.concept, **self.cell_info,
                                                              **variables}, schema)
        except BudgetExhausted as exc:
            session.stopped = str(exc)
            session.trace.write("stopped", reason=session.stopped, images_rendered=len(session.probes))
            if session.gateway.deadline_passed:
                return []
            self._notes.append(f"{self.name}: LLM budget spent ({exc}) after {len(session.probes)} images "
                               f"of {session.concept!r}")
            return []
        return clean_prompts(getattr(reply, field)) if reply is not None else []


def fill_round_robin(items: Sequence[str], n: int) -> list[str]:
    """``n`` prompts cycling through ``items`` (a short list is reused with fresh seeds)."""
    return [items[j % len(items)] for j in range(n)] if items else []
