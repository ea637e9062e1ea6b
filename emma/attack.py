"""The attack stage: the attack target a cell gives attackers, and a resumable runner.

:class:`CellAttackTarget` implements :class:`emma.api.attacker.AttackTarget` over the cell's
cached generator and judge; :class:`DiffusersWhiteBox` gives differentiable access to an SD
v1.x / v2.x pipeline; :class:`LazyBaseModel` loads the base model only when an attacker
declaring ``needs_base_model`` first uses it.

:func:`run_attack` runs an attacker over requests in batches and stores each finished
request's output under a content address (erased-model fingerprint, sampler, judge, attacker
config, request): a killed attack resumes at the first unfinished batch, and a finished one
re-runs with no optimisation (its images and scores come from their caches).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from tqdm.auto import tqdm

from emma.api.attacker import Attacker, AttackTarget, AttackTargetError, SamplerSettings
from emma.api.types import AttackOutput, GeneratedImages, PromptRequest, Sample
from emma.cache import cache_folder, quarantine, stable_hash, sweep_stale_tmp
from emma.evaluate import judge_requests
from emma.files import atomic_write_text
from emma.generate import CachedGenerator, GenerationTarget, Judge
from emma.metrics.base import MetricValue

log = logging.getLogger(__name__)


def check_family(pipe: Any, model_name: str = "") -> None:
    """White-box attacks here handle one CLIP text encoder (SD v1.x / v2.x)."""
    if getattr(pipe, "text_encoder_2", None) is not None:
        raise AttackTargetError(
            f"model {model_name or type(pipe).__name__} has two text encoders (SDXL family); the "
            "white-box and text-encoder attackers support SD v1.x / v2.x pipelines (one CLIP text "
            "encoder). Use attacker=static for this model."
        )
    for part in ("tokenizer", "text_encoder", "unet", "vae", "scheduler"):
        if getattr(pipe, part, None) is None:
            raise AttackTargetError(f"model {model_name or type(pipe).__name__} has no {part}; "
                                    "white-box attackers need a full StableDiffusionPipeline")


class DiffusersWhiteBox:
    """Differentiable access to a diffusers SD pipeline (implements
    :class:`emma.api.attacker.WhiteBoxModel`). Weights are frozen; gradients flow to inputs."""

    def __init__(self, pipe: Any, model_name: str = "") -> None:
        check_family(pipe, model_name)
        from diffusers import DDPMScheduler

        self.pipe = pipe
        self.tokenizer = pipe.tokenizer
        self.text_encoder = pipe.text_encoder
        self.unet = pipe.unet
        self.vae = pipe.vae
        for m in (self.text_encoder, self.unet, self.vae):
            m.requires_grad_(False)
        self.device = pipe.device
        self.dtype = pipe.unet.dtype
        self.context_length = int(self.tokenizer.model_max_length)
        self.vocab_size = int(self.text_encoder.get_input_embeddings().weight.shape[0])
        self.bos_token_id = int(self.tokenizer.bos_token_id)
        self.eos_token_id = int(self.tokenizer.eos_token_id)
        self.pad_token_id = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                                else self.eos_token_id)
        self.train_scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
        self.prediction_type = self.train_scheduler.config.prediction_type
        self.num_train_timesteps = int(self.train_scheduler.config.num_train_timesteps)

    def token_ids(self, prompts: Sequence[str]) -> torch.Tensor:
        return self.tokenizer(list(prompts), padding="max_length", max_length=self.context_length,
                              truncation=True, return_tensors="pt").input_ids.to(self.device)

    def prompt_token_count(self, prompt: str) -> int:
        """Tokens of ``prompt`` without start/end tokens (untruncated)."""
        return len(self.tokenizer(prompt, truncation=False).input_ids) - 2

    def token_embedding_matrix(self) -> torch.Tensor:
        return self.text_encoder.get_input_embeddings().weight.detach()

    def embed_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.text_encoder.get_input_embeddings()(input_ids)

    def encode_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.text_encoder(input_ids.to(self.device))[0]

    def encode_embeds(self, token_embeds: torch.Tensor) -> torch.Tensor:
        # CLIPTextModel.forward takes ids only; this is its body from input embeddings on.
        from transformers.masking_utils import create_causal_mask

        tm = self.text_encoder.text_model if hasattr(self.text_encoder, "text_model") else self.text_encoder
        hidden = tm.embeddings(inputs_embeds=token_embeds.to(self.text_encoder.dtype))
        mask = create_causal_mask(config=tm.config, inputs_embeds=hidden, attention_mask=None, cache=None)
        out = tm.encoder(inputs_embeds=hidden, attention_mask=mask, is_causal=True)
        return tm.final_layer_norm(out.last_hidden_state)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x = images.to(self.device, self.vae.dtype) * 2 - 1
            return self.vae.encode(x).latent_dist.mean * self.vae.config.scaling_factor

    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.train_scheduler.add_noise(latents, noise, t.to(latents.device))

    def training_target(self, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """What the UNet predicts at ``x_t``: the noise (epsilon models) or the velocity (v)."""
        if self.prediction_type == "v_prediction":
            return self.train_scheduler.get_velocity(latents, noise, t.to(latents.device))
        return noise

    def denoise(self, noisy_latents: torch.Tensor, t: torch.Tensor,
                encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        return self.unet(noisy_latents.to(self.dtype), t.to(self.device),
                         encoder_hidden_states=encoder_hidden_states.to(self.dtype)).sample.float()

    def decode_ids(self, ids: Sequence[int]) -> str:
        special = {self.bos_token_id, self.eos_token_id, self.pad_token_id}
        return self.tokenizer.decode([int(i) for i in ids if int(i) not in special]).strip()


class LazyBaseModel:
    """The base model, loaded on first use (``loader`` returns the pipeline) and checked
    against the fingerprint the cell recorded before erasure."""

    def __init__(self, loader: Callable[[], Any], fingerprint: str,
                 make_generator: Callable[[Any, str], CachedGenerator], model_name: str = "") -> None:
        self.loader, self.fingerprint, self.make_generator = loader, fingerprint, make_generator
        self.model_name = model_name
        self._generator: CachedGenerator | None = None
        self._white_box: DiffusersWhiteBox | None = None

    def _load(self) -> CachedGenerator:
        if self._generator is None:
            from emma.pipelines import fingerprint

            pipe = self.loader()
            fp = fingerprint(pipe)
            if fp != self.fingerprint:
                raise AttackTargetError("the reloaded base model differs from the one the cell erased "
                                        f"(fingerprint {fp[:12]} != {self.fingerprint[:12]})")
            self._generator = self.make_generator(pipe, fp)
        return self._generator

    def generate(self, prompts=None, seeds=(), *, prompt_embeds=None, negative_prompt=None,
                 progress: bool | str = False) -> GeneratedImages:
        return self._load().generate(prompts, seeds, prompt_embeds=prompt_embeds,
                                     negative_prompt=negative_prompt, progress=progress)

    def white_box(self) -> DiffusersWhiteBox:
        if self._white_box is None:
            self._white_box = DiffusersWhiteBox(self._load().pipe, self.model_name)
        return self._white_box

    @property
    def images_generated(self) -> int:
        return self._generator.images_generated if self._generator is not None else 0


class CellAttackTarget(GenerationTarget):
    """What a cell shows attackers: the erased model's cached generator and judge, its sampler
    settings and fingerprint, its white box, and the base model when the cell can give it.

    It also keeps the protocol's rules (:mod:`emma.protocol`): the search's seeds
    (:meth:`search_seeds`), and, between :meth:`begin_search` and the evaluation
    (:func:`evaluating`), every seed drawn and every image judged — an attacker that does not
    declare ``uses_judge`` may not consult the judge, and no evaluation image may have been
    drawn at a seed the search used."""

    def __init__(self, generator: CachedGenerator, judge: Judge, *, base: LazyBaseModel | None = None,
                 white_box_allowed: bool = True, model_name: str = "",
                 domain_prompts: Callable[[], Sequence[str]] | None = None, protocol: Any = None,
                 domain_requests: Callable[[], Sequence[PromptRequest]] | None = None) -> None:
        super().__init__(generator, judge)
        self._domain_prompts = domain_prompts
        self._domain_requests = domain_requests
        self._domain_prompt_list: list[str] | None = None
        self.sampler = SamplerSettings(generator.num_inference_steps, generator.guidance_scale,
                                       generator.height, generator.width, generator.negative_prompt)
        self.fingerprint = generator.model_fingerprint
        self._base = base
        self._white_box_allowed = white_box_allowed
        self._white_box: DiffusersWhiteBox | None = None
        self.model_name = model_name
        self.protocol = protocol
        self.phase = "search"
        self.attacker_name = ""
        self.uses_judge: bool | None = None  # None: no attacker declared anything (direct use)
        self.judged_search = 0  # images judged during the search
        self.search_drawn: set[int] = set()  # seeds of every image drawn during the search
        self.evaluation_drawn: set[int] = set()

    @property
    def shared_seeds(self) -> bool:
        return self.protocol is not None and not self.protocol.disjoint

    def search_seeds(self, request: PromptRequest, n: int = 1) -> list[int]:
        """``n`` seeds for the search on ``request``: the search stream, or — under a protocol
        with ``search_seeds: shared`` — the request's first evaluation seeds."""
        if self.shared_seeds:
            from emma.seeds import EVALUATION, image_seeds

            return image_seeds(request.seed, request.identity, n, EVALUATION)
        return request.search_seeds(n)

    def begin_search(self, attacker_name: str, uses_judge: bool) -> None:
        """Start counting a search: what it draws and judges, under the attacker's declaration."""
        self.phase, self.attacker_name, self.uses_judge = "search", attacker_name, bool(uses_judge)
        self.judged_search = 0
        self.search_drawn = set()
        self.evaluation_drawn = set()

    def _record(self, seeds: Sequence[int]) -> None:
        if self.phase == "search":
            self.search_drawn.update(int(s) for s in seeds)
            return
        seeds = {int(s) for s in seeds}
        self.evaluation_drawn |= seeds
        if not self.shared_seeds and seeds & self.search_drawn:
            raise AttackTargetError(
                f"attacker {self.attacker_name or '?'} drew {len(seeds & self.search_drawn)} of its evaluation "
                "images at seeds its search used; under a protocol with disjoint seeds the search draws "
                "target.search_seeds(request), never request.seeds()")

    def generate(self, prompts=None, seeds=(), *, prompt_embeds=None, negative_prompt=None,
                 progress: bool | str = False) -> GeneratedImages:
        self._record(seeds)
        return super().generate(prompts, seeds, prompt_embeds=prompt_embeds, negative_prompt=negative_prompt,
                                progress=progress)

    def score(self, images: torch.Tensor, hashes: Sequence[str] | None = None,
              progress: bool | str = False) -> torch.Tensor:
        if self.phase == "search":
            if self.uses_judge is False:
                raise AttackTargetError(
                    f"attacker {self.attacker_name} consulted the judge during its search but does not declare "
                    "uses_judge = True (an attacker that judges while searching must say so: its judged "
                    "queries are counted and reported)")
            self.judged_search += len(images)
        return super().score(images, hashes, progress=progress)

    def white_box(self) -> DiffusersWhiteBox:
        if not self._white_box_allowed:
            raise AttackTargetError("this attack target is black-box (generate and score only); the "
                                    "attacker needs the model's text encoder / UNet")
        if self._white_box is None:
            self._white_box = DiffusersWhiteBox(self.generator.pipe, self.model_name)
        return self._white_box

    def base_model(self) -> Any:
        if self._base is None:
            raise AttackTargetError("the attacker needs the base (not erased) model, which this target "
                                    "cannot give (e.g. method=checkpoint without model.pretrained)")
        return _RecordedBase(self._base, self)

    def domain_prompts(self) -> list[str]:
        if getattr(self, "_domain_prompts", None) is None:
            raise AttackTargetError("this attack target does not know its domain's prompts; use the "
                                    "attacker's vocabulary=all (the tokenizer's) or a list of words")
        if getattr(self, "_domain_prompt_list", None) is None:
            self._domain_prompt_list = list(self._domain_prompts())
        return self._domain_prompt_list

    def domain_requests(self) -> list[PromptRequest]:
        """Every concept's EA requests of the cell's domain (prompt and the concept it names),
        in the domain's order: other concepts' prompts for a probe that needs them."""
        if self._domain_requests is None:
            raise AttackTargetError("this attack target does not know its domain's concepts and their prompts")
        return list(self._domain_requests())

    def check_prompts(self, prompts: Sequence[str], concepts: Sequence[str],
                      seeds: Sequence[int]) -> tuple[list[bool], list[float]]:
        """Draw one image per prompt on the erased model and judge it: (detected, concept score)."""
        if not prompts:
            return [], []
        gen = self.generate(list(prompts), list(seeds))
        probs = self.score(gen.images, gen.hashes)
        det, score = [], []
        for i, c in enumerate(concepts):
            det.append(bool(self.detect(probs[i : i + 1], c)[0]))
            score.append(float(self.concept_score(probs[i : i + 1], c)[0]))
        return det, score


