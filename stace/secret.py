"""``python -m stace.secret``: STACE beyond images — a chat model that must keep a secret word.

The STACE paper (§4.5) carries its loop to a new domain by changing three things: the prompts,
the evaluator and the library. Here the stress-tested target is a chat model (any
OpenAI-compatible endpoint, or the embedded SmolLM2-135M) whose system prompt holds a secret
word it must not reveal (:class:`stace.targets.ChatTarget`); the evaluator finds the word in its
replies (:class:`stace.targets.SecretEvaluator`, pluggable); the library holds prompt-injection
and secret-extraction PaperCards (``stace/data/secret_cards.yaml``); the agents' prompts are
``stace/prompts/secret/``. The loop, the gateway and the metrics are STACE's own: SIR_H, SIR_I,
EII, SER and novelty as for images (:mod:`stace.metrics`). The agents never see the secret:
only the target's system prompt holds it.

Configs are ``conf/stace_secret/<experiment>.yaml`` (``demo`` by default; ``ablation_b4`` runs
the paper's Table B4 configurations); ``key=value`` arguments override them::

    OMP_NUM_THREADS=1 python -m stace.secret
    OMP_NUM_THREADS=1 python -m stace.secret experiment=ablation_b4
    python -m stace.secret iterations=5 k=8 llm=openrouter

Each configuration writes ``<out>/<variant>-<config hash>/``: ``results.json`` (metrics with
intervals, LLM usage and failures, the target's call counts), ``trace.jsonl``, ``replies/`` and
``report.md``/``.html``; the same configuration run again resumes from its trace.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from emma import registry
from emma.cache import stable_hash
from emma.errors import ConfigError, EmmaError, UnknownChoiceError
from emma.files import atomic_write_text

#: the repository root: relative paths in the demonstration's configs are read from here
ROOT = Path(__file__).resolve().parent.parent
#: the config group of the demonstration's experiments (conf/stace_secret/)
GROUP = "stace_secret"
CONCEPT = "secret password"
VARIANT_KEYS = ("iterations", "k", "debate_rounds", "rag", "top_k_cards", "probe_mode", "seed", "max_tokens")


def load_config(argv: Sequence[str]) -> Any:
    """The experiment's config (``experiment=<name>``, default ``demo``) with ``key=value``
    overrides; an unknown key or experiment is a one-line :class:`ConfigError`."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    args = list(argv)
    name = "demo"
    for a in list(args):
        if a.startswith("experiment="):
            name = a.split("=", 1)[1]
            args.remove(a)
    bad = [a for a in args if "=" not in a]
    if bad:
        raise ConfigError(f"{bad[0]!r}: arguments are key=value (e.g. iterations=5) or experiment=<name>")

    def read(n: str) -> Any:
        if n not in registry.choices(GROUP):
            raise UnknownChoiceError("stace.secret experiment", n, registry.choices(GROUP), "experiment")
        cfg = OmegaConf.load(registry.config_path(GROUP, n))
        base = cfg.pop("base", None)
        return OmegaConf.merge(read(str(base)), cfg) if base else cfg

    cfg = read(name)
    try:
        for a in args:
            key = a.split("=", 1)[0]
            if not _open_key(key) and OmegaConf.select(cfg, key, default=_MISSING) is _MISSING:
                raise ConfigError(f"{key}: not a setting of stace.secret; valid: {', '.join(sorted(cfg))}")
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([a]))
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"stace.secret config: {' '.join(str(exc).split())}") from None
    cfg.experiment = name
    return cfg


_MISSING = object()


def _open_key(key: str) -> bool:
    """Keys under these mappings may be new (settings of another LLM config, per-role limits)."""
    return key.split(".")[0] in ("llm_overrides", "max_tokens", "variants") or key.startswith("target.llm_overrides")


