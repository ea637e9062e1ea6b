"""The README's exit-code table is what the code uses: the same codes with the same names as
``emma.exit_codes``, and the commands return those constants (or an error's ``exit_code``),
never a bare number."""

from __future__ import annotations

import ast
import re

import pytest

from emma import exit_codes
from emma.errors import ConfigError, DiskFullError, EmmaError, UnknownChoiceError, WeightsUnavailableError
from tests.conftest import ROOT

#: the modules with a command-line entry point
COMMANDS = ["emma/run.py", "emma/suites.py", "emma/weights.py", "leaderboards/build.py",
            "leaderboards/stace_tables.py", "leaderboards/wandb_read.py"]


def readme_table() -> dict[str, int]:
    text = (ROOT / "README.md").read_text()
    start = text.index("**Exit codes.**")
    table: dict[str, int] = {}
    for line in text[start:].splitlines()[1:]:
        if table and not line.startswith("|"):
            break
        m = re.match(r"^\|\s*(\d+)\s*\|([^|]*)\|([^|]*)\|\s*$", line)
        if m:
            names = re.findall(r"`([A-Z_]+)`", m.group(2))
            assert names and m.group(3).strip(), line
            for name in names:
                table[name] = int(m.group(1))
    return table


def test_the_readme_table_lists_every_code_by_its_name():
    table = readme_table()
    assert table == exit_codes.CODES
    assert {k: v for k, v in vars(exit_codes).items() if k.isupper() and isinstance(v, int)} == exit_codes.CODES


def test_the_codes_are_the_documented_numbers():
    assert (exit_codes.OK, exit_codes.BUG, exit_codes.USER_ERROR, exit_codes.DISK_FULL,
            exit_codes.PUBLISH_FAILED, exit_codes.INTERRUPTED) == (0, 1, 2, 3, 4, 130)


@pytest.mark.parametrize("err, code", [
    (ConfigError("x"), exit_codes.USER_ERROR),
    (UnknownChoiceError("method", "esdd", ["esd"]), exit_codes.USER_ERROR),
    (WeightsUnavailableError("x"), exit_codes.USER_ERROR),
    (DiskFullError("/x"), exit_codes.DISK_FULL),
])
def test_each_error_carries_its_code(err, code):
    assert isinstance(err, EmmaError) and err.exit_code == code


def _bare_codes(path: str) -> list[str]:
    """``sys.exit(<int>)``, ``SystemExit(<int>)`` and ``return <int>`` in a function that
    returns an exit code (``main``, ``preflight``, ``list_components``, ``show_sweep``, ``cli``)."""
    tree = ast.parse((ROOT / path).read_text())
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, int) and ast.unparse(node.func) in ("sys.exit", "SystemExit"):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
            if fn.name in ("main", "preflight", "list_components", "show_sweep", "cli") \
                    and isinstance(node, ast.Return) \
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, int):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", COMMANDS)
def test_commands_return_named_codes(path):
    assert _bare_codes(path) == []
    assert "exit_codes." in (ROOT / path).read_text() or "exit_code" in (ROOT / path).read_text()


def test_every_test_docs_faults_names_exists():
    """docs/faults.md maps each fault to its tests: each name it gives is a test of that file
    (``file::test``; ``…::test`` and ``::test`` continue the file before)."""
    text = (ROOT / "docs" / "faults.md").read_text()
    current, named = None, []
    for m in re.finditer(r"`(?:(test_\w+\.py)|…)?::(test_\w+)", text):
        current = m.group(1) or current
        named.append((current, m.group(2)))
    assert len(named) > 40
    for file, test in named:
        assert file is not None
        source = (ROOT / "tests" / file).read_text()
        assert re.search(rf"^def {test}\(", source, re.M), f"{file}::{test} is not a test"
