"""Deterministic (ODE) sampling through any backbone: Euler steps on the backbone's sigma schedule.

The backbone supplies `encode_prompts`, `initial_noise(seeds)`, `velocity(x, t, cond, guidance_scale,
uncond)` and `sigmas(num_steps)`; the step itself is `cast_core.sde.ode_step`. Work is split into
chunks of `chunk_size` samples so memory stays flat; seeds are per sample, so a sample does not
depend on which chunk or batch position it falls in.
"""

from __future__ import annotations

import torch

from cast_core.sde import ode_step


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
        cond = backbone.encode_prompts(chunk)
        uncond = backbone.encode_prompts([""] * len(chunk)) if guidance_scale != 1.0 else None
        x = backbone.initial_noise(seeds[lo:lo + chunk_size])
        for k in range(num_steps):
            t, t_next = float(sigmas[k]), float(sigmas[k + 1])
            v = backbone.velocity(x, torch.full((len(chunk),), t), cond, guidance_scale, uncond)
            x = ode_step(x, v, t, t_next)
        out.append(x)
    return torch.cat(out)
