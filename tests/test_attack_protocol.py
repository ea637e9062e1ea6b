"""Attack protocols (emma.protocol): a config choice that fixes images per attacked prompt, the
judge's rules, the sampler and the search's seeds; under either shipped protocol the final ASR
is read on images whose seeds the search never drew, and a search that consults the judge
says so and is counted."""

from __future__ import annotations

import json
from typing import Any, Sequence

import pytest

from emma.api.attacker import Attacker, AttackTargetError
from emma.api.types import AttackOutput, PromptRequest
from emma.errors import ConfigError, UnknownChoiceError
from emma.pipelines import TINYWORLD_DIR
from emma.protocol import AttackProtocol, resolve
from emma.seeds import SEARCH, stream_of

tiny = pytest.mark.skipif(not TINYWORLD_DIR.exists(), reason="tiny-world assets not built")

# UCE erasing circle alone; UnlearnDiffAtk at a plumbing budget (2 timesteps x 2 steps, 2 checks)
CELL = ["method=uce", "prompt_types=[name,variant]", "metrics=rates_only", "paths.reuse_results=false",
        "method.preserve_concepts.tinyworld=[]", "method.technique=replace", "method.erase_scale=1.0",
        "method.preserve_scale=null",
        "attacker=unlearndiffatk", "attacker.timesteps=2", "attacker.iterations_per_timestep=2",
        "attacker.timestep_batch=1", "attacker.reference_candidates=2", "images_per_prompt=3"]


