"""Erase one tiny-world shape with every method and measure EA / RA.

Each method runs at EMMA-like settings scaled down to the tiny world (``TINYWORLD_SETTINGS``:
the papers' algorithms and objectives, with step counts, learning rates and image counts sized
for a 3-layer text encoder and an 8x8x8 latent UNet on a CPU). Images are drawn with the
tiny world's sampler settings (its shipped Euler ancestral scheduler, 20 steps, guidance 5;
``SAMPLER``) and judged by the tiny-world classifier; EA is the fraction of target-prompt
images where the shape is *not* found, RA the fraction of non-target images where their shape
*is* found (EMMA's definitions).

    python scripts/eval_methods_tinyworld.py                       # all methods, writes docs/
    python scripts/eval_methods_tinyworld.py --methods uce,esd --seeds 4 --out methods_subset.md

``tests/test_methods_tinyworld.py`` imports :func:`evaluate_method` and ``TINYWORLD_SETTINGS``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from emma.methods.ca import ConceptAblationMethod  # noqa: E402
from emma.methods.esd import ESDMethod  # noqa: E402
from emma.methods.fmn import ForgetMeNotMethod  # noqa: E402
from emma.methods.mace import MACEMethod  # noqa: E402
from emma.methods.uce import UCEMethod  # noqa: E402

EA_TYPES = ("name", "prefix", "variant", "short", "long")
RA_TYPES = ("random", "similar")
# The tiny world's sampler settings (conf/model/tinyworld.yaml).
SAMPLER = dict(num_inference_steps=20, guidance_scale=5.0, height=32, width=32)
DOMAIN = "tinyworld"

# Scaled-down settings: the methods' own samplers take the tiny world's 20 steps; everything
# not listed (guidance scales of those samplers included) keeps the paper default.
SHAPES_BUT = ["square", "triangle", "star", "heart", "cross", "crescent", "diamond"]  # all but circle
TINYWORLD_SETTINGS: dict[str, tuple[type, dict[str, Any]]] = {
    "esd-x": (ESDMethod, dict(train_method="esd-x", iterations=200, learning_rate=3e-4, ddim_steps=10)),
    "esd-u": (ESDMethod, dict(train_method="esd-u", iterations=800, learning_rate=2.5e-4, ddim_steps=10)),
    # UCE preserves the domain's other concepts, as its reference code does for artists.
    "uce": (UCEMethod, dict(guide_concepts={DOMAIN: "shape"}, preserve_concepts={DOMAIN: SHAPES_BUT})),
    "mace": (MACEMethod, dict(mapping_concepts={DOMAIN: "background"}, learning_rate=3e-3, max_train_steps=50,
                              num_images=8, sample_steps=20, segmenter="attention")),
    "ca": (ConceptAblationMethod, dict(anchor_concepts={DOMAIN: "shape"}, num_class_images=64,
                                       train_batch_size=8, learning_rate=1.5e-3, max_train_steps=200,
                                       sample_steps=20)),
    "ca-model": (ConceptAblationMethod, dict(loss="model", anchor_concepts={DOMAIN: "shape"},
                                             num_class_images=64, train_batch_size=8, learning_rate=1e-4,
                                             max_train_steps=200, sample_steps=20, prior_preservation=True)),
    "fmn": (ForgetMeNotMethod, dict(prompt_templates={DOMAIN: "an image of a {}"}, learning_rate=1e-3,
                                    max_train_steps=70, num_images=8, sample_steps=20)),
}


def default_assets() -> tuple[Path, Path]:
    """The shipped tiny world, else the training script's export folder."""
    from classifiers.tinyworld import DEFAULT_WEIGHTS
    from emma.pipelines import TINYWORLD_DIR

    if TINYWORLD_DIR.exists() and DEFAULT_WEIGHTS.exists():
        return TINYWORLD_DIR, DEFAULT_WEIGHTS
    export = ROOT / ".cache" / "tinyworld-export"
    return export / "pipeline", export / "classifier.safetensors"


