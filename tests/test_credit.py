"""ReCAST math: Renyi divergence vs Monte Carlo, gains, normalisation, Sinkhorn marginals."""

import math

import pytest
import torch

from cast_core.credit import mean_normalise, recast_weights, renyi_gaussian, sinkhorn, step_gains

R, T = 4, 10


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_sinkhorn_marginals_on_random_kernels(seed):
    g = torch.Generator().manual_seed(seed)
    log_k = 3 * torch.randn(R, T, generator=g, dtype=torch.float64)
    budgets = 0.1 + 2 * torch.rand(R, generator=g, dtype=torch.float64)
    out = sinkhorn(log_k, budgets)
    assert out.converged
    torch.testing.assert_close(out.W.sum(dim=1), budgets, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        out.W.sum(dim=0),
        torch.full((T,), float(budgets.sum()) / T, dtype=torch.float64),
        rtol=0,
        atol=1e-6,
    )
    # the plan keeps the kernel's structure: W / K has rank one (log W - log K = f + g)
    log_ratio = out.W.log() - log_k
    centred = log_ratio - log_ratio[:, :1] - log_ratio[:1, :] + log_ratio[0, 0]
    torch.testing.assert_close(centred, torch.zeros(R, T, dtype=torch.float64), rtol=0, atol=1e-8)


def test_uniform_kernel_gives_static_weighting():
    budgets = torch.tensor([0.5, 1.0, 2.0, 0.25], dtype=torch.float64)
    out = recast_weights(torch.zeros(R, T, dtype=torch.float64), budgets, tau=0.7)
    expected = (budgets / T)[:, None].expand(R, T)
    torch.testing.assert_close(out.W, expected)
    torch.testing.assert_close(T * out.W, budgets[:, None].expand(R, T))
    assert out.iterations == 1


def test_gain_spike_receives_most_of_its_weight_there():
    budgets = torch.ones(R, dtype=torch.float64)
    divergence = torch.linspace(0, 1, T, dtype=torch.float64).repeat(R, 1)  # steady gains
    divergence[0] = 0.0
    divergence[0, 6:] = 3.0  # reward 0 is decided at step 6 only
    gains = mean_normalise(step_gains(divergence))
    out = recast_weights(gains, budgets, tau=0.5)
    column = float(budgets.sum()) / T
    assert int(out.W[0].argmax()) == 6
    assert out.W[0, 6] >= 0.9 * column  # reward 0 takes most of that step
    assert out.W[0, 6] > 3 * out.W[0].sum() / T


def test_renyi_of_equal_gaussians_is_zero():
    mu = torch.tensor([[0.3, -1.0, 2.0]], dtype=torch.float64)
    var = torch.tensor([[0.5, 1.0, 3.0]], dtype=torch.float64)
    for alpha in (0.3, 0.5, 2.0):
        assert renyi_gaussian(mu, var, mu, var, alpha).abs().item() < 1e-12


def _vec(v: float) -> torch.Tensor:
    return torch.tensor([v], dtype=torch.float64)  # one-dimensional Gaussian


@pytest.mark.parametrize(
    "mu_p, s_p, mu_q, s_q, alpha",
    [(0.0, 1.0, 1.0, 1.3, 0.5), (1.0, 0.8, 0.0, 1.0, 2.0), (0.5, 0.7, -0.5, 1.0, 0.7)],
)
def test_renyi_matches_monte_carlo(mu_p, s_p, mu_q, s_q, alpha):
    n = 200_000
    g = torch.Generator().manual_seed(7)
    x = mu_q + s_q * torch.randn(n, generator=g, dtype=torch.float64)  # x ~ Q
    log_p = torch.distributions.Normal(mu_p, s_p).log_prob(x)
    log_q = torch.distributions.Normal(mu_q, s_q).log_prob(x)
    log_w = alpha * (log_p - log_q)  # log (p/q)^alpha
    mc = (torch.logsumexp(log_w, dim=0) - math.log(n)) / (alpha - 1)
    # delta-method standard error of the estimate: the 5% tolerance is >= 3.5 of them
    w = log_w.exp()
    mc_se = w.std() / (math.sqrt(n) * w.mean() * abs(alpha - 1))
    closed = renyi_gaussian(_vec(mu_p), _vec(s_p**2), _vec(mu_q), _vec(s_q**2), alpha)
    assert closed.dim() == 0
    assert mc_se.item() < 0.015 * closed.item()
    assert closed.item() == pytest.approx(mc.item(), rel=0.05)


def test_renyi_sums_over_last_dim_and_rejects_bad_alpha():
    mu_p, var_p = torch.tensor([0.0, 1.0]), torch.tensor([1.0, 2.0])
    mu_q, var_q = torch.tensor([0.5, 0.0]), torch.tensor([1.5, 1.0])
    per_dim = [
        renyi_gaussian(mu_p[i : i + 1], var_p[i : i + 1], mu_q[i : i + 1], var_q[i : i + 1], 0.5)
        for i in range(2)
    ]
    torch.testing.assert_close(
        renyi_gaussian(mu_p, var_p, mu_q, var_q, 0.5), per_dim[0] + per_dim[1]
    )
    with pytest.raises(ValueError, match="alpha"):
        renyi_gaussian(mu_p, var_p, mu_q, var_q, 1.0)
    with pytest.raises(ValueError, match="> 0"):
        # alpha var_q + (1 - alpha) var_p = 3 * 1 - 2 * 4 < 0
        renyi_gaussian(torch.zeros(1), torch.full((1,), 4.0), torch.zeros(1), torch.ones(1), 3.0)


def test_identical_distributions_give_zero_gains():
    assert torch.equal(step_gains(torch.zeros(R, T)), torch.zeros(R, T))


def test_step_gains_formula():
    d = torch.tensor([[0.4, 1.0, 0.7, 2.0], [0.0, 0.0, 0.5, 0.5]])
    # D[:, 0] := 0; g = max(D[t] - D[t-1], 0)
    expected = torch.tensor([[0.0, 1.0 - 0.0, 0.0, 2.0 - 0.7], [0.0, 0.0, 0.5, 0.0]])
    torch.testing.assert_close(step_gains(d), expected)


def test_mean_normalise_formula_and_zero_rows():
    g = torch.tensor([[0.0, 1.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    out = mean_normalise(g)
    torch.testing.assert_close(out[0], g[0] / 1.0)  # row mean (0 + 1 + 3 + 0) / 4 = 1
    assert torch.equal(out[1], torch.zeros(4))
    torch.testing.assert_close(mean_normalise(2.5 * g[:1]), out[:1])  # scale-free
