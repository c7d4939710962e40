"""Clipped policy losses and Gaussian KLs against hand-derived gradients and torch.distributions;
the summed-over-dims policy KL against the closed form for a known mean shift."""

import math

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from cast_core.loss import (
    MAX_LOG_RATIO,
    gaussian_kl,
    gaussian_step_kl,
    per_position_clip_range,
    sample_ratio_spatial_loss,
    scalar_clipped_loss,
    spatial_clipped_loss,
    summed_kl,
    summed_log_ratio,
)

N, K, h, w = 3, 2, 4, 5


def _log_probs(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, K, h, w, generator=g, dtype=torch.float64)


def test_constant_map_at_ratio_one_equals_scalar_loss_and_grad():
    old = _log_probs()
    adv = torch.tensor([0.7, -1.3, 2.0], dtype=torch.float64)
    new_s = old.clone().requires_grad_(True)
    new_c = old.clone().requires_grad_(True)
    spatial = spatial_clipped_loss(new_s, old, adv[:, None, None].expand(N, h, w), clip_range=0.1)
    scalar = scalar_clipped_loss(new_c, old, adv, clip_range=0.1)
    torch.testing.assert_close(spatial.loss, scalar.loss)
    (g_s,) = torch.autograd.grad(spatial.loss, new_s)
    (g_c,) = torch.autograd.grad(scalar.loss, new_c)
    torch.testing.assert_close(g_s, g_c)
    # both equal -A / (N K h w) at r = 1
    torch.testing.assert_close(g_s, (-adv / (N * K * h * w))[:, None, None, None].expand_as(g_s))


def _moved(old: torch.Tensor, scale: float, seed: int = 1) -> torch.Tensor:
    """old plus a per-position move of about `scale` (a policy after an optimizer step)."""
    g = torch.Generator().manual_seed(seed)
    return old + scale * torch.randn(old.shape, generator=g, dtype=old.dtype)


@pytest.mark.parametrize("scale", [0.0, 0.05, 0.5])
def test_constant_map_inside_the_sample_ratio_is_the_scalar_loss_at_any_ratio(scale):
    """A constant map A through `sample_ratio_spatial_loss` is Flow-GRPO's loss in value and
    gradient, off-policy too; at scale 0.5 some samples' all-dims ratios are outside the clip
    (0.1), and those get no gradient in both."""
    old = _log_probs()
    adv = torch.tensor([0.7, -1.3, 2.0], dtype=torch.float64)
    new = _moved(old, scale)
    new_m = new.clone().requires_grad_(True)
    new_c = new.clone().requires_grad_(True)
    mapped = sample_ratio_spatial_loss(new_m, old, adv[:, None, None].expand(N, h, w), 0.1)
    scalar = scalar_clipped_loss(new_c, old, adv, 0.1)
    torch.testing.assert_close(mapped.loss, scalar.loss)
    (g_m,) = torch.autograd.grad(mapped.loss, new_m)
    (g_c,) = torch.autograd.grad(scalar.loss, new_c)
    torch.testing.assert_close(g_m, g_c)
    torch.testing.assert_close(mapped.stats.clip_fraction, scalar.stats.clip_fraction)
    if scale == 0.5:
        assert 0 < float(scalar.stats.clip_fraction) < 1


def test_per_position_ratios_carry_a_second_order_term_the_sample_ratio_does_not():
    """Off-policy (after a move d), a constant positive map through per-position ratios has the
    gradient A exp(d_u) / (N K h w) at each position: it grows with the position's own d_u
    (the A d_u^2 / 2 term), while inside the sample ratio every position of a sample gets
    A exp(mean d) / (N K h w)."""
    old = _log_probs()
    adv = torch.full((N,), 1.0, dtype=torch.float64)
    new = _moved(old, 0.01).requires_grad_(True)
    d = (new - old).detach()
    per_position = spatial_clipped_loss(new, old, adv[:, None, None].expand(N, h, w), 10.0)
    (g_p,) = torch.autograd.grad(per_position.loss, new)
    torch.testing.assert_close(g_p, -d.exp() / (N * K * h * w))
    sample = sample_ratio_spatial_loss(new, old, adv[:, None, None].expand(N, h, w), 10.0)
    (g_s,) = torch.autograd.grad(sample.loss, new)
    expected = -d.mean(dim=(-2, -1), keepdim=True).exp().expand_as(d) / (N * K * h * w)
    torch.testing.assert_close(g_s, expected)