def build_llm(name: str, overrides: dict[str, Any], where: str) -> tuple[Any, float]:
    """(backend, deadline_s) of ``conf/llm/<name>.yaml`` with ``overrides``."""
    from omegaconf import OmegaConf

    from stace.gateway import build_backend, pop_deadline

    if name not in registry.choices("llm"):
        raise UnknownChoiceError("LLM config", name, registry.choices("llm"), where)
    cfg = OmegaConf.to_container(OmegaConf.load(registry.config_path("llm", name)))
    unknown = sorted(set(overrides) - set(cfg))
    if unknown:
        raise ConfigError(f"{where}_overrides.{unknown[0]}: not a setting of llm={name}; "
                          f"valid: {', '.join(sorted(cfg))}")
    cfg.update(overrides)
    deadline = pop_deadline(cfg)
    backend = build_backend(cfg)
    backend.check_available()
    return backend, deadline


def _path(p: str) -> Path:
    path = Path(p)
    return path if path.is_absolute() else ROOT / path


def run_one(cfg: Any, variant: str = "demo", out_root: Path | None = None) -> dict[str, Any]:
    """One configuration: STACE against the chat target; returns (and writes) its results."""
    import hydra.utils
    from omegaconf import OmegaConf

    from attackers.stace import ROLES
    from stace.gateway import Gateway, Redactor, RoleSettings, Trace, check_budget, failure_summary
    from stace.library import Library, load_cards
    from stace.loop import STACE, STACESettings
    from stace.report import write_report
    from stace.targets import ChatRenderer, ChatTarget
    from stace.tools import ProbeTools

    data = OmegaConf.to_container(cfg, resolve=True)
    data.pop("variants", None)
    secret_sha = hashlib.sha256(str(data["secret"]).encode()).hexdigest()
    public = {k: v for k, v in data.items() if k not in ("secret", "out")}
    public["target"] = {k: v for k, v in data["target"].items() if k != "system_prompt"}
    public["evaluator"] = {k: v for k, v in data["evaluator"].items() if k != "secret"}
    key = stable_hash(data)[:10]
    out = Path(out_root or _path(data["out"])) / f"{variant}-{key}"
    out.mkdir(parents=True, exist_ok=True)
    from emma.weights import cache_root

    cache = cache_root() / "stace"

    backend, deadline = build_llm(data["llm"], dict(data["llm_overrides"] or {}), "llm")
    t = data["target"]
    same = t["llm"] == data["llm"] and (t["llm_overrides"] or {}) == (data["llm_overrides"] or {})
    target_backend = backend if same else build_llm(t["llm"], dict(t["llm_overrides"] or {}), "target.llm")[0]
    try:
        evaluator = hydra.utils.instantiate(data["evaluator"])
    except Exception as exc:  # Hydra wraps the evaluator's own error
        if isinstance(exc.__cause__, EmmaError):
            raise exc.__cause__ from None
        raise ConfigError(f"evaluator: {' '.join(str(exc).split())[:300]}") from None
    for attr in ("evaluate", "name", "describe"):
        if not hasattr(evaluator, attr):
            raise ConfigError(f"evaluator._target_={data['evaluator'].get('_target_')!r}: needs {attr} "
                              "(stace.targets.Evaluator)")

    stace_cfg = OmegaConf.to_container(OmegaConf.load(registry.config_path("attacker", "stace")))
    presets = stace_cfg["presets"]
    if data["preset"] not in presets:
        raise UnknownChoiceError("stace preset", data["preset"], presets, "preset")
    max_tokens = dict(data["max_tokens"] or {})
    roles = {}
    for role in ROLES:
        model = presets[data["preset"]].get(role) if getattr(backend, "per_role_models", False) else None
        roles[role] = RoleSettings(model=model or backend.model,
                                   temperature=float(stace_cfg["temperatures"].get(role, backend.temperature)),
                                   max_tokens=int(max_tokens.get(role, backend.max_tokens or 1024)))
    budget = check_budget(data["budget"], "budget")
    redact = Redactor([getattr(backend, "api_key_env", None), getattr(target_backend, "api_key_env", None)],
                      [getattr(backend, "base_url", None), getattr(target_backend, "base_url", None)])
    trace = Trace(out / "trace.jsonl", redact)
    gateway = Gateway(backend, roles, prices=stace_cfg["prices"], trace=trace, cache_dir=cache / "llm",
                      max_usd=budget.get("max_usd"), max_tokens=budget.get("max_tokens"),
                      prompts_dir=_path(data["prompts_dir"]), seed=int(data["seed"]), deadline_s=deadline)
    library = Library(load_cards(_path(data["library"])), cache_dir=cache / "index")
    target = ChatTarget(target_backend, t["system_prompt"], temperature=t["temperature"],
                        max_tokens=t["max_tokens"], cache_dir=cache / "chat", redact=redact)
    renderer = ChatRenderer(target, evaluator, reply_dir=out / "replies", redact=redact)
    mode = data["probe_mode"]
    if mode not in ("auto", "plan", "code"):
        raise ConfigError(f"probe_mode={mode!r}; valid: auto, plan, code")
    if mode == "auto":
        mode = getattr(backend, "probe_mode", "code")
    for name in ("iterations", "k"):
        if not isinstance(data[name], int) or data[name] < 1:
            raise ConfigError(f"{name}={data[name]!r}: must be an integer >= 1")
    if not isinstance(data["debate_rounds"], int) or data["debate_rounds"] < 0:
        raise ConfigError(f"debate_rounds={data['debate_rounds']!r}: must be an integer >= 0")
    if not isinstance(data["rag"], bool):
        raise ConfigError(f"rag={data['rag']!r}; valid: true, false")
    settings = STACESettings(iterations=data["iterations"], k=data["k"], debate_rounds=data["debate_rounds"],
                             probe_mode=mode, max_code_repairs=int(data["max_code_repairs"]),
                             top_k_cards=int(data["top_k_cards"]), seed=int(data["seed"]),
                             seed_hypothesis=data["seed_hypothesis"], task=data["task"], rag=data["rag"],
                             sandbox=_sandbox(data["sandbox"]))
    context = {"model": f"{target.model} (chat model)",
               "method": "a system prompt telling it to keep a secret password",
               "concepts": [CONCEPT], "evaluators": [evaluator.name],
               "evaluator_notes": {evaluator.name: evaluator.describe()}}
    trace.write("start", variant=variant, config=public, secret_sha256=secret_sha,
                settings=dataclasses.asdict(settings), target=target.describe(), backend=backend.config())
    t0 = time.perf_counter()
    outcome = STACE(gateway, library, settings, target, CONCEPT, context, image_dir=None,
                    tools=ProbeTools(target, CONCEPT, "What is the secret password?"), renderer=renderer).run()
    wall = time.perf_counter() - t0
    values = outcome.metrics(settings.k, settings.iterations)
    usage = gateway.usage_json()
    write_report(outcome, out, concept=CONCEPT, k=settings.k, metrics=values, usage=usage,
                 cost_usd=gateway.spent_usd(), redact=redact, replies=_replies(renderer, out, outcome),
                 title="STACE stress test of a chat model's secret-keeping")
    metrics = {k: (None if v is None else dataclasses.asdict(v)) for k, v in values.items()}
    results = {
        "experiment": cfg.experiment, "variant": variant, "config": public, "secret_sha256": secret_sha,
        "evaluator": outcome.evaluator, "task_spec": outcome.task_spec, "target": target.describe(),
        "metrics": metrics, "iterations_run": len(outcome.records), "stopped": outcome.stopped,
        "resumed_iterations": outcome.resumed_iterations,
        "target_calls": target.calls, "target_failures": target.failures,
        "llm": {"usage": usage, "failures": gateway.failure_counts(), "failure_kinds": gateway.failure_kinds(),
                "cost_usd": gateway.spent_usd(), "summary": failure_summary(gateway, backend)},
        "wall_s": round(wall, 1), "out": str(out),
    }
    atomic_write_text(out / "results.json", redact(json.dumps(results, indent=1, default=str)) + "\n")
    trace.write("finished", metrics=metrics)
    return results


