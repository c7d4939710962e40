"""Clipped policy objectives on SDE window steps: spatially weighted (CAST) and scalar (Flow-GRPO).

Variant: PPO-style clipped surrogate (as in Flow-GRPO), applied per latent position for CAST.

Inputs are per-position Gaussian log-probs [N, K, h, w] (or [N, h, w]) in fp32: the mean over
channels at each position of one SDE step's log-density (see sde.py). For one position,
    r = exp(l_new - l_old),    loss = -mean_{n, k, u} min(r M, clip(r, 1 - eps, 1 + eps) M),
with M the advantage map (broadcast over steps when it has no K axis). The scalar baseline uses
Flow-GRPO's all-dims ratio r = exp(mean_u l_new - mean_u l_old) per sample and step, with one
advantage A per sample. `sample_ratio_spatial_loss` puts CAST's map inside that one ratio: the
sample's ratio as every position's value, the map weighting each position's gradient.

Diagnostics: ratio_k3 is Schulman's k3, mean((r - 1) - log r), of the loss's own ratio r: per
position (spatial) or of the all-dims mean (scalar). It is not a KL per sample: log r there is a
mean over C (spatial) or over D = C h w dimensions (scalar), so for the scalar ratio it is about
KL / D^2, KL the per-sample KL below (a move of 0.06 nats per sample and step reads as 6e-9 on
the shapes world's 3 x 32 x 32 latents). The KL in nats is `summed_kl`. clip_fraction is the
fraction of positions with |r - 1| > eps; adv_mass = mean |M| over the positions used. The
per-step versions ratio_mean_per_step and clip_fraction_per_step [K] take the same weighted means
over every axis but the window-step axis (dim 1 of [N, K, h, w] inputs; one entry for [N, h, w]);
with every position used they average to ratio_mean and clip_fraction.

Clip range for per-position ratios (our choice; neither paper specifies one). Flow-GRPO clips its
all-dims ratio with a tiny range (about 1e-4 to 2e-4). log r for that ratio is a mean over
D = C h w dimensions, a per-position log-ratio a mean over only C, so with independent dimensions
its spread is sqrt(D / C) = sqrt(h w) times larger. `per_position_clip_range` scales the scalar
range by sqrt(h w): 1e-4 on a 32 x 32 grid gives 3.2e-3, on a 64 x 64 grid 6.4e-3. It is a
starting point to tune by watching clip_fraction (aim for a few percent to ~20%).

KL to the reference: one SDE step is a diagonal Gaussian with a shared std, so
KL(N(mu_p, s^2) || N(mu_r, s^2)) = (mu_p - mu_r)^2 / (2 s^2) per dimension. `gaussian_step_kl`
uses this form directly (the general `gaussian_kl` reduces to it but subtracts 1/2 - 1/2, which
loses precision when the policy is close to the reference). `gaussian_step_kl` returns the mean
over channels at each position; the trainer's loss term is beta times its mean over positions,
samples and steps (Flow-GRPO's convention: the all-dims mean KL), and it reports the KL summed
over all D = C h w dims of a sample and step (= D times that mean) as nats.

KL to the rollout's policy in nats (`summed_kl`). Samples x come from the old (rollout) policy;
the summed log-ratio of one sample and window step is L = log new(x) - log old(x) =
C sum_u (l_new_u - l_old_u), the per-position log-probs l being means over C channels. With
r = exp(L), KL(old || new) = E_old[-L], and Schulman's k3, (r - 1) - log r = exp(L) - 1 - L, is
an unbiased (E_old[r] = 1), non-negative estimate of it, of lower variance than k1 = -L for
small moves (for large ones exp(L) makes it heavy-tailed: compare with k1). For
two Gaussians sharing a std s, with d = (mu_new - mu_old) / s and x = mu_old + s z:
L = -|d|^2 / 2 + d.z, so E[-L] = |d|^2 / 2 (the closed-form KL) and Var(L) = |d|^2 = 2 KL.
exp(L) is taken in float64 with L clamped above at `MAX_LOG_RATIO` (only a large positive L can
overflow; a large negative L, the common sign of a big move, is kept exactly).
"""

from dataclasses import dataclass

import torch
from torch import Tensor

MAX_LOG_RATIO = 50.0  # exp(50) ~ 5e21: finite in float64, and no real estimate gets near it


