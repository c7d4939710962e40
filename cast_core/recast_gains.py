"""ReCAST gain estimation: per-reward, per-step discriminability of positive vs policy samples.

Variant: the gain estimate of ReCAST; the weighting math (Renyi divergence,
gains, mean normalisation, Sinkhorn) is `cast_core.credit`, used here unchanged. Notation: R
rewards k, S schedule steps t_0 = 1 > ... > t_{S-1} (the backbone's `sigmas(S)` without its final
0), N samples, d_k the dimension of reward k's statistic.

1. Statistics. A reward k is a name with a statistic of decoded images, `statistics(images
   [N, 3, H, W] in [0, 1], graphs) -> {k: [N, d_k]}` (`atom_type_statistics`: the mean verifier
   score of the image's atoms of that type, d = 1, NaN when its graph has none). At each step t
   it is taken on the Tweedie estimate x0_hat_t = x_t - t v(x_t, t) (recipe CFG), decoded:
   - positives (`positive_statistics`): clean latents x0+ (in the shapes world, the encoded
     renders of exact scenes) forward-noised on the straight path, x_t = (1 - t) x0+ + t eps;
   - policy (`policy_statistics`): the policy's own Euler ODE from noise (`ode_trajectory`).
   eps and the policy's initial noise are `backbone.initial_noise(seeds)`: with the same seeds
   the two sets share their noise (common random numbers), so at t_0 = 1 both x_t are the same
   eps and the step-0 statistics coincide.
2. Divergence (`divergence`). Per reward, samples with a non-finite value at any step are dropped
   (n_positive, n_policy count the rest; fewer than 2 on either side raises). At each step a
   diagonal Gaussian is fitted to each set (mean, population variance floored at
   `variance_floor`) and D[k, t] = D_alpha(positive || policy) (`credit.renyi_gaussian`);
   D[k, 0] := 0 (pure noise decides nothing, as in `credit.step_gains`).
3. Weights (`recast_gains`): g = step_gains(D), g~ = mean_normalise(g), W = Sinkhorn plan of
   exp(g~ / tau) with rows = budgets lambda_k and columns sum(lambda) / S.
   `restrict_to_window` keeps the window's gains, re-normalises them and re-runs Sinkhorn over
   the window's K steps (columns sum(lambda) / K), which is what the trainer weights.
4. Training weights (`training_weights`): the loss weights reward k's advantage at window step t
   by K W[k, t] / mean(lambda) (K the window's steps, W over the window). Budgets are relative:
   dividing by mean(lambda) makes equal budgets at a uniform kernel (W[k, t] = lambda_k / K) give
   weight 1 everywhere, i.e. exactly CAST's unweighted map. The static baseline at the same budgets
   (`static_weights`) is lambda_k / mean(lambda) at every step; a uniform kernel gives exactly it.
   Atom types that are not rewards get weight 0.

Why alpha = 0.5 by default: D_0.5 is symmetric in its two arguments and equals
-2 ln BC(P, Q), BC the Bhattacharyya coefficient, so it bounds the Bayes error of telling a
positive from a policy sample by the statistic (error <= BC / 2 = exp(-D_0.5 / 2) / 2): "how
discriminable" in the plain sense. For every alpha < 1 the mixture variance alpha var_q +
(1 - alpha) var_p stays positive, so D is finite whatever the fitted variances; alpha > 1 is
infinite once var_p > alpha / (alpha - 1) var_q, which floored near-constant scores make likely.

Departures (the CAST paper's code is not public): Gaussian fits per step, not a density estimate;
the variance floor is ours (exact renders score ~1 with ~0 spread); positives share the policy's
noise seeds; gains over the full schedule, restricted to a window afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from cast_core.credit import mean_normalise, recast_weights, renyi_gaussian, step_gains
from cast_core.csg.graph import ATOM_TYPES, SceneGraph
from cast_core.sampling import encode_conditioning, ode_trajectory, step_velocity
from cast_core.sde import tweedie_x0

StatisticsFn = Callable[[Tensor, list[SceneGraph]], Mapping[str, Tensor]]
Scorer = Callable[[Tensor, list[SceneGraph]], list[tuple[np.ndarray, np.ndarray]]]


@dataclass(frozen=True)
class StepStatistics:
    """sigmas: [S] float64, the steps' t; values: reward -> [S, N, d_k] float64 (NaN: the sample
    has no such reward)."""

    sigmas: Tensor
    values: Mapping[str, Tensor]


@dataclass(frozen=True)
class RecastGains:
    """Per reward k (row, in `rewards` order) and step (column, t = sigmas[step]):
    sigmas [S]; divergence, gains, normalised, W: [R, S] float64 (W rows sum to budgets, columns
    to sum(budgets) / S); n_positive, n_policy: [R] int64 samples fitted; budgets: [R] float64;
    alpha, tau: the divergence order and kernel temperature."""

    rewards: tuple[str, ...]
    sigmas: Tensor
    divergence: Tensor
    gains: Tensor
    normalised: Tensor
    W: Tensor
    n_positive: Tensor
    n_policy: Tensor
    budgets: Tensor
    alpha: float
    tau: float


def atom_type_statistics(score: Scorer, types: tuple[str, ...] = ATOM_TYPES) -> StatisticsFn:
    """Statistics {type: [N, 1]}: the mean score of each image's atoms of that type (NaN when
    its graph has none), from a scorer `score(images, graphs) -> [(scores [A], heatmaps)]`."""
    unknown = sorted(set(types) - set(ATOM_TYPES))
    if unknown:
        raise ValueError(f"unknown atom types {unknown}; choose from {ATOM_TYPES}")

    def statistics(images: Tensor, graphs: list[SceneGraph]) -> dict[str, Tensor]:
        out = {k: torch.full((len(graphs), 1), float("nan"), dtype=torch.float64) for k in types}
        for i, (graph, (scores, _)) in enumerate(zip(graphs, score(images, graphs), strict=True)):
            kinds = np.array([a.type for a in graph.atoms()])
            for k in types:
                if (kinds == k).any():
                    out[k][i, 0] = float(np.asarray(scores, dtype=np.float64)[kinds == k].mean())
        return out

    return statistics


def _schedule(backbone, num_steps: int) -> Tensor:
    sigmas = backbone.sigmas(num_steps)
    if num_steps < 1 or sigmas.shape != (num_steps + 1,):
        raise ValueError(f"need num_steps >= 1 and backbone.sigmas({num_steps}) of shape "
                         f"[{num_steps + 1}]; got {tuple(sigmas.shape)}")
    return sigmas


def _score(backbone, statistics: StatisticsFn, x0_hat: Tensor, graphs: list) -> dict[str, Tensor]:
    values = statistics(backbone.decode(x0_hat), graphs)
    return {k: torch.as_tensor(v, dtype=torch.float64).cpu() for k, v in values.items()}


@torch.no_grad()
def _chunk(backbone, x0: Tensor | None, prompts, graphs, seeds, sigmas: Tensor,
           guidance_scale: float, statistics: StatisticsFn) -> list[dict[str, Tensor]]:
    """Per step, {k: [n, d_k]} for one chunk; policy ODE when x0 is None, else positives."""
    cond, uncond = encode_conditioning(backbone, prompts, guidance_scale)
    eps = backbone.initial_noise(seeds)  # [n, C, h, w]
    if x0 is None:
        return [_score(backbone, statistics, tweedie_x0(s.x_t, s.v, s.t), graphs)
                for s in ode_trajectory(backbone, cond, uncond, eps, sigmas, guidance_scale)]
    x0 = x0.to(eps)
    out = []
    for k in range(len(sigmas) - 1):
        t = float(sigmas[k])
        x_t = (1.0 - t) * x0 + t * eps  # [n, C, h, w]
        v = step_velocity(backbone, x_t, t, cond, uncond, guidance_scale)
        out.append(_score(backbone, statistics, tweedie_x0(x_t, v, t), graphs))
    return out


def _collect(backbone, x0, prompts, graphs, seeds, num_steps, guidance_scale, statistics,
             chunk_size) -> StepStatistics:
    if not prompts or not len(prompts) == len(graphs) == len(seeds):
        raise ValueError(f"need one graph and seed per prompt, at least one: got {len(prompts)} "
                         f"prompts, {len(graphs)} graphs, {len(seeds)} seeds")
    if x0 is not None and x0.shape[0] != len(prompts):
        raise ValueError(f"need one positive latent per prompt: got {x0.shape[0]}, "
                         f"{len(prompts)} prompts")
    sigmas = _schedule(backbone, num_steps)
    chunks = [_chunk(backbone, None if x0 is None else x0[lo:lo + chunk_size],
                     prompts[lo:lo + chunk_size], graphs[lo:lo + chunk_size],
                     seeds[lo:lo + chunk_size], sigmas, guidance_scale, statistics)
              for lo in range(0, len(prompts), chunk_size)]
    values = {k: torch.stack([torch.cat([c[s][k] for c in chunks]) for s in range(num_steps)])
              for k in chunks[0][0]}  # [S, N, d_k]
    return StepStatistics(sigmas=sigmas[:-1].double().cpu(), values=values)


def positive_statistics(backbone, x0: Tensor, prompts: list[str], graphs: list[SceneGraph],
                        seeds: list[int], num_steps: int, guidance_scale: float,
                        statistics: StatisticsFn, chunk_size: int = 64) -> StepStatistics:
    """Statistics of forward-noised positives x0 [N, C, h, w] (latents) at the S steps."""
    return _collect(backbone, x0, prompts, graphs, seeds, num_steps, guidance_scale, statistics,
                    chunk_size)


def policy_statistics(backbone, prompts: list[str], graphs: list[SceneGraph], seeds: list[int],
                      num_steps: int, guidance_scale: float, statistics: StatisticsFn,
                      chunk_size: int = 64) -> StepStatistics:
    """Statistics of the policy's ODE trajectories from `initial_noise(seeds)` at the S steps."""
    return _collect(backbone, None, prompts, graphs, seeds, num_steps, guidance_scale, statistics,
                    chunk_size)


