"""STACE as the paper runs it: the experiments' per-role LLMs (Table D1), the tools each mode
really offers, a fair budget for probe.attack, the concept-naming rule as configuration."""

from __future__ import annotations

import pytest

from stace.loop import PROBE_API_DOC, ProbeSession, probe_api_doc, tools_offered

SD_EXPERIMENTS = ("stace_paper", "stace_table2", "stace_table3", "stace_debate", "stace_sizes")
TINY_TWINS = ("stace_table2_tinyworld", "stace_table3_tinyworld", "stace_debate_tinyworld")
LLM_ATTACKERS = ("attackers.stace.STACEAttacker", "attackers.redteam_llm.RedTeamLLMAttacker",
                 "attackers.coreference.CoreferenceAttacker", "attackers.jailfuzzer.JailFuzzerAttacker")


# one erasure task (and one method, one M) keeps the sweep small; the attackers are all swept
NARROW = {"stace_table3": ["method=esd_200"], "stace_debate": ["attacker.debate_rounds=2"],
          "stace_table3_tinyworld": ["method=esd_200"], "stace_debate_tinyworld": ["attacker.debate_rounds=2"]}


def _cells(experiment: str):
    from emma.validate import cell_overrides, compose_cell

    task = ["+experiment/stace_task=airplane"] if experiment in SD_EXPERIMENTS else ["concept=circle"]
    cells = cell_overrides([f"experiment={experiment}", *task, *NARROW.get(experiment, [])], True)
    out = []
    for cell in cells:
        found: list = []
        cfg = compose_cell(cell, found)
        assert cfg is not None and not found, (cell, found)
        out.append((cell, cfg))
    return out


def _distinct_attackers(cells):
    seen = {}
    for cell, cfg in cells:
        key = (cfg.attacker._target_, str(cfg.attacker.get("preset")), str(cfg.attacker.get("model")))
        seen.setdefault(key, (cell, cfg))
    return list(seen.values())


@pytest.mark.parametrize("experiment", SD_EXPERIMENTS)
def test_paper_experiments_set_the_papers_llms_per_role(experiment):
    from omegaconf import OmegaConf

    cells = _cells(experiment)
    stace_cells = 0
    for cell, cfg in _distinct_attackers(cells):
        target = cfg.attacker._target_
        if target not in LLM_ATTACKERS:
            assert cfg.get("llm") is None, cell  # attackers without an LLM get none
            continue
        assert cfg.llm._target_ == "stace.llm.LLMClient" and cfg.llm.base_url == "https://openrouter.ai/api/v1", cell
        assert cfg.llm.api_key_env == "OPENROUTER_API_KEY"
        if target == "attackers.stace.STACEAttacker":
            stace_cells += 1
            a = OmegaConf.to_container(cfg.attacker, resolve=True)
            assert cfg.llm.per_role_models is True and not a["tools"], cell
            assert set(a["evaluators"]) == {"vlm_judge", "nudenet"} and a["evaluator"] == "agent"
            roles = {r: v["model"] for r, v in a["roles"].items()}
            assert roles == a["presets"][a["preset"]], cell  # written out as Table D1 says
        if target == "attackers.redteam_llm.RedTeamLLMAttacker":
            assert cfg.attacker.model == "openai/gpt-5"  # the paper's Red-Teaming row
    assert stace_cells == (3 if experiment == "stace_sizes" else 1)
    if experiment == "stace_sizes":
        presets = sorted({str(cfg.attacker.preset) for _, cfg in cells})
        assert presets == ["default", "large", "small"] and len(cells) == 3


def test_table_d1_models_are_the_papers():
    from omegaconf import OmegaConf

    from emma.registry import CONF_DIR

    presets = OmegaConf.load(CONF_DIR / "attacker" / "stace.yaml").presets
    d1 = {  # Table D1: role -> (Small, STACE, Large)
        "hypothesis": ("x-ai/grok-4-fast", "x-ai/grok-4.1-fast", "x-ai/grok-4.20-beta"),
        "critic": ("x-ai/grok-4-fast", "x-ai/grok-4", "x-ai/grok-4.20-beta"),
        "query": ("openai/gpt-5-nano", "openai/gpt-5-mini", "openai/gpt-5"),
        "code": ("google/gemini-2.5-flash", "google/gemini-3-flash-preview", "google/gemini-3.1-pro-preview"),
        "experience": ("openai/gpt-5-nano", "openai/gpt-5-mini", "openai/gpt-5"),
        "report": ("openai/gpt-4.1", "openai/gpt-5", "openai/gpt-5.1"),
    }
    for role, models in d1.items():
        assert (presets.small[role], presets.default[role], presets.large[role]) == models, role


@pytest.mark.parametrize("experiment", TINY_TWINS)
def test_tiny_world_twins_use_the_embedded_model(experiment):
    for cell, cfg in _distinct_attackers(_cells(experiment)):
        assert cfg.model.name == "tinyworld"
        if cfg.attacker._target_ in LLM_ATTACKERS:
            assert cfg.llm._target_ == "stace.embedded.EmbeddedLLM", cell


def test_sweep_cfg_job_prints_every_cell_with_its_role_models(capsys):
    from emma.run import show_sweep

    assert show_sweep(["-m", "experiment=stace_sizes", "+experiment/stace_task=airplane", "--cfg", "job"]) == 0
    out = capsys.readouterr().out
    assert out.count("# cell ") == 3 and "# cell 2 of 3: +experiment/stace_attacker=stace\n" in out
    for model in ("x-ai/grok-4-fast", "x-ai/grok-4.1-fast", "x-ai/grok-4.20-beta", "google/gemini-3.1-pro-preview"):
        assert f"model: {model}" in out
    assert show_sweep(["-m", "experiment=stace_sizes", "--cfg", "hydra"]) == 2
    assert "only --cfg job" in capsys.readouterr().err


