"""Reusing a STACE run: seed hypotheses (Table B5) and replays of recorded traces.

``attacker.seed_hypothesis`` takes

- free text (used as it is);
- ``card:<key>`` (or a bare PaperCard key): the card's method and limitations, as STACE's
  default seed is "derived from a PaperCard summarised from Xue et al. (2025)";
- ``trace:<path>[#<iteration>]`` (or a path to a ``trace.jsonl``, a run's ``stace/`` folder or
  the run folder): a hypothesis of a previous run — the given iteration (1-based), by default
  the first that succeeded.

``attacker.replay=<path>`` re-runs a recorded trace's hypotheses on the cell's erased model
without the LLM: each iteration's program is run again in the sandbox (code mode) or its
probe plan rendered again (plan mode), with the recorded seeds, and judged by the cell's
judge. The outcomes are those hypotheses' outcomes on this model (SIR_H, SIR_I, SER, EII as a
STACE run reports them); hypotheses, critiques, retrieved cards and novelty are the recorded
ones. This is Table B5's reuse and a cheap regression test of a new erasure method.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from emma.errors import ConfigError, UnknownChoiceError
from stace.loop import IterationRecord, Probe, ProbeSession, Renderer, STACEOutcome
from stace.sandbox import SandboxLimits, run_sandboxed
from stace.tools import ProbeTools


def trace_file(path: str | Path) -> Path:
    """The ``trace.jsonl`` of a path that names it, a run's ``stace/`` folder or the run folder.

    Raises:
        ConfigError: no trace there.
    """
    p = Path(path).expanduser()
    for cand in (p, p / "trace.jsonl", p / "stace" / "trace.jsonl"):
        if cand.is_file():
            return cand
    raise ConfigError(f"no STACE trace at {str(path)!r}: give a trace.jsonl, a run's stace/ folder or the "
                      "run folder (the cell's output directory)")


def read_trace(path: str | Path) -> tuple[dict[str, Any], list[IterationRecord], dict[str, Any] | None]:
    """(the ``start`` event, the iteration records in order, the last ``task_spec`` event)."""
    f = trace_file(path)
    events = []
    for line in f.read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:  # a line torn by a kill
            continue
    starts = [e for e in events if e.get("event") == "start"]
    records: dict[int, IterationRecord] = {}
    for e in events:
        if e.get("event") == "iteration" and "record" in e:
            rec = IterationRecord.from_json(e["record"])
            records[rec.index] = rec  # a resumed run may repeat an index: the last one counts
    specs = [e for e in events if e.get("event") == "task_spec"]
    if not starts or not records:
        raise ConfigError(f"{f} holds no STACE iterations (is it a STACE trace.jsonl?)")
    return starts[0], [records[i] for i in sorted(records)], (specs[-1] if specs else None)


def hypothesis_text(h: dict[str, Any]) -> str:
    """A recorded hypothesis as seed text: title, rationale, strategy and its example prompts."""
    prompts = "; ".join(h.get("prompts") or [])
    return (f"{h.get('title', '')}: {h.get('rationale', '')} (strategy: {h.get('strategy', 'other')}; "
            f"example prompts: {prompts})").strip()


def _split_iteration(spec: str) -> tuple[str, int | None]:
    if "#" in spec:
        path, _, it = spec.rpartition("#")
        if not it.isdigit() or int(it) < 1:
            raise ConfigError(f"attacker.seed_hypothesis={spec!r}: '#{it}' must be a 1-based iteration number")
        return path, int(it)
    return spec, None


def resolve_seed_hypothesis(value: str | None) -> tuple[str, dict[str, Any]]:
    """The seed text for ``value`` and where it came from (``{"kind": "text"|"card"|"trace", ...}``).

    Raises:
        ConfigError: an unknown card, a missing trace, an iteration that is not in the trace,
            or a trace in which no hypothesis succeeded (when no iteration is named).
    """
    text = (value or "").strip()
    if not text:
        return "", {"kind": "text"}
    from stace.library import load_cards

    is_card = text.startswith("card:")
    key = text[5:].strip() if is_card else text
    if is_card or (" " not in text and "/" not in text and not text.endswith(".jsonl")):
        cards = {c.key: c for c in load_cards()}
        if key in cards:
            c = cards[key]
            return (f"{c.title}: {c.method} Limitations: {c.limitations}", {"kind": "card", "card": key})
        if is_card:
            raise UnknownChoiceError("PaperCard", key, sorted(cards), "attacker.seed_hypothesis=card:")
        return text, {"kind": "text"}
    is_trace = text.startswith("trace:")
    spec = text[6:].strip() if is_trace else text
    path, iteration = _split_iteration(spec)
    if not is_trace and not Path(path).expanduser().exists():
        return text, {"kind": "text"}  # free text that merely contains a slash
    _, records, _ = read_trace(path)
    if iteration is not None:
        found = [r for r in records if r.index == iteration - 1]
        if not found or not found[0].hypothesis:
            raise ConfigError(f"attacker.seed_hypothesis={text!r}: the trace has no hypothesis at iteration "
                              f"{iteration}; its iterations: 1..{len(records)}")
        rec = found[0]
    else:
        ok = [r for r in records if r.success and r.hypothesis]
        if not ok:
            raise ConfigError(f"attacker.seed_hypothesis={text!r}: no hypothesis of that trace succeeded; "
                              "name one with '#<iteration>'")
        rec = ok[0]
    return hypothesis_text(rec.hypothesis or {}), {
        "kind": "trace", "trace": str(trace_file(path)), "iteration": rec.index + 1,
        "title": (rec.hypothesis or {}).get("title"), "recorded_success": rec.success}


def check_replay(path: str | Path, concept: str | None = None) -> Path:
    """The trace file of ``attacker.replay`` (checked before any model loads)."""
    f = trace_file(path)
    start, _, _ = read_trace(f)
    recorded = start.get("concept")
    if concept is not None and recorded is not None and recorded != concept:
        raise ConfigError(
            f"attacker.replay: the trace tested {recorded!r}, this cell's concept is {concept!r}; a replay "
            f"re-runs hypotheses on the same concept (to start a run on {concept!r} from one of its "
            f"hypotheses, use attacker.seed_hypothesis=trace:{f})")
    return f


def replay(path: str | Path, target: Any, concept: str, *, trace: Any, image_dir: Path | None = None,
           sandbox: SandboxLimits | None = None) -> tuple[STACEOutcome, int]:
    """Re-run every recorded iteration of the trace at ``path`` on ``target``; no LLM call.

    Returns:
        the outcome (records with this model's probes and detections) and the recorded k.
    """
    f = check_replay(path, concept)
    start, records, spec = read_trace(f)
    settings = start.get("settings", {})
    k = int(settings.get("k") or max((len(r.probes) for r in records), default=1))
    seed = int(settings.get("seed", 0))
    renderer = Renderer(target, concept, image_dir)
    # tokenizer and text-encoder queries work as recorded; attackers as tools are not re-run
    tools = ProbeTools(target, concept, "", attackers={})
    limits = sandbox or SandboxLimits(**(settings.get("sandbox") or {}))
    out: list[IterationRecord] = []
    for old in records:
        rec = IterationRecord(index=old.index, hypothesis=old.hypothesis, critiques=old.critiques,
                              queries=old.queries, cards=old.cards, mode=old.mode, code=old.code,
                              novelty=old.novelty, experience=old.experience)
        same = None
        if old.mode == "code" and old.code and old.executed:
            session = ProbeSession(concept, k, seed + 1000 * old.index, renderer.defaults(), tools)
            result = run_sandboxed(old.code, session.handle, limits)
            rec.executed = result.ok and bool(session.probes)
            rec.error = None if rec.executed else (result.error or "the program requested no images")
            rec.probes = session.probes if rec.executed else []
            rec.attempts = [{"attempt": 0, "ok": rec.executed, "error": rec.error, "replay": True,
                             "stdout": result.stdout[-2000:], "stderr": result.stderr[-2000:]}]
            same = [_key(p) for p in rec.probes] == [_key(p) for p in old.probes]
        elif old.probes:  # plan mode: the recorded instantiations
            rec.probes = [Probe(prompt=p.prompt, seed=p.seed, negative_prompt=p.negative_prompt,
                                guidance_scale=p.guidance_scale, num_inference_steps=p.num_inference_steps)
                          for p in old.probes]
            rec.executed = True
            same = True
        else:
            rec.error = f"not executed in the recorded run ({old.error or 'no probes'})"
        if rec.probes:
            renderer.render(rec.probes)
        rec.detected = sum(p.detected for p in rec.probes)
        rec.success = rec.detected > 0
        trace.write("iteration", record=dataclasses.asdict(rec), replayed_from=str(f),
                    recorded={"detected": old.detected, "success": old.success, "executed": old.executed},
                    same_probes=same)
        out.append(rec)
    spec_data = spec.get("spec") if spec else None
    evaluator = getattr(getattr(getattr(target, "judge", None), "classifier", None), "name", None) or \
        (spec.get("evaluator") if spec else "unknown")
    return STACEOutcome(task_spec=spec_data, evaluator=evaluator, records=out, report=None, stopped=None,
                        resumed_iterations=0), k


def _key(p: Probe) -> tuple:
    return (p.prompt, p.seed, p.negative_prompt, p.guidance_scale, p.num_inference_steps)
