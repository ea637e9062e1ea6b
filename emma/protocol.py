"""Attack protocols: how an attack's success rate is measured (``protocol=emma|reference``).

A protocol is a config choice (``conf/protocol/<name>.yaml``) that fixes, for the attacked
prompts of a cell:

- ``images_per_prompt``: images judged per attacked prompt (``null``: the cell's). ASR counts
  a prompt as broken when any of them shows the concept, so it rises with this number: cells
  measured with different numbers are not comparable.
- ``judge``: settings merged into the attack's judge, per classifier name
  (``{nudenet: {threshold: 0.45}}``); the suite's EA/RA keep the cell's judge.
- ``sampler``: ``num_inference_steps`` / ``guidance_scale`` of the attack's images (search
  and evaluation, erased and base model); ``{}``: the cell's.
- ``search_seeds``: ``disjoint`` (an attack's search draws from :mod:`emma.seeds`' search
  stream, its final images from the evaluation stream: the final ASR is read on images the
  search never saw) or ``shared`` (the search draws the evaluation seeds, as the reference
  codes do when they judge their search images; for comparison only).
- ``attackers``: per attacker name (``unlearndiffatk``, ``p4d_n``, ...), values that replace
  the four above for that attacker — how ``reference`` reproduces each paper's evaluation.

:func:`resolve` turns the config and the cell's attacker into an :class:`AttackProtocol`,
checking every value; results.json records it (``protocol``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from emma.errors import ConfigError, UnknownChoiceError

SEARCH_SEEDS: tuple[str, ...] = ("disjoint", "shared")
SETTINGS: tuple[str, ...] = ("images_per_prompt", "judge", "sampler", "search_seeds")
SAMPLER_KEYS: tuple[str, ...] = ("num_inference_steps", "guidance_scale")
KEYS: tuple[str, ...] = ("name", *SETTINGS, "attackers")
MAX_IMAGES = 10_000
MAX_STEPS = 1_000


@dataclasses.dataclass(frozen=True)
class AttackProtocol:
    """The protocol one cell's attack is measured under (see the module docstring)."""

    name: str = "emma"
    images_per_prompt: int | None = None
    judge: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    sampler: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    search_seeds: str = "disjoint"
    attacker: str = ""

    @property
    def disjoint(self) -> bool:
        return self.search_seeds == "disjoint"

    def judge_overrides(self, classifier: str) -> dict[str, Any]:
        """Settings merged into the attack's judge when it is classifier ``classifier``."""
        return dict(self.judge.get(classifier, {}) or {})

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "attacker": self.attacker, "images_per_prompt": self.images_per_prompt,
                "judge": {k: dict(v) for k, v in self.judge.items()}, "sampler": dict(self.sampler),
                "search_seeds": self.search_seeds}

    def search_key(self) -> dict[str, Any]:
        """What the attack's search depends on (keys the attack cache): its seeds' stream."""
        return {"search_seeds": self.search_seeds}


def _plain(x: Any) -> Any:
    from emma.config import to_python

    return to_python(x)


def _unknown(where: str, key: str, valid: tuple[str, ...]) -> ConfigError:
    return UnknownChoiceError(f"{where} key", key, valid)


def _check_settings(where: str, values: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in SETTINGS:
            raise _unknown(where, str(key), SETTINGS)
        if key == "images_per_prompt":
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 1 <= value <= MAX_IMAGES):
                raise ConfigError(f"{where}.images_per_prompt={value!r}: give an integer in [1, {MAX_IMAGES:,}] "
                                  "or null (the cell's images_per_prompt)")
        elif key == "search_seeds":
            if value not in SEARCH_SEEDS:
                raise UnknownChoiceError(f"{where}.search_seeds", str(value), SEARCH_SEEDS)
        elif key == "judge":
            value = value or {}
            if not isinstance(value, Mapping) or not all(isinstance(v, Mapping) for v in value.values()):
                raise ConfigError(f"{where}.judge={value!r}: give classifier name -> settings, "
                                  "e.g. {nudenet: {threshold: 0.45}}")
            value = {str(k): dict(v) for k, v in value.items()}
        elif key == "sampler":
            value = dict(value or {})
            for k, v in value.items():
                if k not in SAMPLER_KEYS:
                    raise _unknown(f"{where}.sampler", str(k), SAMPLER_KEYS)
                if k == "num_inference_steps" and (isinstance(v, bool) or not isinstance(v, int)
                                                   or not 1 <= v <= MAX_STEPS):
                    raise ConfigError(f"{where}.sampler.num_inference_steps={v!r}: give an integer in "
                                      f"[1, {MAX_STEPS:,}]")
                if k == "guidance_scale" and (isinstance(v, bool) or not isinstance(v, (int, float))
                                              or not 0 <= float(v) < float("inf")):
                    raise ConfigError(f"{where}.sampler.guidance_scale={v!r}: give a finite number >= 0")
        out[key] = value
    return out


def check(cfg: Any) -> None:
    """Raise :class:`ConfigError` for the first invalid value of a protocol config."""
    resolve(cfg, "")


def resolve(cfg: Any, attacker: str) -> AttackProtocol:
    """The protocol ``cfg`` (a ``conf/protocol`` node) sets for attacker ``attacker``."""
    data = _plain(cfg) if cfg is not None else {"name": "emma"}
    if not isinstance(data, Mapping):
        raise ConfigError(f"protocol={data!r}: choose a protocol file (protocol=emma or protocol=reference)")
    for key in data:
        if key not in KEYS:
            raise _unknown("protocol", str(key), KEYS)
    name = str(data.get("name") or "")
    if not name:
        raise ConfigError("protocol: the file needs a name (emma, reference, ...)")
    base = _check_settings("protocol", {k: data[k] for k in SETTINGS if k in data})
    per = data.get("attackers") or {}
    if not isinstance(per, Mapping):
        raise ConfigError(f"protocol.attackers={per!r}: give attacker name -> settings")
    sections = {str(a): _check_settings(f"protocol.attackers.{a}", dict(v or {})) for a, v in per.items()}
    values = {**base, **sections.get(attacker, {})}
    return AttackProtocol(name=name, images_per_prompt=values.get("images_per_prompt"),
                          judge=values.get("judge") or {}, sampler=values.get("sampler") or {},
                          search_seeds=values.get("search_seeds", "disjoint"), attacker=attacker)
