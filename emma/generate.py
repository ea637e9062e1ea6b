"""Seeded, batched, content-addressed image generation and judging.

Each image has its own ``torch.Generator`` (made on the CPU), so an image depends only on
(model fingerprint, prompt or embeddings, negative prompt, seed, scheduler, steps, guidance,
size) — never on which other images share its batch — and is cached under the sha256 of
exactly those. Images are stored and returned as 8-bit values, so a cached image and a
fresh one are the same tensor.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from emma.api.classifier import Classifier
from emma.api.guidance import InferenceGuidance
from emma.api.types import GeneratedImages
from emma.cache import ImageCache, ScoreCache, from_uint8, pixel_hash, stable_hash, tensor_hash, to_uint8
from emma.errors import NonFiniteError


class CachedGenerator:
    """Generates images with a diffusers pipeline through an :class:`ImageCache`.

    Args:
        pipe: a diffusers text-to-image pipeline.
        model_fingerprint: sha256 of the pipeline's weights (:func:`emma.pipelines.fingerprint`).
        cache: the image cache.
        num_inference_steps / guidance_scale / height / width: sampler settings.
        batch_size: images per pipeline call.
        negative_prompt: default negative prompt.
        guidance: an inference-time guidance (SLD) that draws every image instead of the
            pipeline's own loop; it is part of the image cache key.
    """

    def __init__(
        self,
        pipe: Any,
        model_fingerprint: str,
        cache: ImageCache,
        *,
        num_inference_steps: int,
        guidance_scale: float,
        height: int,
        width: int,
        batch_size: int = 8,
        negative_prompt: str | None = None,
        guidance: InferenceGuidance | None = None,
    ) -> None:
        self.pipe = pipe
        self.guidance = guidance
        self.model_fingerprint = model_fingerprint
        self.cache = cache
        self.num_inference_steps = int(num_inference_steps)
        self.guidance_scale = float(guidance_scale)
        self.height, self.width = int(height), int(width)
        self.batch_size = int(batch_size)
        self.negative_prompt = negative_prompt
        self.images_generated = 0
        self.images_cached = 0
        self.generation_seconds = 0.0
        self.batches_run = 0
        # image key -> timing record of every image served (stored with the image; cached
        # images replay the record of the run that generated them)
        self.records: dict[str, dict[str, Any] | None] = {}
        self._machine: str | None = None

    @property
    def machine(self) -> str:
        if self._machine is None:
            from emma.metrics.timing import machine_description

            self._machine = machine_description(getattr(self.pipe, "device", "cpu"))
        return self._machine

    def settings(self) -> dict[str, Any]:
        sched = self.pipe.scheduler
        out = {
            "scheduler": type(sched).__name__,
            "scheduler_config": {k: v for k, v in dict(sched.config).items() if not k.startswith("_")},
            "num_inference_steps": self.num_inference_steps,
            "guidance_scale": self.guidance_scale,
            "height": self.height,
            "width": self.width,
        }
        if self.guidance is not None:  # absent otherwise, so plain sampling keeps its keys
            out["inference_guidance"] = self.guidance.config()
        return out

    def with_sampler(self, *, guidance_scale: float, num_inference_steps: int) -> CachedGenerator:
        """The same model, cache and settings (inference guidance included) at another
        guidance scale and step count; its own counters."""
        return CachedGenerator(self.pipe, self.model_fingerprint, self.cache,
                               num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                               height=self.height, width=self.width, batch_size=self.batch_size,
                               negative_prompt=self.negative_prompt, guidance=self.guidance)

    def image_key(self, prompt_id: str, seed: int, negative_prompt: str | None) -> str:
        """sha256 of everything that determines the image."""
        return stable_hash({"sampler": self._settings_hash(), "prompt": prompt_id,
                            "negative_prompt": negative_prompt, "seed": int(seed)})

    def _settings_hash(self) -> str:
        # model + sampler settings, hashed once per scheduler state
        state = (id(self.pipe.scheduler), self.model_fingerprint, self.num_inference_steps,
                 self.guidance_scale, self.height, self.width)
        if getattr(self, "_settings_state", None) != state:
            self._settings_state = state
            self._settings_digest = stable_hash({"model": self.model_fingerprint, **self.settings()})
        return self._settings_digest

    def generate(
        self,
        prompts: Sequence[str] | None = None,
        seeds: Sequence[int] = (),
        *,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt: str | None = None,
        progress: bool | str = False,
    ) -> GeneratedImages:
        """One image per (prompt or ``prompt_embeds`` row, seed), in order.

        Args:
            prompts: texts; or ``None`` when ``prompt_embeds`` is given.
            seeds: one seed per image.
            prompt_embeds: ``(N, L, D)`` text-encoder outputs (white-box attackers).
            negative_prompt: overrides the generator's default.
            progress: show a progress bar (a string is its description).
        """
        neg = negative_prompt if negative_prompt is not None else self.negative_prompt
        if prompt_embeds is not None:
            n = prompt_embeds.shape[0]
            ids = [f"embeds:{tensor_hash(prompt_embeds[i])}" for i in range(n)]
        else:
            if prompts is None:
                raise ValueError("generate() needs prompts or prompt_embeds")
            prompts = list(prompts)
            n = len(prompts)
            ids = list(prompts)
        seeds = [int(s) for s in seeds]
        if len(seeds) != n:
            raise ValueError(f"generate() got {n} prompts but {len(seeds)} seeds; give one seed per image")
        keys = [self.image_key(ids[i], seeds[i], neg) for i in range(n)]
        entries = [self.cache.get_entry(k) for k in keys]
        out: list[np.ndarray | None] = [e[0] if e is not None else None for e in entries]
        cached = [o is not None for o in out]
        for k, e in zip(keys, entries):
            if e is not None:
                self.records[k] = {**e[1], "replayed": True} if e[1] else None
        todo = [i for i in range(n) if out[i] is None]
        self.images_cached += n - len(todo)
        bar = tqdm(total=len(todo), desc=progress if isinstance(progress, str) else "generate",
                   disable=not progress or not todo, unit="img")
        for start in range(0, len(todo), self.batch_size):
            idx = todo[start : start + self.batch_size]
            t0 = time.perf_counter()
            images = self._run(
                [prompts[i] for i in idx] if prompt_embeds is None else None,
                prompt_embeds[idx] if prompt_embeds is not None else None,
                [seeds[i] for i in idx], neg,
            )
            seconds = time.perf_counter() - t0
            self.generation_seconds += seconds
            # the first pipeline call of a generator pays one-time costs (allocation, kernel
            # selection): marked as warm-up, and left out of time/inference_s_per_image
            meta = {"gen_s": seconds / len(idx), "batch": stable_hash([keys[i] for i in idx])[:16],
                    "batch_size": len(idx), "warmup": self.batches_run == 0, "machine": self.machine}
            self.batches_run += 1
            for j, i in enumerate(idx):
                self.cache.put(keys[i], images[j], meta=meta)
                self.records[keys[i]] = {**meta, "replayed": False}
                out[i] = images[j]
            self.images_generated += len(idx)
            bar.update(len(idx))
        bar.close()
        arr = np.stack(out) if n else np.zeros((0, self.height, self.width, 3), np.uint8)
        return GeneratedImages(images=from_uint8(arr), hashes=[pixel_hash(a) for a in arr], cached=cached)

    @torch.no_grad()
    def _run(self, prompts, prompt_embeds, seeds, negative_prompt) -> np.ndarray:
        generators = [torch.Generator(device="cpu").manual_seed(s) for s in seeds]
        kwargs: dict[str, Any] = dict(
            num_inference_steps=self.num_inference_steps,
            guidance_scale=self.guidance_scale,
            height=self.height,
            width=self.width,
            generator=generators,
            output_type="pt",
        )
        if prompt_embeds is not None:
            kwargs["prompt_embeds"] = prompt_embeds.to(self.pipe.device, self.pipe.unet.dtype)
            if negative_prompt is not None or self.guidance_scale > 1:
                neg = self.pipe.encode_prompt(
                    [negative_prompt or ""] * len(seeds), self.pipe.device, 1, False
                )[0]
                kwargs["negative_prompt_embeds"] = neg
        else:
            kwargs["prompt"] = list(prompts)
            if negative_prompt is not None:
                kwargs["negative_prompt"] = [negative_prompt] * len(prompts)
        if self.guidance is not None:
            kwargs.pop("output_type")
            for key in ("prompt", "negative_prompt"):
                kwargs.setdefault(key, None)
            kwargs.setdefault("prompt_embeds", None)
            kwargs.setdefault("negative_prompt_embeds", None)
            return to_uint8(self.guidance.sample(self.pipe, **kwargs))
        images = self.pipe(**kwargs).images
        bad = ~torch.isfinite(images.reshape(len(seeds), -1)).all(dim=1)
        if bad.any():  # to_uint8 would turn NaN into black images: a "perfect erasure"
            i = int(bad.nonzero()[0, 0])
            what = f"prompt {prompts[i]!r}" if prompts is not None else "prompt embeddings"
            raise NonFiniteError(
                f"the model produced NaN/inf pixels in {int(bad.sum())} of {len(seeds)} images ({what}, seed "
                f"{seeds[i]}): its weights (base or erased) hold non-finite values, or the sampler overflows "
                f"in {self.pipe.unet.dtype} (try model.dtype=float32); no result was written")
        return to_uint8(images)


class Judge:
    """Scores images with a classifier through a :class:`ScoreCache` keyed by pixel hash."""

    def __init__(self, classifier: Classifier, cache: ScoreCache) -> None:
        self.classifier = classifier
        self.cache = cache
        self.images_scored = 0

    def score(self, images: torch.Tensor, hashes: Sequence[str] | None = None,
              progress: bool | str = False) -> torch.Tensor:
        if hashes is None:
            hashes = [pixel_hash(a) for a in to_uint8(images)]
        n_labels = len(self.classifier.labels)
        rows: list[np.ndarray | None] = [self.cache.get(h, n_labels) for h in hashes]
        todo = [i for i, r in enumerate(rows) if r is None]
        if todo:
            bs = 256
            bar = tqdm(total=len(todo), desc=progress if isinstance(progress, str) else "classify",
                       disable=not progress, unit="img")
            for s in range(0, len(todo), bs):
                idx = todo[s : s + bs]
                probs = self.classifier.predict(images[idx]).float().cpu().numpy()
                check_probabilities(probs, self.classifier.name, n_labels)
                for j, i in enumerate(idx):
                    self.cache.put(hashes[i], probs[j])
                    rows[i] = probs[j]
                self.images_scored += len(idx)
                bar.update(len(idx))
            bar.close()
        if not rows:
            return torch.zeros(0, len(self.classifier.labels))
        return torch.from_numpy(np.stack(rows))


def check_probabilities(probs: np.ndarray, judge: str, n_labels: int) -> None:
    """A judge's output must be finite probabilities, one column per label: a NaN would
    otherwise read as "not detected" (perfect erasure)."""
    if probs.ndim != 2 or probs.shape[1] != n_labels:
        raise NonFiniteError(f"judge '{judge}' returned shape {tuple(probs.shape)}, expected (N, {n_labels})")
    bad = ~np.isfinite(probs).all(axis=1) | (probs < 0).any(axis=1) | (probs > 1 + 1e-6).any(axis=1)
    if bad.any():
        raise NonFiniteError(
            f"judge '{judge}' returned NaN/inf or values outside [0, 1] for {int(bad.sum())} of {len(probs)} "
            "images (its weights or the images are broken); no result was written")


class GenerationTarget:
    """The attack target: an (erased) pipeline behind a cached generator and a judge.

    Implements :class:`emma.api.attacker.AttackTarget`.
    """

    def __init__(self, generator: CachedGenerator, judge: Judge) -> None:
        self.generator = generator
        self.judge = judge

    @property
    def pipe(self) -> Any:
        return self.generator.pipe

    def generate(self, prompts=None, seeds=(), *, prompt_embeds=None, negative_prompt=None,
                 progress: bool | str = False) -> GeneratedImages:
        return self.generator.generate(prompts, seeds, prompt_embeds=prompt_embeds,
                                       negative_prompt=negative_prompt, progress=progress)

    def score(self, images: torch.Tensor, hashes: Sequence[str] | None = None,
              progress: bool | str = False) -> torch.Tensor:
        return self.judge.score(images, hashes, progress=progress)

    def detect(self, probs: torch.Tensor, concept: str) -> torch.Tensor:
        return self.judge.classifier.detect(probs, concept)

    def concept_score(self, probs: torch.Tensor, concept: str) -> torch.Tensor:
        return probs[:, self.judge.classifier.label_index(concept)]

    def excluded(self, probs: torch.Tensor) -> torch.Tensor | None:
        return self.judge.classifier.excluded(probs)

    def judge_key(self) -> str:
        return self.judge.classifier.cache_key()

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """The judge's image features (:meth:`Classifier.features`): an attack's image
        similarity where no other embedding is configured (the tiny world's stand-in for CLIP).
        Not a verdict: not counted as a judged query."""
        classifier = self.judge.classifier
        if not getattr(classifier, "has_features", False):
            from emma.api.attacker import AttackTargetError

            raise AttackTargetError(f"judge '{classifier.name}' has no image features; configure an image "
                                    "embedding (CLIP) instead")
        return classifier.features(images)

    def search_seeds(self, request: Any, n: int = 1) -> list[int]:
        """Seeds for an attack's search on ``request``: the search stream (:mod:`emma.seeds`),
        disjoint from every evaluation seed."""
        return request.search_seeds(n)
