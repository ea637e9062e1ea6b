"""The attack page's table: one row per (method, attacker, protocol), and an attack beats the
static suite only against the static suite of its own protocol."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("attacks_tinyworld", ROOT / "scripts" / "attacks_tinyworld.py")
at = importlib.util.module_from_spec(_spec)
sys.modules["attacks_tinyworld"] = at
_spec.loader.exec_module(at)


def _row(attacker: str, protocol: str | None, lo: float, hi: float, judged: float | None = None) -> dict:
    m = {"asr": {"value": (lo + hi) / 2, "ci_low": lo, "ci_high": hi},
         "asr/images": {"value": (lo + hi) / 2, "ci_low": lo, "ci_high": hi}}
    if judged is not None:
        m["attack/judged_queries_mean"] = {"value": judged}
        m["attack/queries_mean"] = {"value": 22.0}
    row = {"method": "esd", "attacker": attacker, "metrics": m, "timing": {"attack_s": 5.0}, "cell_wall_s": 9.0,
           "overrides": ["metrics=rates_only"],
           "config": {"method": {"_target_": "x", "lr": 1}, "attacker": {"_target_": "y"},
                      "protocol": {"name": protocol or "emma"}}}
    if protocol is not None:
        row["protocol"] = protocol
    return row


def test_beats_static_compares_within_one_protocol():
    rows = [_row("static", "emma", 0.0, 0.09), _row("p4d_n", "emma", 0.10, 0.27, judged=3.0),
            _row("static", "reference", 0.20, 0.40), _row("p4d_n", "reference", 0.10, 0.27, judged=3.0)]
    text = at.markdown(rows, [], "python scripts/attacks_tinyworld.py", [])
    lines = {(ln.split("|")[2].strip(), ln.split("|")[3].strip()): ln for ln in text.splitlines()
             if ln.startswith("| esd |")}
    assert lines[("p4d_n", "emma")].rstrip().endswith("| yes / yes |")
    assert lines[("p4d_n", "reference")].rstrip().endswith("| no / no |")  # its own static suite is higher
    assert "| 22.0 | 3.0 |" in lines[("p4d_n", "emma")]


def test_a_row_written_before_protocols_reads_its_protocol_from_the_config():
    assert at.protocol_of(_row("static", None, 0, 0.1)) == "emma"
    legacy = _row("static", None, 0, 0.1)
    legacy["config"]["protocol"]["name"] = "reference"
    assert at.protocol_of(legacy) == "reference"


def test_an_attack_can_beat_the_static_suite_per_prompt_but_not_per_image():
    attack = _row("p4d_n", "emma", 0.34, 0.74, judged=3.0)
    attack["metrics"]["asr/images"] = {"value": 0.14, "ci_low": 0.07, "ci_high": 0.22}
    static = _row("static", "emma", 0.0, 0.16)
    static["metrics"]["asr/images"] = {"value": 0.0, "ci_low": 0.0, "ci_high": 0.09}
    text = at.markdown([static, attack], [], "python scripts/attacks_tinyworld.py", [])
    line = next(ln for ln in text.splitlines() if ln.startswith("| esd | p4d_n |"))
    assert line.rstrip().endswith("| yes / no |")