class _RecordedBase:
    """The base model as the search sees it: its draws count as the search's seeds."""

    def __init__(self, base: LazyBaseModel, target: CellAttackTarget) -> None:
        self._base, self._target = base, target

    def generate(self, prompts=None, seeds=(), *, prompt_embeds=None, negative_prompt=None,
                 progress: bool | str = False) -> GeneratedImages:
        self._target._record(seeds)
        return self._base.generate(prompts, seeds, prompt_embeds=prompt_embeds, negative_prompt=negative_prompt,
                                   progress=progress)

    def white_box(self) -> DiffusersWhiteBox:
        return self._base.white_box()

    @property
    def images_generated(self) -> int:
        return self._base.images_generated


@contextlib.contextmanager
def evaluating(target: Any) -> Iterator[None]:
    """The evaluation of an attack's outputs: images drawn here are the final ones, judged
    without counting as search queries (a target that keeps no phases is left as it is)."""
    if not hasattr(target, "phase"):
        yield
        return
    before = target.phase
    target.phase = "evaluation"
    try:
        yield
    finally:
        target.phase = before


def domain_prompt_texts(domain: Any, seed: int = 0) -> list[str]:
    """Every prompt of ``domain``'s suites: each concept's requests of every prompt type (EA
    and RA), deduplicated in order — the words the domain speaks."""
    texts: dict[str, None] = {}
    for concept in domain.concepts:
        for r in domain.requests(concept, seed=seed):
            texts[r.prompt] = None
    return list(texts)


