"""Flow-matching ODE and SDE steps, Tweedie estimates and per-position Gaussian log-probs.

Conventions (diffusers): sigma t in [0, 1], t = 1 is pure noise, x_t = (1 - t) x0 + t eps, the
velocity is v = eps - x0. A step goes from t to t_next < t, so dt = t_next - t < 0. Latents have
layout [N, C, *pos] ([N, C, h, w] for images): channels on dim 1, then at least one position dim.
Times t and t_next are Python floats, 0-d tensors or [N] tensors (one time per sample).

Steps (a is the noise level):
- ``ode_step``: Euler, x_next = x_t + v dt.
- ``flow_sde`` (Flow-SDE, as in Flow-GRPO): s(t) = a sqrt(t / (1 - t)),
  mean = x_t + [v + s^2 / (2t) (x_t + (1 - t) v)] dt, std = s sqrt(-dt).
- ``cps`` (coefficients-preserving sampling): std = t_next sin(a pi / 2),
  mean = (1 - t_next) x0_hat + sqrt(t_next^2 - std^2) eps_hat, with the Tweedie estimates
  x0_hat = x_t - t v and eps_hat = x_t + (1 - t) v.
Sampling is x_next = mean + std z, z ~ N(0, I).

Every clamp and floor:
- flow_sde, first step: at t = 1 the denominator 1 - t would be 0; as in Flow-GRPO, t in 1 - t is
  replaced by the schedule's second sigma, which is this step's t_next, so the first step has
  std a sqrt(1 / (1 - t_next)) sqrt(-dt) (a function of (t, t_next) alone). Every other t in the
  denominator is also clamped to t <= t_max (default 0.99) for schedules that end near 1.
  (An earlier version clamped only to t_max = 0.99 at t = 1: with 10 steps that made the first
  step's std 3.2 times Flow-GRPO's and its drift correction 10 times larger, so a window that
  starts at the first step gave samples that the remaining ODE steps could not denoise.)
- flow_sde: s^2 / (2t) is evaluated as a^2 / (2 (1 - t')) with t' the clamped t above, where t
  cancels exactly, so there is no division by t.
- log-probs: std is floored at ``std_floor`` (default 1e-6) inside the log density only, never when
  sampling, so a = 0 (std 0) and the CPS last step (t_next = 0, std 0) give finite log-probs.

a = 0 reduces both kinds bitwise to ``ode_step``: the flow_sde correction is multiplied by a^2 = 0,
and the CPS mean is evaluated in the algebraically equal form
x_t + v dt + t_next (cos(a pi / 2) - 1) eps_hat (using sqrt(t_next^2 - std^2) = t_next cos(a pi / 2)),
whose last term is exactly 0 at a = 0 and which never takes the square root of a rounding-negative
number.

Precision: means are computed in promote(x dtype, float32) and returned in x's dtype; std stays in
that promoted dtype with shape [N, 1, ..., 1]; log-probs are float32.

Block (low-rank) noise, ``noise_block`` b >= 1 (ours): the step's noise is confined to the
subspace of latents that are constant on b x b tiles of the position grid, P = spread o
block_mean (an orthogonal projection). Of the transition above it keeps exactly the part that
lives in that subspace: mean_b = ode + P(mean - ode), with ode the Euler step, and noise std P z,
z ~ N(0, I); in pixels P z = spread(z_c) / b with z_c ~ N(0, I) on the tile grid, so the
returned std is std / b and x_next = mean_b + (std / b) spread(z_c). Outside the subspace the step
is the deterministic Euler step. This is the same SDE with diffusion matrix P instead of I: its
drift correction is P times the original (g^2 / 2 P grad log p, by the Fokker-Planck equation),
so the marginals are still the ODE's, and the law of the tile means is exactly that of the
isotropic SDE's. The action is the tile means: block_mean(x_next) ~ N(block_mean(mean_b),
(std / b)^2) per tile and channel, so log-probs live on the tile grid [N, h / b, w / b]. Why:
the score-function estimator's per-sample noise grows with the action's dimension (its
signal-to-noise ratio is at best 1 / (D + 1) for D Gaussian dims); tiles cut D by b^2 and keep
the low-frequency moves that change a picture's composition, dropping the high-frequency noise
that the remaining steps mostly denoise away. The gradient through the Euler part is ignored,
as it is for the ODE steps outside the window. b = 1 is the isotropic step, bitwise.

Departures: the log-prob is kept per position (mean over channels at each position, shape
[N, *pos]) so the loss can weight positions; its mean over positions equals Flow-GRPO's mean over
all dims. As in Flow-GRPO, the sampled x_next is detached inside the log-prob (it is the action).
Times are validated (0 <= t_next < t <= 1), which costs one device sync per call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

SdeKind = Literal["flow_sde", "cps"]
Time = float | Tensor

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(frozen=True)
class GaussianStep:
    """Gaussian transition N(mean, std^2) of one denoising step.

    mean: [N, C, *pos], in x_t's dtype.
    std: [N, 1, ..., 1], one value per sample, broadcastable to x_t; float32 or wider. With block
    noise (see the module docstring) the std of each pixel's noise, which is also the std of the
    tile means.
    """

    mean: Tensor
    std: Tensor


@dataclass(frozen=True)
class SdeStep:
    """One sampled SDE step.

    x_next: [N, C, *pos], the sample mean + std z, in x_t's dtype.
    log_prob: [N, *pos] float32, log density of x_next per position (mean over channels).
    mean: [N, C, *pos], in x_t's dtype.
    std: [N, 1, ..., 1], float32 or wider.
    """

    x_next: Tensor
    log_prob: Tensor
    mean: Tensor
    std: Tensor


def _check_latent(x: Tensor, name: str) -> None:
    if x.dim() < 3:
        raise ValueError(
            f"{name} must have layout [N, C, *pos] with at least one position dim; "
            f"got shape {tuple(x.shape)}; add the missing batch/position dims"
        )


def _time(t: Time, x_t: Tensor) -> Tensor:
    """A time as a [N, 1, ..., 1] tensor in promote(x_t dtype, float32), on x_t's device."""
    n = x_t.shape[0]
    dtype = torch.promote_types(x_t.dtype, torch.float32)
    t = torch.as_tensor(t, dtype=dtype, device=x_t.device)
    if t.dim() == 0:
        t = t.expand(n)
    if t.numel() != n:
        raise ValueError(
            f"a time must be a float, a 0-d tensor or a [N] tensor with N = {n}; "
            f"got shape {tuple(t.shape)}"
        )
    return t.reshape(n, *([1] * (x_t.dim() - 1)))


