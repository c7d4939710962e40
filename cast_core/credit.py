"""ReCAST: per-reward, per-step credit from discriminability gains, balanced by Sinkhorn.

Variant: ReCAST. Rewards k = 0..R-1, window steps t = 0..T-1 with t = 0
the step at pure noise.

1. Discriminability D[k, t] >= 0: how well reward k's statistic on x0_hat_t separates positive
   samples from policy samples, as a Renyi divergence between Gaussian fits (`renyi_gaussian`).
   D is cumulative: it measures what is decided by step t.
2. Gains (`step_gains`): D[k, 0] := 0 (at pure noise the two distributions coincide; a nonzero
   estimate there is noise), g[k, t] = max(D[k, t] - D[k, t-1], 0) with D[k, -1] := 0. The clamp is
   ours: D should grow along the trajectory, and a decrease in a noisy estimate is read as "no gain"
   rather than negative credit. So g[k, 0] = 0 always.
3. `mean_normalise`: g[k, :] / mean_t g[k, :], so rewards with different divergence scales are
   comparable; a row whose mean is <= eps stays all zero (it then gets a uniform kernel row).
4. `recast_weights`: kernel exp(g / tau); `sinkhorn` (log domain, float64) finds
   W = diag(u) K diag(v) with rows summing to the budgets lambda_k and every column to
   sum(lambda) / T. The trainer weights reward k's advantage at step t by T W[k, t]; with a
   uniform kernel W = lambda / T, the static weighting.

Renyi divergence of order alpha between diagonal Gaussians P = N(mu_p, var_p), Q = N(mu_q, var_q),
D_alpha(P || Q) = log E_Q[(p/q)^alpha] / (alpha - 1), in closed form per dimension:
    ln(s_q / s_p) + ln(var_q / var_a) / (2 (alpha - 1)) + alpha (mu_p - mu_q)^2 / (2 var_a),
    var_a = alpha var_q + (1 - alpha) var_p   (must be > 0, else the divergence is infinite),
summed over the last dim (the statistic's dimension; a scalar statistic is shape [..., 1], and
0-d inputs are read as one dimension). alpha = 1 (the KL limit) is rejected: use
cast_core.loss.gaussian_kl for it.
"""

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SinkhornResult:
    """W [R, T] transport plan (dtype of the log-kernel); iterations run; marginal_error: max
    absolute deviation of row sums from budgets and column sums from sum(budgets)/T (float64);
    converged: marginal_error <= tol."""

    W: Tensor
    iterations: int
    marginal_error: float
    converged: bool


def renyi_gaussian(
    mu_p: Tensor, var_p: Tensor, mu_q: Tensor, var_q: Tensor, alpha: float
) -> Tensor:
    """D_alpha(N(mu_p, var_p) || N(mu_q, var_q)) for diagonal Gaussians over the last dim.

    Inputs broadcast to [..., d]; returns [...]. alpha > 0, alpha != 1.
    """
    if alpha <= 0 or alpha == 1:
        raise ValueError(
            f"alpha must be > 0 and != 1, got {alpha}; for alpha = 1 use loss.gaussian_kl"
        )
    mu_p, var_p, mu_q, var_q = torch.broadcast_tensors(mu_p, var_p, mu_q, var_q)
    if (var_p <= 0).any() or (var_q <= 0).any():
        raise ValueError("variances must be > 0; add a small floor to the fitted variances")
    var_a = alpha * var_q + (1.0 - alpha) * var_p  # [..., d]
    if (var_a <= 0).any():
        raise ValueError(
            f"alpha * var_q + (1 - alpha) * var_p must be > 0 (else D_alpha is infinite); "
            f"got alpha={alpha}: use a smaller alpha"
        )
    terms = (
        0.5 * torch.log(var_q / var_p)
        + torch.log(var_q / var_a) / (2.0 * (alpha - 1.0))
        + alpha * (mu_p - mu_q) ** 2 / (2.0 * var_a)
    )  # [..., d]
    return terms.sum(dim=-1) if terms.dim() > 0 else terms


