"""Harness generation throughput vs a raw diffusers loop, measured side by side.

Both render the same prompts with the same per-image seeds and batch size through the same
pipeline; the harness additionally hashes, writes PNGs atomically into a fresh cache and
reads them back. Prints images/s of each and their ratio (target >= 0.95).

    python scripts/bench_generation.py                    # the tiny world
    python scripts/bench_generation.py --model tiny_random --n 256
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


from emma import registry
from emma.cache import ImageCache  # noqa: E402
from emma.generate import CachedGenerator  # noqa: E402
from emma.pipelines import fingerprint, load_pipeline  # noqa: E402


def raw_loop(pipe, prompts, seeds, cfg, batch_size) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        gens = [torch.Generator("cpu").manual_seed(s) for s in seeds[i : i + batch_size]]
        pipe(prompt=prompts[i : i + batch_size], generator=gens, num_inference_steps=cfg.num_inference_steps,
             guidance_scale=cfg.guidance_scale, height=cfg.height, width=cfg.width, output_type="pt")
    return time.perf_counter() - t0


def harness(pipe, prompts, seeds, cfg, batch_size) -> float:
    with tempfile.TemporaryDirectory() as cache:
        gen = CachedGenerator(pipe, fingerprint(pipe), ImageCache(cache),
                              num_inference_steps=cfg.num_inference_steps, guidance_scale=cfg.guidance_scale,
                              height=cfg.height, width=cfg.width, batch_size=batch_size)
        t0 = time.perf_counter()
        gen.generate(prompts, seeds)
        return time.perf_counter() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tinyworld", help="a conf/model file")
    p.add_argument("--n", type=int, default=128, help="images per measurement")
    p.add_argument("--repeats", type=int, default=3, help="alternating measurements of each")
    args = p.parse_args(argv)
    cfg = registry.load("model", args.model)
    pipe = load_pipeline(cfg)
    bs = int(cfg.batch_size)
    words = ["circle", "square", "triangle", "star", "heart", "cross", "crescent", "diamond"]
    prompts = [f"an image of a {words[i % len(words)]}" for i in range(args.n)]
    seeds = list(range(args.n))
    raw_loop(pipe, prompts[:bs], seeds[:bs], cfg, bs)  # warm-up
    raw_t, har_t = [], []
    for _ in range(args.repeats):  # alternate, so that drift in machine load hits both
        raw_t.append(raw_loop(pipe, prompts, seeds, cfg, bs))
        har_t.append(harness(pipe, prompts, seeds, cfg, bs))
    raw_ips, har_ips = args.n / min(raw_t), args.n / min(har_t)
    print(f"model={args.model} images={args.n} batch_size={bs} steps={cfg.num_inference_steps} "
          f"threads={torch.get_num_threads()}")
    print(f"raw diffusers loop: {raw_ips:8.2f} images/s (best of {args.repeats})")
    print(f"harness generate:   {har_ips:8.2f} images/s (best of {args.repeats})")
    print(f"ratio harness/raw:  {har_ips / raw_ips:8.3f}")


if __name__ == "__main__":
    main()
