"""Train the tiny world: VAE -> classifier -> latent pool -> lexicon (-> affinity) -> UNet + text
encoder (-> a distilled text encoder, frozen while the UNet continues) -> export.

Deterministic (every random draw comes from the seed and the step number) and resumable:
each stage writes its result into ``--work-dir`` atomically and is skipped when present;
the UNet stage checkpoints every ``--ckpt-every`` steps and resumes from the latest one.
CPU by default (``--device cuda`` trains the same on a GPU).

    python scripts/train_tinyworld.py                     # one UNet phase with the defaults
    python scripts/train_tinyworld.py --threads 1 --recipe scripts/tinyworld_recipe.json \
        --export emma/tinyworld/assets                    # the shipped world (about 3.6 h, one thread)

The exported folder loads with
``StableDiffusionPipeline.from_pretrained(folder / "pipeline", local_files_only=True)``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from classifiers.tinyworld import HEADS, TinyWorldNet  # noqa: E402
from emma.tinyworld import arch  # noqa: E402
from emma.tinyworld.generalisation import filler_pool  # noqa: E402
from emma.tinyworld.tokenizer import local_clip_tokenizer  # noqa: E402
from emma.tinyworld.world import caption, render_batch, sample_specs  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def batch_images(seed: int, step: int, n: int) -> tuple[list, torch.Tensor]:
    specs = sample_specs(n, seed=seed * 1_000_003 + step)
    return specs, torch.from_numpy(render_batch(specs))


# --------------------------------------------------------------------------- init from export
def take_export(folder: Path, work: Path):
    """Take an export's VAE, judge and latent scaling as finished stages."""
    from safetensors.torch import load_file

    meta = json.loads((folder / "training.json").read_text())
    if not (work / "vae.pt").exists():
        vae = load_file(str(folder / "pipeline" / "vae" / "diffusion_pytorch_model.safetensors"))
        atomic_save({k: v.float() for k, v in vae.items()}, work / "vae.pt")
    if not (work / "classifier.pt").exists():
        clf = load_file(str(folder / "classifier.safetensors"))
        atomic_save({"state_dict": dict(clf), "accuracy": meta["classifier_accuracy"]}, work / "classifier.pt")
    config = json.loads((folder / "pipeline" / "vae" / "config.json").read_text())
    return float(config["scaling_factor"])


# --------------------------------------------------------------------------- VAE
def train_vae(args, work: Path):
    from diffusers import AutoencoderKL

    out = work / "vae.pt"
    if out.exists():
        log("vae: done, skipping")
        return
    torch.manual_seed(args.seed)
    vae = AutoencoderKL(**arch.VAE_CONFIG).to(args.device)
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed + 1)
    start, ckpt = 0, work / "vae_ckpt.pt"
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        vae.load_state_dict(state["vae"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        start = state["step"]
        log(f"vae: resumed at step {start}")
    log(f"vae: {sum(p.numel() for p in vae.parameters()) / 1e6:.2f}M params")
    for step in tqdm(range(start, args.vae_steps), desc="vae", initial=start, total=args.vae_steps,
                     mininterval=30):
        lr = args.vae_lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * (1 - step / args.vae_steps))
        for g in opt.param_groups:
            g["lr"] = lr
        _, x = batch_images(args.seed + 11, step, args.vae_batch)
        x = (x * 2 - 1).to(args.device)
        post = vae.encode(x).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=gen).to(args.device)
        rec = vae.decode(z).sample
        kl = post.kl().mean() / x[0].numel()
        loss = F.mse_loss(rec, x) + 0.5 * F.l1_loss(rec, x) + args.vae_kl * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % args.ckpt_every == 0:
            atomic_save({"vae": vae.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                         "step": step + 1}, ckpt)
            log(f"vae step {step + 1} loss {loss.item():.4f}")
    atomic_save(vae.state_dict(), out)


def load_vae(args, work: Path):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(**arch.VAE_CONFIG)
    vae.load_state_dict(torch.load(work / "vae.pt", map_location="cpu"))
    return vae.to(args.device).eval()


@torch.no_grad()
def reconstruct(vae, x: torch.Tensor) -> torch.Tensor:
    z = vae.encode(x * 2 - 1).latent_dist.mean
    return ((vae.decode(z).sample + 1) / 2).clamp(0, 1)


# --------------------------------------------------------------------------- classifier
def targets(specs) -> dict[str, torch.Tensor]:
    return {
        "shape": torch.tensor([HEADS["shape"].index(s.shape) for s in specs]),
        "colour": torch.tensor([HEADS["colour"].index(s.colour) for s in specs]),
        "style": torch.tensor([HEADS["style"].index(s.style) for s in specs]),
    }


def train_classifier(args, work: Path):
    out = work / "classifier.pt"
    if out.exists():
        log("classifier: done, skipping")
        return
    vae = load_vae(args, work)
    torch.manual_seed(args.seed + 2)
    net = TinyWorldNet().to(args.device)
    log(f"classifier: {sum(p.numel() for p in net.parameters()) / 1e6:.2f}M params")
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-4)
    for step in tqdm(range(args.clf_steps), desc="classifier", mininterval=10):
        for g in opt.param_groups:
            g["lr"] = 2e-3 * (0.05 + 0.95 * (1 - step / args.clf_steps))
        specs, x = batch_images(args.seed + 22, step, args.clf_batch)
        x = x.to(args.device)
        # half the batch through the VAE: the judge must read decoded images as renders
        half = len(x) // 2
        x = torch.cat([x[:half], reconstruct(vae, x[half:])])
        net.train()
        logits = net(x)
        tgt = targets(specs)
        loss = sum(F.cross_entropy(logits[k], tgt[k].to(args.device)) for k in HEADS)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    net.eval()
    acc = eval_classifier(args, net, vae)
    log(f"classifier held-out accuracy: {json.dumps(acc)}")
    atomic_save({"state_dict": net.state_dict(), "accuracy": acc}, out)