def _fit(x: Tensor, floor: float) -> tuple[Tensor, Tensor]:
    """Gaussian fit over samples: x [S, n, d] -> mean, variance (floored) [S, d]."""
    return x.mean(dim=1), x.var(dim=1, correction=0).clamp_min(floor)


def _finite_rows(name: str, side: str, x: Tensor) -> Tensor:
    keep = torch.isfinite(x).all(dim=2).all(dim=0)  # [N]
    if int(keep.sum()) < 2:
        raise ValueError(f"reward {name!r}: only {int(keep.sum())} {side} samples have a finite "
                         f"statistic (2 needed); add prompts that carry it or drop the reward")
    return x[:, keep]


def divergence(positive: StepStatistics, policy: StepStatistics, rewards: tuple[str, ...],
               alpha: float, variance_floor: float) -> tuple[Tensor, Tensor, Tensor]:
    """(D [R, S] float64 with D[:, 0] = 0, n_positive [R], n_policy [R]); module docstring."""
    if not torch.equal(positive.sigmas, policy.sigmas):
        raise ValueError("positive and policy statistics come from different schedules; collect "
                         "both with the same backbone and num_steps")
    if not variance_floor > 0:
        raise ValueError(f"variance_floor must be > 0; got {variance_floor}")
    missing = [k for k in rewards if k not in positive.values or k not in policy.values]
    if missing:
        raise ValueError(f"rewards {missing} have no statistics; statistics hold "
                         f"{sorted(positive.values)}")
    rows, n_p, n_q = [], [], []
    for k in rewards:
        p = _finite_rows(k, "positive", positive.values[k])  # [S, n_p, d]
        q = _finite_rows(k, "policy", policy.values[k])  # [S, n_q, d]
        rows.append(renyi_gaussian(*_fit(p, variance_floor), *_fit(q, variance_floor), alpha))
        n_p.append(p.shape[1])
        n_q.append(q.shape[1])
    d = torch.stack(rows).double()  # [R, S]
    d[:, 0] = 0.0
    return d, torch.tensor(n_p), torch.tensor(n_q)