@dataclass(frozen=True)
class PolicyLossStats:
    """Detached tensors: clip_fraction, ratio_mean, ratio_std (population), ratio_k3 (k3 of the
    loss's own ratio, in float64, not a KL per sample: see the module docstring), adv_mass (mean |advantage|
    over the positions or samples used), all 0-d; ratio_mean_per_step and clip_fraction_per_step
    [K] in window-step order ([1] for inputs without a step axis)."""

    clip_fraction: Tensor
    ratio_mean: Tensor
    ratio_std: Tensor
    ratio_k3: Tensor
    adv_mass: Tensor
    ratio_mean_per_step: Tensor
    clip_fraction_per_step: Tensor


@dataclass(frozen=True)
class PolicyLoss:
    """loss: 0-d tensor with grad; stats: detached diagnostics."""

    loss: Tensor
    stats: PolicyLossStats


def per_position_clip_range(scalar_clip: float, num_positions: int) -> float:
    """Clip range for per-position ratios: scalar_clip * sqrt(num_positions), num_positions = h*w."""
    if scalar_clip <= 0 or num_positions < 1:
        raise ValueError(
            f"need scalar_clip > 0 and num_positions >= 1: got {scalar_clip}, {num_positions}"
        )
    return scalar_clip * num_positions**0.5


def _clipped_objective(ratio: Tensor, adv: Tensor, clip_range: float) -> Tensor:
    """Elementwise min(r A, clip(r, 1 - eps, 1 + eps) A); ratio and adv broadcast."""
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}; see per_position_clip_range")
    clipped = ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    return torch.minimum(ratio * adv, clipped * adv)


def _stats(
    log_ratio: Tensor, adv: Tensor, weight: Tensor, clip_range: float, has_steps: bool
) -> PolicyLossStats:
    """Weighted-mean diagnostics; log_ratio, adv, weight broadcast to one shape, whose dim 1 is
    the window-step axis K when has_steps."""
    with torch.no_grad():
        log_ratio, adv, weight = torch.broadcast_tensors(log_ratio.detach(), adv.detach(), weight)
        total = weight.sum().clamp_min(1.0)
        other = [d for d in range(log_ratio.dim()) if d != 1]

        def mean(x: Tensor) -> Tensor:
            return (x * weight).sum() / total

        def per_step(x: Tensor) -> Tensor:
            if not has_steps:
                return mean(x).reshape(1)  # [1]
            return (x * weight).sum(dim=other) / weight.sum(dim=other).clamp_min(1.0)  # [K]

        r = log_ratio.exp()
        r_mean = mean(r)
        clipped = ((r - 1.0).abs() > clip_range).to(r.dtype)
        return PolicyLossStats(
            clip_fraction=mean(clipped),
            ratio_mean=r_mean,
            ratio_std=mean((r - r_mean) ** 2).sqrt(),
            ratio_k3=mean(torch.expm1(log_ratio.double()) - log_ratio.double()),  # float64: >= 0
            adv_mass=mean(adv.abs()),
            ratio_mean_per_step=per_step(r),
            clip_fraction_per_step=per_step(clipped),
        )


def _align_map(adv_map: Tensor, log_prob: Tensor) -> Tensor:
    """Give adv_map ([N, h, w], [N, 1, h, w] or [N, K, h, w]) the dims of log_prob."""
    if log_prob.dim() == 4 and adv_map.dim() == 3:
        adv_map = adv_map[:, None]  # [N, 1, h, w]
    try:
        shape = torch.broadcast_shapes(adv_map.shape, log_prob.shape)
    except RuntimeError:
        shape = None
    if shape != log_prob.shape:
        raise ValueError(
            f"adv_map {tuple(adv_map.shape)} must broadcast to log-probs {tuple(log_prob.shape)}; "
            "pool the map onto the latent grid (advantage.pool_to_grid) first"
        )
    return adv_map


