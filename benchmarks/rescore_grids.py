"""Rescore a committed benchmark report's pool grids with the verifier of two revisions.

    .venv/bin/python benchmarks/rescore_grids.py --old-rev fb2cfa4^ reports/cfg1-pool8-40it \\
        reports/cfg1-pool8 reports/nft-cfg1-pool8 reports/nft-quick reports/cast-vs-flowgrpo

Each `grid-<name>-pool.png` of a report (the methods benchmark's grids of the final pool evaluation of the
base and of each arm's seed 0: one row per pool prompt, the pool's first prompts in
data/prompts/pool.jsonl order, its images along the row, every 32 x 32 image drawn 2x with nearest
neighbours and a 2-px white gap) holds the exact uint8 images, so they can be cut out and scored
again. Prints
the mean atom score of each grid under the old revision's `cast_core/shapes/verifier.py` (read
with `git show`) and under the working tree's, and the foreground pixels in instances that the
working tree's verifier calls no shape ("other": bars, specks, blocks).

Used for reports/learning-probes section 7: what the verifier's aspect and short-side gates change
on the images that earlier policies drew.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

TILE, GAP = 64, 2


def grid_images(path: Path) -> tuple[torch.Tensor, list[int]]:
    """([n, 3, 32, 32] in [0, 1], the row of each) from a methods-benchmark report's grid PNG, row by row."""
    image = np.array(Image.open(path).convert("RGB"))
    rows, cols = ((n + GAP) // (TILE + GAP) for n in image.shape[:2])
    tiles = [image[r * (TILE + GAP): r * (TILE + GAP) + TILE,
                   c * (TILE + GAP): c * (TILE + GAP) + TILE][::2, ::2]
             for r in range(rows) for c in range(cols)]
    images = torch.from_numpy(np.stack(tiles)).permute(0, 3, 1, 2).float() / 255.0
    return images, [r for r in range(rows) for _ in range(cols)]


def load_verifier(rev: str):
    """The module `cast_core/shapes/verifier.py` as it was at git revision `rev`."""
    source = subprocess.run(["git", "show", f"{rev}:cast_core/shapes/verifier.py"],
                            capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "verifier_at_rev.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("verifier_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["verifier_at_rev"] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", help="report folders")
    parser.add_argument("--old-rev", required=True, help="git revision of the old verifier")
    parser.add_argument("--pool", default="data/prompts/pool.jsonl")
    args = parser.parse_args(argv)

    from cast_core.csg.geneval import graph_from_geneval
    from cast_core.shapes import verifier as new

    old = load_verifier(args.old_rev)
    records = [json.loads(line) for line in Path(args.pool).read_text().splitlines() if line]
    print(f"{'report':24s} {'grid':10s} {'images':>6s} {'old':>6s} {'new':>6s} {'change':>7s} "
          f"{'no-shape fg':>11s}")
    for folder in args.reports:
        for grid in sorted(Path(folder).glob("grid-*-pool.png")):
            images, rows = grid_images(grid)
            graphs = [graph_from_geneval(records[r]) for r in rows]
            before = np.mean([r.scores.mean() for r in old.verify(images, graphs)])
            after = np.mean([r.scores.mean() for r in new.verify(images, graphs)])
            fg = other = 0
            for inst in new.detect(images):
                sizes = inst.masks.sum(axis=(1, 2))
                fg += sizes.sum()
                other += (sizes * (inst.kind_probs[:, -1] > 0.5)).sum()
            name = grid.stem.removeprefix("grid-").removesuffix("-pool")
            print(f"{Path(folder).name:24s} {name:10s} {len(images):6d} {before:6.3f} {after:6.3f} "
                  f"{after - before:+7.3f} {other / max(fg, 1):11.1%}")


if __name__ == "__main__":
    main()
