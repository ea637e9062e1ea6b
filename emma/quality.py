"""The cell's image-quality and bias stages (EMMA metrics 10-12).

* **FID** of the erased model's suite images (EA + RA prompts, as EMMA) against a reference
  set: on the tiny world, procedurally rendered scenes in the tiny-world judge's feature
  space; elsewhere clean-fid's Inception features against cached COCO statistics.
* **Bias** ``B_a = s(I_n, I_ref) - s(I_n, I_a)`` for the base and the erased model and its
  change (see :mod:`emma.metrics.bias`). EMMA's sets are gender (male reference) and
  ethnicity (White reference). The tiny world has no people; its set is *colour*: neutral
  "an image of a star" vs "an image of a red star" (reference) and "... blue star", with
  SSIM and the tiny-world judge's features as the two similarities.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from emma.api.types import PromptRequest
from emma.datasets.bias import SEED_STRIDE, BiasPromptSet, bias_prompt_set
from emma.errors import ConfigError
from emma.generate import CachedGenerator
from emma.metrics.base import MetricValue
from emma.metrics.bias import PAIRED, PAIRINGS, CLIPSimilarity, SSIMSimilarity, compare_bias, compare_bias_paired
from emma.tinyworld import world

TINYWORLD_DOMAINS = ("tinyworld", "tinyworld_style")


def tinyworld_colour_bias_set(reference: str = "red", compared: Sequence[str] = ("blue",),
                              seed: int = 0) -> BiasPromptSet:
    """Neutral "an image of a <shape>" vs coloured versions, over the 8 shapes."""
    groups = {"neutral": tuple(world.with_template("an image of a {x}", s) for s in world.SHAPES)}
    for colour in (reference, *compared):
        groups[colour] = tuple(world.with_template("an image of a {x}", f"{colour} {s}") for s in world.SHAPES)
    seeds = tuple(seed + i * SEED_STRIDE for i in range(len(world.SHAPES)))
    return BiasPromptSet("colour", reference, groups, seeds)


def bias_sets(domain_name: str, attributes: Sequence[str] | None, seed: int) -> list[BiasPromptSet]:
    if attributes is None:
        attributes = ["colour"] if domain_name in TINYWORLD_DOMAINS else ["gender", "ethnicity"]
    return [tinyworld_colour_bias_set(seed=seed) if a == "colour" else bias_prompt_set(a, seed=seed)
            for a in attributes]


def render_groups(generator: CachedGenerator, bias_set: BiasPromptSet, images_per_prompt: int,
                  progress: str) -> dict[str, torch.Tensor]:
    """Images of every group of ``bias_set`` (aligned seeds across groups)."""
    out: dict[str, torch.Tensor] = {}
    for group, prompts in bias_set.groups.items():
        texts, seeds = [], []
        for prompt, seed in zip(prompts, bias_set.seeds):
            req = PromptRequest(prompt=prompt, concept=group, group="bias", kind=group, seed=seed,
                                n_images=images_per_prompt)
            texts += [prompt] * images_per_prompt
            seeds += req.seeds()
        out[group] = generator.generate(texts, seeds, progress=f"{progress} {group}").images
    return out


def similarities(domain_name: str, judge: Any, notes: list[str]) -> list[Any]:
    """SSIM plus an embedding cosine: the tiny-world judge's features, or CLIP."""
    from emma.errors import WeightsUnavailableError

    sims: list[Any] = [SSIMSimilarity()]
    if domain_name in TINYWORLD_DOMAINS and hasattr(judge, "features"):
        sims.append(CLIPSimilarity(judge.features, name="features"))
        return sims
    try:
        from classifiers.clip_zero_shot import CLIPZeroShotClassifier

        clip = CLIPZeroShotClassifier()
        sims.append(CLIPSimilarity(clip.embed_images, name="clip"))
    except (WeightsUnavailableError, ImportError) as err:  # weights or package absent: report, keep SSIM
        notes.append(f"bias: CLIP similarity skipped ({type(err).__name__}: {str(err).splitlines()[0]})")
    return sims


