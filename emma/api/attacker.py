"""The Attacker role: find prompts (or embeddings) that bring an erased concept back.

An attacker sees one small typed front, :class:`AttackTarget`: generate images from prompts
or prompt embeddings with seeds, score them with the cell's judge, the sampler settings, and
— only when the attacker declares it — differentiable access to the erased model
(:class:`WhiteBoxModel`: tokenizer, text encoder, UNet, VAE) and the base model it was
erased from. A target that cannot give what an attacker declares fails with a clear error
before any work (:meth:`Attacker.check`).
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Optional, Protocol, Sequence

if TYPE_CHECKING:  # annotations only: the pre-flight checks import this module without torch
    import torch

    from emma.api.metric import MetricValue

from emma.api.types import AttackOutput, GeneratedImages, PromptRequest
from emma.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """How the target draws images (diffusers' argument names)."""

    num_inference_steps: int
    guidance_scale: float
    height: int
    width: int
    negative_prompt: Optional[str] = None


class WhiteBoxModel(Protocol):
    """Differentiable access to one Stable-Diffusion-family model (SD v1.x / v2.x: one CLIP
    text encoder). Every tensor method keeps the autograd graph of its inputs."""

    tokenizer: Any
    text_encoder: Any
    context_length: int          # tokens per prompt, start and end tokens included
    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int

    def token_ids(self, prompts: Sequence[str]) -> torch.Tensor:
        """``(N, context_length)`` ids, padded as the pipeline pads them."""

    def token_embedding_matrix(self) -> torch.Tensor:
        """``(vocab_size, D)`` input token embeddings (detached)."""

    def encode_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Text-encoder hidden states ``(N, L, D')`` for token ids, as the pipeline uses them."""

    def encode_embeds(self, token_embeds: torch.Tensor) -> torch.Tensor:
        """The same from input token embeddings ``(N, L, D)`` (differentiable)."""

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """VAE latents (mean, scaled) of ``(N, 3, H, W)`` images in [0, 1]."""

    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``x_t`` of the training (DDPM) forward process at integer timesteps ``t``."""

    def denoise(self, noisy_latents: torch.Tensor, t: torch.Tensor,
                encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        """The UNet's noise prediction (differentiable w.r.t. ``encoder_hidden_states``)."""

    def decode_ids(self, ids: Sequence[int]) -> str:
        """Text of token ids (start/end/padding dropped)."""


class ImageSource(Protocol):
    """Generate from prompts or embeddings; one image per (prompt, seed)."""

    def generate(
        self,
        prompts: Sequence[str] | None = None,
        seeds: Sequence[int] = (),
        *,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt: str | None = None,
        progress: bool | str = False,
    ) -> GeneratedImages:
        """Render one image per (prompt or embedding row, seed)."""


class AttackTarget(ImageSource, Protocol):
    """The narrow front an attacker sees.

    Attributes:
        sampler: the sampler settings images are drawn with.
        fingerprint: sha256 of the erased model's weights (keys the attack cache).
    """

    sampler: SamplerSettings
    fingerprint: str

    def score(self, images: torch.Tensor, hashes: Sequence[str] | None = None,
              progress: bool | str = False) -> torch.Tensor:
        """Classifier probabilities for images."""

    def detect(self, probs: torch.Tensor, concept: str) -> torch.Tensor:
        """Boolean presence of ``concept`` given :meth:`score`'s output."""

    def concept_score(self, probs: torch.Tensor, concept: str) -> torch.Tensor:
        """The judge's probability of ``concept`` per image."""

    def excluded(self, probs: torch.Tensor) -> torch.Tensor | None:
        """Images the judge has no verdict on (GCD: no face), or ``None``: every image judged."""

    def judge_key(self) -> str:
        """The judge's identity (its score-cache key): finished attacks are cached per judge."""

    def search_seeds(self, request: PromptRequest, n: int = 1) -> list[int]:
        """``n`` seeds for the search on ``request`` (the protocol's search stream)."""

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """The judge's image features, where it has a feature space (an image similarity, not
        a verdict). Raises :class:`AttackTargetError` otherwise."""

    def white_box(self) -> WhiteBoxModel:
        """The erased model, differentiable. Raises :class:`AttackTargetError` when the
        target has none (e.g. a black-box API)."""

    def base_model(self) -> "BaseModel":
        """The model before erasure. Raises :class:`AttackTargetError` when unavailable."""

    def domain_prompts(self) -> Sequence[str]:
        """Every prompt of the cell's domain (all concepts, all prompt types): the words the
        domain speaks, e.g. a candidate vocabulary for token searches. Raises
        :class:`AttackTargetError` when the target does not know its domain."""

    def domain_requests(self) -> Sequence[PromptRequest]:
        """Every concept's own (EA) requests of the cell's domain, each with the concept it
        names: other concepts' prompts for probes that need them (WhenConceptsErased's
        interference and latent classifier). Raises :class:`AttackTargetError` when the target
        does not know its domain."""


class BaseModel(ImageSource, Protocol):
    """The base (not erased) model: generation plus white-box access."""

    def white_box(self) -> WhiteBoxModel:
        """The base model, differentiable."""


class AttackTargetError(ConfigError):
    """A target that cannot give what an attacker needs."""


class Attacker(abc.ABC):
    """Turns attack requests (target concept + seed prompt) into attack outputs.

    Class attributes declare what the attacker needs from its target:
    ``needs_text_encoder`` (tokenizer + text encoder), ``needs_white_box`` (also UNet and
    VAE, differentiable), ``needs_base_model`` (the model before erasure), and what it does:
    ``uses_judge`` (its search has the judge score images — success checks, a reference
    image's confirmation; a cell's target refuses the judge to an attacker that does not
    declare it, and counts the images judged as ``attack/judged_queries_mean``).

    The search draws its images at ``target.search_seeds(request, n)``; the final images
    (``request.seeds()``, drawn by :func:`emma.attack.judged_outputs`) are never among them
    under a protocol with disjoint seeds (:mod:`emma.protocol`).
    """

    name: ClassVar[str] = "attacker"
    version: ClassVar[str] = "0"
    needs_text_encoder: ClassVar[bool] = False
    needs_white_box: ClassVar[bool] = False
    needs_base_model: ClassVar[bool] = False
    uses_judge: bool = False
    # A probing attacker's result is the images its search judged (an LLM baseline's probes,
    # rated over its image budget; STACE's hypotheses): its search and evaluation are one, so
    # its outputs' seeds are its search's (recorded as such in samples.jsonl).
    probing: ClassVar[bool] = False
    # Optimising attackers are run in batches of requests whose outputs are cached as each
    # batch finishes (:func:`emma.attack.run_attack`); ``requests_per_batch`` sizes them.
    resumable: ClassVar[bool] = False
    requests_per_batch: int = 0

    @abc.abstractmethod
    def attack(self, target: AttackTarget, requests: Sequence[PromptRequest]) -> list[AttackOutput]:
        """One :class:`AttackOutput` per request, in order."""

    def check(self, target: AttackTarget, requests: Sequence[PromptRequest]) -> None:
        """Raise a :class:`emma.errors.ConfigError` when this attack cannot run on ``target``
        for ``requests`` — called before any generation. Subclasses extend it."""
        if self.needs_text_encoder or self.needs_white_box:
            target.white_box()
        if self.needs_base_model:
            target.base_model()

    def budget(self) -> dict[str, int]:
        """The attack's budget per request (``iterations``, ``queries``: images drawn on the
        target at most), recorded in results so that attackers are compared at equal budgets."""
        return {}

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version}

    # Optional capabilities, with the behaviour of an attacker that has none of them.
    def bind_cell(self, output_dir: str | Path, cache_dir: str | Path, info: Mapping[str, Any]) -> None:
        """Called once before :meth:`attack` with the cell's run directory, cache root and
        ``{model, method, domain}``: attackers that write files of their own (STACE's trace
        and report) keep them; the default keeps nothing."""
        return None

    def extra_metrics(self) -> dict[str, MetricValue]:
        """Metrics of the attack beyond the cell's rates (STACE's SIR, EII, ...), read after
        :meth:`attack`; a key here replaces the cell's metric of the same name."""
        return {}

    def notes(self) -> list[str]:
        """Lines for results.json's ``notes`` after :meth:`attack` (e.g. failed LLM calls)."""
        return []

    def cache_inputs(self, target: AttackTarget) -> dict[str, Any]:
        """What the attack's outputs depend on beyond :meth:`config`, the target's model,
        sampler and judge, and the request: keys of the attack cache (e.g. the domain's
        prompts when the candidate tokens come from them). None by default."""
        return {}

    def complete(self) -> bool:
        """Read after :meth:`attack`. False: the attack's result is partial (e.g. LLM calls
        failed and its metrics are null); the cell's results.json is written, but the cell is
        not stored as finished, so the next run attacks again."""
        return True
