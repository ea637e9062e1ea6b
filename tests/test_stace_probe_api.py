"""The probe API beyond text prompts, through the real sandbox on the trained tiny world:
generation from prompt embeddings, tokenizer and text-encoder queries, and the project's
attackers as tools. The program runs sandboxed; the harness answers, renders and judges."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from emma.api.types import PromptRequest
from stace.loop import ProbeSession, Renderer
from stace.sandbox import SandboxLimits, run_sandboxed
from stace.tools import ProbeTools, attacker_factory

LIMITS = SandboxLimits(cpu_s=20, wall_s=60, memory_mb=512, output_kb=256)
P4D_TINY = {"n_tokens": 4, "iterations": 3, "eval_every": 2, "early_stop": False, "keep_original": False}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The tiny world, not erased, as a cell's attack target (base model = the same weights)."""
    from classifiers.tinyworld import TinyWorldClassifier
    from emma.attack import CellAttackTarget, LazyBaseModel, domain_prompt_texts
    from emma.cache import ClassifierScoreCache, ImageCache
    from emma.domains.tinyworld import tinyworld_domain
    from emma.generate import CachedGenerator, Judge
    from emma.pipelines import fingerprint, load_pipeline

    torch.set_num_threads(1)
    cfg = {"kind": "tinyworld", "dtype": "float32", "device": "cpu"}
    pipe = load_pipeline(cfg)
    cache = tmp_path_factory.mktemp("probe-api-cache")

    def make(p, fp):
        return CachedGenerator(p, fp, ImageCache(cache), num_inference_steps=20, guidance_scale=5.0,
                               height=32, width=32, batch_size=8)

    fp = fingerprint(pipe)
    clf = TinyWorldClassifier()
    base = LazyBaseModel(lambda: pipe, fp, make)
    # as a cell gives it: the domain's prompts too (the tiny presets search their tokens)
    return CellAttackTarget(make(pipe, fp), Judge(clf, ClassifierScoreCache(cache, clf)), base=base,
                            model_name="tinyworld", domain_prompts=lambda: domain_prompt_texts(tinyworld_domain()))


def _session(target, tmp_path, attackers=None):
    tools = ProbeTools(target, "circle", "an image of a circle", attackers, attack_cache=tmp_path)
    renderer = Renderer(target, "circle", tmp_path / "images")
    return ProbeSession("circle", 4, 100, renderer.defaults(), tools), renderer, tools


