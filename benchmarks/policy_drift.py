"""How a run's policy moves in function space: drift or random walk.

    .venv/bin/python benchmarks/policy_drift.py --store runs/x/store --run bench-flowgrpo-s0
        [--every 10] [--images 4] [--json out.json]

The policy's velocity at fixed inputs is compared with the base model's, at checkpoints every
`--every` iterations (and iteration 0). Inputs: each prompt the run trained on (its rollouts), with
`--images` fixed starting noises each, carried by the base model's ODE to each step of the run's
SDE window (the steps training changes); CFG 1. Per checkpoint k it prints
- the RMS of v_k - v_base per latent dim (the unit of `train.velocity_target`);
- the cosine between the move since the previous checkpoint and the move before it (about 0 when
  successive moves are independent, as in a random walk; near 1 for a steady drift);
and for the whole run the net move over the summed moves between checkpoints: about 1/sqrt(n)
for a random walk of n moves, 1 for a straight line.

Weights are read from the store (safetensors blobs); the run's recipe from its pin (`runs`).
"""

from __future__ import annotations

import argparse
import json
import math
from itertools import pairwise
from pathlib import Path

import pyarrow.compute as pc
import torch


def checkpoint_velocity_changes(store, run_id: str, every: int, images: int) -> dict:
    """{"iterations": [k], "rms": [RMS of v_k - v_base], "cos_prev": [cos or None],
    "net_over_path": float, "random_walk": 1/sqrt(moves), "window": [start, end]}."""
    from tasks.stages.models import load_policy, set_lora
    from tasks.stages.recipe import Recipe

    pin = store.read_table("runs", {"run_id": run_id}).to_pylist()
    if not pin:
        raise SystemExit(f"no run {run_id!r} in {store.root} (its `runs` row holds the recipe)")
    recipe = Recipe.model_validate(json.loads(pin[0]["recipe_json"]))
    rows = sorted(store.read_table("checkpoints", pc.field("run_id") == run_id).to_pylist(),
                  key=lambda r: r["iteration"])
    rows = [r for r in rows if r["iteration"] == 0 or (r["iteration"] + 1) % every == 0]
    window = store.read_table("windows", {"run_id": run_id}).to_pylist()[-1]
    steps = range(window["window_start"], window["window_end"])
    ids = sorted(set(store.read_table("rollouts", {"run_id": run_id}).column("prompt_id")
                     .to_pylist()))
    text = {r["prompt_id"]: r["prompt"] for r in store.read_table("csgs", {"run_id": run_id})
            .to_pylist()}
    prompts = [text[i] for i in ids for _ in range(images)]
    backbone, _ = load_policy(recipe, None)
    sigmas = backbone.sigmas(recipe.sampling.num_steps)
    with torch.no_grad():
        cond = backbone.encode_prompts(prompts)
        x = backbone.initial_noise(list(range(len(prompts))))  # fixed: seeds 0 .. N - 1
        inputs = []
        for k in range(max(steps) + 1):  # the base ODE to each window step
            if k in steps:
                inputs.append((x.clone(), sigmas[k]))
            x = x + (sigmas[k + 1] - sigmas[k]) * backbone.velocity(x, sigmas[k], cond)

        def velocities() -> torch.Tensor:  # [N, window steps x latent dims]
            return torch.cat([backbone.velocity(xk, s, cond).reshape(len(prompts), -1)
                              for xk, s in inputs], dim=1).double()

        base = velocities()
        changes = []
        for r in rows:
            set_lora(backbone, store.get_tensors(r["lora_path"]))
            changes.append(velocities() - base)
    return {"run_id": run_id, "iterations": [r["iteration"] for r in rows],
            **drift_figures(changes),
            "window": [window["window_start"], window["window_end"]], "inputs": len(prompts)}


def drift_figures(changes: list[torch.Tensor]) -> dict:
    """From the velocity changes v_k - v_base at successive checkpoints (any equal shape):
    "rms" per checkpoint, "cos_prev" the cosine of each move (checkpoint to checkpoint) with the
    move before it (None for the first two), "net_over_path" |last - first| / the summed move
    norms, and "random_walk" 1 / sqrt(moves), what independent equal moves give on average."""
    moves = [(b - a).reshape(-1) for a, b in pairwise(changes)]
    cos = [None, None] + [float(torch.nn.functional.cosine_similarity(m, p, dim=0))
                          for p, m in pairwise(moves)]
    path = sum(float(m.norm()) for m in moves)
    net = float((changes[-1] - changes[0]).norm())
    return {"rms": [float(c.pow(2).mean().sqrt()) for c in changes], "cos_prev": cos[:len(changes)],
            "net_over_path": net / path if path > 0 else None,
            "random_walk": 1 / math.sqrt(len(moves)) if moves else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--run", action="append", required=True, help="run id (repeatable)")
    ap.add_argument("--every", type=int, default=10, help="a checkpoint every this many iterations")
    ap.add_argument("--images", type=int, default=4, help="starting noises per prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tasks.store.store import Store

    store, out = Store(args.store), []
    for run in args.run:
        fig = checkpoint_velocity_changes(store, run, args.every, args.images)
        out.append(fig)
        start, end = fig["window"]
        print(f"{run}: window [{start}, {end}), {fig['inputs']} inputs; iteration, RMS v - v_base "
              f"per latent dim, cos(move, previous move)")
        for k, rms, c in zip(fig["iterations"], fig["rms"], fig["cos_prev"]):
            print(f"  {k:4d}  {rms:.4f}  " + ("" if c is None else f"{c:+.3f}"))
        print(f"  net / path {fig['net_over_path']:.3f} (a random walk of these moves: about "
              f"{fig['random_walk']:.3f}; a straight line: 1)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