def spatial_clipped_loss(
    log_prob_new: Tensor,
    log_prob_old: Tensor,
    adv_map: Tensor,
    clip_range: float,
    position_mask: Tensor | None = None,
) -> PolicyLoss:
    """CAST loss. log_prob_* [N, K, h, w] or [N, h, w]; adv_map broadcastable to them;
    position_mask (optional, bool, broadcastable) selects the positions averaged over."""
    if log_prob_new.shape != log_prob_old.shape or log_prob_new.dim() not in (3, 4):
        raise ValueError(
            f"log-probs must share a shape [N, K, h, w] or [N, h, w]: got "
            f"{tuple(log_prob_new.shape)} and {tuple(log_prob_old.shape)}"
        )
    adv = _align_map(adv_map, log_prob_new).detach()
    weight = torch.ones((), dtype=log_prob_new.dtype, device=log_prob_new.device)
    if position_mask is not None:
        weight = _align_map(position_mask, log_prob_new).to(log_prob_new.dtype)
    log_ratio = log_prob_new - log_prob_old.detach()  # [N, K, h, w]
    objective = _clipped_objective(log_ratio.exp(), adv, clip_range)  # [N, K, h, w]
    weight_full = weight.expand_as(objective)
    loss = -(objective * weight_full).sum() / weight_full.sum().clamp_min(1.0)
    stats = _stats(log_ratio, adv, weight_full, clip_range, log_prob_new.dim() == 4)
    return PolicyLoss(loss, stats)


def sample_ratio_spatial_loss(
    log_prob_new: Tensor, log_prob_old: Tensor, adv_map: Tensor, clip_range: float
) -> PolicyLoss:
    """CAST's map inside one all-dims ratio per sample and step. log_prob_* [N, K, h, w] or
    [N, h, w]; adv_map broadcastable to them. Each position's term has the value of the sample's
    all-dims ratio r = exp(mean_u (l_new - l_old)) (Flow-GRPO's) and the gradient r grad l_new_u:
        r~_u = exp(d_u - sg(d_u) + sg(mean_v d_v)),  d = l_new - l_old,
        loss = -mean_{n, k, u} min(r~_u M_u, clip(r~_u, 1 - eps, 1 + eps) M_u),
    so the clip decision is the sample's (as Flow-GRPO's) and a constant map M = A gives exactly
    `scalar_clipped_loss` in value and gradient. Why not per-position ratios: sum_u r_u M_u =
    sum_u M_u (1 + d_u + d_u^2 / 2 + ...) carries the term M_u d_u^2 / 2 whose gradient, once the
    policy has moved within an iteration (the second and later optimizer steps), pushes every
    position with M_u > 0 further from the rollout policy in whatever direction the first step
    took (the per-position ratio is an arithmetic mean of ratios, above the sample's geometric
    one); with the all-dims ratio that term is M (mean_u d_u)^2 / 2, about D times smaller.
    `clip_range` is the all-dims range (Flow-GRPO's 1e-4 to 1e-3), not the per-position one."""
    if log_prob_new.shape != log_prob_old.shape or log_prob_new.dim() not in (3, 4):
        raise ValueError(
            f"log-probs must share a shape [N, K, h, w] or [N, h, w]: got "
            f"{tuple(log_prob_new.shape)} and {tuple(log_prob_old.shape)}"
        )
    adv = _align_map(adv_map, log_prob_new).detach()
    d = log_prob_new - log_prob_old.detach()  # [N, K, h, w]
    sample = d.mean(dim=(-2, -1), keepdim=True).detach()  # [N, K, 1, 1]
    routed = (d - d.detach() + sample).exp()  # value: the sample's ratio; gradient: per position
    objective = _clipped_objective(routed, adv, clip_range)  # [N, K, h, w]
    weight = torch.ones_like(objective)
    stats = _stats(sample.expand_as(d), adv, weight, clip_range, log_prob_new.dim() == 4)
    return PolicyLoss(-objective.mean(), stats)


def scalar_clipped_loss(
    log_prob_new: Tensor, log_prob_old: Tensor, advantages: Tensor, clip_range: float
) -> PolicyLoss:
    """Flow-GRPO loss. log_prob_* [N, K, h, w] or [N, h, w]; advantages [N]; ratio over all dims."""
    if log_prob_new.shape != log_prob_old.shape or log_prob_new.dim() not in (3, 4):
        raise ValueError(
            f"log-probs must share a shape [N, K, h, w] or [N, h, w]: got "
            f"{tuple(log_prob_new.shape)} and {tuple(log_prob_old.shape)}"
        )
    if advantages.shape != log_prob_new.shape[:1]:
        raise ValueError(
            f"advantages must be [N] = {log_prob_new.shape[0]}, got {tuple(advantages.shape)}"
        )
    log_ratio = (log_prob_new - log_prob_old.detach()).mean(dim=(-2, -1))  # [N, K] or [N]
    adv = advantages.detach().reshape(-1, *([1] * (log_ratio.dim() - 1)))  # [N, 1] or [N]
    objective = _clipped_objective(log_ratio.exp(), adv, clip_range)  # [N, K] or [N]
    weight = torch.ones_like(objective)
    stats = _stats(log_ratio, adv, weight, clip_range, log_prob_new.dim() == 4)
    return PolicyLoss(-objective.mean(), stats)