@torch.no_grad()
def eval_classifier(args, net, vae, n: int = 2000) -> dict:
    specs = sample_specs(n, seed=args.seed + 999_999)  # never used for training
    x = torch.from_numpy(render_batch(specs)).to(args.device)
    tgt = targets(specs)
    acc = {}
    for name, imgs in (("renders", x), ("vae_reconstructions", reconstruct(vae, x))):
        logits = net(imgs)
        per = {k: (logits[k].argmax(1).cpu() == tgt[k]).float().mean().item() for k in HEADS}
        per["all"] = float(np.mean([
            ((logits["shape"].argmax(1).cpu() == tgt["shape"])
             & (logits["colour"].argmax(1).cpu() == tgt["colour"])
             & (logits["style"].argmax(1).cpu() == tgt["style"])).float().mean().item()
        ]))
        acc[name] = per
    acc["n"] = n
    return acc


# --------------------------------------------------------------------------- latent pool
@torch.no_grad()
def build_pool(args, work: Path):
    out = work / "pool.pt"
    if out.exists():
        log("pool: done, skipping")
        return
    vae = load_vae(args, work)
    specs = sample_specs(args.pool_size, seed=args.seed + 33)
    means, stds = [], []
    for i in tqdm(range(0, len(specs), 500), desc="encode pool", mininterval=10):
        x = torch.from_numpy(render_batch(specs[i : i + 500])).to(args.device)
        post = vae.encode(x * 2 - 1).latent_dist
        means.append(post.mean.cpu())
        stds.append(post.std.cpu())
    mean, std = torch.cat(means), torch.cat(stds)
    # an initialising export keeps the scaling its UNet was trained with
    source = args.init_from or args.vae_judge_from
    scaling = take_export(Path(source), work) if source else float(1.0 / mean.std())
    log(f"pool: {len(specs)} latents, scaling factor {scaling:.4f}")
    atomic_save({"specs": specs, "mean": mean, "std": std, "scaling": scaling}, out)


# --------------------------------------------------------------------------- lexicon
def build_lexicon(args, work: Path):
    """A meaning vector for every token of the vocabulary (``emma/tinyworld/lexicon.py``)."""
    from emma.tinyworld import lexicon

    out = work / "lexicon.npy"
    if out.exists():
        log("lexicon: done, skipping")
        return
    texts = lexicon.token_texts(local_clip_tokenizer())
    if args.lexicon == "random":  # plumbing tests: no sentence model, seeded noise
        feats = lexicon.normalise(np.random.default_rng(args.seed).standard_normal((len(texts), 64)))
    else:
        feats = lexicon.build(texts, work / "lexicon_chunks", log)
    tmp = work / "lexicon.tmp.npy"
    np.save(tmp, feats.astype(np.float16))
    os.replace(tmp, out)
    log(f"lexicon: {feats.shape[0]} tokens x {feats.shape[1]} features")


def build_affinity(args, work: Path):
    """The concept-affinity columns (``emma.tinyworld.lexicon.concept_affinity``): per token, a
    shape and a style distribution with "none", fitted on the caption words and
    ``--affinity-negatives`` whole-word fillers."""
    from emma.tinyworld import lexicon
    from emma.tinyworld.generalisation import filler_pool

    out, meta = work / "affinity.npy", work / "affinity.json"
    settings = {"seed": args.seed, "negatives": args.affinity_negatives, "l2": args.affinity_l2,
                "scale": args.affinity_scale}
    if args.affinity_sharpness != 1.0:  # (absent from folders made before the setting existed)
        settings["sharpness"] = args.affinity_sharpness
    if out.exists():
        # a folder from before the settings were stored holds the settings it was started with
        done = json.loads(meta.read_text()) if meta.exists() else settings
        if done == settings:
            log("affinity: done, skipping")
            return
        log(f"affinity: refitting, the settings changed from {done} to {settings}")
    tok = local_clip_tokenizer()
    pool = filler_pool(tok, words_only=True)
    negatives = np.random.default_rng([args.seed, 48]).choice(pool, args.affinity_negatives, replace=False)
    feats = np.load(work / "lexicon.npy").astype(np.float32)
    aff = lexicon.concept_affinity(feats, tok, negatives.tolist(), l2=args.affinity_l2,
                                   sharpness=args.affinity_sharpness) * args.affinity_scale
    tmp = work / "affinity.tmp.npy"
    np.save(tmp, aff)
    os.replace(tmp, out)
    tmp = work / "affinity.tmp.json"
    tmp.write_text(json.dumps(settings))
    os.replace(tmp, meta)
    log(f"affinity: {aff.shape[1]} columns from {args.affinity_negatives} negatives, l2 {args.affinity_l2}, "
        f"sharpness {args.affinity_sharpness}, scale {args.affinity_scale}")


