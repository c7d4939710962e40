"""Benchmark of the shapes world's hot paths: sampling 128 images and verifying a 128-image batch.

    .venv/bin/python benchmarks/bench_shapes.py [--checkpoint data/base/shapes-base] [--repeats 5]

Prints the median and spread of `repeats` timed runs of each, and ratios against baselines measured
in the same run: sampling with CFG against sampling without it (CFG doubles the batch), and
verifying against rendering the same scenes (the verifier's cost relative to making the images).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from cast_core.backbones.shapes import ShapesBackbone
from cast_core.csg.geneval import graph_from_geneval
from cast_core.sampling import sample_ode
from cast_core.shapes.prompts import load_prompt_file
from cast_core.shapes.render import render, sample_scene
from cast_core.shapes.verifier import verify


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def line(name: str, times: list[float]) -> str:
    return (f"{name:<44} median {statistics.median(times):7.3f} s  "
            f"(min {min(times):.3f}, max {max(times):.3f}, n={len(times)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="data/base/shapes-base")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    backbone = ShapesBackbone.from_pretrained(args.checkpoint).eval()
    records = load_prompt_file("data/prompts/eval.jsonl")[:128]
    records = (records * 2)[:128]
    prompts = [r["prompt"] for r in records]
    seeds = list(range(128))

    cfg = timed(lambda: sample_ode(backbone, prompts, seeds, args.steps, args.guidance), args.repeats)
    no_cfg = timed(lambda: sample_ode(backbone, prompts, seeds, args.steps, 1.0), args.repeats)
    rng = np.random.default_rng(0)
    scenes = [sample_scene(r, rng) for r in records]
    images = torch.from_numpy(np.stack([render(s).image for s in scenes])).permute(0, 3, 1, 2) / 255.0
    graphs = [graph_from_geneval(r) for r in records]
    atoms = sum(len(g.atoms()) for g in graphs)
    scoring = timed(lambda: verify(images, graphs), args.repeats)
    rendering = timed(lambda: [render(s) for s in scenes], args.repeats)

    print(f"threads={args.threads}  steps={args.steps}  cfg={args.guidance}  images=128  atoms={atoms}")
    print(line(f"sample 128 images, {args.steps} steps, CFG {args.guidance}", cfg))
    print(line(f"sample 128 images, {args.steps} steps, no CFG (baseline)", no_cfg))
    print(line("verify 128 images, all atoms", scoring))
    print(line("render 128 scenes (baseline)", rendering))
    print(f"ratio CFG / no-CFG sampling: {statistics.median(cfg) / statistics.median(no_cfg):.2f}x")
    print(f"ratio verify / render: {statistics.median(scoring) / statistics.median(rendering):.2f}x")
    print(f"targets: sampling <= ~10 s -> {statistics.median(cfg):.2f} s; "
          f"verifier <= ~2 s -> {statistics.median(scoring):.2f} s")


if __name__ == "__main__":
    main()
