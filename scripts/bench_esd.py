"""ESD's time per training iteration: the method as shipped vs a plain loop, side by side.

The plain loop is the textbook iteration (x_t drawn under ``torch.no_grad``, two frozen UNet
calls, the trained forward and backward, Adam's per-tensor update). Both start from the same
pipeline and seed; the script prints ms/iteration of each, their ratio, and the largest
difference between the two fine-tuned UNets (0 when the speed-ups leave the arithmetic alone).

    python scripts/bench_esd.py                            # esd-x and esd-u, 1 and 2 threads
    python scripts/bench_esd.py --train-methods esd-u --iterations 50 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


from emma import registry
from emma.methods._common import cpu_generator, encode_text, randint, randn  # noqa: E402
from emma.methods.esd import ESDMethod, esd_parameter_filter  # noqa: E402
from emma.pipelines import load_pipeline  # noqa: E402


def plain_erase(pipe, concept: str, hp: dict, seed: int) -> None:
    """The same algorithm and random draws as ESDMethod.erase, written the plain way."""
    from diffusers import DDIMScheduler

    unet = pipe.unet
    gen = cpu_generator(seed)
    cond, uncond, blank = encode_text(pipe, [concept]), encode_text(pipe, [""]), encode_text(pipe, [""])
    sampler = DDIMScheduler.from_config(pipe.scheduler.config)
    sampler.set_timesteps(hp["ddim_steps"], device="cpu")
    timesteps = sampler.timesteps.clone()
    shape = (1, unet.config.in_channels, unet.config.sample_size, unet.config.sample_size)
    frozen = copy.deepcopy(unet).requires_grad_(False).eval()
    unet.eval()
    params = [p for n, p in unet.named_parameters() if esd_parameter_filter(hp["train_method"])(n)]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=hp["learning_rate"])
    for _ in range(hp["iterations"]):
        randint(1, gen)
        k = randint(hp["ddim_steps"], gen)
        z = randn(shape, gen) * sampler.init_noise_sigma
        with torch.no_grad():
            xt = ESDMethod._sample_until(unet, sampler, timesteps[:k], z, cond, blank,
                                         hp["start_guidance"], torch.float32)
            t = timesteps[k]
            e_0 = frozen(xt, t, encoder_hidden_states=uncond).sample
            e_p = frozen(xt, t, encoder_hidden_states=cond).sample
            target = e_0 - hp["negative_guidance"] * (e_p - e_0)
        loss = F.mse_loss(unet(xt, t, encoder_hidden_states=cond).sample, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    unet.requires_grad_(False)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tinyworld", help="a conf/model file")
    p.add_argument("--concept", default="circle")
    p.add_argument("--train-methods", default="esd-x,esd-u")
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    args = p.parse_args(argv)
    cfg = registry.load("model", args.model)
    base = load_pipeline(cfg)
    print(f"{'method':8} {'threads':>7} {'plain ms/it':>12} {'shipped ms/it':>14} {'speed-up':>9} {'max |dW|':>10}")
    for tm in args.train_methods.split(","):
        hp = dict(train_method=tm, iterations=args.iterations, learning_rate=2.5e-4, negative_guidance=1.0,
                  start_guidance=3.0, ddim_steps=10)
        for n in (int(x) for x in args.threads.split(",")):
            torch.set_num_threads(n)
            a, b = copy.deepcopy(base), copy.deepcopy(base)
            t0 = time.perf_counter()
            plain_erase(a, args.concept, hp, seed=0)
            t_plain = (time.perf_counter() - t0) / args.iterations
            t0 = time.perf_counter()
            ESDMethod(**hp, progress=False).erase(b, [args.concept], seed=0)
            t_new = (time.perf_counter() - t0) / args.iterations
            diff = max((x - y).abs().max().item() for x, y in zip(a.unet.parameters(), b.unet.parameters()))
            print(f"{tm:8} {n:>7} {t_plain * 1e3:>12.1f} {t_new * 1e3:>14.1f} {t_plain / t_new:>8.2f}x {diff:>10.2e}",
                  flush=True)


if __name__ == "__main__":
    main()
