"""Deterministic (ODE) sampling through any backbone: Euler steps on the backbone's sigma schedule.

The backbone supplies `encode_prompts`, `initial_noise(seeds)`, `velocity(x, t, cond, guidance_scale,
uncond)` and `sigmas(num_steps)`; the step itself is `cast_core.sde.ode_step`. `ode_trajectory`
is the one ODE loop of the library: the sampler here and the window calibration (which needs each
step's velocity for its Tweedie estimate) both walk it. Work is split into chunks of `chunk_size`
samples so memory stays flat; seeds are per sample, so a sample does not depend on which chunk or
batch position it falls in.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from cast_core.sde import ode_step


@dataclass(frozen=True)
class OdeStep:
    """One step k of an ODE trajectory: x_t [N, C, h, w] at time t, its velocity v, and t_next."""

    k: int
    t: float
    t_next: float
    x_t: Tensor
    v: Tensor


def encode_conditioning(backbone, prompts: list[str], guidance_scale: float):
    """(cond, uncond) for the prompts; uncond is None without CFG. Never builds a text-encoder graph."""
    with torch.no_grad():
        cond = backbone.encode_prompts(prompts)
        uncond = backbone.encode_prompts([""] * len(prompts)) if guidance_scale != 1.0 else None
    return cond, uncond


def step_velocity(backbone, x_t: Tensor, t: float, cond, uncond, guidance_scale: float) -> Tensor:
    """v(x_t, t) [n, C, h, w] for n samples sharing the step time t."""
    t_vec = torch.full((x_t.shape[0],), t, device=x_t.device)
    return backbone.velocity(x_t, t_vec, cond, guidance_scale, uncond)


def ode_trajectory(backbone, cond, uncond, x: Tensor, sigmas: Tensor,
                   guidance_scale: float) -> Iterator[OdeStep]:
    """Yield each step of the Euler ODE from x at sigmas[0] to sigmas[-1]; the caller reads the
    final sample from the last step (`ode_step(s.x_t, s.v, s.t, s.t_next)`) or via `sample_ode`."""
    for k in range(len(sigmas) - 1):
        t, t_next = float(sigmas[k]), float(sigmas[k + 1])
        v = step_velocity(backbone, x, t, cond, uncond, guidance_scale)
        yield OdeStep(k=k, t=t, t_next=t_next, x_t=x, v=v)
        x = ode_step(x, v, t, t_next)


@torch.no_grad()
def sample_ode(backbone, prompts: list[str], seeds: list[int], num_steps: int,
               guidance_scale: float, chunk_size: int = 128) -> torch.Tensor:
    """Final samples x_0 [N, C, h, w] for N (prompt, seed) pairs."""
    if len(prompts) != len(seeds):
        raise ValueError(f"one seed per prompt: got {len(prompts)} prompts and {len(seeds)} seeds")
    sigmas = backbone.sigmas(num_steps)
    out = []
    for lo in range(0, len(prompts), chunk_size):
        chunk = prompts[lo:lo + chunk_size]
        cond, uncond = encode_conditioning(backbone, chunk, guidance_scale)
        x = backbone.initial_noise(seeds[lo:lo + chunk_size])
        for step in ode_trajectory(backbone, cond, uncond, x, sigmas, guidance_scale):
            x = ode_step(step.x_t, step.v, step.t, step.t_next)
        out.append(x)
    return torch.cat(out)