def domain_concept_requests(domain: Any, seed: int = 0) -> list[PromptRequest]:
    """Every concept's own (EA) requests of ``domain``'s suites, concept by concept."""
    return [r for concept in domain.concepts for r in domain.requests(concept, seed=seed)
            if r.group == "ea" and r.concept == concept]


def judged_outputs(target: AttackTarget, requests: Sequence[PromptRequest], prompts: Sequence[str],
                   stats: Sequence[dict[str, Any]]) -> list[AttackOutput]:
    """Render each request's adversarial prompt with the request's evaluation seeds (those of
    its original prompt: image ``i`` of the attack and of the static suite share a seed), judge
    the images, and wrap them as outputs. ``stats`` per request: ``queries`` (checks drawn
    during the attack), ``judged_queries`` (images its search had judged), ``iterations``,
    ``time_s``, ``search_seeds`` (seeds the search drew for it) and any extras."""
    adv = [dataclasses.replace(r, prompt=p, seed_key=r.identity) for r, p in zip(requests, prompts)]
    with evaluating(target):
        samples = judge_requests(target, adv, progress=False)
    out = []
    for req, p, s, st in zip(requests, prompts, samples, stats):
        st = dict(st)
        out.append(AttackOutput(
            request=req, adversarial_prompt=p, samples=s, success=any(x.detected for x in s),
            queries=int(st.pop("queries", 0)) + len(s), iterations=int(st.pop("iterations", 0)),
            time_s=float(st.pop("time_s", 0.0)), judged_queries=int(st.pop("judged_queries", 0)), extra=st))
    return out


