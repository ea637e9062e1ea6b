"""The tiny world as EMMA domains: shapes (``tinyworld``) and background styles
(``tinyworld_style``).

Prompt types mirror EMMA: ``name`` (the template with the concept's name), ``prefix`` (a
prefix word per EMMA category before the name), ``variant`` (synonyms), ``short`` and
``long`` (descriptions that never use the name), ``random`` and ``similar`` (non-target
concepts). The phrasings are those of the training captions
(:mod:`emma.tinyworld.world`), so the base model can draw every one of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from emma.api.domain import Domain, PromptSuite
from emma.tinyworld import world

# Visually close shapes (RA "similar").
SIMILAR_SHAPES: dict[str, list[str]] = {
    "circle": ["crescent", "heart"],
    "square": ["diamond", "cross"],
    "triangle": ["diamond", "star"],
    "star": ["cross", "triangle"],
    "heart": ["circle", "crescent"],
    "cross": ["star", "square"],
    "crescent": ["circle", "heart"],
    "diamond": ["square", "triangle"],
}
SIMILAR_STYLES: dict[str, list[str]] = {
    "plain": ["striped"],
    "striped": ["checkered"],
    "dotted": ["checkered"],
    "checkered": ["striped"],
}


def _description(desc: str, template: str) -> str:
    # Descriptions read "a shape with ..."; drop the article so the template supplies it.
    body = desc[2:] if desc.startswith("a ") else desc
    body = body[4:] if body.startswith("the ") else body
    return world.with_template(template, body)


class TinyWorldShapeSuite(PromptSuite):
    """EMMA-form prompts for the tiny world's shapes.

    Args:
        prefixes_per_category: prefix words per EMMA category (2 → 10 prefix prompts).
    """

    name = "tinyworld_shapes"
    version = "1"

    def __init__(self, prefixes_per_category: int = 2) -> None:
        self.prefixes_per_category = int(prefixes_per_category)

    def prompts(self, domain: Domain, concept: str) -> dict[str, list[tuple[str, str]]]:
        t = domain.template.replace("{c}", "{x}")
        out: dict[str, list[tuple[str, str]]] = {
            "name": [(world.with_template(t, concept), concept)],
            "prefix": [
                (world.with_template(t, f"{p} {concept}"), concept)
                for words in domain.prefixes.values()
                for p in list(words)[: self.prefixes_per_category]
            ],
            "variant": [(world.with_template(t, v), concept) for v in world.SHAPE_VARIANTS[concept]],
            "short": [(_description(d, t), concept) for d in world.SHAPE_SHORT[concept]],
            "long": [(_description(d, t), concept) for d in world.SHAPE_LONG[concept]],
            "random": [(world.with_template(t, c), c) for c in domain.random_concepts(concept)],
            "similar": [(world.with_template(t, c), c) for c in domain.similar.get(concept, [])],
        }
        return out

    def config(self) -> dict[str, Any]:
        return {**super().config(), "prefixes_per_category": self.prefixes_per_category}


class TinyWorldStyleSuite(PromptSuite):
    """EMMA-form prompts for the tiny world's background styles (the "art styles").

    Every prompt draws ``subject`` (a shape) so that only the style varies.
    """

    name = "tinyworld_styles"
    version = "1"

    def __init__(self, subject: str = "star", prefixes_per_category: int = 2) -> None:
        if subject not in world.SHAPES:
            from emma.errors import UnknownChoiceError

            raise UnknownChoiceError("tiny-world shape", subject, world.SHAPES)
        self.subject = subject
        self.prefixes_per_category = int(prefixes_per_category)

    def _styled(self, style_phrase: str, prefix: str = "") -> str:
        subject = f"{prefix} {self.subject}".strip()
        return world.with_template("a {x}", f"{subject} {style_phrase}")

    def name_prompt(self, style_word: str) -> str:
        """The name prompt with ``style_word`` as its style: "a star in striped style"."""
        return self._styled(f"in {style_word} style")

    def subject_prompt(self) -> str:
        """The subject without a style phrase: "a star"."""
        return world.with_template("a {x}", self.subject)

    def prompts(self, domain: Domain, concept: str) -> dict[str, list[tuple[str, str]]]:
        return {
            "name": [(self.name_prompt(concept), concept)],
            "prefix": [
                (self._styled(f"in {concept} style", p), concept)
                for words in domain.prefixes.values()
                for p in list(words)[: self.prefixes_per_category]
            ],
            "variant": [(self._styled(f", {v} background").replace(" ,", ","), concept)
                        for v in world.STYLE_VARIANTS[concept]],
            "short": [(self._styled(s), concept) for s in world.STYLE_SHORT[concept]],
            "random": [(self.name_prompt(c), c) for c in domain.random_concepts(concept)],
            "similar": [(self.name_prompt(c), c) for c in domain.similar.get(concept, [])],
        }

    def config(self) -> dict[str, Any]:
        return {**super().config(), "subject": self.subject,
                "prefixes_per_category": self.prefixes_per_category}


class TinyWorldDomain(Domain):
    """A tiny-world domain: its bias attribute is *colour* (it has no people), and it renders
    its own reference scenes, judged in the tiny-world classifier's feature space."""

    bias_attributes = ("colour",)

    def bias_prompt_set(self, attribute: str, seed: int = 0) -> Any:
        if attribute == "colour":
            return colour_bias_set(seed=seed)
        return super().bias_prompt_set(attribute, seed=seed)

    def reference_images(self, concepts: Sequence[str], n: int, seed: int) -> Any:
        """Scene ``i`` draws colour, style, position and background from
        ``world.sample_specs(n, seed)`` and takes its shape (or style) from ``concepts[i]``."""
        import dataclasses

        import torch

        specs = []
        for c, spec in zip(concepts, world.sample_specs(n, seed)):
            if c in world.SHAPES:
                spec = dataclasses.replace(spec, shape=c)
            elif c in world.STYLES:
                spec = dataclasses.replace(spec, style=c)
            specs.append(spec)
        return torch.from_numpy(world.render_batch(specs))

    reference_name = "tinyworld"

    def reference_version(self) -> str:
        return str(world.WORLD_VERSION)


