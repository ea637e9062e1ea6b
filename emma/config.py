"""Structured-config schemas, registered with Hydra's ConfigStore.

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

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from emma import registry
from emma.errors import UnknownChoiceError
from emma.model_config import ModelConfig


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
    llm: Any = None  # conf/llm, composed by attackers that use an LLM (attacker=stace)
    concept: Optional[str] = None
    seed: int = 0
    images_per_prompt: Optional[int] = None
    prompt_types: Optional[list[str]] = None
    threads: Optional[int] = None
    overwrite: bool = False


_DOMAINS: dict[str, Any] = {}


def build_domain(domain_cfg: DictConfig) -> Any:
    """The Domain a ``conf/domain`` node builds (cached per config: suites read files)."""
    import hydra

    key = OmegaConf.to_yaml(domain_cfg)
    if key not in _DOMAINS:
        _DOMAINS[key] = hydra.utils.instantiate(domain_cfg, _convert_="all")
    return _DOMAINS[key]


def other_concepts(domain: str, _root_: DictConfig) -> ListConfig:
    """``${emma.other_concepts:tinyworld}``: every concept of domain ``domain`` except the
    cell's concept (the domain's default concept when ``concept`` is null).

    Presets use it for the concepts a method preserves or contrasts with, so that one preset
    serves every concept of a domain. The resolved list shows in ``--cfg job`` and
    results.json, and is hashed into the erased-model cache key with the method's config.
    """
    if _root_.domain.get("name") == domain:
        dcfg = _root_.domain
    else:
        dcfg = registry.load("domain", domain, what="domain (in ${emma.other_concepts:...})")
    built = build_domain(dcfg)
    concept = _root_.get("concept")
    if concept is None and _root_.domain.get("name") == domain:
        concept = built.default_concept
    if concept is not None:
        try:
            concept = built.concept(concept).name
        except UnknownChoiceError:
            pass  # the cell's own concept check reports it
    return ListConfig([c for c in built.concepts if c != concept])


def register_configs() -> None:
    if not OmegaConf.has_resolver("emma.other_concepts"):
        OmegaConf.register_new_resolver("emma.other_concepts", other_concepts)
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="paths", name="paths_schema", node=PathsConfig)


def classifier_config(cfg: DictConfig, name: str | None, domain: Any) -> DictConfig:
    """The classifier config: the ``classifier`` group's choice, or — when that choice is
    ``auto`` — the file ``conf/classifier/<name>.yaml`` the domain asks for, with keys added
    on the command line (``+classifier.threshold=0.6``) merged in."""
    ccfg = cfg.classifier
    if ccfg.get("_target_") is None:
        if name == "auto" or name not in registry.choices("classifier"):
            valid = [c for c in registry.choices("classifier") if c != "auto"]
            raise UnknownChoiceError(f"classifier (asked for by domain '{domain.name}')", str(name), valid)
        base = registry.load("classifier", name)
        overrides = {k: v for k, v in OmegaConf.to_container(ccfg).items() if k != "name"}
        ccfg = OmegaConf.merge(base, overrides)
    return ccfg


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
