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

from typing import Any, Sequence

import torch

from emma.api.types import PromptRequest
from emma.datasets.bias import SEED_STRIDE, BiasPromptSet, bias_prompt_set
from emma.generate import CachedGenerator
from emma.metrics.base import MetricValue
from emma.metrics.bias import CLIPSimilarity, SSIMSimilarity, compare_bias
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
    sims: list[Any] = [SSIMSimilarity()]
    if domain_name in TINYWORLD_DOMAINS and hasattr(judge, "features"):
        sims.append(CLIPSimilarity(judge.features, name="features"))
        return sims
    try:
        from classifiers.clip_zero_shot import CLIPZeroShotClassifier

        clip = CLIPZeroShotClassifier()
        sims.append(CLIPSimilarity(clip.embed_images, name="clip"))
    except Exception as err:  # weights absent offline: report, keep SSIM
        notes.append(f"bias: CLIP similarity skipped ({type(err).__name__}: {str(err).splitlines()[0]})")
    return sims


def bias_metrics(base: dict[str, dict[str, torch.Tensor]], erased: dict[str, dict[str, torch.Tensor]],
                 sets: Sequence[BiasPromptSet], sims: Sequence[Any], n_resamples: int,
                 seed: int) -> dict[str, MetricValue]:
    """``bias/<attribute>/<group>/<similarity>/{base,erased,amplification,change}``."""
    out: dict[str, MetricValue] = {}
    for bset in sets:
        b, e = base[bset.attribute], erased[bset.attribute]
        for group in bset.compared:
            for sim in sims:
                name = getattr(sim, "name", type(sim).__name__.lower())
                cmp = compare_bias(
                    {"neutral": b["neutral"], "reference": b[bset.reference], "attribute": b[group]},
                    {"neutral": e["neutral"], "reference": e[bset.reference], "attribute": e[group]},
                    sim, n_resamples=n_resamples, seed=seed,
                )
                for part in ("base", "erased", "amplification", "change"):
                    out[f"bias/{bset.attribute}/{group}/{name}/{part}"] = getattr(cmp, part)
    return out


def tinyworld_reference(judge: Any, n_ref: int, seed: int) -> Any:
    """Statistics of ``n_ref`` rendered scenes in the judge's feature space, cached by
    (judge weights, renderer version, n_ref, seed): the same reference for every cell."""
    from emma.cache import stable_hash
    from emma.metrics.fid import ReferenceStatistics, reference_statistics_path

    key = stable_hash({"judge": judge.cache_key(), "world": world.WORLD_VERSION, "n": n_ref, "seed": seed})
    path = reference_statistics_path(f"tinyworld-{key[:16]}", "tinyworld-judge-features")
    if path.exists():
        return ReferenceStatistics.load(path)
    refs = torch.from_numpy(world.render_batch(world.sample_specs(n_ref, seed)))
    stats = ReferenceStatistics.from_features(judge.features(refs).double().numpy(), name="tinyworld",
                                              extractor="tinyworld-judge-features")
    stats.save(path)
    return stats


def fid_metric(domain_name: str, images: torch.Tensor, judge: Any, cfg: Any, notes: list[str]) -> MetricValue | None:
    """FID of ``images``; ``None`` (with a note) where the reference cannot be had here."""
    if domain_name in TINYWORLD_DOMAINS and hasattr(judge, "features"):
        from emma.metrics.fid import FrechetDistance

        metric = FrechetDistance(feature_extractor=judge.features,
                                 reference=tinyworld_reference(judge, int(cfg.n_ref), int(cfg.reference_seed)))
        metric.update(images)
        return metric.compute()
    try:
        from emma.metrics.fid import CleanFIDInception, FrechetDistance, reference_statistics

        metric = FrechetDistance(feature_extractor=CleanFIDInception(),
                                 reference=reference_statistics(cfg.reference))
        metric.update(images)
        return metric.compute()
    except Exception as err:  # Inception weights or COCO statistics absent: report, go on
        notes.append(f"fid skipped: {type(err).__name__}: {str(err).splitlines()[0]}")
        return None
