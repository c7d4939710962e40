"""In-memory credit probe: one credit rule at a time on the fixed pool, no store and no Prefect.

    .venv/bin/python benchmarks/credit_probe.py --credit map --heatmaps others [--seed 0]
        [--iterations 12] [--lr 1e-3] [--spatial-mix 1.0] [--own-types object,count]

Run it from the repository root. It is the loop of issue 17's in-memory probes, kept so that
their figures can be reproduced: the committed base model with a fresh LoRA (rank 8), the 32 pool
prompts (data/prompts/pool.jsonl) cycled 8 at a time, 16 samples a prompt with one starting noise
per group, 10 steps, CFG 4, a Flow-SDE window [0, 3) at noise 0.7, the exact verifier, pooled atom
advantages gated by parents (global weight 0, clip 5), and `policy_update` with 2 inner epochs x 2
optimizer steps (AdamW, no warm-up). Credits (`--credit`):
- scalar: Flow-GRPO's group z-score of the mean atom score, all-dims ratio, clip 1e-3;
- const: the sample's mean atom credit as a constant map (per-position ratio, clip 0.032);
- map: the pixel map (`pixel_advantage_map`, mass-normalised) through `--heatmaps` own (each
  sample's own, the CAST paper's) or others (`group_heatmaps(..., "group_others")`); atom types
  outside `--own-types` get a uniform heatmap instead (default: every type keeps its heatmap).
Every `--every` iterations it prints the probe: the pool x 4 images with fixed noise (seeds
10_000_000 + i, the same for every arm, seed and checkpoint), mean atom score and strict accuracy;
after each iteration the rollouts' mean score and the last optimizer step's policy KL (nats per
sample and window step). The figures of the "Why CAST fell" table (docs/history.md) are these
lines at 1536 samples (12 iterations), seeds 0-2, one torch thread per process.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cast_core.advantage import atom_advantages, atom_reward, gate_by_parents, scalar_advantages
from cast_core.backbones.shapes import ShapesBackbone
from cast_core.csg.geneval import graph_from_geneval
from cast_core.lora import add_lora
from cast_core.lr_schedule import linear_warmup_lr
from cast_core.pixel_map import atom_mean_credit, group_heatmaps, pixel_advantage_map, pool_to_grid
from cast_core.policy import PolicyConfig, policy_update
from cast_core.rollout import RolloutSpec, rollout
from cast_core.sampling import sample_ode
from cast_core.shapes.verifier import verify
from cast_core.window import SdeWindow

ROOT = Path(__file__).resolve().parents[1]
BASE, POOL = ROOT / "data/base/shapes-base", ROOT / "data/prompts/pool.jsonl"
PROBE_SEED = 10_000_000
STEPS, CFG, NOISE = 10, 4.0, 0.7


def parents(graph) -> torch.Tensor:
    """[A, A] bool: atom i has atom j as a direct parent."""
    atoms = graph.atoms()
    ids = [a.id for a in atoms]
    out = torch.zeros(len(atoms), len(atoms), dtype=torch.bool)
    for i, a in enumerate(atoms):
        for p in a.parents:
            out[i, ids.index(p)] = True
    return out


def credit(args, results, graphs, b: int, g: int) -> tuple[torch.Tensor, float]:
    """(advantages: [N] scalar or [N, H, W] map, mean rollout score) of one iteration's samples."""
    a_max = max(len(gr.atoms()) for gr in graphs)
    hh, ww = results[0].heatmaps.shape[-2:]
    scores = torch.zeros(b, g, a_max, dtype=torch.float64)
    heat = torch.ones(b, g, a_max, hh, ww)
    mask = torch.zeros(b, a_max, dtype=torch.bool)
    par = torch.zeros(b, a_max, a_max, dtype=torch.bool)
    keep = None if args.own_types is None else set(args.own_types.split(","))
    for bi in range(b):
        atoms = graphs[bi * g].atoms()
        n = len(atoms)
        mask[bi, :n] = True
        par[bi, :n, :n] = parents(graphs[bi * g])
        for gi in range(g):
            r = results[bi * g + gi]
            scores[bi, gi, :n] = torch.from_numpy(r.scores.astype("float64"))
            for ai, atom in enumerate(atoms):
                if keep is None or atom.type in keep:
                    heat[bi, gi, ai] = torch.from_numpy(r.heatmaps[ai])
    only = getattr(args, "reward_types", None)  # a reward of some atom types alone
    if only:
        kinds = set(only.split(","))
        typed = torch.zeros_like(mask)
        for bi in range(b):
            for ai, atom in enumerate(graphs[bi * g].atoms()):
                typed[bi, ai] = atom.type in kinds
        if not typed.any():
            raise SystemExit(f"no atom of type(s) {only} in these prompts")
        has = typed.any(dim=-1)  # [B]; a prompt without such atoms gets reward 0 (no credit)
        safe = torch.where(has[:, None], typed, mask)
        rewards = torch.where(has[:, None], atom_reward(scores, safe, "mean"), 0.0)  # [B, G]
    else:
        rewards = atom_reward(scores, mask, "mean")  # [B, G]
    if args.credit == "scalar":
        adv = scalar_advantages(rewards, args.adv_std).advantages
        return adv.reshape(-1).float(), float(rewards.mean())
    adv = gate_by_parents(atom_advantages(scores, mask, 1e-4, "pooled").advantages, scores, par)
    flat_a, flat_m = adv.reshape(b * g, a_max).float(), mask.repeat_interleave(g, 0)
    if args.credit == "const":
        c = atom_mean_credit(flat_a, flat_m, 5.0)  # [N]
        return c[:, None, None].expand(-1, hh, ww).contiguous(), float(rewards.mean())
    source = "own" if args.heatmaps == "own" else "group_others"
    h = group_heatmaps(heat, source).reshape(b * g, a_max, hh, ww)
    norm = getattr(args, "heatmap_norm", "mass")
    m = pixel_advantage_map(flat_a, h, flat_m, 0.0, 5.0, norm, args.spatial_mix).map
    return m, float(rewards.mean())


