"""The tiny world: renderer, captions, tokenizer, training script end to end, and the shipped
model's quality on a small sample (looser floors than the model card's)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from emma.tinyworld import arch, world
from emma.tinyworld.tokenizer import local_clip_tokenizer

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "emma" / "tinyworld" / "assets"
needs_assets = pytest.mark.skipif(not (ASSETS / "pipeline" / "model_index.json").exists(),
                                  reason="tiny-world assets not built (scripts/train_tinyworld.py --export)")


def test_rendering_is_deterministic_and_covers_the_world():
    a = world.render_batch(world.sample_specs(64, seed=3))
    b = world.render_batch(world.sample_specs(64, seed=3))
    c = world.render_batch(world.sample_specs(64, seed=4))
    assert a.shape == (64, 3, 32, 32) and a.dtype == np.float32
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    specs = world.sample_specs(2000, seed=0)
    assert {s.shape for s in specs} == set(world.SHAPES)
    assert {s.colour for s in specs} == set(world.COLOURS)
    assert {s.style for s in specs} == set(world.STYLES)
    assert len(world.SHAPES) >= 8 and len(world.COLOURS) >= 6 and len(world.STYLES) >= 4


def test_shape_masks_differ_between_shapes():
    masks = {s: world.shape_mask(s, 16, 16, 11) > 0.5 for s in world.SHAPES}
    for s1 in world.SHAPES:
        assert 40 < masks[s1].sum() < 400, s1
        for s2 in world.SHAPES:
            if s1 < s2:
                assert (masks[s1] ^ masks[s2]).sum() > 15, (s1, s2)
    # a circle is rotation-symmetric, a triangle is not upside-down symmetric
    assert (masks["circle"] == masks["circle"][::-1]).mean() > 0.98
    assert (masks["triangle"] == masks["triangle"][::-1]).mean() < 0.9


def test_descriptions_never_use_name_or_synonym():
    for shape in world.SHAPES:
        banned = [shape, *world.SHAPE_VARIANTS[shape]]
        for desc in world.SHAPE_SHORT[shape] + world.SHAPE_LONG[shape]:
            for phrase in banned:
                assert not re.search(rf"\b{re.escape(phrase)}s?\b", desc.lower()), (shape, desc, phrase)
        assert len(world.SHAPE_VARIANTS[shape]) >= 3
    for style in world.STYLES:
        assert len(world.STYLE_VARIANTS[style]) >= 3
        for v in world.STYLE_VARIANTS[style]:
            assert style not in v


def test_captions_mix_names_synonyms_and_descriptions():
    rng = np.random.default_rng(0)
    spec = world.SceneSpec("heart", "red", "dotted", 16, 16, 10, 0)
    caps = [world.caption(spec, rng) for _ in range(400)]
    named = sum("heart" in c for c in caps) / len(caps)
    synonym = sum(any(v in c for v in world.SHAPE_VARIANTS["heart"]) for c in caps) / len(caps)
    described = sum(any(d.split(" ", 1)[1][:20] in c for d in world.SHAPE_SHORT["heart"] + world.SHAPE_LONG["heart"])
                    for c in caps) / len(caps)
    assert 0.4 < named < 0.6 and 0.12 < synonym < 0.3 and 0.2 < described < 0.4
    assert all("heart" not in c for c in caps if any(v in c for v in world.SHAPE_VARIANTS["heart"]))


def test_local_clip_tokenizer_matches_sd_vocabulary():
    tok = local_clip_tokenizer()
    assert tok.model_max_length == 77 and len(tok) == 49408
    assert tok.bos_token == "<|startoftext|>" and tok.eos_token == "<|endoftext|>"
    # ids of openai/clip-vit-large-patch14 (SD v1.x) for a known sentence
    assert tok("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    ids = tok("x", padding="max_length", max_length=77).input_ids
    assert len(ids) == 77 and ids[-1] == 49407


def test_training_script_runs_end_to_end_and_exports_an_sd_pipeline(tmp_path):
    from diffusers import StableDiffusionPipeline

    work, out = tmp_path / "work", tmp_path / "export"
    cmd = [sys.executable, str(ROOT / "scripts" / "train_tinyworld.py"), "--work-dir", str(work),
           "--export", str(out), "--threads", "1", "--vae-steps", "3", "--vae-batch", "4", "--clf-steps", "2",
           "--clf-batch", "8", "--pool-size", "64", "--unet-steps", "4", "--unet-batch", "4", "--ckpt-every", "2",
           "--lexicon", "random"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("vae.pt", "classifier.pt", "pool.pt", "lexicon.npy", "unet_final.pt"):
        assert (work / name).exists(), name
    training = json.loads((out / "training.json").read_text())
    assert training["unet_steps_trained"] == 4
    pipe = StableDiffusionPipeline.from_pretrained(out / "pipeline", local_files_only=True, dtype=torch.float32)
    assert pipe.unet.config.sample_size == 8 and pipe.vae.config.latent_channels == 8
    assert pipe.text_encoder.config.num_hidden_layers == 3
    assert type(pipe.scheduler).__name__ == arch.SCHEDULER_CLASS
    img = pipe("an image of a red star", num_inference_steps=2, guidance_scale=5.0, height=32, width=32,
               generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert img.shape == (1, 3, 32, 32)
    # resuming a finished run trains nothing more and re-exports identical weights
    before = (out / "classifier.safetensors").read_bytes()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert again.returncode == 0 and "unet: done, skipping" in again.stdout
    assert (out / "classifier.safetensors").read_bytes() == before
    # extending the run with another UNet architecture is refused, naming both
    at = cmd.index("--unet-steps")
    other = [*cmd[:at], "--unet-steps", "6", *cmd[at + 2:], "--unet", "v1"]
    refused = subprocess.run(other, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert refused.returncode != 0
    last = refused.stderr.strip().splitlines()[-1]
    assert "holds a --unet v2 run; resume it with that --unet, or start --unet v1" in last
    # a continuation with the affinity columns and the wider language: the map is widened, the
    # export records both phases
    longer = [*cmd[:at], "--unet-steps", "6", *cmd[at + 2:], "--stages", "affinity,unet", "--affinity-negatives",
              "20", "--object-words", "0.3", "--filler-words", "english", "--filler-alone", "0.5"]
    proc = subprocess.run(longer, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the lexicon gained columns" in proc.stdout and (work / "affinity.npy").exists()
    phases = json.loads((out / "training.json").read_text())["phases"]
    assert [(p["from_step"], p["to_step"]) for p in phases] == [(0, 4), (4, 6)]
    assert phases[0]["args"]["object_words"] == 0 and phases[1]["args"]["object_words"] == 0.3
    pipe = StableDiffusionPipeline.from_pretrained(out / "pipeline", local_files_only=True, dtype=torch.float32)
    assert pipe.text_encoder.get_input_embeddings().weight.shape[0] == 49408
    # the same two phases as a recipe, in one command and a fresh work dir, give the same weights
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"args": {"lexicon": "random"}, "phases": [
        {"unet_steps": 4}, {"unet_steps": 6, "stages": "affinity,unet", "affinity_negatives": 20,
                            "object_words": 0.3, "filler_words": "english", "filler_alone": 0.5}]}))
    base = [a for a in cmd if a not in ("--lexicon", "random")]
    del base[base.index("--unet-steps"):base.index("--unet-steps") + 2]  # the recipe sets it
    base[base.index("--work-dir") + 1], base[base.index("--export") + 1] = str(tmp_path / "w2"), str(tmp_path / "e2")
    proc = subprocess.run([*base, "--recipe", str(recipe)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for part in ("unet", "text_encoder"):
        ours = next((tmp_path / "e2" / "pipeline" / part).glob("*.safetensors")).read_bytes()
        assert ours == next((out / "pipeline" / part).glob("*.safetensors")).read_bytes(), part
    exported = json.loads((tmp_path / "e2" / "training.json").read_text())
    assert exported["recipe"]["phases"][1]["unet_steps"] == 6
    assert [(p["from_step"], p["to_step"]) for p in exported["phases"]] == [(0, 4), (4, 6)]
    # a continuation with the identity read-out: the optimizer restarts, the read-out is
    # checkpointed and its loss logged
    ident = [*cmd[:at], "--unet-steps", "8", *cmd[at + 2:], "--identity-loss", "0.1"]
    proc = subprocess.run(ident, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the identity read-out starts; optimizer reset" in proc.stdout
    assert "unet step 8 loss" in proc.stdout and " identity " in proc.stdout
    ckpt = torch.load(work / "unet_ckpt.pt", map_location="cpu", weights_only=False)
    assert ckpt["step"] == 8 and ckpt["head"]["weight"].shape == (49408, 64)
    # an export continues in a fresh work dir: the lexicon map is recovered from its baked table
    fresh = [*base, "--lexicon", "random", "--unet-steps", "10", "--init-from", str(out),
             "--stages", "vae,classifier,pool,lexicon,affinity,unet", "--affinity-negatives", "20"]
    fresh[fresh.index("--work-dir") + 1] = str(tmp_path / "w3")
    fresh[fresh.index("--export") + 1] = str(tmp_path / "e3")
    proc = subprocess.run(fresh, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "unet: initialised from" in proc.stdout and "at step 8" in proc.stdout
    residual = float(proc.stdout.split("largest residual ")[1].split(")")[0])
    assert residual < 1e-2, "the seeded lexicon and affinity are rebuilt exactly, so the map fits the table"


@pytest.mark.parametrize("recipe, message", [
    ({"phases": []}, "with at least one phase"),
    ({"phases": [{"unet_steps": 4, "unet_stepz": 5}]}, "phase 1 sets unet_stepz, which a recipe cannot set; valid: "),
    ({"args": {"threads": 2}, "phases": [{"unet_steps": 4}]}, "args sets threads, which a recipe cannot set"),
    ({"phases": [{"unet_steps": 4}, {"unet_steps": 4}]}, "phase 2 must set unet_steps above the previous phase's (4)"),
    ({"phases": [{"unet_steps": 4, "stages": "unet,paint"}]}, "unknown stage 'paint'; valid: vae, classifier"),
    ({"args": {"seed": 0}, "phases": [{"unet_steps": 4}], "argv": ["--seed", "3"]},
     "--recipe sets --seed; drop it from the command line or edit the recipe"),
])
def test_training_recipe_errors_name_the_bad_setting(tmp_path, recipe, message):
    path = tmp_path / "recipe.json"
    argv = recipe.pop("argv", [])
    path.write_text(json.dumps(recipe))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_tinyworld.py"), "--work-dir",
                           str(tmp_path / "w"), "--recipe", str(path), *argv], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode != 0 and not (tmp_path / "w" / "vae.pt").exists()
    last = proc.stderr.strip().splitlines()[-1]
    assert message in last and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_shipped_recipe_is_valid_and_continues_phase_by_phase():
    spec = importlib.util.spec_from_file_location("train_tinyworld", ROOT / "scripts" / "train_tinyworld.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = mod.build_parser().parse_args([])
    base, phases = mod.load_recipe(ROOT / "scripts" / "tinyworld_recipe.json", args)
    assert base["stages"] == "vae,classifier,pool,lexicon" and base["lexicon"] == "minilm"
    assert [ph["unet_steps"] for ph in phases] == [4000, 8000, 12000, 15000, 18000, 21000, 27000, 30000, 36000]
    assert [ph.get("stages", "unet") for ph in phases].count("affinity,unet") == 2
    # the last phase distils the text encoder and trains the UNet against it, frozen
    assert phases[-1]["stages"] == "distil,unet" and phases[-1]["frozen_text_encoder"] is True
    assert not any(ph.get("frozen_text_encoder") for ph in phases[:-1])


@needs_assets
def test_shipped_pipeline_samples_with_the_tiny_world_scheduler():
    from diffusers import StableDiffusionPipeline

    from emma.pipelines import make_scheduler

    pipe = StableDiffusionPipeline.from_pretrained(ASSETS / "pipeline", local_files_only=True)
    assert type(pipe.scheduler).__name__ == arch.SCHEDULER_CLASS == "EulerAncestralDiscreteScheduler"
    expected = make_scheduler(arch.SCHEDULER_CLASS, arch.SCHEDULER_CONFIG).config
    for key in ("beta_start", "beta_end", "beta_schedule", "num_train_timesteps", "steps_offset",
                "timestep_spacing", "prediction_type"):
        assert pipe.scheduler.config[key] == expected[key], key
    assert expected["timestep_spacing"] == "leading" and expected["steps_offset"] == 1


@needs_assets
def test_shipped_classifier_accuracy_on_held_out_renders():
    from classifiers.tinyworld import HEADS, TinyWorldClassifier

    clf = TinyWorldClassifier()
    specs = world.sample_specs(400, seed=424242)
    probs = clf.predict(torch.from_numpy(world.render_batch(specs)))
    for head, attr in (("shape", "shape"), ("colour", "colour"), ("style", "style")):
        lo = sum(len(HEADS[h]) for h in list(HEADS)[: list(HEADS).index(head)])
        pred = probs[:, lo : lo + len(HEADS[head])].argmax(1)
        truth = torch.tensor([HEADS[head].index(getattr(s, attr)) for s in specs])
        assert (pred == truth).float().mean() >= 0.97, head


@needs_assets
def test_shipped_model_draws_what_it_is_asked_for(tmp_path):
    from classifiers.tinyworld import TinyWorldClassifier
    from emma.tinyworld.quality import evaluate_world, make_target

    target = make_target(ASSETS / "pipeline", TinyWorldClassifier(), tmp_path)
    q = evaluate_world(target, n_name=4, n_other=1, seed=77)
    # the model card measures 0.72-1.00 per shape on name prompts (40 images each), 0.80-1.00
    # on variant / short / long prompts and 0.97-1.00 on styles; the floors leave room for
    # the small sample (4 images per name prompt, 1 per other prompt)
    assert np.mean([r["name"] for r in q.shapes.values()]) >= 0.75, q.shapes
    for kind in ("variant", "short", "long"):
        assert np.mean([r[kind] for r in q.shapes.values()]) >= 0.65, (kind, q.shapes)
    assert min(r["name"] for r in q.shapes.values()) >= 0.25, q.shapes
    assert np.mean(list(q.styles.values())) >= 0.75, q.styles
    # the card's guidance sweep: at the same guidance and seeds, name_rates reproduces the
    # name column from the images already cached; another guidance draws other images
    from emma.tinyworld.quality import name_rates

    assert name_rates(target, n=4, seed=77) == {c: r["name"] for c, r in q.shapes.items()}
    low = make_target(ASSETS / "pipeline", TinyWorldClassifier(), tmp_path, guidance=1.0)
    a = target.generate(["an image of a circle"], [77]).images
    b = low.generate(["an image of a circle"], [77]).images
    assert (a - b).abs().max() > 0.05


@needs_assets
def test_default_cell_measures_the_base_model(tmp_path, monkeypatch):
    """The base model draws the target and the non-targets: EA is low and RA high, and an
    erasure method would have room to move both (issue 5's floors rely on this)."""
    from hydra import compose, initialize_config_dir

    from emma.cell import run_cell
    from emma.registry import register_configs

    monkeypatch.setenv("EMMA_CACHE", str(tmp_path / "cache"))
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "concept=circle", "images_per_prompt=8", "prompt_types=[name,random]", "metrics=rates_only"])
    res = run_cell(cfg, tmp_path / "run")
    assert res.cell.model == "tinyworld" and res.cell.classifier == "tinyworld"
    assert res.metrics["ea/name"].n == 8 and res.metrics["ra/random"].n == 40
    # model card: the judge finds "circle" in 95% of name-prompt images (EA about 0.05) and
    # the other shapes in 72-100% of theirs
    assert res.metrics["ea/name"].value <= 0.3
    assert res.metrics["ra/random"].value >= 0.6
    assert not res.notes  # real weights: no plumbing-only note


