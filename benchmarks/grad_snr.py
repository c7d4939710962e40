"""Signal-to-noise of the policy-gradient estimators: the mean cosine between independent
estimates of the same gradient.

    .venv/bin/python benchmarks/grad_snr.py --credit scalar [--window 0,3] [--antithetic]
        [--batches 6] [--prompts 8] [--group 16] [--seed 0] [--out FILE]

Run it from the repository root. Each of `--batches` batches is one iteration's worth of samples
of the committed base model (fresh LoRA, as in benchmarks/credit_probe.py): the first `--prompts`
pool prompts x `--group` samples, one starting noise per group, the SDE window `--window`, and
the credit of `credit_probe.credit` (scalar: Flow-GRPO's group z-score; const / map: CAST's atom
credit as a constant map or through the group's other heatmaps). Batches differ only in their
seeds (starting noise and SDE noise), so each batch's LoRA gradient of the update's loss at
ratio 1 (`policy_update` with one pass, one step and an lr of 0; no clipping of the norm; at the
fresh LoRA, B = 0, so only the B matrices have a gradient, as at a run's first step) is an
independent estimate of one expected gradient g. For two such estimates the cosine is about
|g|^2 / (|g|^2 + s^2 / n) (n samples a batch, s^2 the per-sample variance), so its mean over all
pairs of batches is a direct figure of the estimator's signal-to-noise ratio at this batch size:
0 is pure noise, 1 noise-free. Printed: the mean pairwise cosine with its standard error over
pairs (pairs share batches, so the SE is a rough guide), the implied per-sample SNR
|g|^2 / s^2 = cos / (n (1 - cos)), and the seconds per batch.

--objective nft measures the forward-process loss's gradient instead (`nft_gradient`).

--antithetic makes every second sample of a group the mirror of the one before (same SDE seed,
noise sign -1; `rollout(..., noise_signs=...)`): each pair shares its start and has opposite
window noise, which cancels the even part of the reward in the noise from the estimator.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from itertools import combinations
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from credit_probe import BASE, CFG, NOISE, POOL, STEPS, credit, on_grid

from cast_core.advantage import scalar_advantages
from cast_core.backbones.shapes import ShapesBackbone
from cast_core.csg.geneval import graph_from_geneval
from cast_core.lora import add_lora
from cast_core.nft import adaptive_weight, forward_noised, group_centred, nft_loss, optimality
from cast_core.policy import PolicyConfig, policy_update
from cast_core.rollout import RolloutSpec, rollout
from cast_core.sampling import encode_conditioning, sample_ode
from cast_core.shapes.verifier import verify
from cast_core.window import SdeWindow

SCORES: list[float] = []  # each SDE batch's mean atom score, for the printed line
SPREADS: list[float] = []  # each SDE batch's mean within-group std of the mean atom score


def batch_gradient(backbone, params, pool, graphs, args, spec, config, m: int) -> torch.Tensor:
    """The flattened LoRA gradient of batch m's loss at ratio 1."""
    b, g = args.prompts, args.group
    prompts = [pool[i]["prompt"] for i in range(b) for _ in range(g)]
    batch_graphs = [graphs[i] for i in range(b) for _ in range(g)]
    base = args.seed * 10**7 + (m + 1) * 10**5
    seeds = [base + i for i in range(b * g)]
    signs = None
    if args.antithetic:
        seeds = [base + i - (i % 2) for i in range(b * g)]  # pairs share the SDE seed
        signs = [1.0 if i % 2 == 0 else -1.0 for i in range(b * g)]
    start = args.seed * 10**7 if args.same_starts else base  # --same-starts: one set for all
    shared = [start + 50_000 + i // g for i in range(b * g)]  # one starting noise per group
    ro = rollout(backbone, prompts, seeds, spec, noise_seeds=shared, noise_signs=signs)
    images = backbone.decode(ro.x0)  # [N, 3, H, W] in [0, 1]
    if args.reward == "red":  # the positive control: a dense reward, linear in the image
        rewards = (images[:, 0] - images[:, 1:].mean(dim=1)).mean(dim=(-2, -1)).view(b, g)
        adv = scalar_advantages(rewards.double()).advantages.reshape(-1).float()
    else:
        results = verify(images, batch_graphs)
        adv = credit(args, results, batch_graphs, b, g)[0]
        rewards = torch.tensor([float(r.scores.mean()) for r in results]).view(b, g)
    adv = on_grid(adv, ro)
    SCORES.append(float(rewards.mean()))
    SPREADS.append(float(rewards.std(dim=1).mean()))
    opt = torch.optim.SGD(params, lr=0.0)
    policy_update(backbone, opt, prompts, ro, spec, adv, config)
    return torch.cat([p.grad.reshape(-1) for p in params]).double()


def nft_gradient(backbone, params, pool, graphs, args, m: int) -> torch.Tensor:
    """The flattened LoRA gradient of batch m's forward-process loss (`cast_core.nft`) at the
    sampling policy: ODE samples with a fresh starting noise each, r from the credit
    (`optimality`, a_max 2; a map stays at pixel resolution here, where nft_probe pools it to
    the token grid), one (t, eps) per sample with t ~ U(0.02, 0.98), beta 1, the
    adaptive weight, the velocity guided at the sampler's scale."""
    b, g = args.prompts, args.group
    prompts = [pool[i]["prompt"] for i in range(b) for _ in range(g)]
    batch_graphs = [graphs[i] for i in range(b) for _ in range(g)]
    seeds = [args.seed * 10**7 + (m + 1) * 10**5 + i for i in range(b * g)]
    with torch.no_grad():
        x0 = sample_ode(backbone, prompts, seeds, STEPS, CFG)
    results = verify(backbone.decode(x0), batch_graphs)
    adv, _ = credit(args, results, batch_graphs, b, g)  # [N] or [N, H, W]
    if args.center and adv.dim() == 3:  # zero-sum over each group at every position
        adv = group_centred(adv, g)
    r = optimality(adv, 2.0)
    gen = torch.Generator().manual_seed(args.seed * 7919 + m)
    t = 0.02 + 0.96 * torch.rand(len(prompts), generator=gen)
    eps = torch.randn(x0.shape, generator=gen)
    noised = forward_noised(x0, t, eps)
    cond, uncond = encode_conditioning(backbone, prompts, CFG)
    for p in params:
        p.grad = None
    for lo in range(0, len(prompts), 64):
        sl = slice(lo, lo + 64)
        with torch.no_grad():
            v_old = backbone.velocity(noised.x_t[sl], t[sl], cond[sl], CFG, uncond[sl])
        v_theta = backbone.velocity(noised.x_t[sl], t[sl], cond[sl], CFG, uncond[sl])
        target = noised.target[sl]
        out = nft_loss(v_theta, v_old, target, r[sl], 1.0, adaptive_weight(v_old, target))
        (out.loss * x0[sl].shape[0] / len(prompts)).backward()
    return torch.cat([p.grad.reshape(-1) for p in params]).double()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--credit", choices=("scalar", "const", "map"), default="scalar")
    ap.add_argument("--objective", choices=("sde", "nft"), default="sde",
                    help="sde: the clipped SDE objective; nft: the forward-process loss")
    ap.add_argument("--window", default="0,3")
    ap.add_argument("--noise", type=float, default=NOISE)
    ap.add_argument("--noise-block", type=int, default=1,
                    help="SDE noise constant on b x b tiles (cast_core.sde; 1 = isotropic)")
    ap.add_argument("--adv-std", choices=("group", "global_std"), default="group",
                    help="scalar credit: z-score by each group's std or by the batch's")
    ap.add_argument("--same-starts", action="store_true",
                    help="every batch draws the same starting noises (only the SDE noise "
                         "differs): the estimator's consistency given the states")
    ap.add_argument("--reward", choices=("atoms", "red"), default="atoms",
                    help="atoms: the verifier's mean atom score; red: mean red minus the other "
                         "channels (a dense reward, the positive control; scalar credit only)")
    ap.add_argument("--reward-types", default=None,
                    help="comma list of atom types (object, count, attribute, relation): the "
                         "reward is the mean score of those atoms alone (scalar credit)")
    ap.add_argument("--antithetic", action="store_true")
    ap.add_argument("--center", action="store_true",
                    help="nft with map credit: subtract each group's mean map at every position")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--spatial-mix", type=float, default=1.0)
    ap.add_argument("--heatmap-norm", choices=("mass", "peak"), default="mass")
    ap.add_argument("--pool", default=str(POOL), help="GenEval-format prompt file (first --prompts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.antithetic and args.group % 2:
        raise SystemExit("--antithetic needs an even --group (mirrored pairs)")
    args.heatmaps, args.own_types = "others", None
    torch.set_num_threads(args.threads)
    backbone = ShapesBackbone.from_pretrained(str(BASE)).eval()
    torch.manual_seed(args.seed)
    params = add_lora(backbone, 8, 8.0)
    pool = [json.loads(line) for line in Path(args.pool).read_text().splitlines() if line.strip()]
    graphs = [graph_from_geneval(r) for r in pool]
    w0, w1 = (int(v) for v in args.window.split(","))
    spec = RolloutSpec(STEPS, CFG, args.noise, "flow_sde", SdeWindow(w0, w1),
                       noise_block=args.noise_block)
    if args.reward == "red" and args.credit != "scalar":
        raise SystemExit("--reward red has no atoms: use it with --credit scalar")
    kind = "scalar" if args.credit == "scalar" else "spatial"
    config = PolicyConfig(kind, 1e-3 if kind == "scalar" else 0.032, micro_batch=64,
                          max_grad_norm=1e12)
    start, grads = time.time(), []
    for m in range(args.batches):
        if args.objective == "nft":
            grads.append(nft_gradient(backbone, params, pool, graphs, args, m))
        else:
            grads.append(batch_gradient(backbone, params, pool, graphs, args, spec, config, m))
    per_batch = (time.time() - start) / args.batches
    cos = torch.tensor([float(torch.nn.functional.cosine_similarity(a, b, dim=0))
                        for a, b in combinations(grads, 2)])
    n = args.prompts * args.group
    mean, se = float(cos.mean()), float(cos.std() / len(cos) ** 0.5)
    snr = mean / (n * (1 - mean)) if mean < 1 else float("inf")
    name = (f"{args.credit} window {args.window} noise {args.noise}"
            f"{' antithetic' if args.antithetic else ''}"
            f"{f' block {args.noise_block}' if args.noise_block > 1 else ''}"
            f"{' global std' if args.adv_std == 'global_std' else ''}"
            f"{' same starts' if args.same_starts else ''}"
            f"{' reward red' if args.reward == 'red' else ''}"
            f"{f' reward {args.reward_types} atoms' if args.reward_types else ''}")
    if args.credit == "map" and (args.heatmap_norm, args.spatial_mix) != ("mass", 1.0):
        name += f" ({args.heatmap_norm} norm, mix {args.spatial_mix})"
    if args.objective == "nft":
        name = f"nft {args.credit}{' centred' if args.center else ''} (ODE samples)"
    name = f"{Path(args.pool).stem} x{args.prompts}: {name}"
    print(f"{name}: mean pairwise cosine {mean:.4f} +- {se:.4f} (SE, {len(cos)} pairs of "
          f"{args.batches} batches of {n}); per-sample SNR {snr:.2e}; {per_batch:.1f} s a batch"
          + (f"; training samples' mean reward {sum(SCORES) / len(SCORES):.3f}, "
             f"within-group std {sum(SPREADS) / len(SPREADS):.3f}" if SCORES else ""),
          flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"name": name, "cosine": mean, "se": se, "snr": snr,
                                "pairs": len(cos), "batch": n, "seconds_per_batch": per_batch,
                                "sample_score": sum(SCORES) / len(SCORES) if SCORES else None,
                                "group_std": sum(SPREADS) / len(SPREADS) if SPREADS else None,
                                "args": vars(args)}) + "\n")


if __name__ == "__main__":
    main()