def on_grid(adv: torch.Tensor, ro) -> torch.Tensor:
    """A map [N, H, W] pooled onto the rollout's log-prob grid (the tile grid with block noise);
    scalar advantages [N] as they are."""
    if adv.dim() == 1:
        return adv
    return pool_to_grid(adv, *ro.log_probs.shape[-2:])


def load_pool(path: str) -> tuple[list[dict], list]:
    """(GenEval-format records, their scene graphs) of a prompt file."""
    pool = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return pool, [graph_from_geneval(r) for r in pool]


def make_probe(backbone, pool, graphs, args, name: str, per_iteration: int):
    """probe(k): score the pool x args.probe_images with fixed noise (seeds PROBE_SEED + i) after
    iteration k (-1: before training), print a line and append a row to args.out if set."""
    prompts = [r["prompt"] for r in pool for _ in range(args.probe_images)]
    probe_graphs = [gr for gr in graphs for _ in range(args.probe_images)]
    seeds = [PROBE_SEED + i for i in range(len(prompts))]
    start = time.time()

    def probe(k: int) -> None:
        with torch.no_grad():
            x = sample_ode(backbone, prompts, seeds, getattr(args, "steps", STEPS),
                           getattr(args, "cfg", CFG))
            res = verify(backbone.decode(x), probe_graphs)
        mean = sum(float(r.scores.mean()) for r in res) / len(res)
        strict = sum(float((r.scores > 0.5).all()) for r in res) / len(res)
        samples, wall = (k + 1) * per_iteration, time.time() - start
        print(f"{name} it {k} samples {samples} probe {mean:.4f} strict {strict:.3f} "
              f"wall {wall:.0f}", flush=True)
        if args.out:
            row = {"name": name, "iteration": k, "samples": samples, "probe": mean,
                   "strict": strict, "wall_s": wall, "args": vars(args)}
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    return probe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--credit", choices=("scalar", "const", "map"), default="map")
    ap.add_argument("--heatmaps", choices=("own", "others"), default="others")
    ap.add_argument("--own-types", default=None,
                    help="comma list of atom types that keep their heatmap (others uniform)")
    ap.add_argument("--spatial-mix", type=float, default=1.0)
    ap.add_argument("--heatmap-norm", choices=("mass", "peak"), default="mass")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--cfg", type=float, default=CFG,
                    help="guidance scale of the rollouts, the policy trained and the probe")
    ap.add_argument("--every", type=int, default=4, help="probe every N iterations")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps-per-epoch", type=int, default=2)
    ap.add_argument("--inner-epochs", type=int, default=2)
    ap.add_argument("--kl-beta", type=float, default=0.0,
                    help="KL to the base model, PolicyConfig.kl_beta (all-dims mean convention)")
    ap.add_argument("--warmup", type=int, default=0, help="linear lr warm-up, optimizer steps")
    ap.add_argument("--noise", type=float, default=NOISE, help="SDE noise level")
    ap.add_argument("--noise-block", type=int, default=1,
                    help="SDE noise constant on b x b tiles (cast_core.sde; 1 = isotropic)")
    ap.add_argument("--sde-kind", choices=("flow_sde", "cps"), default="flow_sde")
    ap.add_argument("--window", default="0,3", help="SDE window start,end (steps)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts an iteration (B)")
    ap.add_argument("--group", type=int, default=16, help="samples a prompt (G)")
    ap.add_argument("--adv-std", choices=("group", "global_std"), default="group",
                    help="scalar credit: z-score by each group's std or by the batch's")
    ap.add_argument("--pool", default=str(POOL), help="GenEval-format prompt file to cycle")
    ap.add_argument("--probe-images", type=int, default=4, help="probe images a prompt")
    ap.add_argument("--clip-range", type=float, default=None,
                    help="ratio clip (default 1e-3 scalar, 0.032 per position)")
    ap.add_argument("--name", default=None, help="label of the printed lines")
    ap.add_argument("--out", default=None, help="append one JSON line per probe to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    b, g = args.prompts, args.group
    name = args.name or (f"{args.credit}" + (f"-{args.heatmaps}" if args.credit == "map" else "")
                         + f"-lr{args.lr}" + (f"-cfg{args.cfg}" if args.cfg != CFG else "")
                         + f"-s{args.seed}")

    backbone = ShapesBackbone.from_pretrained(str(BASE)).eval()
    torch.manual_seed(args.seed)
    params = add_lora(backbone, 8, 8.0)
    pool, graphs = load_pool(args.pool)
    w0, w1 = (int(v) for v in args.window.split(","))
    spec = RolloutSpec(STEPS, args.cfg, args.noise, args.sde_kind, SdeWindow(w0, w1),
                       noise_block=args.noise_block)
    kind = "scalar" if args.credit == "scalar" else "spatial"
    clip = args.clip_range or (1e-3 if kind == "scalar" else 0.032)
    config = PolicyConfig(kind, clip, kl_beta=args.kl_beta,
                          inner_epochs=args.inner_epochs, micro_batch=64,
                          steps_per_epoch=args.steps_per_epoch)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0)
    probe = make_probe(backbone, pool, graphs, args, name, b * g)
    taken = [0]  # optimizer steps so far (for the warm-up)

    probe(-1)
    for k in range(args.iterations):
        idx = [(k * b + j) % len(pool) for j in range(b)]
        prompts = [pool[i]["prompt"] for i in idx for _ in range(g)]
        batch_graphs = [graphs[i] for i in idx for _ in range(g)]
        seeds = [args.seed * 10**7 + k * 10**4 + i for i in range(b * g)]
        shared = [seeds[(i // g) * g] for i in range(b * g)]  # one starting noise per group
        ro = rollout(backbone, prompts, seeds, spec, noise_seeds=shared)
        results = verify(backbone.decode(ro.x0), batch_graphs)
        adv, train_score = credit(args, results, batch_graphs, b, g)
        adv = on_grid(adv, ro)
        steps = policy_update(
            backbone, opt, prompts, ro, spec, adv, config, shuffle_seed=k,
            lr_for_step=lambda j: linear_warmup_lr(args.lr, args.warmup, taken[0] + j))
        taken[0] += sum(not s.skipped for s in steps)
        last = steps[-1]
        ref = "" if last.ref_kl_nats is None else f" ref_kl_nats {last.ref_kl_nats:.3f}"
        print(f"{name} it {k} train {train_score:.4f} clip {last.clip_fraction:.3f} "
              f"policy_kl_nats {last.policy_kl_nats:.3f}{ref}", flush=True)
        if (k + 1) % args.every == 0:
            probe(k)


if __name__ == "__main__":
    main()