def test_the_default_stace_declares_no_attacker_tools():
    from omegaconf import OmegaConf

    from emma.registry import CONF_DIR

    conf = OmegaConf.load(CONF_DIR / "attacker" / "stace.yaml")
    assert conf.tools is None and conf.evaluators is None and conf.evaluator == "agent"


# -- the tools each mode offers ----------------------------------------------------------------

def test_tools_offered_follow_mode_target_and_declared_attackers():
    plan = tools_offered("plan", True, ["p4d_n"])
    assert "no code runs" in plan and "tokenizer" not in plan and "p4d_n" not in plan
    black = tools_offered("code", False, [])
    assert black.endswith("in a Python program") and "tokenizer" not in black
    white = tools_offered("code", True, ["unlearndiffatk", "p4d_n"])
    assert "text encoder's prompt embeddings" in white and "attackers p4d_n, unlearndiffatk" in white
    assert "count against the k images" in white


def test_probe_api_doc_leaves_out_what_the_target_lacks():
    assert probe_api_doc(True, ["p4d_n"]) == PROBE_API_DOC
    black = probe_api_doc(False, [])
    for op in ("probe.encode", "probe.generate_embeds", "probe.tokenize", "probe.nearest_tokens", "probe.attack"):
        assert op not in black, op
    assert "probe.generate(prompts" in black and "probe.info()" in black and "Only the standard library" in black
    white = probe_api_doc(True, [])
    assert "probe.encode(text)" in white and "probe.attack" not in white


def test_the_concept_naming_rule_is_configuration():
    from stace.gateway import Gateway

    gw = Gateway(backend=None, roles={}, trace=None)
    variables = {"task": "t", "seed_hypothesis": "s", "cards": [], "experience": [], "previous": None,
                 "feedback": None, "concept": "circle", "tools": "prompts"}
    allowed = "\n".join(m["content"] for m in gw.render("hypothesis_generator", {**variables, "name_concept": True}))
    banned = "\n".join(m["content"] for m in gw.render("hypothesis_generator", {**variables, "name_concept": False}))
    assert "never name" not in allowed and 'never name\nthe erased concept "circle"' in banned
    assert "executable with the tools this run offers: prompts." in allowed


def test_attacker_rejects_a_non_boolean_name_concept(monkeypatch):
    from omegaconf import OmegaConf

    from attackers.stace import STACEAttacker
    from emma.errors import ConfigError
    from emma.registry import CONF_DIR

    conf = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "attacker" / "stace.yaml"))
    args = {k: v for k, v in conf.items() if k not in ("defaults", "_target_", "_recursive_", "llm")}
    llm = {"_target_": "stace.llm.LLMClient", "model": "m", "base_url": "http://127.0.0.1:9/v1", "api_key_env": None}
    with pytest.raises(ConfigError, match="attacker.name_concept='no'; valid: true, false"):
        STACEAttacker(llm=llm, **{**args, "name_concept": "no"})


# -- a fair budget for probe.attack ------------------------------------------------------------

class FakeTools:
    attackers = {"p4d_n": None}

    def __init__(self, queries: int) -> None:
        self.queries, self.seeds = queries, []

    def attack(self, name, prompt, seed):
        self.seeds.append(seed)
        return {"adversarial_prompt": "a round thing", "queries": self.queries, "iterations": 3}


def test_attack_queries_count_against_k_and_seeds_never_overlap():
    tools = FakeTools(queries=3)
    s = ProbeSession("circle", 8, 100, {}, tools)
    r = s.handle("attack", {"attacker": "p4d_n"})
    assert r["seed"] == 600 and r["remaining"] == 5 and tools.seeds == [600]
    assert s.handle("info", {})["remaining"] == 5
    ids = s.handle("generate", {"prompts": ["a round thing"] * 5})
    assert ids == [0, 1, 2, 3, 4] and [p.seed for p in s.probes] == [100, 101, 102, 103, 104]
    with pytest.raises(ValueError, match=r"only 0 of the k=8 images are left \(3 spent on probe.attack"):
        s.handle("generate", {"prompts": ["x"]})
    with pytest.raises(ValueError, match="nothing is left"):
        s.handle("attack", {"attacker": "p4d_n"})


def test_a_seed_the_optimiser_saw_is_never_an_evaluation_seed():
    s = ProbeSession("circle", 10, 100, {}, FakeTools(queries=1))
    s.handle("attack", {"attacker": "p4d_n", "seed": 101})
    with pytest.raises(ValueError, match="seed 101 was used by probe.attack's optimiser"):
        s.handle("generate", {"prompts": ["a", "b"], "seeds": [7, 101]})
    s.handle("generate", {"prompts": ["a", "b"]})  # default seeds skip the attack's seed
    assert [p.seed for p in s.probes] == [600, 100] or [p.seed for p in s.probes] == [100, 601]
    assert 101 not in {p.seed for p in s.probes}
    with pytest.raises(ValueError, match="is a requested probe's seed"):
        s.handle("attack", {"attacker": "p4d_n", "seed": 100})


def test_earlier_attempts_queries_stay_spent():
    s = ProbeSession("circle", 4, 0, {}, FakeTools(queries=2), spent=3)
    assert s.handle("info", {})["remaining"] == 1
    with pytest.raises(ValueError, match="only 1 of the k=4"):
        s.handle("generate", {"prompts": ["a", "b"]})
