"""Stage ``setup``: from a composed configuration to a :class:`CellContext` — the finished-cell
lookup (once), validation (once), and the cell's components built from the config.

A cell whose inputs hash to a stored result stops here (``ctx.finished``): no component is
built and no check that imports torch-heavy modules runs, so serving it stays fast.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from emma import finished
from emma.errors import ConfigError
from emma.stages.context import CellContext

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from emma.api.domain import Domain
    from emma.api.types import PromptRequest
    from emma.generate import Judge


class Judges:
    """The cell's judges, one per classifier config name, built on first use."""

    def __init__(self, cfg: DictConfig, domain: Domain, cache_root: Path) -> None:
        self.cfg, self.domain, self.cache_root = cfg, domain, cache_root
        self.auto = cfg.classifier.get("_target_") is None
        self._judges: dict[str, Judge] = {}
        self._protocol_judges: dict[str, Judge] = {}  # the attack's, when its protocol sets judge rules

    def name_for(self, request: PromptRequest) -> str:
        return self.domain.classifier_for(request) if self.auto else "__chosen__"

    def get(self, name: str) -> Judge:
        import hydra

        from emma.cache import ClassifierScoreCache
        from emma.generate import Judge
        from emma.registry import classifier_config

        if name not in self._judges:
            ccfg = classifier_config(self.cfg, name, self.domain)
            classifier = hydra.utils.instantiate(ccfg, _convert_="all")
            # keyed at use: can_detect may still add labels to an open-vocabulary judge
            self._judges[name] = Judge(classifier, ClassifierScoreCache(self.cache_root, classifier))
        return self._judges[name]

    def for_request(self, request: PromptRequest) -> Judge:
        return self.get(self.name_for(request))

    def with_overrides(self, name: str, overrides: dict) -> Judge:
        """Judge ``name`` with ``overrides`` merged into its config (an attack protocol's
        judge rule, e.g. NudeNet's threshold); its scores are cached under its own key."""
        import hydra
        from omegaconf import OmegaConf

        from emma.cache import ClassifierScoreCache, stable_hash
        from emma.generate import Judge
        from emma.registry import classifier_config

        if not overrides:
            return self.get(name)
        key = f"{name}+{stable_hash(overrides)}"
        if key not in self._protocol_judges:
            ccfg = OmegaConf.merge(classifier_config(self.cfg, name, self.domain), OmegaConf.create(overrides))
            try:
                classifier = hydra.utils.instantiate(ccfg, _convert_="all")
            except Exception as err:  # noqa: BLE001 - Hydra wraps the constructor's own error
                from emma.errors import first_line

                raise ConfigError(f"the protocol's judge settings {overrides} do not apply to classifier "
                                  f"'{name}': {first_line(err.__cause__ or err)}") from None
            self._protocol_judges[key] = Judge(classifier, ClassifierScoreCache(self.cache_root, classifier))
        return self._protocol_judges[key]

    def all(self) -> list[Judge]:
        """The cell's judges (those of the suite), built so far."""
        return list(self._judges.values())

    def protocol_judges(self) -> list[Judge]:
        """Judges an attack protocol configured differently from the cell's."""
        return list(self._protocol_judges.values())


def setup(cfg: DictConfig, *, lookup: bool = True, build: bool = True) -> CellContext:
    """The cell's context: finished-cell lookup, then (for a cell that runs) validation and
    its components.

    Args:
        cfg: the composed cell configuration.
        lookup: serve a finished cell with the same inputs (``False``: build the components
            anyway, for callers that run some stages themselves).
        build: build the components (``False``: the caller checks something cheap first,
            then calls :func:`build_components`).
    """
    cache_root = Path(cfg.paths.cache_dir).expanduser()
    key = finished.cell_key(cfg)  # inputs as they are now, before anything runs
    mark = finished.repair_mark()  # before the lookup: a damaged stored result it repairs is noted
    ctx = CellContext(cfg=cfg, cache_root=cache_root, key=key, seed=int(cfg.seed), repairs_mark=mark,
                      finished=finished.entry(cfg, key, repair=True) if lookup else None)
    if ctx.finished is not None:
        return ctx
    import torch

    from emma.validate import check_cell
    from emma.weights import ENV_CACHE

    os.environ[ENV_CACHE] = str(cache_root)  # one root: weights, FID statistics, downloads follow it
    check_cell(cfg)  # every setting, before any work (threads=0 is refused here, not by torch)
    if cfg.get("threads") is not None:
        torch.set_num_threads(int(cfg.threads))
    if build:
        build_components(ctx)
    return ctx


def build_components(ctx: CellContext) -> None:
    """Domain, concept, requests, judges, method and attacker of ``ctx.cfg``; a judge that
    cannot judge a request's concept is refused here, before any image is drawn."""
    import hydra

    from emma.protocol import resolve as resolve_protocol

    t = time.perf_counter()
    cfg = ctx.cfg
    ctx.domain = domain = hydra.utils.instantiate(cfg.domain, _convert_="all")
    ctx.concept = domain.concept(domain.default_concept if cfg.concept is None else cfg.concept).name
    ctx.judges = Judges(cfg, domain, ctx.cache_root)
    ctx.method = hydra.utils.instantiate(cfg.method, _convert_="all")
    # Reference data the method names for this domain (``<data:NAME>``): fetched, or refused
    # offline here, with the command that fetches it, before any weight is loaded.
    from emma.methods.reference_data import check_available
    check_available(ctx.method.config(), domain.name)
    ctx.attacker = hydra.utils.instantiate(cfg.attacker, _convert_="all")
    ctx.protocol = resolve_protocol(cfg.get("protocol"), ctx.attacker.name)
    ctx.requests = domain.requests(ctx.concept, seed=ctx.seed, images_per_prompt=cfg.images_per_prompt,
                                   types=None if cfg.prompt_types is None else list(cfg.prompt_types))
    for req in ctx.requests:
        classifier = ctx.judges.for_request(req).classifier
        if not classifier.can_detect(req.concept):
            labels = list(classifier.labels)
            raise ConfigError(
                f"classifier '{classifier.name}' cannot judge {req.concept!r} ({req.kind} prompt "
                f"{req.prompt!r}); its labels: {', '.join(labels[:20])}{', ...' if len(labels) > 20 else ''}. "
                "Choose another classifier=..."
            )
    ctx.timing["setup_s"] = time.perf_counter() - t
