"""Every erasure method on every tiny-world shape, through the command line's own configs.

Each (method, concept) is the cell ``python -m emma.run method=M concept=C`` restricted to the
two columns that decide whether an erasure works: EA on the name prompt and RA on random
other shapes (``metrics=rates_only prompt_types=[name,random]``). The configs are composed
from ``conf/`` exactly as the CLI composes them, so the method's tiny-world preset
(``conf/preset/method/<method>_tiny.yaml``) is what is measured; nothing is set here.

    python scripts/eval_methods_tinyworld.py                         # all methods x 8 shapes -> docs/
    python scripts/eval_methods_tinyworld.py --methods esd_u --concepts circle,star --seeds 0,1,2
    python scripts/eval_methods_tinyworld.py --methods esd --override method.learning_rate=2e-4 --out /dev/null

Erased models and images are cached under ``--cache`` (default ``.cache/eval-methods``), so an
interrupted run resumes and a re-run only re-reads. ``tests/test_methods_tinyworld.py`` calls
:func:`evaluate_cell`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

METHODS = ("esd", "esd_u", "esd_100", "esd_200", "esd_500", "uce", "mace", "ca", "ca_model", "fmn",
           "rece", "salun", "spm")
SHAPES = ("circle", "square", "triangle", "star", "heart", "cross", "crescent", "diamond")
# Methods whose tiny-world rows stay below the bar for reasons docs/methods_tinyworld_limits.md
# measures; the page links there. A method failing more cells than LIST_FAILING_UP_TO gets one line.
BELOW_THE_BAR = ("esd_u", "fmn", "sld", "sld_weak", "sld_strong", "sld_max")
LIST_FAILING_UP_TO = 6
# The style a style word without meaning draws (scripts/style_fallback.py): a miss on it links the
# limits page's section on why plain is where an eraser short of its target shows.
FALLBACK_STYLE = "plain"
FALLBACK_WHY = ("(plain is what a meaningless style word draws: [methods_tinyworld_limits.md]"
                "(methods_tinyworld_limits.md#plain-the-style-a-meaningless-style-word-draws))")
STYLES = ("plain", "striped", "dotted", "checkered")
RATE_OVERRIDES = ("metrics=rates_only", "prompt_types=[name,random]")
VARIANT_OVERRIDES = ("metrics=rates_only", "prompt_types=[name,random,variant]")


def compose(overrides: Sequence[str]) -> Any:
    """The cell config ``python -m emma.run <overrides>`` would run (presets included)."""
    from emma import registry

    return registry.compose(overrides)


@dataclass
class CellRates:
    method: str
    concept: str
    seed: int
    threads: int
    ea_name: float
    ra_random: float
    n_name: int
    n_random: int
    unlearning_s: float
    wall_s: float
    method_config: dict[str, Any]
    #: where the cell ran: the libraries and runtime (CPU, torch threads) its results.json
    #: records; float rounding follows both, so a figure is checked against its machine
    environment: dict[str, Any] = field(default_factory=dict)
    #: EA on the domain's variant prompts (synonyms of a shape, other words for a style), with
    #: ``--variants``: what the bar does not see, whether an erasure reaches the concept's other
    #: names; ``None`` when not measured
    ea_variant: float | None = None
    n_variant: int = 0


class Bases(dict):
    """The base model's cells, keyed by (concept, seed): a cell is compared with the base at its
    own seed (the seed moves the images of both); files written before bases had seeds give
    one seed per concept, which then stands for every seed."""

    def of(self, r: CellRates) -> CellRates:
        return self.get((r.concept, r.seed)) or self.first(r.concept)

    def first(self, concept: str) -> CellRates:
        return self[min(k for k in self if k[0] == concept)]

    def concepts(self) -> list[str]:
        return list(dict.fromkeys(c for c, _ in self))


def concept_overrides(concept: str) -> list[str]:
    """The overrides that pick ``concept``: a style of the tiny world is a concept of the
    ``tinyworld_style`` domain, a shape one of the default ``tinyworld`` domain."""
    return (["domain=tinyworld_style"] if concept in STYLES else []) + [f"concept={concept}"]


def evaluate_cell(method: str, concept: str, *, seed: int = 0, images_per_prompt: int | None = None,
                  cache_dir: str | Path, overrides: Sequence[str] = (), threads: int | None = None,
                  variants: bool = False) -> CellRates:
    """Run the cell ``method=<method> concept=<concept>`` (EA name + RA random only; with
    ``variants`` also EA on the variant prompts) and return its rates; a style runs in the
    ``tinyworld_style`` domain. ``images_per_prompt=None`` keeps the domain's default (10)."""
    from emma.cell import run_cell

    rates = VARIANT_OVERRIDES if variants else RATE_OVERRIDES
    ov = [f"method={method}", *concept_overrides(concept), f"seed={seed}", *rates,
          f"paths.cache_dir={cache_dir}"]
    if images_per_prompt is not None:
        ov.append(f"images_per_prompt={images_per_prompt}")
    if threads is not None:
        ov.append(f"threads={threads}")
    cfg = compose([*ov, *overrides])
    before = torch.get_num_threads()
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as out:
            result = run_cell(cfg, out)
    finally:
        used = torch.get_num_threads()
        torch.set_num_threads(before)  # run_cell sets threads= for the whole process
    wall = time.perf_counter() - t0
    m = result.metrics
    return CellRates(method=method, concept=concept, seed=seed, threads=used,
                     ea_name=m["ea/name"].value, ra_random=m["ra/random"].value, n_name=m["ea/name"].n,
                     n_random=m["ra/random"].n, unlearning_s=m["time/unlearning_s"].value, wall_s=wall,
                     method_config=result.versions["components"]["method"],
                     environment={k: result.versions[k] for k in ("libraries", "runtime")},
                     ea_variant=m["ea/variant"].value if variants else None,
                     n_variant=m["ea/variant"].n if variants else 0)


