"""The Domain / PromptSuite roles: which concepts exist, and which prompts probe them."""

from __future__ import annotations

import abc
import dataclasses
import hashlib
from typing import Any, ClassVar, Mapping, Sequence

from emma.api.types import EA_TYPES, RA_TYPES, PromptRequest
from emma.errors import ConfigError, UnknownChoiceError


@dataclasses.dataclass(frozen=True)
class Concept:
    """A concept of a domain: canonical ``name`` plus ``aliases`` (synonyms, spellings)."""

    name: str
    display: str = ""
    aliases: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return self.display or self.name


class PromptSuite(abc.ABC):
    """Produces the EA/RA prompts of one concept of a domain.

    ``prompts`` returns, per prompt type (``name``, ``prefix``, ``variant``, ``short``,
    ``long``, ``random``, ``similar``), a list of ``(prompt, concept_to_check)`` pairs. A type
    the suite does not have (e.g. ``variant`` for celebrities) is simply absent.
    """

    name: ClassVar[str] = "suite"
    version: ClassVar[str] = "0"

    @abc.abstractmethod
    def prompts(self, domain: "Domain", concept: str) -> dict[str, list[tuple[str, str]]]:
        """Prompts per type for ``concept``."""

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version}


class Domain:
    """A concept domain (objects, celebrities, styles, ... or the tiny world).

    Args:
        name: domain name (the conf/domain file name).
        version: bumped whenever prompts or concepts change.
        concepts: concept names, or mappings ``{name, display, aliases}``.
        template: the EMMA template with ``{c}`` for the concept (``"an image of the {c}"``).
        prefixes: prefix words per category (noun, adjective, emotion, verb_ing, preposition).
        similar: per concept, the visually/semantically similar non-target concepts.
        n_random: number of random non-target concepts (RA random).
        random_pool: concepts RA random draws from (default: this domain's other concepts).
        classifier: name of the default judge (a conf/classifier file).
        images_per_prompt: images per prompt (EMMA: 30).
        suite: the :class:`PromptSuite` that produces prompts.
    """

    def __init__(
        self,
        name: str,
        version: str,
        concepts: Sequence[str | Mapping[str, Any]],
        suite: PromptSuite,
        template: str = "{c}",
        prefixes: Mapping[str, Sequence[str]] | None = None,
        similar: Mapping[str, Sequence[str]] | None = None,
        n_random: int = 10,
        random_pool: Sequence[str] | None = None,
        classifier: str = "clip_zero_shot",
        images_per_prompt: int = 30,
        default_concept: str | None = None,
        **extra: Any,
    ) -> None:
        self.name, self.version = name, str(version)
        self.concepts: dict[str, Concept] = {}
        for c in concepts:
            if isinstance(c, str):
                concept = Concept(name=c)
            else:
                concept = Concept(
                    name=c["name"], display=c.get("display", ""),
                    aliases=tuple(c.get("aliases", ()) or ()),
                )
            self.concepts[concept.name] = concept
        self.suite = suite
        self.template = template
        self.prefixes = {k: list(v) for k, v in (prefixes or {}).items()}
        self.similar = {k: list(v) for k, v in (similar or {}).items()}
        self.n_random = int(n_random)
        self.random_pool = list(random_pool) if random_pool else None
        self.classifier = classifier
        self.images_per_prompt = int(images_per_prompt)
        self.default_concept = default_concept or next(iter(self.concepts), None)
        self.extra = dict(extra)

    # --- quality stages (FID, bias): what the domain offers them ------------------------------

    #: Bias attributes measured when ``metrics.bias.attributes`` is null (EMMA's people sets).
    bias_attributes: ClassVar[tuple[str, ...]] = ("gender", "ethnicity")

    def bias_prompt_set(self, attribute: str, seed: int = 0) -> Any:
        """The :class:`~emma.datasets.bias.BiasPromptSet` of ``attribute`` (EMMA's person
        templates; a domain with its own attributes overrides this)."""
        from emma.datasets.bias import bias_prompt_set

        return bias_prompt_set(attribute, seed=seed)

    def reference_images(self, concepts: Sequence[str], n: int, seed: int) -> Any:
        """``n`` reference images (float ``[n, 3, H, W]`` in [0, 1], like generated images)
        drawn with the suite's prompt mix ``concepts``, for a domain that can render its own
        ground truth; ``None`` (the default) means the configured reference statistics (COCO)
        and Inception/CLIP features. A domain that renders references is judged in its classifier's feature space (the
        judge's ``features``) for FID and bias similarity."""
        return None

    #: Names the rendered reference in results (``<reference_name>-suite-mix``).
    reference_name: ClassVar[str] = ""

    def reference_version(self) -> str:
        """Changes whenever :meth:`reference_images` would draw other images."""
        return ""

    def concept(self, name: str) -> Concept:
        """Look up a concept by name or alias (case-insensitive); clear error if unknown."""
        if name in self.concepts:
            return self.concepts[name]
        low = name.lower()
        for c in self.concepts.values():
            if low == c.name.lower() or low in (a.lower() for a in c.aliases):
                return c
        raise UnknownChoiceError("concept", name, self.concepts, where=f"domain '{self.name}'")

    def random_concepts(self, concept: str) -> list[str]:
        """RA random concepts for ``concept``: a fixed pseudo-random draw (by name)."""
        pool = [c for c in (self.random_pool or list(self.concepts)) if c != concept]
        excluded = set(self.similar.get(concept, ()))
        pool = [c for c in pool if c not in excluded] or pool
        key = lambda c: hashlib.sha256(f"{self.name}/{concept}/{c}".encode()).hexdigest()  # noqa: E731
        return sorted(pool, key=key)[: self.n_random]

    def requests(
        self, concept: str, *, seed: int = 0, images_per_prompt: int | None = None,
        types: Sequence[str] | None = None,
    ) -> list[PromptRequest]:
        """EA and RA requests for ``concept`` (``types`` restricts the prompt types)."""
        name = self.concept(concept).name
        n = self.images_per_prompt if images_per_prompt is None else int(images_per_prompt)
        if n < 1:
            raise ConfigError(f"images_per_prompt={n}: must be at least 1 "
                              f"(null: the domain's {self.images_per_prompt})")
        prompts = self.suite.prompts(self, name)
        if types is not None:
            types = list(types)
            if not types:
                raise ConfigError(f"prompt_types=[]: give at least one of {', '.join(prompts)}, or null for all")
            for kind in types:
                if kind not in prompts:
                    raise UnknownChoiceError(f"prompt type of {self.name}/{name}", kind, prompts)
        out: list[PromptRequest] = []
        for kind, items in prompts.items():
            if types is not None and kind not in types:
                continue
            group = "ea" if kind in EA_TYPES else "ra" if kind in RA_TYPES else "attack"
            for prompt, checked in items:
                out.append(PromptRequest(prompt=prompt, concept=checked, group=group,
                                         kind=kind, seed=seed, n_images=n))
        return out

    def classifier_for(self, request: PromptRequest) -> str:
        """Name of the judge (a conf/classifier file) for ``request``; domains whose prompt
        types need different judges (EMMA's nsfw RA prompts check object labels) override it."""
        return self.classifier

    @property
    def data_files(self) -> dict[str, str]:
        """Local data files the domain's prompts come from (name -> path); results.json
        records their sha256 (``versions.data_files``). None by default."""
        return {}

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "suite": self.suite.config()}