def test_an_encoded_prompt_renders_as_its_text_and_a_mix_renders_too(target, tmp_path):
    session, renderer, tools = _session(target, tmp_path)
    code = (
        "info = probe.info()\n"
        "print(info['embed_shape'])\n"
        "e = probe.encode('an image of a circle')\n"
        "probe.generate(['an image of a circle'], seeds=[3])\n"
        "probe.generate_embeds(e, seeds=[3], label='circle as embeddings')\n"
        "s = probe.encode('an image of a square')\n"
        "mix = [[0.5 * x + 0.5 * y for x, y in zip(r, q)] for r, q in zip(e, s)]\n"
        "print(probe.generate_embeds([mix], seeds=[4], guidance_scale=7.5, label='circle/square mix'))\n"
        "try:\n"
        "    probe.generate_embeds([[1.0, 2.0]], seeds=[5])\n"
        "except RuntimeError as exc:\n"
        "    print('refused:', exc)\n"
    )
    r = run_sandboxed(code, session.handle, LIMITS)
    assert r.ok, r.stderr
    L, D = tools.embed_shape()
    lines = r.stdout.splitlines()
    assert json.loads(lines[0]) == [L, D] == [77, target.pipe.text_encoder.config.hidden_size]
    assert lines[1] == "[2]"
    assert "refused:" in lines[2] and f"each must be {L} x {D}" in lines[2]
    assert len(session.probes) == 3 and [p.embeds is None for p in session.probes] == [True, False, False]
    assert session.probes[1].prompt.startswith("<circle as embeddings ")
    renderer.render(session.probes, session.embeds)
    text, embeds, mix = session.probes
    # the same conditioning and seed: the same image, judged the same (the base model draws a circle)
    assert text.image_hash == embeds.image_hash and text.detected and embeds.detected
    assert mix.image_hash not in (text.image_hash, None) and mix.guidance_scale == 7.5
    # the embeddings were the text encoder's, and are kept beside the images
    saved = torch.load(tmp_path / "embeds" / f"{embeds.embeds}.pt")
    ids = target.pipe.tokenizer(["an image of a circle"], padding="max_length", max_length=77,
                                return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(saved, target.pipe.text_encoder(ids)[0][0], atol=1e-5, rtol=1e-5)
    assert (tmp_path / "images" / f"{mix.image_hash}.png").exists()


def test_tokenizer_and_nearest_token_queries_match_independent_computations(target, tmp_path):
    session, _, _ = _session(target, tmp_path)
    code = ("import json\n"
            "print(json.dumps(probe.tokenize('a roundish disc')))\n"
            "print(json.dumps(probe.token_ids('a roundish disc')))\n"
            "print(json.dumps(probe.nearest_tokens('circle', n=5)))\n")
    r = run_sandboxed(code, session.handle, LIMITS)
    assert r.ok, r.stderr
    toks, ids, near = (json.loads(x) for x in r.stdout.splitlines())
    tok = target.pipe.tokenizer
    assert toks == tok.tokenize("a roundish disc")
    assert ids == tok("a roundish disc").input_ids and ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    table = target.pipe.text_encoder.get_input_embeddings().weight.detach().numpy().astype(np.float64)
    q = table[tok("circle").input_ids[1:-1]].mean(0)
    cos = table @ q / (np.linalg.norm(table, axis=1) * np.linalg.norm(q))
    top = np.argsort(-cos)[:5]
    assert [w for w, _ in near] == [tok.decode([int(i)]).strip() for i in top]
    assert [c for _, c in near] == pytest.approx(cos[top].tolist(), abs=1e-5)
    assert near[0][0] == "circle" and near[0][1] == pytest.approx(1.0)


def test_an_attacker_runs_as_a_tool_and_its_prompt_is_rendered(target, tmp_path):
    factories = {"p4d_n": lambda: attacker_factory("p4d_n", "tiny", P4D_TINY)}
    session, renderer, tools = _session(target, tmp_path, factories)
    code = ("print(probe.info()['attackers'])\n"
            "a = probe.attack('p4d_n', 'an image of a circle', seed=7)\n"
            "print(a['adversarial_prompt'])\n"
            "probe.generate([a['adversarial_prompt']], seeds=[0])\n"
            "try:\n"
            "    probe.attack('sneaky')\n"
            "except RuntimeError as exc:\n"
            "    print('refused:', exc)\n")
    r = run_sandboxed(code, session.handle, LIMITS)
    assert r.ok, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "['p4d_n']"
    assert "refused:" in lines[2] and "unknown attacker 'sneaky'; available: p4d_n" in lines[2]
    # the same attack run directly (P4D with the preset and the overrides) gives the same prompt
    direct = attacker_factory("p4d_n", "tiny", P4D_TINY).attack(
        target, [PromptRequest("an image of a circle", "circle", "attack", "stace-tool/p4d_n", seed=7)])[0]
    assert lines[1] == direct.adversarial_prompt != "an image of a circle"
    call = tools.calls[0]
    assert (call.attacker, call.prompt, call.seed, call.iterations) == ("p4d_n", "an image of a circle", 7, 3)
    assert call.adversarial_prompt == direct.adversarial_prompt and call.queries == direct.queries
    assert [p.prompt for p in session.probes] == [direct.adversarial_prompt]
    assert len(tools.calls) == 1  # the unknown one was refused before it ran
    # the optimiser's judge queries were charged to the hypothesis's k = 4, beside the image
    assert session.attack_queries == direct.queries and session.left() == 4 - 1 - direct.queries


def test_tool_attackers_follow_the_preset_and_unknown_ones_are_refused():
    from emma.errors import UnknownChoiceError

    a = attacker_factory("unlearndiffatk", "tiny", {"k": 2})
    assert (a.timesteps, a.iterations_per_timestep, a.k) == (10, 10, 2)  # preset, then override
    assert attacker_factory("unlearndiffatk", "sd").timesteps == 50
    with pytest.raises(UnknownChoiceError, match="sneaky"):
        attacker_factory("sneaky", "tiny")
