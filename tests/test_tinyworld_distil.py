"""The distilled, frozen text encoder of scripts/train_tinyworld.py (stage ``distil`` and
``--frozen-text-encoder``): what each position is distilled towards, and that the UNet then
trains against the encoder without changing it."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from emma.tinyworld.tokenizer import local_clip_tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import train_tinyworld as T  # noqa: E402


class _HashModel:
    """Stands in for the sentence model: a fixed unit vector per text, and a log of the texts."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def encode(self, texts, **_):
        self.seen.extend(texts)
        rows = [np.random.default_rng(int(hashlib.sha256(t.encode()).hexdigest()[:8], 16)).standard_normal(8)
                for t in texts]
        return np.stack([r / np.linalg.norm(r) for r in rows])


def test_each_position_is_distilled_towards_the_embedding_of_its_prefix(tmp_path, monkeypatch):
    from emma.tinyworld import lexicon

    model = _HashModel()
    monkeypatch.setattr(lexicon, "_sentence_model", lambda: model)
    tok = local_clip_tokenizer()
    texts = ["an image of a circle", "an image of a disc", "a circle"]
    rows, emb = T.distil_targets(texts, tok, tmp_path)
    # one row per content token; shared prefixes share one embedding
    assert [len(r) for r in rows] == [5, 5, 2]
    assert rows[0][:4] == rows[1][:4] and rows[0][4] != rows[1][4]
    assert len(emb) == len(set(model.seen)) == 5 + 1 + 2
    want = model.encode(["an image of a", "an image of a circle", "a circle"])
    np.testing.assert_allclose(emb[rows[0][3]], want[0], atol=1e-6)
    np.testing.assert_allclose(emb[rows[0][4]], want[1], atol=1e-6)
    np.testing.assert_allclose(emb[rows[2][1]], want[2], atol=1e-6)
    # the embeddings are stored under a key of the texts: a second call embeds nothing
    model.seen.clear()
    again_rows, again = T.distil_targets(texts, tok, tmp_path)
    assert model.seen == [] and again_rows == rows and np.array_equal(again, emb)


def test_distil_corpus_is_seeded_and_never_holds_a_probe_or_control_word():
    from emma.tinyworld.generalisation import CONTROLS, PROBE

    class Args:
        seed, distil_sentences, object_words = 0, 200, 0.3

    tok = local_clip_tokenizer()
    texts = T.distil_corpus(Args, tok)
    assert len(texts) == 400 and texts == T.distil_corpus(Args, tok)
    words = {w for t in texts for w in t.split()}
    held = {w for entry in (*PROBE, *CONTROLS) for w in entry.split()} - {"a", "of", "the", "sign", "flag"}
    assert not words & {w for w in held if len(w) > 3}, sorted(words & held)[:5]


def _cmd(work: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "scripts" / "train_tinyworld.py"), "--work-dir", str(work),
            "--export", str(out), "--threads", "1", "--vae-steps", "3", "--vae-batch", "4", "--clf-steps", "2",
            "--clf-batch", "8", "--pool-size", "64", "--unet-batch", "4", "--ckpt-every", "2",
            "--lexicon", "random", "--distil-sentences", "6", "--distil-steps", "4", "--distil-batch", "4",
            *extra]


def test_the_unet_continues_against_the_frozen_distilled_encoder(tmp_path):
    from diffusers import StableDiffusionPipeline

    work, out = tmp_path / "work", tmp_path / "export"
    run = lambda *extra: subprocess.run(_cmd(work, out, *extra), capture_output=True, text=True,  # noqa: E731
                                        timeout=900, cwd=ROOT)
    first = run("--stages", "vae,classifier,pool,lexicon,unet", "--unet-steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    # without the distilled encoder, the frozen continuation is refused in one line
    early = run("--stages", "unet", "--unet-steps", "4", "--frozen-text-encoder")
    assert early.returncode != 0
    assert early.stderr.strip().splitlines()[-1].endswith("distil.pt is missing; run stage distil first")
    proc = run("--stages", "distil,unet", "--unet-steps", "4", "--frozen-text-encoder")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "distil step 4 loss" in proc.stdout and "unet step 4 loss" in proc.stdout
    assert "the text encoder is frozen from here; optimizer reset" in proc.stdout
    distilled = torch.load(work / "distil.pt", map_location="cpu", weights_only=False)["te"]
    ckpt = torch.load(work / "unet_ckpt.pt", map_location="cpu", weights_only=False)
    for key, value in distilled.items():  # the UNet stage left the encoder (and its EMA) as distilled
        assert torch.equal(ckpt["te"][key], value), key
        assert torch.equal(ckpt["ema"]["te"][key], value), key
    pipe = StableDiffusionPipeline.from_pretrained(out / "pipeline", local_files_only=True, dtype=torch.float32)
    baked = T.plain_text_encoder(work, dict(distilled)).state_dict()
    for key, value in pipe.text_encoder.state_dict().items():
        torch.testing.assert_close(value, baked[key].half().float(), rtol=0, atol=0)
    phases = json.loads((out / "training.json").read_text())["phases"]
    assert [(ph["from_step"], ph["args"]["frozen_text_encoder"]) for ph in phases] == [(0, False), (2, True)]
    # a rerun skips the finished distillation; the identity read-out is refused with a frozen encoder
    again = run("--stages", "distil", "--unet-steps", "4")
    assert again.returncode == 0 and "distil: done, skipping" in again.stdout
    # a distillation made with other settings is never reused: refused in one line, before any work
    other = run("--stages", "distil", "--unet-steps", "4", "--distil-steps", "5")
    assert other.returncode != 0 and "distil.pt was made with" in other.stderr.strip().splitlines()[-1]
    assert "'distil_steps': 4" in other.stderr and "'distil_steps': 5" in other.stderr
    both = run("--stages", "unet", "--unet-steps", "6", "--frozen-text-encoder", "--identity-loss", "0.1")
    assert both.returncode != 0
    assert both.stderr.strip().splitlines()[-1] == (
        "--identity-loss trains the text encoder; --frozen-text-encoder keeps it fixed: choose one")