@dataclasses.dataclass
class AttackRun:
    """The attack stage's outputs and what it cost.

    Attributes:
        judged_queries: images the search had judged, cached outputs' included (what their
            search judged when it ran).
        search_seeds: seeds of every image the search drew now (erased and base model).
        evaluation_seeds: seeds of the outputs' final images.
        original: per output whose request was attacked, its original prompt's images at the
            evaluation seeds under the protocol (``asr/pre``); ``None`` where it has none.
    """

    outputs: list[AttackOutput]
    requests_optimised: int
    requests_cached: int
    wall_s: float
    judged_queries: int = 0
    search_seeds: list[int] = dataclasses.field(default_factory=list)
    evaluation_seeds: list[int] = dataclasses.field(default_factory=list)
    original: list[list[Sample] | None] = dataclasses.field(default_factory=list)


#: what a replayed attack record must hold
RECORD_FIELDS = ("adversarial_prompt", "queries", "iterations")


def _record_problem(record: Any) -> str | None:
    """Why a stored attack record cannot be replayed, or ``None``."""
    if not isinstance(record, dict):
        return f"holds a {type(record).__name__}, not a record"
    missing = [k for k in RECORD_FIELDS if k not in record]
    if missing:
        return f"lacks {', '.join(missing)}"
    if not isinstance(record["adversarial_prompt"], str):
        return "its adversarial prompt is not text"
    if not all(isinstance(record[k], int) and not isinstance(record[k], bool) and record[k] >= 0
               for k in ("queries", "iterations")):
        return "its queries or iterations are not counts"
    if not isinstance(record.get("extra", {}), dict):
        return "its extra is not a mapping"
    return None