def test_a_map_inside_the_sample_ratio_weights_each_positions_gradient():
    """At ratio 1 a varying map has the same gradient through either ratio: -M_u / (N K h w)."""
    old = _log_probs()
    g = torch.Generator().manual_seed(3)
    adv_map = torch.randn(N, h, w, generator=g, dtype=torch.float64)
    new_p = old.clone().requires_grad_(True)
    new_s = old.clone().requires_grad_(True)
    (g_p,) = torch.autograd.grad(spatial_clipped_loss(new_p, old, adv_map, 0.1).loss, new_p)
    (g_s,) = torch.autograd.grad(sample_ratio_spatial_loss(new_s, old, adv_map, 1e-3).loss,
                                 new_s)
    torch.testing.assert_close(g_s, g_p)
    torch.testing.assert_close(g_s, (-adv_map / (N * K * h * w))[:, None].expand_as(g_s))


def test_clipping_gradients_follow_the_min():
    eps = 0.2
    old = torch.zeros(4, 1, 1, 3, dtype=torch.float64)
    # per sample: ratio above 1+eps, below 1-eps, inside the range
    r = torch.tensor([1.5, 0.5, 1.1], dtype=torch.float64)
    log_r = r.log().expand(4, 1, 1, 3)
    adv = torch.tensor([1.0, -1.0, 2.0, -2.0], dtype=torch.float64)[:, None, None].expand(4, 1, 3)
    new = log_r.clone().requires_grad_(True)
    out = spatial_clipped_loss(new, old, adv, clip_range=eps)
    (grad,) = torch.autograd.grad(out.loss, new)
    grad = grad[:, 0, 0]  # [4, 3]
    n_el = 4 * 3
    # A > 0: r > 1+eps is clipped (zero grad); r < 1-eps keeps its gradient
    assert grad[0, 0] == 0 and grad[2, 0] == 0
    torch.testing.assert_close(grad[0, 1], -1.0 * r[1] / n_el)
    # A < 0: r < 1-eps is clipped (zero grad); r > 1+eps keeps its gradient
    assert grad[1, 1] == 0 and grad[3, 1] == 0
    torch.testing.assert_close(grad[1, 0], 1.0 * r[0] / n_el)
    # inside the range the gradient is -A r / num_elements
    torch.testing.assert_close(grad[:, 2], -adv[:, 0, 2] * r[2] / n_el)
    assert out.stats.clip_fraction.item() == pytest.approx(2 / 3)


def test_stats_formulas_and_detached():
    old = _log_probs(1)
    new = (old + 0.05 * _log_probs(2)).requires_grad_(True)
    adv_map = torch.randn(N, h, w, dtype=torch.float64)
    out = spatial_clipped_loss(new, old, adv_map, clip_range=0.04)
    r = (new - old).detach().exp()
    assert out.stats.clip_fraction.item() == pytest.approx(
        ((r - 1).abs() > 0.04).double().mean().item()
    )
    assert out.stats.ratio_mean.item() == pytest.approx(r.mean().item())
    assert out.stats.ratio_std.item() == pytest.approx(r.std(correction=0).item())
    assert out.stats.ratio_k3.item() == pytest.approx(((r - 1) - r.log()).mean().item())
    assert out.stats.adv_mass.item() == pytest.approx(adv_map.abs().mean().item())
    for field in ("clip_fraction", "ratio_mean", "ratio_std", "ratio_k3", "adv_mass"):
        value = getattr(out.stats, field)
        assert value.dim() == 0 and not value.requires_grad
    assert out.loss.requires_grad


