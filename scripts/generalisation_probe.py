"""Does the tiny world draw what words it never saw mean?

For every word of ``emma.tinyworld.generalisation.PROBE`` (words and phrases absent from every
training caption, each with the shape or style a person expects), the fraction of images of
"an image of a <word>" in which the judge finds the expected concept. For the ``CONTROLS``
(words that suggest no shape) and for random vocabulary words, how often each shape is drawn:
a control that drew one shape more often than random words do would mean the encoder reads
shapes into words that have none.

Every image has its own seed (word k of a list draws seeds ``first + k*n ... first + k*n + n-1``,
and the lists do not overlap), so the control and random-word rates are independent samples of
what the model draws, not the same few noise draws seen through different words. Their
intervals treat each word as a cluster of correlated images
(:func:`emma.metrics.intervals.beta_binomial_interval`); a shape *fails* the control check
when the controls' interval lies entirely above the random words'.

With ``--method M --concept C`` the probe measures the model that the cell
``python -m emma.run method=M concept=C`` erases (its presets, ``--override`` for more), and
``--compare JSON`` puts another run's rates beside each word: does erasing a concept by its name
also erase the words that evoke it, and what does it cost the words of other concepts?

    python scripts/generalisation_probe.py                       # the shipped tiny world
    python scripts/generalisation_probe.py --assets DIR --n 20 --json out.json --markdown out.md
    python scripts/generalisation_probe.py --method esd --concept circle \
        --compare emma/tinyworld/assets/generalisation.json --markdown esd_circle.md
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from classifiers.tinyworld import TinyWorldClassifier  # noqa: E402
from emma.errors import EmmaError, UnknownChoiceError  # noqa: E402
from emma.metrics.intervals import beta_binomial_interval, wilson_interval  # noqa: E402
from emma.tinyworld.generalisation import BASE_RATE_WORDS, CONTROLS, PROBE, kind, random_words  # noqa: E402
from emma.tinyworld.quality import make_target  # noqa: E402
from emma.tinyworld.world import SHAPES, STYLES, with_template  # noqa: E402

TEMPLATE = "an image of a {x}"
DEFAULT_ASSETS = ROOT / "emma" / "tinyworld" / "assets"
PASS_RATE = 0.5


def judged_prompts(target, prompts: list[str], n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Per prompt and per concept of the judge, which of the prompt's ``n`` images show the
    concept. Prompt ``k`` draws the seeds ``seed + k*n`` to ``seed + k*n + n - 1``."""
    flat = [p for p in prompts for _ in range(n)]
    seeds = [seed + k * n + i for k in range(len(prompts)) for i in range(n)]
    clf = target.judge.classifier
    probs = []
    batch = 256
    for lo in range(0, len(flat), batch):
        result = target.generate(flat[lo : lo + batch], seeds[lo : lo + batch])
        probs.append(clf.predict(result.images))
        print(f"  {min(lo + batch, len(flat))}/{len(flat)} images", flush=True)
    allp = torch.cat(probs)
    concepts = list(SHAPES) + list(STYLES)
    found = {c: clf.detect(allp, c).numpy() for c in concepts}
    return [{c: found[c][k * n : (k + 1) * n] for c in concepts} for k in range(len(prompts))]


def judged(target, words: list[str], n: int, seed: int) -> dict[str, dict[str, np.ndarray]]:
    """:func:`judged_prompts` of "an image of a <word>", keyed by word."""
    return dict(zip(words, judged_prompts(target, [with_template(TEMPLATE, w) for w in words], n, seed)))


def erased_generator(method: str, concept: str, overrides: list[str], cache: str | Path) -> tuple[Any, dict]:
    """The generator of the cell ``method=<method> concept=<concept>`` (a style in the
    ``tinyworld_style`` domain): its erased model, through the cell's own stages and presets,
    drawn as the cell draws it, with the method's sampling-time guidance where it has one (SLD,
    SPM's Facilitated Transport); and what it is."""
    from eval_methods_tinyworld import concept_overrides

    from emma import registry
    from emma.cell import erased_cell

    ctx = erased_cell(registry.compose([f"method={method}", *concept_overrides(concept),
                                        f"paths.cache_dir={cache}", *overrides]))
    return ctx.generator, {"method": method, "concept": concept, "overrides": list(overrides),
                           "erased_fingerprint": ctx.erased.fingerprint,
                           "guidance": ctx.guidance.name if ctx.guidance is not None else None}


