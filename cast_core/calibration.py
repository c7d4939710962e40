"""Window calibration: similarity curves from Tweedie clean-image estimates along the ODE.

For P prompts (one seed each) the backbone's deterministic sampler runs on its own sigma schedule
t_0 = 1 > t_1 > ... > t_S = 0 (Euler steps, ``sde.ode_step``). At each step k = 0..S-1 the velocity
v_k = v(x_{t_k}, t_k) that makes the step also gives the Tweedie estimate
x0_hat_k = x_{t_k} - t_k v_k (``sde.tweedie_x0``); it is decoded, embedded, and compared with the
embedded final sample: s_k = cos(e(decode(x0_hat_k)), e(decode(x_final))), curves [P, S] float64.

The last entry: with t_S = 0 the last Euler step x_{t_{S-1}} + v (0 - t_{S-1}) is the Tweedie
estimate itself, so x0_hat_{S-1} = x_final (bitwise, with the formulas of ``cast_core.sde``) and
s_{S-1} = 1 exactly. The curve therefore always ends at 1; a schedule that stops at t_S > 0 would
end below 1.

``calibrate_window`` averages the curves over prompts, finds the structure-formation step with
``window.structure_formation_step`` (curvature knee, threshold fallback) and places the SDE window of
the requested size ending at it (``window.window_from_formation``).
``tasks.stages.plots.plot_calibration`` draws it for a person to look at.

Departures (the CAST paper's code is not public): one seed per prompt; CFG as the backbone applies
it, so the curve is the guided sampler's; no smoothing beyond the mean over prompts; the spread
shown is the population std over prompts (0 for one prompt, never NaN).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from cast_core.sampling import encode_conditioning, ode_trajectory
from cast_core.sde import ode_step, tweedie_x0
from cast_core.window import (
    FormationMethod,
    FormationPoint,
    SdeWindow,
    structure_formation_step,
    window_from_formation,
)


@dataclass(frozen=True)
class SimilarityCurves:
    """curves: [P, S] float64, s_k per prompt; sigmas: [S] float64, t_k at which x0_hat_k was
    estimated (t_0 = 1 first)."""

    curves: Tensor
    sigmas: Tensor


@dataclass(frozen=True)
class Calibration:
    """formation: the structure-formation point of the mean curve; window: the SDE window ending
    at it; mean_curve, std_curve: [S] float64, mean and population std over the P prompts."""

    formation: FormationPoint
    window: SdeWindow
    mean_curve: Tensor
    std_curve: Tensor


def cosine_similarity(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise cosine a_i . b_i / sqrt(|a_i|^2 |b_i|^2) in float64. a, b: [N, D] -> [N].

    Written as dot / sqrt(aa * bb) so that cos(e, e) is exactly 1 (sqrt(fl(q^2)) = q in IEEE
    arithmetic). A zero row has no direction: it gives NaN, never a silent 0.
    """
    if a.dim() != 2 or a.shape != b.shape:
        raise ValueError(
            "a and b must both have shape [N, D]; "
            f"got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    a64, b64 = a.double(), b.double()
    dot = (a64 * b64).sum(dim=1)
    return dot / torch.sqrt((a64 * a64).sum(dim=1) * (b64 * b64).sum(dim=1))


@torch.no_grad()
def _chunk_curves(backbone, embedder, prompts: list[str], seeds: list[int], sigmas: Tensor,
                  guidance_scale: float, progress: Callable[[int], object]) -> Tensor:
    """Curves [n, S] float64 for one chunk of n prompts; `progress(1)` after each step."""
    cond, uncond = encode_conditioning(backbone, prompts, guidance_scale)
    x = backbone.initial_noise(seeds)  # [n, C, h, w]
    estimates = []
    for step in ode_trajectory(backbone, cond, uncond, x, sigmas, guidance_scale):
        x0_hat = tweedie_x0(step.x_t, step.v, step.t)
        estimates.append(embedder.embed(backbone.decode(x0_hat)))  # [n, D]
        x = ode_step(step.x_t, step.v, step.t, step.t_next)
        progress(1)
    e_final = embedder.embed(backbone.decode(x))  # [n, D]
    return torch.stack([cosine_similarity(e_k, e_final) for e_k in estimates], dim=1).cpu()


def similarity_curves(backbone, embedder, prompts: list[str], seeds: list[int], num_steps: int,
                      guidance_scale: float, chunk_size: int = 64,
                      progress: Callable[[int], object] | None = None) -> SimilarityCurves:
    """Tweedie similarity curves of P prompts over S = num_steps ODE steps (module docstring).

    backbone: the protocol of ``cast_core.backbones`` (encode_prompts, initial_noise, velocity,
    sigmas, decode); embedder: anything with ``embed(images [N, 3, H, W] in [0, 1]) -> [N, D]``.
    Work runs in chunks of ``chunk_size`` prompts; seeds are per prompt, so chunking does not
    change a curve. `progress`, when given, is called with 1 after each ODE step of each chunk:
    ceil(P / chunk_size) x num_steps calls (for the caller's progress bar). Returns
    SimilarityCurves(curves [P, S], sigmas [S]).
    """
    if len(prompts) != len(seeds) or not prompts:
        raise ValueError(
            f"need one seed per prompt and at least one prompt: got {len(prompts)} prompts and "
            f"{len(seeds)} seeds"
        )
    if num_steps < 1 or chunk_size < 1:
        raise ValueError(f"num_steps and chunk_size must be >= 1; got {num_steps}, {chunk_size}")
    sigmas = backbone.sigmas(num_steps)
    if sigmas.shape != (num_steps + 1,):
        raise ValueError(
            f"backbone.sigmas({num_steps}) must have shape [{num_steps + 1}] (t_0 = 1 ... t_S); "
            f"got {tuple(sigmas.shape)}"
        )
    chunks = [
        _chunk_curves(backbone, embedder, prompts[lo:lo + chunk_size], seeds[lo:lo + chunk_size],
                      sigmas, guidance_scale, progress or (lambda steps: None))
        for lo in range(0, len(prompts), chunk_size)
    ]
    return SimilarityCurves(curves=torch.cat(chunks), sigmas=sigmas[:-1].double().cpu())


def calibrate_window(
    curves: Tensor,
    num_steps: int,
    window_size: int,
    method: FormationMethod = "curvature",
    threshold: float = 0.9,
    min_start: int = 0,
    max_end: int | None = None,
    curvature_tol: float = 0.1,
    range_tol: float = 1e-6,
) -> Calibration:
    """Formation step of the prompt-averaged curve and the window of ``window_size`` steps ending
    at it, within [min_start, max_end). curves: [P, S] (or one curve [S]) with S = num_steps.

    method, threshold, curvature_tol, range_tol: as in ``window.structure_formation_step``.
    """
    s = torch.as_tensor(curves, dtype=torch.float64)
    s = s[None] if s.dim() == 1 else s  # [P, S]
    if s.dim() != 2 or s.shape[1] != num_steps:
        raise ValueError(
            f"curves must have shape [P, S] with S = num_steps = {num_steps}; "
            f"got {tuple(torch.as_tensor(curves).shape)}; pass the num_steps the curves were made with"
        )
    formation = structure_formation_step(
        s, method=method, threshold=threshold, curvature_tol=curvature_tol, range_tol=range_tol
    )
    window = window_from_formation(formation.step, num_steps, window_size, min_start, max_end)
    std = s.std(dim=0, unbiased=False)  # [S]
    return Calibration(formation=formation, window=window, mean_curve=formation.curve,
                       std_curve=std)