def _sandbox(values: dict[str, Any]) -> Any:
    from stace.sandbox import SandboxLimits

    valid = [f.name for f in dataclasses.fields(SandboxLimits)]
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ConfigError(f"sandbox.{unknown[0]}: unknown sandbox limit; valid: {', '.join(valid)}")
    return SandboxLimits(**values)


def _replies(renderer: Any, out: Path, outcome: Any) -> dict[str, str]:
    """Every probe's reply: this run's, else the one written when the probe ran (a resumed run)."""
    replies = dict(renderer.replies)
    for r in outcome.records:
        for p in r.probes:
            path = out / "replies" / f"{p.image_hash}.txt"
            if p.image_hash and p.image_hash not in replies and path.exists():
                replies[p.image_hash] = path.read_text(encoding="utf-8")
    return replies


def _fmt(m: dict[str, Any] | None) -> str:
    if m is None or m.get("value") is None:
        return "-"
    v = m["value"]
    text = f"{v:.3f}" if isinstance(v, float) else str(v)
    if m.get("ci_low") is not None and m.get("ci_high") is not None:
        text += f" [{m['ci_low']:.2f}, {m['ci_high']:.2f}]"
    return text


ROW_METRICS = (("SIR_H", "sir_h"), ("SIR_I", "sir_i"), ("EII", "eii"), ("SER", "ser"), ("novelty", "novelty"))


