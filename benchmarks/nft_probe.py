"""In-memory probe of the forward-process (DiffusionNFT-style) objective on the fixed pool.

    .venv/bin/python benchmarks/nft_probe.py [--credit scalar|map] [--seed 0] [--iterations 12]
        [--lr 1e-3] [--beta 1.0] [--inner-epochs 2] [--steps-per-epoch 2] [--train-cfg 4.0]

Run it from the repository root. Same world, pool, LoRA, probe and budget as
benchmarks/credit_probe.py (8 pool prompts x 16 samples an iteration, 10 steps, CFG 4), so the
probe figures of the two scripts compare directly. What differs is the whole update:

- Rollouts: the deterministic ODE sampler (no SDE window), a fresh starting noise per sample
  (with the ODE a shared noise would give G identical images); only the clean images are kept.
- Optimality: r = 0.5 + 0.5 clip(A / a_max, -1, 1) in [0, 1], A the group z-score of the mean atom
  score (Flow-GRPO's advantage); with --credit map, A is CAST's pixel map of the atom advantages
  (pooled atom spread, gating, the group's other heatmaps, mass-normalised) pooled to the token
  grid and upsampled, so r is a map: one optimality per position. --center subtracts each
  group's mean map at every position: the map's credits lean positive (parent gating zeroes the
  negative child credit of a missing object; +0.23 of a 0.71 SD on the one-prompt set, +0.09 of
  0.43 on the pool), and for this loss a positive mean of 2 r - 1 is a pull towards the
  policy's own samples (self-distillation), a direction that every batch shares.
- Loss: `cast_core.nft.nft_loss` (the maths and its sources are in that module): per sample, t ~ U(t_min, 1 - t_min), eps ~ N(0, I), x_t = (1 - t) x0 + t eps, target
  v = eps - x0 (diffusers' convention), v_old the sampling policy's velocity at (x_t, t) (no grad),
  v_theta the current one; the implicit positive and negative policies
  v+ = (1 - beta) v_old + beta v_theta, v- = (1 + beta) v_old - beta v_theta;
  loss(u) = r(u) |v+(u) - v(u)|^2 + (1 - r(u)) |v-(u) - v(u)|^2, mean over channels and positions,
  divided by the sample's detached mean |v_old - v|^2 (adaptive weight: each sample's loss
  counts in units of the old policy's own error at that t).
  At theta = theta_old, d loss / d v_theta = 2 beta (2 r - 1) (v_old - v): positive samples pull
  the velocity towards their own target, negative ones push it away, and r = 1/2 does nothing.
- Policy update: the sampling policy is the LoRA at the start of the iteration (old-policy
  decay 0: the old policy is reset to the current one after every iteration), inner epochs x
  optimizer steps per epoch over the samples, each with a fresh (t, eps) per sample and pass.
  --train-cfg sets the velocity being trained: the guided one (default, the scale the sampler
  and the probe use) or, at 1.0, the conditional branch alone (CFG-free training).
The probe is the same as credit_probe's (pool x 4 images, fixed noise 10_000_000 + i).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from credit_probe import BASE, CFG, POOL, STEPS, credit, load_pool, make_probe

from cast_core.backbones.shapes import ShapesBackbone
from cast_core.lora import add_lora
from cast_core.lr_schedule import linear_warmup_lr
from cast_core.nft import adaptive_weight, forward_noised, group_centred, nft_loss, optimality
from cast_core.sampling import encode_conditioning, sample_ode
from cast_core.shapes.render import render, sample_scene
from cast_core.shapes.verifier import verify


def iteration_optimality(args, results, graphs, b: int, g: int, grid: tuple[int, int]):
    """(r: [N] or [N, H, W] in [0, 1], mean score) of one iteration's samples: the credit of
    `credit_probe.credit` (a map pooled to the token grid, optionally centred per group)."""
    adv, score = credit(args, results, graphs, b, g)  # [N] or [N, H, W]
    if args.top_k:  # rejection-sampling fine-tuning: the group's best k pulled, the rest ignored
        if adv.dim() != 1:
            raise SystemExit("--top-k takes --credit scalar")
        rank = adv.view(b, g).argsort(dim=1, descending=True).argsort(dim=1)  # 0 = best
        return torch.where(rank < args.top_k, 1.0, 0.5).reshape(-1), score
    if adv.dim() == 3:
        hh, ww = adv.shape[-2:]
        pooled = F.adaptive_avg_pool2d(adv[:, None], grid)  # token grid
        adv = F.interpolate(pooled, size=(hh, ww), mode="nearest")[:, 0]
        if args.center:  # zero-sum over each group at every position
            adv = group_centred(adv, g)
    return optimality(adv, args.a_max), score


def velocity(backbone, x_t, t, cond, uncond, scale: float):
    """v(x_t, t) [n, C, H, W], t [n]; guided when scale != 1."""
    return backbone.velocity(x_t, t, cond, scale, uncond if scale != 1.0 else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--credit", choices=("scalar", "map"), default="scalar")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--beta", type=float, default=1.0)
    ap.add_argument("--a-max", type=float, default=2.0, help="|A| at which r reaches 0 or 1")
    ap.add_argument("--t-min", type=float, default=0.02)
    ap.add_argument("--inner-epochs", type=int, default=2)
    ap.add_argument("--steps-per-epoch", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--cfg", type=float, default=CFG,
                    help="guidance scale of the rollouts and of the probe (1: CFG-free policy)")
    ap.add_argument("--train-cfg", type=float, default=None,
                    help="guidance scale of the velocity trained (default: --cfg, the sampler's)")
    ap.add_argument("--steps", type=int, default=STEPS, help="ODE steps of rollouts and probe")
    ap.add_argument("--spatial-mix", type=float, default=1.0)
    ap.add_argument("--center", action="store_true",
                    help="map credit: subtract each group's mean map at every position")
    ap.add_argument("--top-k", type=int, default=0,
                    help="r = 1 for each group's k best samples, 1/2 (no gradient at the old "
                         "policy) for the rest: rejection-sampling fine-tuning (RAFT, Dong et al. "
                         "2023) through the same loss; 0: the advantage mapping")
    ap.add_argument("--renders", action="store_true",
                    help="control: train on exact renders of the prompts' records (a fresh scene "
                         "a sample) instead of the policy's samples; with --top-k G this is "
                         "supervised fine-tuning on the world's ground truth")
    ap.add_argument("--no-adaptive", action="store_true", help="no per-sample loss weight")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pool", default=str(POOL), help="GenEval-format prompt file to cycle")
    ap.add_argument("--probe-images", type=int, default=4, help="probe images a prompt")
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.heatmaps, args.own_types, args.adv_std = "others", None, "group"  # credit()'s settings
    if args.train_cfg is None:
        args.train_cfg = args.cfg
    torch.set_num_threads(args.threads)
    b, g = args.prompts, args.group
    name = args.name or (f"nft-{args.credit}-lr{args.lr}-b{args.beta}"  # arm, then "-s<seed>"
                         + (f"-top{args.top_k}" if args.top_k else "")
                         + (f"-cfg{args.cfg}-train{args.train_cfg}" if args.cfg != CFG
                            or args.train_cfg != CFG else "")
                         + (f"-steps{args.steps}" if args.steps != STEPS else "")
                         + ("-renders" if args.renders else "") + f"-s{args.seed}")

    backbone = ShapesBackbone.from_pretrained(str(BASE)).eval()
    torch.manual_seed(args.seed)
    params = add_lora(backbone, 8, 8.0)
    grid = backbone.token_grid
    pool, graphs = load_pool(args.pool)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0)
    probe, taken = make_probe(backbone, pool, graphs, args, name, b * g), 0

    probe(-1)
    for k in range(args.iterations):
        idx = [(k * b + j) % len(pool) for j in range(b)]
        prompts = [pool[i]["prompt"] for i in idx for _ in range(g)]
        batch_graphs = [graphs[i] for i in idx for _ in range(g)]
        seeds = [args.seed * 10**7 + k * 10**4 + i for i in range(b * g)]
        with torch.no_grad():
            x0 = sample_ode(backbone, prompts, seeds, args.steps, args.cfg)
        if args.renders:  # the control: exact renders of each prompt's record instead
            rng = np.random.default_rng([args.seed, k])
            imgs = np.stack([render(sample_scene(pool[i], rng)).image for i in idx for _ in range(g)])
            x0 = torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        results = verify(backbone.decode(x0), batch_graphs)
        r, train_score = iteration_optimality(args, results, batch_graphs, b, g, grid)
        n = x0.shape[0]
        gen = torch.Generator().manual_seed(args.seed * 7919 + k)
        # one (t, eps) per sample and pass, and the sampling policy's velocity there
        draws = []
        cond_all, uncond_all = encode_conditioning(backbone, prompts, args.train_cfg)
        for _ in range(args.inner_epochs):
            t = args.t_min + (1 - 2 * args.t_min) * torch.rand(n, generator=gen)
            eps = torch.randn(x0.shape, generator=gen)
            noised = forward_noised(x0, t, eps)
            x_t = noised.x_t
            with torch.no_grad():
                v_old = torch.cat([
                    velocity(backbone, x_t[lo:lo + 64], t[lo:lo + 64], cond_all[lo:lo + 64],
                             None if uncond_all is None else uncond_all[lo:lo + 64],
                             args.train_cfg) for lo in range(0, n, 64)])
            draws.append((t, x_t, noised.target, v_old))
        losses, pos_share = [], float((r > 0.5).float().mean())
        for epoch, (t, x_t, target, v_old) in enumerate(draws):
            order = torch.randperm(n, generator=gen)
            for step_idx in torch.tensor_split(order, args.steps_per_epoch):
                for group in opt.param_groups:
                    group["lr"] = linear_warmup_lr(args.lr, args.warmup, taken)
                opt.zero_grad(set_to_none=True)
                total = 0.0
                for mb in step_idx.split(args.micro_batch):
                    v_th = velocity(backbone, x_t[mb], t[mb], cond_all[mb],
                                    None if uncond_all is None else uncond_all[mb],
                                    args.train_cfg)
                    vo, tg = v_old[mb], target[mb]
                    wt = None if args.no_adaptive else adaptive_weight(vo, tg)
                    out = nft_loss(v_th, vo, tg, r[mb], args.beta, wt)
                    loss = out.loss * len(mb) / len(step_idx)
                    loss.backward()
                    total += float(loss.detach())
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                taken += 1
                losses.append(total)
        print(f"{name} it {k} train {train_score:.4f} loss {sum(losses) / len(losses):.4f} "
              f"positive_share {pos_share:.3f}", flush=True)
        if (k + 1) % args.every == 0:
            probe(k)


if __name__ == "__main__":
    main()
