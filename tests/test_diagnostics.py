"""Training diagnostics against closed forms: high-frequency energy of images, per-window-step ratio
mean and clip fraction (in the loss and through a real policy update), the LoRA change norm, and
the constant-reward alarm."""

import math

import pytest
import torch

from cast_core.backbones.shapes import ShapesBackbone, ShapesBackboneConfig
from cast_core.diagnostics import (
    constant_reward_alarm,
    high_frequency_energy,
    map_noise_factor,
    order_disagreement,
    param_change_norm,
)
from cast_core.lora import add_lora
from cast_core.loss import scalar_clipped_loss, spatial_clipped_loss
from cast_core.policy import PolicyConfig, policy_update
from cast_core.rollout import RolloutSpec, replay_log_probs, rollout
from cast_core.window import SdeWindow

H = W = 32


def _rgb(gray: torch.Tensor) -> torch.Tensor:
    """[N, H, W] -> [N, 3, H, W] with equal channels (luma of equal channels is the value)."""
    return gray[:, None].expand(-1, 3, -1, -1).clone()


def _checkerboard() -> torch.Tensor:
    i, j = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    return ((i + j) % 2).double()  # [H, W] in {0, 1}


def _cosine(periods: int = 1) -> torch.Tensor:
    x = torch.arange(W, dtype=torch.float64)
    return (0.5 + 0.4 * torch.cos(2 * math.pi * periods * x / W)).expand(H, W)  # [H, W]


def test_constant_images_have_zero_high_frequency_energy():
    values = torch.tensor([0.0, 0.3, 1.0, 1 / 3])
    images = values[:, None, None, None].expand(-1, 3, H, W)
    colour = torch.tensor([0.9, 0.1, 0.4])[None, :, None, None].expand(1, 3, H, W)
    e = high_frequency_energy(torch.cat([images, colour]))
    assert e.tolist() == [0.0] * 5


def test_checkerboard_has_all_its_energy_at_nyquist():
    e = high_frequency_energy(_rgb(_checkerboard()[None]))
    assert e.item() == pytest.approx(1.0, abs=1e-12)
    # |f| = sqrt(2) / 2 for the checkerboard: still all above 0.7
    assert high_frequency_energy(_rgb(_checkerboard()[None]), radius=0.7).item() == \
        pytest.approx(1.0, abs=1e-12)


def test_smooth_images_have_low_energy():
    one_period = high_frequency_energy(_rgb(_cosine()[None])).item()
    assert one_period == pytest.approx(0.0, abs=1e-20)  # all energy at |f| = 1/32
    ramp = torch.linspace(0, 1, W, dtype=torch.float64).expand(H, W)
    e = high_frequency_energy(_rgb(ramp[None])).item()
    assert 0.0 < e < 0.1  # only the wrap-around edge of the periodic extension


def test_mixture_energy_is_the_checkerboard_share():
    # x = A cos(2 pi x / W) + B (-1)^(i + j): per-pixel energies A^2 / 2 and B^2 at |f| = 1/32
    # and |f| = 0.707, so E_hf = B^2 / (A^2 / 2 + B^2) for radius 0.25.
    a, b = 0.3, 0.1
    x = torch.arange(W, dtype=torch.float64)
    signed = 2 * _checkerboard() - 1  # [H, W] in {-1, 1}
    img = 0.5 + a * torch.cos(2 * math.pi * x / W).expand(H, W) + b * signed
    e = high_frequency_energy(_rgb(img[None])).item()
    assert e == pytest.approx(b**2 / (a**2 / 2 + b**2), rel=1e-9)


