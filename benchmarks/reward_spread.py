"""Within-group reward spread of SDE rollouts: how much a group's window noise moves the reward.

    .venv/bin/python benchmarks/reward_spread.py NOISE:BLOCK:START:END [...] [--batches 2]

Run it from the repository root. For each setting (noise level, `noise_block`, window
[start, end)), `--batches` batches of the first 8 pool prompts x 16 samples with one starting
noise per group (as in the recipes; only the window noise differs within a group) are rolled out
from the committed base model and scored by the exact verifier. Printed per setting: the mean
atom score, the mean and median over groups of the within-group std of the mean atom score, the
share of groups whose std exceeds 0.05, and the mean within-group range. Noise level 0 is the ODE
(every group's samples identical: std 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from credit_probe import BASE, CFG, POOL, STEPS

from cast_core.backbones.shapes import ShapesBackbone
from cast_core.csg.geneval import graph_from_geneval
from cast_core.rollout import RolloutSpec, rollout
from cast_core.shapes.verifier import verify
from cast_core.window import SdeWindow


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("settings", nargs="+", help="NOISE:BLOCK:START:END, e.g. 0.7:4:0:3")
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--guidance", type=float, default=CFG,
                    help=f"CFG scale of the rollouts (default {CFG}; the recipes train at 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    backbone = ShapesBackbone.from_pretrained(str(BASE)).eval()
    pool = [json.loads(line) for line in Path(POOL).read_text().splitlines() if line.strip()][:8]
    b, g = len(pool), 16
    prompts = [r["prompt"] for r in pool for _ in range(g)]
    graphs = [graph_from_geneval(r) for r in pool for _ in range(g)]
    for setting in args.settings:
        noise, block, w0, w1 = setting.split(":")
        spec = RolloutSpec(STEPS, args.guidance, float(noise), "flow_sde", SdeWindow(int(w0), int(w1)),
                           noise_block=int(block))
        batches = []
        for m in range(args.batches):
            seeds = [7_000_000 + m * 10**5 + i for i in range(b * g)]
            starts = [7_050_000 + m * 10**5 + i // g for i in range(b * g)]
            ro = rollout(backbone, prompts, seeds, spec, noise_seeds=starts)
            scores = verify(backbone.decode(ro.x0), graphs)
            batches.append(torch.tensor([float(s.scores.mean()) for s in scores]).view(b, g))
        r = torch.cat(batches)  # [groups, G]
        sd = r.std(dim=1)
        print(f"noise {noise} block {block} window [{w0}, {w1}): mean {r.mean():.3f}, "
              f"within-group std mean {sd.mean():.3f}, median {sd.median():.3f}, share of groups "
              f"with std > 0.05: {(sd > 0.05).float().mean():.2f}, within-group range (mean) "
              f"{(r.max(1).values - r.min(1).values).mean():.3f}", flush=True)


if __name__ == "__main__":
    main()