def judged_by(generator: Any, classifier: Any, cache: str | Path) -> Any:
    """``generator`` judged by ``classifier``, its scores cached in ``cache``."""
    from emma.cache import ScoreCache
    from emma.generate import GenerationTarget, Judge

    return GenerationTarget(generator, Judge(classifier, ScoreCache(cache, classifier.cache_key())))


def probe_target(assets: Path, cache: str | Path, erased: tuple[str, str, list[str]] | None = None,
                 erase_cache: str | Path | None = None) -> tuple[Any, dict[str, Any]]:
    """The judged target a probe measures, and what it is: the pipeline in ``assets``, or with
    ``erased`` = (method, concept, overrides) the shipped world that method erases the concept
    from (:func:`erased_generator`; ``erase_cache``: where the erased model is read or written,
    ``cache`` when ``None``). Images and scores are cached in ``cache``."""
    clf = TinyWorldClassifier(weights=assets / "classifier.safetensors")
    if erased is None:
        return (make_target(assets / "pipeline", clf, cache),
                {"assets": "shipped" if assets == DEFAULT_ASSETS else str(assets)})
    gen, model = erased_generator(*erased, cache=cache if erase_cache is None else erase_cache)
    return judged_by(gen, clf, cache), model


def run(assets: Path, n: int, seed: int, n_random: int, erased: tuple[str, str, list[str]] | None = None,
        erase_cache: str | Path | None = None) -> dict:
    """The probe on the pipeline in ``assets`` or, with ``erased`` = (method, concept,
    overrides), on the shipped world that method erases the concept from."""
    with tempfile.TemporaryDirectory() as cache:
        target, model = probe_target(assets, cache, erased, erase_cache)
        rand_words = random_words(n_random, seed)
        # one seed per image across the three lists
        probe = judged(target, list(PROBE), n, seed)
        controls = judged(target, list(CONTROLS), n, seed + len(PROBE) * n)
        rand = judged(target, rand_words, n, seed + (len(PROBE) + len(CONTROLS)) * n)
    rows = []
    for word, concept in PROBE.items():
        hits = int(probe[word][concept].sum())
        lo, hi = wilson_interval(hits, n)
        same_kind = [c for c in probe[word] if kind(c) == kind(concept)]
        drawn = max(same_kind, key=lambda c: int(probe[word][c].sum()))
        rows.append({"word": word, "expected": concept, "rate": hits / n, "n": n,
                     "ci": [lo, hi], "drawn": drawn})
    passed = sum(r["rate"] >= PASS_RATE for r in rows)

    def shape_rates(table: dict[str, dict[str, np.ndarray]]) -> dict[str, dict]:
        out = {}
        for s in SHAPES:
            hits = [int(w[s].sum()) for w in table.values()]
            total = n * len(table)
            lo, hi = beta_binomial_interval(hits, [n] * len(hits))
            rate = sum(hits) / total
            out[s] = {"rate": rate, "n": total, "words": len(hits), "ci": [min(lo, rate), max(hi, rate)]}
        return out

    control_words = {w: {s: float(controls[w][s].mean()) for s in SHAPES} for w in CONTROLS}
    c_rates, r_rates = shape_rates(controls), shape_rates(rand)
    return {"model": model, "n_per_word": n, "seed": seed, "template": TEMPLATE, "pass_rate": PASS_RATE,
            "words": rows, "passed": passed, "total": len(rows),
            "controls": c_rates, "random": r_rates, "seeds": "one per image",
            "controls_above_random": control_failures(c_rates, r_rates),
            "control_words": control_words, "random_words": rand_words}


def control_failures(controls: dict[str, dict], rand: dict[str, dict]) -> list[str]:
    """The shapes the control words draw more often than random words, beyond doubt: the
    controls' interval lies entirely above the random words'."""
    return [s for s in SHAPES if controls[s]["ci"][0] > rand[s]["ci"][1]]


