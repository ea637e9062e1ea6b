"""The cell's image-quality and bias stages (EMMA metrics 10-12).

* **FID** of the erased model's suite images (EA + RA prompts, as EMMA) against a reference
  set: for a domain that renders its own references (the tiny world), those scenes in its
  judge's feature space; elsewhere clean-fid's Inception features against cached COCO
  statistics. What a domain offers these stages is part of its API
  (:class:`~emma.api.domain.Domain`: ``bias_attributes``, ``bias_prompt_set``,
  ``reference_images``).
* **Bias** ``B_a = s(I_n, I_ref) - s(I_n, I_a)`` for the base and the erased model and its
  change (see :mod:`emma.metrics.bias`). EMMA's sets are gender (male reference) and
  ethnicity (White reference). The tiny world has no people; its set is *colour*: neutral
  "an image of a star" vs "an image of a red star" (reference) and "... blue star", with
  SSIM and the tiny-world judge's features as the two similarities. Elsewhere the second
  similarity is the embedding ``metrics.bias.similarity`` binds (CLIP's image tower).

This module reaches judges through the Classifier role only (``has_features``, ``features``);
the embedding comes from the configuration, not from an import of an implementation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from emma.api.classifier import Classifier
from emma.api.domain import Domain
from emma.api.types import PromptRequest
from emma.datasets.bias import BiasPromptSet
from emma.errors import ConfigError
from emma.generate import CachedGenerator
from emma.metrics.base import MetricValue
from emma.metrics.bias import PAIRED, PAIRINGS, CLIPSimilarity, SSIMSimilarity, compare_bias, compare_bias_paired


def bias_sets(domain: Domain, attributes: Sequence[str] | None, seed: int) -> list[BiasPromptSet]:
    """The bias prompt sets of ``attributes`` (null: the domain's own, e.g. colour on the tiny world)."""
    chosen = domain.bias_attributes if attributes is None else attributes
    return [domain.bias_prompt_set(a, seed=seed) for a in chosen]


def judged_in_feature_space(domain: Domain, judge: Classifier) -> bool:
    """A domain that renders its own references (the tiny world) is compared in its judge's
    feature space, where no Inception or CLIP weights exist."""
    return bool(domain.reference_name) and judge.has_features


def render_groups(generator: CachedGenerator, bias_set: BiasPromptSet, images_per_prompt: int,
                  progress: str) -> dict[str, torch.Tensor]:
    """Images of every group of ``bias_set`` (aligned seeds across groups)."""
    out: dict[str, torch.Tensor] = {}
    for group, prompts in bias_set.groups.items():
        texts, seeds = [], []
        for i, prompt in enumerate(prompts):
            req = PromptRequest(prompt=prompt, concept=group, group="bias", kind=group, seed=bias_set.seed,
                                n_images=images_per_prompt, seed_key=bias_set.seed_key(i))
            texts += [prompt] * images_per_prompt
            seeds += req.seeds()
        out[group] = generator.generate(texts, seeds, progress=f"{progress} {group}").images
    return out


def similarities(domain: Domain, judge: Classifier, notes: list[str], similarity: Any = None) -> list[Any]:
    """SSIM plus an embedding cosine: the judge's own features where the domain is judged in
    them (the tiny world), else the embedding ``similarity`` binds.

    Args:
        similarity: ``metrics.bias.similarity``: ``{name, embedding}``, ``embedding`` a
            ``_target_`` that returns a function ``images -> (N, D)``, ``name`` the
            similarity's name in the metric keys (``clip``); ``None``: SSIM only.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from emma.errors import WeightsUnavailableError

    sims: list[Any] = [SSIMSimilarity()]
    if judged_in_feature_space(domain, judge):
        sims.append(CLIPSimilarity(judge.features, name="features"))
        return sims
    if similarity is None:
        return sims
    name = str(similarity["name"])
    try:
        embed = instantiate(similarity["embedding"])
    except (InstantiationException, WeightsUnavailableError, ImportError) as err:
        cause = err.__cause__ if isinstance(err, InstantiationException) else err  # Hydra wraps the target's error
        if not isinstance(cause, (WeightsUnavailableError, ImportError)):
            raise
        # weights or package absent: report, keep SSIM
        notes.append(f"bias: {name} similarity skipped ({type(cause).__name__}: {str(cause).splitlines()[0]})")
        return sims
    sims.append(CLIPSimilarity(embed, name=name))
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
                name = sim.name
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
        seeds = [bset.image_seeds(p, images_per_prompt) for p in range(len(bset))]
        for group, prompts in bset.groups.items():
            arr = to_uint8(images[bset.attribute][group])
            for i, a in enumerate(arr):
                p = i // images_per_prompt
                lines.append({"group": "bias", "model": model, "attribute": bset.attribute, "kind": group,
                              "prompt": prompts[p], "prompt_index": p,
                              "seed": seeds[p][i % images_per_prompt], "image_hash": pixel_hash(a)})
    return lines


def rendered_reference(domain: Domain, judge: Any, concepts: Sequence[str], n_ref: int, seed: int,
                       cache_root: str | Path) -> Any:
    """Statistics, in the judge's feature space, of references the domain renders with the
    suite's own prompt mix: reference ``i`` takes its concept from suite image
    ``i mod len(concepts)`` (:meth:`~emma.api.domain.Domain.reference_images`); ``n`` is the
    smallest multiple of the suite size >= ``n_ref``. A faithful model therefore scores near
    the floor, and erasing a concept shows as a rise. Cached under the cell's cache root by
    (judge, renderer version, concepts, n, seed)."""
    from emma.cache import stable_hash
    from emma.metrics.fid import ReferenceStatistics, reference_statistics_path

    concepts = list(concepts)
    n = len(concepts) * -(-int(n_ref) // len(concepts))
    name = f"{domain.reference_name}-suite-mix"
    key = stable_hash({"judge": judge.cache_key(), "world": domain.reference_version(), "n": n, "seed": seed,
                       "concepts": concepts})
    path = reference_statistics_path(f"{name}-{key[:16]}", f"{domain.reference_name}-judge-features", cache_root)
    if path.exists():
        from emma.cache import quarantine
        from emma.metrics.fid import DamagedStatisticsError

        try:
            return ReferenceStatistics.load(path, require_checksum=True, key=key)
        except DamagedStatisticsError as err:  # rendered references: recompute them
            quarantine(path, cache_root, "fid_statistics", err.reason)
    refs = domain.reference_images([concepts[i % len(concepts)] for i in range(n)], n, seed)
    stats = ReferenceStatistics.from_features(judge.features(refs).double().numpy(), name=name,
                                              extractor=f"{domain.reference_name}-judge-features:{judge.cache_key()}")
    stats.key = key
    stats.save(path)
    return stats


def fid_metric(domain: Domain, images: torch.Tensor, clusters: Sequence[Any], concepts: Sequence[str],
               judge: Any, cfg: Any, notes: list[str], cache_root: str | Path, seed: int = 0,
               ) -> tuple[MetricValue | None, dict[str, Any]]:
    """FID of ``images`` (one cluster id per image: its prompt) with a cluster-bootstrap
    interval, and the record of the reference used; ``(None, {})`` with a note where the
    reference statistics or the Inception weights are not available here."""
    from emma.errors import WeightsUnavailableError
    from emma.metrics.fid import CleanFIDInception, ReferenceUnavailableError, fid_with_interval, reference_statistics

    n_boot = int(cfg.get("n_bootstrap", 200))
    if judged_in_feature_space(domain, judge):
        ref = rendered_reference(domain, judge, concepts, int(cfg.n_ref), int(cfg.reference_seed), cache_root)
        feats = judge.features(images).double().numpy()
    else:
        try:
            ref = reference_statistics(cfg.reference, root=cache_root)
            feats = CleanFIDInception()(images).double().numpy()
        except (ReferenceUnavailableError, WeightsUnavailableError) as err:
            notes.append(f"fid skipped: {str(err).splitlines()[0]}")
            return None, {}
    return fid_with_interval(feats, clusters, ref.mu, ref.sigma, n_resamples=n_boot, seed=seed), ref.describe()
