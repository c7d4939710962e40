"""LoRA policy updates on a tiny real backbone: frozen base, the reference model, the effect of one
update, spatial vs scalar objectives, gradient accumulation over window steps and micro-batches,
optimizer steps per epoch and the lr schedule, the KLs in nats, the NaN guard, validation."""

import pytest
import torch

from cast_core.backbones.shapes import ShapesBackbone, ShapesBackboneConfig
from cast_core.lora import add_lora, reference_mode
from cast_core.loss import spatial_clipped_loss
from cast_core.lr_schedule import (
    halflife_factor,
    kl_step_weights,
    kl_targeted_lr,
    linear_warmup_lr,
)
from cast_core.policy import PolicyConfig, policy_update
from cast_core.rollout import RolloutSpec, replay_log_probs, rollout
from cast_core.sde import block_mean, sde_mean_std, velocity_gain
from cast_core.update_kl import update_kl_nats, velocity_change
from cast_core.window import SdeWindow

TINY = ShapesBackboneConfig(num_layers=1, num_heads=2, head_dim=8, text_width=16, text_layers=1)
PROMPTS = [
    "a photo of a red circle",
    "a photo of a red circle",
    "a photo of two blue squares",
    "a photo of two blue squares",
]
SEEDS = [3, 4, 5, 6]
SPEC = RolloutSpec(
    num_steps=4, guidance_scale=1.5, noise_level=0.7, sde_kind="flow_sde", window=SdeWindow(1, 3)
)


def _model(seed: int = 0) -> ShapesBackbone:
    torch.manual_seed(seed)
    return ShapesBackbone(TINY).eval()


def _velocity(model: ShapesBackbone) -> torch.Tensor:
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        return model.velocity(x, torch.tensor([0.8, 0.3]), model.encode_prompts(PROMPTS[1:3]))


def _snapshot(model: ShapesBackbone) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def trained():
    """(model, base velocity, rollout, steps) after one update with positive advantages."""
    model = _model()
    base_v = _velocity(model)
    lora = add_lora(model, rank=4, alpha=4.0)
    before = _snapshot(model)
    out = rollout(model, PROMPTS, SEEDS, SPEC)
    optimizer = torch.optim.Adam(lora, lr=1e-2)
    config = PolicyConfig(advantage="spatial", clip_range=0.5, micro_batch=4)
    steps = policy_update(model, optimizer, PROMPTS, out, SPEC, torch.ones(4, 32, 32), config)
    return model, base_v, before, out, steps


def test_add_lora_freezes_everything_but_the_adapter_and_starts_at_the_base():
    model = _model()
    base_v = _velocity(model)
    lora = add_lora(model, rank=2, alpha=2.0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and n.startswith("transformer.") for n in trainable)
    assert {id(p) for p in lora} == {id(p) for p in model.parameters() if p.requires_grad}
    assert not any(p.requires_grad for p in model.text_encoder.parameters())
    assert all(
        float(p.detach().abs().max()) == 0.0 for n, p in model.named_parameters() if "lora_B" in n
    )
    assert torch.equal(_velocity(model), base_v)  # B = 0: the adapted model is the base model


def test_one_update_with_positive_advantages_moves_lora_only_and_raises_log_probs(trained):
    model, _, before, out, steps = trained
    after = _snapshot(model)
    changed = [n for n in after if not torch.equal(after[n], before[n])]
    assert changed and all("lora_" in n for n in changed)
    assert len(steps) == 1 and not steps[0].skipped
    # M = 1 everywhere: a small ascent step raises the log-likelihood of the sampled steps (by
    # ~2e-5 here, against float noise ~1e-7 in the mean)
    replay = replay_log_probs(model, out, PROMPTS, SPEC, with_grad=False)
    assert (replay.log_probs - out.log_probs).mean() > 1e-6


