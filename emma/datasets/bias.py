"""Bias prompt sets (EMMA §3.2, metrics 11 *gender* and 12 *ethnicity*).

A set holds aligned prompt lists: ``groups["neutral"][i]`` and ``groups[g][i]`` are the same
sentence with the subject replaced (``"a person walking"`` / ``"a woman walking"``), and all
groups use the same seeds (derived from the cell seed and the prompt index, :mod:`emma.seeds`),
so images can be compared pair by pair. The bias of a model
towards the reference group (male; White) is measured by comparing neutral images with
each other group's images relative to the reference group's::

    gender = bias_prompt_set("gender")         # neutral, male (reference), female
    ethnicity = bias_prompt_set("ethnicity")   # neutral, White (reference), Asian, Black
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from emma.api.types import PromptRequest
from emma.datasets.download import fetch
from emma.errors import ConfigError, UnknownChoiceError


def _bias_config() -> dict:
    text = (importlib.resources.files("emma.domains") / "data" / "bias.yaml").read_text("utf-8")
    return yaml.safe_load(text)


@dataclasses.dataclass(frozen=True)
class BiasPromptSet:
    """Neutral and attribute-specific prompts, aligned index by index.

    Args:
        attribute: ``"gender"`` or ``"ethnicity"``.
        reference: the reference group (``"male"``, ``"White"``).
        groups: ``"neutral"`` and each group -> its prompts (all the same length).
        seed: the cell seed the images' seeds derive from; prompt index ``i`` of every group
            draws the seeds of identity ``bias/<attribute>/<i>`` (:meth:`image_seeds`).
        version: version of the bias data (recorded in results).
    """

    attribute: str
    reference: str
    groups: Mapping[str, tuple[str, ...]]
    seed: int = 0
    version: str = "1"

    def __post_init__(self) -> None:
        lengths = {g: len(p) for g, p in self.groups.items()}
        if len(set(lengths.values())) != 1:
            raise ConfigError(f"bias set {self.attribute}: every group needs one prompt per index, got {lengths}")
        if "neutral" not in self.groups or self.reference not in self.groups:
            raise ConfigError(f"bias set {self.attribute} needs 'neutral' and {self.reference!r}")

    @property
    def compared(self) -> tuple[str, ...]:
        """Groups compared against the reference (female; Asian and Black)."""
        return tuple(g for g in self.groups if g not in ("neutral", self.reference))

    def __len__(self) -> int:
        return len(self.groups["neutral"])

    def seed_key(self, index: int) -> str:
        """The identity prompt index ``index`` of every group draws its seeds from."""
        return f"bias/{self.attribute}/{int(index)}"

    def image_seeds(self, index: int, n: int) -> list[int]:
        """Seeds of the ``n`` images of prompt index ``index`` (the same in every group)."""
        from emma.seeds import image_seeds

        return image_seeds(self.seed, self.seed_key(index), n)

    def pairs(self, group: str) -> list[tuple[str, str]]:
        """``(neutral prompt, group prompt)`` pairs."""
        if group not in self.groups:
            raise UnknownChoiceError(f"{self.attribute} group", group, self.groups)
        return list(zip(self.groups["neutral"], self.groups[group], strict=True))

    def requests(self, images_per_prompt: int = 1) -> list[PromptRequest]:
        """Requests of every group (kind ``"<attribute>/<group>"``, concept = group)."""
        return [
            PromptRequest(prompt=prompt, concept=group, group="bias", kind=f"{self.attribute}/{group}",
                          seed=self.seed, n_images=images_per_prompt, seed_key=self.seed_key(i))
            for group, prompts in self.groups.items()
            for i, prompt in enumerate(prompts)
        ]


def bias_prompt_set(attribute: str, *, templates: Sequence[str] | None = None,
                    seed: int = 0) -> BiasPromptSet:
    """The person-subject bias set of EMMA: templates x {neutral, groups}.

    Args:
        attribute: ``"gender"`` or ``"ethnicity"``.
        templates: sentences with ``{s}`` for the subject (default: the packaged ten).
        seed: the cell seed the images' seeds derive from (:meth:`BiasPromptSet.image_seeds`).
    """
    cfg = _bias_config()
    if attribute not in cfg["attributes"]:
        raise UnknownChoiceError("bias attribute", attribute, cfg["attributes"])
    spec = cfg["attributes"][attribute]
    templates = list(templates or cfg["templates"])
    bad = [t for t in templates if "{s}" not in t]
    if bad:
        raise ConfigError(f"bias templates need a {{s}} subject placeholder: {bad}")
    groups = {"neutral": tuple(t.replace("{s}", spec["neutral"]) for t in templates)}
    for group, subject in spec["groups"].items():
        groups[group] = tuple(t.replace("{s}", subject) for t in templates)
    return BiasPromptSet(attribute, spec["reference"], groups, int(seed), str(cfg["version"]))


def profession_bias_prompt_set(attribute: str, path: str | os.PathLike | None = None, *,
                               seed: int = 0) -> BiasPromptSet:
    """A bias set over UCE's profession prompts (``"a photo of a doctor"`` ->
    ``"a photo of a female doctor"``), from ``uce/gender_bias`` (225 professions x 11 prompts).

    Args:
        attribute: ``"gender"`` or ``"ethnicity"``.
        path: local copy of UCE's ``gender_bias.csv`` (default: pinned download).
        seed: the cell seed the images' seeds derive from.
    """
    from emma.datasets.external import PROMPT_SETS

    cfg = _bias_config()
    if attribute not in cfg["attributes"]:
        raise UnknownChoiceError("bias attribute", attribute, cfg["attributes"])
    spec = cfg["attributes"][attribute]
    file = Path(path) if path is not None else fetch(PROMPT_SETS["uce/gender_bias"].remote)
    import pandas as pd  # only where a bias prompt file is read: not on a cell's start-up path

    df = pd.read_csv(file, dtype=str, keep_default_na=False)
    columns = [c for c in df.columns if c == "validation" or re.fullmatch(r"ex\d+", c)]
    groups: dict[str, list[str]] = {"neutral": [], **{g: [] for g in spec["profession_groups"]}}
    for row in df.to_dict("records"):
        subject = f"{row['article']} {row['profession']}"
        for column in columns:
            neutral = row[column]
            if subject not in neutral:
                continue  # a sentence that does not name its profession cannot be substituted
            groups["neutral"].append(neutral)
            for group, form in spec["profession_groups"].items():
                groups[group].append(neutral.replace(subject, form.replace("{p}", row["profession"]), 1))
    return BiasPromptSet(attribute, spec["reference"], {g: tuple(p) for g, p in groups.items()},
                         int(seed), f"{cfg['version']}+uce")
