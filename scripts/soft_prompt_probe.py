"""Does an erased tiny-world model still draw the concept under some text conditioning?

A relaxation of the hard-prompt attackers (UnlearnDiffAtk, P4D, Ring-A-Bell): the conditioning
is optimised continuously so that the erased UNet's noise prediction matches the base model's
for the concept's name prompt (P4D's objective) on noised base-model images of the concept; then the
erased model draws 16 images with it and the tiny-world judge counts the concept. A high rate
shows the concept is still drawable; a low one proves nothing (the optimiser may miss). Three
relaxations, from loosest to the attackers' own space:

- ``hidden``: the text encoder's output (77 x d) itself;
- ``embeds``: the input token embeddings of the name prompt, through the text encoder
  (a soft prompt over every position);
- ``soft16``: 16 free input embeddings after the start token (P4D-N's layout), and their
  nearest tokens (cosine; P4D's projection) over the whole vocabulary and over the domain's
  words, judged as text prompts.

    python scripts/soft_prompt_probe.py --methods esd,uce,fmn --concept circle --steps 300 \
        --out docs/soft_prompt_tinyworld.md

The erased model comes from the CLI's configs (the method's tiny-world preset) and the cache
under ``--cache``; one torch thread.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_attacks import make_target  # noqa: E402

from attackers.common import candidate_token_ids  # noqa: E402


def probe(method: str, concept: str, steps: int, cache: Path, overrides: list[str]) -> dict[str, Any]:
    """Fraction of 16 erased-model images showing ``concept`` under each conditioning."""
    target, requests = make_target(method, overrides, cache, concept=concept)
    wb, base = target.white_box(), target.base_model()
    prompt = next(r.prompt for r in requests if r.kind == "name")  # the domain's name prompt
    seeds = list(range(100, 116))
    gen = torch.Generator().manual_seed(0)

    def detected(**kw: Any) -> float:
        out = target.generate(seeds=seeds, **kw)
        return float(target.detect(target.score(out.images, out.hashes), concept).float().mean())

    row: dict[str, Any] = {"method": method, "concept": concept, "steps": steps, "prompt": prompt,
                           "name prompt": detected(prompts=[prompt] * len(seeds))}
    x0 = wb.encode_images(base.generate([prompt] * 8, list(range(8))).images).float()
    base_wb = base.white_box()
    with torch.no_grad():
        base_hidden = base_wb.encode_ids(base_wb.token_ids([prompt])).float().expand(len(x0), -1, -1)

    def fit(var: torch.nn.Parameter, to_hidden: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        opt = torch.optim.Adam([var], lr=1e-2)
        for _ in tqdm(range(steps), desc=f"{method} soft prompt", leave=False):
            t = torch.randint(0, wb.num_train_timesteps, (len(x0),), generator=gen)
            noise = torch.randn(x0.shape, generator=gen)
            noisy = wb.add_noise(x0, noise, t)
            with torch.no_grad():  # P4D's objective: the base model's prediction for the prompt
                goal = base_wb.denoise(noisy, t, base_hidden)
            loss = torch.nn.functional.mse_loss(wb.denoise(noisy, t, to_hidden(var).expand(len(x0), -1, -1)), goal)
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            return to_hidden(var.detach()).expand(len(seeds), -1, -1)

    ids = wb.token_ids([prompt])
    with torch.no_grad():
        h0, e0 = wb.encode_ids(ids).float(), wb.embed_ids(ids).float()
    row["hidden states"] = detected(prompt_embeds=fit(torch.nn.Parameter(h0.clone()), lambda v: v))
    row["soft prompt, every position"] = detected(
        prompt_embeds=fit(torch.nn.Parameter(e0.clone()), wb.encode_embeds))

    vocab = wb.token_embedding_matrix().float()
    with torch.no_grad():
        blank = wb.embed_ids(wb.token_ids([""])).float()
    pos = torch.arange(1, 17)
    first_special = min(wb.bos_token_id, wb.eos_token_id)
    free = torch.nn.Parameter(vocab[torch.randint(0, first_special, (16,), generator=gen)])

    def place(v: torch.Tensor) -> torch.Tensor:
        full = blank.clone()
        full[0, pos] = v
        return wb.encode_embeds(full)

    row["soft prompt, 16 free tokens"] = detected(prompt_embeds=fit(free, place))
    for name in ("all", "domain"):
        cand = torch.arange(first_special) if name == "all" else candidate_token_ids(wb, "domain", target, "probe")
        unit = torch.nn.functional.normalize(vocab[cand], dim=-1)
        nearest = cand[(torch.nn.functional.normalize(free.detach(), dim=-1) @ unit.T).argmax(-1)]
        text = wb.decode_ids(nearest.tolist())
        row[f"nearest tokens ({name})"] = detected(prompts=[text] * len(seeds))
        row[f"nearest tokens ({name}) text"] = text
    return row


COLUMNS = ("name prompt", "hidden states", "soft prompt, every position", "soft prompt, 16 free tokens",
           "nearest tokens (all)", "nearest tokens (domain)")


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    out = ["# Soft-prompt probe: is the concept still in the erased model?", "",
           "Fraction of 16 images (seeds 100-115) on the erased model in which the tiny-world judge finds the "
           "erased concept, under conditionings optimised so that the erased UNet's noise prediction matches "
           "the base model's for the name prompt (P4D's objective) on noised base-model images of the concept "
           "(8 images, Adam 1e-2, the same steps for each). `hidden states`: the text "
           "encoder's output itself; `soft prompt, every position`: the name prompt's input token embeddings "
           "(all 77 positions, padding included); `soft prompt, 16 free tokens`: P4D-N's layout; `nearest "
           "tokens`: those 16 embeddings projected to their nearest tokens (cosine, P4D's projection) and "
           "drawn as text. The hard-prompt attackers (UnlearnDiffAtk, P4D, Ring-A-Bell) search only the last "
           "kind: a high soft rate with a low hard rate says the concept is still drawable but the words to "
           "reach it are missing from the vocabulary. A low soft rate proves nothing: the optimiser may miss.", "",
           f"`{command}` (erased models from the CLI's tiny-world presets; one torch thread).", "",
           "| method | concept | steps | " + " | ".join(COLUMNS) + " |",
           "|---|---|---|" + "---|" * len(COLUMNS)]
    for r in rows:
        out.append(f"| {r['method']} | {r['concept']} | {r['steps']} | "
                   + " | ".join(f"{r[c]:.2f}" for c in COLUMNS) + " |")
    out += ["", "Projected prompts:", ""]
    for r in rows:
        for name in ("all", "domain"):
            out.append(f"- {r['method']}, {name} vocabulary: `{r[f'nearest tokens ({name}) text']}`")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="esd,uce,fmn")
    p.add_argument("--concept", default="circle")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--cache", type=Path, default=ROOT / ".cache" / "eval-methods")
    p.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable)")
    p.add_argument("--out", type=Path, default=None, help="write the table as markdown here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for method in args.methods.split(","):
        row = probe(method, args.concept, args.steps, args.cache, args.override)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("text")}), flush=True)
        rows.append(row)
    if args.out is not None:
        command = (f"python scripts/soft_prompt_probe.py --methods {args.methods} --concept {args.concept} "
                   f"--steps {args.steps}" + "".join(f" --override '{o}'" for o in args.override)
                   + f" --out {args.out.as_posix()}")
        args.out.write_text(markdown(rows, command))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