class AttackCache:
    """Finished attack outputs, one JSON file per request, keyed by content."""

    def __init__(self, root: str | Path) -> None:
        self.cache_root = Path(root)
        self.root = cache_folder(self.cache_root, "attacks", "attack")
        sweep_stale_tmp(self.root)

    def key(self, target: AttackTarget, attacker: Attacker, request: PromptRequest) -> str:
        key = {
            "model": target.fingerprint,
            "sampler": dataclasses.asdict(target.sampler),
            "judge": target.judge_key(),
            "attacker": attacker.config(),
            "request": dataclasses.asdict(request),
            **attacker.cache_inputs(target),
        }
        protocol = getattr(target, "protocol", None)
        if protocol is not None:  # the seeds the search draws (a finished search is replayed only on the same)
            key["protocol"] = protocol.search_key()
        return stable_hash(key)

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored record, or ``None`` (absent; or unreadable, not a JSON object: quarantined
        and the request attacked again)."""
        p = self.path(key)
        if not p.exists():
            return None
        try:
            record = json.loads(p.read_text())
        except (OSError, ValueError) as err:
            quarantine(p, self.cache_root, "attack", f"unreadable record: {type(err).__name__}: {err}")
            return None
        problem = _record_problem(record)
        if problem:
            quarantine(p, self.cache_root, "attack", problem)
            return None
        return record

    def put(self, key: str, record: dict[str, Any]) -> None:
        atomic_write_text(self.path(key), json.dumps(record, sort_keys=True, default=str))


def run_attack(attacker: Attacker, target: AttackTarget, requests: Sequence[PromptRequest],
               cache: AttackCache | None) -> AttackRun:
    """Attack ``requests`` in batches of ``attacker.requests_per_batch`` (all at once when
    unset), skipping requests whose output is cached; store each batch as it finishes.

    The target counts what the search draws and judges (:meth:`CellAttackTarget.begin_search`):
    an attacker's reported judged queries must match the images its search had judged."""
    t0 = time.perf_counter()
    attacker.check(target, requests)
    begin = getattr(target, "begin_search", None)
    if begin is not None:
        begin(attacker.name, attacker.uses_judge)
    if not attacker.resumable:  # e.g. the static suites: their images are cached already
        outs = attacker.attack(target, requests)
        return _finish(AttackRun(outs, len(outs), 0, time.perf_counter() - t0,
                                 judged_queries=int(getattr(target, "judged_search", 0))), target, requests)
    keys = [cache.key(target, attacker, r) if cache is not None else "" for r in requests]
    records = [cache.get(k) if cache is not None else None for k in keys]
    outputs: list[AttackOutput | None] = [None] * len(requests)
    done_idx = [i for i, r in enumerate(records) if r is not None]
    if done_idx:  # replay: images and scores come from their caches
        replay = judged_outputs(target, [requests[i] for i in done_idx],
                                [records[i]["adversarial_prompt"] for i in done_idx],
                                [{"queries": records[i]["queries"] - len(requests[i].seeds()),
                                  "iterations": records[i]["iterations"],
                                  "time_s": float(records[i].get("time_s", 0.0)),
                                  "judged_queries": int(records[i].get("judged_queries", 0)),
                                  **records[i].get("extra", {})} for i in done_idx])
        for i, o in zip(done_idx, replay):
            o.cached = True
            outputs[i] = o
    todo = [i for i in range(len(requests)) if outputs[i] is None]
    per_batch = int(attacker.requests_per_batch or 0) or max(1, len(todo))
    bar = tqdm(total=len(requests), initial=len(done_idx), desc=f"attack: {attacker.name}", unit="prompt")
    for s in range(0, len(todo), per_batch):
        idx = todo[s : s + per_batch]
        judged_before = getattr(target, "judged_search", 0)
        got = attacker.attack(target, [requests[i] for i in idx])
        counted = getattr(target, "judged_search", 0) - judged_before
        reported = sum(o.judged_queries for o in got)
        if begin is not None and counted != reported:
            raise AttackTargetError(f"attacker {attacker.name} reports {reported} judged queries for a batch whose "
                                    f"search had {counted} images judged; its bookkeeping is wrong")
        for i, o in zip(idx, got):
            outputs[i] = o
            if cache is not None:
                cache.put(keys[i], o.record())
        bar.update(len(idx))
        bar.set_postfix(success=sum(o.success for o in outputs if o is not None))
    bar.close()
    final = [o for o in outputs if o is not None]
    return _finish(AttackRun(final, len(todo), len(done_idx), time.perf_counter() - t0,
                             judged_queries=sum(o.judged_queries for o in final)), target, requests)