def load_tinyworld(pipeline: Path, device: str = "cpu") -> Any:
    from diffusers import StableDiffusionPipeline

    # The tiny world ships fp16 weights; it runs (and is erased) in fp32 on CPUs.
    pipe = StableDiffusionPipeline.from_pretrained(str(pipeline), local_files_only=True, safety_checker=None,
                                                   requires_safety_checker=False, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def prompt_suite(concept: str) -> dict[str, list[tuple[str, str]]]:
    """EMMA-form prompts of the tiny-world domain: ``{type: [(prompt, checked concept)]}``."""
    from emma.domains.tinyworld import tinyworld_domain

    domain = tinyworld_domain()
    return domain.suite.prompts(domain, concept)


@torch.no_grad()
def judge(pipe: Any, classifier: Any, prompts: list[tuple[str, str]], seeds: int,
          batch_size: int = 32, sampler: dict[str, Any] | None = None) -> list[bool]:
    """Draw ``seeds`` images per prompt and return, per image, whether its concept is found."""
    jobs = [(p, c, s) for p, c in prompts for s in range(seeds)]
    found: list[bool] = []
    for i in range(0, len(jobs), batch_size):
        chunk = jobs[i : i + batch_size]
        gens = [torch.Generator("cpu").manual_seed(s) for _, _, s in chunk]
        images = pipe([p for p, _, _ in chunk], generator=gens, output_type="pt",
                      **(sampler or SAMPLER)).images
        images = (images.float().cpu() * 255).round() / 255  # judged as the harness stores them (8 bit)
        probs = classifier.predict(images)
        for j, (_, c, _) in enumerate(chunk):
            found.append(bool(classifier.detect(probs[j : j + 1], c)[0]))
    return found


def grid_prompts(concept: str) -> list[str]:
    """The sample grid's columns: the erased concept's name prompt x 4, two other shapes x 2."""
    others = [c for c in ("crescent", "square", "triangle") if c != concept][:2]
    return [f"an image of a {c}" for c in [concept] * 4 + [others[0]] * 2 + [others[1]] * 2]


@dataclass
class Row:
    method: str
    unlearning_s: float
    rates: dict[str, float]
    n: dict[str, int]
    config: dict[str, Any] = field(default_factory=dict)
    samples: Any = None  # (3, 32, 256) float tensor: one grid row (grid_prompts)


@torch.no_grad()
def sample_row(pipe: Any, concept: str, sampler: dict[str, Any] | None = None) -> torch.Tensor:
    """One grid row: grid_prompts(concept) (seeds 0, 1, ...) side by side."""
    prompts = grid_prompts(concept)
    gens = [torch.Generator("cpu").manual_seed(i) for i in range(len(prompts))]
    images = pipe(prompts, generator=gens, output_type="pt", **(sampler or SAMPLER)).images
    return torch.cat(list(images.float().cpu()), dim=2)


def save_grid(rows: list[Row], path: Path, scale: int = 3) -> None:
    """The rows' samples stacked (one row per method, labelled on the left) as a PNG."""
    from PIL import Image, ImageDraw

    strips = [r.samples for r in rows if r.samples is not None]
    grid = (torch.cat(strips, dim=1).permute(1, 2, 0).numpy() * 255).round().clip(0, 255).astype("uint8")
    img = Image.fromarray(grid).resize((grid.shape[1] * scale, grid.shape[0] * scale), Image.NEAREST)
    label_w = 80
    canvas = Image.new("RGB", (img.width + label_w, img.height), "white")
    canvas.paste(img, (label_w, 0))
    draw = ImageDraw.Draw(canvas)
    for i, r in enumerate(r for r in rows if r.samples is not None):
        draw.text((6, i * 32 * scale + 32 * scale // 2 - 6), r.method, fill="black")
    tmp = path.with_suffix(".tmp.png")
    canvas.save(tmp)
    os.replace(tmp, path)


def rates_of(pipe: Any, classifier: Any, suite: dict[str, list[tuple[str, str]]], seeds: int,
             types: tuple[str, ...] = EA_TYPES + RA_TYPES,
             sampler: dict[str, Any] | None = None) -> tuple[dict[str, float], dict[str, int]]:
    rates, counts = {}, {}
    for kind in types:
        if kind not in suite:
            continue
        found = judge(pipe, classifier, suite[kind], seeds, sampler=sampler)
        hits = sum(found) / max(len(found), 1)
        rates[kind] = 1.0 - hits if kind in EA_TYPES else hits
        counts[kind] = len(found)
    return rates, counts


def evaluate_method(base: Any, classifier: Any, name: str | None, concept: str, seeds: int,
                    types: tuple[str, ...] = EA_TYPES + RA_TYPES, seed: int = 0,
                    overrides: dict[str, Any] | None = None, progress: bool = False,
                    sampler: dict[str, Any] | None = None, samples: bool = False) -> Row:
    """Erase ``concept`` from a copy of ``base`` with method ``name`` (``None``: the base model)."""
    suite = prompt_suite(concept)
    pipe = copy.deepcopy(base)
    elapsed, config = 0.0, {"name": "base"}
    if name is not None:
        cls, kwargs = TINYWORLD_SETTINGS[name]
        extra = {} if cls is UCEMethod else {"progress": progress}
        method = cls(**{**kwargs, **(overrides or {})}, **extra)
        t0 = time.perf_counter()
        method.erase(pipe, [concept], seed=seed, domain=DOMAIN)
        elapsed = time.perf_counter() - t0
        config = method.config()
    rates, counts = rates_of(pipe, classifier, suite, seeds, types, sampler)
    strip = sample_row(pipe, concept, sampler) if samples else None
    return Row(method=name or "base", unlearning_s=elapsed, rates=rates, n=counts, config=config,
               samples=strip)


def markdown(rows: list[Row], concept: str, seeds: int, command: str, guidance: float,
             grid_name: str = "methods_tinyworld.png") -> str:
    head = ("| method | unlearning (s) | " + " | ".join(f"EA {t}" for t in EA_TYPES) + " | "
            + " | ".join(f"RA {t}" for t in RA_TYPES) + " |")
    sep = "|" + "---|" * (2 + len(EA_TYPES) + len(RA_TYPES))
    lines = [head, sep]
    for r in rows:
        cells = [f"{r.rates[t]:.2f}" if t in r.rates else "–" for t in EA_TYPES + RA_TYPES]
        t = "–" if r.method == "base" else f"{r.unlearning_s:.1f}"
        lines.append(f"| {r.method} | {t} | " + " | ".join(cells) + " |")
    counts = rows[0].n if rows else {}
    settings = "\n".join(
        f"- **{r.method}**: `{json.dumps({k: v for k, v in r.config.items() if k not in ('name', 'version')}, sort_keys=True)}`"  # noqa: E501
        for r in rows if r.method != "base")
    return f"""# Erasure methods on the tiny world

Erasing **{concept}** from the tiny world with each method at EMMA-like settings scaled down
(`scripts/eval_methods_tinyworld.py`, `TINYWORLD_SETTINGS`). Images: the tiny world's sampler
(Euler ancestral, 20 steps, guidance {guidance:g}, 32x32), {seeds} seeds per prompt, judged by the tiny-world
classifier (top-1 of its shape head with probability >= 0.5). EA = fraction of target-prompt
images where the {concept} is **not** found; RA = fraction of non-target images where their
shape **is** found. Prompts are the tiny-world domain's EMMA suite (images per type:
{", ".join(f"{k} {v}" for k, v in counts.items())}). Unlearning time is wall-clock seconds of
`erase()` on this machine's CPU (shared with other jobs; compare within the table only).

{chr(10).join(lines)}

Samples (one row per method; columns: {", ".join(f'"{p}"' for p in dict.fromkeys(grid_prompts(concept)))},
as 4, 2 and 2 images; seeds 0-7):

![samples]({grid_name})

Settings (constructor arguments, including the unchanged paper defaults):

{settings}

Command: `{command}` — {time.strftime('%Y-%m-%d %H:%M %Z')}, torch {torch.__version__},
{torch.get_num_threads()} CPU threads.
"""


def main(argv: list[str] | None = None) -> None:
    pipeline_default, classifier_default = default_assets()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipeline", type=Path, default=pipeline_default)
    ap.add_argument("--classifier", type=Path, default=classifier_default)
    ap.add_argument("--concept", default="circle")
    ap.add_argument("--methods", default=",".join(TINYWORLD_SETTINGS))
    ap.add_argument("--seeds", type=int, default=16, help="images per prompt")
    ap.add_argument("--seed", type=int, default=0, help="seed of the erasure")
    ap.add_argument("--guidance-scale", type=float, default=SAMPLER["guidance_scale"],
                    help="guidance of the evaluation images (default: conf/model/tinyworld.yaml's)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "methods_tinyworld.md")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv)

    from classifiers.tinyworld import TinyWorldClassifier

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    base = load_tinyworld(args.pipeline)
    classifier = TinyWorldClassifier(weights=str(args.classifier))
    names = [m for m in args.methods.split(",") if m]
    unknown = [m for m in names if m not in TINYWORLD_SETTINGS]
    if unknown:
        ap.error(f"unknown method(s) {unknown}; valid: {', '.join(TINYWORLD_SETTINGS)}")
    sampler = {**SAMPLER, "guidance_scale": args.guidance_scale}
    rows = [evaluate_method(base, classifier, None, args.concept, args.seeds, sampler=sampler, samples=True)]
    print(f"base: {rows[0].rates}", flush=True)
    for name in names:
        row = evaluate_method(base, classifier, name, args.concept, args.seeds, seed=args.seed,
                              progress=True, sampler=sampler, samples=True)
        print(f"{name}: {row.unlearning_s:.1f}s {row.rates}", flush=True)
        rows.append(row)
    given = argv if argv is not None else sys.argv[1:]
    command = "python scripts/eval_methods_tinyworld.py " + " ".join(given)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    grid = args.out.with_suffix(".png")
    save_grid(rows, grid)
    args.out.write_text(markdown(rows, args.concept, args.seeds, command.strip(), args.guidance_scale,
                                 grid_name=grid.name))
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.__dict__.items() if k != "samples"} for r in rows],
                                        indent=2, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
