"""Adaptive attacks against erased tiny worlds: ASR of each attacker vs the static suite.

Runs the cells ``method=M attacker=A`` (the CLI's configs and tiny-world presets, composed
in-process) for every method M and attacker A, and writes ``docs/attacks_tinyworld.md``
(method x attacker: ASR with 95% CI, attacked prompts that succeed, queries, iterations, wall
time) and ``docs/attacks_tinyworld.png`` (per method: original prompt vs adversarial prompt
on the erased model, same seed).

Every cell runs under each protocol of ``--protocols`` (``conf/protocol/``: ``emma`` judges each
attacked prompt on the cell's images, ``reference`` as each attack paper evaluated it); an
attack beats the static suite only against the static suite of its own protocol.

    python scripts/attacks_tinyworld.py
    python scripts/attacks_tinyworld.py --methods uce --attackers static,unlearndiffatk --protocols emma \\
        --override 'prompt_types=[name,variant]'
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from emma.files import atomic_write_text  # noqa: E402

ATTACKERS = ("static", "unlearndiffatk", "p4d_n", "p4d_k", "ring_a_bell")
METHODS = ("esd", "uce", "fmn")


def compose_cell(method: str, attacker: str, overrides: list[str]) -> Any:
    from emma import registry

    return registry.compose([f"method={method}", f"attacker={attacker}", *overrides])


def run(method: str, attacker: str, overrides: list[str], out: Path, protocol: str = "emma") -> dict[str, Any]:
    from emma.cell import run_cell

    cfg = compose_cell(method, attacker, [*overrides, f"protocol={protocol}"])
    t = time.perf_counter()
    result = run_cell(cfg, out)
    wall = time.perf_counter() - t
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    attack = [s for s in samples if s["group"] == "attack"]
    per_prompt: dict[str, bool] = {}
    for s in attack:
        key = s.get("original_prompt", s["prompt"])
        per_prompt[key] = per_prompt.get(key, False) or bool(s["detected"])
    return {"method": method, "attacker": attacker, "protocol": protocol,
            "metrics": {k: v.to_json() for k, v in result.metrics.items()},
            "timing": result.timing, "counts": result.counts, "cell_wall_s": wall,
            "prompts_broken": sum(per_prompt.values()), "prompts": len(per_prompt),
            "examples": _examples(attack), "config": result.config}


def _examples(attack: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}
    for s in attack:
        key = s.get("original_prompt", s["prompt"])
        if key not in seen or (s["detected"] and not seen[key]["detected"]):
            seen[key] = {"original": key, "adversarial": s.get("adversarial_prompt", s["prompt"]),
                         "seed": s["seed"], "detected": s["detected"]}
    return list(seen.values())


def fmt_ci(m: dict[str, Any] | None) -> str:
    if not m:
        return "–"
    lo, hi = m.get("ci_low"), m.get("ci_high")
    ci = f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else ""
    return f"{m['value']:.2f}{ci}"


def grid(rows: list[dict[str, Any]], overrides: dict[str, list[str]], path: Path, per_method: int = 4) -> list[str]:
    """Per method: columns of (original, adversarial) pairs on the erased model, same seed."""
    from PIL import Image

    from emma.cell import erased_cell

    lines, strips = [], []
    for method in dict.fromkeys(r["method"] for r in rows):
        ctx = erased_cell(compose_cell(method, "static", [*overrides[method], "concept=circle"]))
        gen = ctx.generator
        pairs = []
        for r in rows:
            if r["method"] != method or r["attacker"] == "static":
                continue
            ex = [e for e in r["examples"] if e["detected"]][:1] or r["examples"][:1]
            for e in ex:
                pairs.append((r["attacker"], e))
        pairs = pairs[: per_method]
        if not pairs:
            continue
        texts = [t for _, e in pairs for t in (e["original"], e["adversarial"])]
        seeds = [e["seed"] for _, e in pairs for _ in range(2)]
        imgs = gen.generate(texts, seeds).images
        strips.append(torch.cat(list(imgs), dim=2))
        for a, e in pairs:
            lines.append(f"- {method} / {a}: `{e['original']}` -> `{e['adversarial']}` (seed {e['seed']}, "
                         f"judge: {'circle' if e['detected'] else 'no circle'})")
    if strips:
        width = max(s.shape[2] for s in strips)
        strips = [torch.nn.functional.pad(s, (0, width - s.shape[2])) for s in strips]
        img = (torch.cat(strips, dim=1).clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
        Image.fromarray(img).resize((img.shape[1] * 3, img.shape[0] * 3), Image.NEAREST).save(path)
    return lines


def _above(ours: dict[str, Any] | None, static: dict[str, Any] | None) -> str:
    """"yes" when the attack's interval lies entirely above the static suite's, "no" when not,
    "–" when either is missing."""
    if not ours or not static:
        return "–"
    return "yes" if (ours.get("ci_low") or 0) > (static.get("ci_high") or 1) else "no"


def protocol_of(row: dict[str, Any]) -> str:
    """The attack protocol a row ran under (rows written before protocols existed: its config's)."""
    return row.get("protocol") or (row.get("config", {}).get("protocol") or {}).get("name", "emma")


def _metrics_of(row: dict[str, Any]) -> str:
    return next((o.split("=", 1)[1] for o in row.get("overrides", []) if o.startswith("metrics=")), "?")


def markdown(rows: list[dict[str, Any]], grid_lines: list[str], command: str, overrides: list[str]) -> str:
    out = ["# Adaptive attacks on the tiny world", "",
           "Concept **circle** erased from the tiny world by each method (the CLI's tiny-world presets), "
           "then attacked by each attacker on the domain's EA prompts (the CLI's tiny-world attacker "
           "presets). `static` renders the EA prompts unchanged. Images: the tiny world's sampler "
           "(Euler ancestral, 20 steps, guidance 5, 32x32), judged by the tiny-world classifier. "
           "ASR = attacked prompts with the circle in at least one image (the cell's `asr`, Wilson 95% CI); "
           "ASR (images) = fraction of their images with the circle (`asr/images`, prompt-cluster bootstrap "
           "95% CI). Queries = images drawn on the erased model per prompt (checks during the "
           "attack + the final judged images); attack s/prompt = the search's wall seconds per attacked prompt "
           "as measured when it ran on this machine's shared CPU (`attack/time_s`; an attack output "
           "replayed from the content-addressed attack cache keeps the time measured when it was computed; "
           "1 thread; compare within the table only); cell wall = the whole cell in this run "
           "(`emma.cell.run_cell` in-process: load, erase unless cached, suite, attack, metrics), with "
           "the image and erased-model caches shared by the cells in the order they ran (attacker-major).", "",
           f"Overrides: `{' '.join(overrides) or '(none)'}`. Beats static (prompts / images): the attack's "
           "ASR interval lies entirely above the static suite's on the same erased model, per attacked prompt "
           "(`asr`) and per image (`asr/images`).", "",
           "Protocol: `emma` judges every attacked prompt on the cell's images per prompt with the cell's "
           "judge and sampler; `reference` judges each attack as its paper did (images per prompt, judge "
           "threshold, sampler: `conf/protocol/reference.yaml`, docs/protocols/attackers/); under both, the "
           "search never sees an evaluation seed. Judged/prompt = the judge's verdicts the search consulted "
           "per attacked prompt (`attack/judged_queries_mean`; 0: the search never asks the judge).", "",
           "| method | attacker | protocol | ASR (prompts) | ASR (images) | queries/prompt | judged/prompt "
           "| iterations/prompt | attack s/prompt | cell wall (s) | metrics | beats static (prompts / images) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["metrics"]
        static = next((s["metrics"] for s in rows if s["method"] == r["method"] and s["attacker"] == "static"
                       and protocol_of(s) == protocol_of(r)), None)
        beats = "" if r["attacker"] == "static" or not static else " / ".join(
            _above(m.get(k), static.get(k)) for k in ("asr", "asr/images"))
        q = m.get("attack/queries_mean", {}).get("value")
        it = m.get("attack/iterations_mean", {}).get("value")
        jq = (m.get("attack/judged_queries_mean") or {}).get("value")
        ts = (m.get("attack/time_s") or {}).get("value")
        out.append(f"| {r['method']} | {r['attacker']} | {protocol_of(r)} | {fmt_ci(m.get('asr'))} "
                   f"| {fmt_ci(m.get('asr/images'))} | {'–' if q is None else f'{q:.1f}'} "
                   f"| {'–' if jq is None else f'{jq:.1f}'} | {'–' if it is None else f'{it:.0f}'} "
                   f"| {'–' if ts is None else f'{ts:.1f}'} | {r['cell_wall_s']:.0f} "
                   f"| {_metrics_of(r)} | {beats} |")
    out += ["", "Where an attack scores 0, [soft_prompt_tinyworld.md](soft_prompt_tinyworld.md) "
            "(`scripts/soft_prompt_probe.py`) says whether the erased model still draws the concept under "
            "conditioning optimised continuously: a high soft rate next to a hard-token rate of 0 means the "
            "concept is still in the model, but no prompt over the searched vocabulary reaches it."]
    out += ["", "Original prompt (left) vs adversarial prompt (right) on the erased model, same seed; one row "
            "per method:", "", "![grid](attacks_tinyworld.png)", ""] + grid_lines
    out += ["", "Erasure settings (the method presets when the cells ran):", ""]
    for mth in dict.fromkeys(r["method"] for r in rows):
        cfg = next(r["config"]["method"] for r in rows if r["method"] == mth)
        out.append(f"- **{mth}**: `{json.dumps({k: v for k, v in cfg.items() if k != '_target_'}, sort_keys=True)}`")
    out += ["", "Attacker settings (budget per prompt):", ""]
    for a in dict.fromkeys(r["attacker"] for r in rows):
        cfg = next(r["config"]["attacker"] for r in rows if r["attacker"] == a)
        out.append(f"- **{a}**: `{json.dumps({k: v for k, v in cfg.items() if k != '_target_'}, sort_keys=True)}`")
    # the invocations that ran the cells (one per metrics config), then the one that rendered this page
    runs_by_metrics: dict[str, list[str]] = {}
    for r in rows:
        runs_by_metrics.setdefault(_metrics_of(r), [])
        if r["method"] not in runs_by_metrics[_metrics_of(r)]:
            runs_by_metrics[_metrics_of(r)].append(r["method"])
    out += ["", "Cells run by:", ""]
    out += [f"- `{command} --methods {','.join(ms)}"
            f"{'' if mx == 'rates_only' else f' --metrics {mx}'}`" for mx, ms in runs_by_metrics.items()]
    out += ["", f"Rendered by `{command} --from-rows` — {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
            f"torch {torch.__version__}, {torch.get_num_threads()} CPU thread(s)."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--attackers", default=",".join(ATTACKERS))
    p.add_argument("--protocols", default="emma,reference", help="attack protocols (conf/protocol/), each a row")
    p.add_argument("--override", action="append", default=[], help="a Hydra override for every cell")
    p.add_argument("--method-override", action="append", default=[],
                   help="METHOD:OVERRIDE, a Hydra override for that method's cells only")
    p.add_argument("--from-rows", action="store_true", help="only render the finished cells of --runs")
    p.add_argument("--metrics", default="rates_only",
                   help="the cells' metrics config (default rates_only; 'default' adds bias and FID)")
    p.add_argument("--rerun", action="store_true", help="run cells already in --runs/rows.json again")
    p.add_argument("--out", default=str(ROOT / "docs" / "attacks_tinyworld.md"))
    p.add_argument("--runs", default=str(ROOT / ".cache" / "attacks_tinyworld"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    # every cell computes (no finished-cell reuse), so that wall times are measured
    overrides = [f"metrics={args.metrics}", "paths.reuse_results=false", "overwrite=true", *args.override]
    if "EMMA_CACHE" in os.environ and not any(o.startswith("paths.cache_dir") for o in overrides):
        overrides.append(f"paths.cache_dir={os.environ['EMMA_CACHE']}")
    per_method: dict[str, list[str]] = {}
    for mo in args.method_override:
        m, _, o = mo.partition(":")
        per_method.setdefault(m, []).append(o)
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    # finished cells are kept in rows.json: a run resumes at the first missing cell, and runs of
    # different methods (e.g. with different --metrics) add up to one table
    rows = json.loads((runs / "rows.json").read_text()) if (runs / "rows.json").exists() else []
    # attacker-major: every method gets the static suite and the first attackers first
    protocols = [x for x in args.protocols.split(",") if x]
    from emma import registry

    unknown = [x for x in protocols if x not in registry.choices("protocol")]
    if unknown:
        p.error(f"unknown protocol(s) {unknown}; valid: {', '.join(registry.choices('protocol'))}")
    for protocol in [] if args.from_rows else protocols:
        for attacker in args.attackers.split(","):
            for method in args.methods.split(","):
                key = (method, attacker, protocol)
                if any((r["method"], r["attacker"], protocol_of(r)) == key for r in rows) and not args.rerun:
                    print(f"== {method} x {attacker} ({protocol}): in {runs / 'rows.json'}", flush=True)
                    continue
                print(f"== {method} x {attacker} ({protocol})", flush=True)
                row = run(method, attacker, overrides + per_method.get(method, []),
                          runs / f"{method}_{attacker}_{protocol}", protocol)
                row["overrides"] = overrides + per_method.get(method, [])
                rows = [r for r in rows if (r["method"], r["attacker"], protocol_of(r)) != key] + [row]
                atomic_write_text(runs / "rows.json", json.dumps(rows, indent=1, default=str))
                print(f"   asr {fmt_ci(row['metrics'].get('asr'))}, broken {row['prompts_broken']}/{row['prompts']}, "
                      f"attack {row['timing'].get('attack_s', 0):.0f}s", flush=True)
    order = {x: i for i, x in enumerate(protocols)}
    rows.sort(key=lambda r: (METHODS.index(r["method"]) if r["method"] in METHODS else 99,
                             order.get(protocol_of(r), 99),
                             ATTACKERS.index(r["attacker"]) if r["attacker"] in ATTACKERS else 99))
    out = Path(args.out)
    method_overrides = {m: [o for o in overrides + per_method.get(m, []) if not o.startswith("attacker")]
                        for m in dict.fromkeys(r["method"] for r in rows)}
    lines = grid(rows, method_overrides, out.with_suffix(".png"))
    shown = [o for o in overrides if not o.startswith("paths.")] + args.method_override
    command = "python scripts/attacks_tinyworld.py" + "".join(f" --override '{o}'" for o in args.override) \
        + "".join(f" --method-override '{o}'" for o in args.method_override)
    out.write_text(markdown(rows, lines, command, shown))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