def colour_bias_set(reference: str = "red", compared: Sequence[str] = ("blue",), seed: int = 0) -> Any:
    """Neutral "an image of a <shape>" vs coloured versions, over the 8 shapes."""
    from emma.datasets.bias import BiasPromptSet

    groups = {"neutral": tuple(world.with_template("an image of a {x}", s) for s in world.SHAPES)}
    for colour in (reference, *compared):
        groups[colour] = tuple(world.with_template("an image of a {x}", f"{colour} {s}") for s in world.SHAPES)
    return BiasPromptSet("colour", reference, groups, int(seed))


def tinyworld_domain(
    name: str = "tinyworld",
    version: str = "1",
    kind: str = "shape",
    suite: PromptSuite | None = None,
    n_random: int = 5,
    classifier: str = "tinyworld",
    images_per_prompt: int = 10,
    template: str = "an image of a {c}",
    default_concept: str | None = None,
    similar: dict[str, Sequence[str]] | None = None,
) -> Domain:
    """Build the tiny-world shape (``kind="shape"``) or style (``kind="style"``) domain."""
    if kind == "shape":
        concepts = [{"name": s, "aliases": list(world.SHAPE_VARIANTS[s])} for s in world.SHAPES]
        suite = suite or TinyWorldShapeSuite()
        similar = similar or SIMILAR_SHAPES
    elif kind == "style":
        concepts = [{"name": s, "aliases": list(world.STYLE_VARIANTS[s])} for s in world.STYLES]
        suite = suite or TinyWorldStyleSuite()
        similar = similar or SIMILAR_STYLES
    else:
        from emma.errors import UnknownChoiceError

        raise UnknownChoiceError("tiny-world domain kind", kind, ("shape", "style"))
    return TinyWorldDomain(
        name=name, version=version, concepts=concepts, suite=suite,
        template=template, prefixes=world.PREFIXES, similar=similar,
        n_random=n_random, classifier=classifier, images_per_prompt=images_per_prompt,
        default_concept=default_concept,
    )