# --------------------------------------------------------------------------- distilled text encoder
def distil_corpus(args, tok) -> list[str]:
    """The texts the frozen text encoder is distilled on (a pure function of the seed): tiny-world
    captions, and sentences of whole-word fillers (``filler_pool``: never a caption, probe or
    control word) alone, in the captions' templates and inside captions."""
    from emma.tinyworld.world import TEMPLATES, with_template

    rng = np.random.default_rng([args.seed, 60])
    specs = sample_specs(args.distil_sentences, seed=args.seed + 61)
    words = [tok.decode([i]).strip() for i in filler_pool(tok, words_only=True)]
    texts = [caption(s, rng, args.object_words) for s in specs]
    for k in range(args.distil_sentences):
        form = k % 4
        pick = lambda n: " ".join(words[j] for j in rng.integers(len(words), size=n))  # noqa: E731
        if form == 0:
            texts.append(pick(1))
        elif form == 1:
            texts.append(with_template(TEMPLATES[rng.integers(len(TEMPLATES))], pick(1)))
        elif form == 2:
            texts.append(pick(int(rng.integers(2, 7))))
        else:  # a filler word in a caption's place
            cap = caption(specs[k], rng, args.object_words).split()
            cap.insert(int(rng.integers(len(cap) + 1)), pick(1))
            texts.append(" ".join(cap))
    return texts


def distil_targets(texts: list[str], tok, work: Path) -> tuple[list[list[int]], np.ndarray]:
    """Per text, the index (into the returned MiniLM embeddings) of every prefix of its tokens:
    position ``i`` of a text's encoding is distilled towards the sentence embedding of its first
    ``i`` tokens, and the end token and padding towards the whole text's."""
    from emma.tinyworld import lexicon

    ids = tok(texts, truncation=True, max_length=tok.model_max_length).input_ids
    prefixes: dict[str, int] = {}
    rows = []
    for seq in ids:
        body = seq[1:-1]
        row = []
        for i in range(1, len(body) + 1):
            row.append(prefixes.setdefault(tok.decode(body[:i]).strip(), len(prefixes)))
        rows.append(row)
    unique = list(prefixes)
    out = work / "distil_targets.npy"
    key = texts_key(unique)
    stamp = work / "distil_targets.key"
    if out.exists() and stamp.exists() and stamp.read_text() == key:
        return rows, np.load(out)
    model = lexicon._sentence_model()
    chunks, size = [], 8192
    chunk_dir = work / "distil_chunks"
    chunk_dir.mkdir(exist_ok=True)
    t0 = time.time()
    for c in range(0, len(unique), size):
        path = chunk_dir / f"{key}_{c // size:04d}.npy"
        if not path.exists():
            emb = model.encode(unique[c : c + size], batch_size=256, normalize_embeddings=True,
                               convert_to_numpy=True, show_progress_bar=False).astype(np.float32)
            tmp = path.with_suffix(".tmp.npy")
            np.save(tmp, emb)
            os.replace(tmp, path)
            log(f"distil: {min(c + size, len(unique))}/{len(unique)} prefixes embedded "
                f"({(time.time() - t0) / 60:.1f} min)")
        chunks.append(np.load(path))
    emb = np.concatenate(chunks)
    tmp = work / "distil_targets.tmp.npy"
    np.save(tmp, emb)
    os.replace(tmp, out)
    stamp.write_text(key)
    return rows, emb


def texts_key(texts: list[str]) -> str:
    """A short content key of ``texts`` (their order included)."""
    import hashlib

    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]