def bias_metrics(base: dict[str, dict[str, torch.Tensor]], erased: dict[str, dict[str, torch.Tensor]],
                 sets: Sequence[BiasPromptSet], sims: Sequence[Any], n_resamples: int,
                 seed: int, pairing: str = PAIRED, images_per_prompt: int = 1) -> dict[str, MetricValue]:
    """``bias/<attribute>/<group>/<similarity>/{base,erased,amplification,change}``.

    Args:
        pairing: ``paired`` (image i of every set shares prompt index and seed; the default)
            or ``all_pairs`` (mean over all neutral x group pairs); docs/metrics.md.
        images_per_prompt: images per prompt index (consecutive in each set): one cluster.
    """
    if pairing not in PAIRINGS:
        raise ConfigError(f"metrics.bias.pairing={pairing!r}; valid: {', '.join(PAIRINGS)}")
    out: dict[str, MetricValue] = {}
    for bset in sets:
        b, e = base[bset.attribute], erased[bset.attribute]
        for group in bset.compared:
            for sim in sims:
                name = getattr(sim, "name", type(sim).__name__.lower())
                sb = {"neutral": b["neutral"], "reference": b[bset.reference], "attribute": b[group]}
                se = {"neutral": e["neutral"], "reference": e[bset.reference], "attribute": e[group]}
                if pairing == PAIRED:
                    clusters = [i // images_per_prompt for i in range(len(sb["neutral"]))]
                    cmp = compare_bias_paired(sb, se, sim, clusters, n_resamples=n_resamples, seed=seed)
                else:
                    cmp = compare_bias(sb, se, sim, n_resamples=n_resamples, seed=seed)
                for part in ("base", "erased", "amplification", "change"):
                    out[f"bias/{bset.attribute}/{group}/{name}/{part}"] = getattr(cmp, part)
    return out


def bias_sample_lines(images: dict[str, dict[str, torch.Tensor]], sets: Sequence[BiasPromptSet],
                      images_per_prompt: int, model: str) -> list[dict[str, Any]]:
    """samples.jsonl lines of the bias images (``group: bias``), so bias can be recomputed
    from the lines and the cached images."""
    from emma.cache import pixel_hash, to_uint8

    lines = []
    for bset in sets:
        for group, prompts in bset.groups.items():
            arr = to_uint8(images[bset.attribute][group])
            for i, a in enumerate(arr):
                p = i // images_per_prompt
                lines.append({"group": "bias", "model": model, "attribute": bset.attribute, "kind": group,
                              "prompt": prompts[p], "prompt_index": p,
                              "seed": bset.seeds[p] + i % images_per_prompt, "image_hash": pixel_hash(a)})
    return lines


def tinyworld_reference(judge: Any, concepts: Sequence[str], n_ref: int, seed: int,
                        cache_root: str | Path) -> Any:
    """Statistics, in the judge's feature space, of scenes rendered with the suite's own
    prompt mix: scene ``i`` draws colour, style, position and background from
    ``sample_specs(n, seed)`` and takes its shape (or style) from suite image
    ``i mod len(concepts)``; ``n`` is the smallest multiple of the suite size >= ``n_ref``.
    A faithful model therefore scores near the floor, and erasing a shape shows as a rise.
    Cached under the cell's cache root by (judge, renderer version, concepts, n, seed)."""
    import dataclasses

    from emma.cache import stable_hash
    from emma.metrics.fid import ReferenceStatistics, reference_statistics_path

    concepts = list(concepts)
    n = len(concepts) * -(-int(n_ref) // len(concepts))
    key = stable_hash({"judge": judge.cache_key(), "world": world.WORLD_VERSION, "n": n, "seed": seed,
                       "concepts": concepts})
    path = reference_statistics_path(f"tinyworld-suite-mix-{key[:16]}", "tinyworld-judge-features", cache_root)
    if path.exists():
        from emma.cache import quarantine
        from emma.metrics.fid import DamagedStatisticsError

        try:
            return ReferenceStatistics.load(path, require_checksum=True, key=key)
        except DamagedStatisticsError as err:  # rendered references: recompute them
            quarantine(path, cache_root, "fid_statistics", err.reason)
    specs = []
    for i, spec in enumerate(world.sample_specs(n, seed)):
        c = concepts[i % len(concepts)]
        if c in world.SHAPES:
            spec = dataclasses.replace(spec, shape=c)
        elif c in world.STYLES:
            spec = dataclasses.replace(spec, style=c)
        specs.append(spec)
    refs = torch.from_numpy(world.render_batch(specs))
    stats = ReferenceStatistics.from_features(judge.features(refs).double().numpy(), name="tinyworld-suite-mix",
                                              extractor=f"tinyworld-judge-features:{judge.cache_key()}")
    stats.key = key
    stats.save(path)
    return stats


def fid_metric(domain_name: str, images: torch.Tensor, clusters: Sequence[Any], concepts: Sequence[str],
               judge: Any, cfg: Any, notes: list[str], cache_root: str | Path, seed: int = 0,
               ) -> tuple[MetricValue | None, dict[str, Any]]:
    """FID of ``images`` (one cluster id per image: its prompt) with a cluster-bootstrap
    interval, and the record of the reference used; ``(None, {})`` with a note where the
    reference statistics or the Inception weights are not available here."""
    from emma.errors import WeightsUnavailableError
    from emma.metrics.fid import CleanFIDInception, ReferenceUnavailableError, fid_with_interval, reference_statistics

    n_boot = int(cfg.get("n_bootstrap", 200))
    if domain_name in TINYWORLD_DOMAINS and hasattr(judge, "features"):
        ref = tinyworld_reference(judge, concepts, int(cfg.n_ref), int(cfg.reference_seed), cache_root)
        feats = judge.features(images).double().numpy()
    else:
        try:
            ref = reference_statistics(cfg.reference, root=cache_root)
            feats = CleanFIDInception()(images).double().numpy()
        except (ReferenceUnavailableError, WeightsUnavailableError) as err:
            notes.append(f"fid skipped: {str(err).splitlines()[0]}")
            return None, {}
    return fid_with_interval(feats, clusters, ref.mu, ref.sigma, n_resamples=n_boot, seed=seed), ref.describe()
