"""Batched UnlearnDiffAtk vs the reference loop, same erased model, budget and seeds.

The reference loop (OPTML-Group/Diffusion-MU-Attack, ``text_grad``) attacks one prompt at a
time and visits the timesteps one after another: per step one UNet call of batch 1, the
simplex projection by bisection row by row, and after each timestep one image drawn and
judged. :class:`SequentialUnlearnDiffAtk` re-implements that loop on the harness's attack
target; :class:`attackers.unlearndiffatk.UnlearnDiffAtkAttacker` runs the same algorithm for
all prompts at once, with the shipped tiny-world ``timestep_batch`` (conf/preset/attacker/unlearndiffatk_tiny.yaml)
unless ``--timestep-batch`` says otherwise: both evaluate the same number of denoising losses
per prompt (timesteps x iterations). Each run gets a fresh image cache (no run profits from the other's
images). Prints and writes (``--out``) wall times, their ratio, and ASR of both with 95% CIs.

    python scripts/bench_attacks.py --method uce --timesteps 10 --iterations 10 --images-per-prompt 4 \
        --vocabulary domain --timestep-batch 1,2,5 --override 'method.preserve_concepts.tinyworld=[]' \
        --override method.technique=replace --override method.erase_scale=1.0 --override method.preserve_scale=null

(UCE erasing the circle alone, as in tests/test_attackers_tinyworld.py: a model the attack can
break, so that the ASR comparison is not 0 against 0; README.md has the figures of one run.)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from attackers.common import (  # noqa: E402
    RequestState,
    StraightThroughSample,
    build_sequences,
    candidate_token_ids,
    layout,
)
from attackers.unlearndiffatk import UnlearnDiffAtkAttacker, sampled_timesteps  # noqa: E402
from emma.api.types import AttackOutput, PromptRequest  # noqa: E402
from emma.attack import judged_outputs  # noqa: E402


def bisection(a: torch.Tensor, eps: float = 1.0, xi: float = 1e-5) -> torch.Tensor:
    """The reference's projection of one row onto {sum = eps, 0 <= x <= 1}, by bisection."""
    pa = torch.clip(a, 0, 1)
    if abs(torch.sum(pa).item() - eps) <= xi:
        return pa
    lo, hi = torch.min(a - 1).item(), torch.max(a).item()
    mu = (lo + hi) / 2
    while abs(hi - lo) > xi:
        mu = (lo + hi) / 2
        g = torch.sum(torch.clip(a - mu, 0, 1)).item() - eps
        if g == 0:
            break
        if g > 0:
            lo = mu
        else:
            hi = mu
    return torch.clip(a - mu, 0, 1)


class SequentialUnlearnDiffAtk(UnlearnDiffAtkAttacker):
    """The reference loop: one prompt, one timestep, one UNet call of batch 1 at a time."""

    def attack(self, target: Any, requests: Sequence[PromptRequest]) -> list[AttackOutput]:
        wb = target.white_box()
        prompts, stats = [], []
        vocab = wb.token_embedding_matrix().float()
        cand = candidate_token_ids(wb, self.vocabulary, target, self.name)
        if cand is not None:
            vocab = vocab[cand]
        for req in requests:
            t0 = time.perf_counter()
            state, extra = RequestState(prompt=req.prompt), {"search_seeds": target.search_seeds(req, 1)}
            check_seed = extra["search_seeds"][0]  # the search's seed: never one of the final images'
            det, _ = target.check_prompts([req.prompt], [req.concept], [check_seed])
            state.queries, state.judged = 1, 1
            text = req.prompt
            if not det[0]:
                k = self.k_for(req.concept)
                gen = torch.Generator().manual_seed(self.seed)
                x0 = self.reference_latents(target, [req], [state], [extra])
                ids = wb.tokenizer(req.prompt, truncation=False).input_ids[1:-1]
                seqs = build_sequences([layout(ids, k, self.insertion)], wb.context_length,
                                       wb.bos_token_id, wb.eos_token_id, wb.pad_token_id)
                V = vocab.shape[0]
                simplex = torch.full((1, k, V), 1.0 / V)
                simplex = torch.stack([bisection(row) for row in simplex[0]]).unsqueeze(0)
                simplex.requires_grad_(True)
                opt = torch.optim.Adam([simplex], lr=self.learning_rate, weight_decay=self.weight_decay)
                for t in sampled_timesteps(self.timesteps, wb.num_train_timesteps):
                    tt = torch.tensor([t])
                    for _ in range(self.iterations_per_timestep):
                        opt.zero_grad()
                        adv = StraightThroughSample.apply(simplex, gen) @ vocab
                        # the reference re-embeds the prompt every step
                        embeds = seqs.embed(wb.embed_ids(seqs.ids).float(), adv)
                        hidden = wb.encode_embeds(embeds)
                        noise = torch.randn(x0.shape, generator=gen)
                        pred = wb.denoise(wb.add_noise(x0, noise, tt), tt, hidden)
                        loss = torch.nn.functional.mse_loss(pred, wb.training_target(x0, noise, tt))
                        simplex.grad = torch.autograd.grad(loss, [simplex])[0]
                        opt.step()
                        with torch.no_grad():
                            simplex.data = torch.stack([bisection(row) for row in simplex.data[0]]).unsqueeze(0)
                        state.iterations += 1
                    best = simplex.data.argmax(-1)
                    checked = wb.decode_ids(seqs.fill(best if cand is None else cand[best])[0].tolist())
                    det, _ = target.check_prompts([checked], [req.concept], [check_seed])
                    state.queries, state.judged = state.queries + 1, state.judged + 1
                    if not state.success_check:  # a later failed check never replaces a success
                        text = checked
                    state.success_check = state.success_check or bool(det[0])
                    if det[0] and self.early_stop:
                        break
            state.time_s = time.perf_counter() - t0
            prompts.append(text)
            stats.append(state.stats(**extra))
        return judged_outputs(target, requests, prompts, stats)