def _step_times(x_t: Tensor, t: Time, t_next: Time) -> tuple[Tensor, Tensor]:
    """(t, t_next) as [N, 1, ..., 1] tensors, validated to 0 <= t_next < t <= 1."""
    t_, t_next_ = _time(t, x_t), _time(t_next, x_t)
    if not bool(((t_next_ >= 0) & (t_next_ < t_) & (t_ <= 1)).all()):
        raise ValueError(
            "step times must satisfy 0 <= t_next < t <= 1 (steps go from noise t = 1 towards "
            f"data t = 0); got t={t!r}, t_next={t_next!r}"
        )
    return t_, t_next_


def _check_noise_level(noise_level: float, upper: float | None) -> None:
    ok = math.isfinite(noise_level) and noise_level >= 0
    if not ok or (upper is not None and noise_level > upper):
        bound = f"[0, {upper}]" if upper is not None else "[0, inf)"
        raise ValueError(f"noise_level must lie in {bound}; got {noise_level!r}")


def _check_block(x: Tensor, block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"noise_block must be an int >= 1 (1 = isotropic noise); got {block!r}")
    if block > 1 and (x.dim() != 4 or x.shape[-2] % block or x.shape[-1] % block):
        raise ValueError(
            f"noise_block {block} needs latents [N, C, h, w] with h and w divisible by it; got "
            f"shape {tuple(x.shape)}; pick a block that divides the latent grid"
        )


def block_mean(x: Tensor, block: int) -> Tensor:
    """Means over block x block tiles: [N, C, h, w] -> [N, C, h / block, w / block] (x at 1)."""
    _check_block(x, block)
    if block == 1:
        return x
    return torch.nn.functional.avg_pool2d(x, block)


def block_spread(z: Tensor, block: int) -> Tensor:
    """Each value repeated over its tile: [N, C, h, w] -> [N, C, h block, w block] (z at 1)."""
    if block == 1:
        return z
    return z.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)