def test_model_card_lists_the_recipe_phases_and_what_each_changed():
    sys.path.insert(0, str(ROOT / "scripts"))
    import eval_tinyworld

    table = eval_tinyworld.phase_table({"recipe": json.loads((ROOT / "scripts" / "tinyworld_recipe.json").read_text())})
    rows = table.splitlines()[2:]
    assert rows[0] == "| 1 | 0 -> 4000 | - |"
    assert rows[3].startswith("| 4 | 12000 -> 15000 | ") and "object_words=0.3" in rows[3]
    assert "stages=affinity,unet" in rows[5] and "affinity_scale=4.0" in rows[5]
    assert eval_tinyworld.phase_table({"args": {}}) == "(one phase: the arguments in training.json)"


@needs_assets
def test_card_only_rewrites_the_card_from_stored_measurements(tmp_path):
    """``--card-only`` measures nothing: the card's tables are the stored quality and probe
    files' numbers; without them it refuses in one line."""
    import shutil

    sys.path.insert(0, str(ROOT / "scripts"))
    import eval_tinyworld

    assets = tmp_path / "assets"
    shutil.copytree(ASSETS, assets)
    quality = json.loads((assets / "quality.json").read_text())
    quality["shapes"]["circle"] = {"name": 0.123, "variant": 0.456, "short": 0.789, "long": 0.5}
    (assets / "quality.json").write_text(json.dumps(quality))
    (assets / "README.md").unlink()
    eval_tinyworld.main(["--assets", str(assets), "--card-only", "--wall-time", "a while"])
    card = (assets / "README.md").read_text()
    assert "| circle | 0.12 | 0.46 | 0.79 | 0.50 |" in card and "Wall time: a while." in card
    assert ("below target in 3 of the measured rates:** circle name 0.12 (target 0.93); circle variant 0.46 "
            "(target 0.70); circle long 0.50 (target 0.70).") in card
    probe = json.loads((assets / "generalisation.json").read_text())
    assert f"**{probe['passed']} of {probe['total']}**" in card
    assert "| 9 | 30000 -> 36000 | stages=distil,unet" in card
    eval_tinyworld.main(["--assets", str(assets), "--card-only"])  # a rewrite keeps the card's wall time
    assert "Wall time: a while." in (assets / "README.md").read_text()
    eval_tinyworld.main(["--assets", str(assets), "--card-only", "--wall-time", ""])  # a given value wins
    assert "Wall time: ." in (assets / "README.md").read_text()
    (assets / "generalisation.json").unlink()
    with pytest.raises(SystemExit, match="has no generalisation.json; run without --card-only first"):
        eval_tinyworld.main(["--assets", str(assets), "--card-only"])


def test_affinity_stage_skips_same_settings_and_refits_changed_ones(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("train_tinyworld", ROOT / "scripts" / "train_tinyworld.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    feats = np.random.default_rng(0).standard_normal((len(local_clip_tokenizer()), 16)).astype(np.float16)
    np.save(tmp_path / "lexicon.npy", feats)
    args = mod.build_parser().parse_args(["--affinity-negatives", "30"])
    mod.build_affinity(args, tmp_path)
    first = np.load(tmp_path / "affinity.npy")
    assert first.shape == (feats.shape[0], 14)
    assert json.loads((tmp_path / "affinity.json").read_text())["negatives"] == 30
    mod.build_affinity(args, tmp_path)
    assert "affinity: done, skipping" in capsys.readouterr().out
    args.affinity_scale = 2.0
    mod.build_affinity(args, tmp_path)
    assert "refitting" in capsys.readouterr().out
    np.testing.assert_allclose(np.load(tmp_path / "affinity.npy"), first * 2.0, rtol=1e-5, atol=1e-6)