def test_one_channel_equals_three_equal_channels_and_luma_weights():
    g = torch.rand(2, H, W, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    torch.testing.assert_close(high_frequency_energy(g[:, None]), high_frequency_energy(_rgb(g)))
    red = torch.zeros(1, 3, H, W, dtype=torch.float64)
    red[:, 0] = _checkerboard()
    assert high_frequency_energy(red).item() == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("radius", [0.0, 0.71, -0.1])
def test_radius_is_validated(radius):
    with pytest.raises(ValueError, match="radius"):
        high_frequency_energy(torch.zeros(1, 3, 8, 8), radius=radius)


def test_per_step_stats_of_the_spatial_loss_are_step_means():
    g = torch.Generator().manual_seed(1)
    old = torch.randn(3, 4, 5, 6, generator=g, dtype=torch.float64)
    new = old + 0.2 * torch.randn(3, 4, 5, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 5, 6, generator=g, dtype=torch.float64)
    eps = 0.15
    stats = spatial_clipped_loss(new, old, adv, eps).stats
    r = (new - old).exp()  # [N, K, h, w]
    torch.testing.assert_close(stats.ratio_mean_per_step, r.mean(dim=(0, 2, 3)))
    torch.testing.assert_close(stats.clip_fraction_per_step,
                               ((r - 1).abs() > eps).double().mean(dim=(0, 2, 3)))
    torch.testing.assert_close(stats.ratio_mean_per_step.mean(), stats.ratio_mean)
    torch.testing.assert_close(stats.clip_fraction_per_step.mean(), stats.clip_fraction)
    mask = torch.rand(3, 5, 6, generator=g) > 0.5  # [N, h, w], broadcast over K
    masked = spatial_clipped_loss(new, old, adv, eps, position_mask=mask).stats
    m = mask[:, None].double().expand_as(r)
    torch.testing.assert_close(masked.ratio_mean_per_step,
                               (r * m).sum(dim=(0, 2, 3)) / m.sum(dim=(0, 2, 3)))
    flat = spatial_clipped_loss(new[:, 0], old[:, 0], adv, eps).stats  # no step axis
    torch.testing.assert_close(flat.ratio_mean_per_step, r[:, 0].mean().reshape(1))


def test_per_step_stats_of_the_scalar_loss_use_the_all_dims_ratio():
    g = torch.Generator().manual_seed(2)
    old = torch.randn(4, 3, 5, 5, generator=g, dtype=torch.float64)
    new = old + 0.05 * torch.randn(4, 3, 5, 5, generator=g, dtype=torch.float64)
    eps = 0.004
    stats = scalar_clipped_loss(new, old, torch.randn(4, generator=g, dtype=torch.float64),
                                eps).stats
    r = (new - old).mean(dim=(-2, -1)).exp()  # [N, K]
    torch.testing.assert_close(stats.ratio_mean_per_step, r.mean(dim=0))
    torch.testing.assert_close(stats.clip_fraction_per_step,
                               ((r - 1).abs() > eps).double().mean(dim=0))


TINY = ShapesBackboneConfig(num_layers=1, num_heads=2, head_dim=8, text_width=16, text_layers=1)
PROMPTS = ["a photo of a red circle"] * 2 + ["a photo of two blue squares"] * 2
SPEC = RolloutSpec(num_steps=4, guidance_scale=1.5, noise_level=0.7, sde_kind="flow_sde",
                   window=SdeWindow(1, 4))


@pytest.fixture(scope="module")
def moved():
    """A tiny policy whose LoRA moved after the rollout (so ratios differ from 1), with its
    rollout and LoRA parameters."""
    torch.manual_seed(0)
    model = ShapesBackbone(TINY).eval()
    lora = add_lora(model, rank=2, alpha=2.0)
    out = rollout(model, PROMPTS, [3, 4, 5, 6], SPEC)
    with torch.no_grad():
        for p in lora:
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return model, out, lora


@pytest.mark.parametrize("kind", ["spatial", "scalar"])
def test_per_step_stats_of_an_update_equal_the_manual_computation(moved, kind):
    model, out, lora = moved
    eps = 0.05 if kind == "spatial" else 0.002
    adv = torch.ones(4, 32, 32) if kind == "spatial" else torch.ones(4)
    config = PolicyConfig(advantage=kind, clip_range=eps, steps_per_epoch=2, micro_batch=2)
    steps = policy_update(model, torch.optim.SGD(lora, lr=0.0), PROMPTS, out, SPEC, adv, config)
    log_ratio = (replay_log_probs(model, out, PROMPTS, SPEC, with_grad=False).log_probs
                 - out.log_probs)  # [N, K, h, w] float32, as in the loss
    k = SPEC.window.end - SPEC.window.start
    for j, step in enumerate(steps):  # two optimizer steps of two samples, in order
        lr = log_ratio[2 * j:2 * j + 2]  # [2, K, h, w]
        if kind == "spatial":
            r, dims = lr.exp(), (0, 2, 3)
        else:
            r, dims = lr.mean(dim=(-2, -1)).exp(), (0,)  # [2, K]
        assert len(step.ratio_mean_per_step) == len(step.clip_fraction_per_step) == k
        want = r.mean(dim=dims)
        assert step.ratio_mean_per_step == pytest.approx(want.tolist(), abs=1e-5)
        assert step.clip_fraction_per_step == pytest.approx(
            ((r - 1).abs() > eps).double().mean(dim=dims).tolist(), abs=1e-9)
        assert sum(step.ratio_mean_per_step) / k == pytest.approx(step.ratio_mean, abs=1e-6)
    assert any(abs(v - 1) > 1e-3 for s in steps for v in s.ratio_mean_per_step)
    assert any(v > 0 for s in steps for v in s.clip_fraction_per_step)


def test_param_change_norm_closed_form_and_after_an_update(moved):
    before = [torch.zeros(2, 2), torch.zeros(3)]
    after = [torch.full((2, 2), 3.0), torch.tensor([4.0, 0.0, 0.0])]
    assert param_change_norm(before, after) == pytest.approx(math.sqrt(4 * 9 + 16), abs=1e-12)
    assert param_change_norm(after, after) == 0.0
    with pytest.raises(ValueError, match="one 'after' tensor"):
        param_change_norm(before, after[:1])
    model, out, lora = moved
    snapshot = [p.detach().clone() for p in lora]
    config = PolicyConfig(advantage="spatial", clip_range=0.05, micro_batch=4)
    policy_update(model, torch.optim.Adam(lora, lr=1e-3), PROMPTS, out, SPEC,
                  torch.randn(4, 32, 32, generator=torch.Generator().manual_seed(3)), config)
    delta = torch.cat([(p.detach() - s).double().reshape(-1) for p, s in zip(lora, snapshot)])
    got = param_change_norm(snapshot, lora)
    assert got > 0 and got == pytest.approx(float(torch.linalg.vector_norm(delta)), rel=1e-12)


def test_alarm_triggers_on_constant_rewards():
    varied = {"object": torch.tensor([False, True]), "count": torch.tensor([True, False])}
    alarm = constant_reward_alarm(varied, torch.full((16,), 0.25), std_floor=1e-4)
    assert alarm.alarm and alarm.constant_types == ()
    assert alarm.reason.startswith("all 16 scalar rewards are equal (mean 0.2500")
    assert alarm.reward_std == 0.0 and alarm.reward_mean == pytest.approx(0.25)


def test_alarm_triggers_when_every_group_of_a_type_ties():
    flags = {"object": torch.tensor([False, True]), "relation": torch.tensor([True, True, True])}
    rewards = torch.tensor([0.1, 0.5, 0.9, 0.3])
    alarm = constant_reward_alarm(flags, rewards, std_floor=1e-4)
    assert alarm.alarm and alarm.constant_types == ("relation",)
    assert alarm.reason == "every group of atom type 'relation' has zero variance (3 of 3 groups)"


def test_no_alarm_when_rewards_vary():
    flags = {"object": torch.tensor([False, True]), "count": torch.tensor([], dtype=torch.bool)}
    rewards = torch.tensor([0.1, 0.5, 0.9, 0.3])
    alarm = constant_reward_alarm(flags, rewards, std_floor=1e-4)
    assert not alarm.alarm and alarm.reason is None and alarm.constant_types == ()
    assert alarm.reward_std == pytest.approx(float(rewards.double().std(correction=0)))
    # a spread just above the floor is a signal, just below it is not
    assert not constant_reward_alarm({}, torch.tensor([0.0, 2.1e-4]), 1e-4).alarm
    assert constant_reward_alarm({}, torch.tensor([0.0, 1.9e-4]), 1e-4).alarm


def test_map_noise_factor_closed_forms():
    credit = torch.tensor([0.5, -1.5, 2.0])  # [N] each sample's spatial mean
    constant = credit[:, None, None].expand(3, 8, 8)
    assert map_noise_factor(constant) == pytest.approx(1.0)
    for cells in (1, 4, 16, 64):  # credit / f on a fraction f = cells / 64 of the positions
        m = torch.zeros(3, 8, 8)
        m.view(3, -1)[:, :cells] = credit[:, None] * 64 / cells
        assert map_noise_factor(m) == pytest.approx(64 / cells)
    # a map with zero mean adds its whole second moment on top of the other samples' credit
    m = torch.cat([constant[:2], torch.tensor([1.0, -1.0]).repeat(32).view(1, 8, 8)])
    assert map_noise_factor(m) == pytest.approx((0.25 + 2.25 + 1.0) / ((0.25 + 2.25) / 1))
    with pytest.raises(ValueError, match="spatial mean 0"):
        map_noise_factor(torch.zeros(2, 4, 4))
    with pytest.raises(ValueError, match=r"\[N, h, w\]"):
        map_noise_factor(torch.ones(4, 4))


def test_order_disagreement_closed_forms():
    b = torch.tensor([[0.1, 0.5, 0.9], [3.0, 2.0, 1.0]])
    assert order_disagreement(2 * b + 1, b) == 0.0  # increasing within each group
    assert order_disagreement(-b, b) == 1.0
    a = torch.tensor([[0.1, 0.9, 0.5], [3.0, 2.0, 1.0]])  # one of six pairs flipped
    assert order_disagreement(a, b) == pytest.approx(1 / 6)
    tied = torch.tensor([[0.0, 0.0, 1.0], [3.0, 2.0, 1.0]])  # the tied pair is left out
    assert order_disagreement(tied, b) == 0.0
    with pytest.raises(ValueError, match="nothing to compare"):
        order_disagreement(torch.zeros(1, 3), b[:1])
    with pytest.raises(ValueError, match="one shape"):
        order_disagreement(b, b[:1])
