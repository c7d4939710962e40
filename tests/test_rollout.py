"""Windowed rollouts on a tiny real backbone: stored steps, the a = 0 limit against the ODE sampler,
per-sample seeding, and replay of log-probs (ratio 1, gradients to LoRA only)."""

import pytest
import torch

from cast_core.backbones.shapes import ShapesBackbone, ShapesBackboneConfig
from cast_core.lora import add_lora
from cast_core.rollout import RolloutSpec, replay_log_probs, rollout, sde_noise
from cast_core.sampling import sample_ode
from cast_core.window import SdeWindow

TINY = ShapesBackboneConfig(num_layers=1, num_heads=2, head_dim=8, text_width=16, text_layers=1)
PROMPTS = ["a photo of a red circle", "a photo of two blue squares", "a photo of a green triangle"]
SEEDS = [11, 12, 13]


@pytest.fixture(scope="module")
def tiny() -> ShapesBackbone:
    torch.manual_seed(0)
    return ShapesBackbone(TINY).eval()


def _spec(kind="flow_sde", noise=0.7, window=(1, 3), steps=4, cfg=2.0) -> RolloutSpec:
    return RolloutSpec(
        num_steps=steps,
        guidance_scale=cfg,
        noise_level=noise,
        sde_kind=kind,
        window=SdeWindow(*window),
    )


def test_window_steps_are_stored_with_shapes_times_and_chain(tiny):
    spec = _spec()
    out = rollout(tiny, PROMPTS, SEEDS, spec)
    n, (c, h, w) = len(PROMPTS), tiny.latent_shape
    assert out.x0.shape == (n, c, h, w)
    assert out.latents.shape == out.next_latents.shape == (n, 2, c, h, w)
    assert out.log_probs.shape == (n, 2, h, w) and out.log_probs.dtype == torch.float32
    sigmas = tiny.sigmas(4)
    torch.testing.assert_close(out.t, sigmas[1:3])
    torch.testing.assert_close(out.t_next, sigmas[2:4])
    assert torch.equal(out.latents[:, 1], out.next_latents[:, 0])  # consecutive window steps chain
    # the stored x_next is mean + std z with z drawn from the (seed, step) generator
    replay = replay_log_probs(tiny, out, PROMPTS, spec, with_grad=False)
    for j, k in enumerate(spec.window.steps):
        z = (out.next_latents[:, j] - replay.means[:, j]) / replay.stds[:, j]
        torch.testing.assert_close(z, sde_noise(SEEDS, k, (c, h, w)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["flow_sde", "cps"])
def test_zero_noise_rollout_equals_the_ode_sampler(tiny, kind):
    out = rollout(tiny, PROMPTS, SEEDS, _spec(kind=kind, noise=0.0))
    expected = sample_ode(tiny, PROMPTS, SEEDS, num_steps=4, guidance_scale=2.0)
    torch.testing.assert_close(out.x0, expected, rtol=0.0, atol=1e-6)


def test_sde_noise_depends_on_seed_and_step_only(tiny):
    spec = _spec()
    full = rollout(tiny, PROMPTS, SEEDS, spec)
    order = [2, 0]  # other positions, other batch size, other chunking
    sub = rollout(tiny, [PROMPTS[i] for i in order], [SEEDS[i] for i in order], spec, chunk_size=1)
    for field in ("x0", "latents", "next_latents", "log_probs"):
        torch.testing.assert_close(
            getattr(sub, field), getattr(full, field)[order], rtol=1e-5, atol=1e-5
        )
    noise = sde_noise([5, 5, 6], 1, (3, 2, 2))
    assert torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert not torch.equal(sde_noise([5], 1, (3, 2, 2)), sde_noise([5], 2, (3, 2, 2)))
    # step noise never reuses another seed's initial-noise stream
    assert not torch.equal(sde_noise([6], 0, tiny.latent_shape)[0], tiny.initial_noise([7])[0])


def test_replay_with_unchanged_weights_gives_ratio_one(tiny):
    spec = _spec(kind="cps", noise=0.5)
    out = rollout(tiny, PROMPTS, SEEDS, spec)
    replay = replay_log_probs(tiny, out, PROMPTS, spec)
    assert replay.log_probs.shape == out.log_probs.shape
    assert (replay.log_probs - out.log_probs).abs().max() < 1e-4
    part = out.select([2, 0], [1])
    sub = replay_log_probs(tiny, part, [PROMPTS[2], PROMPTS[0]], spec)
    assert sub.log_probs.shape == (2, 1, 32, 32) and sub.means.shape == (2, 1, 3, 32, 32)
    assert (sub.log_probs - out.log_probs[[2, 0]][:, [1]]).abs().max() < 1e-4


def test_replay_gradients_reach_lora_parameters_only():
    torch.manual_seed(1)
    model = ShapesBackbone(TINY).eval()
    lora = add_lora(model, rank=2, alpha=2.0)
    spec = _spec()
    out = rollout(model, PROMPTS[:2], SEEDS[:2], spec)
    replay_log_probs(model, out, PROMPTS[:2], spec).log_probs.mean().backward()
    lora_ids = {id(p) for p in lora}
    with_grad = [n for n, p in model.named_parameters() if p.grad is not None]
    assert with_grad and all("lora_" in n for n in with_grad)
    assert all(p.grad is None for p in model.parameters() if id(p) not in lora_ids)
    assert any(p.grad.abs().sum() > 0 for p in lora if p.grad is not None)


@pytest.mark.parametrize("kind", ["flow_sde", "cps"])
def test_log_probs_are_finite_when_the_window_starts_at_noise(tiny, kind):
    spec = _spec(kind=kind, window=(0, 2))
    out = rollout(tiny, PROMPTS[:2], SEEDS[:2], spec)
    assert float(out.t[0]) == 1.0
    assert torch.isfinite(out.log_probs).all() and torch.isfinite(out.next_latents).all()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"window": SdeWindow(2, 5)}, "num_steps"),
        ({"sde_kind": "ddim"}, "sde_kind"),
        ({"noise_level": -0.1}, "noise_level"),
        ({"noise_level": 1.5, "sde_kind": "cps"}, "noise_level"),
        ({"num_steps": 0}, "num_steps"),
    ],
)
def test_rollout_spec_validation_names_the_field(kwargs, field):
    base = {
        "num_steps": 4,
        "guidance_scale": 1.0,
        "noise_level": 0.7,
        "sde_kind": "flow_sde",
        "window": SdeWindow(0, 2),
    }
    with pytest.raises(ValueError, match=field):
        RolloutSpec(**{**base, **kwargs})