def gaussian_kl(mu_p: Tensor, std_p: Tensor, mu_q: Tensor, std_q: Tensor) -> Tensor:
    """Elementwise KL(N(mu_p, std_p^2) || N(mu_q, std_q^2)) =
    log(std_q / std_p) + (std_p^2 + (mu_p - mu_q)^2) / (2 std_q^2) - 1/2 (inputs broadcast)."""
    if (torch.as_tensor(std_p) <= 0).any() or (torch.as_tensor(std_q) <= 0).any():
        raise ValueError("stds must be > 0 for a Gaussian KL; the ODE step (noise 0) has no KL")
    var_q = std_q**2
    return torch.log(std_q / std_p) + (std_p**2 + (mu_p - mu_q) ** 2) / (2 * var_q) - 0.5


def gaussian_step_kl(mean_policy: Tensor, mean_ref: Tensor, std: Tensor | float) -> Tensor:
    """KL between two SDE steps sharing a std: (mu_p - mu_r)^2 / (2 std^2), mean over channels.

    mean_policy, mean_ref [N, C, h, w]; std scalar or broadcastable (e.g. [N, 1, 1, 1]).
    Returns [N, h, w].
    """
    if mean_policy.shape != mean_ref.shape or mean_policy.dim() != 4:
        raise ValueError(
            f"means must share a shape [N, C, h, w]: got {tuple(mean_policy.shape)}, {tuple(mean_ref.shape)}"
        )
    std = torch.as_tensor(std, dtype=mean_policy.dtype, device=mean_policy.device)
    if (std <= 0).any():
        raise ValueError("std must be > 0 for a Gaussian KL; the ODE step (noise 0) has no KL")
    kl = (mean_policy - mean_ref) ** 2 / (2 * std**2)  # [N, C, h, w]
    return kl.mean(dim=1)  # [N, h, w]


@dataclass(frozen=True)
class SummedKl:
    """KL(old || new) in nats per sample and window step, summed over all C h w dims; 0-d float64
    means over samples and steps. k3: mean(exp(L) - 1 - L), unbiased and >= 0; k1: mean(-L),
    unbiased, may be < 0 (a cross-check). k3_per_step: k3's mean over samples at each window step
    ([K] float64; [1] for log-probs without a step axis), whose mean is k3."""

    k3: Tensor
    k1: Tensor
    k3_per_step: Tensor


def summed_log_ratio(log_prob_new: Tensor, log_prob_old: Tensor, channels: int) -> Tensor:
    """L = C sum_u (l_new_u - l_old_u) in float64: log-probs [N, K, h, w] -> [N, K] (or
    [N, h, w] -> [N]), per-position log-probs being means over `channels` (C) channels."""
    if log_prob_new.shape != log_prob_old.shape or log_prob_new.dim() not in (3, 4):
        raise ValueError(
            f"log-probs must share a shape [N, K, h, w] or [N, h, w]: got "
            f"{tuple(log_prob_new.shape)} and {tuple(log_prob_old.shape)}"
        )
    diff = log_prob_new.detach().double() - log_prob_old.detach().double()  # [N, K, h, w]
    return channels * diff.sum(dim=(-2, -1))  # [N, K]


def summed_kl(log_prob_new: Tensor, log_prob_old: Tensor, channels: int) -> SummedKl:
    """KL(old || new) in nats per sample and step from samples of the old policy (k3 and k1 of
    the summed log-ratio, see the module docstring). log_prob_* [N, K, h, w] or [N, h, w]."""
    log_ratio = summed_log_ratio(log_prob_new, log_prob_old, channels)  # [N, K] or [N]
    clamped = log_ratio.clamp(max=MAX_LOG_RATIO)
    k3 = clamped.exp() - 1.0 - clamped
    per_step = (k3 if k3.dim() == 2 else k3[:, None]).mean(dim=0)  # [K]
    return SummedKl(k3=k3.mean(), k1=(-log_ratio).mean(), k3_per_step=per_step)