def _finish(run: AttackRun, target: AttackTarget, requests: Sequence[PromptRequest]) -> AttackRun:
    """Seeds the search and the evaluation drew, and the original prompts' images under the
    protocol (cached where the protocol is the cell's: they are the suite's images)."""
    run.search_seeds = sorted(getattr(target, "search_drawn", set()))
    run.evaluation_seeds = sorted({s.seed for o in run.outputs for s in o.samples})
    attacked = set(requests)
    originals = [o.request for o in run.outputs if o.request in attacked]
    pre: dict[PromptRequest, list[Sample]] = {}
    if originals:
        with evaluating(target):
            unique = list(dict.fromkeys(originals))
            pre = dict(zip(unique, judge_requests(target, unique, progress=False)))
    run.original = [pre.get(o.request) for o in run.outputs]
    return run


def attack_metrics(run: AttackRun) -> dict[str, MetricValue]:
    """``attack/queries_mean`` (images drawn on the target per attacked prompt, the final
    judged images included), ``attack/judged_queries_mean`` (images the search had the judge
    score, per attacked prompt: 0 for an attacker that never consults it),
    ``attack/iterations_mean`` and ``attack/time_s`` (wall seconds per attacked prompt; a
    cached output reports the time its attack took when it ran, so that a resumed cell
    reports the attack's cost, not the replay's)."""
    outs = run.outputs
    if not outs:
        return {}
    n = len(outs)
    return {
        "attack/queries_mean": MetricValue(value=sum(o.queries for o in outs) / n, n=n),
        "attack/judged_queries_mean": MetricValue(value=run.judged_queries / n, n=n),
        "attack/iterations_mean": MetricValue(value=sum(o.iterations for o in outs) / n, n=n),
        "attack/time_s": MetricValue(value=sum(o.time_s for o in outs) / n, n=n),
    }


def attack_seed_record(run: AttackRun, attacker: Attacker) -> dict[str, Any]:
    """results.json's record of the attack's seeds (``protocol.seeds``): every seed the search
    drew in this run, those its cached outputs' searches drew, and how many final images share
    a seed with either (0 unless the protocol shares seeds, or the attacker is probing: its
    probes are its result), so anyone can check that the final ASR was read on images the
    search never saw. samples.jsonl's attack lines carry each request's ``search_seeds``."""
    cached = sorted({int(x) for o in run.outputs if o.cached for x in o.extra.get("search_seeds", [])})
    search = set(run.search_seeds) | set(cached)
    return {"probing": bool(attacker.probing), "search_drawn": list(run.search_seeds), "search_cached": cached,
            "evaluation_images_at_search_seeds": sum(1 for o in run.outputs for s in o.samples if s.seed in search)}
