"""EMMA's concept domains, configured by ``conf/domain/<name>.yaml``.

A domain file lists the concepts (canonical name, display name, aliases, and the similar
concepts used by RA *similar*), the EMMA template, the prefix words per category, the RA
counts, the default classifier, images per prompt and a ``version``; ``suite.source``
chooses who writes the prompts (EMMA's published files or our own generated content) among
the ``suites`` the file names (source -> :class:`~emma.api.domain.PromptSuite` class)::

    domain = load_domain("object", ["suite.source=generated"])
    domain.requests("airplane", seed=0)
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from emma import registry
from emma.api.domain import Concept, Domain, PromptSuite
from emma.api.types import PromptRequest
from emma.config import to_python
from emma.domains.text import PREFIX_CATEGORIES, normalize
from emma.errors import ConfigError, EmmaError, UnknownChoiceError

logger = logging.getLogger(__name__)

#: Classifier names a domain may use (besides any ``conf/classifier/<name>.yaml``).
KNOWN_CLASSIFIERS: tuple[str, ...] = (
    "ml_decoder", "gcd", "style_vit", "nudenet", "q16", "yolo_logo", "clip_zero_shot",
    "vlm_judge", "tinyworld",
)


def _classifier_configs() -> set[str]:
    """The classifier choices of the registry (a new classifier needs no edit here)."""
    return set(registry.choices("classifier"))


def _concept_from(entry: str | Mapping[str, Any]) -> Concept:
    if isinstance(entry, str):
        return Concept(name=entry)
    return Concept(name=entry["name"], display=entry.get("display") or "",
                   aliases=tuple(entry.get("aliases") or ()))


class EmmaDomain(Domain):
    """A :class:`~emma.api.domain.Domain` with EMMA's extra knobs.

    Args:
        emma_dir: folder of this domain in EMMA's ``prompts/`` (``"art"`` for style), or
            ``None`` when EMMA publishes no prompts for it.
        excluded: concepts deliberately left out, with the reason (object: ``person``).
        has_variants: whether the *variant* prompt type exists (EMMA: not for celebrity and
            style, which have no synonyms).
        prefix_joiner: what joins a prefix word and the concept (EMMA glues them: ``""``).
        prefixes_per_category: prefix words drawn per category (EMMA: 2, so 10 prompts).
        n_similar: RA *similar* concepts per target (EMMA: 5).
        similar_in_domain: whether similar concepts are concepts of this domain (EMMA: yes,
            except NSFW, whose similar concepts are safe look-alikes).
        random_pool_concepts: concepts RA *random* draws from when they live outside this
            domain (NSFW draws from the object domain), used for display names and lookup.
        random_from: name of the domain the random pool comes from (recorded in configs).
        classifier_overrides: ``{"concept": {name: classifier}, "kind": {kind: classifier}}``
            for requests that the default classifier cannot judge.
        classifier_labels: name of a known label list (``"gcd"``, ``"style_vit"``) that the
            default classifier detects; the EMMA reader reports concepts missing from it.
        description: one line on what the domain tests.
        **kwargs: passed to :class:`~emma.api.domain.Domain`.
    """

    def __init__(
        self,
        *,
        emma_dir: str | None = None,
        excluded: Mapping[str, str] | None = None,
        has_variants: bool = True,
        prefix_joiner: str = "",
        prefixes_per_category: int = 2,
        n_similar: int = 5,
        similar_in_domain: bool = True,
        random_pool_concepts: Sequence[Concept] = (),
        random_from: str | None = None,
        classifier_overrides: Mapping[str, Mapping[str, str]] | None = None,
        classifier_labels: str | None = None,
        description: str = "",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.emma_dir = emma_dir
        self.excluded = dict(excluded or {})
        self.has_variants = bool(has_variants)
        self.prefix_joiner = prefix_joiner
        self.prefixes_per_category = int(prefixes_per_category)
        self.n_similar = int(n_similar)
        self.similar_in_domain = bool(similar_in_domain)
        self.random_pool_concepts = {c.name: c for c in random_pool_concepts}
        self.random_from = random_from
        self.classifier_overrides = {k: dict(v) for k, v in (classifier_overrides or {}).items()}
        self.classifier_labels = classifier_labels
        self.description = description
        self._index: dict[str, dict[str, str]] = {}
        self._check()

    # -- validation ------------------------------------------------------------------------
    def _check(self) -> None:
        if "{c}" not in self.template:
            raise ConfigError(f"domain {self.name!r}: template {self.template!r} has no {{c}}")
        missing = [c for c in PREFIX_CATEGORIES if c not in self.prefixes]
        unknown = [c for c in self.prefixes if c not in PREFIX_CATEGORIES]
        if missing or unknown:
            raise ConfigError(
                f"domain {self.name!r}: prefixes must have exactly the categories "
                f"{list(PREFIX_CATEGORIES)}; missing {missing}, unknown {unknown}"
            )
        for known, what in ((self.classifier, "classifier"),
                            *((v, "classifier override") for m in self.classifier_overrides.values()
                              for v in m.values())):
            if known not in KNOWN_CLASSIFIERS and known not in _classifier_configs():
                raise UnknownChoiceError(f"{what} of domain {self.name!r}", known,
                                         sorted({*KNOWN_CLASSIFIERS, *_classifier_configs()}))
        for concept, similar in self.similar.items():
            if concept not in self.concepts:
                raise UnknownChoiceError(f"concept of domain {self.name!r} (in `similar`)",
                                         concept, self.concepts)
            if concept in similar:
                raise ConfigError(f"domain {self.name!r}: {concept!r} is listed as similar to itself")
            if self.similar_in_domain:
                for other in similar:
                    if other not in self.concepts:
                        raise UnknownChoiceError(
                            f"similar concept of {concept!r} in domain {self.name!r}", other,
                            self.concepts)
        clash = set(self.excluded) & set(self.concepts)
        if clash:
            raise ConfigError(f"domain {self.name!r}: {sorted(clash)} are both concepts and excluded")

    # -- lookup ----------------------------------------------------------------------------
    def concept(self, name: str) -> Concept:
        """Look up a concept by name or alias; excluded concepts say why they are excluded."""
        for excluded, reason in self.excluded.items():
            if normalize(name) == normalize(excluded):
                raise UnknownChoiceError(
                    f"concept of domain '{self.name}' ({excluded!r} is excluded: {reason})",
                    name, self.concepts)
        try:
            return super().concept(name)
        except UnknownChoiceError:
            # any spelling of the name, display name or an alias ("Tom Hanks", "baseballbat")
            resolved = self.resolve(name)
            if resolved is None:
                raise
            return self.concepts[resolved]

    def _lookup(self, where: str) -> dict[str, str]:
        if where not in self._index:
            source = list(self.concepts.values())
            if where == "random":  # the pool first: NSFW's "apple" is COCO's apple
                source = [*self.random_pool_concepts.values(), *source]
            index: dict[str, str] = {}
            for c in source:
                for term in (c.name, c.display, *c.aliases):
                    if term:
                        index.setdefault(normalize(term), c.name)
            self._index[where] = index
        return self._index[where]

    def resolve(self, text: str, where: str = "domain") -> str | None:
        """Canonical name of the concept spelled ``text`` (any case or spacing), or ``None``.

        Args:
            text: a concept as written in a prompt (``"parking meter"``, ``"barack-obama"``).
            where: ``"domain"`` (this domain's concepts) or ``"random"`` (the RA random pool
                when it comes from another domain).
        """
        if where not in ("domain", "random"):
            raise ValueError(f"where must be 'domain' or 'random', not {where!r}")
        return self._lookup(where).get(normalize(text))

    def display_name(self, name: str) -> str:
        """How a concept is written in prompts (concepts of this domain or of the random pool)."""
        concept = self.concepts.get(name) or self.random_pool_concepts.get(name)
        return concept.label if concept else name

    def classifier_for(self, request: PromptRequest) -> str:
        """The classifier config that judges ``request`` (per-concept, then per-kind override)."""
        by_concept = self.classifier_overrides.get("concept", {})
        if request.group == "ea" and request.concept in by_concept:
            return by_concept[request.concept]
        return self.classifier_overrides.get("kind", {}).get(request.kind, self.classifier)

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg.update(
            template=self.template, classifier=self.classifier, n_random=self.n_random,
            n_similar=self.n_similar, images_per_prompt=self.images_per_prompt,
            n_concepts=len(self.concepts), random_from=self.random_from,
            classifier_overrides=self.classifier_overrides,
        )
        return cfg


# -- building from config --------------------------------------------------------------------

def available_domains() -> list[str]:
    """Names of the domain configs (the registry's ``domain`` choices)."""
    return registry.choices("domain")


def load_domain_config(name: str, overrides: Iterable[str] = ()) -> DictConfig:
    """The config of ``conf/domain/<name>.yaml`` with dot-list ``overrides``, in struct mode.

    Args:
        name: domain config name (``object``, ``celebrity``, ...).
        overrides: ``key=value`` strings relative to the domain (``suite.source=generated``);
            unknown keys fail, as under Hydra.

    Raises:
        UnknownChoiceError: no such domain config.
        ConfigError: an override names a key the domain config does not have.
    """
    cfg = OmegaConf.create(registry.config_path("domain", name).read_text(encoding="utf-8"))
    OmegaConf.set_struct(cfg, True)
    problems = []
    for override in overrides:  # one at a time, so every bad one is named
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([override]))
        except OmegaConfBaseException as exc:
            problems.append(_explain_override(cfg, name, override, exc))
    if problems:
        raise ConfigError("\n".join(problems) if len(problems) == 1 else
                          f"{len(problems)} bad overrides:\n" + "\n".join(f"  {p}" for p in problems))
    return cfg


