"""The erasure methods' protocol cards (docs/protocols/methods/<method>.md) are the contract
between each method's reference implementation and its SD-scale config (the attackers' cards:
tests/test_protocol_cards.py).

Each card has one table (``| key | domains | reference | ours | source | why they differ |``).
For every EMMA domain D and every method M, ``model=sd14 domain=D method=M`` is composed
(composition only: no weights) and every setting of the resolved ``method`` node must match
the card's ``ours`` for D; a setting the card does not list, a card row whose ``ours`` differs
from the config, and a row whose ``ours`` differs from its ``reference`` (or whose reference
has no such setting, ``—``) without a reason, all fail.

Row semantics:

- ``key``: a dotted path in the ``method`` node in backticks (```lamb```), an absolute path
  of the cell config (```/model.height```), or a setting the harness has no key for in
  parentheses (``(resolution)``; only its reason is checked);
- ``domains``: ``all`` or a comma-separated list of EMMA domains; a row naming a domain
  overrides the ``all`` row of its key for that domain;
- ``reference`` / ``ours``: YAML values in backticks (floats compare to 1e-9 relative), or
  ``—`` where the reference has no such setting for those domains;
- a per-domain mapping in the config (``{default: ..., object: ...}``) is compared by its
  entry for D (else its ``default``), as the methods read it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CARDS = ROOT / "docs" / "protocols" / "methods"
ABSENT = {"—", "-", "–", ""}
COLUMNS = ["key", "domains", "reference", "ours", "source", "why they differ"]


@dataclass
class Row:
    key: str
    kind: str  # "method" | "absolute" | "info"
    domains: list[str] | None  # None = all
    reference: Any
    has_reference: bool
    ours: Any
    ours_text: str
    note: str
    line: int


def emma_domains() -> list[str]:
    """The EMMA domains: every domain choice but the tiny world's."""
    from emma import registry

    out = []
    for name in registry.choices("domain"):
        target = str(registry.load("domain", name).get("_target_", ""))
        if "tinyworld" not in target:
            out.append(name)
    return out


def _cell_value(text: str, where: str) -> tuple[bool, Any]:
    text = text.strip()
    if text in ABSENT:
        return False, None
    m = re.fullmatch(r"`(.*)`", text)
    if not m:
        raise AssertionError(f"{where}: value {text!r} must be a YAML value in backticks or '—'")
    try:
        return True, yaml.safe_load(m.group(1))
    except yaml.YAMLError as err:
        raise AssertionError(f"{where}: {m.group(1)!r} is not YAML ({err})") from None


def parse_card(path: Path, domains: list[str]) -> list[Row]:
    lines = path.read_text(encoding="utf-8").splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.strip().startswith("| key |")]
    assert len(starts) == 1, f"{path.name}: expected one table whose header starts with '| key |'"
    header = [c.strip() for c in lines[starts[0]].strip().strip("|").split("|")]
    assert header == COLUMNS, f"{path.name}: table columns must be {COLUMNS}, got {header}"
    rows = []
    for i in range(starts[0] + 2, len(lines)):
        ln = lines[i].strip()
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        where = f"{path.name}:{i + 1}"
        assert len(cells) == len(COLUMNS), f"{where}: {len(cells)} cells, expected {len(COLUMNS)}"
        key, doms, ref, ours, _source, note = cells
        if m := re.fullmatch(r"`/([A-Za-z0-9_.]+)`", key):
            kind, key = "absolute", m.group(1)
        elif m := re.fullmatch(r"`([A-Za-z0-9_.]+)`", key):
            kind, key = "method", m.group(1)
        elif re.fullmatch(r"\(.+\)", key):
            kind = "info"
        else:
            raise AssertionError(f"{where}: key {key!r} must be `path`, `/absolute.path` or (a description)")
        if doms == "all":
            dlist = None
        else:
            dlist = [d.strip() for d in doms.split(",")]
            unknown = [d for d in dlist if d not in domains]
            assert not unknown, f"{where}: unknown domains {unknown}; EMMA domains: {domains}"
        has_ref, ref_value = _cell_value(ref, where)
        if kind == "info":
            has_ours, ours_value = (True, ours) if ours not in ABSENT else (False, None)
        else:
            has_ours, ours_value = _cell_value(ours, where)
            assert has_ours, f"{where}: `ours` must give the value the harness uses"
        rows.append(Row(key, kind, dlist, ref_value, has_ref, ours_value, ours, note, i + 1))
    assert rows, f"{path.name}: the table has no rows"
    return rows


def rows_for(rows: list[Row], domain: str, card: str) -> dict[tuple[str, str], Row]:
    """The row that holds for ``domain``, per (kind, key): a domain row beats the ``all`` row."""
    out: dict[tuple[str, str], Row] = {}
    for specific in (False, True):
        seen: set[tuple[str, str]] = set()
        for r in rows:
            if (r.domains is not None) != specific or (specific and domain not in r.domains):
                continue
            k = (r.kind, r.key)
            assert k not in seen, f"{card}:{r.line}: {r.key} is given twice for domain {domain}"
            seen.add(k)
            out[k] = r
    return out