def test_position_mask_restricts_the_mean():
    old = _log_probs(3)
    new = old + 0.01
    adv_map = torch.randn(N, h, w, dtype=torch.float64)
    mask = torch.zeros(N, h, w, dtype=torch.bool)
    mask[:, :2] = True
    out = spatial_clipped_loss(new, old, adv_map, clip_range=0.5, position_mask=mask)
    r = math.exp(0.01)
    expected = -(r * adv_map[:, :2]).mean()
    torch.testing.assert_close(out.loss, expected)


def test_map_shape_mismatch_raises():
    with pytest.raises(ValueError, match="pool_to_grid"):
        spatial_clipped_loss(_log_probs(), _log_probs(), torch.zeros(N, h + 1, w), clip_range=0.1)


def test_scalar_loss_uses_all_dims_ratio():
    old = _log_probs(4)
    new = old + 0.3 * _log_probs(5)
    adv = torch.tensor([1.0, -0.5, 0.2], dtype=torch.float64)
    eps = 0.05
    out = scalar_clipped_loss(new, old, adv, clip_range=eps)
    r = (new - old).mean(dim=(-2, -1)).exp()  # [N, K]
    a = adv[:, None]
    expected = -torch.minimum(r * a, r.clamp(1 - eps, 1 + eps) * a).mean()
    torch.testing.assert_close(out.loss, expected)


def test_gaussian_kl_matches_torch_distributions():
    g = torch.Generator().manual_seed(6)
    mu_p, mu_q = torch.randn(2, 4, 3, 3, generator=g, dtype=torch.float64)
    std_p, std_q = 0.2 + torch.rand(2, 4, 3, 3, generator=g, dtype=torch.float64)
    expected = kl_divergence(Normal(mu_p, std_p), Normal(mu_q, std_q))
    torch.testing.assert_close(gaussian_kl(mu_p, std_p, mu_q, std_q), expected)
    # shared std, mean over channels (dim 1)
    mu_p, mu_r = torch.randn(2, 2, 4, 3, 3, generator=g, dtype=torch.float64)
    std = torch.tensor([0.3, 0.7], dtype=torch.float64)[:, None, None, None]
    step = gaussian_step_kl(mu_p, mu_r, std)
    expected = kl_divergence(
        Normal(mu_p, std.expand_as(mu_p)), Normal(mu_r, std.expand_as(mu_r))
    ).mean(dim=1)
    assert step.shape == (2, 3, 3)
    torch.testing.assert_close(step, expected)


def test_per_position_clip_range_scales_with_sqrt_positions():
    assert per_position_clip_range(1e-4, 32 * 32) == pytest.approx(1e-4 * 32)
    with pytest.raises(ValueError):
        per_position_clip_range(0.0, 16)


def _per_position_log_probs(x, mu, std):
    """Gaussian log-density per dim, mean over channels (dim 2 of [M, K, C, h, w]), as sde.py."""
    return Normal(mu, std).log_prob(x).mean(dim=2)  # [M, K, h, w]


