"""The forward-process (NFT) policy update: optimizer steps of ``nft.nft_loss`` on clean samples.

Variant: DiffusionNFT's update (Zheng et al. 2025, arXiv 2509.16117), written from the paper's
equations, with CAST's per-position optimality (ours). For N clean samples x0 [N, C, h, w] of the
policy that sampled them (the old policy), their prompts and advantages A ([N], or a map
[N, h, w] on the latent grid):

1. Credit. A map is pooled to the backbone's token grid (``token_grid``, when it has one) and
   spread back to the latent grid, so one optimality covers one token; with ``centre`` it is
   group-centred (``nft.group_centred``: zero-sum over each group of ``group_size`` consecutive
   samples at every position; a credit that leans positive is otherwise a pull towards the
   policy's own samples); r = ``nft.optimality``(A, a_max) in [0, 1]. With per-step maps
   [N, K, h, w] (ReCAST's weights, given with the K steps' times ``step_times``) each draw's
   credit is the map of the step nearest its t (``nft.credit_at_t``), so r is made per epoch.
2. Draws. For inner epoch e, every sample gets t ~ U(t_min, t_max) and eps ~ N(0, I) from a CPU
   generator seeded with ``rollout.step_seed(seed, e)`` (one draw for all N, so no draw depends
   on the micro-batching), x_t = (1 - t) x0 + t eps and the target v = eps - x0
   (``nft.forward_noised``).
3. The old velocity v_old(x_t, t) of every draw of every epoch is computed before the first
   optimizer step, under the weights the call starts with (no gradient): the old policy is the
   policy that sampled, reset to the trained one at the next iteration (DiffusionNFT also allows
   a slower, averaged old policy; not implemented).
4. Steps. Each epoch visits the samples in a seeded random order, split into ``steps_per_epoch``
   equal mini-batches; each is one optimizer step whose gradient accumulates over micro-batches
   of at most ``micro_batch`` samples (the gradient of the mini-batch's mean loss), with the
   per-sample ``nft.adaptive_weight`` when ``adaptive_weight``, the gradient norm clipped to
   ``max_grad_norm``, and a non-finite loss or gradient norm skipping the step (recorded).

The velocity trained is the one the sampler uses (``guidance_scale``; the unconditional branch
with the empty prompt when it is not 1), or with guidance_scale 1 the conditional one alone
(DiffusionNFT's CFG-free training). Diagnostics per step: the loss, the share of positions (or
samples) with r > 1/2, the mean per-sample loss in ``t_buckets`` equal bins of [t_min, t_max]
(None where a bin is empty), the gradient norm.

Data parallel (``shard``, ``cast_core.data_parallel``, as ``cast_core.policy``): every rank
draws the same t and eps for all N samples and computes r from all N advantages, but holds x0
only for its samples (``held``: ``Shard.rows`` of ``nft_step_indices``) and computes the old
velocity only there; it backpropagates its contiguous part of each step's samples (as
``arrange_steps`` orders them) with the same n / m weights, the ranks' gradients and losses are
summed, and the per-sample losses gathered in sample order for the t-bins, so every rank takes the
single process's step (to float rounding).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from cast_core.checks import require_count, require_positive
from cast_core.data_parallel import (
    SOLO,
    Shard,
    all_reduce_grads,
    arrange_steps,
    gather_rows,
    held_rows,
    local_rows,
    sum_over_ranks,
)
from cast_core.nft import (
    adaptive_weight,
    credit_at_t,
    forward_noised,
    group_centred,
    nft_loss,
    optimality,
)
from cast_core.rollout import step_seed
from cast_core.sampling import encode_conditioning


@dataclass(frozen=True)
class NftConfig:
    """Settings of ``nft_update`` (module docstring). beta: the implicit policies' step;
    t_min < t_max in (0, 1): the uniform t range; a_max: the |A| at which r is 0 or 1;
    group_size: G, for ``centre``."""

    beta: float = 1.0
    t_min: float = 0.02
    t_max: float = 0.98
    a_max: float = 2.0
    adaptive_weight: bool = True
    centre: bool = True
    group_size: int = 1
    inner_epochs: int = 1
    steps_per_epoch: int = 1
    micro_batch: int = 8
    max_grad_norm: float = 1.0
    t_buckets: int = 4

    def __post_init__(self) -> None:
        for name in ("beta", "a_max", "max_grad_norm"):
            require_positive("NftConfig", name, getattr(self, name))
        if not 0.0 < self.t_min < self.t_max < 1.0:
            raise ValueError(f"NftConfig needs 0 < t_min < t_max < 1 (t = 1 is noise); got "
                             f"t_min={self.t_min!r}, t_max={self.t_max!r}")
        for name in ("group_size", "inner_epochs", "steps_per_epoch", "micro_batch", "t_buckets"):
            require_count("NftConfig", name, getattr(self, name))


@dataclass(frozen=True)
class NftStep:
    """One optimizer step. loss, grad_norm: None when skipped; positive_share: share of r > 1/2
    over the step's samples (and positions); loss_by_t: mean per-sample loss per t bin (None:
    empty bin, or skipped); lr: the lr the step ran with."""

    epoch: int
    samples: int
    loss: float | None
    grad_norm: float | None
    positive_share: float
    loss_by_t: tuple[float | None, ...]
    lr: float
    skipped: bool
    skip_reason: str | None


@dataclass(frozen=True)
class _Draw:
    """One epoch's forward-process draws: t [N] of every sample; x_t, target, v_old [n, C, h, w]
    of the n samples held (all N on one process), in `local_rows` order."""

    t: Tensor
    x_t: Tensor
    target: Tensor
    v_old: Tensor


def nft_optimality(advantages: Tensor, shape: tuple[int, ...], config: NftConfig,
                   token_grid: tuple[int, int] | None) -> Tensor:
    """r in [0, 1]: [N] from scalar advantages [N], or [N, h, w] from a map [N, h, w] on the
    latent grid of `shape` [N, C, h, w] (pooled to `token_grid` and spread back, centred per
    group with config.centre)."""
    n, _, h, w = shape
    if advantages.dim() == 1:
        if advantages.shape[0] != n:
            raise ValueError(f"need one advantage per sample ({n}); got {tuple(advantages.shape)}")
        adv = advantages
    else:
        if tuple(advantages.shape) != (n, h, w):
            raise ValueError(f"an advantage map must be on the latent grid [N, h, w] = "
                             f"{(n, h, w)}; got {tuple(advantages.shape)} (with block noise the "
                             "maps live on the tile grid: use sampling.noise_block = 1 with nft)")
        adv = advantages
        if token_grid is not None and tuple(token_grid) != (h, w):
            pooled = F.adaptive_avg_pool2d(adv[:, None], tuple(token_grid))
            adv = F.interpolate(pooled, size=(h, w), mode="nearest")[:, 0]
    if config.centre:
        adv = group_centred(adv, config.group_size)
    return optimality(adv.float(), config.a_max)


def _velocity(backbone, x_t: Tensor, t: Tensor, prompts: list[str], scale: float) -> Tensor:
    """v(x_t, t) [n, C, h, w] of n samples with per-sample times t [n], guided at `scale`."""
    cond, uncond = encode_conditioning(backbone, prompts, scale)
    return backbone.velocity(x_t, t, cond, scale, uncond)


def _pick(prompts: list[str], idx: Tensor) -> list[str]:
    return [prompts[i] for i in idx.tolist()]


def _draws(backbone, x0: Tensor, held: Tensor, prompts: list[str], config: NftConfig,
           scale: float, seed: int) -> list[_Draw]:
    """Every epoch's draws (for all N = len(prompts) samples, so none depends on which rank
    draws) and the old policy's velocity at the samples `held` (the rows of x0; no gradient)."""
    n, device = len(prompts), x0.device
    out = []
    for epoch in range(config.inner_epochs):
        gen = torch.Generator().manual_seed(step_seed(seed, epoch))
        t = config.t_min + (config.t_max - config.t_min) * torch.rand(n, generator=gen)
        eps = torch.randn((n, *x0.shape[1:]), generator=gen)
        t, eps = t.to(device), eps[held].to(device, x0.dtype)
        noised = forward_noised(x0, t[held.to(device)], eps)
        with torch.no_grad():
            v_old = torch.cat([noised.x_t[:0].float()] + [
                _velocity(backbone, noised.x_t[rows.to(device)], t[held[rows].to(device)],
                          _pick(prompts, held[rows]), scale).float()
                for rows in torch.arange(len(held)).split(config.micro_batch) if len(rows)])
        out.append(_Draw(t, noised.x_t, noised.target.float(), v_old))
    return out


