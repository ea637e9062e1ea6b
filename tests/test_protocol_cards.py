"""Protocol cards (docs/protocols/attackers/<attacker>.md): every setting of an attacker's
resolved SD-scale config, and of the reference protocol for it, has a row; each row's "ours"
is the config's value; a row whose reference and ours differ says why."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT

CARDS = ROOT / "docs" / "protocols" / "attackers"
ATTACKERS = ("unlearndiffatk", "p4d_n", "p4d_k", "ring_a_bell", "wce")
COLUMNS = ["setting", "reference", "source", "ours (SD scale)", "why"]


def card_rows(text: str) -> list[dict[str, str]]:
    """The rows of a card's table, as column -> cell text."""
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == COLUMNS, header
    rows = []
    for line in lines[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        assert len(cells) == len(COLUMNS), line
        rows.append(dict(zip(COLUMNS, cells)))
    return rows


def resolved(attacker: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The attacker's config as an SD-scale cell composes it, and the reference protocol as it
    resolves for that attacker."""
    from omegaconf import OmegaConf

    from emma import registry
    from emma.protocol import resolve

    cfg = registry.compose(["model=sd14", f"attacker={attacker}", "protocol=reference"])
    config = OmegaConf.to_container(cfg.attacker, resolve=True)
    config.pop("_target_")
    return config, resolve(cfg.protocol, attacker).to_json()


def _lookup(path: list[str], data: Any) -> Any:
    for part in path:
        data = data.get(part) if isinstance(data, dict) else None
    return data


def same(reference: str, ours: str) -> bool:
    """Whether a row's reference states our value: it begins with it (``3 (objects, style)``
    states ``3``, ``3 (`cof`)`` states ``3.0``); a descriptive row may say ``the same``."""
    ours = ours.strip("`")
    if ours == "the same" or reference == ours or re.match(rf"{re.escape(ours)}(\s|\(|,|;|$)", reference):
        return True
    first = reference.split()[0].rstrip(",;") if reference.split() else ""
    try:
        return yaml.safe_load(first) == yaml.safe_load(ours) and not isinstance(yaml.safe_load(ours), str)
    except yaml.YAMLError:
        return False


def violations(text: str, config: dict[str, Any], protocol: dict[str, Any]) -> list[str]:
    """Every way a card and the resolved configs disagree (empty: the card declares them)."""
    out: list[str] = []
    seen: set[str] = set()
    for row in card_rows(text):
        key = re.fullmatch(r"`([\w.]+)`", row["setting"])
        if not same(row["reference"], row["ours (SD scale)"]) and not row["why"]:
            out.append(f"{row['setting']}: reference {row['reference']!r} and ours {row['ours (SD scale)']!r} "
                       "differ, and the card gives no reason")
        if not row["source"]:
            out.append(f"{row['setting']}: no source")
        if key is None:
            continue
        name = key.group(1)
        seen.add(name)
        ours = re.fullmatch(r"`(.*)`", row["ours (SD scale)"])
        if ours is None:
            out.append(f"{name}: its 'ours' cell is not a `value`")
            continue
        declared = yaml.safe_load(ours.group(1))
        if name.startswith("protocol."):
            actual = _lookup(name.split(".")[1:], protocol)
        elif name in config:
            actual = config[name]
        else:
            out.append(f"{name}: not a key of the attacker's config")
            continue
        if declared != actual:
            out.append(f"{name}: the card says {declared!r}, the SD-scale config has {actual!r}")
    for name in config:
        if name not in seen:
            out.append(f"{name}: a config key with no row on the card (value {config[name]!r})")
    return out


@pytest.mark.parametrize("attacker", ATTACKERS)
def test_each_card_declares_every_difference_from_its_reference(attacker):
    text = (CARDS / f"{attacker}.md").read_text()
    config, protocol = resolved(attacker)
    assert violations(text, config, protocol) == []
    assert re.search(r"at `[0-9a-f]{7}`\s*\(`[0-9a-f]{40}`\)", text), "the card pins the reference's commit"


def test_the_card_check_fails_when_a_config_value_changes():
    text = (CARDS / "unlearndiffatk.md").read_text()
    config, protocol = resolved("unlearndiffatk")
    # a YAML edit (iterations_per_timestep: 40 -> 30) that the card does not declare
    assert violations(text, {**config, "iterations_per_timestep": 30}, protocol) == [
        "iterations_per_timestep: the card says 40, the SD-scale config has 30"]
    # a new key with no row
    assert violations(text, {**config, "restarts": 2}, protocol) == [
        "restarts: a config key with no row on the card (value 2)"]
    # the reference protocol's images per prompt
    assert violations(text, config, {**protocol, "images_per_prompt": 3}) == [
        "protocol.images_per_prompt: the card says 1, the SD-scale config has 3"]
    # a difference with its reason removed
    undeclared = text.replace("a cell attacks every EA prompt: the first of 5 base images the judge confirms is the "
                              "reference (the most concept-like when none is)", "")
    assert [v.split(":")[0] for v in violations(undeclared, config, protocol)] == ["`reference_candidates`"]
