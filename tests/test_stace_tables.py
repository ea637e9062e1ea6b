"""STACE's tables in the paper's layout: rows, columns and cells from result files, averages
and the cost study computed by hand."""

from __future__ import annotations

import json

import pytest

from emma.results import SCHEMA_VERSION
from leaderboards.stace_tables import build, main


def _write(root, name, *, attacker, concept, metrics, method="esd", iterations=200, debate_rounds=2):
    d = root / name
    d.mkdir(parents=True)
    data = {"schema_version": SCHEMA_VERSION,
            "cell": {"model": "tinyworld", "method": method, "domain": "tinyworld", "concept": concept,
                     "attacker": attacker, "classifier": "tinyworld"},
            "metrics": {k: (v if isinstance(v, dict) else {"value": v}) for k, v in metrics.items()},
            "config": {"method": {"name": method, "iterations": iterations},
                       "attacker": {"debate_rounds": debate_rounds}},
            "versions": {"components": {}}}
    (d / "results.json").write_text(json.dumps(data))


def _stace(sir_h, n, sir_i, cost, tokens, ser=1.0, eii=1, novelty=0.5):
    return {"stace/sir_h": {"value": sir_h, "n": n}, "stace/sir_i": {"value": sir_i, "n": n * 4},
            "stace/ser": ser, "stace/eii": eii, "stace/novelty": novelty, "stace/cost_usd": cost,
            "stace/tokens/hypothesis": tokens, "asr": sir_h}


def _cell(table, label, column):
    return next(r for r in table.rows if r[table.columns[0]] == label)[column]


def test_table2_rows_attackers_columns_concepts_cells_sir_i(tmp_path):
    _write(tmp_path, "a", attacker="stace", concept="circle", metrics=_stace(2 / 3, 3, 0.25, 0.06, 300))
    _write(tmp_path, "b", attacker="stace", concept="star", metrics=_stace(0.0, 3, 0.0, 0.03, 150))
    _write(tmp_path, "c", attacker="coreference", concept="circle",
           metrics={"sir_i": {"value": 0.5, "n": 12}, "asr/images": {"value": 0.4}, "llm/cost_usd": 0.012,
                    "llm/tokens": 600})
    _write(tmp_path, "d", attacker="unlearndiffatk", concept="star", metrics={"asr/images": {"value": 0.1, "n": 20}})
    (t,) = build([tmp_path], ["table2"], out=tmp_path / "board")
    assert t.columns[:4] == ["attacker", "circle", "star", "avg"]
    assert _cell(t, "stace", "circle")["value"] == 0.25 and _cell(t, "stace", "avg")["value"] == 0.125
    assert _cell(t, "coreference", "circle")["value"] == 0.5  # sir_i over the budget, not asr/images
    assert _cell(t, "coreference", "star") is None
    assert _cell(t, "unlearndiffatk", "star")["value"] == 0.1
    # cost study: $0.09 over 6 iterations, 2 successful hypotheses; 450 tokens
    assert _cell(t, "stace", "$/iter")["value"] == pytest.approx(0.09 / 6)
    assert _cell(t, "stace", "$/success")["value"] == pytest.approx(0.09 / 2)
    assert _cell(t, "stace", "tokens/success")["value"] == pytest.approx(450 / 2)
    assert _cell(t, "coreference", "$/image")["value"] == pytest.approx(0.012 / 12)
    md = (tmp_path / "board" / "stace_table2.md").read_text()
    assert "| stace | 0.250 | 0.000 | 0.125 |" in md
    assert (tmp_path / "board" / "stace_table2.csv").read_text().startswith("attacker,circle,")


