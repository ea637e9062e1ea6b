"""The no-name validator: implicit prompts must describe a concept without naming it.

EMMA's *short* and *long* descriptions test whether the concept itself was erased, not only
the link from its name; a description that contains the name (or an alias, in any case or
spacing: ``"van gogh"``, ``"VanGogh"``, ``"Van-Gogh"``) tests the name again and must be
rejected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from emma.api.domain import Concept
from emma.domains.text import fold, name_pattern, normalize
from emma.errors import EmmaError


class NameLeakError(EmmaError):
    """Descriptions that contain the name or an alias of the concept they describe."""


@dataclasses.dataclass(frozen=True)
class NameLeak:
    """One occurrence of a forbidden term in a description.

    Args:
        text: the description.
        term: the forbidden term (the concept's name, display name or an alias).
        match: the matched text (case-folded).
        start: character offset of the match in the folded text.
    """

    text: str
    term: str
    match: str
    start: int

    def __str__(self) -> str:
        return f"{self.match!r} (forbidden term {self.term!r}) in {self.text!r}"


def forbidden_terms(concept: Concept | str, extra: Iterable[str] = ()) -> list[str]:
    """The terms a description of ``concept`` may not contain: name, display, aliases."""
    if isinstance(concept, Concept):
        terms = [concept.display, concept.name, *concept.aliases]
    else:
        terms = [concept]
    terms.extend(extra)
    seen: dict[str, str] = {}
    for term in terms:
        if term and normalize(term) and normalize(term) not in seen:
            seen[normalize(term)] = term
    return list(seen.values())


def find_name_leaks(text: str, terms: Iterable[str]) -> list[NameLeak]:
    """All occurrences in ``text`` of any of ``terms`` (see :func:`~emma.domains.text.name_pattern`).

    Args:
        text: the description to check.
        terms: forbidden names and aliases.

    Returns:
        The leaks, in order of position; empty when the text is clean.
    """
    folded = fold(text)
    found: list[tuple[int, int, str]] = []
    for term in terms:
        pattern = name_pattern(term)
        if pattern is None:
            continue
        found.extend((m.start(), m.end(), term) for m in pattern.finditer(folded))
    # one leak per place: "Vincent van Gogh" also contains "Van Gogh" and "Gogh"
    leaks: list[NameLeak] = []
    end = -1
    for start, stop, term in sorted(found, key=lambda f: (f[0], -f[1])):
        if start >= end:
            leaks.append(NameLeak(text=text, term=term, match=folded[start:stop], start=start))
            end = stop
    return leaks


def validate_descriptions(
    concept: Concept | str, descriptions: Sequence[str], extra_terms: Iterable[str] = ()
) -> list[NameLeak]:
    """Leaks of ``concept``'s name or aliases in ``descriptions`` (empty list: all clean)."""
    terms = forbidden_terms(concept, extra_terms)
    return [leak for text in descriptions for leak in find_name_leaks(text, terms)]


def check_descriptions(
    concept: Concept | str, descriptions: Sequence[str], extra_terms: Iterable[str] = ()
) -> None:
    """Raise :class:`NameLeakError` if any description names ``concept``.

    Raises:
        NameLeakError: listing every leak, so that all of them can be fixed at once.
    """
    leaks = validate_descriptions(concept, descriptions, extra_terms)
    if leaks:
        name = concept.label if isinstance(concept, Concept) else concept
        lines = "\n  ".join(str(leak) for leak in leaks)
        n_texts = len({leak.text for leak in leaks})
        raise NameLeakError(
            f"{n_texts} description(s) of {name!r} contain its name or an alias; "
            f"descriptions must describe the concept without naming it:\n  {lines}"
        )
