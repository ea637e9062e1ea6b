"""Which style does the tiny world draw when a style prompt's style word means nothing?

An erasure that removes a style word's meaning (SPM's membrane, AdvUnlearn's text encoder, an
ESD too weak to push past it) leaves the name prompt "a star in <plain> style" with a style
word that carries nothing. What the model draws then is what the erased model can at best
draw on that prompt. This script measures it on the base model: the style-domain name prompt
with each control word of the generalisation probe (``emma.tinyworld.generalisation.CONTROLS``,
words that suggest no shape and no style) in place of the style, judged by the tiny-world
judge as EA is. References: the empty prompt (the unconditional branch that ESD's target is
built on), the style-less prompt ("a star") and each style's own name prompt.

With ``--method M --concept C --cell-seed S`` it measures the model that the cell
``python -m emma.run method=M domain=tinyworld_style concept=C seed=S`` erases (its presets and
stages; the erased model comes from ``--cache`` when that cell ran there): did the erasure
leave the concept's word meaning what a control word means (its name prompt drawn as often as
the controls draw it), or does the word still draw its style?

The control words' rate of a style is given with the beta-binomial interval over words (each
word a cluster of correlated images). If a style's control rate is high, an eraser that only
removes that style's word leaves the style drawn: EA on it is bounded by one minus that rate.

    python scripts/style_fallback.py --n 32 --markdown out.md --json out.json
    python scripts/style_fallback.py --method spm --concept plain --cell-seed 0 --cache DIR
    python scripts/style_fallback.py --summary base.json spm_plain_s0.json ...   # one row per file

Every image has its own seed (prompt k draws seeds ``seed + k*n`` to ``seed + k*n + n - 1``);
one torch thread unless ``--threads``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "scripts"):  # the package, and the probe this measurement shares
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from generalisation_probe import judged_prompts, probe_target  # noqa: E402

from emma.domains.tinyworld import TinyWorldStyleSuite  # noqa: E402
from emma.errors import EmmaError  # noqa: E402
from emma.files import atomic_write_text  # noqa: E402
from emma.metrics.intervals import beta_binomial_interval, wilson_interval  # noqa: E402
from emma.tinyworld.generalisation import CONTROLS  # noqa: E402
from emma.tinyworld.world import STYLES  # noqa: E402

DEFAULT_ASSETS = ROOT / "emma" / "tinyworld" / "assets"


def prompt_sets(suite: TinyWorldStyleSuite | None = None) -> dict[str, list[str]]:
    """The prompts measured: per control word its style prompt; the references."""
    suite = suite or TinyWorldStyleSuite()
    return {
        "controls": [suite.name_prompt(w) for w in CONTROLS],
        "references": ["", suite.subject_prompt(), *(suite.name_prompt(s) for s in STYLES)],
    }


def style_counts(target: Any, prompts: list[str], n: int, seed: int) -> list[dict[str, int]]:
    """Per prompt, how many of its ``n`` images the judge finds in each style (seeds as
    :func:`generalisation_probe.judged_prompts` draws them)."""
    return [{s: int(found[s].sum()) for s in STYLES} for found in judged_prompts(target, prompts, n, seed)]


def run(assets: Path = DEFAULT_ASSETS, n: int = 32, seed: int = 5000,
        erased: tuple[str, str, list[str]] | None = None, erase_cache: str | Path | None = None) -> dict[str, Any]:
    """The measurement on the pipeline in ``assets`` or, with ``erased`` = (method, concept,
    overrides), on the shipped world that method erases the style from (``erase_cache``: the
    cache the erased model is read from or written to)."""
    sets = prompt_sets()
    with tempfile.TemporaryDirectory() as cache:
        target, model = probe_target(assets, cache, erased, erase_cache)
        controls = style_counts(target, sets["controls"], n, seed)
        refs = style_counts(target, sets["references"], n, seed + len(sets["controls"]) * n)
    per_style = {}
    for s in STYLES:
        hits = [c[s] for c in controls]
        lo, hi = beta_binomial_interval(hits, [n] * len(hits))
        rate = sum(hits) / (n * len(hits))
        per_style[s] = {"rate": rate, "ci": [min(lo, rate), max(hi, rate)], "words": len(hits),
                        "images": n * len(hits)}
    references = []
    for p, c in zip(sets["references"], refs):
        references.append({"prompt": p, "n": n, "counts": c,
                           "ci": {s: list(wilson_interval(c[s], n)) for s in STYLES}})
    return {"model": model, "n_per_prompt": n,
            "seed": seed, "seeds": "one per image", "styles": list(STYLES),
            "controls": per_style,
            "control_words": [{"word": w, "prompt": p, "counts": c}
                              for w, p, c in zip(CONTROLS, sets["controls"], controls)],
            "references": references, "threads": torch.get_num_threads(),
            "torch": torch.__version__}


def _pct(x: float) -> str:
    return f"{x:.2f}"


def markdown(res: dict[str, Any], command: str) -> str:
    styles = res["styles"]
    n = res["n_per_prompt"]
    model = res["model"]
    which = (f"The model that {model['method']} erases {model['concept']} from "
             f"(overrides: {' '.join(model['overrides']) or 'none'}). " if "method" in model else "")
    lines = [
        which + f"Style prompts whose style word is one of the {len(res['control_words'])} control words "
        f"of the generalisation probe (words that suggest no shape and no style), {n} images each "
        "(one seed per image), judged by the tiny-world judge. Rate of each style, with the "
        "beta-binomial 95% interval over words:",
        "",
        "| | " + " | ".join(styles) + " |",
        "|---|" + "---|" * len(styles),
        "| control words | " + " | ".join(
            f"{_pct(res['controls'][s]['rate'])} ({_pct(res['controls'][s]['ci'][0])}-"
            f"{_pct(res['controls'][s]['ci'][1])})" for s in styles) + " |",
        "",
        f"References ({n} images each, Wilson 95% intervals):",
        "",
        "| prompt | " + " | ".join(styles) + " |",
        "|---|" + "---|" * len(styles),
    ]
    for r in res["references"]:
        label = f'"{r["prompt"]}"' if r["prompt"] else "(empty prompt)"
        lines.append(f"| {label} | " + " | ".join(
            f"{_pct(r['counts'][s] / n)} ({_pct(r['ci'][s][0])}-{_pct(r['ci'][s][1])})" for s in styles) + " |")
    lines += ["", "Per control word (images of each style, of " + str(n) + "):", "",
              "| word | " + " | ".join(styles) + " |", "|---|" + "---|" * len(styles)]
    for w in res["control_words"]:
        lines.append(f"| {w['word']} | " + " | ".join(str(w["counts"][s]) for s in styles) + " |")
    lines += ["", f"Command: `{command}` (torch {res['torch']}, {res['threads']} thread(s))."]
    return "\n".join(lines) + "\n"


def summary(results: list[dict[str, Any]]) -> str:
    """One row per measurement: how often the erased style's name prompt, the control words,
    the style-less and the empty prompt draw that style (the base model: plain), and the least
    rate at which another style's name prompt draws its own style."""
    lines = ["| model | its name prompt | control words | \"a star\" | empty prompt | other styles' own (least) |",
             "|---|---|---|---|---|---|"]
    suite = TinyWorldStyleSuite()
    for res in results:
        model = res["model"]
        style = model.get("concept", "plain")  # the base model's row: plain, the fallback
        seed = next((o.split("=", 1)[1] for o in model.get("overrides", []) if o.startswith("seed=")), "0")
        label = f"{model['method']} / {style}, seed {seed}" if "method" in model else f"base ({style})"
        n = res["n_per_prompt"]
        ref = {r["prompt"]: r["counts"] for r in res["references"]}
        c = res["controls"][style]
        others = min(ref[suite.name_prompt(s)][s] for s in res["styles"] if s != style) / n
        lines.append(f"| {label} | {ref[suite.name_prompt(style)][style] / n:.2f} | {c['rate']:.2f} "
                     f"({c['ci'][0]:.2f}-{c['ci'][1]:.2f}) | {ref[suite.subject_prompt()][style] / n:.2f} | "
                     f"{ref[''][style] / n:.2f} | {others:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--assets", type=Path, default=DEFAULT_ASSETS, help="tiny-world assets folder")
    ap.add_argument("--n", type=int, default=32, help="images per prompt")
    ap.add_argument("--seed", type=int, default=5000, help="first seed")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--method", help="measure the model this method erases --concept from")
    ap.add_argument("--concept", help="the erased style (with --method)")
    ap.add_argument("--cell-seed", dest="cell_seed", type=int, default=None,
                    help="the erasing cell's seed (with --method; default 0)")
    ap.add_argument("--override", action="append", default=[], help="extra Hydra override of the erasing cell")
    ap.add_argument("--cache", type=Path, help="cache of erased models (with --method)")
    ap.add_argument("--summary", nargs="+", type=Path, metavar="JSON",
                    help="print one row per measurement file written with --json, and measure nothing")
    ap.add_argument("--json", type=Path, help="write the measurement here")
    ap.add_argument("--markdown", type=Path, help="write the tables here")
    args = ap.parse_args(argv)
    if args.summary:
        missing = [str(p) for p in args.summary if not p.is_file()]
        if missing:
            print(f"error: no measurement file {', '.join(missing)}; pass files written with --json", file=sys.stderr)
            return 2
        results = [json.loads(p.read_text()) for p in args.summary]
        bad = [str(p) for p, r in zip(args.summary, results)
               if not isinstance(r, dict) or not {"model", "references", "controls"} <= r.keys()]
        if bad:
            print(f"error: {', '.join(bad)} not written by style_fallback.py --json (no model, references "
                  "or controls)", file=sys.stderr)
            return 2
        print(summary(results), end="")
        return 0
    if args.n < 1:
        print(f"error: --n must be at least 1, got {args.n}", file=sys.stderr)
        return 2
    if not (args.assets / "pipeline").is_dir():
        print(f"error: no tiny-world pipeline under {args.assets}/pipeline; pass --assets a folder "
              "that holds pipeline/ and classifier.safetensors", file=sys.stderr)
        return 2
    if (args.method is None) != (args.concept is None):
        print("error: --method and --concept go together (the cell whose erased model is measured)",
              file=sys.stderr)
        return 2
    cell_only = [f for f, v in (("--cell-seed", args.cell_seed), ("--cache", args.cache),
                                ("--override", args.override)) if v not in (None, [])]
    if args.method is None and cell_only:
        print(f"error: {', '.join(cell_only)} describe the erasing cell; give them with --method and --concept",
              file=sys.stderr)
        return 2
    if args.concept is not None and args.concept not in STYLES:
        print(f"error: unknown tiny-world style {args.concept!r}; valid: {', '.join(STYLES)}", file=sys.stderr)
        return 2
    if args.method is not None and args.assets != DEFAULT_ASSETS:
        print("error: --method erases the shipped tiny world (the CLI's model); leave out --assets",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    erased = None
    if args.method is not None:
        cell_seed = 0 if args.cell_seed is None else args.cell_seed
        erased = (args.method, args.concept, [f"seed={cell_seed}", *args.override])
    t0 = time.perf_counter()
    try:
        res = run(args.assets, args.n, args.seed, erased, args.cache)
    except EmmaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    command = f"python scripts/style_fallback.py {argv_text}".strip()
    md = markdown(res, command)
    if args.json:
        atomic_write_text(args.json, json.dumps(res, indent=1) + "\n", "the measurement")
    if args.markdown:
        atomic_write_text(args.markdown, md, "the tables")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