def test_reference_mode_is_the_base_model_after_training(trained):
    model, base_v, *_ = trained
    with reference_mode(model):
        assert torch.equal(_velocity(model), base_v)
    policy_v = _velocity(model)
    assert not torch.allclose(policy_v, base_v)
    with pytest.raises(RuntimeError), reference_mode(model):
        raise RuntimeError("adapters must come back on")
    assert torch.equal(_velocity(model), policy_v)


def test_first_step_ratio_is_one_and_steps_are_recorded_in_order():
    model = _model(1)
    lora = add_lora(model, rank=2, alpha=2.0)
    out = rollout(model, PROMPTS, SEEDS, SPEC)
    config = PolicyConfig(
        advantage="scalar",
        clip_range=1e-2,
        inner_epochs=2,
        steps_per_epoch=2,
        micro_batch=1,
        kl_beta=0.1,
    )
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    steps = policy_update(
        model, torch.optim.Adam(lora, lr=1e-2), PROMPTS, out, SPEC, adv, config, shuffle_seed=0
    )
    assert [(s.epoch, s.step, s.samples) for s in steps] == [
        (0, 0, 2),
        (0, 1, 2),
        (1, 0, 2),
        (1, 1, 2),
    ]
    assert steps[0].first_ratio_ok is True and abs(steps[0].ratio_mean - 1.0) < 1e-4
    assert all(s.first_ratio_ok is None for s in steps[1:])
    # LoRA B = 0: policy == reference == rollout policy before the first step
    assert steps[0].ref_kl_nats == 0.0 and steps[0].ref_kl_mean_dim == 0.0
    assert 0.0 <= steps[0].policy_kl_nats < 1e-5
    assert steps[-1].ref_kl_nats > 0.0 and not any(s.skipped for s in steps)
    num_dims = out.latents.shape[2] * out.log_probs.shape[-2] * out.log_probs.shape[-1]
    for s in steps:
        assert s.ref_kl_mean_dim == pytest.approx(s.ref_kl_nats / num_dims, rel=1e-9)
    assert steps[-1].policy_kl_nats > steps[0].policy_kl_nats


def test_constant_map_equals_scalar_objective_at_ratio_one():
    model = _model(2)
    lora = add_lora(model, rank=2, alpha=2.0)
    out = rollout(model, PROMPTS, SEEDS, SPEC)
    c = 0.7
    frozen = torch.optim.SGD(lora, lr=0.0)

    def first_loss(kind: str, adv: torch.Tensor) -> float:
        config = PolicyConfig(advantage=kind, clip_range=0.2, micro_batch=4)
        return policy_update(model, frozen, PROMPTS, out, SPEC, adv, config)[0].loss

    spatial = first_loss("spatial", torch.full((4, 32, 32), c))
    scalar = first_loss("scalar", torch.full((4,), c))
    assert spatial == pytest.approx(-c, abs=1e-4) and scalar == pytest.approx(-c, abs=1e-4)
    assert spatial == pytest.approx(scalar, abs=1e-5)


def _moved_lora(seed: int):
    """(model, lora, rollout) with LoRA moved off B = 0, so both factors get gradients."""
    model = _model(seed)
    lora = add_lora(model, rank=2, alpha=2.0)
    with torch.no_grad():
        for p in lora:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return model, lora, rollout(model, PROMPTS, SEEDS, SPEC)


def _first_step(model, lora, out, adv, **config):
    """(UpdateStep, accumulated grads) of one lr-0 optimizer step over all N samples."""
    for p in lora:
        p.grad = None
    config = PolicyConfig(clip_range=0.2, max_grad_norm=1e9, **config)
    step = policy_update(model, torch.optim.SGD(lora, lr=0.0), PROMPTS, out, SPEC, adv, config)[0]
    return step, [p.grad.clone() for p in lora]


