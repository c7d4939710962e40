"""Flow-matching steps against closed forms: Normal log-pdfs, exact ODE solutions, Tweedie on a
linear path, the a = 0 limit, and the noise statistics of both SDE kinds."""

import itertools
import math

import pytest
import torch

from cast_core.sde import (
    cps_mean_std,
    flow_sde_mean_std,
    gaussian_log_prob,
    ode_step,
    sde_mean_std,
    sde_step,
    tweedie_eps,
    tweedie_x0,
)

KINDS = ["flow_sde", "cps"]


def _latents(seed: int, shape=(3, 4, 2, 5), dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_gaussian_log_prob_matches_torch_normal_per_position():
    x, mean = _latents(0), _latents(1)
    std = torch.tensor([0.3, 1.0, 2.5]).reshape(3, 1, 1, 1)
    expected = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(x).mean(dim=1)
    got = gaussian_log_prob(x, mean, std)
    assert got.shape == (3, 2, 5) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_gaussian_log_prob_accepts_one_position_dim_and_floors_zero_std():
    x = _latents(2, shape=(2, 3, 7))
    got = gaussian_log_prob(x, x.clone(), torch.zeros(2, 1, 1), std_floor=1e-3)
    expected = torch.full((2, 7), -math.log(1e-3) - 0.5 * math.log(2 * math.pi))
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("t, t_next", [(1.0, 0.95), (0.6, 0.55), (0.04, 0.0)])
def test_zero_noise_level_is_exactly_the_ode_step(kind, t, t_next):
    x_t, v = _latents(3), _latents(4)
    step = sde_step(x_t, v, t, t_next, 0.0, kind, generator=torch.Generator().manual_seed(0))
    assert torch.equal(step.x_next, ode_step(x_t, v, t, t_next))
    assert torch.equal(step.mean, step.x_next)
    torch.testing.assert_close(step.x_next, x_t + v * (t_next - t), rtol=0, atol=1e-6)
    assert torch.equal(step.std, torch.zeros_like(step.std))
    assert torch.isfinite(step.log_prob).all()


def test_constant_velocity_is_integrated_exactly():
    x0, eps = _latents(5, dtype=torch.float64), _latents(6, dtype=torch.float64)
    sigmas = torch.linspace(1.0, 0.0, 11, dtype=torch.float64)
    x = eps.clone()
    for t, t_next in itertools.pairwise(sigmas):
        x = ode_step(x, eps - x0, t, t_next)
    torch.testing.assert_close(x, x0, rtol=0, atol=1e-12)


def _gaussian_data_velocity(x, t, m, s):
    """Optimal v(x, t) = E[eps - x0 | x_t = x] for x0 ~ N(m, s^2), eps ~ N(0, 1) per dim."""
    var_t = (1 - t) ** 2 * s**2 + t**2
    return -m + (t - (1 - t) * s**2) / var_t * (x - (1 - t) * m)


def _euler_endpoint_error(num_steps: int, m: float, s: float) -> float:
    z = _latents(7, dtype=torch.float64)
    sigmas = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    x = z.clone()
    for t, t_next in itertools.pairwise(sigmas):
        x = ode_step(x, _gaussian_data_velocity(x, t, m, s), t, t_next)
    return float((x - (m + s * z)).abs().max())  # the exact flow maps z to m + s z


def test_gaussian_data_ode_endpoint_converges_with_step_count():
    m, s = 1.5, 0.4
    errors = [_euler_endpoint_error(n, m, s) for n in (25, 50, 100)]
    assert errors[2] < 3e-2
    assert errors[1] < 0.6 * errors[0] and errors[2] < 0.6 * errors[1]  # first order: ~halves


def test_flow_sde_preserves_gaussian_data_marginals():
    m, s, a, num_steps = 1.5, 0.4, 0.5, 100
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(4000, 1, 1, generator=gen, dtype=torch.float64)
    sigmas = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    for t, t_next in itertools.pairwise(sigmas):
        v = _gaussian_data_velocity(x, t, m, s)
        x = sde_step(x, v, t, t_next, a, "flow_sde", generator=gen).x_next
    assert abs(float(x.mean()) - m) < 0.03
    assert abs(float(x.std()) - s) < 0.03


def test_tweedie_recovers_x0_and_eps_on_a_linear_path():
    x0, eps = _latents(9, dtype=torch.float64), _latents(10, dtype=torch.float64)
    t = torch.tensor([1.0, 0.37, 0.0], dtype=torch.float64)
    t_b = t.reshape(3, 1, 1, 1)
    x_t, v = (1 - t_b) * x0 + t_b * eps, eps - x0
    torch.testing.assert_close(tweedie_x0(x_t, v, t), x0, rtol=0, atol=1e-12)
    torch.testing.assert_close(tweedie_eps(x_t, v, t), eps, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("t, t_next", [(1.0, 0.9), (0.1, 0.0)])
def test_first_and_last_steps_are_finite(kind, t, t_next):
    step = sde_step(_latents(11), _latents(12), t, t_next, 0.9, kind, noise=_latents(13))
    for value in (step.x_next, step.log_prob, step.mean, step.std):
        assert torch.isfinite(value).all()
    if kind == "cps" and t_next == 0.0:
        assert torch.equal(step.std, torch.zeros_like(step.std))


def test_flow_sde_first_step_uses_the_second_sigma_as_flow_grpo():
    """Flow-GRPO's step at sigma = 1: std_dev_t = a sqrt(sigma / (1 - sigma_max)) with sigma_max
    the schedule's second sigma, mean = x (1 + std_dev_t^2 / (2 sigma) dt)
    + v (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) dt, noise std std_dev_t sqrt(-dt)."""
    x_t, v = _latents(14, dtype=torch.float64), _latents(15, dtype=torch.float64)
    a, t, t_next = 0.7, 1.0, 0.9
    dt = t_next - t
    std_dev_t = a * math.sqrt(t / (1 - t_next))
    step = flow_sde_mean_std(x_t, v, t, t_next, a)
    torch.testing.assert_close(step.std, torch.full((3, 1, 1, 1), std_dev_t * math.sqrt(-dt),
                                                    dtype=torch.float64))
    expected_mean = (x_t * (1 + std_dev_t**2 / (2 * t) * dt)
                     + v * (1 + std_dev_t**2 * (1 - t) / (2 * t)) * dt)
    torch.testing.assert_close(step.mean, expected_mean)


def test_flow_sde_clamps_t_below_one_with_t_max():
    a, t_max = 0.7, 0.95
    step = flow_sde_mean_std(_latents(14), _latents(15), 0.98, 0.97, a, t_max=t_max)
    expected = a * math.sqrt(0.98 / (1.0 - t_max)) * math.sqrt(0.01)
    torch.testing.assert_close(step.std, torch.full((3, 1, 1, 1), expected))


def test_flow_sde_matches_flow_grpo_expanded_form():
    x_t, v = _latents(16, dtype=torch.float64), _latents(17, dtype=torch.float64)
    a, t, t_next = 0.7, 0.6, 0.5
    s = a * math.sqrt(t / (1 - t))
    dt = t_next - t
    expected_mean = x_t * (1 + s**2 / (2 * t) * dt) + v * (1 + s**2 * (1 - t) / (2 * t)) * dt
    step = flow_sde_mean_std(x_t, v, t, t_next, a)
    torch.testing.assert_close(step.mean, expected_mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(step.std, torch.full_like(step.std, s * math.sqrt(-dt)))


def test_cps_matches_the_coefficients_preserving_form():
    x_t, v = _latents(18, dtype=torch.float64), _latents(19, dtype=torch.float64)
    a, t, t_next = 0.6, 0.6, 0.5
    std = t_next * math.sin(a * math.pi / 2)
    x0_hat, eps_hat = x_t - t * v, x_t + (1 - t) * v
    expected_mean = (1 - t_next) * x0_hat + math.sqrt(t_next**2 - std**2) * eps_hat
    step = cps_mean_std(x_t, v, t, t_next, a)
    torch.testing.assert_close(step.mean, expected_mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(step.std, torch.full_like(step.std, std))


@pytest.mark.parametrize("kind", KINDS)
def test_sde_step_log_prob_equals_replayed_log_prob(kind):
    x_t, v = _latents(20), _latents(21)
    step = sde_step(x_t, v, 0.7, 0.6, 0.8, kind, generator=torch.Generator().manual_seed(1))
    replay = sde_mean_std(x_t, v, 0.7, 0.6, 0.8, kind)
    torch.testing.assert_close(
        step.log_prob, gaussian_log_prob(step.x_next, replay.mean, replay.std)
    )


@pytest.mark.parametrize("kind", KINDS)
def test_empirical_noise_matches_std(kind):
    x_t, v = _latents(22, shape=(2, 20000, 1, 1)), _latents(23, shape=(2, 20000, 1, 1))
    step = sde_step(x_t, v, 0.7, 0.6, 0.8, kind, generator=torch.Generator().manual_seed(2))
    residual = step.x_next - step.mean  # [2, 20000, 1, 1]
    empirical = residual.std(dim=1).reshape(2)
    torch.testing.assert_close(empirical, step.std.reshape(2), rtol=0.03, atol=0)
    assert residual.mean(dim=1).abs().max() < 4 * float(step.std.max()) / math.sqrt(20000)


def test_cps_keeps_the_path_coefficients():
    gen = torch.Generator().manual_seed(3)
    shape = (1, 40000, 1, 1)
    x0, eps = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    a, t, t_next = 0.7, 0.6, 0.45
    x_t, v = (1 - t) * x0 + t * eps, eps - x0  # on the path, oracle velocity
    x_next = sde_step(x_t, v, t, t_next, a, "cps", generator=gen).x_next
    residual = x_next - (1 - t_next) * x0  # t_next (cos eps + sin z): variance t_next^2
    assert abs(float((residual**2).mean()) - t_next**2) < 0.02 * t_next**2
    assert abs(float((residual * eps).mean()) - t_next * math.cos(a * math.pi / 2)) < 0.01


def test_per_sample_times_match_scalar_times():
    x_t, v, noise = _latents(24), _latents(25), _latents(26)
    t, t_next = torch.tensor([1.0, 0.5, 0.2]), torch.tensor([0.9, 0.4, 0.0])
    batched = sde_step(x_t, v, t, t_next, 0.7, "flow_sde", noise=noise)
    for i in range(3):
        single = sde_step(
            x_t[i : i + 1],
            v[i : i + 1],
            float(t[i]),
            float(t_next[i]),
            0.7,
            "flow_sde",
            noise=noise[i : i + 1],
        )
        torch.testing.assert_close(batched.x_next[i : i + 1], single.x_next)
        torch.testing.assert_close(batched.log_prob[i : i + 1], single.log_prob)


def test_generator_makes_steps_reproducible():
    x_t, v = _latents(27), _latents(28)
    first = sde_step(x_t, v, 0.7, 0.6, 0.7, "cps", generator=torch.Generator().manual_seed(4))
    second = sde_step(x_t, v, 0.7, 0.6, 0.7, "cps", generator=torch.Generator().manual_seed(4))
    assert torch.equal(first.x_next, second.x_next)


def test_bfloat16_latents_keep_their_dtype_and_fp32_log_probs():
    x_t, v = _latents(29).bfloat16(), _latents(30).bfloat16()
    step = sde_step(x_t, v, 0.7, 0.6, 0.7, "flow_sde", generator=torch.Generator().manual_seed(5))
    assert step.x_next.dtype == step.mean.dtype == torch.bfloat16
    assert step.log_prob.dtype == torch.float32


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: sde_step(x, x, 0.5, 0.4, 0.5, "ddim"), "kind"),
        (lambda x: sde_step(x, x, 0.5, 0.6, 0.5, "cps"), "t_next < t"),
        (lambda x: sde_step(x, x, 1.2, 0.6, 0.5, "cps"), "t <= 1"),
        (lambda x: sde_step(x, x, 0.5, 0.4, -0.1, "flow_sde"), "noise_level"),
        (lambda x: sde_step(x, x, 0.5, 0.4, 1.5, "cps"), "noise_level"),
        (lambda x: flow_sde_mean_std(x, x, 0.5, 0.4, 0.5, t_max=1.0), "t_max"),
        (lambda x: sde_step(x, x, torch.ones(2), 0.4, 0.5, "cps"), r"\[N\] tensor"),
        (lambda x: sde_step(x, x, 0.5, 0.4, 0.5, "cps", noise=x[:1]), "noise must have"),
        (
            lambda x: sde_step(x, x, 0.5, 0.4, 0.5, "cps", noise=x, generator=torch.Generator()),
            "not both",
        ),
        (lambda x: ode_step(x[0, 0], x[0, 0], 0.5, 0.4), "layout"),
        (lambda x: gaussian_log_prob(x, x, torch.ones(1), std_floor=0.0), "std_floor"),
    ],
)
def test_invalid_arguments_raise_with_a_reason(call, match):
    with pytest.raises(ValueError, match=match):
        call(_latents(31))