def _explain_override(cfg: DictConfig, name: str, override: str, exc: Exception) -> str:
    """``key=value: unknown key of domain 'x'; did you mean ...? valid keys ...`` in one line."""
    import difflib

    key = override.split("=", 1)[0]
    node: Any = cfg
    path: list[str] = []
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            valid = sorted(str(k) for k in node.keys()) if isinstance(node, DictConfig) else []
            close = difflib.get_close_matches(part, valid, n=3, cutoff=0.5)
            where = f"'{'.'.join(path)}'" if path else "the top level"
            hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
            return (f"{override}: unknown key of domain {name!r}; {hint}valid keys at {where}: "
                    f"{', '.join(valid) or '(none)'}")
        path.append(part)
        node = node[part]
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{override}: {first}"


def load_domain(name: str, overrides: Iterable[str] = ()) -> Domain:
    """Build the domain of ``conf/domain/<name>.yaml`` as the runner does (``_target_``)."""
    import hydra.utils
    from hydra.errors import InstantiationException

    try:
        return hydra.utils.instantiate(load_domain_config(name, overrides))
    except InstantiationException as exc:
        # Hydra wraps the builder's error; the harness's own errors already teach
        if isinstance(exc.__cause__, EmmaError):
            raise exc.__cause__ from None
        if isinstance(exc.__cause__, (ValueError, TypeError)):  # a value of the wrong type
            raise ConfigError(f"domain {name!r} with {list(overrides)}: {exc.__cause__}") from None
        raise