def markdown(res: dict, compare: dict | None = None) -> str:
    """The probe's tables; with ``compare`` (another run's result at the same words), its rate
    and most drawn concept beside each word's."""
    lines = [f"Words passing (expected concept in >= {res['pass_rate']:.0%} of {res['n_per_word']} "
             f"images): **{res['passed']} of {res['total']}** ({res['passed'] / res['total']:.0%})"
             + (f"; compared run: {compare['passed']} of {compare['total']}." if compare else "."), ""]
    if compare is None:
        lines += ["| word | expected | rate | 95% CI | most drawn |", "|---|---|---|---|---|"]
    else:
        lines += ["| word | expected | rate | 95% CI | most drawn | compared: rate | most drawn |",
                  "|---|---|---|---|---|---|---|"]
        other = {r["word"]: r for r in compare["words"]}
    for r in res["words"]:
        line = (f"| {r['word']} | {r['expected']} | {r['rate']:.2f} | "
                f"[{r['ci'][0]:.2f}, {r['ci'][1]:.2f}] | {r['drawn']} |")
        if compare is not None:
            o = other.get(r["word"])
            line += f" {o['rate']:.2f} | {o['drawn']} |" if o else " - | - |"
        lines.append(line)
    lines += ["", f"Shapes drawn by the {len(CONTROLS)} control words and by "
              f"{len(res['random_words'])} random vocabulary words ({res['n_per_word']} images each):", "",
              "| shape | controls | 95% CI | random words | 95% CI |", "|---|---|---|---|---|"]
    for s in SHAPES:
        c, r = res["controls"][s], res["random"][s]
        lines.append(f"| {s} | {c['rate']:.3f} | [{c['ci'][0]:.3f}, {c['ci'][1]:.3f}] | {r['rate']:.3f} | "
                     f"[{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] |")
    failed = res.get("controls_above_random", [])
    point = [s for s in SHAPES if res["controls"][s]["rate"] > res["random"][s]["rate"]]
    lines += ["", "Intervals: each word a cluster of correlated images (beta-binomial profile likelihood). "
              + (f"**Controls above random words (interval entirely above): {', '.join(failed)}.**" if failed
                 else "**No shape is drawn by the controls more often than by random words beyond doubt.**")
              + f" Point rates above random: {', '.join(point) or 'none'}."]
    strong = sorted(((w, s, r) for w, rates in res["control_words"].items() for s, r in rates.items() if r >= 0.5),
                    key=lambda x: -x[2])
    if strong:
        lines += ["", "Control words that draw one shape in half their images or more: "
                  + ", ".join(f"{w} ({s} {r:.2f})" for w, s, r in strong) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--assets", default=str(DEFAULT_ASSETS))
    p.add_argument("--n", type=int, default=20, help="images per word")
    p.add_argument("--seed", type=int, default=BASE_RATE_WORDS[1],
                   help="first seed of every word's images (and the seed of the random words' draw)")
    p.add_argument("--random", type=int, default=BASE_RATE_WORDS[0], help="random vocabulary words for the base rate")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--method", default=None, help="probe the shipped world this method erases --concept from")
    p.add_argument("--concept", default=None, help="the concept --method erases (a shape or a style)")
    p.add_argument("--override", action="append", default=[], help="extra Hydra override of the erasing cell")
    p.add_argument("--erase-cache", default=None, help="cache for the erased model (default: a temporary one)")
    p.add_argument("--compare", default=None, help="--json of another run: its rates beside each word")
    args = p.parse_args(argv)
    if (args.method is None) != (args.concept is None):
        p.error("--method and --concept go together (the cell that erases the concept)")
    if args.method is not None and Path(args.assets) != DEFAULT_ASSETS:
        p.error("--method erases the shipped world; --assets names another model")
    if args.method is not None:
        from emma import registry

        if args.method not in registry.choices("method"):
            p.error(str(UnknownChoiceError("--method", args.method, registry.choices("method"))))
    if args.concept is not None and args.concept not in (*SHAPES, *STYLES):
        p.error(f"unknown --concept {args.concept!r}; valid: {', '.join((*SHAPES, *STYLES))}")
    compare = None
    if args.compare:
        try:
            compare = json.loads(Path(args.compare).read_text())
        except (OSError, ValueError) as err:
            p.error(f"--compare {args.compare}: not a probe's --json ({type(err).__name__}: {err})")
        if not isinstance(compare, dict) or not isinstance(compare.get("words"), list):
            p.error(f"--compare {args.compare}: not a probe's --json (no 'words' list)")
    if args.threads:
        torch.set_num_threads(args.threads)
    erased = (args.method, args.concept, args.override) if args.method else None
    try:
        res = run(Path(args.assets), args.n, args.seed, args.random, erased=erased, erase_cache=args.erase_cache)
    except EmmaError as err:  # a cell the harness refuses (an unknown method, a bad override)
        p.exit(2, f"error: {err}\n")
    text = markdown(res, compare)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
