"""Tiny-world throughput on this machine: images/s of generation (the shipped pipeline and
scheduler, 20 steps, guidance 5, batch 32) and of classification (the tiny-world judge).

    python scripts/bench_tinyworld.py [--n 128] [--threads 2]
    python scripts/bench_tinyworld.py --model tinyworld2 --vs-unet v1 --threads 1 --repeats 3
    python scripts/bench_tinyworld.py --pretrained EXPORT/pipeline --vs-pretrained \
        emma/tinyworld/assets/pipeline --threads 1 --repeats 4     # a trained candidate vs world 1

``--vs-pretrained FOLDER`` times, the same way, the benchmarked pipeline against another trained
pipeline folder (a retrained tiny world against the shipped one, both with their own weights).
``--vs-unet v1`` times, side by side in one run, the shipped pipeline and the same pipeline with
the first tiny world's UNet architecture (``arch.UNET_CONFIG_V1``, random weights: the time of a
forward pass does not depend on the weights), alternating them ``--repeats`` times, and prints
the ratio of their best images/s.
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
from emma import registry  # noqa: E402
from emma.pipelines import load_pipeline  # noqa: E402
from emma.tinyworld import arch  # noqa: E402
from emma.tinyworld.world import SHAPES, render_batch, sample_specs  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--model", default="tinyworld", help="model config (conf/model): tinyworld or tinyworld2")
    p.add_argument("--vs-unet", choices=["v1"], default=None,
                   help="also time the first tiny world's UNet architecture, side by side")
    p.add_argument("--repeats", type=int, default=3, help="alternating timings per pipeline (--vs-unet)")
    p.add_argument("--pretrained", default=None, help="benchmark this pipeline folder (model.pretrained)")
    p.add_argument("--vs-pretrained", default=None,
                   help="also time this pipeline folder, side by side (e.g. emma/tinyworld/assets/pipeline)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = registry.load("model", args.model)
    if args.pretrained:
        cfg.pretrained = args.pretrained
    pipe = load_pipeline(cfg)
    prompts = [f"an image of a {SHAPES[i % len(SHAPES)]}" for i in range(args.n)]
    bs = int(cfg.batch_size)

    def generate(lo: int, hi: int, pipe=pipe) -> torch.Tensor:
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
    if args.vs_unet:
        from diffusers import StableDiffusionPipeline, UNet2DConditionModel

        torch.manual_seed(0)
        old = StableDiffusionPipeline(**{**pipe.components, "unet": UNet2DConditionModel(**arch.UNET_CONFIG_V1)})
        compare(pipe, old, "v1", generate, args.n, args.repeats)
    if args.vs_pretrained:
        other = cfg.copy()
        other.pretrained = args.vs_pretrained
        compare(pipe, load_pipeline(other), "other", generate, args.n, args.repeats)

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


def compare(pipe, old, label: str, generate, n: int, repeats: int) -> None:
    """Best images/s of ``pipe`` and of ``old`` (called ``label``), timed alternately."""
    old.set_progress_bar_config(disable=True)
    generate(0, 8, pipe=old)  # warm-up
    best = {"this": 0.0, label: 0.0}
    for _ in range(repeats):
        for name, p in (("this", pipe), (label, old)):
            t0 = time.perf_counter()
            generate(0, n, pipe=p)
            best[name] = max(best[name], n / (time.perf_counter() - t0))
    unet_params = {k: sum(x.numel() for x in p.unet.parameters()) / 1e6 for k, p in (("this", pipe), (label, old))}
    print(f"{'UNet':10} {'params':>8} {'images/s':>10}  (best of {repeats}, {n} images each)")
    for name in best:
        print(f"{name:10} {unet_params[name]:7.2f}M {best[name]:10.1f}")
    print(f"ratio this / {label}: {best['this'] / best[label]:.2f}x")


if __name__ == "__main__":
    main()
