"""One RL update of LoRA parameters on stored window steps: clipped objective, KL, guards.

Variant: Flow-GRPO's update (PPO-style clipped surrogate on SDE steps, optional KL to the frozen
base model) with either CAST's per-position advantage maps ("spatial") or Flow-GRPO's scalar
advantages ("scalar"); the objectives themselves live in ``cast_core.loss``. Both objectives go
through exactly the same loop below (same accumulation, same optimizer steps).

The LoRA adapter this trains, and the reference (adapters off) its KL is measured against, are
``cast_core.lora``; the lr schedules a caller passes as ``lr_for_step`` are ``cast_core.lr_schedule``.

Update loop: ``inner_epochs`` passes over the N samples (in order, or shuffled per epoch with
``shuffle_seed``). Each pass splits them into ``steps_per_epoch`` mini-batches of as-equal-as-
possible size (sizes differ by at most one), and each mini-batch is one optimizer step: it is
processed in micro-batches of at most ``micro_batch`` samples, whose gradients accumulate, then
the grad norm is clipped to ``max_grad_norm`` and the optimizer steps once. ``micro_batch`` only
bounds memory: a micro-batch of n of the mini-batch's m samples backpropagates its mean loss
times n / m, and every sample carries the same number of terms (K steps, h w positions), so the
accumulated gradient is exactly the gradient of the mini-batch's mean loss. Within a micro-batch
the K window steps are replayed one at a time and each step's share (its objective / K, plus
kl_beta * its mean KL / K, times the step's ``step_weights`` entry when the config has them) is
backpropagated at once, so activation memory is one step's of one micro-batch, not K's. The
recorded loss and statistics of a step (``UpdateStep``) are recomputed
from the detached log-probs of all its samples and steps, so they are what one micro-batch of the
whole mini-batch would give. ``lr_for_step`` (optional) sets every param group's lr before each
optimizer step from the number of steps this call has taken (skipped ones not counted; the caller
adds its earlier steps, e.g. for a warm-up: ``lr_schedule.linear_warmup_lr``).
Data parallel (``shard``, ``cast_core.data_parallel``): each rank runs the micro-batches of its
contiguous part of every mini-batch (its samples as ``arrange_steps`` orders them, which keeps
a sample on one rank across inner epochs where it can) with the same n / m weights, the ranks'
gradients are summed before the clip, and the stored and replayed log-probs of the parts
gathered before the statistics, so every rank takes the single process's step (to float
rounding) on the mean over all m samples. A rank's rollout need hold only the rows of its parts
(``held``: ``Shard.rows`` of ``step_indices``).

Guards: a step whose loss (so any of its micro-batches' losses) or accumulated grad norm is not
finite gets its grads zeroed and no optimizer step; its ``UpdateStep`` says skipped=True and why.
The first step (weights still those of the rollout for all its micro-batches) must give
ratio_mean = 1; ``first_ratio_ok`` reports |ratio_mean - 1| <= ratio_tol there so the caller can
warn with the figures (rollout and replay disagree: dropout on, different precision or CFG, or
weights changed since the rollout). The model must be in eval mode (no dropout) for ratios to be
meaningful.

KLs, per step, each a mean over its samples and window steps:
- ``policy_kl_nats``: KL(rollout policy || current policy) of one sample and window step in nats,
  summed over all D = C h w dims: Schulman's k3 of the summed log-ratio (``loss.summed_kl``,
  derivation there), with ``policy_kl_k1_nats`` the plain mean of -log ratio as a cross-check.
  It is 0 at the first step and says how far the update has moved the sampler.
- ``ratio_k3``: k3 of the loss's own ratio (per position, or the all-dims mean for "scalar"); not
  a KL per sample (for "scalar" it is about policy_kl_nats / D^2).
- with kl_beta > 0, the exact KL to the reference (adapters off) from the closed form for two
  Gaussians sharing the step's std (``loss.gaussian_step_kl``): ``ref_kl_nats`` summed over the D
  dims (with block noise, of the tile means: D = C h w / b^2 action dims), and
  ``ref_kl_mean_dim`` = ref_kl_nats / D, the all-dims mean of (mu_p - mu_r)^2 /
  (2 std^2). The loss adds kl_beta * ref_kl_mean_dim (Flow-GRPO's convention), so a beta chosen
  against the summed KL is beta_summed * D here. It needs std > 0, so a window containing a
  zero-std step (noise level 0, or the CPS step to t = 0) with kl_beta > 0 raises ValueError. The
  reference forward costs one extra transformer pass per step and is skipped when kl_beta = 0
  (both ref fields are then None).

Departures: Flow-GRPO also accumulates gradients over micro-batches (and window steps) between
optimizer steps; here a micro-batch is a set of samples with all their window steps and the
number of optimizer steps per pass is ``steps_per_epoch``. The update is ours to specify in full
(shuffling, guard, first-step ratio check); the CAST paper's code is not public.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from cast_core.data_parallel import (
    SOLO,
    Shard,
    all_reduce_grads,
    arrange_steps,
    gather_rows,
    held_rows,
    local_rows,
)
from cast_core.lora import reference_mode
from cast_core.loss import (
    PolicyLoss,
    gaussian_step_kl,
    sample_ratio_spatial_loss,
    scalar_clipped_loss,
    spatial_clipped_loss,
    summed_kl,
)
from cast_core.policy_config import AdvantageKind, PolicyConfig, UpdateStep
from cast_core.rollout import Rollout, RolloutSpec, replay_steps
from cast_core.sampling import encode_conditioning
from cast_core.sde import block_mean

__all__ = ["AdvantageKind", "PolicyConfig", "UpdateStep", "policy_update", "step_indices"]

def _check_advantages(advantages: Tensor, n: int, rollout: Rollout, kind: AdvantageKind) -> None:
    _, k, h, w = rollout.log_probs.shape
    wants = [(n, h, w), (n, k, h, w)] if kind == "spatial" else [(n,)]
    if tuple(advantages.shape) not in wants:
        hint = (
            "pool the pixel map onto the latent grid (one map a sample, or one per window step)"
            if kind == "spatial"
            else "one per sample"
        )
        raise ValueError(
            f"{kind} advantages must have shape {' or '.join(map(str, wants))}; got "
            f"{tuple(advantages.shape)}; {hint}"
        )


def _objective(config: PolicyConfig, new: Tensor, old: Tensor, adv: Tensor) -> PolicyLoss:
    if config.advantage == "scalar":
        return scalar_clipped_loss(new, old, adv, config.clip_range)
    if config.map_ratio == "sample":
        return sample_ratio_spatial_loss(new, old, adv, config.clip_range)
    return spatial_clipped_loss(new, old, adv, config.clip_range)


@dataclass(frozen=True)
class _Replayed:
    """A micro-batch's detached replay: log_probs [n, K, h, w]; ref_kl [n, K] (KL to the
    reference summed over the C h w dims, float64) or None when kl_beta = 0."""

    log_probs: Tensor
    ref_kl: Tensor | None


def _micro_batch_backward(
    backbone,
    prompts: list[str],
    steps: Rollout,
    adv: Tensor,
    spec: RolloutSpec,
    config: PolicyConfig,
    share: float,
) -> _Replayed:
    """Backprop share x the mean loss of n samples, step by step (steps: n samples, K steps; adv
    [n, h, w], [n, K, h, w] (one map per window step) or [n])."""
    cond, uncond = encode_conditioning(backbone, prompts, spec.guidance_scale)
    num_k, channels = steps.t.shape[0], steps.latents.shape[2]
    new, ref_kls = [], []
    for k in range(num_k):
        step = steps.select(steps=[k])
        replay = replay_steps(backbone, cond, uncond, step, spec)  # log_probs [n, 1, h, w]
        step_adv = adv[:, k : k + 1] if adv.dim() == 4 else adv  # this step's map
        total = _objective(config, replay.log_probs, step.log_probs, step_adv).loss
        if config.kl_beta > 0:
            with torch.no_grad(), reference_mode(backbone):
                ref = replay_steps(backbone, cond, uncond, step, spec)
            b = spec.noise_block  # the KL of the tile means (the action) at b > 1
            kl = gaussian_step_kl(block_mean(replay.means[:, 0], b),
                                  block_mean(ref.means[:, 0], b), replay.stds[:, 0])
            total = total + config.kl_beta * kl.mean()  # kl [n, h, w]: mean over channels
            ref_kls.append(channels * kl.detach().double().sum(dim=(-2, -1)))  # [n]
        weight = 1.0 if config.step_weights is None else config.step_weights[k]
        (total * (share * weight / num_k)).backward()
        new.append(replay.log_probs.detach())
    ref_kl = torch.stack(ref_kls, dim=1) if ref_kls else None  # [n, K]
    return _Replayed(torch.cat(new, dim=1), ref_kl)


def _gathered(parts: list[_Replayed], old: Tensor, sizes: list[int], config: PolicyConfig
              ) -> _Replayed:
    """Every rank's replays of a step in sample order, from this rank's micro-batches' `parts`
    (none when its part is empty; old [n, K, h, w], its part's, gives the empty shapes)."""
    mine = [p.log_probs for p in parts] or [old[:0]]
    log_probs = gather_rows(torch.cat(mine), sizes)  # [m, K, h, w]
    if config.kl_beta == 0:
        return _Replayed(log_probs, None)
    kls = [p.ref_kl for p in parts] or [old.new_zeros((0, old.shape[1]), dtype=torch.float64)]
    return _Replayed(log_probs, gather_rows(torch.cat(kls), sizes))  # ref_kl [m, K]


def _record(
    parts: list[_Replayed],
    old: Tensor,
    adv: Tensor,
    channels: int,
    config: PolicyConfig,
) -> tuple[Tensor, dict]:
    """(loss, UpdateStep statistics) of one step from its micro-batches' replays (in the order
    of `old` [m, K, h, w] and `adv`)."""
    new = torch.cat([p.log_probs for p in parts])  # [m, K, h, w]
    full = _objective(config, new, old, adv)
    policy_kl = summed_kl(new, old, channels)
    stats = full.stats
    fields = {
        "clip_fraction": float(stats.clip_fraction),
        "ratio_mean": float(stats.ratio_mean),
        "ratio_std": float(stats.ratio_std),
        "ratio_k3": float(stats.ratio_k3),
        "adv_mass": float(stats.adv_mass),
        "policy_kl_nats": float(policy_kl.k3),
        "policy_kl_k1_nats": float(policy_kl.k1),
        "ref_kl_nats": None,
        "ref_kl_mean_dim": None,
        "ratio_mean_per_step": tuple(stats.ratio_mean_per_step.tolist()),
        "clip_fraction_per_step": tuple(stats.clip_fraction_per_step.tolist()),
    }
    loss = full.loss.double()
    weights = None
    if config.step_weights is not None:  # the loss the backward took: each step's share weighted
        weights = torch.tensor(config.step_weights, dtype=torch.float64, device=new.device)
        loss = torch.stack([
            _objective(config, new[:, k:k + 1], old[:, k:k + 1],
                       adv[:, k:k + 1] if adv.dim() == 4 else adv).loss.double()
            for k in range(new.shape[1])]).mul(weights).mean()
    if config.kl_beta > 0:
        ref_kls = torch.cat([p.ref_kl for p in parts])  # [m, K]
        ref_kl = ref_kls.mean()
        num_dims = channels * old.shape[-2] * old.shape[-1]  # D = C h w
        fields |= {"ref_kl_nats": float(ref_kl), "ref_kl_mean_dim": float(ref_kl / num_dims)}
        weighted = ref_kl if weights is None else (ref_kls * weights.to(ref_kls.device)).mean()
        loss = loss + config.kl_beta * weighted / num_dims
    return loss, fields


def _optimizer_step(
    backbone,
    optimizer: torch.optim.Optimizer,
    prompts: list[str],
    rollout: Rollout,
    spec: RolloutSpec,
    advantages: Tensor,
    idx: Tensor,
    config: PolicyConfig,
    epoch: int,
    step: int,
    first: bool,
    shard: Shard,
    local: Tensor,
) -> UpdateStep:
    """Accumulate the gradients of mini-batch `idx` over micro-batches (of this rank's part of
    it, summed over the ranks), clip, and step unless the loss or grad norm is not finite;
    `first`: check the ratio of the update's first step; local: each sample's row in `rollout`
    (``data_parallel.local_rows``)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer.zero_grad(set_to_none=True)
    part = shard.part(idx)
    parts = [
        _micro_batch_backward(
            backbone,
            [prompts[i] for i in mb.tolist()],
            rollout.select(held_rows(local, mb)),
            advantages[mb.to(advantages.device)],
            spec,
            config,
            share=len(mb) / len(idx),
        )
        for mb in part.split(config.micro_batch)
        if len(mb)  # an empty part splits into one empty micro-batch
    ]
    all_reduce_grads(params, shard)
    with torch.no_grad():
        adv = advantages[idx.to(advantages.device)]
        if shard.world > 1:  # the step's stored log-probs from the ranks that hold them
            mine = rollout.log_probs[held_rows(local, part).to(rollout.log_probs.device)]
            old = gather_rows(mine, shard.sizes(len(idx)))
            parts = [_gathered(parts, mine, shard.sizes(len(idx)), config)]
        else:
            old = rollout.log_probs[held_rows(local, idx).to(rollout.log_probs.device)]
        loss, fields = _record(parts, old, adv, rollout.latents.shape[2], config)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
    reason = None
    if not torch.isfinite(loss):
        reason = "non-finite loss"
    elif not torch.isfinite(grad_norm):
        reason = "non-finite grad norm"
    if reason is None:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    ratio_ok = abs(fields["ratio_mean"] - 1.0) <= config.ratio_tol
    return UpdateStep(
        epoch=epoch,
        step=step,
        samples=len(idx),
        lr=float(optimizer.param_groups[0]["lr"]),
        loss=float(loss),
        grad_norm=float(grad_norm),
        skipped=reason is not None,
        skip_reason=reason,
        first_ratio_ok=bool(ratio_ok) if first else None,
        **fields,
    )


def policy_update(
    backbone,
    optimizer: torch.optim.Optimizer,
    prompts: list[str],
    rollout: Rollout,
    spec: RolloutSpec,
    advantages: Tensor,
    config: PolicyConfig,
    shuffle_seed: int | None = None,
    on_step: Callable[[UpdateStep], None] | None = None,
    lr_for_step: Callable[[int], float] | None = None,
    shard: Shard = SOLO,
    held: Tensor | None = None,
) -> list[UpdateStep]:
    """Inner epochs x steps_per_epoch optimizer steps of the clipped objective on the rollout's
    window steps, each accumulated over micro-batches.

    prompts: N; rollout: N samples, K steps; advantages: [N, h, w] (spatial, on the log-prob
    grid), [N, K, h, w] (spatial, one map per window step: ReCAST's step weights) or [N]
    (scalar). lr_for_step(j), when given, sets every param group's lr before the optimizer step
    that follows j steps taken by this call (skipped steps not counted). Returns one UpdateStep
    per optimizer step, in order; `on_step` (e.g. a progress bar) is called with each one.
    With a `shard` of a data-parallel group (``cast_core.data_parallel``) every rank passes the
    same prompts and advantages of all N samples, backpropagates its part of each step and gets
    the same weights and records; its rollout may hold only the rows of the samples `held`
    (sorted; ``Shard.rows(step_indices(...))``; None: all N).
    """
    n = len(prompts)
    rows = rollout.latents.shape[0]
    if rows != (n if held is None else len(held)):
        raise ValueError(f"need one prompt per rollout sample: got {len(prompts)} prompts for "
                         f"{rows} rollout rows" + ("" if held is None else
                                                   f" holding {len(held)} samples"))
    if config.steps_per_epoch > n:
        raise ValueError(
            f"PolicyConfig.steps_per_epoch ({config.steps_per_epoch}) exceeds the {n} samples: "
            f"each optimizer step needs at least one sample; set steps_per_epoch <= {n}"
        )
    _check_advantages(advantages, n, rollout, config.advantage)
    if config.step_weights is not None and len(config.step_weights) != rollout.t.shape[0]:
        raise ValueError(f"PolicyConfig.step_weights has {len(config.step_weights)} weights for "
                         f"the rollout's {rollout.t.shape[0]} window steps; give one per step")
    advantages = advantages.to(rollout.log_probs.device, torch.float32)
    local = local_rows(held, n)
    records: list[UpdateStep] = []
    taken = 0
    steps = arrange_steps(step_indices(n, config, shuffle_seed), shard.world)
    for j, idx in enumerate(steps):
        epoch, step = divmod(j, config.steps_per_epoch)
        if lr_for_step is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr_for_step(taken)
        record = _optimizer_step(
            backbone,
            optimizer,
            prompts,
            rollout,
            spec,
            advantages,
            idx,
            config,
            epoch,
            step,
            first=not records,
            shard=shard,
            local=local,
        )
        records.append(record)
        taken += not record.skipped
        if on_step is not None:
            on_step(record)
    return records


def step_indices(n: int, config: PolicyConfig, shuffle_seed: int | None) -> list[Tensor]:
    """Every optimizer step's sample indices, in the order `policy_update` takes them: inner
    epoch e's step s is entry e * steps_per_epoch + s, the s-th of steps_per_epoch near-equal
    parts of the epoch's order (a seeded permutation of the n samples, or 0..n-1 without a
    seed)."""
    generator = torch.Generator().manual_seed(shuffle_seed) if shuffle_seed is not None else None
    steps: list[Tensor] = []
    for _ in range(config.inner_epochs):
        order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
        steps.extend(torch.tensor_split(order, config.steps_per_epoch))
    return steps