def _weights(gains: Tensor, budgets: Tensor, tau: float) -> tuple[Tensor, Tensor]:
    normalised = mean_normalise(gains)
    plan = recast_weights(normalised, budgets, tau)
    if not plan.converged:
        raise RuntimeError(f"Sinkhorn did not converge (marginal error {plan.marginal_error:.2e} "
                           f"after {plan.iterations} iterations); raise tau")
    return normalised, plan.W


def recast_gains(positive: StepStatistics, policy: StepStatistics, budgets: Mapping[str, float],
                 alpha: float = 0.5, tau: float = 1.0,
                 variance_floor: float = 1e-4) -> RecastGains:
    """Divergence, gains and Sinkhorn weights over the full schedule; rewards in budgets' order."""
    rewards = tuple(budgets)
    if not rewards:
        raise ValueError("budgets must name at least one reward")
    lam = torch.tensor([float(budgets[k]) for k in rewards], dtype=torch.float64)  # [R]
    d, n_p, n_q = divergence(positive, policy, rewards, alpha, variance_floor)
    gains = step_gains(d)
    normalised, W = _weights(gains, lam, tau)
    return RecastGains(rewards, positive.sigmas, d, gains, normalised, W, n_p, n_q, lam,
                       float(alpha), float(tau))


def restrict_to_window(result: RecastGains, start: int, end: int) -> RecastGains:
    """The window's steps [start, end): gains kept, re-normalised, Sinkhorn over K = end - start."""
    S = result.sigmas.shape[0]
    if not 0 <= start < end <= S:
        raise ValueError(f"window [{start}, {end}) must satisfy 0 <= start < end <= {S}")
    gains = result.gains[:, start:end]
    normalised, W = _weights(gains, result.budgets, result.tau)
    return RecastGains(result.rewards, result.sigmas[start:end],
                       result.divergence[:, start:end], gains, normalised, W, result.n_positive,
                       result.n_policy, result.budgets, result.alpha, result.tau)