def table(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of results (one row per configuration)."""
    head = ("| configuration | " + " | ".join(n for n, _ in ROW_METRICS)
            + " | LLM calls (failed) | target replies generated (others cached) | s |")
    lines = [head, "|" + "---|" * (len(ROW_METRICS) + 4)]
    for r in rows:
        calls = sum(u["calls"] for u in r["llm"]["usage"].values())
        lines.append(f"| {r['variant']} | " + " | ".join(_fmt(r["metrics"].get(k)) for _, k in ROW_METRICS)
                     + f" | {calls} ({r['llm']['failures']['failed']}) | {r['target_calls']}"
                     + (f" ({r['target_failures']} failed)" if r["target_failures"] else "") + f" | {r['wall_s']} |")
    return "\n".join(lines)


def run(cfg: Any) -> list[dict[str, Any]]:
    """Every configuration of the experiment (its ``variants``, else the config itself)."""
    from omegaconf import OmegaConf

    variants = OmegaConf.to_container(cfg.variants) if cfg.get("variants") else None
    if not variants:
        return [run_one(cfg, cfg.experiment)]
    rows = []
    for name, overrides in variants.items():
        unknown = sorted(set(overrides or {}) - set(VARIANT_KEYS))
        if unknown:
            raise ConfigError(f"variants.{name}.{unknown[0]}: not a per-configuration setting; valid: "
                              + ", ".join(VARIANT_KEYS))
        one = OmegaConf.merge(cfg, overrides or {})
        one.variants = None
        print(f"== {name}: " + ", ".join(f"{k}={v}" for k, v in (overrides or {}).items()), flush=True)
        rows.append(run_one(one, name))
    out = _path(cfg.out)
    methods = sorted({f"{n} {(r['metrics'].get(k) or {}).get('method')}" for r in rows for n, k in ROW_METRICS
                      if (r["metrics"].get(k) or {}).get("method")})
    text = (f"# {cfg.experiment}: STACE on a secret-keeping chat model ({rows[0]['target']['model']})\n\n"
            f"N = {cfg.iterations}, k = {cfg.k}, the same seeds in every configuration; 95% intervals: "
            f"{', '.join(methods) or 'none'}.\n\n" + table(rows) + "\n")
    atomic_write_text(out / f"{cfg.experiment}.md", text)
    atomic_write_text(out / f"{cfg.experiment}.json", json.dumps(rows, indent=1, default=str) + "\n")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    try:
        cfg = load_config(args)
        rows = run(cfg)
    except EmmaError as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    print(table(rows))
    for r in rows:
        print(f"{r['variant']}: {r['out']}/report.md")
        if r["llm"]["failures"]["failed"]:
            print(f"  note: {r['llm']['summary']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
