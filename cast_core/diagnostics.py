"""Training diagnostics that are not part of the objective: image high-frequency energy, the size
of a policy update, how maps and credits compare, and the constant-reward alarm.

High-frequency energy (an artifact / reward-hacking check). For one image [C, H, W] in [0, 1]:
grayscale g = BT.601 luma (0.299 R + 0.587 G + 0.114 B; a one-channel image is used as is), its
mean removed; P(f) = |FFT2(g - mean g)|^2 on the DFT grid, with frequencies f = (f_y, f_x) in
cycles per pixel (``torch.fft.fftfreq``: each axis in [-1/2, 1/2), Nyquist at 1/2). Then
    E_hf = sum_{|f| > radius} P(f) / sum_f P(f),
the fraction of the image's variation energy above `radius` (Parseval: the denominator is
H W sum (g - mean g)^2). Closed forms: a constant image has no variation and gets 0 by
definition (population variance <= FLAT_VARIANCE); a one-pixel checkerboard has all its energy at
(1/2, 1/2), |f| = 0.707, so E_hf = 1 for any radius below that; cos(2 pi x / W) has all of it at
|f| = 1/W, so E_hf = 0 for radius >= 1/W. The periodic extension of the DFT counts an image's
left/right and top/bottom edge mismatch as high-frequency content (no window is applied), so a
linear ramp gets a small but nonzero E_hf. Images that drift towards noise or stripes (a reward
hacked by texture) show a rising E_hf.

Parameter change: ||theta_after - theta_before||_2 over all given tensors (LoRA parameters) as one
vector, accumulated in float64.

Map noise factor (``map_noise_factor``), for advantage maps M [N, h, w] trained inside each sample's
all-dims ratio: the gradient is sum_u M_k(u) grad log p_u(x_k), and if the per-position scores
grad log p_u are independent with equal variance, its noise variance is proportional to
mean_k mean_u M_k(u)^2. A constant map with the same per-sample credit (each sample's spatial mean
mbar_k) gives mean_k mbar_k^2. Their ratio
    F = mean_k mean_u M_k(u)^2 / mean_k mbar_k^2 >= 1
is how much more gradient noise the map's spatial shape costs than its mean credit alone; the map
gains only where the reward's true gradient is concentrated where the map is. Closed forms: a
constant map gives 1; a map equal to mbar_k / f on a fraction f of the positions and 0 elsewhere
gives 1 / f.

Order disagreement (``order_disagreement``), for two credits a, b [B, G] of the same B groups
of G samples: the share of the within-group pairs (g < g') that the two order oppositely,
sign(a_g - a_g') = -sign(b_g - b_g') != 0, among the pairs neither ties (|difference| <= tol).
Two credits that are increasing functions of each other within every group give 0; a reversed
order gives 1. E.g. CAST's gated atom credit against Flow-GRPO's advantage: gating zeroes the
(negative) credits of a missing object's count and attribute atoms, so a sample that leaves the
object out can rank above one that draws it in the wrong colour.

Constant-reward alarm: a reward gives no learning signal in an iteration when every group of it
has zero variance. Per atom type: every (prompt, atom) group of that type is flagged
zero-variance (the flags ``advantage.atom_advantages`` computed with its std_floor). Scalar: the
population std of all N scalar rewards of the iteration is <= std_floor (then every prompt
group ties as well). Atom types without any group are not judged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

LUMA = (0.299, 0.587, 0.114)
FLAT_VARIANCE = 1e-12  # below this an image counts as constant (a 1/255 step on 1 of 1024 px: 1.5e-8)


def grayscale(images: Tensor) -> Tensor:
    """[N, 3, H, W] or [N, 1, H, W] -> [N, H, W] float64 luma."""
    if images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"images must be [N, 3, H, W] or [N, 1, H, W]; got {tuple(images.shape)}")
    x = images.detach().to(torch.float64)
    if x.shape[1] == 1:
        return x[:, 0]
    weights = torch.tensor(LUMA, dtype=torch.float64, device=x.device)
    return (x * weights[None, :, None, None]).sum(dim=1)  # [N, H, W]


def frequency_radius(h: int, w: int) -> Tensor:
    """[h, w] float64: |f| in cycles per pixel at each bin of an h x w DFT (fft2 order)."""
    f_y = torch.fft.fftfreq(h, dtype=torch.float64)  # [h]
    f_x = torch.fft.fftfreq(w, dtype=torch.float64)  # [w]
    return (f_y[:, None] ** 2 + f_x[None, :] ** 2).sqrt()


def high_frequency_energy(images: Tensor, radius: float = 0.25) -> Tensor:
    """Fraction of each image's spectral energy above `radius` cycles/pixel -> [N] float64 in
    [0, 1] (see the module docstring). images [N, 3, H, W] or [N, 1, H, W]."""
    if not 0.0 < radius < 0.5 * 2**0.5:
        raise ValueError(f"radius must lie in (0, 0.707) cycles/pixel (Nyquist 0.5 per axis); "
                         f"got {radius!r}; 0.25 is half the per-axis Nyquist frequency")
    g = grayscale(images)  # [N, H, W]
    x = g - g.mean(dim=(-2, -1), keepdim=True)  # [N, H, W]
    power = torch.fft.fft2(x).abs() ** 2  # [N, H, W]
    high = power[:, frequency_radius(*g.shape[-2:]) > radius].sum(dim=-1)  # [N]
    total = power.sum(dim=(-2, -1))  # [N]
    flat = x.pow(2).mean(dim=(-2, -1)) <= FLAT_VARIANCE  # [N]
    return torch.where(flat, 0.0, high / total.clamp_min(torch.finfo(torch.float64).tiny))


def param_change_norm(before: Sequence[Tensor], after: Sequence[Tensor]) -> float:
    """||after - before||_2 over all tensors as one vector (float64); pairs in the same order."""
    if len(before) != len(after):
        raise ValueError(f"need one 'after' tensor per 'before' tensor: got {len(before)} and "
                         f"{len(after)}; snapshot the same parameter list before and after")
    total = torch.zeros((), dtype=torch.float64)
    for i, (b, a) in enumerate(zip(before, after)):
        if b.shape != a.shape:
            raise ValueError(f"tensor {i}: shapes differ, {tuple(b.shape)} vs {tuple(a.shape)}")
        total += (a.detach().double().cpu() - b.detach().double().cpu()).pow(2).sum()
    return float(total.sqrt())


def map_noise_factor(maps: Tensor) -> float:
    """F of the module docstring for maps [N, h, w] (float64); raises when every sample's
    spatial mean is 0 (no credit to compare with)."""
    if maps.dim() != 3 or maps.shape[0] == 0:
        raise ValueError(f"maps must be a non-empty [N, h, w] tensor; got {tuple(maps.shape)}")
    m = maps.detach().double().flatten(1)  # [N, h w]
    mean_sq = m.mean(dim=1).pow(2).mean()
    if not mean_sq > 0:
        raise ValueError("every map has spatial mean 0: no credit to compare the map's noise with")
    return float(m.pow(2).mean() / mean_sq)


def order_disagreement(a: Tensor, b: Tensor, tol: float = 1e-6) -> float:
    """The module docstring's share of within-group pairs ordered oppositely by credits a and
    b [B, G]; raises when no pair is untied in both."""
    if a.dim() != 2 or a.shape != b.shape:
        raise ValueError(f"need a and b [B, G] of one shape; got {tuple(a.shape)}, "
                         f"{tuple(b.shape)}")
    da = a.double()[:, :, None] - a.double()[:, None, :]  # [B, G, G]
    db = b.double()[:, :, None] - b.double()[:, None, :]
    upper = torch.ones(a.shape[1], a.shape[1], dtype=torch.bool).triu(1)  # g < g'
    untied = upper & (da.abs() > tol) & (db.abs() > tol)  # [B, G, G]
    if not untied.any():
        raise ValueError("no pair of samples differs in both credits: nothing to compare")
    flipped = untied & (da.sign() != db.sign())
    return float(flipped.sum() / untied.sum())


@dataclass(frozen=True)
class RewardAlarm:
    """alarm: some reward had no learning signal; reason: which, with the figures (None without
    an alarm); constant_types: atom types whose every group had zero variance (sorted);
    reward_std: population std of the N scalar rewards; reward_mean: their mean."""

    alarm: bool
    reason: str | None
    constant_types: tuple[str, ...]
    reward_std: float
    reward_mean: float


def constant_reward_alarm(
    zero_variance: Mapping[str, Tensor], rewards: Tensor, std_floor: float
) -> RewardAlarm:
    """zero_variance: {atom type: [groups] bool}, one flag per (prompt, atom) group of the type;
    rewards: [N] the iteration's scalar rewards. See the module docstring for the rule."""
    if rewards.dim() != 1 or rewards.numel() == 0:
        raise ValueError(f"rewards must be a non-empty [N] tensor; got {tuple(rewards.shape)}")
    if not std_floor > 0:
        raise ValueError(f"std_floor must be > 0 (the advantage's); got {std_floor!r}")
    reasons, constant = [], []
    for kind in sorted(zero_variance):
        flags = torch.as_tensor(zero_variance[kind], dtype=torch.bool).reshape(-1)  # [groups]
        if flags.numel() and bool(flags.all()):
            constant.append(kind)
            reasons.append(f"every group of atom type {kind!r} has zero variance "
                           f"({flags.numel()} of {flags.numel()} groups)")
    r = rewards.detach().double()
    std, mean = float(r.std(correction=0)), float(r.mean())
    if std <= std_floor:
        reasons.append(f"all {r.numel()} scalar rewards are equal (mean {mean:.4f}, std {std:.2e}"
                       f" <= std_floor {std_floor:.0e})")
    return RewardAlarm(bool(reasons), "; ".join(reasons) or None, tuple(constant), std, mean)
