"""How far an update moved the sampler: KL(rollout policy || current policy) in nats per sample
and window step (`update_kl_nats`: the mean over the window and each step's own), replayed on the
stored window steps after training, and the velocity change it implies (`velocity_change`: RMS per
action dim, which reads alike across window steps and noise levels where the KL does not). The
per-step ``policy_kl_nats`` of `cast_core.policy.policy_update` is measured before each optimizer
step, so it cannot show the last (or only) step's move; this can. The KL-targeted lr
(`cast_core.lr_schedule.kl_targeted_lr`) steers on either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from cast_core.data_parallel import SOLO, Shard, gather_rows, held_rows, local_rows
from cast_core.loss import summed_kl
from cast_core.rollout import Rollout, RolloutSpec, replay_steps
from cast_core.sampling import encode_conditioning
from cast_core.sde import VelocityGain, velocity_gain


@dataclass(frozen=True)
class UpdateKl:
    """KL(rollout policy || current policy) in nats per sample, summed over the C h w dims:
    `nats` the mean over the window steps, `per_step` each window step's (K values in window
    order, whose mean is `nats`). A later step has a smaller noise std, so the same change of the
    velocity moves it by more nats; `velocity` is the change of the velocity these KLs imply."""

    nats: float
    per_step: tuple[float, ...]
    velocity: VelocityChange


@dataclass(frozen=True)
class VelocityChange:
    """The change of the velocity an update's KL implies, as an RMS per action dim (latent dim;
    tile-mean dim with block noise): `rms` over the window, sqrt of the mean of the steps'
    squares, `per_step` each window step's. The same velocity change moves a later step by more
    nats (`cast_core.sde.VelocityGain`), so unlike the KL these read alike across window steps,
    windows, noise levels and SDE kinds."""

    rms: float
    per_step: tuple[float, ...]


def velocity_change(per_step_kl: tuple[float, ...], gains: list[VelocityGain],
                    dims: int) -> VelocityChange:
    """RMS velocity change per action dim at each window step from the KL it moved (nats per
    sample, summed over `dims` action dims): the Gaussian's std does not depend on the velocity,
    so KL_k = slope_k^2 |dv_k|^2 / (2 std_k^2) and rms_k = sqrt(KL_k / (nats_per_sq_k dims))
    (a KL estimate below 0, possible for k3 only by rounding, counts as 0)."""
    if len(per_step_kl) != len(gains) or not gains or dims < 1:
        raise ValueError(f"need one gain per window step's KL and dims >= 1: got {len(gains)} "
                         f"gains, {len(per_step_kl)} KLs, dims {dims}")
    per_step = tuple(math.sqrt(max(kl, 0.0) / (g.nats_per_sq * dims))
                     for kl, g in zip(per_step_kl, gains))
    return VelocityChange(math.sqrt(sum(r * r for r in per_step) / len(per_step)), per_step)


@torch.no_grad()
def update_kl_nats(
    backbone,
    prompts: list[str],
    rollout: Rollout,
    spec: RolloutSpec,
    max_samples: int = 64,
    micro_batch: int = 16,
    *,
    shard: Shard = SOLO,
    held: Tensor | None = None,
    split: list[Tensor] | None = None,
) -> UpdateKl:
    """KL(rollout policy || current policy) in nats per sample and window step, summed over the
    C h w dims (k3 of the summed log-ratio, ``loss.summed_kl``), on the first ``max_samples``
    samples (prompts: one per sample; the stored log-probs are the rollout policy's).
    Called after an iteration's training it says how far the iteration moved the policy, which
    the per-step ``policy_kl_nats`` cannot show for the last (or only) optimizer step.
    Data parallel (a `shard` of a group): `split` gives every rank's samples (a partition of the
    N, e.g. their parts of the first inner epoch), `held` the samples whose rows `rollout` holds
    (sorted, containing this rank's split); each rank replays its split's samples among the
    first max_samples and the log-probs are gathered in sample order, so every rank returns the
    single process's figure (to the float rounding of other micro-batches)."""
    total = len(prompts)
    n = min(max_samples, total)
    if n < 1 or micro_batch < 1:
        raise ValueError(f"need max_samples >= 1 and micro_batch >= 1: got {max_samples}, "
                         f"{micro_batch}")
    if shard.world > 1 and split is None:
        raise ValueError("a data-parallel update_kl_nats needs every rank's `split`")
    parts = [torch.arange(n)] if shard.world == 1 else [s[s < n] for s in split]
    mine = parts[shard.rank if shard.world > 1 else 0]
    rows = held_rows(local_rows(held, total), mine)
    channels = rollout.latents.shape[2]
    new = [rollout.log_probs[:0]]
    for lo in range(0, len(mine), micro_batch):
        idx = mine[lo:lo + micro_batch].tolist()
        cond, uncond = encode_conditioning(backbone, [prompts[i] for i in idx],
                                           spec.guidance_scale)
        new.append(replay_steps(backbone, cond, uncond,
                                rollout.select(rows[lo:lo + micro_batch].tolist()),
                                spec).log_probs)
    new_lp, old_lp = torch.cat(new), rollout.log_probs[rows.to(rollout.log_probs.device)]
    if shard.world > 1:
        sizes = [len(p) for p in parts]
        order = torch.argsort(torch.cat(parts)).to(new_lp.device)  # rank order -> sample order
        new_lp, old_lp = gather_rows(new_lp, sizes)[order], gather_rows(old_lp, sizes)[order]
    kl = summed_kl(new_lp, old_lp, channels)
    per_step = tuple(float(x) for x in kl.k3_per_step)
    return UpdateKl(float(kl.k3), per_step, window_velocity_change(per_step, rollout, spec))


def window_velocity_change(per_step_kl: tuple[float, ...], rollout: Rollout,
                           spec: RolloutSpec) -> VelocityChange:
    """`velocity_change` of the KLs moved at the rollout's window steps (its t, t_next) under the
    spec's sampler; the action dims are C x the log-prob grid (the tile grid with block noise)."""
    gains = [velocity_gain(float(t), float(t_next), spec.noise_level, spec.sde_kind,
                           noise_block=spec.noise_block)
             for t, t_next in zip(rollout.t.tolist(), rollout.t_next.tolist())]
    dims = rollout.latents.shape[2] * rollout.log_probs.shape[-2] * rollout.log_probs.shape[-1]
    return velocity_change(per_step_kl, gains, dims)