def _budget_scale(budgets: Tensor) -> Tensor:
    if budgets.dim() != 1 or budgets.numel() == 0 or not bool((budgets > 0).all()):
        raise ValueError(f"budgets must be a non-empty vector of values > 0; got {budgets.tolist()}")
    return budgets.double().mean()


def _by_type(rewards: tuple[str, ...], rows: Tensor, types: tuple[str, ...]) -> Tensor:
    """rows [R, K] in `rewards` order -> [len(types), K] in `types` order, 0 for non-rewards."""
    unknown = sorted(set(rewards) - set(types))
    if unknown:
        raise ValueError(f"rewards {unknown} are not among the types {types}")
    out = torch.zeros(len(types), rows.shape[1], dtype=torch.float64)
    for k, name in enumerate(rewards):
        out[types.index(name)] = rows[k]
    return out


def training_weights(result: RecastGains, types: tuple[str, ...] = ATOM_TYPES) -> Tensor:
    """[len(types), K] float64: K W[k, t] / mean(budgets) per type (0 for a type that is not a
    reward), K = the steps of `result` (pass `restrict_to_window`'s result). Module docstring."""
    num_steps = result.W.shape[1]
    rows = num_steps * result.W.double() / _budget_scale(result.budgets)  # [R, K]
    return _by_type(result.rewards, rows, types)


def static_weights(budgets: Mapping[str, float], num_steps: int,
                   types: tuple[str, ...] = ATOM_TYPES) -> Tensor:
    """[len(types), K] float64: lambda_k / mean(lambda) at every one of the K = num_steps steps
    (0 for a type without a budget): the static weighting ReCAST is compared against."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1; got {num_steps}")
    lam = torch.tensor([float(v) for v in budgets.values()], dtype=torch.float64)  # [R]
    rows = (lam / _budget_scale(lam))[:, None].expand(-1, num_steps)  # [R, K]
    return _by_type(tuple(budgets), rows, types)