def _build_suite(domain_name: str, suite: Any, suites: Mapping[str, str] | None) -> PromptSuite:
    """The suite ``suite.source`` names among the domain's ``suites`` (source -> class path),
    built with the options of ``suite`` that its class takes (the others are warned about)."""
    if isinstance(suite, PromptSuite):
        return suite
    if not suites:
        raise ConfigError(f"domain {domain_name!r} lists no `suites` (suite.source -> PromptSuite "
                          "class, e.g. generated: emma.domains.generated.GeneratedSuite)")
    cfg = dict(to_python(suite) or {})
    source = cfg.pop("source", next(iter(suites)))
    if source not in suites:
        raise UnknownChoiceError(f"suite.source of domain {domain_name!r}", source, suites)
    cls = _suite_class(domain_name, source, suites[source])
    takes = [n for n, p in inspect.signature(cls).parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    ignored = {k: v for k, v in cfg.items() if k not in takes and v not in (None, False)}
    if ignored:
        logger.warning("domain %s: suite options %s do not apply to suite.source=%s",
                       domain_name, sorted(ignored), source)
    return cls(**{k: cfg[k] for k in takes if k in cfg})


def _suite_class(domain_name: str, source: str, path: str) -> type[PromptSuite]:
    """The :class:`PromptSuite` class at ``path`` (``suites.<source>`` of a domain config)."""
    import hydra.utils

    try:
        cls = hydra.utils.get_class(path)
    except Exception as exc:  # Hydra raises ImportError or ValueError, wrapped variously
        raise ConfigError(f"domain {domain_name!r}: suites.{source} = {path!r} is not an importable "
                          f"class ({str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r})"
                          ) from None
    if not issubclass(cls, PromptSuite):
        raise ConfigError(f"domain {domain_name!r}: suites.{source} = {path!r} is not a PromptSuite")
    return cls


def build_domain(
    name: str,
    version: str,
    concepts: Sequence[str | Mapping[str, Any]],
    template: str,
    suite: Mapping[str, Any] | PromptSuite,
    prefixes: Mapping[str, Sequence[str]],
    classifier: str,
    suites: Mapping[str, str] | None = None,
    n_random: int = 10,
    n_similar: int = 5,
    images_per_prompt: int = 30,
    random_from: str | None = None,
    random_pool: Sequence[str | Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> EmmaDomain:
    """Build an :class:`EmmaDomain` from a ``conf/domain`` file (the ``_target_``).

    Args:
        name: domain name.
        version: bumped whenever concepts or prompts change.
        concepts: ``{name, display, aliases, similar}`` mappings (or bare names).
        template: the EMMA template with ``{c}``.
        suite: ``{source: <a key of suites>, <options of that suite>...}`` or a ready
            :class:`~emma.api.domain.PromptSuite`.
        prefixes: prefix words per category (:data:`PREFIX_CATEGORIES`).
        classifier: default judge (a ``conf/classifier`` name).
        suites: ``suite.source`` -> class path of the :class:`~emma.api.domain.PromptSuite`
            that writes the prompts (``generated: emma.domains.generated.GeneratedSuite``);
            the first is the default source.
        n_random: RA random concepts per target.
        n_similar: RA similar concepts per target.
        images_per_prompt: images per prompt (EMMA: 30).
        random_from: draw RA random concepts from this other domain (NSFW: ``object``).
        random_pool: or from this explicit list of concepts.
        **kwargs: further :class:`EmmaDomain` arguments (``emma_dir``, ``excluded``, ...).
    """
    concepts = to_python(concepts)
    random_pool = to_python(random_pool)
    kwargs = {k: to_python(v) for k, v in kwargs.items()}
    similar = {}
    for entry in concepts:
        if isinstance(entry, Mapping) and entry.get("similar"):
            similar[entry["name"]] = list(entry["similar"])
    if random_from is not None and random_pool is not None:
        raise ConfigError(f"domain {name!r}: set random_from or random_pool, not both")
    pool_concepts: list[Concept] = []
    pool_names: list[str] | None = None
    if random_from is not None:
        other = to_python(load_domain_config(random_from))
        pool_concepts = [_concept_from(c) for c in other["concepts"]]
        pool_names = [c.name for c in pool_concepts]
    elif random_pool is not None:
        pool_concepts = [_concept_from(c) for c in random_pool]
        pool_names = [c.name for c in pool_concepts]
    return EmmaDomain(
        name=name, version=str(version), concepts=concepts, suite=_build_suite(name, suite, to_python(suites)),
        template=template, prefixes=to_python(prefixes), similar=similar, n_random=n_random,
        n_similar=n_similar, random_pool=pool_names, classifier=classifier,
        images_per_prompt=images_per_prompt, random_pool_concepts=pool_concepts,
        random_from=random_from, **kwargs,
    )