def test_shared_noise_seeds_start_a_group_from_one_noise_and_keep_the_sde_noise(tiny):
    spec = _spec(window=(0, 2))
    prompts = [PROMPTS[0]] * 3
    shared = rollout(tiny, prompts, SEEDS, spec, noise_seeds=[99, 99, 99])
    # one starting point, x_t of the first window step (step 0 = the initial noise)
    assert torch.equal(shared.latents[:, 0], tiny.initial_noise([99] * 3))
    # the samples still differ, by their own SDE noise
    assert not torch.equal(shared.next_latents[0, 0], shared.next_latents[1, 0])
    replay = replay_log_probs(tiny, shared, prompts, spec, with_grad=False)
    z = (shared.next_latents[:, 0] - replay.means[:, 0]) / replay.stds[:, 0]
    torch.testing.assert_close(z, sde_noise(SEEDS, 0, tiny.latent_shape), rtol=1e-4, atol=1e-4)
    # noise_seeds equal to seeds is the default
    default = rollout(tiny, prompts, SEEDS, spec)
    same = rollout(tiny, prompts, SEEDS, spec, noise_seeds=SEEDS)
    assert torch.equal(default.x0, same.x0)
    with pytest.raises(ValueError, match="one initial-noise seed per sample"):
        rollout(tiny, prompts, SEEDS, spec, noise_seeds=[1, 2])


def test_noise_signs_mirror_a_pair_at_every_window_step(tiny):
    spec = _spec(window=(0, 2))
    prompts = [PROMPTS[0]] * 2
    pair = rollout(tiny, prompts, [5, 5], spec, noise_seeds=[99, 99], noise_signs=[1, -1])
    # same start, the first window step's noise exactly mirrored about the shared mean
    assert torch.equal(pair.latents[0, 0], pair.latents[1, 0])
    replay = replay_log_probs(tiny, pair, prompts, spec, with_grad=False)
    for j, k in enumerate(spec.window.steps):
        z = (pair.next_latents[:, j] - replay.means[:, j]) / replay.stds[:, j]
        torch.testing.assert_close(z[0], sde_noise([5], k, tiny.latent_shape)[0], rtol=1e-4,
                                   atol=1e-4)
        torch.testing.assert_close(z[1], -z[0], rtol=1e-4, atol=1e-4)
    # the stored log-prob is the exact density of each draw: a mirrored draw is as likely
    torch.testing.assert_close(pair.log_probs[0, 0], pair.log_probs[1, 0], rtol=1e-5, atol=1e-5)
    plus = rollout(tiny, prompts, [5, 5], spec, noise_seeds=[99, 99])
    assert torch.equal(plus.x0[0], pair.x0[0])  # +1 is the default draw
    with pytest.raises(ValueError, match="noise_signs"):
        rollout(tiny, prompts, [5, 5], spec, noise_signs=[1, 0])