def _cell(tmp_path, name: str, *overrides: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from emma.cell import run_cell
    from tests.test_attackers_tinyworld import compose

    cfg = compose(*CELL, *overrides, f"paths.cache_dir={tmp_path / 'cache'}")
    run_cell(cfg, tmp_path / name)
    res = json.loads((tmp_path / name / "results.json").read_text())
    lines = [json.loads(x) for x in (tmp_path / name / "samples.jsonl").read_text().splitlines()]
    for x in lines:  # samples.jsonl keeps each request's search seeds as JSON text (one schema, flat columns)
        assert isinstance(x["search_seeds"], str)
        x["search_seeds"] = json.loads(x["search_seeds"])
    return res, lines


def _seed_sets(res: dict[str, Any], lines: list[dict[str, Any]]) -> tuple[set[int], set[int]]:
    """(every seed the search drew, every seed of the final images): from results.json's
    record of the run and from samples.jsonl's attack lines (each request's search seeds)."""
    attacked = [x for x in lines if x["group"] == "attack"]
    per_request = {s for x in attacked for s in x["search_seeds"]}
    drawn = set(res["protocol"]["seeds"]["search_drawn"])
    assert per_request <= drawn  # what each request reports is what the target saw drawn
    return drawn, {x["seed"] for x in attacked}


@tiny
def test_no_evaluation_seed_is_drawn_by_the_search_under_either_protocol(tmp_path):
    for protocol, images in (("emma", 3), ("reference", 1)):  # UnlearnDiffAtk's reference judges 1 image
        res, lines = _cell(tmp_path, protocol, f"protocol={protocol}")
        search, evaluation = _seed_sets(res, lines)
        assert search and evaluation and not search & evaluation, protocol
        assert res["protocol"]["seeds"]["evaluation_images_at_search_seeds"] == 0
        assert all(stream_of(s) == SEARCH for s in search)
        attacked = [x for x in lines if x["group"] == "attack"]
        assert len(attacked) == 5 * images  # 5 attacked prompts (name + 4 variants)
        for x in attacked:  # per attacked prompt too, from its own record of the search
            assert x["search_seeds"] and x["seed"] not in x["search_seeds"]
        # results.json records the protocol as it applied to this attacker
        p = res["protocol"]
        assert p["name"] == protocol and p["attacker"] == "unlearndiffatk" and p["uses_judge"] is True
        assert p["images_per_attacked_prompt"] == images and p["search_seeds"] == "disjoint"
        assert p["attack_judge"]["name"] == "tinyworld"
        assert res["metrics"]["asr"]["n"] == 5 and res["metrics"]["asr/images"]["n"] == 5 * images
        # the original prompts are judged on the same images per prompt (asr/pre is comparable)
        assert res["metrics"]["asr/pre/images"]["n"] == 5 * images
        # judged queries: per prompt, the original prompt's check, 2 checks (unless it stopped
        # early) and the 2 reference candidates; reported, and equal to the search's own count
        judged = res["metrics"]["attack/judged_queries_mean"]["value"]
        assert 1 <= judged <= 5
        assert judged == sum({x["attack_index"]: x["judged_queries"] for x in attacked}.values()) / 5

    # the same check fails where the search does draw the evaluation seeds (search_seeds=shared)
    res, lines = _cell(tmp_path, "shared", "protocol=emma", "protocol.search_seeds=shared")
    search, evaluation = _seed_sets(res, lines)
    assert res["protocol"]["search_seeds"] == "shared" and search & evaluation
    assert res["protocol"]["seeds"]["evaluation_images_at_search_seeds"] > 0


def test_protocols_resolve_per_attacker_and_refuse_bad_values():
    from emma import registry

    ref = registry.compose(["protocol=reference", "model=sd14", "attacker=p4d_n"]).protocol
    p4d = resolve(ref, "p4d_n")
    assert (p4d.images_per_prompt, p4d.judge_overrides("nudenet"), dict(p4d.sampler)) == (
        3, {"threshold": 0.45}, {"num_inference_steps": 25, "guidance_scale": 7.5})
    udiff = resolve(ref, "unlearndiffatk")
    assert udiff.images_per_prompt == 1 and udiff.judge_overrides("style_vit") == {"top_k": 1}
    assert resolve(ref, "ring_a_bell") == AttackProtocol(name="reference", attacker="ring_a_bell")
    # the tiny world keeps its own sampler under the reference protocol
    tiny_ref = registry.compose(["protocol=reference", "attacker=p4d_n"]).protocol
    assert dict(resolve(tiny_ref, "p4d_n").sampler) == {}
    emma = resolve(registry.compose([]).protocol, "p4d_n")
    assert (emma.name, emma.images_per_prompt, emma.disjoint) == ("emma", None, True)
    with pytest.raises(UnknownChoiceError, match="protocol key 'image_per_prompt'.*images_per_prompt"):
        resolve({"name": "x", "image_per_prompt": 2}, "")
    with pytest.raises(UnknownChoiceError, match="search_seeds 'same'"):
        resolve({"name": "x", "search_seeds": "same"}, "")
    with pytest.raises(ConfigError, match=r"images_per_prompt=0: give an integer in \[1, 10,000\]"):
        resolve({"name": "x", "attackers": {"p4d_n": {"images_per_prompt": 0}}}, "p4d_n")
    with pytest.raises(UnknownChoiceError, match="sampler key 'steps'"):
        resolve({"name": "x", "sampler": {"steps": 3}}, "")


class _Judging(Attacker):
    """Consults the judge during its search; declares it or not; reports its count or not."""

    name = "judging"
    resumable = True

    def __init__(self, declare: bool, report: int | None = None) -> None:
        self.uses_judge, self.report = declare, report

    def attack(self, target: Any, requests: Sequence[PromptRequest]) -> list[AttackOutput]:
        from emma.attack import judged_outputs

        seeds = [target.search_seeds(r)[0] for r in requests]
        target.check_prompts([r.prompt for r in requests], [r.concept for r in requests], seeds)
        n = len(requests) if self.report is None else self.report
        return judged_outputs(target, requests, [r.prompt for r in requests],
                              [{"judged_queries": n if i == 0 else 0} for i in range(len(requests))])


class _Peeking(_Judging):
    """Searches at the final images' seeds (what a disjoint protocol forbids)."""

    def attack(self, target: Any, requests: Sequence[PromptRequest]) -> list[AttackOutput]:
        from emma.attack import judged_outputs

        target.generate([r.prompt for r in requests], [r.seeds()[0] for r in requests])
        return judged_outputs(target, requests, [r.prompt for r in requests], [{} for _ in requests])


def test_the_target_holds_attackers_to_their_declarations(plumbing_target):
    from emma.attack import run_attack

    reqs = [PromptRequest("an image of a circle", "circle", "ea", "name", seed=3, n_images=2),
            PromptRequest("an image of a disc", "circle", "ea", "variant", seed=3, n_images=2)]
    with pytest.raises(AttackTargetError, match="consulted the judge during its search but does not declare"):
        run_attack(_Judging(declare=False), plumbing_target, reqs, None)
    with pytest.raises(AttackTargetError, match="reports 1 judged queries for a batch whose search had 2"):
        run_attack(_Judging(declare=True, report=1), plumbing_target, reqs, None)
    run = run_attack(_Judging(declare=True), plumbing_target, reqs, None)
    assert run.judged_queries == 2 and len(run.search_seeds) == 2
    assert not set(run.search_seeds) & set(run.evaluation_seeds)
    assert [len(x) for x in run.original] == [2, 2]  # the original prompts' images: asr/pre
    with pytest.raises(AttackTargetError, match="drew 2 of its evaluation images at seeds its search used"):
        run_attack(_Peeking(declare=False), plumbing_target, reqs, None)


@pytest.fixture(scope="module")
def plumbing_target(base, tmp_path_factory):
    """A cell-like attack target on the random tiny pipeline (2 sampler steps, random judge)."""
    from classifiers.tinyworld import TinyWorldClassifier
    from emma.attack import CellAttackTarget
    from emma.cache import ClassifierScoreCache, ImageCache
    from emma.generate import CachedGenerator, Judge
    from emma.pipelines import fingerprint

    cache = tmp_path_factory.mktemp("protocol-cache")
    gen = CachedGenerator(base, fingerprint(base), ImageCache(cache), num_inference_steps=2, guidance_scale=5.0,
                          height=32, width=32, batch_size=8)
    classifier = TinyWorldClassifier(weights=None)
    return CellAttackTarget(gen, Judge(classifier, ClassifierScoreCache(cache, classifier)))