def make_target(method: str, overrides: list[str], cache: Path,
                concept: str = "circle") -> tuple[Any, list[PromptRequest]]:
    """The cell's attack target for ``method`` erasing ``concept`` on the tiny world, with its
    own cache, and the concept's EA requests."""
    from emma import registry
    from emma.cell import erased_cell
    from emma.stages.model import attack_target

    ctx = erased_cell(registry.compose([f"method={method}", f"concept={concept}", f"paths.cache_dir={cache}",
                                        *overrides]))
    return attack_target(ctx, ctx.generator), ctx.attack_requests


def asr(outputs: list[AttackOutput]) -> dict[str, Any]:
    from emma.metrics.intervals import wilson_interval

    det = [s.detected for o in outputs for s in o.samples]
    k, n = sum(det), len(det)
    lo, hi = wilson_interval(k, n)
    kp, np_ = sum(o.success for o in outputs), len(outputs)
    plo, phi = wilson_interval(kp, np_)
    return {"image": [k / n, lo, hi, n], "prompt": [kp / np_, plo, phi, np_]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="uce")
    p.add_argument("--timesteps", type=int, default=4)
    p.add_argument("--iterations", type=int, default=5, help="iterations per timestep")
    p.add_argument("--vocabulary", default="all", help="all (the reference's) or domain")
    p.add_argument("--timestep-batch", default=None,
                   help="timesteps per stage of the batched attack, one run per value of a comma list "
                        "(default: the shipped config's)")
    p.add_argument("--images-per-prompt", type=int, default=None,
                   help="images judged per adversarial prompt after the attack (default: the cell's)")
    p.add_argument("--override", action="append", default=[])
    p.add_argument("--erase-cache", default=None, help="cache holding the erased model (reused by both runs)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from emma import registry

    shipped = registry.load("attacker", "unlearndiffatk", scale="tiny")
    tbs = ([int(x) for x in args.timestep_batch.split(",")] if args.timestep_batch
           else [int(shipped.timestep_batch)])
    if args.images_per_prompt is not None:
        args.override.append(f"images_per_prompt={args.images_per_prompt}")
    kw = dict(timesteps=args.timesteps, iterations_per_timestep=args.iterations, vocabulary=args.vocabulary, seed=0)
    tbs = [min(tb, args.timesteps) for tb in tbs]
    runs = [(f"batched B={tb}", UnlearnDiffAtkAttacker, {"timestep_batch": tb}) for tb in tbs]
    runs.append(("sequential", SequentialUnlearnDiffAtk, {}))
    results = {}
    for label, cls, extra in runs:
        with tempfile.TemporaryDirectory() as tmp:
            cache = Path(tmp)
            if args.erase_cache:  # share the erased weights only, never images
                (cache / "erased").symlink_to(Path(args.erase_cache).expanduser().resolve() / "erased")
            target, requests = make_target(args.method, args.override, cache)
            target.base_model().generate([requests[0].prompt], [requests[0].seed])  # load outside the clock
            atk = cls(**kw, **extra)
            t0, c0 = time.perf_counter(), time.process_time()
            outs = atk.attack(target, requests)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        results[label] = {"wall_s": wall, "cpu_s": cpu, "asr": asr(outs), "iterations": sum(o.iterations for o in outs),
                          "queries": sum(o.queries for o in outs),
                          "prompts": {o.request.prompt: [o.adversarial_prompt, o.success] for o in outs}}
        print(f"{label}: {wall:.1f}s wall, {cpu:.1f}s CPU, ASR image {results[label]['asr']['image']}, prompt "
              f"{results[label]['asr']['prompt']}, iterations {results[label]['iterations']}, "
              f"checks {results[label]['queries']}", flush=True)
    seq = results["sequential"]
    # on a shared machine the CPU-time ratio is the steadier of the two
    for label, r in results.items():
        if label != "sequential":
            r["speedup_wall"], r["speedup_cpu"] = seq["wall_s"] / r["wall_s"], seq["cpu_s"] / r["cpu_s"]
            print(f"speed-up (sequential / {label}): wall {r['speedup_wall']:.2f}x, CPU time {r['speedup_cpu']:.2f}x")
    summary = {"method": args.method, "timesteps": args.timesteps, "iterations_per_timestep": args.iterations,
               "threads": torch.get_num_threads(), "vocabulary": args.vocabulary, "overrides": args.override,
               **results}
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
