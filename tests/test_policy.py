"""LoRA policy updates on a tiny real backbone: frozen base, the reference model, the effect of one
update, spatial vs scalar objectives, step-wise gradient accumulation, the NaN guard, validation."""

import pytest
import torch

from cast_core.backbones.shapes import ShapesBackbone, ShapesBackboneConfig
from cast_core.loss import spatial_clipped_loss
from cast_core.policy import PolicyConfig, add_lora, policy_update, reference_mode
from cast_core.rollout import RolloutSpec, replay_log_probs, rollout
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
        advantage="scalar", clip_range=1e-2, inner_epochs=2, micro_batch=3, kl_beta=0.1
    )
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    steps = policy_update(
        model, torch.optim.Adam(lora, lr=1e-2), PROMPTS, out, SPEC, adv, config, shuffle_seed=0
    )
    assert [(s.epoch, s.micro_batch) for s in steps] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert steps[0].first_ratio_ok is True and abs(steps[0].ratio_mean - 1.0) < 1e-4
    assert all(s.first_ratio_ok is None for s in steps[1:])
    assert steps[0].kl == 0.0  # LoRA B = 0: policy == reference before the first step
    assert steps[-1].kl > 0.0 and not any(s.skipped for s in steps)


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


def test_step_wise_accumulation_equals_the_all_steps_gradient():
    model = _model(3)
    lora = add_lora(model, rank=2, alpha=2.0)
    with torch.no_grad():  # move off B = 0 so both LoRA factors get gradients
        for p in lora:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    out = rollout(model, PROMPTS, SEEDS, SPEC)
    adv = torch.randn(4, 32, 32, generator=torch.Generator().manual_seed(1))
    config = PolicyConfig(advantage="spatial", clip_range=0.2, micro_batch=4, max_grad_norm=1e9)
    step = policy_update(model, torch.optim.SGD(lora, lr=0.0), PROMPTS, out, SPEC, adv, config)[0]
    accumulated = [p.grad.clone() for p in lora]
    for p in lora:
        p.grad = None
    full = spatial_clipped_loss(
        replay_log_probs(model, out, PROMPTS, SPEC).log_probs, out.log_probs, adv, 0.2
    )
    full.loss.backward()
    assert step.loss == pytest.approx(float(full.loss.detach()), rel=1e-5, abs=1e-7)
    for got, p in zip(accumulated, lora):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-7)


def test_nan_advantage_skips_the_micro_batch_and_leaves_weights_unchanged():
    model = _model(4)
    lora = add_lora(model, rank=2, alpha=2.0)
    out = rollout(model, PROMPTS, SEEDS, SPEC)
    adv = torch.ones(4, 32, 32)
    adv[0, 3, 5] = float("nan")
    before = _snapshot(model)
    optimizer = torch.optim.Adam(lora, lr=1e-2)
    one = PolicyConfig(advantage="spatial", clip_range=0.2, micro_batch=4)
    (step,) = policy_update(model, optimizer, PROMPTS, out, SPEC, adv, one)
    assert step.skipped and step.skip_reason == "non-finite loss"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in lora) and not optimizer.state
    two = PolicyConfig(advantage="spatial", clip_range=0.2, micro_batch=2)
    steps = policy_update(model, optimizer, PROMPTS, out, SPEC, adv, two)
    assert [s.skipped for s in steps] == [True, False]


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
