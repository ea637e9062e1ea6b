"""Small text helpers shared by the prompt suites: folding, templates, name matching, and
EMMA's prefix categories (what both the domains and the suites build prefix prompts from)."""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

PLACEHOLDER = "{c}"

#: EMMA's prefix categories (paper §3.2 and appendix 6.1), in the order prompts are built.
PREFIX_CATEGORIES: tuple[str, ...] = ("noun", "adjective", "emotion", "verb_ing", "preposition")


def fold(text: str) -> str:
    """Case- and accent-insensitive form of ``text`` (``"Dalí"`` -> ``"dali"``)."""
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(ch for ch in decomposed if not unicodedata.combining(ch)).casefold()


def normalize(text: str) -> str:
    """Letters and digits only, folded: ``"M.C. Escher"``, ``"m.c.-escher"`` -> ``"mcescher"``."""
    return re.sub(r"[^a-z0-9]", "", fold(text))


def render(template: str, concept: str) -> str:
    """Put ``concept`` into ``template`` at ``{c}`` (no ``str.format``: names may hold braces)."""
    return template.replace(PLACEHOLDER, concept)


@lru_cache(maxsize=64)
def template_regex(template: str) -> re.Pattern[str]:
    """A regex that matches prompts made from ``template`` and captures the concept as ``c``."""
    if PLACEHOLDER not in template:
        raise ValueError(f"template {template!r} has no {PLACEHOLDER} placeholder")
    head, tail = template.split(PLACEHOLDER, 1)
    return re.compile(rf"^\s*{re.escape(head)}(?P<c>.+?){re.escape(tail)}\s*$", re.DOTALL)


def extract(template: str, prompt: str) -> str | None:
    """The concept text of a prompt made from ``template``, or ``None`` if it does not fit."""
    m = template_regex(template).match(prompt)
    return m.group("c") if m else None


# Separators a writer might put between the words of a name: "Van Gogh", "van-gogh",
# "Van_Gogh", "M. C. Escher", or none at all ("VanGogh").
_SEP = r"[\s\-_.'’·]*"


@lru_cache(maxsize=4096)
def name_pattern(term: str) -> re.Pattern[str] | None:
    """Regex finding ``term`` in folded text, whatever the case, spacing or punctuation.

    The words of ``term`` must appear in order, joined by nothing or by separators, as whole
    words (``"remote"`` does not match ``"remotely"``, ``"asus"`` does not match
    ``"pegasus"``), optionally followed by a plural or possessive ending; a word of six or
    more characters also matches when split once by a separator (``"air-plane"``).
    """
    tokens = re.findall(r"[a-z0-9]+", fold(term))
    if not tokens:
        return None
    body = _SEP.join(_token(t) for t in tokens)
    return re.compile(rf"(?<![a-z0-9]){body}(?:'?s|es)?(?![a-z0-9])")


def _token(token: str) -> str:
    """One word of a name; a long word may also be split once ("air plane", "sun-flower").

    Both halves must have at least 3 characters, so that short words do not match common
    phrases ("asus" never matches "as us").
    """
    options = [re.escape(token)]
    if len(token) >= 6:
        options += [rf"{re.escape(token[:i])}[\s\-_.]+{re.escape(token[i:])}"
                    for i in range(3, len(token) - 2)]
    return options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"
