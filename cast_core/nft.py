"""Forward-process (negative-aware) flow-matching loss, with an optimality per sample or per
position.

Variant: the objective of Zheng et al. 2025 (DiffusionNFT, "Online Diffusion Reinforcement with
Forward Process", arXiv 2509.16117), written here from the paper's equations; the optimality map
(one r per latent position instead of one per sample) is ours: it carries CAST's atom-pixel credit.

Conventions (diffusers, as in ``cast_core.sde``): x_t = (1 - t) x0 + t eps, target velocity
v = eps - x0. For a clean sample x0 of the sampling (old) policy, a time t and a noise eps:

    v+ = (1 - beta) v_old + beta v_theta        (implicit positive policy)
    v- = (1 + beta) v_old - beta v_theta        (implicit negative policy)
    l(u) = r(u) |v+(u) - v(u)|^2 + (1 - r(u)) |v-(u) - v(u)|^2      (mean over channels at u)
    loss = mean over samples of w * mean_u l(u)

with r in [0, 1] the optimality probability (per sample [N] or per position [N, h, w]),
v_old the old policy's velocity at (x_t, t) (no gradient) and w an optional per-sample weight
(detached; e.g. ``adaptive_weight``). Facts the tests check in closed form:
- a constant map r(u) = r equals the per-sample loss with that r;
- r = 1 everywhere is |beta (v_theta - v) + (1 - beta) (v_old - v)|^2, at beta = 1 exactly plain
  flow matching |v_theta - v|^2 towards the samples;
- at theta = theta_old (v_theta = v_old) the gradient in v_theta is 2 beta (2 r - 1) (v_old - v)
  / (C h w) per element: gradient descent moves the velocity towards the sample's target where
  r > 1/2 and away where r < 1/2; r = 1/2 contributes nothing.

``forward_noised`` builds (x_t, v) from clean samples; ``group_centred`` makes a credit zero-sum
over each group (at every position for a map): a positive mean of 2 r - 1 in a group is a pull
towards the policy's own samples (self-distillation), the same direction in every batch, so a
credit that leans positive (CAST's gated atom map does) must be centred before ``optimality``.

``optimality`` maps an advantage A (a group z-score, or CAST's map of atom advantages) to
r = 1/2 + 1/2 clip(A / a_max, -1, 1), the paper's normalised-reward form with a_max the |A| at
which a sample counts as fully positive or negative.

Per-step credit over the forward-noise t (ReCAST's weights on NFT; ours). ReCAST weights each
atom type's share of the map per step of the sampling schedule t_0 > t_1 > ... > t_{S-1} (one map
M_k [N, h, w] per step k). NFT draws a continuous t per sample instead of visiting steps, and the
sampler only ever queries the velocity at the t_k, so a draw at t trains the velocity of the
nearest step: k(t) = argmin_k |t - t_k| (``nearest_steps``; a tie goes to the earlier, noisier
step), and the sample's credit is M_{k(t)} (``credit_at_t``). As k(t) is monotone in t, the steps
a draw in [t_min, t_max] can reach form one range [k(t_max), k(t_min)] (``covered_steps``); the
per-step weights are solved over that range, as the SDE objective solves them over its window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class NftLoss:
    """loss: 0-d; per_sample [N] (before the weight); positive_share: mean of r > 1/2."""

    loss: Tensor
    per_sample: Tensor
    positive_share: Tensor


@dataclass(frozen=True)
class Noised:
    """x_t [N, C, h, w] = (1 - t) x0 + t eps and its flow-matching target v = eps - x0."""

    x_t: Tensor
    target: Tensor


def forward_noised(x0: Tensor, t: Tensor, eps: Tensor) -> Noised:
    """The forward process at per-sample times t [N] for x0, eps [N, C, h, w]."""
    if x0.shape != eps.shape or t.shape != x0.shape[:1]:
        raise ValueError(f"need x0 and eps of one shape [N, ...] and t [N]; got "
                         f"{tuple(x0.shape)}, {tuple(eps.shape)}, {tuple(t.shape)}")
    tt = t.reshape(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return Noised((1 - tt) * x0 + tt * eps, eps - x0)


def group_centred(values: Tensor, group_size: int) -> Tensor:
    """values [B G, ...] minus each group's mean over its G consecutive samples (elementwise)."""
    n = values.shape[0]
    if group_size < 1 or n % group_size:
        raise ValueError(f"{n} samples do not split into groups of {group_size}")
    grouped = values.reshape(n // group_size, group_size, *values.shape[1:])
    return (grouped - grouped.mean(dim=1, keepdim=True)).reshape(values.shape)


def optimality(advantages: Tensor, a_max: float) -> Tensor:
    """r = 1/2 + 1/2 clip(A / a_max, -1, 1), same shape as advantages ([N] or [N, h, w])."""
    if not a_max > 0:
        raise ValueError(f"a_max must be > 0 (the |A| at which r reaches 0 or 1); got {a_max!r}")
    return 0.5 + 0.5 * (advantages / a_max).clamp(-1.0, 1.0)


def adaptive_weight(v_old: Tensor, target: Tensor, floor: float = 1e-4) -> Tensor:
    """1 / mean |v_old - v|^2 per sample [N] (detached): each sample's loss in units of the old
    policy's own error at its (t, eps), so samples at easy and hard t count alike."""
    err = (v_old.detach() - target).pow(2).flatten(1).mean(dim=1)
    return 1.0 / err.clamp_min(floor)


def nft_loss(
    v_theta: Tensor,
    v_old: Tensor,
    target: Tensor,
    r: Tensor,
    beta: float,
    weight: Tensor | None = None,
) -> NftLoss:
    """The loss above. v_theta, v_old, target [N, C, h, w]; r [N] or [N, h, w] in [0, 1];
    weight [N] or None (1)."""
    if v_theta.shape != v_old.shape or v_theta.shape != target.shape or v_theta.dim() != 4:
        raise ValueError(f"velocities and target must share a shape [N, C, h, w]; got "
                         f"{tuple(v_theta.shape)}, {tuple(v_old.shape)}, {tuple(target.shape)}")
    n, _, h, w = v_theta.shape
    if tuple(r.shape) not in ((n,), (n, h, w)):
        raise ValueError(f"r must be [N] = ({n},) or [N, h, w] = ({n}, {h}, {w}); got "
                         f"{tuple(r.shape)}: pool the map onto the latent grid")
    if not beta > 0:
        raise ValueError(f"beta must be > 0; got {beta!r}")
    if (r < 0).any() or (r > 1).any():
        raise ValueError("r must lie in [0, 1]: map advantages with nft.optimality")
    v_old = v_old.detach()
    rr = (r[:, None, None, None] if r.dim() == 1 else r[:, None]).to(v_theta.dtype)
    v_pos = (1 - beta) * v_old + beta * v_theta
    v_neg = (1 + beta) * v_old - beta * v_theta
    per_dim = rr * (v_pos - target).pow(2) + (1 - rr) * (v_neg - target).pow(2)
    per_sample = per_dim.flatten(1).mean(dim=1)  # [N]
    wt = torch.ones_like(per_sample) if weight is None else weight.detach().to(per_sample.dtype)
    if wt.shape != per_sample.shape:
        raise ValueError(f"weight must be [N] = ({n},); got {tuple(wt.shape)}")
    return NftLoss((wt * per_sample).mean(), per_sample.detach(), (r > 0.5).float().mean())


def nearest_steps(t: Tensor, step_times: Tensor) -> Tensor:
    """k(t) [N] int64: the index of the step time nearest each t [N]; step_times [K] strictly
    decreasing (t_0 > ... > t_{K-1}); a tie goes to the earlier step (module docstring)."""
    if t.dim() != 1 or step_times.dim() != 1 or step_times.numel() == 0:
        raise ValueError(f"need t [N] and step_times [K >= 1]; got {tuple(t.shape)} and "
                         f"{tuple(step_times.shape)}")
    if step_times.numel() > 1 and not bool((step_times[1:] < step_times[:-1]).all()):
        raise ValueError(f"step_times must decrease strictly (t_0 = noise first); got "
                         f"{step_times.tolist()}")
    gap = (t.double()[:, None] - step_times.double().to(t.device)[None]).abs()  # [N, K]
    return gap.argmin(dim=1)  # the first minimum: ties to the earlier step


def covered_steps(step_times: Tensor, t_min: float, t_max: float) -> tuple[int, int]:
    """[start, end): the steps of step_times [S] (strictly decreasing) nearest some t in
    [t_min, t_max] (module docstring)."""
    if not t_min < t_max:
        raise ValueError(f"need t_min < t_max; got {t_min!r}, {t_max!r}")
    ends = nearest_steps(torch.tensor([t_max, t_min], dtype=torch.float64), step_times)
    return int(ends[0]), int(ends[1]) + 1


def credit_at_t(step_maps: Tensor, t: Tensor, step_times: Tensor) -> Tensor:
    """Each sample's map at the step nearest its t: step_maps [N, K, h, w], t [N], step_times
    [K] -> [N, h, w] = step_maps[n, k(t_n)]."""
    n, k = step_maps.shape[:2]
    if step_maps.dim() != 4 or t.shape != (n,) or step_times.shape != (k,):
        raise ValueError(f"need step_maps [N, K, h, w], t [N] and step_times [K] with the same "
                         f"N and K; got {tuple(step_maps.shape)}, {tuple(t.shape)} and "
                         f"{tuple(step_times.shape)}")
    steps = nearest_steps(t, step_times).to(step_maps.device)
    return step_maps[torch.arange(n, device=step_maps.device), steps]