def _bucket_means(t: Tensor, losses: Tensor, config: NftConfig) -> tuple[float | None, ...]:
    """Mean loss per equal bin of [t_min, t_max]: t, losses [m]."""
    width = (config.t_max - config.t_min) / config.t_buckets
    bins = ((t - config.t_min) / width).floor().clamp(0, config.t_buckets - 1).long()
    return tuple(float(losses[bins == k].mean()) if bool((bins == k).any()) else None
                 for k in range(config.t_buckets))


def nft_update(
    backbone,
    optimizer: torch.optim.Optimizer,
    prompts: list[str],
    x0: Tensor,
    advantages: Tensor,
    config: NftConfig,
    guidance_scale: float,
    seed: int,
    lr_for_step: Callable[[int], float] | None = None,
    on_step: Callable[[NftStep], None] | None = None,
    shard: Shard = SOLO,
    held: Tensor | None = None,
    step_times: Tensor | None = None,
) -> list[NftStep]:
    """inner_epochs x steps_per_epoch optimizer steps of the NFT loss (module docstring).

    prompts: N; x0: [N, C, h, w] clean latents of the sampling policy; advantages: [N], a map
    [N, h, w] on the latent grid, or per-step maps [N, K, h, w] with step_times [K] (strictly
    decreasing: the schedule times of the K steps). lr_for_step(j) sets every group's lr before
    the step that follows j steps taken (skipped ones not counted). Returns one NftStep per
    optimizer step.
    With a `shard` of a data-parallel group every rank passes the prompts and advantages of all
    N samples and x0 of the samples `held` only (sorted; ``Shard.rows(nft_step_indices(...))``;
    None: all N), and gets the same weights and records.
    """
    n = len(prompts)
    if x0.shape[0] != (n if held is None else len(held)):
        raise ValueError(f"need one prompt per sample: got {len(prompts)} for {x0.shape[0]} "
                         f"samples" + ("" if held is None else f" holding {len(held)}"))
    if config.steps_per_epoch > n:
        raise ValueError(f"NftConfig.steps_per_epoch ({config.steps_per_epoch}) exceeds the {n} "
                         f"samples; set it <= {n}")
    if config.centre and n % config.group_size:
        raise ValueError(f"{n} samples do not split into groups of {config.group_size}; set "
                         "NftConfig.group_size to the rollout's G")
    if (advantages.dim() == 4) != (step_times is not None):
        raise ValueError(f"per-step maps [N, K, h, w] come with their steps' times and only they "
                         f"do: got advantages {tuple(advantages.shape)} and step_times "
                         f"{None if step_times is None else tuple(step_times.shape)}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    local = local_rows(held, n)
    draws = _draws(backbone, x0, torch.arange(n) if held is None else held.cpu(), prompts,
                   config, guidance_scale, seed)
    rs = _optimalities(advantages.to(x0.device), draws, step_times, (n, *x0.shape[1:]), config,
                       getattr(backbone, "token_grid", None))
    out, taken = [], 0
    steps = arrange_steps(nft_step_indices(n, config, seed), shard.world)
    for j, idx in enumerate(steps):
        epoch, idx = j // config.steps_per_epoch, idx.to(x0.device)
        lr = lr_for_step(taken) if lr_for_step is not None else optimizer.param_groups[0]["lr"]
        for group in optimizer.param_groups:
            group["lr"] = lr
        step = _step(backbone, optimizer, params, draws[epoch], rs[epoch], idx, prompts, config,
                     guidance_scale, epoch, lr, shard, local)
        taken += 0 if step.skipped else 1
        out.append(step)
        if on_step is not None:
            on_step(step)
    return out


def _optimalities(advantages: Tensor, draws: list[_Draw], step_times: Tensor | None,
                   shape: tuple[int, ...], config: NftConfig,
                   token_grid: tuple[int, int] | None) -> list[Tensor]:
    """r of each epoch's draws: the same r for every epoch, or with per-step maps (step_times
    given) r of each draw's nearest-step map."""
    if step_times is None:
        return [nft_optimality(advantages, shape, config, token_grid)] * len(draws)
    return [nft_optimality(credit_at_t(advantages, d.t, step_times), shape, config, token_grid)
            for d in draws]


def nft_step_indices(n: int, config: NftConfig, seed: int) -> list[Tensor]:
    """Every optimizer step's sample indices, in the order `nft_update` takes them: inner epoch
    e's step s is entry e * steps_per_epoch + s, the s-th of steps_per_epoch near-equal parts of
    the epoch's seeded permutation of the n samples."""
    steps: list[Tensor] = []
    for epoch in range(config.inner_epochs):
        gen = torch.Generator().manual_seed(step_seed(seed, 10_000 + epoch))
        steps.extend(torch.tensor_split(torch.randperm(n, generator=gen), config.steps_per_epoch))
    return steps


def _step(backbone, optimizer, params, draw: _Draw, r: Tensor, idx: Tensor, prompts: list[str],
          config: NftConfig, scale: float, epoch: int, lr: float, shard: Shard,
          local: Tensor) -> NftStep:
    """One optimizer step on the samples `idx`, accumulated over micro-batches (of this rank's
    part of it, gradients and losses summed over the ranks); local: `local_rows` of the draw."""
    optimizer.zero_grad(set_to_none=True)
    total, per_sample = 0.0, [draw.v_old.new_zeros(0)]
    for mb in shard.part(idx).split(config.micro_batch):
        if not len(mb):  # an empty part splits into one empty micro-batch
            continue
        rows = held_rows(local, mb).to(draw.x_t.device)
        v_theta = _velocity(backbone, draw.x_t[rows], draw.t[mb], _pick(prompts, mb),
                            scale).float()
        v_old, target = draw.v_old[rows], draw.target[rows]
        weight = adaptive_weight(v_old, target) if config.adaptive_weight else None
        result = nft_loss(v_theta, v_old, target, r[mb], config.beta, weight)
        (result.loss * (len(mb) / len(idx))).backward()
        total += float(result.loss.detach()) * len(mb) / len(idx)
        w = torch.ones_like(result.per_sample) if weight is None else weight
        per_sample.append(w * result.per_sample)
    all_reduce_grads(params, shard)
    total = sum_over_ranks(total, shard, draw.x_t.device)
    losses = gather_rows(torch.cat(per_sample).detach(), shard.sizes(len(idx)))  # idx order
    share = float((r[idx] > 0.5).float().mean())
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm))
    bad = None if math.isfinite(total) else "non-finite loss"
    bad = bad or (None if math.isfinite(grad_norm) else "non-finite gradient norm")
    if bad is not None:
        optimizer.zero_grad(set_to_none=True)
        return NftStep(epoch, len(idx), None, None, share, (None,) * config.t_buckets, lr, True,
                       bad)
    optimizer.step()
    by_t = _bucket_means(draw.t[idx].float().cpu(), losses.cpu(), config)
    return NftStep(epoch, len(idx), total, grad_norm, share, by_t, lr, False, None)