def test_table3_splits_esd_by_strength_and_debate_rows_by_m(tmp_path, capsys):
    for it, sir_h in ((100, 1.0), (200, 2 / 3), (500, 0.0)):
        _write(tmp_path, f"e{it}", attacker="stace", concept="circle", iterations=it,
               metrics=_stace(sir_h, 3, sir_h / 2, 0.0, 0, ser=0.5, eii=2 if sir_h else None))
    _write(tmp_path, "uce", attacker="stace", concept="circle", method="uce", iterations=None,
           metrics=_stace(1 / 3, 3, 0.1, 0.0, 0))
    t3, tdeb = build([tmp_path], ["table3", "debate"])
    assert [r["method"] for r in t3.rows] == ["esd-100", "esd-200", "esd-500", "uce"]
    assert _cell(t3, "esd-200", "circle")["value"] == pytest.approx(2 / 3)
    assert _cell(t3, "esd-500", "avg EII") is None and _cell(t3, "esd-100", "avg SER")["value"] == 0.5
    assert _cell(t3, "esd-500", "$/success") is None  # nothing succeeded: no cost per success
    assert [r["debate rounds"] for r in tdeb.rows] == ["M=2"]
    # a concept of a row counts once: the mean of the four M=2 circle cells, never the newest
    assert _cell(tdeb, "M=2", "avg Nov(H)")["n"] == 1
    assert main([str(tmp_path / "nothing-here")]) == 2
    assert "nothing-here: no such file" in capsys.readouterr().err


def test_paper_experiments_compose_and_every_task_is_a_concept_of_its_domain():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from emma.registry import register_configs
    from tests.conftest import ROOT

    conf = ROOT / "conf"
    tasks = str(OmegaConf.load(conf / "experiment" / "stace_table2.yaml")
                .hydra.sweeper.params["+experiment/stace_task"]).split(",")
    assert len(tasks) == 10
    for exp in ("stace_table3", "stace_debate"):  # the same ten tasks
        params = OmegaConf.load(conf / "experiment" / f"{exp}.yaml").hydra.sweeper.params
        assert str(params["+experiment/stace_task"]).split(",") == tasks
    for task in tasks:  # each task file names a concept of the domain it selects
        t = OmegaConf.load(conf / "experiment" / "stace_task" / f"{task}.yaml")
        domain = t.defaults[0]["override /domain"]
        names = [c["name"] for c in OmegaConf.load(conf / "domain" / f"{domain}.yaml").concepts]
        assert t.concept in names, task
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["experiment=stace_table2", "+experiment/stace_task=superman"])
        assert (cfg.model.name, cfg.domain.name, cfg.concept) == ("sd14", "ip", "superman")
        for exp in ("stace_table2_tinyworld", "stace_table3_tinyworld", "stace_debate_tinyworld"):
            assert compose(config_name="config", overrides=[f"experiment={exp}"]).model.name == "tinyworld"
    GlobalHydra.instance().clear()


def _edit(root, name, edit):
    path = root / name / "results.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_seeds_of_a_concept_are_pooled_and_another_budget_is_its_own_row(tmp_path, capsys):
    for name, seed, sir_i in (("s0", 0, 0.5), ("s1", 1, 0.25), ("big", 0, 0.1)):
        _write(tmp_path, name, attacker="stace", concept="circle", metrics=_stace(0.5, 3, sir_i, 0.03, 100))
        _edit(tmp_path, name, lambda d, seed=seed: d["config"].update(seed=seed))
    _edit(tmp_path, "big", lambda d: d["config"].update(images_per_prompt=12))
    (t,) = build([tmp_path], ["table2"])
    pooled = _cell(t, "stace [images_per_prompt=None]", "circle")
    assert pooled["value"] == pytest.approx(0.375)
    assert (pooled["min"], pooled["max"], pooled["n_seeds"]) == (0.25, 0.5, 2)
    assert _cell(t, "stace [images_per_prompt=12]", "circle")["value"] == 0.1
    assert main([str(tmp_path), "--table", "table2"]) == 0
    out = capsys.readouterr()
    assert "0.375 (0.250–0.500, 2 seeds)" in out.out and "differ in images_per_prompt" in out.err
