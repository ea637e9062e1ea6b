"""Structured-config schemas (registered with Hydra's ConfigStore by :func:`emma.registry.register_configs`), and
the conversion of config values to plain Python (:func:`to_python`).

The root schema makes an unknown top-level key fail at compose time; ``ModelConfig`` does
the same for every file in ``conf/model``. Component groups (method, attacker, classifier,
domain) are ``_target_`` + constructor arguments: Hydra's struct mode rejects a misspelt
override (``method.iteratons=5``) at compose time, and the config test instantiates every
file so that a misspelt key inside a YAML fails there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf


@dataclasses.dataclass
class PathsConfig:
    """Args:
        cache_dir: the one root of every cache (images, scores, erased models, weights,
            FID statistics, finished results).
        reuse_results: serve a finished cell whose inputs hash to a stored result from the
            cache (:mod:`emma.finished`); ``false`` recomputes from the image/score caches.
    """

    cache_dir: str = "~/.cache/emma"
    reuse_results: bool = True


@dataclasses.dataclass
class RunConfig:
    """Root schema of ``conf/config.yaml``.

    Args:
        concept: the concept to erase and probe (``null``: the domain's default concept).
        seed: first seed of every prompt's images, and the seed of erasure and bootstrap.
        images_per_prompt: overrides the domain's images per prompt.
        prompt_types: restrict the suite to these prompt types (``[name, random]``).
        threads: torch CPU threads for the cell (``null``: torch's default). Results depend
            on it in the last bits (the order of float reductions): same seed and same
            threads give bit-identical metrics; the count used is in results.json.
        overwrite: replace the results of an earlier cell in the same run directory.
        evidence_images: how many flagged images the cell copies to ``evidence/`` (``null``:
            every judged image, each named in its ``samples.jsonl`` row's ``image``). No number
            depends on it.
    """

    model: Any = MISSING
    method: Any = MISSING
    domain: Any = MISSING
    attacker: Any = MISSING
    protocol: Any = MISSING  # conf/protocol: how the attack's success is measured (emma.protocol)
    classifier: Any = MISSING
    metrics: Any = MISSING
    logger: Any = MISSING
    paths: Any = MISSING
    experiment: Any = None
    llm: Any = None  # conf/llm, composed by attackers that use an LLM (attacker=stace)
    concept: Optional[str] = None
    seed: int = 0
    images_per_prompt: Optional[int] = None
    prompt_types: Optional[list[str]] = None
    threads: Optional[int] = None
    overwrite: bool = False
    evidence_images: Optional[int] = 16


def to_python(x: Any) -> Any:
    """Plain Python of a config value: an OmegaConf container (what ``hydra.utils.instantiate``
    passes to constructors), at any depth, becomes dicts and lists with interpolations
    resolved; a dict, list or tuple is rebuilt (tuples as lists) around its converted items;
    anything else is returned unchanged."""
    if isinstance(x, (DictConfig, ListConfig)):
        return OmegaConf.to_container(x, resolve=True)
    if isinstance(x, Mapping):
        return {k: to_python(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_python(v) for v in x]
    return x
