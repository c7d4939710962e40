"""The forward-process (NFT) loss against closed forms; the nearest-step credit over t."""

import pytest
import torch

from cast_core.nft import (
    adaptive_weight,
    covered_steps,
    credit_at_t,
    forward_noised,
    group_centred,
    nearest_steps,
    nft_loss,
    optimality,
)


def _velocities(n=3, c=2, h=4, w=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, c, h, w, generator=g, dtype=torch.float64) for _ in range(3)]


def test_constant_map_equals_the_per_sample_loss():
    v_theta, v_old, target = _velocities()
    r = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    per_sample = nft_loss(v_theta, v_old, target, r, beta=0.7)
    as_map = nft_loss(v_theta, v_old, target, r[:, None, None].expand(3, 4, 5), beta=0.7)
    torch.testing.assert_close(as_map.loss, per_sample.loss)
    torch.testing.assert_close(as_map.per_sample, per_sample.per_sample)


def test_all_positive_at_beta_one_is_plain_flow_matching():
    v_theta, v_old, target = _velocities()
    out = nft_loss(v_theta, v_old, target, torch.ones(3, dtype=torch.float64), beta=1.0)
    torch.testing.assert_close(out.loss, (v_theta - target).pow(2).mean())


def test_all_positive_any_beta_closed_form():
    v_theta, v_old, target = _velocities(seed=1)
    beta = 0.3
    out = nft_loss(v_theta, v_old, target, torch.ones(3, dtype=torch.float64), beta=beta)
    expected = (beta * (v_theta - target) + (1 - beta) * (v_old - target)).pow(2).mean()
    torch.testing.assert_close(out.loss, expected)


@pytest.mark.parametrize("beta", [0.1, 1.0, 2.0])
def test_gradient_at_the_old_policy_moves_towards_positive_samples(beta):
    _, v_old, target = _velocities(seed=2)
    n, c, h, w = v_old.shape
    r = torch.rand(n, h, w, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    v_theta = v_old.clone().requires_grad_(True)
    nft_loss(v_theta, v_old, target, r, beta).loss.backward()
    expected = 2 * beta * (2 * r[:, None] - 1) * (v_old - target) / (n * c * h * w)
    torch.testing.assert_close(v_theta.grad, expected)
    # a descent step raises the positive positions' fit and lowers the negative ones'
    step = v_theta.detach() - 1e-3 * v_theta.grad
    closer = ((step - target).pow(2) < (v_old - target).pow(2))  # [N, C, h, w]
    pos = (r > 0.5)[:, None].expand_as(closer)
    assert closer[pos].all() and not closer[~pos].any()


def test_half_optimality_gives_no_gradient_at_the_old_policy():
    _, v_old, target = _velocities(seed=4)
    v_theta = v_old.clone().requires_grad_(True)
    nft_loss(v_theta, v_old, target, torch.full((3,), 0.5, dtype=torch.float64), 1.0).loss.backward()
    assert v_theta.grad.abs().max() == 0


def test_weight_scales_each_sample():
    v_theta, v_old, target = _velocities(seed=5)
    r = torch.tensor([0.2, 0.6, 1.0], dtype=torch.float64)
    wt = adaptive_weight(v_old, target)
    out = nft_loss(v_theta, v_old, target, r, 1.0, weight=wt)
    torch.testing.assert_close(out.loss, (wt * out.per_sample).mean())
    torch.testing.assert_close(wt, 1 / (v_old - target).pow(2).flatten(1).mean(1))


def test_optimality_maps_advantages_into_unit_interval():
    a = torch.tensor([-5.0, -1.0, 0.0, 1.0, 5.0])
    torch.testing.assert_close(optimality(a, 2.0), torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]))
    with pytest.raises(ValueError, match="a_max"):
        optimality(a, 0.0)


def test_bad_inputs_are_named():
    v_theta, v_old, target = _velocities()
    with pytest.raises(ValueError, match="latent grid"):
        nft_loss(v_theta, v_old, target, torch.ones(3, 2, 2, dtype=torch.float64), 1.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        nft_loss(v_theta, v_old, target, torch.full((3,), 1.5, dtype=torch.float64), 1.0)
    with pytest.raises(ValueError, match="beta"):
        nft_loss(v_theta, v_old, target, torch.ones(3, dtype=torch.float64), 0.0)


def test_forward_noised_interpolates_and_its_target_is_the_time_derivative():
    x0, eps, _ = _velocities(seed=6)
    t = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    out = forward_noised(x0, t, eps)
    torch.testing.assert_close(out.x_t[0], x0[0])
    torch.testing.assert_close(out.x_t[1], 0.5 * (x0[1] + eps[1]))
    torch.testing.assert_close(out.x_t[2], eps[2])
    later = forward_noised(x0, t + 1e-3, eps).x_t
    torch.testing.assert_close((later - out.x_t) / 1e-3, out.target)
    with pytest.raises(ValueError, match="t \\[N\\]"):
        forward_noised(x0, t[:2], eps)


def test_group_centred_makes_each_group_zero_sum_at_every_position():
    maps = torch.rand(6, 4, 5, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    out = group_centred(maps, 3)
    torch.testing.assert_close(out.reshape(2, 3, 4, 5).sum(dim=1), torch.zeros(2, 4, 5, dtype=torch.float64))
    torch.testing.assert_close(maps - out, maps.reshape(2, 3, 4, 5).mean(1, keepdim=True)
                               .expand(2, 3, 4, 5).reshape(6, 4, 5))
    with pytest.raises(ValueError, match="groups of 4"):
        group_centred(maps, 4)


def test_nearest_steps_picks_the_nearest_time_and_ties_to_the_earlier_step():
    times = torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64)  # ties exact in binary
    t = torch.tensor([0.99, 0.76, 0.75, 0.74, 0.38, 0.375, 0.1], dtype=torch.float64)
    assert nearest_steps(t, times).tolist() == [0, 0, 0, 1, 1, 1, 2]
    with pytest.raises(ValueError, match="decrease strictly"):
        nearest_steps(t, torch.tensor([0.2, 0.6]))


def test_covered_steps_are_those_a_draw_in_the_range_can_reach():
    times = torch.linspace(1.0, 0.1, 10, dtype=torch.float64)  # 1.0, 0.9, ..., 0.1
    assert covered_steps(times, 0.02, 0.98) == (0, 10)
    assert covered_steps(times, 0.33, 0.66) == (3, 8)  # 0.7 (nearest 0.66) ... 0.3 (0.33)
    for lo, hi in ((0.02, 0.98), (0.33, 0.66), (0.5, 0.51)):
        start, end = covered_steps(times, lo, hi)
        reached = set(nearest_steps(torch.linspace(lo, hi, 1001), times).tolist())
        assert reached == set(range(start, end))


def test_credit_at_t_takes_each_sample_its_step_map():
    maps = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 2, 2)  # [N, K, h, w]
    out = credit_at_t(maps, torch.tensor([0.1, 0.95]), torch.tensor([0.9, 0.5, 0.1]))
    assert torch.equal(out[0], maps[0, 2]) and torch.equal(out[1], maps[1, 0])
    with pytest.raises(ValueError, match="same N and K"):
        credit_at_t(maps, torch.tensor([0.1, 0.95]), torch.tensor([0.9, 0.1]))