def train_distil(args, work: Path):
    """A text encoder that is then frozen (``--frozen-text-encoder``): the tiny world's
    CLIPTextModel (token embeddings mapped from the lexicon's meanings), trained so that the
    output at every position predicts, through a linear read-out discarded afterwards, the
    MiniLM sentence embedding of the text up to that position. Its contexts keep how a thing was
    said, as a text encoder trained on other text does; the UNet then learns to read the tiny
    world from them, and an edit of one phrasing's context need not reach the others."""
    out = work / "distil.pt"
    settings = {k: getattr(args, k) for k in ("seed", "distil_sentences", "distil_steps", "distil_batch",
                                               "distil_lr", "object_words")}
    for path in (out, work / "distil_ckpt.pt"):
        if path.exists():
            done = torch.load(path, map_location="cpu", weights_only=False).get("settings")
            if done != settings:  # never reuse a distillation made with other settings
                raise SystemExit(f"distil: {path} was made with {done}, not {settings}; remove it (and "
                                 "distil.pt) to distil again, or keep its settings")
    if out.exists():
        log("distil: done, skipping")
        return
    tok = local_clip_tokenizer()
    texts = distil_corpus(args, tok)
    rows, emb = distil_targets(texts, tok, work)
    log(f"distil: {len(texts)} texts, {len(emb)} distinct prefixes")
    torch.manual_seed(args.seed + 62)
    te = text_encoder(work).to(args.device)
    head = torch.nn.Linear(te.config.hidden_size, emb.shape[1]).to(args.device)
    params = list(te.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=args.distil_lr, weight_decay=0.01)
    target = torch.from_numpy(emb)
    ids_all = tok(texts, padding="max_length", max_length=tok.model_max_length, truncation=True,
                  return_tensors="pt").input_ids
    length = tok.model_max_length
    index = torch.full((len(texts), length), -1, dtype=torch.long)
    content = torch.zeros(len(texts), length, dtype=torch.bool)
    for r, row in enumerate(rows):
        index[r, 1 : 1 + len(row)] = torch.tensor(row, dtype=torch.long)
        index[r, 1 + len(row):] = row[-1] if row else -1  # end token and padding: the whole text
        content[r, 1 : 1 + len(row)] = True
    start, ckpt = 0, work / "distil_ckpt.pt"
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        te.load_state_dict(state["te"])
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        log(f"distil: resumed at step {start}")
    t0 = time.time()
    for step in tqdm(range(start, args.distil_steps), desc="distil", initial=start,
                     total=args.distil_steps, mininterval=30):
        lr = args.distil_lr * min(1.0, (step + 1) / 200) * (1 - step / args.distil_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        rng = np.random.default_rng([args.seed, 63, step])
        b = torch.from_numpy(rng.integers(len(texts), size=args.distil_batch))
        idx = index[b]
        valid = idx >= 0
        pred = F.normalize(head(te(ids_all[b].to(args.device))[0]), dim=-1)
        cos = (pred * target[idx.clamp(min=0)].to(args.device)).sum(-1)
        is_content = content[b] & valid
        is_tail = ~content[b] & valid
        # content positions and the tail (end token + padding) weigh equally per text
        loss = ((1 - cos) * is_content).sum() / is_content.sum().clamp(min=1) \
            + ((1 - cos) * is_tail).sum() / is_tail.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if (step + 1) % args.ckpt_every == 0 or step + 1 == args.distil_steps:
            atomic_save({"te": te.state_dict(), "head": head.state_dict(), "opt": opt.state_dict(),
                         "step": step + 1, "settings": settings}, ckpt)
            log(f"distil step {step + 1} loss {loss.item():.4f} "
                f"({(time.time() - t0) / (step + 1 - start):.3f} s/step)")
    atomic_save({"te": te.state_dict(), "step": args.distil_steps, "texts": len(texts), "settings": settings}, out)


# --------------------------------------------------------------------------- UNet + text
def train_unet(args, work: Path):
    from diffusers import DDPMScheduler, UNet2DConditionModel

    final = work / "unet_final.pt"
    if final.exists():
        done = torch.load(final, map_location="cpu", weights_only=False).get("step")
        if done is None or done >= args.unet_steps:
            log("unet: done, skipping")
            return
        log(f"unet: extending the finished run of {done} steps to {args.unet_steps}")
        final.unlink()
    pool = torch.load(work / "pool.pt", map_location="cpu", weights_only=False)
    tok = local_clip_tokenizer()
    torch.manual_seed(args.seed + 3)
    unet = UNet2DConditionModel(**arch.UNET_CONFIGS[args.unet]).to(args.device)
    te = text_encoder(work).to(args.device)
    frozen = args.frozen_text_encoder
    if frozen:
        if args.identity_loss:
            raise SystemExit("--identity-loss trains the text encoder; --frozen-text-encoder keeps it fixed: "
                             "choose one")
        if not (work / "distil.pt").exists():
            raise SystemExit(f"--frozen-text-encoder: {work / 'distil.pt'} is missing; run stage distil first")
        distilled = torch.load(work / "distil.pt", map_location="cpu", weights_only=False)["te"]
        te.load_state_dict(distilled)
        te.requires_grad_(False)
        te.eval()
    # --identity-loss: a linear read-out that must name each caption token from the encoder's
    # output at its position, so a word's context keeps which word it was, not only its meaning
    head = torch.nn.Linear(te.config.hidden_size, te.config.vocab_size).to(args.device) if args.identity_loss else None
    params = (list(unet.parameters()) + ([] if frozen else list(te.parameters()))
              + (list(head.parameters()) if head else []))
    log(f"unet: {sum(p.numel() for p in unet.parameters()) / 1e6:.2f}M params, "
        f"text encoder {sum(p.numel() for p in te.parameters()) / 1e6:.2f}M")
    opt = torch.optim.AdamW(params, lr=args.unet_lr, weight_decay=0.01)
    ema = {"unet": copy.deepcopy(unet.state_dict()), "te": copy.deepcopy(te.state_dict())}
    sched = DDPMScheduler(**{k: v for k, v in arch.SCHEDULER_CONFIG.items()
                             if k in ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule")})
    gen = torch.Generator().manual_seed(args.seed + 4)
    start = warm = 0
    ckpt = work / "unet_ckpt.pt"
    if not ckpt.exists() and args.init_from:
        # Continue from an exported tiny world (its EMA weights, a fresh optimizer): for
        # extending a model whose checkpoints are gone. The step count carries on from the
        # export's, so the captions are those a single longer run draws at these steps.
        start = init_from_export(Path(args.init_from), unet, te)
        if frozen:  # the export's UNet, this work dir's distilled encoder
            te.load_state_dict(distilled)
        ema = {"unet": copy.deepcopy(unet.state_dict()), "te": copy.deepcopy(te.state_dict())}
        gen.manual_seed(args.seed + 4 + start)
        warm = start
        log(f"unet: initialised from {args.init_from} at step {start}")
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        if state.get("unet_arch", "v2") != args.unet:
            raise SystemExit(f"{ckpt} holds a --unet {state.get('unet_arch', 'v2')} run; resume it with that "
                             f"--unet, or start --unet {args.unet} in another --work-dir")
        unet.load_state_dict(state["unet"])
        widened = widen_lexicon_map(state["te"], te)
        if head is not None and "head" in state:
            head.load_state_dict(state["head"])
        elif head is not None:  # the read-out starts here: the optimizer's groups changed
            widened = True
        widen_lexicon_map(state["ema"]["te"], te)
        te.load_state_dict(distilled if frozen else state["te"])
        ema = state["ema"]
        if frozen:  # a run continued with the encoder frozen from here on: the distilled one
            ema["te"] = copy.deepcopy(te.state_dict())
        gen.set_state(state["gen"])
        start = state["step"]
        warm = state.get("warm_start", 0)
        refrozen = len(state["opt"]["param_groups"][0]["params"]) != len(params)
        if widened or refrozen:  # the optimizer's moments no longer fit the parameters: fresh ones, a new warm-up
            warm = start
            log("unet: the text encoder is frozen from here; optimizer reset" if refrozen and not widened
                else "unet: the lexicon gained columns or the identity read-out starts; optimizer reset")
        else:
            opt.load_state_dict(state["opt"])
        log(f"unet: resumed at step {start}")
    record_phase(work, start, args)
    n_pool = len(pool["specs"])
    use_fillers = args.filler_tokens or args.filler_alone
    fillers = torch.tensor(filler_pool(tok, args.filler_words == "english")) if use_fillers else None
    if fillers is not None:
        log(f"unet: {args.filler_tokens:.0%} of captions get, and {args.filler_alone:.0%} are, one of "
            f"{len(fillers)} filler tokens ({args.filler_words})")
    embedding = te.get_input_embeddings()
    if args.feature_noise:
        embedding.noise = args.feature_noise
        embedding.generator = torch.Generator().manual_seed(args.seed + 5 + start)
        log(f"unet: noise of scale {args.feature_noise} on the token meanings")
    t0 = time.time()
    for step in tqdm(range(start, args.unet_steps), desc="unet", initial=start,
                     total=args.unet_steps, mininterval=30):
        lr = args.unet_lr * min(1.0, (step + 1 - warm) / 200)
        if args.unet_decay_steps:  # linear decay to zero over the last --unet-decay-steps steps
            lr *= min(1.0, (args.unet_steps - step) / args.unet_decay_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        rng = np.random.default_rng([args.seed, 44, step])
        idx = rng.integers(n_pool, size=args.unet_batch)
        caps = [caption(pool["specs"][i], rng, args.object_words) if rng.random() >= args.cond_drop else ""
                for i in idx]
        alone = np.zeros(len(caps), bool)
        if args.filler_alone:  # a lone word that means nothing here: the image is the prior's
            alone = np.random.default_rng([args.seed, 46, step]).random(len(caps)) < args.filler_alone
            caps = ["" if a else c for c, a in zip(caps, alone)]
        ids = tok(caps, padding="max_length", max_length=tok.model_max_length,
                  truncation=True, return_tensors="pt").input_ids
        if args.filler_tokens:
            ids = insert_fillers(ids, fillers, args.filler_tokens, np.random.default_rng([args.seed, 45, step]))
        if alone.any():
            ids[alone] = insert_fillers(ids[alone], fillers, 1.0, np.random.default_rng([args.seed, 47, step]))
        ids = ids.to(args.device)
        idx_t = torch.from_numpy(idx)
        eps = torch.randn(pool["mean"][idx_t].shape, generator=gen)
        lat = (pool["mean"][idx_t] + pool["std"][idx_t] * eps) * pool["scaling"]
        noise = torch.randn(lat.shape, generator=gen)
        t = torch.randint(0, sched.config.num_train_timesteps, (len(lat),), generator=gen)
        noisy = sched.add_noise(lat, noise, t)
        with torch.set_grad_enabled(not frozen):
            enc = te(ids)[0]
        pred = unet(noisy.to(args.device), t.to(args.device), enc).sample
        loss = F.mse_loss(pred, noise.to(args.device))
        if head is not None:
            words = (ids != te.config.bos_token_id) & (ids != te.config.eos_token_id)
            ident = F.cross_entropy(head(enc[words]), ids[words]) if words.any() else enc.sum() * 0
            loss_total = loss + args.identity_loss * ident
        else:
            loss_total = loss
        opt.zero_grad(set_to_none=True)
        loss_total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for key, model in (("unet", unet),) + ((("te", te),) if not frozen else ()):
                for name, p in model.state_dict().items():
                    if p.dtype.is_floating_point:
                        ema[key][name].mul_(decay).add_(p.detach(), alpha=1 - decay)
                    else:
                        ema[key][name].copy_(p)
        if (step + 1) % args.ckpt_every == 0 or step + 1 == args.unet_steps:
            atomic_save({"unet": unet.state_dict(), "te": te.state_dict(),
                         "opt": opt.state_dict(), "ema": ema, "gen": gen.get_state(),
                         "step": step + 1, "warm_start": warm, "unet_arch": args.unet,
                         **({"head": head.state_dict()} if head is not None else {})}, ckpt)
            log(f"unet step {step + 1} loss {loss.item():.4f} "
                + (f"identity {ident.item():.3f} " if head is not None else "")
                + f"({(time.time() - t0) / (step + 1 - start):.2f} s/step)")
    atomic_save({"ema": ema, "scaling": pool["scaling"], "step": args.unet_steps}, final)


def insert_fillers(ids: torch.Tensor, pool: torch.Tensor, p: float, rng: np.random.Generator) -> torch.Tensor:
    """``ids`` with one token of ``pool`` inserted after the start token of a fraction ``p`` of
    the captions (drawn by ``rng``); the padded length is kept, so the last position drops."""
    rows = np.flatnonzero(rng.random(len(ids)) < p)
    picks = pool[torch.from_numpy(rng.integers(len(pool), size=len(rows)))]
    out = ids.clone()
    for r, tok_id in zip(rows, picks):
        out[r, 2:] = ids[r, 1:-1]
        out[r, 1] = tok_id
    return out


def text_encoder(work: Path):
    """The tiny world's CLIPTextModel, its token embedding a map from the lexicon's meanings."""
    from transformers import CLIPTextConfig, CLIPTextModel

    from emma.tinyworld.lexicon import semantic_embedding

    config = CLIPTextConfig(**arch.TEXT_ENCODER_CONFIG)
    te = CLIPTextModel(config)
    feats = np.load(work / "lexicon.npy").astype(np.float32)
    if (work / "affinity.npy").exists():  # the concept-affinity columns (stage "affinity")
        feats = np.concatenate([feats, np.load(work / "affinity.npy")], axis=1)
    te.set_input_embeddings(semantic_embedding(
        feats, config.hidden_size, (config.bos_token_id, config.eos_token_id)))
    return te


EMBEDDING = "embeddings.token_embedding"  # the text encoder's token embedding, in its state dict
PROJ_KEY = f"{EMBEDDING}.proj.weight"  # the lexicon map (a semantic embedding's)
TABLE_KEY = f"{EMBEDDING}.weight"  # the baked token table (an exported plain embedding's)


def widen_lexicon_map(state: dict, te) -> bool:
    """Give a text-encoder ``state`` fitted on fewer lexicon columns than ``te`` reads (the
    affinity columns were added since) zero weights for the new columns; whether it did."""
    have, want = state[PROJ_KEY], te.state_dict()[PROJ_KEY]
    if have.shape == want.shape:
        return False
    if have.shape[0] != want.shape[0] or have.shape[1] > want.shape[1]:
        raise SystemExit(f"text encoder map {tuple(have.shape)} does not fit the lexicon's {tuple(want.shape)}")
    state[PROJ_KEY] = torch.cat([have, have.new_zeros(have.shape[0], want.shape[1] - have.shape[1])], dim=1)
    return True


def plain_text_encoder(work: Path, state: dict):
    """A plain CLIPTextModel with the lexicon map of ``state`` baked into its embedding table."""
    from transformers import CLIPTextConfig, CLIPTextModel

    te = text_encoder(work)
    widen_lexicon_map(state, te)
    te.load_state_dict(state)
    table = te.get_input_embeddings().weight()
    plain = CLIPTextModel(CLIPTextConfig(**arch.TEXT_ENCODER_CONFIG))
    plain_state = {k: v for k, v in state.items() if "token_embedding" not in k}
    key = next(k for k in plain.state_dict() if k.endswith("token_embedding.weight"))
    plain_state[key] = table
    missing, unexpected = plain.load_state_dict(plain_state, strict=False)
    if unexpected or [k for k in missing if "position_ids" not in k]:
        raise SystemExit(f"text encoder export: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return plain


def recover_lexicon_map(state: dict, te) -> float:
    """Turn an exported text encoder's baked token table (in ``state``) back into the lexicon
    map of ``te``'s semantic embedding: the least-squares ``W, b`` with ``features @ W.T + b``
    equal to the table on every ordinary token, and the start/end tokens' free vectors. Returns
    the largest absolute residual (fp16 rounding of the export when the lexicon is the one it
    was trained with; a large one means another lexicon)."""
    emb = te.get_input_embeddings()
    table = state.pop(TABLE_KEY)
    special = emb.special_ids
    rows = torch.ones(table.shape[0], dtype=torch.bool)
    rows[special] = False
    x = torch.cat([emb.features[rows].double(), torch.ones(int(rows.sum()), 1, dtype=torch.float64)], dim=1)
    sol = torch.linalg.lstsq(x, table[rows].double()).solution
    state[PROJ_KEY] = sol[:-1].T.float()
    state[f"{EMBEDDING}.proj.bias"] = sol[-1].float()
    state[f"{EMBEDDING}.special"] = table[special].float()
    return float((x @ sol - table[rows].double()).abs().max())


def init_from_export(folder: Path, unet, te) -> int:
    """Load an exported pipeline's UNet and text encoder into ``unet`` / ``te``; its step count.

    An export bakes the lexicon map into a plain token table; when ``te`` learns a map, the map
    is recovered from the table (:func:`recover_lexicon_map`)."""
    from safetensors.torch import load_file

    meta = json.loads((folder / "training.json").read_text())
    for model, sub, fname in ((unet, "unet", "diffusion_pytorch_model.safetensors"),
                              (te, "text_encoder", "model.safetensors")):
        state = {k: v.float() for k, v in load_file(str(folder / "pipeline" / sub / fname)).items()}
        if model is te and TABLE_KEY in state and hasattr(te.get_input_embeddings(), "proj"):
            residual = recover_lexicon_map(state, te)
            if residual > 1e-2:  # fp16 rounding is ~1e-3: the work dir's lexicon is not the export's
                raise SystemExit(f"--init-from {folder}: its token table is not a map of this work dir's lexicon "
                                 f"(largest residual {residual:.2g}, fp16 rounding gives ~1e-3); build the "
                                 "lexicon and affinity stages with the export's settings")
            log(f"unet: lexicon map recovered from {folder}'s token table (largest residual {residual:.2e})")
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if "position_ids" not in k]:
            raise SystemExit(f"--init-from {folder}: {sub} does not match the tiny-world architecture "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return int(meta["unet_steps_trained"])


def phase_args(args) -> dict:
    """The arguments that decide what a UNet phase trains (not where it runs or writes)."""
    return {k: v for k, v in vars(args).items()
            if k not in ("work_dir", "export", "device", "threads", "stages", "recipe")}


def record_phase(work: Path, start: int, args) -> None:
    """Append this UNet phase (its first step and arguments) to ``work/phases.json``, once: a
    model continued over several runs (``--unet-steps`` raised, new flags) keeps its recipe."""
    path = work / "phases.json"
    phases = json.loads(path.read_text()) if path.exists() else []
    entry = {"to_step": args.unet_steps, "args": phase_args(args)}
    if any(p["to_step"] == entry["to_step"] and p["args"] == entry["args"] for p in phases):
        return  # the same phase, resumed
    phases.append({"from_step": start, **entry})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(phases, indent=1, default=str))
    os.replace(tmp, path)


# --------------------------------------------------------------------------- export
def export(args, work: Path, dest: Path):
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from safetensors.torch import save_file

    from emma.pipelines import make_scheduler

    vae = load_vae(args, work).cpu()
    if (work / "unet_final.pt").exists():
        final = torch.load(work / "unet_final.pt", map_location="cpu", weights_only=False)
        final.setdefault("step", args.unet_steps)
    else:  # export the EMA weights of the latest checkpoint while training goes on
        state = torch.load(work / "unet_ckpt.pt", map_location="cpu", weights_only=False)
        pool = torch.load(work / "pool.pt", map_location="cpu", weights_only=False)
        final = {"ema": state["ema"], "scaling": pool["scaling"], "step": state["step"]}
        log(f"exporting the checkpoint of step {state['step']} (training not finished)")
    vae.register_to_config(scaling_factor=final["scaling"])
    unet = UNet2DConditionModel(**arch.UNET_CONFIGS[args.unet])
    unet.load_state_dict(final["ema"]["unet"])
    te = plain_text_encoder(work, final["ema"]["te"])
    # fp16 on disk; cast with torch's own .to (diffusers' warns about fp32-kept modules, of
    # which these configs have none)
    for module in (vae, unet, te):
        torch.nn.Module.to(module, dtype=torch.float16)
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=te, tokenizer=local_clip_tokenizer(), unet=unet,
        scheduler=make_scheduler(arch.SCHEDULER_CLASS, arch.SCHEDULER_CONFIG), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / "pipeline.tmp"
    pipe.save_pretrained(tmp, safe_serialization=True)
    if (dest / "pipeline").exists():
        import shutil

        shutil.rmtree(dest / "pipeline")
    os.replace(tmp, dest / "pipeline")
    clf = torch.load(work / "classifier.pt", map_location="cpu", weights_only=False)
    save_file({k: v.contiguous() for k, v in clf["state_dict"].items()},
              str(dest / "classifier.safetensors"))
    meta = {"classifier_accuracy": clf["accuracy"], "unet_steps_trained": final["step"],
            "args": {k: v for k, v in vars(args).items() if k not in ("work_dir", "export", "recipe")}}
    if args.recipe:  # the whole recipe, so the export names every phase that made it
        meta["recipe"] = json.loads(Path(args.recipe).read_text())
    if (work / "phases.json").exists():  # every UNet phase that led here, in order
        meta["phases"] = json.loads((work / "phases.json").read_text())
    (dest / "training.json").write_text(json.dumps(meta, indent=2, default=str))
    log(f"exported to {dest}")


# --------------------------------------------------------------------------- recipe
RECIPE_FIXED = ("work_dir", "export", "device", "threads", "recipe")


def load_recipe(path: Path, args) -> tuple[dict, list[dict]]:
    """Read a training recipe: ``{"args": {...}, "phases": [{...}, ...]}``.

    ``args`` sets the run's arguments (argparse names, e.g. ``"unet_steps"``) over the command
    line's; each phase changes some of them, cumulatively, and may name its ``"stages"``
    (default ``"unet"``). A phase must raise ``unet_steps``: it continues the UNet from where the
    previous one ended, exactly as a finished run extended with new flags does."""
    try:
        recipe = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--recipe {path}: cannot read it as JSON ({exc})") from None
    if not isinstance(recipe, dict) or not isinstance(recipe.get("phases"), list) or not recipe["phases"]:
        raise SystemExit(f'--recipe {path}: expected {{"args": {{...}}, "phases": [{{...}}, ...]}} '
                         "with at least one phase")
    valid = sorted(k for k in vars(args) if k not in RECIPE_FIXED)
    steps = -1
    for where, block in [("args", recipe.get("args", {}))] + [
            (f"phase {i + 1}", ph) for i, ph in enumerate(recipe["phases"])]:
        if not isinstance(block, dict):
            raise SystemExit(f"--recipe {path}: {where} must be an object of settings")
        bad = sorted(set(block) - set(valid))
        if bad:
            raise SystemExit(f"--recipe {path}: {where} sets {', '.join(bad)}, which a recipe cannot set; "
                             f"valid: {', '.join(valid)}")
        if where != "args":
            if block.get("unet_steps", -1) <= steps:
                raise SystemExit(f"--recipe {path}: {where} must set unet_steps above the previous "
                                 f"phase's ({steps})")
            steps = block["unet_steps"]
    return recipe.get("args", {}), recipe["phases"]


def run_stages(args, work: Path, stages: dict, names: str) -> None:
    for name in filter(None, names.split(",")):
        t = time.time()
        stages[name](args, work)
        log(f"stage {name}: {time.time() - t:.0f} s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", default=str(ROOT / ".cache" / "tinyworld-train"))
    p.add_argument("--export", default=None, help="folder to export the trained assets into")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--vae-steps", type=int, default=800)
    p.add_argument("--vae-batch", type=int, default=32)
    p.add_argument("--vae-lr", type=float, default=1e-3)
    p.add_argument("--vae-kl", type=float, default=1e-4)
    p.add_argument("--clf-steps", type=int, default=500)
    p.add_argument("--clf-batch", type=int, default=128)
    p.add_argument("--pool-size", type=int, default=40000)
    p.add_argument("--unet", choices=sorted(arch.UNET_CONFIGS), default="v2",
                   help="the UNet architecture (emma.tinyworld.arch.UNET_CONFIGS)")
    p.add_argument("--unet-steps", type=int, default=8000)
    p.add_argument("--unet-batch", type=int, default=48)
    p.add_argument("--unet-lr", type=float, default=8e-4)
    p.add_argument("--unet-decay-steps", type=int, default=0,
                   help="decay the UNet learning rate linearly to zero over the last N steps (0: constant)")
    p.add_argument("--cond-drop", type=float, default=0.1)
    p.add_argument("--filler-tokens", type=float, default=0.0,
                   help="fraction of captions that get one random vocabulary token (never a caption, probe, "
                        "control or base-rate word's): words outside the world's language carry no shape")
    p.add_argument("--filler-words", choices=["any", "english"], default="any",
                   help="filler tokens from the whole vocabulary, or its whole words of 4+ letters")
    p.add_argument("--filler-alone", type=float, default=0.0,
                   help="fraction of captions that are one filler token alone (the image is any scene)")
    p.add_argument("--feature-noise", type=float, default=0.0,
                   help="scale of Gaussian noise on the token meanings while training (smooths the map)")
    p.add_argument("--affinity-negatives", type=int, default=300,
                   help="stage affinity: whole-word fillers fitted as the class 'none'")
    p.add_argument("--affinity-l2", type=float, default=1e-4, help="stage affinity: L2 penalty of the fit")
    p.add_argument("--affinity-sharpness", type=float, default=1.0,
                   help="stage affinity: the fit's logits times this before the softmax (sharper columns)")
    p.add_argument("--affinity-scale", type=float, default=1.0,
                   help="stage affinity: the columns' scale (probabilities times this; the map learns them faster)")
    p.add_argument("--identity-loss", type=float, default=0.0,
                   help="weight of a read-out loss naming each caption token from the encoder's output at "
                        "its position (keeps a word's identity in its context, not only its meaning)")
    p.add_argument("--object-words", type=float, default=0.0,
                   help="fraction of captions that name the shape, and of style phrases that name the "
                        "background, by a thing of that shape or pattern (world.SHAPE_OBJECTS, STYLE_OBJECTS)")
    p.add_argument("--frozen-text-encoder", action="store_true",
                   help="train the UNet against the text encoder of stage distil, frozen (as SD's UNet "
                        "learns against a CLIP encoder trained on other text)")
    p.add_argument("--distil-sentences", type=int, default=12000,
                   help="stage distil: captions, and as many filler-word sentences, in its corpus")
    p.add_argument("--distil-steps", type=int, default=6000)
    p.add_argument("--distil-batch", type=int, default=128)
    p.add_argument("--distil-lr", type=float, default=2e-3)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--init-from", default=None,
                   help="an exported tiny world to continue the UNet stage from when no checkpoint exists")
    p.add_argument("--vae-judge-from", default=None,
                   help="an exported tiny world whose VAE, judge and latent scaling to keep "
                        "(the UNet and text encoder train from scratch)")
    p.add_argument("--lexicon", choices=["minilm", "random"], default="minilm",
                   help="token meanings from the sentence model, or seeded noise (plumbing tests only)")
    p.add_argument("--stages", default="vae,classifier,pool,lexicon,unet",
                   help="comma-separated stages to run, in order (finished stages are skipped)")
    p.add_argument("--recipe", default=None,
                   help="a JSON recipe: the base stages, then UNet phases that each continue the previous "
                        "one with changed settings (scripts/tinyworld_recipe.json trains the shipped world)")
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.init_from or args.vae_judge_from:
        take_export(Path(args.init_from or args.vae_judge_from), work)
    t0 = time.time()
    stages = {"vae": train_vae, "classifier": train_classifier, "pool": build_pool,
              "lexicon": build_lexicon, "affinity": build_affinity, "distil": train_distil,
              "unet": train_unet}
    phases: list[dict] = []
    if args.recipe:
        base, phases = load_recipe(Path(args.recipe), args)
        # the recipe decides every setting it names: a different one on the command line is refused
        defaults = vars(p.parse_args([]))
        clash = sorted({k for ph in [base, *phases] for k in ph} & {k for k, v in vars(args).items()
                                                                    if v != defaults[k] and k not in RECIPE_FIXED})
        if clash:
            p.error(f"--recipe sets {', '.join('--' + k.replace('_', '-') for k in clash)}; drop "
                    f"{'it' if len(clash) == 1 else 'them'} from the command line or edit the recipe")
        vars(args).update(base)
        args.stages = base.get("stages", "vae,classifier,pool,lexicon")
    for names in [args.stages] + [ph.get("stages", "unet") for ph in phases]:
        for name in filter(None, names.split(",")):
            if name not in stages:
                p.error(f"unknown stage {name!r}; valid: {', '.join(stages)}")
    run_stages(args, work, stages, args.stages)
    for i, phase in enumerate(phases):
        vars(args).update({k: v for k, v in phase.items() if k != "stages"})
        log(f"recipe phase {i + 1} of {len(phases)}: to step {args.unet_steps}")
        run_stages(args, work, stages, phase.get("stages", "unet"))
    if args.export:
        export(args, work, Path(args.export))
        if not args.stages:
            return
    log(f"total wall time {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
