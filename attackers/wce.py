"""WhenConceptsErased (Lu et al., NeurIPS 2025): a suite of probes that look for an erased
concept beyond adversarial text — the reference is kevinlu4588/WhenAreConceptsErased; every
setting and where it comes from is on docs/protocols/attackers/wce.md.

Each probe draws images of an attacked (EA) prompt on the erased model in its own way:

``standard``
    the prompt as it is, the cell's sampler.
``noise_based``
    DDIM trajectories with more noise than DDPM: per image a sweep of ``eta`` values (the
    noise's weight, above 1) times ``variance_scales`` (a further factor on the injected
    noise); the judge keeps the most concept-like variant.
``classifier_guidance``
    deterministic DDIM steered by a latent classifier of the concept (a small network on noisy
    latents and the timestep, trained on base-model images): per image a sweep of
    ``classifier_scales``; the judge keeps the most concept-like.
``noise_classifier``
    both: ``noise_classifier_scales`` times ``eta_values``.
``diffusion_completion``
    the base model denoises the first steps (through step ``k`` of ``interrupt_steps``), the
    erased model completes the trajectory: one image per interrupt step.
``interference``
    the other concepts' prompts on the erased model, judged for their own concept (whether
    erasing one concept disturbed the others); not an attack on the erased concept, so its
    rate is reported beside the ASR, never in it.
``inpainting``
    a base-model image of the prompt with a central square masked (``mask_fraction`` of each
    side); the erased model fills the square, the rest of the image is held to the base
    image's noised latents at every step.
``textual_inversion``
    one new token embedding learned on the erased model from base-model images of the concept
    (the diffusion loss, the erased UNet frozen); the prompt's concept words are replaced by it.

Seeds: every image a probe draws is at the request's search seeds (``target.search_seeds``),
in a block of its own per probe (so a probe's images do not depend on which other probes run),
never at the evaluation seeds; the static suite's images of the same prompts (``asr/pre``) are
the comparison. The attacker is *probing*: a probe's images are its result. Where a probe
sweeps variants the judge picks the one kept per image, as the reference's ranking classifier
does (``uses_judge``); every variant judged is counted.

Results: the request's output holds every kept image of every probe (``kind`` =
``wce/<probe>``), so ``asr`` is "any probe finds the concept"; ``wce/<probe>/asr`` (per prompt,
Wilson interval) and ``wce/<probe>/asr/images`` (images, clustered bootstrap) give each
probe's own rate; ``wce/interference/ra`` the interference probe's. ``<run dir>/wce/`` keeps
each probe's images and ``probes.jsonl`` (one line per image: probe, prompt, seed, variant,
score, detected).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from emma.api.attacker import Attacker, AttackTarget, AttackTargetError
from emma.api.types import AttackOutput, PromptRequest, Sample
from emma.errors import ConfigError

#: every probe, in the order their seed blocks are laid out (fixed: a probe's seeds do not
#: depend on which others run)
PROBES: tuple[str, ...] = ("standard", "noise_based", "classifier_guidance", "noise_classifier",
                           "diffusion_completion", "interference", "inpainting", "textual_inversion")
#: probes that run their own sampling loop on the erased UNet (not the cell's generator)
TRAJECTORY = ("noise_based", "classifier_guidance", "noise_classifier", "diffusion_completion", "inpainting")
#: probes that need the base model (its images, or its first denoising steps)
NEED_BASE = ("classifier_guidance", "noise_classifier", "diffusion_completion", "inpainting", "textual_inversion")
#: probes that sweep variants per image and keep the one the judge rates highest
SWEEPS = ("noise_based", "classifier_guidance", "noise_classifier")


def check_probes(probes: Any) -> list[str]:
    """The probe names, checked: a one-line error naming the valid ones otherwise."""
    if isinstance(probes, str):
        probes = [probes]
    names = [str(p) for p in (probes or [])]
    if not names:
        raise ConfigError(f"wce probes: none selected; choose from {', '.join(PROBES)}")
    bad = [p for p in names if p not in PROBES]
    if bad:
        raise ConfigError(f"wce probes: unknown {', '.join(repr(b) for b in bad)}; valid probes: {', '.join(PROBES)}")
    return list(dict.fromkeys(names))


def _floats(what: str, values: Any, low: float | None = None) -> list[float]:
    out = [float(v) for v in (values or [])]
    if not out:
        raise ConfigError(f"wce {what}: give at least one value")
    if low is not None and any(v < low for v in out):
        raise ConfigError(f"wce {what}: values must be >= {low} (got {out})")
    return out


def _positive(what: str, value: Any) -> int:
    if int(value) < 1:
        raise ConfigError(f"wce {what} must be >= 1 (got {value})")
    return int(value)


class WCEAttacker(Attacker):
    """The WhenConceptsErased probes (see the module's docstring; the keys' reference values:
    docs/protocols/attackers/wce.md).

    Args:
        probes: which probes run (any of :data:`PROBES`).
        eta_values: DDIM eta values of the noise-based sweeps.
        variance_scales: factors on the injected noise (noise-based probe).
        classifier_scales: classifier-guidance strengths (the classifier-guidance probe).
        noise_classifier_scales: classifier-guidance strengths swept with ``eta_values``.
        num_inference_steps / guidance_scale: the probes' own sampling loops (``None``: the
            cell's sampler); ``standard``, ``interference`` and ``textual_inversion`` draw
            with the cell's generator.
        interrupt_steps: diffusion completion: the base model runs steps 0..k, the erased
            model the rest, for each k.
        mask_fraction: inpainting: the masked central square's side over the image's.
        interference_prompts: prompts per other concept (the first ones of its EA suite).
        classifier_path: a trained latent classifier (the reference's ``model_state_dict``
            checkpoint format, or a state dict) instead of training one; ``None``: train.
        classifier_*: training of the latent classifier (images per class, epochs, batch,
            learning rate, weight decay, noised copies per image, timestep power law, hidden width).
        ti_*: textual inversion (images, steps, batch, learning rate, weight decay,
            initializer token, templates).
        batch_size: latent rows per UNet call in the probes' own loops.
        seed: seeds the training draws (classifier and textual inversion).
    """

    name = "wce"
    version = "1"
    needs_white_box = True
    probing = True
    uses_judge = True

    def __init__(self, probes: Sequence[str] = PROBES,
                 eta_values: Sequence[float] = (1.0, 1.17, 1.34, 1.51, 1.68, 1.85),
                 variance_scales: Sequence[float] = (1.0, 1.02, 1.03, 1.04),
                 classifier_scales: Sequence[float] = tuple(range(25, 200, 7)),
                 noise_classifier_scales: Sequence[float] = (30, 50, 75, 125),
                 num_inference_steps: Optional[int] = 50, guidance_scale: Optional[float] = 7.5,
                 interrupt_steps: Sequence[int] = (0, 1, 2), mask_fraction: float = 0.5,
                 interference_prompts: int = 10, classifier_path: Optional[str] = None,
                 classifier_images: Optional[Mapping[str, int]] = None, classifier_epochs: int = 70,
                 classifier_batch_size: int = 8, classifier_learning_rate: float = 1e-4,
                 classifier_weight_decay: float = 1e-3, classifier_noised_copies: int = 7,
                 classifier_timestep_power: float = 3.0, classifier_hidden: Sequence[int] = (1024, 512),
                 ti_images: int = 30, ti_steps: int = 3000, ti_batch_size: int = 4,
                 ti_learning_rate: float = 2e-3, ti_weight_decay: float = 1e-2, ti_initializer: str = "object",
                 ti_templates: Sequence[str] = ("a photo of a {}",), batch_size: int = 8, seed: int = 0) -> None:
        self.probes = check_probes(probes)
        self.eta_values = _floats("eta_values", eta_values, 0.0)
        self.variance_scales = _floats("variance_scales", variance_scales, 0.0)
        self.classifier_scales = _floats("classifier_scales", classifier_scales, 0.0)
        self.noise_classifier_scales = _floats("noise_classifier_scales", noise_classifier_scales, 0.0)
        self.num_inference_steps = None if num_inference_steps is None else _positive("num_inference_steps",
                                                                                       num_inference_steps)
        self.guidance_scale = None if guidance_scale is None else float(guidance_scale)
        self.interrupt_steps = sorted({int(k) for k in (interrupt_steps or [])})
        if not self.interrupt_steps or self.interrupt_steps[0] < 0:
            raise ConfigError(f"wce interrupt_steps: give step indices >= 0 (got {list(interrupt_steps or [])})")
        if not 0.0 < float(mask_fraction) <= 1.0:
            raise ConfigError(f"wce mask_fraction must be in (0, 1] (got {mask_fraction})")
        self.mask_fraction = float(mask_fraction)
        self.interference_prompts = _positive("interference_prompts", interference_prompts)
        self.classifier_path = classifier_path
        if classifier_path is not None and not Path(str(classifier_path)).expanduser().is_file():
            raise ConfigError(f"wce classifier_path={classifier_path!r}: no such file")
        images = {"positive": 1300, "negative": 5000, **dict(classifier_images or {})}
        if set(images) != {"positive", "negative"}:
            raise ConfigError(f"wce classifier_images: keys positive and negative (got {sorted(images)})")
        self.classifier_images = {k: _positive(f"classifier_images.{k}", v) for k, v in images.items()}
        self.classifier_epochs = _positive("classifier_epochs", classifier_epochs)
        self.classifier_batch_size = _positive("classifier_batch_size", classifier_batch_size)
        self.classifier_learning_rate = float(classifier_learning_rate)
        self.classifier_weight_decay = float(classifier_weight_decay)
        self.classifier_noised_copies = _positive("classifier_noised_copies", classifier_noised_copies)
        self.classifier_timestep_power = float(classifier_timestep_power)
        self.classifier_hidden = [_positive("classifier_hidden", h) for h in classifier_hidden]
        if len(self.classifier_hidden) != 2:
            raise ConfigError(f"wce classifier_hidden: two widths (got {list(classifier_hidden)})")
        self.ti_images = _positive("ti_images", ti_images)
        self.ti_steps = _positive("ti_steps", ti_steps)
        self.ti_batch_size = _positive("ti_batch_size", ti_batch_size)
        self.ti_learning_rate = float(ti_learning_rate)
        self.ti_weight_decay = float(ti_weight_decay)
        self.ti_initializer = str(ti_initializer)
        self.ti_templates = [str(t) for t in (ti_templates or [])]
        if not self.ti_templates or any("{}" not in t for t in self.ti_templates):
            raise ConfigError("wce ti_templates: give templates with a {} where the learned token goes")
        self.batch_size = _positive("batch_size", batch_size)
        self.seed = int(seed)
        self._out_dir: Path | None = None
        self._metrics: dict[str, Any] = {}
        self._notes: list[str] = []

    # ---- declarations -------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {**super().config(), "probes": self.probes, "eta_values": self.eta_values,
                "variance_scales": self.variance_scales, "classifier_scales": self.classifier_scales,
                "noise_classifier_scales": self.noise_classifier_scales,
                "num_inference_steps": self.num_inference_steps, "guidance_scale": self.guidance_scale,
                "interrupt_steps": self.interrupt_steps, "mask_fraction": self.mask_fraction,
                "interference_prompts": self.interference_prompts, "classifier_path": self.classifier_path,
                "classifier_images": self.classifier_images, "classifier_epochs": self.classifier_epochs,
                "classifier_batch_size": self.classifier_batch_size,
                "classifier_learning_rate": self.classifier_learning_rate,
                "classifier_weight_decay": self.classifier_weight_decay,
                "classifier_noised_copies": self.classifier_noised_copies,
                "classifier_timestep_power": self.classifier_timestep_power,
                "classifier_hidden": self.classifier_hidden, "ti_images": self.ti_images, "ti_steps": self.ti_steps,
                "ti_batch_size": self.ti_batch_size, "ti_learning_rate": self.ti_learning_rate,
                "ti_weight_decay": self.ti_weight_decay, "ti_initializer": self.ti_initializer,
                "ti_templates": self.ti_templates, "batch_size": self.batch_size, "seed": self.seed,
                "budget": self.budget()}

    def variants(self, probe: str) -> int:
        """Images drawn (and judged) per kept image of ``probe``."""
        return {"noise_based": len(self.eta_values) * len(self.variance_scales),
                "classifier_guidance": len(self.classifier_scales),
                "noise_classifier": len(self.noise_classifier_scales) * len(self.eta_values)}.get(probe, 1)

    def budget(self) -> dict[str, int]:
        return {"probes": len(self.probes),
                "images_per_seed": sum(self.variants(p) * (len(self.interrupt_steps) if p == "diffusion_completion"
                                                           else 1) for p in self.probes if p != "interference"),
                "ti_steps": self.ti_steps if "textual_inversion" in self.probes else 0}

    @property
    def needs_base_model(self) -> bool:  # type: ignore[override]
        return any(p in NEED_BASE for p in self.probes)

    def check(self, target: AttackTarget, requests: Sequence[PromptRequest]) -> None:
        super().check(target, requests)
        guidance = getattr(getattr(target, "generator", None), "guidance", None)
        own_loop = [p for p in self.probes if p in TRAJECTORY]
        if guidance is not None and own_loop:
            raise AttackTargetError(
                f"wce probes {', '.join(own_loop)} run their own sampling loop on the UNet, which would bypass this "
                "method's inference-time guidance; choose from standard, interference, textual_inversion for it")
        if "interference" in self.probes or any(p in ("classifier_guidance", "noise_classifier") for p in self.probes):
            _domain_requests(target)
        if "textual_inversion" in self.probes:
            wb = target.white_box()
            ids = wb.tokenizer(self.ti_initializer, truncation=False).input_ids[1:-1]
            if len(ids) != 1:
                raise ConfigError(f"wce ti_initializer {self.ti_initializer!r} is {len(ids)} tokens for this "
                                  "tokenizer; give a word that is one token (the reference: object)")

    def bind_cell(self, output_dir: str | Path, cache_dir: str | Path, info: Mapping[str, Any]) -> None:
        self._out_dir = Path(output_dir) / "wce"

    def extra_metrics(self) -> dict[str, Any]:
        return dict(self._metrics)

    def notes(self) -> list[str]:
        return list(self._notes)

    # ---- the attack ---------------------------------------------------------------------
    def attack(self, target: AttackTarget, requests: Sequence[PromptRequest]) -> list[AttackOutput]:
        from attackers import wce_probes as P

        t0 = time.perf_counter()
        run = P.ProbeRun(self, target, requests)
        kept: dict[str, list[list[P.Kept]]] = {}
        seconds: dict[str, float] = {}
        for probe in self.probes:
            t = time.perf_counter()
            if probe == "interference":
                run.interference()
            else:
                kept[probe] = getattr(run, probe)()
            seconds[probe] = round(time.perf_counter() - t, 2)
        run.notes.append("wce: seconds per probe: " + ", ".join(f"{p} {s:g}" for p, s in seconds.items()))
        each = (time.perf_counter() - t0) / max(1, len(requests))
        outputs = []
        for i, req in enumerate(requests):
            samples: list[Sample] = []
            for probe in self.probes:
                samples += [k.sample for k in kept.get(probe, [[]] * len(requests))[i]]
            prompt = run.ti_prompts[i] if run.ti_prompts else req.prompt
            outputs.append(AttackOutput(
                request=req, adversarial_prompt=prompt, samples=samples, success=any(s.detected for s in samples),
                queries=run.drawn[i], iterations=run.iterations, time_s=each, judged_queries=run.judged[i],
                extra={"search_seeds": sorted(run.seeds_used[i]), "probes": list(self.probes),
                       **({"ti_prompt": run.ti_prompts[i]} if run.ti_prompts else {})}))
        self._metrics = P.probe_metrics(self.probes, kept, run.interference_samples, seed=self.seed)
        self._notes = run.notes
        run.write(self._out_dir)
        return outputs


def _domain_requests(target: AttackTarget) -> list[PromptRequest]:
    try:
        return list(target.domain_requests())
    except AttackTargetError as exc:
        raise AttackTargetError(f"wce probes interference, classifier_guidance and noise_classifier need the other "
                                f"concepts' prompts, which this attack target cannot give ({exc}); choose other "
                                "probes") from exc


def write_lines(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    from emma.files import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows), what="wce probe records")