def noise_shape(shape: Sequence[int], block: int) -> tuple[int, ...]:
    """The shape of a step's standard-normal draw: `shape` [N, C, *pos], its tile grid at b > 1."""
    shape = tuple(int(d) for d in shape)
    if block == 1:
        return shape
    return (*shape[:-2], shape[-2] // block, shape[-1] // block)


def _x0_hat(x_t: Tensor, v: Tensor, t: Tensor) -> Tensor:
    return x_t - t * v


def _eps_hat(x_t: Tensor, v: Tensor, t: Tensor) -> Tensor:
    return x_t + (1 - t) * v


def _euler(x_t: Tensor, v: Tensor, t: Tensor, t_next: Tensor) -> Tensor:
    return x_t + v * (t_next - t)


def ode_step(x_t: Tensor, v: Tensor, t: Time, t_next: Time) -> Tensor:
    """Euler step x_t + v (t_next - t). x_t, v: [N, C, *pos] -> [N, C, *pos]."""
    _check_latent(x_t, "x_t")
    t_, t_next_ = _step_times(x_t, t, t_next)
    return _euler(x_t, v, t_, t_next_).to(x_t.dtype)


def tweedie_x0(x_t: Tensor, v: Tensor, t: Time) -> Tensor:
    """Clean estimate x0_hat = x_t - t v. x_t, v: [N, C, *pos] -> [N, C, *pos]."""
    _check_latent(x_t, "x_t")
    return _x0_hat(x_t, v, _time(t, x_t)).to(x_t.dtype)


def tweedie_eps(x_t: Tensor, v: Tensor, t: Time) -> Tensor:
    """Noise estimate eps_hat = x_t + (1 - t) v. x_t, v: [N, C, *pos] -> [N, C, *pos]."""
    _check_latent(x_t, "x_t")
    return _eps_hat(x_t, v, _time(t, x_t)).to(x_t.dtype)


def flow_sde_mean_std(
    x_t: Tensor, v: Tensor, t: Time, t_next: Time, noise_level: float, t_max: float = 0.99
) -> GaussianStep:
    """Flow-SDE transition (Flow-GRPO). x_t, v: [N, C, *pos]; mean [N, C, *pos], std [N, 1, ...].

    At t = 1 the t in 1 - t is t_next (Flow-GRPO); t_max clamps it otherwise (see the module
    docstring); noise_level a >= 0.
    """
    _check_latent(x_t, "x_t")
    _check_noise_level(noise_level, upper=None)
    if not 0.0 < t_max < 1.0:
        raise ValueError(f"t_max must lie in (0, 1) to keep 1 - t positive; got {t_max!r}")
    t_, t_next_ = _step_times(x_t, t, t_next)
    dt = t_next_ - t_  # [N, 1, ...], negative
    one_minus_t = 1 - torch.where(t_ >= 1, t_next_, t_).clamp(max=t_max)
    s2_over_2t = noise_level**2 / (2 * one_minus_t)  # s^2 / (2t) with t cancelled
    mean = x_t + (v + s2_over_2t * _eps_hat(x_t, v, t_)) * dt
    std = noise_level * torch.sqrt(t_ / one_minus_t) * torch.sqrt(-dt)
    return GaussianStep(mean=mean.to(x_t.dtype), std=std)


def cps_mean_std(x_t: Tensor, v: Tensor, t: Time, t_next: Time, noise_level: float) -> GaussianStep:
    """Coefficients-preserving transition. x_t, v: [N, C, *pos]; mean [N, C, *pos], std [N, 1, ...].

    noise_level a in [0, 1]; std = t_next sin(a pi / 2).
    """
    _check_latent(x_t, "x_t")
    _check_noise_level(noise_level, upper=1.0)
    t_, t_next_ = _step_times(x_t, t, t_next)
    std = t_next_ * math.sin(noise_level * math.pi / 2)
    # sqrt(t_next^2 - std^2) - t_next = t_next (cos(a pi/2) - 1) = -2 t_next sin^2(a pi/4)
    eps_coef_shift = -2.0 * math.sin(noise_level * math.pi / 4) ** 2 * t_next_
    mean = _euler(x_t, v, t_, t_next_) + eps_coef_shift * _eps_hat(x_t, v, t_)
    return GaussianStep(mean=mean.to(x_t.dtype), std=std)


def sde_mean_std(
    x_t: Tensor,
    v: Tensor,
    t: Time,
    t_next: Time,
    noise_level: float,
    kind: SdeKind,
    t_max: float = 0.99,
    noise_block: int = 1,
) -> GaussianStep:
    """Transition of the chosen kind; t_max only affects flow_sde. Shapes as the kinds above.

    noise_block b > 1 confines the noise to b x b tiles (module docstring): the mean keeps the
    Euler step plus the tile-projected correction, and std is the per-pixel std, std / b.
    """
    _check_block(x_t, noise_block)
    if kind == "flow_sde":
        step = flow_sde_mean_std(x_t, v, t, t_next, noise_level, t_max=t_max)
    elif kind == "cps":
        step = cps_mean_std(x_t, v, t, t_next, noise_level)
    else:
        raise ValueError(f"kind must be 'flow_sde' or 'cps'; got {kind!r}")
    if noise_block == 1:
        return step
    t_, t_next_ = _step_times(x_t, t, t_next)
    ode = _euler(x_t.float(), v.float(), t_, t_next_)  # [N, C, h, w] fp32
    correction = block_spread(block_mean(step.mean.float() - ode, noise_block), noise_block)
    return GaussianStep(mean=(ode + correction).to(x_t.dtype), std=step.std / noise_block)


@dataclass(frozen=True)
class VelocityGain:
    """How one SDE step's Gaussian answers a change of the velocity. Every kind's mean is affine
    in v with one slope at every position, mean(v + dv) = mean(v) + slope dv, and its std does
    not depend on v; with block noise b the action is the tile means, whose std is std / b. So a
    change dv of the velocity (the same at both ends of a KL) moves the step by
    KL = slope^2 |dv|^2 / (2 std^2) nats, |dv|^2 summed over the action's dims (`nats_per_sq`
    per unit of |dv|^2). slope < 0 (dt < 0); std 0 (the ODE) has no KL."""

    slope: float
    std: float

    @property
    def nats_per_sq(self) -> float:
        return self.slope**2 / (2.0 * self.std**2)


def velocity_gain(t: float, t_next: float, noise_level: float, kind: SdeKind,
                  t_max: float = 0.99, noise_block: int = 1) -> VelocityGain:
    """The step's `VelocityGain`, read off the transition itself (at x = 0 with v = 0 and v = 1:
    exact, the mean being affine in (x, v)). Needs noise_level > 0."""
    if not noise_level > 0:
        raise ValueError(f"velocity_gain needs noise_level > 0 (the ODE has no KL); got "
                         f"{noise_level!r}")
    zero, one = torch.zeros(1, 1, 1, dtype=torch.float64), torch.ones(1, 1, 1, dtype=torch.float64)
    at_zero = sde_mean_std(zero, zero, t, t_next, noise_level, kind, t_max=t_max)
    at_one = sde_mean_std(zero, one, t, t_next, noise_level, kind, t_max=t_max)
    return VelocityGain(slope=float(at_one.mean - at_zero.mean),
                        std=float(at_zero.std) / noise_block)


def gaussian_log_prob(
    x: Tensor, mean: Tensor, std: Tensor, std_floor: float = 1e-6, noise_block: int = 1
) -> Tensor:
    """Per-position log density of x under N(mean, max(std, std_floor)^2), float32.

    x, mean: [N, C, *pos]; std: broadcastable to x (e.g. [N, 1, ..., 1]).
    Returns [N, *pos]: the elementwise Normal log-pdf averaged over channels (dim 1).
    With noise_block b > 1 ([N, C, h, w] only) it is the density of the tile means,
    block_mean(x) ~ N(block_mean(mean), std^2): [N, h / b, w / b].
    """
    _check_latent(x, "x")
    if mean.shape != x.shape:
        raise ValueError(f"mean must have x's shape {tuple(x.shape)}; got {tuple(mean.shape)}")
    if not std_floor > 0:
        raise ValueError(f"std_floor must be positive to keep log-probs finite; got {std_floor!r}")
    x32, mean32 = block_mean(x.float(), noise_block), block_mean(mean.float(), noise_block)
    std32 = std.float().clamp_min(std_floor)
    log_pdf = -((x32 - mean32) ** 2) / (2 * std32**2) - torch.log(std32) - _LOG_SQRT_2PI
    return log_pdf.mean(dim=1)  # [N, *pos]


def sde_step(
    x_t: Tensor,
    v: Tensor,
    t: Time,
    t_next: Time,
    noise_level: float,
    kind: SdeKind,
    *,
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
    t_max: float = 0.99,
    std_floor: float = 1e-6,
    noise_block: int = 1,
) -> SdeStep:
    """Sample x_next = mean + std z and its per-position log-prob.

    x_t, v: [N, C, *pos]. z is ``noise`` when given, else drawn from ``generator`` (at most one
    of the two), of x_t's shape, or with noise_block b > 1 of the tile grid's [N, C, h / b, w / b]
    and spread over the tiles. Returns SdeStep with x_next [N, C, *pos], log_prob [N, *pos]
    ([N, h / b, w / b] with b > 1).
    """
    if generator is not None and noise is not None:
        raise ValueError("pass either generator or noise to sde_step, not both")
    step = sde_mean_std(x_t, v, t, t_next, noise_level, kind, t_max=t_max,
                        noise_block=noise_block)
    shape = noise_shape(x_t.shape, noise_block)
    if noise is None:
        noise = torch.randn(shape, generator=generator, device=x_t.device, dtype=x_t.dtype)
    elif tuple(noise.shape) != shape:
        raise ValueError(
            f"noise must have shape {shape} (x_t's, on the tile grid of noise_block "
            f"{noise_block}); got {tuple(noise.shape)}"
        )
    x_next = (step.mean + step.std * block_spread(noise, noise_block)).to(x_t.dtype)
    log_prob = gaussian_log_prob(x_next.detach(), step.mean, step.std, std_floor, noise_block)
    return SdeStep(x_next=x_next, log_prob=log_prob, mean=step.mean, std=step.std)
