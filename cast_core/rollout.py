"""Group rollouts with an SDE window, and replay of the window steps' log-probs under new weights.

Variant: Flow-GRPO-style sampling restricted to a window (as in Flow-GRPO-Fast / MixGRPO): the
denoising steps k in the window [start, end) are stochastic (``sde.sde_step``, Flow-SDE or CPS) and
are the only steps the policy is trained on; every other step is the deterministic Euler step
(``sde.ode_step``). With noise level 0 a rollout equals ``sampling.sample_ode`` exactly.

Conventions: sigmas come from ``backbone.sigmas(num_steps)`` (t = 1 is noise); step k goes from
t = sigmas[k] to t_next = sigmas[k + 1]; the velocity is ``backbone.velocity`` with the spec's CFG
scale (the empty prompt as unconditional input when the scale is not 1). For each window step the
rollout stores the input latent x_t, the sampled x_next and the per-position log-prob (fp32).

Seeds: sample i starts from ``backbone.initial_noise([noise_seeds[i]])`` (``noise_seeds`` defaults
to ``seeds``; passing one value per group shares the starting noise within the group, so the
group's samples differ only by their window noise) and its SDE noise at step k is drawn from a CPU ``torch.Generator`` seeded with splitmix64(splitmix64(seeds[i]) ^ k) (see
``sde_noise``), in float32, then moved to the latents' device and dtype. No random draw depends on
the sample's batch position, the batch size or the chunking, and the noise stream never coincides
with the initial-noise stream of another seed (consecutive seeds are common).

Replay: ``replay_log_probs`` recomputes each stored step's Gaussian with the current weights at the
stored x_t and scores the stored x_next with the same functions the rollout used, so with unchanged
weights the ratio is 1 up to float noise. Departure from Flow-GRPO: no timestep resampling or
shuffling of steps here; which steps and samples to replay is the caller's choice (``select``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cast_core.checks import require_count
from cast_core.sampling import encode_conditioning, step_velocity
from cast_core.sde import (
    GaussianStep,
    SdeKind,
    gaussian_log_prob,
    noise_shape,
    ode_step,
    sde_mean_std,
    sde_step,
)
from cast_core.window import SdeWindow

_MASK64 = (1 << 64) - 1
Index = slice | Sequence[int] | Tensor


@dataclass(frozen=True)
class RolloutSpec:
    """How to sample: num_steps Euler/SDE steps, CFG scale, SDE noise level a, SDE kind, window;
    noise_block b: the window noise is constant on b x b tiles of the latent grid (``sde``'s block
    noise; 1 = isotropic), and log-probs live on the tile grid."""

    num_steps: int
    guidance_scale: float
    noise_level: float
    sde_kind: SdeKind
    window: SdeWindow
    noise_block: int = 1

    def __post_init__(self) -> None:
        if (
            isinstance(self.num_steps, bool)
            or not isinstance(self.num_steps, int)
            or self.num_steps < 1
        ):
            raise ValueError(f"RolloutSpec.num_steps must be an int >= 1; got {self.num_steps!r}")
        if not math.isfinite(self.guidance_scale):
            raise ValueError(
                "RolloutSpec.guidance_scale must be finite (1.0 = no CFG); "
                f"got {self.guidance_scale!r}"
            )
        if self.sde_kind not in ("flow_sde", "cps"):
            raise ValueError(
                f"RolloutSpec.sde_kind must be 'flow_sde' or 'cps'; got {self.sde_kind!r}"
            )
        upper = 1.0 if self.sde_kind == "cps" else math.inf
        if not (math.isfinite(self.noise_level) and 0.0 <= self.noise_level <= upper):
            raise ValueError(
                f"RolloutSpec.noise_level must lie in [0, {upper}] for sde_kind={self.sde_kind!r}; "
                f"got {self.noise_level!r}"
            )
        if not isinstance(self.window, SdeWindow):
            raise TypeError(
                f"RolloutSpec.window must be an SdeWindow; got {type(self.window).__name__}"
            )
        self.window.require_within(self.num_steps)
        require_count("RolloutSpec", "noise_block", self.noise_block, "1 = isotropic noise")


@dataclass(frozen=True)
class Rollout:
    """N samples with their K window steps (on the latents' device).

    x0: [N, C, h, w] final samples. latents: [N, K, C, h, w] each window step's input x_t.
    next_latents: [N, K, C, h, w] the sampled x_next. log_probs: [N, K, h', w'] fp32, per-position
    log-density of x_next on the noise grid (h' = h / b, w' = w / b for the spec's noise_block b).
    t, t_next: [K] fp32 sigmas of each window step.
    """

    x0: Tensor
    latents: Tensor
    next_latents: Tensor
    log_probs: Tensor
    t: Tensor
    t_next: Tensor

    def select(self, samples: Index = slice(None), steps: Index = slice(None)) -> Rollout:
        """The rollout restricted to some samples (dim N) and window steps (dim K)."""
        s = samples if isinstance(samples, slice) else torch.as_tensor(samples, dtype=torch.long)
        k = steps if isinstance(steps, slice) else torch.as_tensor(steps, dtype=torch.long)
        return Rollout(
            x0=self.x0[s],
            latents=self.latents[s][:, k],
            next_latents=self.next_latents[s][:, k],
            log_probs=self.log_probs[s][:, k],
            t=self.t[k],
            t_next=self.t_next[k],
        )


@dataclass(frozen=True)
class Replay:
    """Window steps recomputed with the current weights.

    log_probs: [n, K', h', w'] fp32 (the noise grid). means: [n, K', C, h, w]. stds:
    [n, K', 1, 1, 1], the per-pixel std of the step's noise.
    """

    log_probs: Tensor
    means: Tensor
    stds: Tensor


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, k: int) -> int:
    """The 64-bit generator seed of step k's SDE noise for a sample seeded with `seed`."""
    return _splitmix64(_splitmix64(int(seed) & _MASK64) ^ int(k))


def sde_noise(seeds: Sequence[int], k: int, shape: Sequence[int]) -> Tensor:
    """Standard-normal SDE noise of step k, one draw of `shape` (C, h, w, or the tile grid's
    C, h / b, w / b with block noise) per seed: [N, *shape]."""
    return torch.stack(
        [
            torch.randn(tuple(shape), generator=torch.Generator().manual_seed(step_seed(s, k)))
            for s in seeds
        ]
    )


def _velocity(backbone, x_t: Tensor, t: float, cond, uncond, spec: RolloutSpec) -> Tensor:
    """v(x_t, t) [n, C, h, w] for n samples sharing the step time t."""
    return step_velocity(backbone, x_t, t, cond, uncond, spec.guidance_scale)


def _check_pairs(prompts: list[str], seeds: Sequence[int]) -> None:
    if len(prompts) != len(seeds) or not prompts:
        raise ValueError(
            f"need one seed per prompt and at least one pair: got {len(prompts)} prompts and "
            f"{len(seeds)} seeds; repeat each prompt G times with G distinct seeds"
        )


def _no_progress(steps: int) -> None:
    """The default `progress` callback: nothing."""


@torch.no_grad()
def _rollout_chunk(backbone, prompts: list[str], seeds: list[int], spec: RolloutSpec,
                   noise_seeds: list[int], progress: Callable[[int], object],
                   signs: list[float]) -> Rollout:
    device = next(backbone.transformer.parameters()).device
    sigmas = backbone.sigmas(spec.num_steps)
    cond, uncond = encode_conditioning(backbone, prompts, spec.guidance_scale)
    x = backbone.initial_noise(noise_seeds).to(device)  # [n, C, h, w]
    latents, next_latents, log_probs = [], [], []
    for k in range(spec.num_steps):
        t, t_next = float(sigmas[k]), float(sigmas[k + 1])
        v = _velocity(backbone, x, t, cond, uncond, spec)
        progress(1)
        if k not in spec.window.steps:
            x = ode_step(x, v, t, t_next)
            continue
        z = sde_noise(seeds, k, noise_shape(x.shape, spec.noise_block)[1:])
        z = z.to(device=x.device, dtype=x.dtype)
        z = z * torch.tensor(signs, dtype=x.dtype, device=x.device)[:, None, None, None]
        step = sde_step(x, v, t, t_next, spec.noise_level, spec.sde_kind, noise=z,
                        noise_block=spec.noise_block)
        latents.append(x)
        next_latents.append(step.x_next)
        log_probs.append(step.log_prob)
        x = step.x_next
    window = list(spec.window.steps)
    return Rollout(
        x0=x,
        latents=torch.stack(latents, dim=1),  # [n, K, C, h, w]
        next_latents=torch.stack(next_latents, dim=1),  # [n, K, C, h, w]
        log_probs=torch.stack(log_probs, dim=1),  # [n, K, h', w']
        t=sigmas[window].float(),
        t_next=sigmas[[k + 1 for k in window]].float(),
    )


def rollout(
    backbone, prompts: list[str], seeds: Sequence[int], spec: RolloutSpec, chunk_size: int = 64,
    noise_seeds: Sequence[int] | None = None, progress: Callable[[int], object] | None = None,
    noise_signs: Sequence[float] | None = None,
) -> Rollout:
    """Sample N = len(prompts) (prompt, seed) pairs, storing the window steps. See ``Rollout``.

    noise_signs (optional, one +1 or -1 per sample) multiplies each sample's SDE noise at every
    window step: two samples with the same seed, start and prompt and opposite signs are a
    mirrored (antithetic) pair, each still an exact draw of the policy.

    Chunks of `chunk_size` samples run at once; the random draws do not depend on the chunking
    (outputs agree across chunkings up to the rounding of batched kernels). `progress`, when
    given, is called with 1 after each step's velocity of each chunk: ceil(N / chunk_size) x
    num_steps calls (the caller draws a progress bar; this module never prints).
    """
    _check_pairs(prompts, seeds)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    seeds = [int(s) for s in seeds]
    if noise_seeds is None:
        noise_seeds = seeds
    elif len(noise_seeds) != len(seeds):
        raise ValueError(f"need one initial-noise seed per sample: got {len(noise_seeds)} for "
                         f"{len(seeds)} samples")
    noise_seeds = [int(s) for s in noise_seeds]
    signs = [1.0] * len(seeds) if noise_signs is None else [float(v) for v in noise_signs]
    if len(signs) != len(seeds) or any(v not in (1.0, -1.0) for v in signs):
        raise ValueError(f"noise_signs must hold one +1 or -1 per sample ({len(seeds)}); got "
                         f"{len(signs)} values, {sorted(set(signs))[:4]}")
    parts = [
        _rollout_chunk(backbone, prompts[lo : lo + chunk_size], seeds[lo : lo + chunk_size], spec,
                       noise_seeds[lo : lo + chunk_size], progress or _no_progress,
                       signs[lo : lo + chunk_size])
        for lo in range(0, len(prompts), chunk_size)
    ]
    return Rollout(
        x0=torch.cat([p.x0 for p in parts]),
        latents=torch.cat([p.latents for p in parts]),
        next_latents=torch.cat([p.next_latents for p in parts]),
        log_probs=torch.cat([p.log_probs for p in parts]),
        t=parts[0].t,
        t_next=parts[0].t_next,
    )


def replay_steps(backbone, cond, uncond, steps: Rollout, spec: RolloutSpec) -> Replay:
    """Replay with precomputed conditioning (from ``backbone.encode_prompts``) for the n samples.

    steps.latents / next_latents [n, K', C, h, w], steps.t / t_next [K']. Grad follows the caller's
    grad mode.
    """
    log_probs, means, stds = [], [], []
    for j in range(steps.t.shape[0]):
        t, t_next = float(steps.t[j]), float(steps.t_next[j])
        x_t = steps.latents[:, j]  # [n, C, h, w]
        v = _velocity(backbone, x_t, t, cond, uncond, spec)
        gauss: GaussianStep = sde_mean_std(x_t, v, t, t_next, spec.noise_level, spec.sde_kind,
                                           noise_block=spec.noise_block)
        log_probs.append(gaussian_log_prob(steps.next_latents[:, j].detach(), gauss.mean,
                                           gauss.std, noise_block=spec.noise_block))
        means.append(gauss.mean)
        stds.append(gauss.std)
    return Replay(
        log_probs=torch.stack(log_probs, dim=1),  # [n, K', h', w']
        means=torch.stack(means, dim=1),  # [n, K', C, h, w]
        stds=torch.stack(stds, dim=1),  # [n, K', 1, 1, 1]
    )


def replay_log_probs(
    backbone, steps: Rollout, prompts: list[str], spec: RolloutSpec, with_grad: bool = True
) -> Replay:
    """Log-probs [n, K', h, w] of stored steps under the current weights.

    steps: a rollout or ``rollout.select(samples, steps)`` with n samples; prompts: their n prompts.
    """
    if len(prompts) != steps.latents.shape[0]:
        raise ValueError(
            f"need one prompt per replayed sample: got {len(prompts)} prompts for "
            f"{steps.latents.shape[0]} samples; pass the prompts of the selected samples"
        )
    cond, uncond = encode_conditioning(backbone, prompts, spec.guidance_scale)
    with torch.set_grad_enabled(with_grad):
        return replay_steps(backbone, cond, uncond, steps, spec)