# ---------------------------------------------------------------------------- sample grid
def grid_prompts(concept: str) -> list[str]:
    """The sample grid's columns: the erased concept's name prompt x 4, two other concepts of
    its domain x 2."""
    if concept in STYLES:
        others = [c for c in ("striped", "dotted", "checkered") if c != concept][:2]
        return [f"a star in {c} style" for c in [concept] * 4 + [others[0]] * 2 + [others[1]] * 2]
    others = [c for c in ("crescent", "square", "triangle") if c != concept][:2]
    return [f"an image of a {c}" for c in [concept] * 4 + [others[0]] * 2 + [others[1]] * 2]


def sample_row(method: str, concept: str, cache_dir: str | Path, seed: int = 0) -> torch.Tensor:
    """One grid row (grid_prompts, seeds 0..7) drawn by the model ``method`` erases ``concept``
    from, through the cell's own stages (the erased model comes from the cache the evaluation
    filled; a missing or stale entry is erased again)."""
    from emma.cell import erased_cell

    ctx = erased_cell(compose([f"method={method}", *concept_overrides(concept), f"seed={seed}",
                               f"paths.cache_dir={cache_dir}"]))
    prompts = grid_prompts(concept)
    images = ctx.generator.generate(prompts, list(range(len(prompts)))).images
    return torch.cat(list(images.float().cpu()), dim=2)


