"""Tiny-world throughput on this machine: images/s of generation (the shipped pipeline and
scheduler, 20 steps, guidance 5, batch 32) and of classification (the tiny-world judge).

    python scripts/bench_tinyworld.py [--n 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


from classifiers.tinyworld import TinyWorldClassifier  # noqa: E402
from emma import registry
from emma.pipelines import load_pipeline  # noqa: E402
from emma.tinyworld.world import SHAPES, render_batch, sample_specs  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = registry.load("model", "tinyworld")
    pipe = load_pipeline(cfg)
    prompts = [f"an image of a {SHAPES[i % len(SHAPES)]}" for i in range(args.n)]
    bs = int(cfg.batch_size)

    def generate(lo: int, hi: int) -> torch.Tensor:
        out = []
        for i in range(lo, hi, bs):
            gens = [torch.Generator().manual_seed(s) for s in range(i, min(i + bs, hi))]
            out.append(pipe(prompt=prompts[i : min(i + bs, hi)], generator=gens,
                            num_inference_steps=cfg.num_inference_steps, guidance_scale=cfg.guidance_scale,
                            height=cfg.height, width=cfg.width, output_type="pt").images)
        return torch.cat(out)

    generate(0, bs)  # warm-up
    t0 = time.perf_counter()
    images = generate(0, args.n)
    gen_ips = args.n / (time.perf_counter() - t0)

    clf = TinyWorldClassifier()
    renders = torch.from_numpy(render_batch(sample_specs(1024, seed=0)))
    clf.predict(renders[:64])  # warm-up
    t0 = time.perf_counter()
    clf.predict(renders)
    clf_ips = len(renders) / (time.perf_counter() - t0)
    print(f"threads={torch.get_num_threads()} steps={cfg.num_inference_steps} batch={bs}")
    print(f"generation:     {gen_ips:8.1f} images/s ({args.n} images)")
    print(f"classification: {clf_ips:8.1f} images/s ({len(renders)} images)")
    assert images.shape[1:] == (3, 32, 32)


if __name__ == "__main__":
    main()
