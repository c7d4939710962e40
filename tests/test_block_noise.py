"""Block (tile-constant) SDE noise against closed forms: b = 1 is the isotropic step bitwise; the
tile means keep the isotropic step's law exactly; the rest of the step is the Euler step; the
log-prob is the tile means' Normal density; marginals of Gaussian data are preserved; rollouts,
replays and policy updates on a tiny real backbone live on the tile grid."""

import itertools

import pytest
import torch

from cast_core.backbones.shapes import ShapesBackbone, ShapesBackboneConfig
from cast_core.lora import add_lora
from cast_core.policy import PolicyConfig, policy_update
from cast_core.rollout import RolloutSpec, replay_log_probs, rollout, sde_noise
from cast_core.sampling import sample_ode
from cast_core.sde import (
    block_mean,
    block_spread,
    gaussian_log_prob,
    noise_shape,
    ode_step,
    sde_mean_std,
    sde_step,
)
from cast_core.window import SdeWindow

KINDS = ["flow_sde", "cps"]
TIMES = [(1.0, 0.9), (0.6, 0.5), (0.2, 0.1)]


def _latents(seed: int, shape=(3, 2, 8, 8), dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_block_mean_and_spread_are_a_projection():
    x = _latents(0)
    coarse = block_mean(x, 4)
    assert coarse.shape == (3, 2, 2, 2)
    torch.testing.assert_close(coarse[0, 1, 1, 0], x[0, 1, 4:8, 0:4].mean())
    projected = block_spread(coarse, 4)
    torch.testing.assert_close(block_mean(projected, 4), coarse)  # P^2 = P
    torch.testing.assert_close((x * projected).sum(), (projected * projected).sum())  # P = P^T
    assert block_mean(x, 1) is x and block_spread(x, 1) is x


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("t, t_next", TIMES)
def test_block_one_is_the_isotropic_step_bitwise(kind, t, t_next):
    x_t, v, z = _latents(1), _latents(2), _latents(3)
    iso = sde_step(x_t, v, t, t_next, 0.7 if kind == "flow_sde" else 0.5, kind, noise=z)
    one = sde_step(x_t, v, t, t_next, 0.7 if kind == "flow_sde" else 0.5, kind, noise=z,
                   noise_block=1)
    for a, b in [(iso.x_next, one.x_next), (iso.log_prob, one.log_prob), (iso.std, one.std)]:
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("t, t_next", TIMES)
@pytest.mark.parametrize("block", [2, 4])
def test_tile_means_keep_the_isotropic_law_and_the_rest_is_euler(kind, t, t_next, block):
    x_t, v = _latents(4, dtype=torch.float64), _latents(5, dtype=torch.float64)
    a = 0.7 if kind == "flow_sde" else 0.5
    iso = sde_mean_std(x_t, v, t, t_next, a, kind)
    blk = sde_mean_std(x_t, v, t, t_next, a, kind, noise_block=block)
    # tile means: the isotropic step's mean, and its noise's std (std / b for b^2 iid pixels)
    torch.testing.assert_close(block_mean(blk.mean, block), block_mean(iso.mean, block))
    torch.testing.assert_close(blk.std, iso.std / block)
    # within tiles: the deterministic Euler step
    ode = ode_step(x_t, v, t, t_next)

    def detail(x):
        return x - block_spread(block_mean(x, block), block)

    torch.testing.assert_close(detail(blk.mean), detail(ode))


@pytest.mark.parametrize("kind", KINDS)
def test_block_sample_is_tile_constant_noise_with_the_tile_density(kind):
    x_t, v = _latents(6), _latents(7)
    z = _latents(8, shape=(3, 2, 2, 2))
    step = sde_step(x_t, v, 0.6, 0.5, 0.7 if kind == "flow_sde" else 0.5, kind, noise=z,
                    noise_block=4)
    noise = step.x_next - step.mean
    torch.testing.assert_close(noise, block_spread(block_mean(noise, 4), 4))  # tile-constant
    torch.testing.assert_close(block_mean(noise, 4) / step.std, z, rtol=1e-4, atol=1e-5)
    expected = torch.distributions.Normal(block_mean(step.mean, 4), step.std.expand(3, 2, 2, 2))
    expected = expected.log_prob(block_mean(step.x_next, 4)).mean(dim=1)  # [N, 2, 2]
    assert step.log_prob.shape == (3, 2, 2)
    torch.testing.assert_close(step.log_prob, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        gaussian_log_prob(step.x_next, step.mean, step.std, noise_block=4), step.log_prob
    )


def test_empirical_tile_means_match_the_isotropic_step():
    """Monte-Carlo: 4,000 isotropic and 4,000 block draws of one step give tile means with the
    same mean and variance (std / b)^2; the block draws have no variance within a tile."""
    x_t = _latents(9, shape=(1, 1, 4, 4)).expand(4000, 1, 4, 4)
    v = _latents(10, shape=(1, 1, 4, 4)).expand(4000, 1, 4, 4)
    gen = torch.Generator().manual_seed(11)
    iso = sde_step(x_t, v, 0.6, 0.5, 0.7, "flow_sde", generator=gen)
    blk = sde_step(x_t, v, 0.6, 0.5, 0.7, "flow_sde", generator=gen, noise_block=2)
    std = float(iso.std[0]) / 2
    for draw in (iso.x_next, blk.x_next):
        tiles = block_mean(draw, 2)  # [4000, 1, 2, 2]
        torch.testing.assert_close(tiles.mean(0), block_mean(iso.mean, 2)[0], atol=4 * std / 63,
                                   rtol=0)
        assert ((tiles.var(0) / std**2 - 1).abs() < 0.1).all()
    inner = blk.x_next - block_spread(block_mean(blk.x_next, 2), 2)
    assert float(inner.var(0).max()) < 1e-10


def test_block_noise_preserves_gaussian_data_marginals():
    """Pixels iid N(m, s^2): the block SDE (diffusion matrix P) keeps the ODE's marginals, so
    every pixel ends N(m, s^2) and every 2 x 2 tile mean N(m, s^2 / 4)."""
    m, s, a, num_steps = 1.5, 0.4, 0.5, 100
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(4000, 1, 2, 2, generator=gen, dtype=torch.float64)
    sigmas = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    for t, t_next in itertools.pairwise(sigmas):
        var_t = (1 - t) ** 2 * s**2 + t**2  # v = E[eps - x0 | x_t] for x0 ~ N(m, s^2) per dim
        v = -m + (t - (1 - t) * s**2) / var_t * (x - (1 - t) * m)
        x = sde_step(x, v, t, t_next, a, "flow_sde", generator=gen, noise_block=2).x_next
    assert abs(float(x.mean()) - m) < 0.03
    assert abs(float(x.std()) - s) < 0.03
    assert abs(float(block_mean(x, 2).std()) - s / 2) < 0.02


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: block_mean(x, 3), "divisible"),
        (lambda x: block_mean(x[:, :, 0], 2), r"\[N, C, h, w\]"),
        (lambda x: sde_step(x, x, 0.5, 0.4, 0.5, "cps", noise_block=0), "int >= 1"),
        (lambda x: sde_step(x, x, 0.5, 0.4, 0.5, "cps", noise=x, noise_block=2), r"\(3, 2, 4, 4\)"),
        (lambda x: gaussian_log_prob(x, x, torch.ones(1), noise_block=5), "divisible"),
    ],
)
def test_invalid_blocks_raise_with_a_reason(call, match):
    with pytest.raises(ValueError, match=match):
        call(_latents(13))


