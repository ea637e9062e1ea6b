"""Structured-config schemas, registered with Hydra's ConfigStore.

The root schema makes an unknown top-level key fail at compose time; ``ModelConfig`` does
the same for every file in ``conf/model``. Component groups (method, attacker, classifier,
domain) are ``_target_`` + constructor arguments: Hydra's struct mode rejects a misspelt
override (``method.iteratons=5``) at compose time, and the config test instantiates every
file so that a misspelt key inside a YAML fails there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from emma.pipelines import ModelConfig

GROUPS: tuple[str, ...] = ("model", "method", "domain", "attacker", "classifier", "metrics",
                           "logger", "paths", "experiment")


@dataclasses.dataclass
class PathsConfig:
    cache_dir: str = "~/.cache/emma"


@dataclasses.dataclass
class RunConfig:
    """Root schema of ``conf/config.yaml``.

    Args:
        concept: the concept to erase and probe (``null``: the domain's default concept).
        seed: first seed of every prompt's images, and the seed of erasure and bootstrap.
        images_per_prompt: overrides the domain's images per prompt.
        prompt_types: restrict the suite to these prompt types (``[name, random]``).
    """

    model: Any = MISSING
    method: Any = MISSING
    domain: Any = MISSING
    attacker: Any = MISSING
    classifier: Any = MISSING
    metrics: Any = MISSING
    logger: Any = MISSING
    paths: Any = MISSING
    experiment: Any = None
    concept: Optional[str] = None
    seed: int = 0
    images_per_prompt: Optional[int] = None
    prompt_types: Optional[list[str]] = None


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="paths", name="paths_schema", node=PathsConfig)
