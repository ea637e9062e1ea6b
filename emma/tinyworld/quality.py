"""How well the tiny world's base model draws what it is asked for.

For each shape and prompt type (EMMA's name / variant / short / long, from the tiny-world
domain's own suite) and for each style, the fraction of generated images in which the
tiny-world judge finds the asked-for concept. Used by ``scripts/eval_tinyworld.py`` (model
card) and by the tests (looser floors on a small sample).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from emma.cache import ImageCache
from emma.domains.tinyworld import tinyworld_domain
from emma.evaluate import judge_requests
from emma.generate import CachedGenerator, GenerationTarget, Judge
from emma.pipelines import fingerprint, load_pipeline


@dataclasses.dataclass
class WorldQuality:
    """Detection rates: ``shapes[shape][type]``, ``styles[style]``, plus sample counts."""

    shapes: dict[str, dict[str, float]]
    styles: dict[str, float]
    n_images: dict[str, int]

    def worst(self, kind: str) -> float:
        return min(v[kind] for v in self.shapes.values() if kind in v)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def make_target(pipeline_dir: str | Path | None, classifier: Any, cache_dir: str | Path,
                steps: int = 20, guidance: float = 5.0, batch_size: int = 64) -> GenerationTarget:
    """The pipeline in ``pipeline_dir`` (the shipped tiny world when ``None``) drawing at the
    model card's sampler settings, judged by ``classifier``, its images and scores cached in
    ``cache_dir``."""
    cfg = {"kind": "tinyworld", "pretrained": str(pipeline_dir) if pipeline_dir else None,
           "dtype": "float32", "device": "cpu"}
    return target_for(load_pipeline(cfg), classifier, cache_dir, steps, guidance, batch_size)


def target_for(pipe: Any, classifier: Any, cache_dir: str | Path, steps: int = 20, guidance: float = 5.0,
               batch_size: int = 64) -> GenerationTarget:
    """:func:`make_target` for a pipeline already loaded (an erased one, say)."""
    gen = CachedGenerator(pipe, fingerprint(pipe), ImageCache(cache_dir), num_inference_steps=steps,
                          guidance_scale=guidance, height=32, width=32, batch_size=batch_size)
    from emma.cache import ScoreCache

    return GenerationTarget(gen, Judge(classifier, ScoreCache(cache_dir, classifier.cache_key())))


def _rate(samples) -> float:
    return float(np.mean([s.detected for s in samples])) if samples else float("nan")


def evaluate_world(
    target: GenerationTarget,
    *,
    shapes: Sequence[str] | None = None,
    styles: Sequence[str] | None = None,
    n_name: int = 40,
    n_other: int = 10,
    seed: int = 1000,
    progress: bool = False,
) -> WorldQuality:
    """Detection rates of the base model.

    Args:
        target: the pipeline behind a cached generator and the tiny-world judge.
        shapes / styles: which concepts (default: all).
        n_name: images of the single name prompt per concept.
        n_other: images per variant / short / long prompt.
        seed: first seed (different from the harness's default 0, so that the card is not
            measured on the images a default cell renders).
    """
    shape_dom = tinyworld_domain()
    style_dom = tinyworld_domain(name="tinyworld_style", kind="style")
    shapes = list(shapes or shape_dom.concepts)
    styles = list(styles or style_dom.concepts)
    requests = []
    for c in shapes:
        requests += shape_dom.requests(c, seed=seed, images_per_prompt=n_name, types=["name"])
        requests += shape_dom.requests(c, seed=seed, images_per_prompt=n_other,
                                       types=["variant", "short", "long"])
    for c in styles:
        requests += style_dom.requests(c, seed=seed, images_per_prompt=n_name, types=["name"])
    per_request = judge_requests(target, requests, progress="tiny-world quality" if progress else False)
    by: dict[tuple[str, str], list] = {}
    for req, samples in zip(requests, per_request):
        by.setdefault((req.concept, req.kind), []).extend(samples)
    shape_rates = {c: {k: _rate(by.get((c, k), [])) for k in ("name", "variant", "short", "long")}
                   for c in shapes}
    style_rates = {c: _rate(by.get((c, "name"), [])) for c in styles}
    counts = {"images": sum(len(s) for s in per_request), "name_per_concept": n_name,
              "per_other_prompt": n_other}
    return WorldQuality(shapes=shape_rates, styles=style_rates, n_images=counts)


def name_rates(target: GenerationTarget, *, shapes: Sequence[str] | None = None, n: int = 40,
               seed: int = 1000) -> dict[str, float]:
    """Per shape, the fraction of ``n`` images of its name prompt in which the judge finds it."""
    dom = tinyworld_domain()
    shapes = list(shapes or dom.concepts)
    requests = [r for c in shapes for r in dom.requests(c, seed=seed, images_per_prompt=n, types=["name"])]
    per_request = judge_requests(target, requests)
    by: dict[str, list] = {}
    for req, samples in zip(requests, per_request):
        by.setdefault(req.concept, []).extend(samples)
    return {c: _rate(by.get(c, [])) for c in shapes}


@torch.no_grad()
def sample_grid(target: GenerationTarget, concepts: Sequence[str], prompts: Sequence[str],
                n: int = 8, seed: int = 0, scale: int = 3) -> np.ndarray:
    """One row per concept of ``n`` images of its prompt; uint8 (H, W, 3), upscaled."""
    rows = []
    for prompt in prompts:
        imgs = target.generate([prompt] * n, list(range(seed, seed + n))).images
        rows.append(torch.cat(list(imgs), dim=2))
    grid = torch.cat(rows, dim=1)
    arr = (grid.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    return arr.repeat(scale, axis=0).repeat(scale, axis=1)
