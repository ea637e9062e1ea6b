"""``attacker=coreference``: the Coreference Prompts baseline of STACE's Table 2 (Xue et al., 2025).

An LLM lists expressions that refer to the concept without naming it — coreferences,
nicknames, descriptions, related expressions ("Disneyland mouse mascot" for "Mickey Mouse").
Expressions that contain the concept's name are dropped. Each expression is placed in the
prompt templates, and the image budget is spread over the expressions round-robin (image
``j`` uses expression ``j mod E``, template ``(j div E) mod T``, seed ``seed + j``).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from pydantic import BaseModel, Field

from attackers.llm_common import LLMBaselineAttacker, Session, clean_prompts
from emma.errors import ConfigError


class Coreferences(BaseModel):
    """Expressions that refer to the concept without naming it."""

    expressions: list[str] = Field(min_length=1, max_length=30)


def names_of(concept: str) -> list[str]:
    """Spellings of a concept's name that an expression must not contain."""
    c = concept.lower()
    return sorted({c, c.replace("-", " "), c.replace("_", " ")})


class CoreferenceAttacker(LLMBaselineAttacker):
    """Coreference prompts: related expressions of the concept, rendered on the erased model.

    Args:
        llm / images / seed / model / temperature / max_tokens / prices / budget / prompts_dir:
            see :class:`attackers.llm_common.LLMBaselineAttacker`.
        expressions: distinct expressions asked for per concept.
        templates: prompt templates with an ``{expression}`` field.
        max_calls: LLM calls per concept at most (to reach ``expressions``).
    """

    name = "coreference"
    version = "2"
    role = "coreference"

    def __init__(self, llm: Mapping[str, Any], expressions: int = 10,
                 templates: Sequence[str] = ("{expression}",), max_calls: int = 3, **kwargs: Any) -> None:
        templates = list(templates or [])
        bad = [t for t in templates if "{expression}" not in t]
        if int(expressions) < 1 or not templates or bad or int(max_calls) < 1:
            raise ConfigError("attacker.expressions and attacker.max_calls must be >= 1 and every one of "
                              "attacker.templates must contain '{expression}'"
                              + (f" (not: {bad[0]!r})" if bad else ""))
        super().__init__(llm, **kwargs)
        self.n_expressions = int(expressions)
        self.templates = templates
        self.max_calls = int(max_calls)

    def settings_json(self) -> dict[str, Any]:
        return {"expressions": self.n_expressions, "templates": self.templates, "max_calls": self.max_calls}

    def run(self, session: Session) -> None:
        forbidden = [re.compile(rf"\b{re.escape(n)}\b", re.I) for n in names_of(session.concept)]
        found: list[str] = []
        dropped: list[str] = []
        for _ in range(self.max_calls):
            if len(found) >= self.n_expressions or session.stopped:
                break
            got = self.ask_prompts(session, "coreference", {
                "n": self.n_expressions - len(found), "previous": found}, Coreferences, "expressions")
            dropped += [e for e in got if any(f.search(e) for f in forbidden)]
            found = clean_prompts(found + [e for e in got if not any(f.search(e) for f in forbidden)])
        found = found[: self.n_expressions]
        session.trace.write("coreferences", concept=session.concept, expressions=found, dropped=dropped)
        if not found:
            return
        e, t = len(found), len(self.templates)
        session.render([self.templates[(j // e) % t].format(expression=found[j % e])
                        for j in range(session.budget)], label="coreference prompts")
