"""The state one cell's stages pass forward: :class:`CellContext`.

Each stage (:mod:`emma.stages`) reads the fields earlier stages filled and fills its own; a
field is ``None`` until its stage has run. Nothing else is shared between stages.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # annotations only: a finished cell is served without importing torch
    from omegaconf import DictConfig

    from emma.api.attacker import Attacker
    from emma.api.domain import Domain
    from emma.api.guidance import InferenceGuidance
    from emma.api.method import ErasureMethod
    from emma.api.metric import MetricValue
    from emma.api.types import AttackOutput, PromptRequest, Sample
    from emma.protocol import AttackProtocol


@dataclasses.dataclass
class CellContext:
    """One cell, as it moves through its stages.

    Args:
        cfg: the composed cell configuration (no ``hydra`` node).
        cache_root: the one cache root (images, scores, erased models, weights, results).
        key: the finished-cell key, computed once before any work (:mod:`emma.finished`).
        finished: a stored result with the same inputs (``None``: the cell runs).
        output_dir: where results.json and samples.jsonl go (set when the cell runs).
    """

    cfg: DictConfig
    cache_root: Path
    key: str
    finished: Path | None = None
    output_dir: Path | None = None
    seed: int = 0
    timing: dict[str, float] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    repairs_mark: Any = None
    cache_repairs: int = 0
    # setup
    domain: Domain | None = None
    concept: str = ""
    requests: list[PromptRequest] = dataclasses.field(default_factory=list)
    judges: Any = None  # emma.stages.setup.Judges
    method: ErasureMethod | None = None
    attacker: Attacker | None = None
    protocol: AttackProtocol | None = None  # how the attack is measured (emma.protocol)
    # model
    pipe: Any = None
    base_fingerprint: str = ""
    base_model: Any = None  # emma.attack.LazyBaseModel
    make_generator: Callable[..., Any] | None = None
    domain_prompts: Callable[[], list[str]] | None = None
    domain_requests: Callable[[], list[PromptRequest]] | None = None
    # bias (base images, drawn before erasure edits the pipeline in place)
    bias_sets: list[Any] = dataclasses.field(default_factory=list)
    base_bias: dict[str, Any] = dataclasses.field(default_factory=dict)
    images_generated_before: int = 0
    # erase
    erased: Any = None  # emma.erase.EraseResult
    guidance: InferenceGuidance | None = None
    generator: Any = None  # emma.generate.CachedGenerator of the erased model
    # suite
    suite: list[tuple[PromptRequest, list[Sample]]] = dataclasses.field(default_factory=list)
    suite_records: dict[str, Any] = dataclasses.field(default_factory=dict)
    # attack
    attack_run: Any = None  # emma.attack.AttackRun
    # metrics
    metrics: dict[str, MetricValue] = dataclasses.field(default_factory=dict)
    provenance: dict[str, Any] = dataclasses.field(default_factory=dict)
    extra_lines: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # record
    result: Any = None  # emma.results.CellResult

    @property
    def attack_requests(self) -> list[PromptRequest]:
        """The requests an attacker works on: the erased concept's (EA) prompts, with the
        protocol's images per attacked prompt (the cell's when it sets none)."""
        ea = [r for r in self.requests if r.group == "ea"]
        n = self.protocol.images_per_prompt if self.protocol is not None else None
        return ea if n is None else [dataclasses.replace(r, n_images=int(n)) for r in ea]

    @property
    def samples(self) -> list[Sample]:
        return [s for _, samples in self.suite for s in samples]

    @property
    def outputs(self) -> list[AttackOutput]:
        return self.attack_run.outputs if self.attack_run is not None else []

    @property
    def suite_judge(self) -> Any:
        """The classifier that judges the suite's first request (FID features, bias, results)."""
        return self.judges.for_request(self.requests[0]).classifier
