"""Every YAML in every conf/ group composes with the root config and instantiates with the
tiny model, offline. Real-weight files are instantiated in their random/offline mode, and
their real mode must fail with the download message, not a library traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from emma.api.attacker import Attacker
from emma.api.classifier import Classifier
from emma.api.domain import Domain
from emma.api.method import ErasureMethod
from emma.errors import WeightsUnavailableError
from emma.pipelines import load_pipeline
from emma.registry import GROUPS, register_configs

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()

# yaml keys that switch a real-weight classifier to random weights (offline plumbing)
RANDOM_MODE = {
    "clip_zero_shot": ["classifier.weights=null", "classifier.labels=[circle,square]"],
    "gcd": ["classifier.weights=null"],
    "ml_decoder": ["classifier.weights=null"],
    "q16": ["classifier.weights=null", "classifier.clip_weights=null"],
    "style_vit": ["classifier.weights=null"],
    "yolo_logo": ["classifier.weights=null"],
    "vlm_judge": ["classifier.backend=null", "classifier.labels=[circle,square]"],
    "nudenet": [],
    "tinyworld": ["classifier.weights=null"],
}


def files(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def cfg_with(*overrides: str):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=["model=tiny_random", *overrides])


def test_every_group_has_files():
    for group in GROUPS:
        if group == "experiment":
            continue
        assert files(group), f"conf/{group} is empty"


@pytest.mark.parametrize("name", files("model"))
def test_model_files(name):
    cfg = cfg_with(f"model={name}", "model.device=cpu", "model.dtype=float32")
    assert cfg.model.name == name
    if cfg.model.kind == "diffusers":
        with pytest.raises(WeightsUnavailableError, match="huggingface-cli download"):
            load_pipeline(cfg.model)
    elif cfg.model.kind == "tinyworld" and not (Path(__file__).parents[1] / "emma/tinyworld/assets/pipeline").exists():
        pytest.skip("tiny-world assets not built")
    else:
        pipe = load_pipeline(cfg.model)
        assert pipe.unet.config.in_channels == pipe.vae.config.latent_channels


@pytest.mark.parametrize("name", files("method"))
def test_method_files(name):
    cfg = cfg_with(f"method={name}")
    if name == "checkpoint":  # needs the user's checkpoint: the path is mandatory
        from omegaconf.errors import MissingMandatoryValue

        with pytest.raises(MissingMandatoryValue, match="method.path"):
            instantiate(cfg.method)
        return
    method = instantiate(cfg.method)
    assert isinstance(method, ErasureMethod)
    assert method.config()["name"] == method.name


# the default llm=embedded would download its model on first use (tests are offline)
ATTACKER_EXTRA = {n: ["llm=local"] for n in ("stace", "redteam_llm", "coreference", "jailfuzzer")}


@pytest.mark.parametrize("name", files("attacker"))
def test_attacker_files(name):
    cfg = cfg_with(f"attacker={name}", *ATTACKER_EXTRA.get(name, []))
    assert isinstance(instantiate(cfg.attacker), Attacker)


@pytest.mark.parametrize("name", files("domain"))
def test_domain_files(name):
    domain = instantiate(cfg_with(f"domain={name}").domain)
    assert isinstance(domain, Domain)
    assert domain.name == name
    assert domain.default_concept in domain.concepts
    assert (CONF / "classifier" / f"{domain.classifier}.yaml").exists()


@pytest.mark.parametrize("name", [n for n in files("classifier") if n != "auto"])
def test_classifier_files_random_mode(name):
    cfg = cfg_with(f"classifier={name}", *RANDOM_MODE[name])
    clf = instantiate(cfg.classifier)
    assert isinstance(clf, Classifier)
    assert len(clf.labels) > 0


@pytest.mark.parametrize("name", [n for n in files("classifier")
                                  if n not in ("auto", "nudenet", "tinyworld", "vlm_judge")])
def test_classifier_files_real_mode_fail_fast_offline(name):
    cfg = cfg_with(f"classifier={name}")
    with pytest.raises((WeightsUnavailableError, InstantiationException)) as info:
        instantiate(cfg.classifier)
    err = info.value.__cause__ if isinstance(info.value, InstantiationException) else info.value
    assert isinstance(err, WeightsUnavailableError)
    assert "python -m emma.weights fetch" in str(err)


@pytest.mark.parametrize("group", ["metrics", "logger", "paths"])
def test_plain_groups_compose(group):
    for name in files(group):
        cfg = cfg_with(f"{group}={name}")
        assert cfg[group] is not None


def test_root_defaults_name_the_axes():
    cfg = cfg_with()
    for key in ("model", "method", "domain", "attacker", "classifier", "metrics", "logger", "paths"):
        assert key in cfg
    assert "concept" in cfg and "seed" in cfg


def _preset_files(group: str) -> list[Path]:
    return sorted((CONF / "preset" / group).glob("*.yaml"))


@pytest.mark.parametrize("path", _preset_files("method") + _preset_files("attacker"), ids=lambda p: p.stem)
def test_every_preset_names_a_component_and_only_its_keys(path):
    """A preset ``<choice>_<scale>.yaml`` belongs to an existing component and scale, changes
    only keys the component has (a misspelt key would be passed to its constructor), and is
    what a model of that scale composes."""
    from omegaconf import OmegaConf

    group = path.parent.name
    choice, scale = path.stem.rsplit("_", 1)
    assert (CONF / group / f"{choice}.yaml").exists(), f"{path.name}: no conf/{group}/{choice}.yaml"
    assert (CONF / "scale" / f"{scale}.yaml").exists(), f"{path.name}: unknown scale {scale!r}"
    assert path.read_text().startswith(f"# @package {group}"), f"{path.name} must start with '# @package {group}'"
    component = OmegaConf.load(CONF / group / f"{choice}.yaml")
    parents = [OmegaConf.load(CONF / group / f"{d}.yaml") for d in component.get("defaults", [])
               if isinstance(d, str) and d != "_self_"]  # entries of other groups ({/llm: ...}) are no parents
    known = set(component) | {k for p in parents for k in p}
    preset = OmegaConf.load(path)
    assert set(preset) - {"defaults"} <= known, f"{path.name}: keys not in {group}/{choice}: {set(preset) - known}"
    model = {"tiny": "tiny_random", "sd": "sd14", "sdxl": "sdxl"}[scale]
    cfg = cfg_with(f"model={model}", f"{group}={choice}")
    # a per-domain preset of the model's default domain merges after this one: its keys are its own
    from emma import registry

    domain_preset = registry.preset_path(group, choice, scale, str(cfg.domain.name))
    by_domain = set(OmegaConf.load(domain_preset)) if domain_preset is not None else set()
    for key, value in preset.items():
        if key == "defaults" or key in by_domain or OmegaConf.is_interpolation(preset, key):
            continue
        if OmegaConf.is_dict(value):  # a per-domain table: the preset's entries merge into the paper's
            for sub in value:
                if not OmegaConf.is_interpolation(value, sub):
                    assert cfg[group][key][sub] == value[sub], (path.name, key, sub)
        else:
            assert cfg[group][key] == value, (path.name, key)


@pytest.mark.parametrize("path", sorted((CONF / "preset" / "method_domain").glob("*_tiny_*.yaml")),
                         ids=lambda p: p.stem)
def test_every_tiny_domain_preset_changes_only_its_method_keys_and_is_what_its_domain_composes(path):
    """A tiny per-domain preset ``<method>_tiny_<domain>.yaml`` belongs to an existing method and
    domain, changes only keys of the method, and its values (its parent's included) are what a
    tiny-world cell of that domain composes."""
    from omegaconf import OmegaConf

    method, domain = path.stem.split("_tiny_")
    assert (CONF / "method" / f"{method}.yaml").exists(), f"{path.name}: no conf/method/{method}.yaml"
    assert (CONF / "domain" / f"{domain}.yaml").exists(), f"{path.name}: no conf/domain/{domain}.yaml"
    assert path.read_text().startswith("# @package method"), f"{path.name} must start with '# @package method'"
    from emma import registry

    values: dict = {}
    for node in registry.preset_chain("method", method, "tiny", domain):  # its own keys over its parents'
        values = {**{k: v for k, v in node.items() if k != "defaults"}, **values}
    assert values, f"{path.name} sets nothing"
    component = OmegaConf.load(CONF / "method" / f"{method}.yaml")
    known = set(component) | {k for d in component.get("defaults", []) if isinstance(d, str) and d != "_self_"
                              for k in OmegaConf.load(CONF / "method" / f"{d}.yaml")}
    assert set(values) <= known, f"{path.name}: keys not in method/{method}: {set(values) - known}"
    cfg = cfg_with(f"method={method}", f"domain={domain}")
    for key, value in values.items():
        assert cfg.method[key] == value, (path.name, key)
    other = "tinyworld_style" if domain == "tinyworld" else "tinyworld"
    elsewhere = cfg_with(f"method={method}", f"domain={other}")
    assert any(elsewhere.method[k] != v for k, v in values.items()), f"{path.name} changes nothing for {domain}"


def test_an_experiment_sets_top_level_values_and_the_command_line_still_wins():
    """experiment=tinyworld_full sizes its cells (prompt types, images per prompt, threads):
    config.yaml's own nulls must not reset them; an explicit override beats the experiment."""
    cfg = cfg_with("experiment=tinyworld_full", "method=esd", "attacker=p4d_n")
    assert (list(cfg.prompt_types), cfg.images_per_prompt, cfg.threads) == (["name", "variant", "random"], 2, 1)
    assert cfg.attacker.iterations == 200 and cfg.method.iterations == 300  # tiny presets still apply
    assert cfg_with("experiment=tinyworld_full", "images_per_prompt=5").images_per_prompt == 5
    assert cfg_with("method=esd").prompt_types is None


def test_the_model_scale_sets_the_torch_threads_and_the_command_line_wins():
    """The tiny world runs on one CPU thread (its numbers then do not depend on the machine's
    core count); SD-scale models keep torch's default; threads=N overrides either."""
    assert cfg_with().threads == 1
    assert cfg_with("model=tiny_random").threads == 1
    assert cfg_with("model=sd14").threads is None
    assert cfg_with("threads=2").threads == 2
    assert cfg_with("model=sd14", "threads=4").threads == 4