def test_accumulation_over_steps_and_micro_batches_equals_the_mini_batch_gradient():
    model, lora, out = _moved_lora(3)
    adv = torch.randn(4, 32, 32, generator=torch.Generator().manual_seed(1))
    one, grads = _first_step(model, lora, out, adv, advantage="spatial", micro_batch=4)
    full = spatial_clipped_loss(
        replay_log_probs(model, out, PROMPTS, SPEC).log_probs, out.log_probs, adv, 0.2
    )
    for p in lora:
        p.grad = None
    full.loss.backward()
    assert one.loss == pytest.approx(float(full.loss.detach()), rel=1e-5, abs=1e-7)
    for got, p in zip(grads, lora):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-7)
    for micro in (1, 3):  # 3: micro-batches of 3 and 1 samples, weighted 3/4 and 1/4
        split, split_grads = _first_step(
            model, lora, out, adv, advantage="spatial", micro_batch=micro
        )
        for got, want in zip(split_grads, grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
        assert split.samples == one.samples == 4
        for field in (
            "loss",
            "ratio_mean",
            "ratio_std",
            "clip_fraction",
            "ratio_k3",
            "policy_kl_nats",
            "adv_mass",
        ):
            assert getattr(split, field) == pytest.approx(getattr(one, field), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("kind", ["scalar", "spatial"])
def test_step_weights_scale_each_window_steps_share_of_loss_and_gradient(kind):
    """Loss and gradient are linear in the step weights: G(w) = sum_k w_k g_k / K. So with the
    2-step window G(3, 5) = 3 (G(2, 1) - G(1, 1)) + 5 (G(1, 2) - G(1, 1)), and likewise the loss;
    equal weights of 1 are the unweighted update."""
    model, lora, out = _moved_lora(4)
    gen = torch.Generator().manual_seed(2)
    adv = torch.randn(4, generator=gen) if kind == "scalar" else torch.randn(4, 32, 32,
                                                                             generator=gen)
    got = {w: _first_step(model, lora, out, adv, advantage=kind, micro_batch=2, kl_beta=0.1,
                          step_weights=w)
           for w in ((1.0, 1.0), (2.0, 1.0), (1.0, 2.0), (3.0, 5.0))}
    plain = _first_step(model, lora, out, adv, advantage=kind, micro_batch=2, kl_beta=0.1)
    assert got[(1.0, 1.0)][0].loss == pytest.approx(plain[0].loss, rel=1e-6)
    base, first, second, mixed = (got[w] for w in ((1.0, 1.0), (2.0, 1.0), (1.0, 2.0),
                                                    (3.0, 5.0)))
    assert mixed[0].loss == pytest.approx(
        3 * (first[0].loss - base[0].loss) + 5 * (second[0].loss - base[0].loss), rel=1e-4)
    for g, g0, g1, g2, gp in zip(mixed[1], base[1], first[1], second[1], plain[1]):
        torch.testing.assert_close(g0, gp, rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(g, 3 * (g1 - g0) + 5 * (g2 - g0), rtol=1e-3, atol=1e-7)
    with pytest.raises(ValueError, match="2 window steps"):
        _first_step(model, lora, out, adv, advantage=kind, step_weights=(1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="finite and > 0"):
        PolicyConfig(advantage=kind, clip_range=0.2, step_weights=(1.0, 0.0))


def test_scalar_and_constant_map_objectives_give_the_same_first_step_gradient():
    """At ratio 1 both are mean over positions of A * grad log-prob per position."""
    model, lora, out = _moved_lora(6)
    a = torch.tensor([0.7, -1.3, 2.0, 0.4])
    spatial, spatial_grads = _first_step(
        model, lora, out, a[:, None, None].expand(4, 32, 32), advantage="spatial", micro_batch=3
    )
    scalar, scalar_grads = _first_step(model, lora, out, a, advantage="scalar", micro_batch=3)
    assert spatial.loss == pytest.approx(scalar.loss, abs=1e-5)
    assert spatial.policy_kl_nats == pytest.approx(scalar.policy_kl_nats, rel=1e-9)  # same replay
    for s, c in zip(spatial_grads, scalar_grads):
        torch.testing.assert_close(s, c, rtol=1e-4, atol=1e-8)
    assert any(float(g.abs().max()) > 0 for g in scalar_grads)


def _trained_lora(adv, **config):
    """The LoRA after two optimizer steps (2 inner epochs) of AdamW at lr 3e-2 from one start."""
    model, lora, out = _moved_lora(7)
    optimizer = torch.optim.AdamW(lora, lr=3e-2, weight_decay=0.0)
    config = PolicyConfig(max_grad_norm=1e9, micro_batch=4, inner_epochs=2, **config)
    policy_update(model, optimizer, PROMPTS, out, SPEC, adv, config)
    return [p.detach().clone() for p in lora]


def test_a_constant_map_inside_the_sample_ratio_trains_as_flow_grpo_off_policy_too():
    """Two steps: the second runs off-policy. The constant map inside the sample's all-dims ratio
    ends on Flow-GRPO's LoRA; through per-position ratios it does not (their second-order term)."""
    a = torch.tensor([0.7, -1.3, 2.0, 0.4])
    constant = a[:, None, None].expand(4, 32, 32)
    scalar = _trained_lora(a, advantage="scalar", clip_range=10.0)  # no clipping anywhere:
    sample = _trained_lora(constant, advantage="spatial", clip_range=10.0, map_ratio="sample")
    position = _trained_lora(constant, advantage="spatial", clip_range=10.0)  # the ratio only
    for s, c in zip(sample, scalar):
        torch.testing.assert_close(s, c, rtol=1e-4, atol=1e-6)
    assert max(float((p - c).abs().max()) for p, c in zip(position, scalar)) > 1e-4


def test_steps_per_epoch_sets_optimizer_steps_samples_and_the_lr_schedule():
    model = _model(7)
    lora = add_lora(model, rank=2, alpha=2.0)
    out = rollout(model, PROMPTS, SEEDS, SPEC)
    optimizer = torch.optim.Adam(lora, lr=1.0)
    config = PolicyConfig(
        advantage="spatial", clip_range=0.2, inner_epochs=2, steps_per_epoch=3, micro_batch=1
    )
    seen = []

    def lr_for_step(j: int) -> float:
        seen.append(j)
        return linear_warmup_lr(1e-2, 4, 10 + j)

    steps = policy_update(
        model,
        optimizer,
        PROMPTS,
        out,
        SPEC,
        torch.ones(4, 32, 32),
        config,
        shuffle_seed=1,
        lr_for_step=lr_for_step,
    )
    assert [(s.epoch, s.step, s.samples) for s in steps] == [
        (0, 0, 2),
        (0, 1, 1),
        (0, 2, 1),
        (1, 0, 2),
        (1, 1, 1),
        (1, 2, 1),
    ]
    assert seen == [0, 1, 2, 3, 4, 5]
    assert int(optimizer.state[lora[0]]["step"]) == 6  # one optimizer step per UpdateStep
    assert [s.lr for s in steps] == [1e-2] * 6  # warm-up over 4 steps ended before step 10
    assert optimizer.param_groups[0]["lr"] == 1e-2
    two = PolicyConfig(advantage="spatial", clip_range=0.2, steps_per_epoch=2, micro_batch=4)
    steps = policy_update(model, optimizer, PROMPTS, out, SPEC, torch.ones(4, 32, 32), two)
    assert [(s.step, s.samples) for s in steps] == [(0, 2), (1, 2)]
    assert int(optimizer.state[lora[0]]["step"]) == 8


def test_linear_warmup_lr():
    assert [linear_warmup_lr(0.4, 4, j) for j in range(6)] == pytest.approx(
        [0.1, 0.2, 0.3, 0.4, 0.4, 0.4]
    )
    assert linear_warmup_lr(0.4, 0, 0) == 0.4
    with pytest.raises(ValueError):
        linear_warmup_lr(0.4, -1, 0)


def test_kl_targeted_lr_hits_the_target_of_a_quadratic_move_in_one_iteration():
    # a small move's KL is quadratic in the lr: kl(lr) = c lr^2, so lr * sqrt(target / kl(lr))
    # moves exactly the target when the factor is within bounds
    c, target, bounds = 2e4, 0.03, {"max_factor": 2.0, "lr_min": 1e-5, "lr_max": 1e-2}
    for lr in (6e-4, 1.6e-3):  # kl 0.0072 and 0.0512: factors 2.04 (clamped) and 0.77
        nxt = kl_targeted_lr(lr, c * lr**2, target, **bounds)
        if lr == 6e-4:
            assert nxt == pytest.approx(2 * lr)  # the factor clamps at max_factor
            assert c * nxt**2 < target
        else:
            assert c * nxt**2 == pytest.approx(target)
    # iterated, it settles at the target's lr, sqrt(target / c)
    lr = 1e-4
    for _ in range(8):
        lr = kl_targeted_lr(lr, c * lr**2, target, **bounds)
    assert lr == pytest.approx((target / c) ** 0.5)


def test_kl_step_weights_equalise_steps_whose_kl_is_quadratic_in_their_weight():
    # step k moves KL_k = c_k w_k^2 (its own gradient alone): the controller brings every step to
    # the same KL, i.e. w_k proportional to 1 / sqrt(c_k), renormalised to mean 1
    c = (0.01, 0.04, 0.16, 0.64)  # later steps: smaller noise std, more nats per unit of weight
    kw = {"max_factor": 2.0, "floor": 0.01}
    weights = None
    for _ in range(12):
        current = weights or (1.0,) * len(c)
        weights = kl_step_weights(weights, tuple(ck * w * w for ck, w in zip(c, current)), **kw)
    kls = [ck * w * w for ck, w in zip(c, weights)]
    assert max(kls) / min(kls) == pytest.approx(1.0, abs=1e-6)
    assert sum(weights) / len(weights) == pytest.approx(1.0)
    want = [ck ** -0.5 for ck in c]
    assert weights == pytest.approx([4 * x / sum(want) for x in want])
    # one iteration moves a weight by at most max_factor before the renormalisation
    first = kl_step_weights(None, (0.01, 100.0), **kw)
    assert first[0] / first[1] == pytest.approx(4.0)  # x2 and x1/2


def test_kl_step_weights_floor_and_missing_estimates():
    kw = {"max_factor": 10.0, "floor": 0.1}
    assert kl_step_weights((1.0, 2.0), None, **kw) == (1.0, 2.0)  # no estimate: unchanged
    assert kl_step_weights(None, None, **kw) is None
    assert kl_step_weights((1.0, 1.0), (0.0, float("nan")), **kw) == (1.0, 1.0)  # nothing usable
    w = kl_step_weights(None, (1e-4, 1e4, 1.0), **kw)
    assert min(w) == 0.1  # floored: no step stops training
    a, b, c = kl_step_weights(None, (1.0, float("inf"), 0.0), **kw)
    assert b < a < c  # non-finite: the smallest factor; no move: the largest
    with pytest.raises(ValueError, match="one weight per window step"):
        kl_step_weights((1.0,), (0.1, 0.2), **kw)
    for bad in ({"max_factor": 0.5}, {"floor": 0.0}, {"floor": 1.5}):
        with pytest.raises(ValueError):
            kl_step_weights(None, (0.1,), **(kw | bad))


def test_kl_targeted_lr_bounds_and_missing_estimates():
    bounds = {"max_factor": 2.0, "lr_min": 1e-4, "lr_max": 1e-3}
    assert kl_targeted_lr(5e-4, 10.0, 0.01, **bounds) == pytest.approx(2.5e-4)  # factor 1/2
    assert kl_targeted_lr(1.5e-4, 10.0, 0.01, **bounds) == 1e-4  # the lr floor
    assert kl_targeted_lr(8e-4, 1e-9, 0.01, **bounds) == 1e-3  # the lr ceiling
    assert kl_targeted_lr(5e-4, None, 0.01, **bounds) == 5e-4  # no estimate: unchanged
    assert kl_targeted_lr(4e-4, 0.0, 0.01, **bounds) == pytest.approx(8e-4)  # no move: x2
    assert kl_targeted_lr(4e-4, float("nan"), 0.01, **bounds) == pytest.approx(2e-4)
    assert kl_targeted_lr(4e-4, 0.04, 0.01, **bounds) == pytest.approx(2e-4)  # sqrt(1/4)
    for bad in ({"max_factor": 0.5}, {"lr_min": 2e-3}, {"lr_min": 0.0}):
        with pytest.raises(ValueError):
            kl_targeted_lr(4e-4, 0.01, 0.01, **(bounds | bad))
    with pytest.raises(ValueError):
        kl_targeted_lr(4e-4, 0.01, 0.0, **bounds)


def test_nan_advantage_skips_the_optimizer_step_and_leaves_weights_unchanged():
    model = _model(4)
    lora = add_lora(model, rank=2, alpha=2.0)
    out = rollout(model, PROMPTS, SEEDS, SPEC)
    adv = torch.ones(4, 32, 32)
    adv[0, 3, 5] = float("nan")
    before = _snapshot(model)
    optimizer = torch.optim.Adam(lora, lr=1e-2)
    for micro in (4, 1):  # one micro-batch, or the NaN in one of four accumulated ones
        one = PolicyConfig(advantage="spatial", clip_range=0.2, micro_batch=micro)
        (step,) = policy_update(model, optimizer, PROMPTS, out, SPEC, adv, one)
        assert step.skipped and step.skip_reason == "non-finite loss"
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        assert all(p.grad is None for p in lora) and not optimizer.state
    two = PolicyConfig(advantage="spatial", clip_range=0.2, steps_per_epoch=2, micro_batch=1)
    steps = policy_update(model, optimizer, PROMPTS, out, SPEC, adv, two)
    assert [s.skipped for s in steps] == [True, False]
    assert int(optimizer.state[lora[0]]["step"]) == 1


def test_more_steps_per_epoch_than_samples_is_an_error():
    model = _model(5)
    lora = add_lora(model, rank=2, alpha=2.0)
    out = rollout(model, PROMPTS, SEEDS, SPEC)
    config = PolicyConfig(advantage="spatial", clip_range=0.2, steps_per_epoch=5)
    with pytest.raises(ValueError, match=r"steps_per_epoch \(5\) exceeds the 4 samples"):
        policy_update(
            model, torch.optim.SGD(lora, lr=0.0), PROMPTS, out, SPEC, torch.ones(4, 32, 32), config
        )


@pytest.mark.parametrize(
    "field, value",
    [
        ("advantage", "pixel"),
        ("clip_range", 0.0),
        ("kl_beta", -1.0),
        ("inner_epochs", 0),
        ("micro_batch", 0),
        ("max_grad_norm", float("inf")),
        ("ratio_tol", 0.0),
        ("micro_batch", True),
        ("steps_per_epoch", 0),
        ("steps_per_epoch", 2.0),
    ],
)
def test_policy_config_validation_names_the_field(field, value):
    kwargs = {"advantage": "spatial", "clip_range": 0.2, field: value}
    with pytest.raises(ValueError, match=f"PolicyConfig.{field}"):
        PolicyConfig(**kwargs)


def test_advantage_shape_is_checked():
    model = _model(5)
    lora = add_lora(model, rank=2, alpha=2.0)
    out = rollout(model, PROMPTS, SEEDS, SPEC)
    config = PolicyConfig(advantage="spatial", clip_range=0.2)
    with pytest.raises(ValueError, match="latent grid"):
        policy_update(
            model, torch.optim.SGD(lora, lr=0.0), PROMPTS, out, SPEC, torch.ones(4, 8, 8), config
        )


def test_update_kl_is_zero_before_and_positive_after_an_update():
    backbone = _model()
    params = add_lora(backbone, rank=2, alpha=2.0)
    spec, prompts = SPEC, PROMPTS
    ro = rollout(backbone, prompts, SEEDS, spec)
    before = update_kl_nats(backbone, prompts, ro, spec)
    assert before.nats == pytest.approx(0.0, abs=1e-4)
    assert before.per_step == pytest.approx((0.0,) * spec.window.size, abs=1e-4)
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn_like(p))
    moved = update_kl_nats(backbone, prompts, ro, spec, max_samples=3, micro_batch=2)
    assert moved.nats > 1e-3
    assert len(moved.per_step) == spec.window.size and min(moved.per_step) > 0
    assert sum(moved.per_step) / len(moved.per_step) == pytest.approx(moved.nats, rel=1e-9)
    assert len(moved.velocity.per_step) == spec.window.size and moved.velocity.rms > 0
    assert before.velocity.rms < moved.velocity.rms
    with pytest.raises(ValueError, match="max_samples"):
        update_kl_nats(backbone, prompts, ro, spec, max_samples=0)


@pytest.mark.parametrize("kind, level, block", [("flow_sde", 0.7, 1), ("flow_sde", 0.2, 1),
                                                ("cps", 0.5, 1), ("flow_sde", 0.7, 2)])
def test_velocity_change_recovers_the_velocity_change_from_the_exact_kl(kind, level, block):
    # closed form: the step's mean moves by slope dv, its std stays, so KL = |dmean|^2 / (2 std^2)
    # summed over the action's dims (tile means with block noise); velocity_change must give
    # back the RMS of dv over those dims at each step, whatever the step, kind or level.
    gen = torch.Generator().manual_seed(0)
    times = [(1.0, 0.9), (0.6, 0.5), (0.3, 0.2)]
    x, v = torch.randn(1, 3, 8, 8, generator=gen), torch.randn(1, 3, 8, 8, generator=gen)
    kls, gains, want = [], [], []
    for k, (t, t_next) in enumerate(times):
        dv = (0.01 * (k + 1)) * torch.randn(1, 3, 8, 8, generator=gen)
        old = sde_mean_std(x, v, t, t_next, level, kind, noise_block=block)
        new = sde_mean_std(x, v + dv, t, t_next, level, kind, noise_block=block)
        shift = block_mean(new.mean - old.mean, block)
        kls.append(float((shift**2).sum() / (2 * old.std.flatten()[0] ** 2)))
        gains.append(velocity_gain(t, t_next, level, kind, noise_block=block))
        want.append(float(block_mean(dv, block).pow(2).mean().sqrt()))
    got = velocity_change(tuple(kls), gains, dims=3 * (8 // block) ** 2)
    assert got.per_step == pytest.approx(want, rel=1e-5)
    assert got.rms == pytest.approx((sum(w * w for w in want) / 3) ** 0.5, rel=1e-5)
    # the KL of one velocity change grows down the schedule (smaller std): the point of the unit
    assert gains[0].nats_per_sq < gains[1].nats_per_sq < gains[2].nats_per_sq


def test_velocity_change_validation():
    gain = velocity_gain(1.0, 0.9, 0.7, "flow_sde")
    with pytest.raises(ValueError, match="one gain per window step"):
        velocity_change((0.1, 0.2), [gain], dims=4)
    with pytest.raises(ValueError, match="noise_level > 0"):
        velocity_gain(1.0, 0.9, 0.0, "flow_sde")
    assert velocity_change((-1e-12,), [gain], dims=4).rms == 0.0


def test_halflife_factor():
    assert halflife_factor(0, 10.0) == 1.0 and halflife_factor(7, None) == 1.0
    assert halflife_factor(10, 10.0) == pytest.approx(0.5)
    assert halflife_factor(25, 10.0) == pytest.approx(2 ** -2.5)
    for bad in ((-1, 10.0), (3, 0.0), (3, -2.0)):
        with pytest.raises(ValueError, match="halflife > 0"):
            halflife_factor(*bad)