def test_noise_shape_is_the_tile_grid():
    assert noise_shape((5, 3, 32, 32), 4) == (5, 3, 8, 8)
    assert noise_shape((5, 3, 32, 32), 1) == (5, 3, 32, 32)


# -- on a tiny real backbone ---------------------------------------------------------------------

TINY = ShapesBackboneConfig(num_layers=1, num_heads=2, head_dim=8, text_width=16, text_layers=1)
PROMPTS = ["a photo of a red circle", "a photo of a red circle", "a photo of two blue squares",
           "a photo of two blue squares"]
SEEDS = [21, 22, 23, 24]


def _spec(block: int, noise: float = 0.7) -> RolloutSpec:
    return RolloutSpec(num_steps=4, guidance_scale=1.5, noise_level=noise, sde_kind="flow_sde",
                       window=SdeWindow(1, 3), noise_block=block)


@pytest.fixture(scope="module")
def tiny() -> ShapesBackbone:
    torch.manual_seed(0)
    return ShapesBackbone(TINY).eval()


def test_block_rollout_lives_on_the_tile_grid_and_replays_at_ratio_one(tiny):
    spec = _spec(4)
    out = rollout(tiny, PROMPTS, SEEDS, spec)
    c, h, w = tiny.latent_shape
    assert out.log_probs.shape == (4, 2, h // 4, w // 4)
    replay = replay_log_probs(tiny, out, PROMPTS, spec, with_grad=False)
    torch.testing.assert_close(replay.log_probs, out.log_probs, rtol=0, atol=1e-4)
    for j, k in enumerate(spec.window.steps):
        noise = out.next_latents[:, j] - replay.means[:, j]
        z = block_mean(noise, 4) / replay.stds[:, j]
        torch.testing.assert_close(z, sde_noise(SEEDS, k, (c, h // 4, w // 4)), rtol=1e-3,
                                   atol=1e-3)


def test_zero_noise_block_rollout_equals_the_ode_sampler(tiny):
    out = rollout(tiny, PROMPTS, SEEDS, _spec(4, noise=0.0))
    expected = sample_ode(tiny, PROMPTS, SEEDS, num_steps=4, guidance_scale=1.5)
    torch.testing.assert_close(out.x0, expected, rtol=0.0, atol=1e-6)


def test_rollout_spec_rejects_a_bad_block():
    with pytest.raises(ValueError, match="noise_block"):
        _spec(0)


def test_policy_update_on_the_tile_grid_with_the_reference_kl(tiny):
    torch.manual_seed(1)
    model = ShapesBackbone(TINY).eval()
    params = add_lora(model, rank=4, alpha=4.0)
    spec = _spec(4)
    out = rollout(model, PROMPTS, SEEDS, spec)
    opt = torch.optim.Adam(params, lr=1e-2)
    config = PolicyConfig(advantage="spatial", clip_range=0.5, micro_batch=4, kl_beta=1.0,
                          inner_epochs=2)
    with pytest.raises(ValueError, match="pool the pixel map"):
        policy_update(model, opt, PROMPTS, out, spec, torch.ones(4, 32, 32), config)
    steps = policy_update(model, opt, PROMPTS, out, spec, torch.ones(4, 8, 8), config)
    assert steps[0].first_ratio_ok and steps[0].ref_kl_nats == 0.0  # fresh LoRA: B = 0
    assert steps[1].ref_kl_nats > 0 and steps[1].policy_kl_nats > 0
