"""Authored descriptions, the no-name validator, the LLM client and the generation script."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from emma.api.domain import Concept
from emma.domains import (
    NameLeakError,
    check_descriptions,
    find_name_leaks,
    load_authored,
    load_domain,
)
from emma.domains.generated import descriptions_path
from emma.domains.text import normalize
from emma.domains.validate import validate_descriptions
from emma.errors import ConfigError, EmmaError, UnknownChoiceError
from stace.llm import LLMClient, parse_json_reply

REPO = Path(__file__).resolve().parents[1]

# STACE's ten concepts (STACE Table 2) -> (domain, canonical name)
STACE_CONCEPTS = {
    "Airplane": ("object", "airplane"), "Bird": ("object", "bird"), "Dog": ("object", "dog"),
    "Andy Warhol": ("style", "andy-warhol"), "Pablo Picasso": ("style", "pablo-picasso"),
    "Van Gogh": ("style", "vincent-van-gogh"), "Mickey Mouse": ("ip", "mickey-mouse"),
    "Superman": ("ip", "superman"), "Nudity": ("nsfw", "sexual"), "Violence": ("nsfw", "violence"),
}
AUTHORED_DOMAINS = ("object", "style", "ip", "nsfw")


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("EMMA_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("label", sorted(STACE_CONCEPTS))
def test_every_stace_concept_has_authored_content_with_emma_counts(label):
    domain_name, name = STACE_CONCEPTS[label]
    domain = load_domain(domain_name)
    assert domain.concept(label).name == name
    content = load_authored(domain)[name]
    assert len(content.short) == 5 and len(content.long) == 5
    assert len(content.variants) == (10 if domain.has_variants else 0)
    assert len(set(content.short)) == 5 and len(set(content.long)) == 5 and len(set(content.variants)) == len(
        content.variants)
    # EMMA's long descriptions expand the short ones
    assert all(len(long) > len(short) for short, long in zip(content.short, content.long, strict=True))
    assert content.source == "authored"


def test_every_ip_concept_has_authored_content():
    ip = load_domain("ip")
    assert set(load_authored(ip)) == set(ip.concepts)


@pytest.mark.parametrize("domain_name", AUTHORED_DOMAINS)
def test_every_authored_description_passes_the_no_name_validator(domain_name):
    domain = load_domain(domain_name)
    authored = load_authored(domain, validate=False)
    assert authored
    for name, content in authored.items():
        concept = domain.concepts[name]
        assert validate_descriptions(concept, [*content.short, *content.long]) == [], name
        # a variant is another way to say it, never the name itself (aliases may be variants)
        own = {normalize(concept.name), normalize(concept.label)}
        assert not own & {normalize(v) for v in content.variants}, name


@pytest.mark.parametrize("text,terms", [
    ("A painting by VAN GOGH of a wheat field", ["Van Gogh"]),
    ("swirling vangogh-like skies", ["Van Gogh"]),
    ("in the style of Van-Gogh", ["Van Gogh"]),
    ("Van  Gogh's sunflowers", ["Van Gogh"]),
    ("van_gogh", ["Van Gogh"]),
    ("a Dalí melting clock", ["Dali"]),
    ("two dogs in a park", ["dog"]),
    ("Superman's red cape", ["Superman"]),
    ("a reporter named CLARK KENT", ["Clark Kent"]),
    ("a print by M. C. Escher", ["M.C. Escher"]),
    ("a print by MC Escher", ["M.C. Escher"]),
    ("a shiny Air-Plane", ["airplane"]),
    ("an AIR PLANE at the gate", ["airplane"]),
    ("the Mickey\u00a0Mouse ears", ["Mickey Mouse"]),
])
def test_validator_catches_case_spacing_and_punctuation_variants(text, terms):
    leaks = find_name_leaks(text, terms)
    assert len(leaks) == 1 and leaks[0].term == terms[0]


@pytest.mark.parametrize("text,terms", [
    ("a pegasus-shaped emblem", ["ASUS"]),         # substring inside a word
    ("it works remotely", ["remote"]),
    ("a hotdog stand", ["dog"]),
    ("ski goggles", ["Gogh"]),
    ("such as us", ["ASUS"]),                     # a short word is never split
    ("a bedroom at night", ["bed"]),
])
def test_validator_does_not_flag_other_words(text, terms):
    assert find_name_leaks(text, terms) == []


def test_check_descriptions_lists_every_leak():
    concept = Concept(name="vincent-van-gogh", display="Vincent van Gogh", aliases=("Van Gogh", "Gogh"))
    texts = ["Thick impasto sunflowers.", "A starry night by vincent VAN gogh.", "Gogh's bedroom in Arles."]
    with pytest.raises(NameLeakError) as info:
        check_descriptions(concept, texts)
    message = str(info.value)
    assert message.startswith("2 description(s) of 'Vincent van Gogh' contain its name or an alias")
    assert "'vincent van gogh' (forbidden term 'Vincent van Gogh')" in message
    assert "'van gogh'" not in message  # one report per place, the longest match
    assert "A starry night" in message and "Gogh's bedroom" in message and "impasto" not in message


def _write(path: Path, concepts: dict) -> Path:
    path.write_text(yaml.safe_dump({"version": "1", "concepts": concepts}))
    return path


def test_loading_a_leaky_or_malformed_file_fails_with_the_reason(tmp_path):
    domain = load_domain("object")
    five = [f"A four-legged pet number {i}." for i in range(5)]
    leaky = _write(tmp_path / "leaky.yaml", {"dog": {"short": [*five[:4], "A happy Dog."], "long": five}})
    with pytest.raises(NameLeakError, match="'A happy Dog.'"):
        load_authored(domain, leaky)
    unknown = _write(tmp_path / "unknown.yaml", {"dragon": {"short": five}})
    with pytest.raises(UnknownChoiceError, match="dragon"):
        load_authored(domain, unknown)
    typo = _write(tmp_path / "typo.yaml", {"dog": {"shorts": five}})
    with pytest.raises(ConfigError, match="unknown fields \\['shorts'\\]"):
        load_authored(domain, typo)
    with pytest.raises(ConfigError, match="does not exist"):
        load_authored(domain, tmp_path / "missing.yaml")


# -- the LLM client -------------------------------------------------------------------------

def test_llm_client_reads_the_key_from_the_named_variable_and_never_shows_it(monkeypatch):
    client = LLMClient(model="m", base_url="http://localhost:1/v1", api_key_env="EMMA_TEST_LLM_KEY")
    monkeypatch.delenv("EMMA_TEST_LLM_KEY", raising=False)
    with pytest.raises(ConfigError, match="EMMA_TEST_LLM_KEY, which is not set"):
        client._api_key()
    monkeypatch.setenv("EMMA_TEST_LLM_KEY", "sk-very-secret")
    assert client._api_key() == "sk-very-secret"
    assert "sk-very-secret" not in repr(client) and "sk-very-secret" not in json.dumps(client.config())
    assert LLMClient(model="m", api_key_env=None)._api_key() == "EMPTY"


def test_llm_client_without_openai_package_says_how_to_install(monkeypatch):
    if importlib.util.find_spec("openai") is not None:
        pytest.skip("openai is installed here")
    monkeypatch.setenv("EMMA_TEST_LLM_KEY", "x")
    with pytest.raises(EmmaError, match=r"pip install 'emma-harness\[llm\]'"):
        LLMClient(model="m", api_key_env="EMMA_TEST_LLM_KEY").chat("hi")


def test_llm_configs_instantiate_without_secrets():
    import hydra.utils
    from omegaconf import OmegaConf

    from stace.embedded import EmbeddedLLM

    for path in sorted((REPO / "conf" / "llm").glob("*.yaml")):
        cfg = OmegaConf.load(path)
        assert "key" not in {k.lower() for k in cfg}, path
        client = hydra.utils.instantiate(cfg)  # the embedded model loads on first use, not here
        assert isinstance(client, (LLMClient, EmbeddedLLM)) and client.model


def test_parse_json_reply_accepts_code_fences():
    assert parse_json_reply('```json\n{"descriptions": ["a"]}\n```') == {"descriptions": ["a"]}
    assert parse_json_reply('["x", "y"]') == ["x", "y"]
    with pytest.raises(EmmaError, match="not valid JSON"):
        parse_json_reply("Sure! Here you go")


# -- scripts/generate_descriptions.py -----------------------------------------------------------

def _script():
    spec = importlib.util.spec_from_file_location("generate_descriptions",
                                                  REPO / "scripts" / "generate_descriptions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ScriptedLLM:
    """Replies from a script, recording the prompts it was sent."""

    model = "scripted-test-model"

    def __init__(self, replies: list[object]) -> None:
        self.replies = [json.dumps(r) for r in replies]
        self.prompts: list[str] = []

    def chat(self, messages, **kwargs) -> str:
        self.prompts.append(messages[-1]["content"])
        return self.replies.pop(0)


def test_generate_descriptions_rejects_leaks_and_asks_again(tmp_path):
    module = _script()
    variants = ["airplane", "aircraft", "jetliner", "airliner", "jumbo jet", "biplane", "seaplane",
                "glider", "turboprop", "airbus", "propeller craft"]
    client = ScriptedLLM([
        {"variants": variants},
        {"descriptions": ["A winged machine above the clouds.", "An AIRPLANE over the sea.",
                          "A shiny air-plane at the gate.", "A metal craft with two wings.",
                          "A jet climbing after take-off."]},
        {"descriptions": ["A passenger craft taxiing to the runway.", "A Plane landing at dusk."]},
        {"descriptions": ["A long winged machine gliding above a sea of white clouds at noon, engines on.",
                          "A metal craft with two wings crossing the sky, sunlight flashing on its hull.",
                          "Some aeroplanes parked at a gate while crews load luggage in the rain.",
                          "unused"]},
        {"descriptions": ["A long jet climbing after take-off over a city at dawn, gear tucked away.",
                          "A passenger craft taxiing slowly to the runway behind a yellow follow-me car.",
                          "A vehicle with wings landing softly at dusk with its lights blinking brightly."]},
    ])
    domain = load_domain("object")
    content = module.generate_descriptions(domain, "airplane", client, n_short=4, n_long=4)
    assert content.variants == tuple(variants[1:])          # the name itself is dropped
    assert content.short == ("A winged machine above the clouds.", "A metal craft with two wings.",
                             "A jet climbing after take-off.", "A passenger craft taxiing to the runway.")
    assert content.long[2].startswith("A long jet climbing") and len(content.long) == 4
    assert content.source == "llm:scripted-test-model"
    assert "An AIRPLANE over the sea." in client.prompts[2]  # the rejected ones are fed back
    assert '"aeroplane"' in client.prompts[1] and '"plane"' in client.prompts[1]
    assert validate_descriptions(domain.concepts["airplane"], [*content.short, *content.long]) == []

    target = tmp_path / "object.yaml"
    target.write_text("# header kept\nversion: '1'\ndomain: object\nconcepts: {}\n")
    module.merge_into_file(target, "object", "airplane", content)
    assert target.read_text().startswith("# header kept\n")
    loaded = load_authored(domain, target)["airplane"]
    assert loaded.short == content.short and loaded.source == "llm:scripted-test-model"
    with pytest.raises(EmmaError, match="--force"):
        module.merge_into_file(target, "object", "airplane", content)


def test_generate_descriptions_gives_up_with_the_rejected_texts():
    module = _script()
    leaky = {"descriptions": ["A dog.", "Dogs!", "DOG", "dog-like", "a dog"]}
    client = ScriptedLLM([leaky, leaky])
    with pytest.raises(EmmaError, match="only 0 of 5 short descriptions of 'dog' avoid its name"):
        module.generate_descriptions(load_domain("object"), "dog", client, n_variants=0, max_attempts=2)


def test_packaged_description_files_are_the_ones_loaded():
    assert descriptions_path("object").is_file()
    assert descriptions_path("object").parent == REPO / "emma" / "domains" / "data" / "descriptions"
