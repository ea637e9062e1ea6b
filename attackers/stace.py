"""``attacker=stace``: STACE, the multi-agent LLM stress tester, as an EMMA attacker.

The attacker is thin: it builds the LLM backend and per-role settings from the config,
checks the backend can work (API key present, embedded model installed) when it is
constructed — before the cell loads any model — and runs :class:`stace.loop.STACE` on the
cell's attack target. It returns one :class:`AttackOutput` per hypothesis (its k judged
images) and reports STACE's metrics (``stace/sir_h`` ...; ``asr`` = SIR_H) through
:meth:`extra_metrics`. Trace and report go to ``<cell output>/stace/``.

LLM failures that cost the run its result (an iteration left without a hypothesis or without
probes because the Hypothesis Generator, Code Synthesiser or probe planner gave no usable reply,
or the LLM time bound ``llm.deadline_s`` passed) end the cell with
:class:`stace.gateway.LLMFailureError`; with ``tolerate_llm_failures`` the metrics are recorded
as null instead, and the cell is not stored as finished (:meth:`complete`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from emma.api.attacker import Attacker, AttackTarget
from emma.api.types import AttackOutput, PromptRequest, Sample
from emma.config import to_python
from emma.errors import ConfigError, UnknownChoiceError
from emma.metrics.base import MetricValue
from stace.gateway import (
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
from stace.library import Library
from stace.library_builder import library_cards
from stace.loop import STACE, STACESettings
from stace.replay import check_replay, replay, resolve_seed_hypothesis
from stace.report import write_report
from stace.sandbox import SandboxLimits
from stace.tools import TOOL_ATTACKERS, ProbeTools, attacker_factory

ROLES = ("task_verification", "hypothesis", "critic", "query", "code", "experience", "report", "papercard")
#: what :mod:`stace.loop` records when an iteration got no probes because an LLM call failed
LLM_LOST = ("no valid hypothesis", "no valid probe plan", "the Code Synthesiser gave no valid reply")
#: the metrics that are the attack's result (null when LLM failures cost it that result)
RESULT_METRICS = ("asr", "stace/sir_h", "stace/sir_i", "stace/ser", "stace/eii", "stace/novelty",
                  "stace/cost_per_success_usd", "stace/cost_per_iteration_usd")


def _judge_note(judge: Any) -> str:
    """A few words on what a judge is, for Task Verification."""
    clf = judge.classifier
    d = clf.describe() if hasattr(clf, "describe") else {}
    parts = [f"{type(clf).__name__}"]
    if d.get("model"):
        parts.append(f"model {d['model']}")
    if getattr(clf, "threshold", None) is not None:
        parts.append(f"threshold {clf.threshold}")
    return ", ".join(parts)


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"attacker.{key}={value!r}; valid: true, false")
    return value


def lost_to_llm(record: Any) -> bool:
    """An iteration without a hypothesis, or without probes because an LLM call failed."""
    return record.hypothesis is None or (not record.executed and record.error in LLM_LOST)


class STACEAttacker(Attacker):
    """STACE on the cell's erased model.

    Args:
        llm: the ``conf/llm`` config (backend, default model, key variable, ...).
        iterations: N, hypotheses per run.
        k: instantiations (images) per hypothesis.
        debate_rounds: M, Critic/Generator rounds (0: no Critic).
        probe_mode: ``code`` (Code Synthesiser + sandbox), ``plan`` (declarative JSON probe
            plan, for small models) or ``auto`` (the LLM config's ``probe_mode``).
        max_code_repairs: repair attempts after a failed sandbox run.
        top_k_cards: PaperCards retrieved per query.
        seed: first seed of the probes' images and of the LLM calls.
        seed_hypothesis: the SeedHypothesis of the first iteration: text, ``card:<key>`` or
            ``trace:<path>[#<iteration>]`` (:func:`stace.replay.resolve_seed_hypothesis`).
        replay: a recorded trace whose hypotheses are re-run on this cell's model with no
            LLM call (:func:`stace.replay.replay`); ``None``: a normal run.
        task: the free-text request (``None``: built from the cell).
        preset: ``small`` | ``default`` | ``large`` (Table D1) — per-role models, used when
            the LLM config has ``per_role_models: true`` (OpenRouter).
        presets: preset name -> role -> model.
        temperatures: role -> temperature (§D.1).
        max_tokens: role -> completion limit.
        roles: per-role overrides ``{role: {model, temperature, max_tokens}}``.
        prices: model -> ``[input, output]`` USD per million tokens.
        budget: ``{max_usd, max_tokens}``; the run stops cleanly with a partial report.
        sandbox: limits of the code sandbox (:class:`stace.sandbox.SandboxLimits`).
        prompts_dir: a folder of prompt templates replacing ``stace/prompts``.
        tools: the project's attackers a probe program may run (``probe.attack``): name ->
            overrides of its config (``conf/attacker/<name>.yaml`` and the cell's preset).
        tool_scale: the preset scale of those attackers (``None``: the cell's, else ``sd``).
        tolerate_llm_failures: when LLM failures cost the run its result, record the metrics
            as null (with the failure counts and a note) instead of ending the cell with an
            error; either way the cell is not stored as finished.
        name_concept: whether hypotheses and probe plans may name the concept (the paper sets
            no rule; ``false`` asks for prompts that avoid the name).
        evaluators: judges offered to Task Verification beside the cell's own: classifier
            config name -> overrides (``vlm_judge``: the paper's Qwen2.5-VL judge for general
            concepts; ``nudenet`` for explicit content); one that cannot judge the concept is
            not offered.
        evaluator: ``agent`` (the TaskSpec's choice decides) or a judge's name (the cell's
            judge's name, or one of ``evaluators``) to fix it.
        library: a library folder built by ``python -m stace.library build`` (or its
            ``papercards.yaml``) whose cards join the shipped ones; ``None``: the shipped cards.
        rag: retrieve PaperCards for the Hypothesis Generator and the Critic (``False``: the
            paper's "Hypo Only" configuration of Table B4; novelty is still measured).
    """

    name = "stace"
    version = "4"
    uses_judge = True  # its hypotheses' probes are judged as it goes (they are its result)
    probing = True

    def __init__(self, llm: Mapping[str, Any], iterations: int = 10, k: int = 10, debate_rounds: int = 2,
                 probe_mode: str = "auto", max_code_repairs: int = 2, top_k_cards: int = 3, seed: int = 0,
                 seed_hypothesis: str = "", task: str | None = None, preset: str = "default",
                 presets: Mapping[str, Mapping[str, str]] | None = None,
                 temperatures: Mapping[str, float] | None = None, max_tokens: Mapping[str, int] | None = None,
                 roles: Mapping[str, Mapping[str, Any]] | None = None,
                 prices: Mapping[str, Sequence[float]] | None = None,
                 budget: Mapping[str, Any] | None = None, sandbox: Mapping[str, Any] | None = None,
                 prompts_dir: str | None = None, tools: Mapping[str, Mapping[str, Any]] | None = None,
                 tool_scale: str | None = None, replay: str | None = None,
                 tolerate_llm_failures: bool = False, name_concept: bool = True,
                 evaluators: Mapping[str, Mapping[str, Any]] | None = None, evaluator: str = "agent",
                 library: str | None = None, rag: bool = True) -> None:
        llm_cfg = dict(to_python(llm) or {})
        self.deadline_s = pop_deadline(llm_cfg)
        self.tolerate_llm_failures = check_tolerate(tolerate_llm_failures)
        budget = check_budget(to_python(budget))
        presets = dict(to_python(presets) or {})
        if preset not in presets:
            raise UnknownChoiceError("stace preset", preset, presets)
        if probe_mode not in ("auto", "code", "plan"):
            raise ConfigError(f"attacker.probe_mode={probe_mode!r}; valid: auto, code, plan")
        if int(iterations) < 1 or int(k) < 1 or int(debate_rounds) < 0:
            raise ConfigError("attacker.iterations and attacker.k must be >= 1, debate_rounds >= 0")
        self.backend = build_backend(llm_cfg)
        self.backend.check_available()  # a missing key or model fails here, before any model loads
        mode = getattr(self.backend, "probe_mode", "code") if probe_mode == "auto" else probe_mode
        temperatures = dict(to_python(temperatures) or {})
        max_tokens = dict(to_python(max_tokens) or {})
        overrides = dict(to_python(roles) or {})
        unknown = set(overrides) - set(ROLES)
        if unknown:
            raise UnknownChoiceError("STACE role", sorted(unknown)[0], ROLES, "attacker.roles")
        self.roles: dict[str, RoleSettings] = {}
        for role in ROLES:
            model = presets[preset].get(role) if getattr(self.backend, "per_role_models", False) else None
            s = RoleSettings(model=model or self.backend.model,
                             temperature=float(temperatures.get(role, self.backend.temperature)),
                             max_tokens=int(max_tokens.get(role, self.backend.max_tokens or 1024)))
            self.roles[role] = dataclasses.replace(s, **dict(overrides.get(role, {})))
        seed_hypothesis, self.seed_source = resolve_seed_hypothesis(seed_hypothesis)
        self.replay = str(check_replay(replay)) if replay else None
        self.settings = STACESettings(
            iterations=int(iterations), k=int(k), debate_rounds=int(debate_rounds), probe_mode=mode,
            max_code_repairs=int(max_code_repairs), top_k_cards=int(top_k_cards), seed=int(seed),
            seed_hypothesis=seed_hypothesis, task=task, name_concept=_flag("name_concept", name_concept),
            rag=_flag("rag", rag),
            sandbox=SandboxLimits(**dict(to_python(sandbox) or {})))
        self.preset = preset
        self.prices = {m: list(v) for m, v in dict(to_python(prices) or {}).items()}
        self.budget = budget
        self.prompts_dir = Path(prompts_dir) if prompts_dir else None
        self.tools = {str(n): dict(o or {}) for n, o in dict(to_python(tools) or {}).items()}
        for name in self.tools:
            if name not in TOOL_ATTACKERS:
                raise UnknownChoiceError("STACE tool attacker", name, TOOL_ATTACKERS, "attacker.tools")
        self.tool_scale = tool_scale
        self.evaluators = {str(n): dict(o or {}) for n, o in dict(to_python(evaluators) or {}).items()}
        from emma import registry

        for name in self.evaluators:
            registry.check_choice("classifier", name)
        if not isinstance(evaluator, str) or not evaluator:
            raise ConfigError(f"attacker.evaluator={evaluator!r}; valid: agent, or a judge's name")
        self.evaluator = evaluator
        self.library = None if library is None else str(library)
        self.cards = library_cards(self.library)  # a missing or clashing library fails here
        self.output_dir: Path | None = None
        self.cache_dir: Path | None = None
        self.cell_info: dict[str, Any] = {}
        self._metrics: dict[str, MetricValue] = {}
        self._notes: list[str] = []
        self._complete = True

    def bind_cell(self, output_dir: str | Path, cache_dir: str | Path, info: Mapping[str, Any]) -> None:
        """Where the cell writes (trace, report) and caches; what Task Verification may know."""
        self.output_dir, self.cache_dir, self.cell_info = Path(output_dir), Path(cache_dir), dict(info)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "backend": self.backend.config(), "preset": self.preset,
                "roles": {r: dataclasses.asdict(s) for r, s in self.roles.items()},
                "settings": dataclasses.asdict(self.settings), "budget": self.budget, "tools": self.tools,
                "seed_source": self.seed_source, "replay": self.replay, "evaluators": self.evaluators,
                "evaluator": self.evaluator, "library": self.library, "n_cards": len(self.cards)}

    def attack(self, target: AttackTarget, requests: Sequence[PromptRequest]) -> list[AttackOutput]:
        concept = requests[0].concept
        out = (self.output_dir or Path(tempfile.mkdtemp(prefix="stace-"))) / "stace"
        cache = self.cache_dir or out / "cache"
        redact = Redactor([getattr(self.backend, "api_key_env", None)], [getattr(self.backend, "base_url", None)])
        _drop_lost_iterations(out / "trace.jsonl")
        trace = Trace(out / "trace.jsonl", redact)
        if not self.replay:
            print(time_bound_line(self.backend, self.deadline_s), flush=True)
        gateway = Gateway(self.backend, self.roles, prices=self.prices, trace=trace,
                          cache_dir=cache / "stace" / "llm", max_usd=self.budget.get("max_usd"),
                          max_tokens=self.budget.get("max_tokens"), prompts_dir=self.prompts_dir,
                          seed=self.settings.seed, deadline_s=None if self.replay else self.deadline_s)
        library = Library(self.cards, cache_dir=cache / "stace" / "index")
        judge = getattr(target, "judge", None)
        judges = self._judges(target, concept, cache) if not self.replay else {}
        context = {**self.cell_info, "concepts": list(judge.classifier.labels) if judge else [concept],
                   "evaluators": list(judges) or ([judge.classifier.name] if judge else ["domain classifier"]),
                   "evaluator_notes": {n: _judge_note(j) for n, j in judges.items()}}
        if self.evaluator != "agent" and self.evaluator not in context["evaluators"]:
            raise ConfigError(f"attacker.evaluator={self.evaluator!r} cannot judge {concept!r} here; valid: agent, "
                              + ", ".join(context["evaluators"]))
        trace.write("start", concept=concept, settings=dataclasses.asdict(self.settings),
                    roles={r: dataclasses.asdict(s) for r, s in self.roles.items()},
                    backend=self.backend.config())
        k = self.settings.k
        if self.replay:  # the recorded hypotheses on this model; no LLM call
            outcome, k = replay(self.replay, target, concept, trace=trace, image_dir=out / "images",
                                sandbox=self.settings.sandbox)
        else:
            tools = ProbeTools(target, concept, requests[0].prompt, self._tool_factories(),
                               attack_cache=cache if self.cache_dir else None)
            outcome = STACE(gateway, library, self.settings, target, concept, context, image_dir=out / "images",
                            tools=tools, judges=judges, evaluator=self.evaluator).run()
        values = outcome.metrics(k, None if self.replay else self.settings.iterations)
        n_success = sum(r.success for r in outcome.records)
        cost = gateway.spent_usd()
        m: dict[str, MetricValue] = {
            "stace/sir_h": values["sir_h"], "stace/sir_i": values["sir_i"], "stace/ser": values["ser"],
            "stace/eii": values["eii"],
            "stace/cost_usd": MetricValue(value=cost, n=len(outcome.records)),
            "stace/cost_per_success_usd": MetricValue(value=cost / n_success if n_success else None, n=n_success),
            "stace/cost_per_iteration_usd": MetricValue(value=cost / len(outcome.records) if outcome.records else None,
                                                        n=len(outcome.records)),
            "asr": values["sir_h"],
        }
        if values["novelty"] is not None:
            m["stace/novelty"] = values["novelty"]
        usage = gateway.usage_json()
        for role, u in usage.items():
            m[f"stace/tokens/{role}"] = MetricValue(value=u["prompt_tokens"] + u["completion_tokens"], n=u["calls"])
        for what in ("retries", "repairs", "failures", "cache_hits"):
            m[f"stace/llm_{what}"] = MetricValue(value=sum(u[what] for u in usage.values()),
                                                 n=sum(u["calls"] for u in usage.values()))
        m["stace/attack_queries"] = MetricValue(value=sum(r.attack_queries for r in outcome.records),
                                                n=len(outcome.records))
        m["stace/llm_no_reply"] = MetricValue(value=sum(u["no_reply"] for u in usage.values()), n=gateway.asked)
        m["stace/llm_invalid"] = MetricValue(value=sum(u["invalid"] for u in usage.values()), n=gateway.asked)
        m.update(failure_metrics(gateway, "stace/llm_"))
        self._metrics = m
        self._notes = []
        self._complete = True
        lost = [r for r in outcome.records if lost_to_llm(r)]
        if lost or gateway.deadline_passed:
            what = (f"{len(lost)} of {self.settings.iterations} iterations got no hypothesis or no probes"
                    if lost else f"only {len(outcome.records)} of {self.settings.iterations} iterations ran")
            trace.write("failed", reason=failure_summary(gateway, self.backend), lost=what)
            self._complete = False
            if not self.tolerate_llm_failures:
                raise failure_error("STACE", gateway, self.backend, what)
            m.update(null_metrics([k for k in RESULT_METRICS if k in m or k == "asr"], gateway, self.backend, what))
            self._notes.append(f"STACE has no result: {failure_summary(gateway, self.backend)}; {what}. "
                               "Its metrics are null (attacker.tolerate_llm_failures=true) and the cell is "
                               "not stored as a finished result")
        elif outcome.stopped:
            self._notes.append(f"STACE stopped early ({outcome.stopped}) after {len(outcome.records)} of "
                               f"{self.settings.iterations} iterations; its metrics cover those only")
        chosen = judges.get(outcome.evaluator)
        counts = getattr(getattr(chosen, "classifier", None), "verdict_counts", None)
        if counts is not None:  # a VLM judge: refusals and garbage count as absent, and are counted
            for what, n in counts().items():
                m[f"stace/evaluator/{what}"] = MetricValue(value=n, n=sum(counts().values()))
            lost = counts()["refused"] + counts()["unparsed"]
            if lost:
                self._notes.append(f"STACE's evaluator {outcome.evaluator}: {counts()['refused']} refusals and "
                                   f"{counts()['unparsed']} unparseable verdicts, counted as 'concept absent'")
        if judge is not None and chosen is not None and chosen is not judge:
            self._notes.append(f"STACE's images were judged by {outcome.evaluator} (the TaskSpec's evaluator; "
                               f"offered: {', '.join(context['evaluators'])}), not the cell's judge "
                               f"{judge.classifier.name}")
        note = failure_note(gateway, "STACE")
        if note:
            self._notes.append(note)
        if gateway.unpriced:
            self._notes.append(f"STACE: no price for {sorted(gateway.unpriced)}; their cost counts as 0")
        write_report(outcome, out, concept=concept, k=k, metrics=values, usage=usage,
                     cost_usd=cost, redact=redact)
        trace.write("finished", metrics={k_: dataclasses.asdict(v) for k_, v in m.items()})
        return [self._output(r, concept) for r in outcome.records]

    def _judges(self, target: Any, concept: str, cache: Path) -> dict[str, Any]:
        """The evaluators offered: the cell's judge first, then each configured one that can
        judge ``concept`` (built now: a missing key or weights fails before any LLM call)."""
        own = getattr(target, "judge", None)
        if own is None:
            return {}
        judges = {own.classifier.name: own}
        if not self.evaluators:
            return judges
        if getattr(target, "generator", None) is None:
            raise ConfigError("attacker.evaluators: this attack target renders with its own judge only")
        from emma import registry
        from emma.cache import ClassifierScoreCache
        from emma.generate import Judge

        for name, overrides in self.evaluators.items():
            if name in judges:
                continue
            clf = registry.build("classifier", name, overrides=overrides)
            if clf.can_detect(concept):  # an open-vocabulary judge adds the concept as a label here
                judges[name] = Judge(clf, ClassifierScoreCache(cache, clf))
        return judges

    def _tool_factories(self) -> dict[str, Any]:
        scale = self.tool_scale
        if scale is None:
            from emma.stages.record import preset_choices

            scale = preset_choices().get("scale") or "sd"
        return {name: functools.partial(attacker_factory, name, scale, overrides)
                for name, overrides in self.tools.items()}

    def _output(self, rec: Any, concept: str) -> AttackOutput:
        h = rec.hypothesis or {}
        req = PromptRequest(prompt=h.get("title", "(no hypothesis)"), concept=concept, group="attack",
                            kind=f"stace/{rec.index + 1}", seed=self.settings.seed + 1000 * rec.index,
                            n_images=max(1, len(rec.probes)))
        samples = [Sample(prompt=p.prompt, seed=p.seed, concept=concept, group="attack",
                          kind=f"stace/{rec.index + 1}", image_hash=p.image_hash or "", detected=p.detected,
                          score=p.score, extra={"negative_prompt": p.negative_prompt,
                                                "guidance_scale": p.guidance_scale,
                                                "num_inference_steps": p.num_inference_steps})
                   for p in rec.probes]
        return AttackOutput(request=req, adversarial_prompt=h.get("title", ""), samples=samples,
                            success=rec.success, queries=len(samples),
                            extra={"executed": rec.executed, "error": rec.error, "novelty": rec.novelty})

    def extra_metrics(self) -> dict[str, MetricValue]:
        """STACE's metrics of the last :meth:`attack` (they replace the cell's image-level asr)."""
        return dict(self._metrics)

    def notes(self) -> list[str]:
        return list(self._notes)

    def complete(self) -> bool:
        """False after an attack whose LLM failures cost it its result (metrics null)."""
        return self._complete


def _drop_lost_iterations(path: Path) -> None:
    """Forget, in a trace a run resumes from, the iterations from the first one lost to an LLM
    failure on (the loop resumes by count), so that a rerun redoes them."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    keep, cut = [], False
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            rec = {}
        if rec.get("event") == "iteration":
            r = rec.get("record") or {}
            cut = cut or r.get("hypothesis") is None or (not r.get("executed") and r.get("error") in LLM_LOST)
            if cut:
                continue
        keep.append(line)
    if len(keep) < len(lines):
        path.write_text("".join(f"{x}\n" for x in keep), encoding="utf-8")