def same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (isinstance(a, bool) and isinstance(b, bool) and a == b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def per_domain(value: Any, domain: str, domains: list[str]) -> Any:
    """A per-domain mapping's entry for ``domain`` (else ``default``), as the methods read it."""
    if isinstance(value, dict) and value:
        keys = set(map(str, value))
        known = set(domains) | {"default", "tinyworld", "tinyworld_style"}
        if keys <= known and ("default" in keys or domain in keys):
            return value.get(domain, value.get("default"))
    return value


_MISSING = object()


def select(node: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def compose_cell(method: str, domain: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from emma.registry import compose

    cfg = compose(["model=sd14", f"domain={domain}", f"method={method}", *extra])
    return OmegaConf.to_container(cfg, resolve=True)


def check(method: str, domain: str, cell: dict[str, Any], rows: list[Row], domains: list[str]) -> list[str]:
    """Every disagreement between ``method``'s card and its resolved config ``cell`` in ``domain``."""
    card = f"{method}.md"
    table = rows_for(rows, domain, card)
    node = {k: v for k, v in cell["method"].items() if k != "_target_"}
    problems = []
    for key in node:
        if ("method", key) not in table and not any(k == "method" and p.startswith(key + ".") for k, p in table):
            problems.append(f"{card} [{domain}]: setting `{key}` = {node[key]!r} is not on the card")
    for (kind, key), r in table.items():
        where = f"{card}:{r.line} [{domain}] `{key}`"
        if kind != "info":
            value = select(node if kind == "method" else cell, key)
            if value is _MISSING:
                problems.append(f"{where}: no such setting in the resolved config")
                continue
            value = per_domain(value, domain, domains)
            if not same(value, r.ours):
                problems.append(f"{where}: the card says ours = {r.ours!r}, the config resolves to {value!r}")
        differs = not r.has_reference or (not same(r.reference, r.ours) if kind != "info" else
                                          str(r.reference) != r.ours_text.strip("`"))
        if differs and not r.note.strip():
            problems.append(f"{where}: ours differs from the reference (or the reference has none) "
                            "and the card gives no reason")
    return problems


# --------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def domains() -> list[str]:
    return emma_domains()


def carded_methods() -> list[str]:
    from emma import registry

    return list(registry.choices("method"))


def test_every_method_has_a_card_and_no_card_is_orphaned():
    names = set(carded_methods())
    cards = {p.stem for p in CARDS.glob("*.md")}
    assert names - cards == set(), f"methods without a protocol card: {sorted(names - cards)}"
    assert cards - names == set(), f"cards for no method: {sorted(cards - names)}"
    assert len(names) >= 16


def test_emma_domains_are_the_five_and_ip(domains):
    assert set(domains) == {"object", "celebrity", "style", "nsfw", "copyright", "ip"}


@pytest.mark.parametrize("method", carded_methods())
def test_card_matches_the_resolved_sd14_config_in_every_domain(method, domains):
    rows = parse_card(CARDS / f"{method}.md", domains)
    problems = []
    for domain in domains:
        problems += check(method, domain, compose_cell(method, domain), rows, domains)
    assert not problems, "\n".join(problems)


def test_a_changed_value_fails_the_check(domains):
    """The check bites: a value the YAML would now resolve to, different from the card's."""
    rows = parse_card(CARDS / "uce.md", domains)
    assert check("uce", "style", compose_cell("uce", "style"), rows, domains) == []
    changed = compose_cell("uce", "style", ("method.lamb=0.25",))
    problems = check("uce", "style", changed, rows, domains)
    assert len(problems) == 1 and "`lamb`" in problems[0] and "0.25" in problems[0], problems
    extra = compose_cell("uce", "style", ("+method.new_knob=1",))
    assert any("`new_knob` = 1 is not on the card" in p for p in check("uce", "style", extra, rows, domains))


def test_an_undeclared_deviation_fails(domains, tmp_path):
    card = tmp_path / "toy.md"
    card.write_text("| key | domains | reference | ours | source | why they differ |\n|---|---|---|---|---|---|\n"
                    "| `lamb` | all | `0.1` | `0.5` | somewhere | |\n"
                    "| `erase_scale` | style | — | `1.0` | nowhere | |\n")
    rows = parse_card(card, domains)
    problems = check("toy", "style", {"method": {"lamb": 0.5, "erase_scale": 1.0}}, rows, domains)
    assert len(problems) == 2 and all("gives no reason" in p for p in problems), problems
    assert check("toy", "object", {"method": {"lamb": 0.5}}, rows, domains)[0].endswith("gives no reason")
