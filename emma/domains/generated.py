"""Our own prompt content (``suite.source=generated``).

*name* and *prefix* prompts come from the domain's template and prefix words; *variant*,
*short* and *long* come from authored data files
(``emma/domains/data/descriptions/<domain>.yaml``, written by hand or by
``scripts/generate_descriptions.py`` and checked by the no-name validator); RA *random* is a
fixed pseudo-random draw and RA *similar* the domain's curated list.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import yaml

from emma.api.domain import Domain, PromptSuite
from emma.domains.text import PREFIX_CATEGORIES, normalize, render
from emma.domains.validate import check_descriptions
from emma.errors import ConfigError

#: Counts EMMA uses per concept (paper §3.2): 10 variants, 5 short and 5 long descriptions.
N_VARIANTS, N_SHORT, N_LONG = 10, 5, 5


@dataclasses.dataclass(frozen=True)
class AuthoredContent:
    """Variants and descriptions of one concept.

    Args:
        variants: synonyms, aliases or nicknames (EMMA *variant*); empty where the concept
            has none (celebrities, artists).
        short: concise descriptions that never name the concept (EMMA *short*).
        long: detailed descriptions that never name the concept (EMMA *long*).
        source: who wrote them (``"authored"`` or ``"llm:<model>"``).
    """

    variants: tuple[str, ...] = ()
    short: tuple[str, ...] = ()
    long: tuple[str, ...] = ()
    source: str = "authored"

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "variants": list(self.variants), "short": list(self.short),
                "long": list(self.long)}


def descriptions_path(domain: str) -> Path:
    """The packaged authored-content file of ``domain`` (it may not exist)."""
    root = importlib.resources.files("emma.domains") / "data" / "descriptions" / f"{domain}.yaml"
    return Path(str(root))


def load_authored(domain: Domain, path: str | os.PathLike | None = None,
                  *, validate: bool = True) -> dict[str, AuthoredContent]:
    """Authored variants/descriptions per canonical concept name of ``domain``.

    Args:
        domain: the domain; concept keys of the file are resolved through its aliases.
        path: the data file (default: :func:`descriptions_path`); a missing default file
            means no authored content.
        validate: run the no-name validator on every description (raises on leaks).

    Raises:
        ConfigError: malformed file or a concept the domain does not have.
        NameLeakError: a description names its concept.
    """
    file = Path(path) if path is not None else descriptions_path(domain.name)
    if not file.is_file():
        if path is not None:
            raise ConfigError(f"authored descriptions file {file} does not exist")
        return {}
    data = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
    entries = data.get("concepts")
    if not isinstance(entries, Mapping):
        raise ConfigError(f"{file}: expected a top-level `concepts:` mapping")
    out: dict[str, AuthoredContent] = {}
    for key, entry in entries.items():
        concept = domain.concept(str(key))
        unknown = set(entry) - {"variants", "short", "long", "source"}
        if unknown:
            raise ConfigError(f"{file}: concept {key!r} has unknown fields {sorted(unknown)}; "
                              "valid: variants, short, long, source")
        content = AuthoredContent(
            variants=tuple(entry.get("variants") or ()), short=tuple(entry.get("short") or ()),
            long=tuple(entry.get("long") or ()), source=str(entry.get("source", "authored")),
        )
        if validate:
            check_descriptions(concept, [*content.short, *content.long])
        out[concept.name] = content
    return out


class GeneratedSuite(PromptSuite):
    """Prompts built from templates, prefix words and authored data (no EMMA files needed).

    Args:
        descriptions: authored-content file (default: the packaged file of the domain).

    A concept without authored content has only *name*, *prefix*, *random* and *similar*
    prompts; :meth:`missing` says which types are absent.
    """

    name: ClassVar[str] = "generated"
    version: ClassVar[str] = "1"

    def __init__(self, descriptions: str | None = None) -> None:
        self.descriptions = descriptions
        self._authored: dict[str, dict[str, AuthoredContent]] = {}
        self._files: dict[str, str | None] = {}

    def authored(self, domain: Domain) -> dict[str, AuthoredContent]:
        """Authored content of ``domain`` (loaded and validated once)."""
        if domain.name not in self._authored:
            self._authored[domain.name] = load_authored(domain, self.descriptions)
            file = Path(self.descriptions) if self.descriptions else descriptions_path(domain.name)
            self._files[domain.name] = (
                hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else None)
        return self._authored[domain.name]

    def prefix_words(self, domain: Domain, concept: str) -> list[str]:
        """The prefix words for ``concept``: a fixed draw of N per category, in category order.

        A word equal to the concept (or one of its aliases) is never drawn.
        """
        per = getattr(domain, "prefixes_per_category", 2)
        c = domain.concepts[concept]
        own = {normalize(t) for t in (c.name, c.display, *c.aliases) if t}
        words: list[str] = []
        for category in PREFIX_CATEGORIES:
            pool = [w for w in domain.prefixes.get(category, []) if normalize(w) not in own]
            if len(pool) < per:
                raise ConfigError(
                    f"domain {domain.name!r}: prefix category {category!r} has {len(pool)} usable "
                    f"words for {concept!r}, needs {per}")
            salt = f"{domain.name}/{concept}/{category}/"
            ranked = sorted(pool, key=lambda w, s=salt: hashlib.sha256((s + w).encode()).hexdigest())
            words.extend(ranked[:per])
        return words

    def prompts(self, domain: Domain, concept: str) -> dict[str, list[tuple[str, str]]]:
        c = domain.concepts[concept]
        template = domain.template
        joiner = getattr(domain, "prefix_joiner", "")
        display = getattr(domain, "display_name", lambda n: n)
        out: dict[str, list[tuple[str, str]]] = {
            "name": [(render(template, c.label), c.name)],
            "prefix": [(render(template, f"{w}{joiner}{c.label}"), c.name)
                       for w in self.prefix_words(domain, concept)],
        }
        content = self.authored(domain).get(c.name)
        if content is not None:
            if getattr(domain, "has_variants", True) and content.variants:
                out["variant"] = [(render(template, v), c.name) for v in content.variants]
            if content.short:
                out["short"] = [(s, c.name) for s in content.short]
            if content.long:
                out["long"] = [(s, c.name) for s in content.long]
        out["random"] = [(render(template, display(o)), o) for o in domain.random_concepts(c.name)]
        similar = domain.similar.get(c.name, [])
        if similar:
            out["similar"] = [(render(template, display(o)), o) for o in similar]
        return out

    def missing(self, domain: Domain, concept: str) -> list[str]:
        """EA prompt types ``concept`` lacks because no content was authored for it."""
        have = self.prompts(domain, domain.concept(concept).name)
        wanted = ["variant", "short", "long"] if getattr(domain, "has_variants", True) else [
            "short", "long"]
        return [k for k in wanted if k not in have]

    def config(self) -> dict[str, Any]:
        return {**super().config(), "descriptions": self.descriptions,
                "descriptions_sha256": dict(self._files)}