def save_grid(rows: list[tuple[str, torch.Tensor]], path: Path, scale: int = 3) -> None:
    """Sample rows stacked (one per method, labelled on the left) as a PNG, written atomically."""
    from PIL import Image, ImageDraw

    grid = torch.cat([r for _, r in rows], dim=1).permute(1, 2, 0).numpy()
    grid = (grid * 255).round().clip(0, 255).astype("uint8")
    img = Image.fromarray(grid).resize((grid.shape[1] * scale, grid.shape[0] * scale), Image.NEAREST)
    label_w = 80
    canvas = Image.new("RGB", (img.width + label_w, img.height), "white")
    canvas.paste(img, (label_w, 0))
    draw = ImageDraw.Draw(canvas)
    for i, (name, _) in enumerate(rows):
        draw.text((6, i * 32 * scale + 32 * scale // 2 - 6), name, fill="black")
    tmp = path.with_suffix(".tmp.png")
    canvas.save(tmp)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- report
def summarize(rows: list[CellRates], base: Bases) -> dict[str, dict[str, Any]]:
    """Per method: mean and worst EA name, mean and worst RA random relative to the base
    model's RA on the same concept, the slowest unlearning, and whether every cell passes
    EA >= 0.8 and RA >= 0.8 x base."""
    out: dict[str, dict[str, Any]] = {}
    for method in dict.fromkeys(r.method for r in rows):
        rs = [r for r in rows if r.method == method]
        rel = [r.ra_random / base.of(r).ra_random for r in rs]
        worst_ea = min(rs, key=lambda r: r.ea_name)
        worst_ra = min(rs, key=lambda r: r.ra_random / base.of(r).ra_random)
        out[method] = {
            "ea_mean": sum(r.ea_name for r in rs) / len(rs), "ea_worst": worst_ea.ea_name,
            "ea_worst_concept": worst_ea.concept,
            "ra_mean": sum(r.ra_random for r in rs) / len(rs), "ra_worst": worst_ra.ra_random,
            "ra_worst_concept": worst_ra.concept, "ra_rel_worst": min(rel),
            "unlearning_max_s": max(r.unlearning_s for r in rs),
            "passes": all(r.ea_name >= 0.8 and r.ra_random >= 0.8 * base.of(r).ra_random for r in rs),
            "cells": len(rs),
        }
    return out


def preset_values(method: str, config: dict[str, Any]) -> dict[str, Any]:
    """The values a method's tiny-world preset sets (its own keys and those of the presets it
    extends): a literal as the preset writes it (a per-domain preset may replace it in a cell), an
    interpolation as the cell resolved it; a per-domain mapping reduced to the shape domain's
    entry when that is the only tiny-world domain it names, else kept whole."""
    from omegaconf import OmegaConf

    from emma import registry

    out: dict[str, Any] = {}
    for preset in registry.preset_chain("method", method, "tiny"):  # the preset's own first
        for k in preset:
            if k == "defaults" or k in out:
                continue
            literal = not OmegaConf.is_interpolation(preset, k) and not (
                OmegaConf.is_dict(preset[k]) or OmegaConf.is_list(preset[k]))
            v = preset[k] if literal else config.get(k)
            out[k] = v["tinyworld"] if isinstance(v, dict) and "tinyworld" in v and "tinyworld_style" not in v else v
    return out


def domain_presets(method: str, concepts: Sequence[str]) -> str:
    """The method's per-domain tiny presets (``conf/preset/method_domain/<method>_tiny_<domain>.yaml``)
    of the domains of ``concepts``, as the settings they add (empty when there are none)."""
    from omegaconf import OmegaConf

    from emma import registry

    out = []
    for domain in dict.fromkeys("tinyworld_style" if c in STYLES else "tinyworld" for c in concepts):
        chain = registry.preset_chain("method", method, "tiny", domain)
        if chain:
            values: dict[str, Any] = {}
            for node in chain:  # the preset's own keys over those of the presets it extends
                values = {**{k: v for k, v in OmegaConf.to_container(node).items() if k != "defaults"}, **values}
            out.append(f"; on {domain} also `conf/preset/method_domain/{method}_tiny_{domain}.yaml`: `"
                       f"{json.dumps(values, sort_keys=True)}`")
    return "".join(out)


def settings_line(method: str, config: dict[str, Any], concepts: Sequence[str]) -> str:
    """The page's line for a method's settings: its paper config, then the tiny-world preset files
    that apply (a method without one runs its paper settings on the tiny world, and says so)."""
    from emma import registry

    if not registry.preset_chain("method", method, "tiny"):
        head = f"- **{method}**: `conf/method/{method}.yaml` (no tiny-world preset: its own settings)"
    else:
        head = (f"- **{method}**: `conf/method/{method}.yaml` + `conf/preset/method/{method}_tiny.yaml`: `"
                + json.dumps(preset_values(method, config), sort_keys=True) + "`")
    return head + domain_presets(method, concepts)


def default_images_per_prompt() -> int:
    """The tiny-world domains' images per prompt (their domain configs, read through the
    registry); a ConfigError if the two domains disagree, since the page states one default."""
    from emma import registry
    from emma.errors import ConfigError

    counts = {int(registry.load("domain", name).images_per_prompt) for name in ("tinyworld", "tinyworld_style")}
    if len(counts) != 1:
        raise ConfigError(f"the tiny-world domains draw different images per prompt ({sorted(counts)}); "
                          "the methods page states one")
    return counts.pop()


def images_phrase(rows: Sequence[CellRates]) -> str:
    """"the domain's 10 images per prompt", or the rows' own count where it differs (the name
    prompt is one prompt, so a cell's name images are its images per prompt)."""
    default = default_images_per_prompt()
    own = sorted({r.n_name for r in rows})
    if not own or own == [default]:
        return f"the domain's {default} images per prompt"
    return f"{'/'.join(map(str, own))} images per prompt; the domain's default is {default}"


def pass_probability(n: int, rate: float, bar: float = 0.8) -> float:
    """Probability that ``n`` images of a model whose true EA is ``rate`` show EA >= ``bar``
    (exact binomial: at least ceil(bar * n) erased images)."""
    need = math.ceil(bar * n - 1e-9)
    return sum(math.comb(n, k) * rate**k * (1 - rate) ** (n - k) for k in range(need, n + 1))


def resolution(rows: Sequence[CellRates], bar: float = 0.8) -> str:
    """What the bar can tell from one cell's name images: the Wilson interval of an EA of 1.0 and
    of the bar itself, and how often cells of a method whose every true EA is 0.9 or 0.95 all pass.
    Empty without rows; several name-image counts are each described."""
    from emma.metrics.intervals import wilson_interval

    out = []
    for n in sorted({r.n_name for r in rows if r.n_name}):
        cells = max(sum(1 for r in rows if r.n_name == n and r.method == m)
                    for m in {r.method for r in rows})
        k_bar = math.ceil(bar * n - 1e-9)
        top, at = wilson_interval(n, n), wilson_interval(k_bar, n)
        confident = (f"no single cell shows EA >= {bar} with confidence," if top[0] < bar else
                     f"a cell shows EA >= {bar} with confidence only where its interval's lower end is "
                     f"at or above {bar},")
        odds = "; ".join(f"at {p:g}, one cell passes with probability {pass_probability(n, p, bar):.2f} "
                         f"and all {cells} together with {pass_probability(n, p, bar) ** cells:.2f}"
                         for p in (0.9, 0.95))
        out.append(f"With {n} name images a cell's EA is a count out of {n}: EA 1.00 has the 95% "
                   f"interval {top[0]:.2f}-{top[1]:.2f} (Wilson) and EA {k_bar / n:.2f} "
                   f"{at[0]:.2f}-{at[1]:.2f}, so {confident} and a pass or a miss by one image is within "
                   f"the noise. For a method whose true EA is the "
                   f"same in every cell: {odds}. A machine with other float rounding draws other "
                   "images, so cells near the bar can flip between machines.")
    return "\n\n".join(out)


def variant_section(rows: Sequence[CellRates], concepts: Sequence[str]) -> str:
    """EA on the variant prompts, per method and concept (the lowest over seeds), for the rows
    that measured it (``--variants``); empty when none did. Not part of the bar: it shows whether
    a preset that passes on the name also erases the concept's other names."""
    measured = [r for r in rows if r.ea_variant is not None]
    if not measured:
        return ""
    lines = ["| method | mean | " + " | ".join(concepts) + " |", "|---|---|" + "---|" * len(concepts)]
    for method in dict.fromkeys(r.method for r in measured):
        mine = [r for r in measured if r.method == method]
        by: dict[str, list[float]] = {}
        for r in mine:
            by.setdefault(r.concept, []).append(r.ea_variant)
        mean = sum(r.ea_variant for r in mine) / len(mine)
        lines.append(f"| {method} | {mean:.2f} | " + " | ".join(
            f"{min(by[c]):.2f}" if c in by else "–" for c in concepts) + " |")
    n = "/".join(str(k) for k in sorted({r.n_variant for r in measured}))
    return ("\n## EA on the variant prompts (not part of the bar; the lowest over seeds)\n\n"
            f"The domain's variant prompts (a shape's synonyms, \"disc\" for the circle; a style's other "
            f"words), {n} images per cell: an erasure that passes on the name but not here leaves the "
            "concept reachable by its other names.\n\n" + "\n".join(lines) + "\n")


def markdown(rows: list[CellRates], base: Bases, concepts: Sequence[str], command: str,
             grid_name: str | None, errors: Sequence[dict[str, Any]] = (), shared: bool = False,
             title: str = "Erasure methods on the tiny world", lead: str = "") -> str:
    """The page; ``shared``: its cells ran in several processes at once (``--report``); ``lead``:
    a paragraph under the title (what this selection of cells is)."""
    summary = summarize(rows, base)
    for e in errors:  # a method with a cell that could not run does not pass
        if e["method"] in summary:
            summary[e["method"]]["passes"] = False
    head = ("| method | cells | EA name mean | EA name worst | RA random mean | RA random worst (÷ base) "
            "| cells passing | max unlearning (s) |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for method, s in summary.items():
        rs = [r for r in rows if r.method == method]
        ok = sum(r.ea_name >= 0.8 and r.ra_random >= 0.8 * base.of(r).ra_random for r in rs)
        lines.append(f"| {method} | {s['cells']} | {s['ea_mean']:.2f} | "
                     f"{s['ea_worst']:.2f} ({s['ea_worst_concept']}) | "
                     f"{s['ra_mean']:.2f} | {s['ra_worst']:.2f} ({s['ra_worst_concept']}, {s['ra_rel_worst']:.2f}) | "
                     f"{ok} of {s['cells']}{'' if s['passes'] else ' (**no**)'} | {s['unlearning_max_s']:.1f} |")
    per = ["| method | " + " | ".join(concepts) + " |", "|---|" + "---|" * len(concepts)]
    per.append("| base (none), first seed | " + " | ".join(
        f"{base.first(c).ea_name:.2f} / {base.first(c).ra_random:.2f}" for c in concepts) + " |")
    for method in summary:  # the worst seed of each concept: lowest EA / lowest RA
        by: dict[str, list[CellRates]] = {}
        for r in rows:
            if r.method == method:
                by.setdefault(r.concept, []).append(r)
        per.append(f"| {method} | " + " | ".join(
            f"{min(r.ea_name for r in by[c]):.2f} / {min(r.ra_random for r in by[c]):.2f}" if c in by else "–"
            for c in concepts) + " |")
    def low_ea(r: CellRates) -> bool:
        return r.ea_name < 0.8

    def low_ra(r: CellRates) -> bool:
        return r.ra_random < 0.8 * base.of(r).ra_random

    failed = [r for r in rows if low_ea(r) or low_ra(r)]
    below = []
    for method in summary:  # one line per cell; a method failing in many cells gets one line
        mine = [r for r in failed if r.method == method]
        if len(mine) > LIST_FAILING_UP_TO:
            n_ea, n_ra = sum(map(low_ea, mine)), sum(map(low_ra, mine))
            where = (" (why: [methods_tinyworld_limits.md](methods_tinyworld_limits.md))"
                     if method in BELOW_THE_BAR else "")
            below.append(f"- {method}: {len(mine)} of {summary[method]['cells']} cells, {n_ea} on EA name and "
                         f"{n_ra} on RA random{where}")
            continue
        below += [f"- {r.method} / {r.concept} (seed {r.seed}): "
                  + ", ".join(x for x in (f"EA {r.ea_name:.2f} < 0.8" if low_ea(r) else "",
                                          f"RA {r.ra_random:.2f} < 0.8 x {base.of(r).ra_random:.2f}"
                                          if low_ra(r) else "") if x)
                  + (f" {FALLBACK_WHY}" if r.concept == FALLBACK_STYLE else "")
                  for r in mine]
    below += [f"- {e['method']} / {e['concept']} (seed {e['seed']}): stopped with an error: {e['error']}"
              for e in errors]
    failing = "\n".join(below) if below else "None: every cell passes."
    seeds = sorted({r.seed for r in rows})
    from emma import registry

    absent = [m for m in registry.choices("method") if m not in summary and m not in ("none", "checkpoint")]
    missing = (f"\nNot in this table (no cell measured for it): {', '.join(absent)}.\n" if absent else "")
    unseeded = sum((r.concept, r.seed) not in base for r in rows)
    if unseeded:  # said, not silently replaced: those cells' RA bar uses another seed's base
        missing += (f"\n{unseeded} cells have no base-model cell at their own seed; their RA is compared "
                    "with the base at the concept's first seed.\n")
    used = sorted({r.threads for r in rows})
    threads = (f"{'/'.join(map(str, used))} torch thread{'s' if used != [1] else ''} per cell" if used
               else f"{torch.get_num_threads()} CPU threads")
    counts = []  # "10 name images and 50 random-shape images" per domain in the table
    for kind, members in (("shape", [r for r in rows if r.concept not in STYLES]),
                          ("style", [r for r in rows if r.concept in STYLES])):
        if members:
            n_name = "/".join(str(n) for n in sorted({r.n_name for r in members}))
            n_random = "/".join(str(n) for n in sorted({r.n_random for r in members}))
            counts.append(f"{n_name} name images and {n_random} random-{kind} images per {kind} cell")
    presets = "\n".join(settings_line(m, next(r for r in rows if r.method == m).method_config,
                                       [r.concept for r in rows if r.method == m]) for m in summary)
    grid = (f"\nSamples (one row per method, erasing **{concepts[0]}**; columns: "
            f"{', '.join(repr(p) for p in dict.fromkeys(grid_prompts(concepts[0])))} as 4, 2 and 2 images; "
            f"seeds 0-7):\n\n![samples]({grid_name})\n" if grid_name else "")
    timing = ("; the cells of this table ran in several processes at once, so a time includes waiting for "
              "a core and times compare only roughly (scripts/bench_*.py measure speed)" if shared else "")
    lead = f"{lead.strip()}\n\n" if lead.strip() else ""
    variants_said = (" (and EA on the variant prompts, shown apart)"
                     if any(r.ea_variant is not None for r in rows) else "")
    ptypes = "name,random,variant" if variants_said else "name,random"
    return f"""# {title}

{lead}Each cell is `python -m emma.run method=M concept=C` with the shipped configs: the method's
paper defaults (`conf/method/M.yaml`) with its tiny-world preset (`conf/preset/method/M_tiny.yaml`,
and `conf/preset/method_domain/M_tiny_tinyworld_style.yaml` for a style where one exists),
chosen automatically because the default model is the tiny world; a style runs in the
`tinyworld_style` domain (`domain=tinyworld_style concept=C`). Only EA on the name prompt
and RA on random prompts of the other concepts are computed{variants_said}
(`metrics=rates_only prompt_types=[{ptypes}]`): {"; ".join(counts) or "no cells"}
({images_phrase(rows)}), drawn by the tiny world's sampler (Euler ancestral, 20 steps,
guidance 5) and judged by the domain's tiny-world classifier. EA = fraction of name-prompt images
where the erased concept is **not** found; RA = fraction of other-concept images where their
concept **is** found (EMMA's definitions). A method passes when every concept reaches EA ≥ 0.8
and RA ≥ 0.8 × the base model's RA on the same concept.
Seeds: {", ".join(map(str, seeds))}. Unlearning time is wall-clock `erase()` on this machine's CPU{timing}.

## Summary over {len(concepts)} concepts

{chr(10).join(lines)}
{missing}
## Cells below the bar (EA name >= 0.8, RA random >= 0.8 x base)

{failing}

{resolution(rows) or "No cells."}

## Per concept (EA name / RA random; with several seeds, the lowest of each)

{chr(10).join(per)}
{variant_section(rows, concepts)}{grid}
## Settings (resolved constructor arguments)

{presets}

Command: `{command}` — {time.strftime('%Y-%m-%d %H:%M %Z')}, torch {torch.__version__},
{threads}.
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--concepts", default=",".join(SHAPES),
                    help="comma-separated shapes and styles (a style runs in the tinyworld_style domain)")
    ap.add_argument("--seeds", default="0", help="comma-separated cell seeds (erasure and images)")
    ap.add_argument("--images-per-prompt", type=int, default=None, help="default: the domain's (10)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable)")
    ap.add_argument("--variants", action="store_true",
                    help="also EA on the domain's variant prompts (reported beside the bar, not part of it)")
    ap.add_argument("--cache", type=Path, default=ROOT / ".cache" / "eval-methods")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "methods_tinyworld.md")
    ap.add_argument("--json", type=Path, default=None, help="also write every cell's rates as JSON")
    ap.add_argument("--no-grid", action="store_true")
    ap.add_argument("--title", default="Erasure methods on the tiny world", help="the page's title")
    ap.add_argument("--lead", default="", help="a paragraph under the title: what this selection of cells is")
    ap.add_argument("--report", type=Path, nargs="+", default=None, metavar="JSON",
                    help="write the table from --json files of earlier runs (cells in their order) instead of "
                         "running cells; the grid is drawn from the cache")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)

    methods = [m for m in args.methods.split(",") if m]
    from emma import registry

    unknown = [m for m in methods if m not in registry.choices("method")]
    if unknown:
        valid = ", ".join(registry.choices("method"))
        ap.error(f"unknown method(s) {unknown}; valid: {valid}")
    concepts = [c for c in args.concepts.split(",") if c]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if args.report:
        base, cells, failed = Bases(), {}, {}
        for path in args.report:  # a later file's cell replaces an earlier one's
            data = json.loads(path.read_text())
            base.update({(b["concept"], b["seed"]): CellRates(**b) for b in data["base"]})
            for r in data["rows"]:
                cells[(r["method"], r["concept"], r["seed"])] = CellRates(**r)
                failed.pop((r["method"], r["concept"], r["seed"]), None)
            for e in data.get("errors", []):
                failed[(e["method"], e["concept"], e["seed"])] = e
                cells.pop((e["method"], e["concept"], e["seed"]), None)
        rows = list(cells.values())
        order = {m: i for i, m in enumerate(METHODS)}
        shape = {c: i for i, c in enumerate(SHAPES + STYLES)}
        rows.sort(key=lambda r: (order.get(r.method, len(order)), shape.get(r.concept, len(shape))))
        methods = list(dict.fromkeys(r.method for r in rows))
        known = base.concepts()
        concepts = [c for c in SHAPES + STYLES if c in known] + [c for c in known if c not in SHAPES + STYLES]
        seeds = sorted({r.seed for r in rows} | {e["seed"] for e in failed.values()})
        write_report(args, argv, rows, base, methods, concepts, seeds, list(failed.values()))
        return
    kw = dict(images_per_prompt=args.images_per_prompt, cache_dir=args.cache, threads=args.threads)
    base = Bases({(c, s): evaluate_cell("none", c, seed=s, **kw) for c in concepts for s in seeds})
    kw["variants"] = args.variants
    print("base: " + ", ".join(f"{c}/{s} {r.ea_name:.2f}/{r.ra_random:.2f}" for (c, s), r in base.items()), flush=True)
    from emma.errors import EmmaError

    rows: list[CellRates] = []
    errors: list[dict[str, Any]] = []
    for method in methods:
        for concept in concepts:
            for seed in seeds:
                try:
                    r = evaluate_cell(method, concept, seed=seed, overrides=args.override, **kw)
                except EmmaError as e:  # one cell that cannot run is a row of the report, not the end of the sweep
                    errors.append({"method": method, "concept": concept, "seed": seed, "error": str(e)})
                    print(f"{method:>9} {concept:>9} seed {seed}: ERROR {e}", flush=True)
                    if args.json:
                        write_json(args.json, base, rows, errors)
                    continue
                ok = r.ea_name >= 0.8 and r.ra_random >= 0.8 * base.of(r).ra_random
                variant = f"  EA variant {r.ea_variant:.2f}" if r.ea_variant is not None else ""
                print(f"{method:>9} {concept:>9} seed {seed}: EA name {r.ea_name:.2f}{variant}  "
                      f"RA random {r.ra_random:.2f} "
                      f"(base {base.of(r).ra_random:.2f})  unlearning {r.unlearning_s:.1f}s  "
                      f"cell {r.wall_s:.1f}s  {'ok' if ok else 'FAIL'}", flush=True)
                rows.append(r)
                if args.json:
                    write_json(args.json, base, rows, errors)
    write_report(args, argv, rows, base, methods, concepts, seeds, errors)


def write_json(path: Path, base: Bases, rows: list[CellRates], errors: list[dict[str, Any]]) -> None:
    """Every cell so far (and every cell that stopped with an error), written atomically."""
    from emma.files import atomic_write_text

    atomic_write_text(path, json.dumps({"base": [asdict(b) for b in base.values()],
                                        "rows": [asdict(x) for x in rows], "errors": errors}, indent=1))


def write_report(args: argparse.Namespace, argv: list[str] | None, rows: list[CellRates],
                 base: Bases, methods: list[str], concepts: list[str], seeds: list[int],
                 errors: Sequence[dict[str, Any]] = ()) -> None:
    if str(args.out) == os.devnull:
        return
    grid_name = None
    if not args.no_grid:
        grid_rows = [("base", sample_row("none", concepts[0], args.cache))]
        grid_rows += [(m, sample_row(m, concepts[0], args.cache, seeds[0])) for m in methods]
        grid = args.out.with_suffix(".png")
        save_grid(grid_rows, grid)
        grid_name = grid.name
    if args.report:  # the cells came from earlier runs: name the run that reproduces them
        own = sorted({r.n_name for r in rows})
        ipp = f" --images-per-prompt {own[0]}" if len(own) == 1 and own[0] != default_images_per_prompt() else ""
        measured = list(dict.fromkeys(r.concept for r in rows))
        cset = "" if measured == list(SHAPES) else f" --concepts {','.join(c for c in concepts if c in measured)}"
        sset = "" if seeds == [0] else f" --seeds {','.join(map(str, seeds))}"
        var = " --variants" if any(r.ea_variant is not None for r in rows) else ""
        command = (f"python scripts/eval_methods_tinyworld.py --methods {','.join(methods)}{cset}{sset} --threads "
                   f"{rows[0].threads if rows else 1}{ipp}{var}  (cells run in several processes sharing one "
                   f"cache, table assembled with --report)")
    else:
        given = argv if argv is not None else sys.argv[1:]
        command = ("python scripts/eval_methods_tinyworld.py " + " ".join(given)).strip()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(rows, base, concepts, command, grid_name, errors, shared=bool(args.report),
                                         title=args.title, lead=args.lead))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