@pytest.mark.parametrize("kl", [0.5, 3e-3])
def test_summed_kl_matches_the_closed_form_for_a_mean_shift(kl):
    """Old N(0, s^2), new N(s d, s^2) on D = C h w dims with |d|^2 / 2 = kl: the k3 and k1
    estimates over samples of the old policy match kl within 4 standard errors, and the loss's
    all-dims-mean ratio k3 reads about kl / D^2 (E[(L / D)^2] / 2 = (2 kl + kl^2) / (2 D^2))."""
    m, k, c, hh, ww, s = 20000, 2, 3, 4, 5, 0.3
    num_dims = c * hh * ww
    g = torch.Generator().manual_seed(11)
    d = torch.randn(c, hh, ww, generator=g, dtype=torch.float64)
    d = d * math.sqrt(2 * kl) / d.norm()  # |d|^2 / 2 = kl
    x = s * torch.randn(m, k, c, hh, ww, generator=g, dtype=torch.float64)
    old = _per_position_log_probs(x, 0.0, s)
    new = _per_position_log_probs(x, s * d, s)
    est = summed_kl(new, old, channels=c)
    log_ratio = summed_log_ratio(new, old, channels=c)  # [M, K]
    assert log_ratio.shape == (m, k) and log_ratio.dtype == torch.float64
    torch.testing.assert_close(
        log_ratio.var(), torch.tensor(2 * kl, dtype=torch.float64), rtol=0.05, atol=0.0
    )
    k3 = log_ratio.exp() - 1 - log_ratio
    for value, samples in ((est.k3, k3), (est.k1, -log_ratio)):
        stderr = samples.std() / math.sqrt(samples.numel())
        assert abs(float(value) - kl) < 4 * float(stderr)
    torch.testing.assert_close(est.k3, k3.mean())
    ratio_k3 = scalar_clipped_loss(new, old, torch.zeros(m), 0.1).stats.ratio_k3
    assert float(ratio_k3) == pytest.approx((2 * kl + kl**2) / (2 * num_dims**2), rel=0.05)


def test_summed_kl_is_finite_for_large_moves():
    old = torch.zeros(2, 1, 2, 2)
    new = torch.tensor([1e3, -1e3])[:, None, None, None].expand(2, 1, 2, 2)
    est = summed_kl(new, old, channels=4)  # L = 16e3 and -16e3
    want = (math.exp(MAX_LOG_RATIO) - 1 - MAX_LOG_RATIO + (-1 + 16e3)) / 2
    assert math.isfinite(float(est.k3)) and float(est.k3) == pytest.approx(want)
    assert float(est.k1) == 0.0


@pytest.mark.parametrize("scalar_steps", [0, 1, 2])
def test_split_step_maps_train_the_first_steps_as_flow_grpo_and_the_rest_with_the_map(
        scalar_steps):
    """`split_step_maps` inside the sample ratio: the window's first `scalar_steps` steps get
    exactly Flow-GRPO's gradient, the others the map's (each a 1/K share of the mean loss); with
    every step scalar the whole loss is Flow-GRPO's."""
    from cast_core.pixel_map import split_step_maps

    old = _log_probs()
    new = _moved(old, 0.05)
    adv = torch.tensor([0.7, -1.3, 2.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    maps = torch.randn(N, h, w, generator=g, dtype=torch.float64)
    split = split_step_maps(adv, maps, K, scalar_steps)  # [N, K, h, w]
    assert split.shape == (N, K, h, w)
    new_s = new.clone().requires_grad_(True)
    (g_split,) = torch.autograd.grad(sample_ratio_spatial_loss(new_s, old, split, 0.1).loss, new_s)
    for k in range(K):  # each step's gradient is its own loss's, scaled by 1/K
        one = new[:, k : k + 1].clone().requires_grad_(True)
        if k < scalar_steps:
            loss = scalar_clipped_loss(one, old[:, k : k + 1], adv, 0.1).loss
        else:
            loss = sample_ratio_spatial_loss(one, old[:, k : k + 1], maps[:, None], 0.1).loss
        (g_k,) = torch.autograd.grad(loss, one)
        torch.testing.assert_close(g_split[:, k : k + 1], g_k / K)
    every = split_step_maps(adv, maps, K, K)
    torch.testing.assert_close(sample_ratio_spatial_loss(new, old, every, 0.1).loss,
                               scalar_clipped_loss(new, old, adv, 0.1).loss)
    for bad in ((adv, maps, K, K + 1), (adv, maps, K, -1), (adv[:2], maps, K, 1),
                (adv, maps[0], K, 1)):
        with pytest.raises(ValueError, match="need"):
            split_step_maps(*bad)