def step_gains(divergence: Tensor) -> Tensor:
    """Non-negative per-step gains [R, T] from cumulative divergence [R, T] (t = 0 pure noise)."""
    if divergence.dim() != 2 or not torch.isfinite(divergence).all():
        raise ValueError(
            f"divergence must be a finite [R, T] tensor, got shape {tuple(divergence.shape)}"
        )
    d = divergence.clone()
    d[:, 0] = 0.0  # pure noise decides nothing
    previous = torch.cat([torch.zeros_like(d[:, :1]), d[:, :-1]], dim=1)  # [R, T], D[k, -1] = 0
    return (d - previous).clamp_min(0.0)


def mean_normalise(gains: Tensor, eps: float = 1e-12) -> Tensor:
    """gains [R, T] >= 0 divided by each row's mean over t; rows with mean <= eps become zero."""
    if gains.dim() != 2 or (gains < 0).any():
        raise ValueError("gains must be a non-negative [R, T] tensor; build them with step_gains")
    row_mean = gains.mean(dim=1, keepdim=True)  # [R, 1]
    live = row_mean > eps
    return torch.where(live, gains / row_mean.clamp_min(eps), torch.zeros_like(gains))


def _marginal_error(log_w: Tensor, log_rows: Tensor, log_col: Tensor) -> float:
    w = log_w.exp()
    row_err = (w.sum(dim=1) - log_rows.exp()).abs().max()
    col_err = (w.sum(dim=0) - log_col.exp()).abs().max()
    return float(torch.maximum(row_err, col_err))


def sinkhorn(
    log_kernel: Tensor, budgets: Tensor, max_iters: int = 1000, tol: float = 1e-9
) -> SinkhornResult:
    """Log-domain Sinkhorn: W = exp(log_kernel + f[:, None] + g[None, :]) with
    W.sum(1) = budgets [R] and W.sum(0) = budgets.sum() / T for each of the T columns."""
    if log_kernel.dim() != 2 or budgets.shape != log_kernel.shape[:1]:
        raise ValueError(
            f"need log_kernel [R, T] and budgets [R]: got {tuple(log_kernel.shape)}, {tuple(budgets.shape)}"
        )
    if (
        not torch.isfinite(log_kernel).all()
        or not (budgets > 0).all()
        or not torch.isfinite(budgets).all()
    ):
        raise ValueError(
            "log_kernel must be finite and budgets finite and > 0; drop zero-budget rewards"
        )
    if max_iters < 1 or tol <= 0:
        raise ValueError(f"need max_iters >= 1 and tol > 0: got {max_iters}, {tol}")
    log_k = log_kernel.to(torch.float64)
    log_rows = budgets.to(torch.float64).log()  # [R]
    T = log_k.shape[1]
    log_col = (log_rows.exp().sum() / T).log().expand(T)  # [T]
    g = torch.zeros_like(log_col)
    error, iterations = float("inf"), 0
    while iterations < max_iters and error > tol:
        f = log_rows - torch.logsumexp(log_k + g[None, :], dim=1)  # [R]
        g = log_col - torch.logsumexp(log_k + f[:, None], dim=0)  # [T]
        iterations += 1
        error = _marginal_error(log_k + f[:, None] + g[None, :], log_rows, log_col)
    W = (log_k + f[:, None] + g[None, :]).exp().to(log_kernel.dtype)  # [R, T]
    return SinkhornResult(W, iterations, error, error <= tol)


def recast_weights(
    gains: Tensor, budgets: Tensor, tau: float, max_iters: int = 1000, tol: float = 1e-9
) -> SinkhornResult:
    """Sinkhorn plan for kernel exp(gains / tau); gains [R, T] (mean-normalised), budgets [R]."""
    if tau <= 0:
        raise ValueError(
            f"tau must be > 0, got {tau}; smaller tau concentrates weight on peak steps"
        )
    return sinkhorn(gains / tau, budgets, max_iters=max_iters, tol=tol)
