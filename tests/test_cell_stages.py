"""The cell as stages over one context, and the registry as the one reader of conf/."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

from emma import registry
from emma.errors import ConfigError
from emma.pipelines import fingerprint
from tests.conftest import ROOT

FAST = ["model=tiny_random", "classifier=tinyworld", "classifier.weights=null", "metrics=rates_only",
        "prompt_types=[name]", "images_per_prompt=1"]


def _counting(monkeypatch, module, name, counts):
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)


def _cli(monkeypatch, argv):
    from emma import run

    monkeypatch.setattr(sys, "argv", ["emma.run", *argv])
    run.cli()


def test_a_cli_cell_is_composed_validated_and_looked_up_once(tmp_path, monkeypatch, capsys):
    from emma import finished, validate

    monkeypatch.setenv("EMMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = [*FAST, f"paths.cache_dir={tmp_path / 'cache'}"]
    counts: dict[str, int] = {}
    for module, name in ((registry, "compose"), (validate, "validate_cell"), (finished, "entry")):
        _counting(monkeypatch, module, name, counts)

    _cli(monkeypatch, [*argv, f"hydra.run.dir={tmp_path / 'first'}"])
    assert counts == {"compose": 1, "validate_cell": 1, "entry": 1}
    first = json.loads((tmp_path / "first" / "results.json").read_text())
    assert first["counts"]["prompts"] == 1 and first["counts"]["images"] == 1
    assert (tmp_path / "first" / ".hydra" / "overrides.yaml").is_file()

    # the same cell again: served from the finished-cell cache, so not validated at all
    counts.clear()
    _cli(monkeypatch, [*argv, f"hydra.run.dir={tmp_path / 'second'}"])
    assert counts == {"compose": 1, "entry": 1}
    assert "finished cell served from the cache" in capsys.readouterr().out
    second = json.loads((tmp_path / "second" / "results.json").read_text())
    assert second.pop("served_from_cache")["key"] and first.pop("served_from_cache") is None
    assert second == first


def test_stages_give_the_cell_that_run_cell_gives(tmp_path, monkeypatch):
    """Callers that need part of a cell run the stages themselves: setup + load_model + erase
    gives the erased model whose generator the suite stage draws with."""
    from emma.cell import STAGES, run_cell
    from emma.stages.erasure import erase
    from emma.stages.model import load_model
    from emma.stages.setup import setup

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = registry.compose([*FAST, "method=uce", f"paths.cache_dir={tmp_path / 'cache'}",
                            "paths.reuse_results=false"])
    result = run_cell(cfg, tmp_path / "cell")
    ctx = setup(cfg)
    load_model(ctx)
    erase(ctx)
    assert ctx.erased.fingerprint == result.versions["model"]["erased_fingerprint"]
    assert ctx.erased.fingerprint != ctx.base_fingerprint
    assert ctx.generator.model_fingerprint == ctx.erased.fingerprint
    from emma.cell import erased_cell  # the same stages, for tools that need only the erased model

    tool = erased_cell(cfg)
    assert tool.erased.fingerprint == ctx.erased.fingerprint and tool.finished is None
    assert fingerprint(tool.erased.pipe) == ctx.erased.fingerprint
    assert [s.__name__ for s in STAGES] == ["load_model", "draw_base_bias", "erase", "draw_suite", "attack",
                                            "rate_metrics", "quality_metrics", "timing_metrics", "record"]


def test_listing_prints_the_registry(monkeypatch, capsys):
    from emma.run import list_components

    assert list_components(["--list", "methods"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names == registry.choices("method") and "esd" in names and "uce" in names
    assert list_components(["--list", "concepts", "domain=tinyworld"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "circle  (default)" in lines and "star" in lines and len(lines) == 8
    assert list_components(["--list", "methodz"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown listing 'methodz'") and "Did you mean 'methods'?" in err


def test_include_folder_adds_choices_and_a_missing_one_is_named(tmp_path, monkeypatch):
    (tmp_path / "method").mkdir()
    (tmp_path / "method" / "toy_noop.yaml").write_text("# a toy\n_target_: emma.api.method.NoErasure\n")
    monkeypatch.setenv(registry.ENV_INCLUDE, str(tmp_path))
    assert "toy_noop" in registry.choices("method") and "esd" in registry.choices("method")
    assert registry.config_path("method", "toy_noop") == tmp_path / "method" / "toy_noop.yaml"
    assert registry.listing("methods").splitlines()[registry.choices("method").index("toy_noop")] \
        .split(None, 1) == ["toy_noop", "a toy"]
    (tmp_path / "domain").mkdir()
    (tmp_path / "domain" / "toy_broken.yaml").write_text("_target_: emma.domains.build_domain\nname: toy_broken\n")
    with pytest.raises(ConfigError, match=r"^domain 'toy_broken' \(.*toy_broken.yaml\) cannot be built: .*missing"):
        registry.build("domain", "toy_broken")
    monkeypatch.setenv(registry.ENV_INCLUDE, str(tmp_path / "missing"))
    with pytest.raises(Exception, match="EMMA_INCLUDE names .*missing.*which is not a folder"):
        registry.choices("method")


def _python_files(*packages: str) -> list[Path]:
    return [p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))]


def test_conf_is_read_by_the_registry_alone():
    """No module but emma/registry.py names the conf/ folder or defines CONF_DIR."""
    readers, definitions = [], []
    for path in _python_files("emma", "attackers", "classifiers", "stace", "leaderboards", "scripts"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value == "conf":
                readers.append(str(path.relative_to(ROOT)))
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "CONF_DIR" for t in node.targets):
                definitions.append(str(path.relative_to(ROOT)))
    assert set(readers) == {"emma/registry.py"}, readers
    assert definitions == ["emma/registry.py"]


def test_the_core_imports_no_implementation():
    """emma/ reaches roles, never classifiers/, attackers/, stace/ or leaderboards/ (conf/ binds them)."""
    found = []
    for path in _python_files("emma"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names
                      if n.split(".")[0] in ("classifiers", "attackers", "stace", "leaderboards")]
    assert found == []


def test_no_function_in_the_cell_path_is_long():
    """run_cell is the loop over the stages; no stage function is longer than 60 lines."""
    for path in [ROOT / "emma" / "cell.py", *sorted((ROOT / "emma" / "stages").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                limit = 40 if node.name == "run_cell" else 60
                assert length <= limit, f"{path.name}:{node.name} has {length} lines"


def test_a_taken_run_directory_is_refused_before_the_components_are_built(tmp_path, monkeypatch, capsys):
    """The output-directory check is cheap; building the judges loads their weights: the check
    comes first, after the lookup and the validation."""
    from emma.stages import setup as setup_module

    monkeypatch.setenv("EMMA_CACHE", str(tmp_path / "cache"))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "results.json").write_text("{}")
    counts: dict[str, int] = {}
    _counting(monkeypatch, setup_module, "build_components", counts)
    with pytest.raises(SystemExit) as exit_:
        _cli(monkeypatch, [*FAST, f"paths.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'taken'}"])
    assert exit_.value.code == 2
    assert "already holds results.json" in capsys.readouterr().err
    assert counts == {}
