"""The forward-process (NFT) update on a tiny real backbone: only LoRA moves; r = 1 at beta 1 is a
plain flow-matching step towards the samples (closed form); positive samples' flow-matching error
falls and negative ones' rises; draws do not depend on the micro-batching; the token-grid pooling
and group centring of a map; per-step maps (ReCAST's weights) take the map of the step nearest each
draw's t; the NaN guard; validation."""

import pytest
import torch

from cast_core.backbones.shapes import ShapesBackbone, ShapesBackboneConfig
from cast_core.lora import add_lora
from cast_core.nft import forward_noised
from cast_core.nft_update import NftConfig, nft_optimality, nft_update
from cast_core.rollout import step_seed
from cast_core.sampling import encode_conditioning, sample_ode

TINY = ShapesBackboneConfig(num_layers=1, num_heads=2, head_dim=8, text_width=16, text_layers=1)
PROMPTS = ["a photo of a red circle"] * 2 + ["a photo of two blue squares"] * 2
SEEDS = [31, 32, 33, 34]
CFG = 1.5


def _policy(seed: int = 0):
    torch.manual_seed(seed)
    model = ShapesBackbone(TINY).eval()
    params = add_lora(model, rank=4, alpha=4.0)
    with torch.no_grad():  # a non-zero B, so the LoRA's A matrices get gradients too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    x0 = sample_ode(model, PROMPTS, SEEDS, num_steps=3, guidance_scale=CFG)
    return model, params, x0


def _fm_error(model, x0, config: NftConfig, seed: int) -> torch.Tensor:
    """|v_theta - v|^2 per sample [N] on epoch 0's draws of `nft_update` (the same generator)."""
    gen = torch.Generator().manual_seed(step_seed(seed, 0))
    t = config.t_min + (config.t_max - config.t_min) * torch.rand(x0.shape[0], generator=gen)
    eps = torch.randn(tuple(x0.shape), generator=gen)
    noised = forward_noised(x0, t, eps)
    cond, uncond = encode_conditioning(model, PROMPTS, CFG)
    with torch.no_grad():
        v = model.velocity(noised.x_t, t, cond, CFG, uncond)
    return (v - noised.target).pow(2).flatten(1).mean(dim=1)


def test_a_step_changes_only_lora_and_records_its_diagnostics():
    model, params, x0 = _policy()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora = [p.detach().clone() for p in params]
    config = NftConfig(group_size=2, inner_epochs=2, steps_per_epoch=2, micro_batch=2)
    steps = nft_update(model, torch.optim.Adam(params, lr=1e-3), PROMPTS, x0,
                       torch.tensor([1.0, -1.0, 0.5, -0.5]), config, CFG, seed=3)
    assert len(steps) == 4 and [s.epoch for s in steps] == [0, 0, 1, 1]
    assert all(not s.skipped and s.samples == 2 and len(s.loss_by_t) == 4 for s in steps)
    assert all(s.loss > 0 and s.grad_norm > 0 for s in steps)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters()
               if not p.requires_grad)
    assert any(not torch.equal(a, b) for a, b in zip(lora, params, strict=True))


def test_all_positive_at_beta_one_is_a_flow_matching_step():
    """r = 1, beta = 1, no adaptive weight: the loss is |v_theta - v|^2 (nft.py), so one SGD
    step of nft_update equals one SGD step on the flow-matching loss of the same draws."""
    config = NftConfig(centre=False, adaptive_weight=False, micro_batch=4, max_grad_norm=1e9)
    model, params, x0 = _policy()
    nft_update(model, torch.optim.SGD(params, lr=0.5), PROMPTS, x0, torch.full((4,), 10.0),
               config, CFG, seed=5)
    after_nft = [p.detach().clone() for p in params]

    model, params, x0 = _policy()
    gen = torch.Generator().manual_seed(step_seed(5, 0))
    t = config.t_min + (config.t_max - config.t_min) * torch.rand(4, generator=gen)
    eps = torch.randn(tuple(x0.shape), generator=gen)
    noised = forward_noised(x0, t, eps)
    cond, uncond = encode_conditioning(model, PROMPTS, CFG)
    opt = torch.optim.SGD(params, lr=0.5)
    loss = (model.velocity(noised.x_t, t, cond, CFG, uncond) - noised.target).pow(2).mean()
    loss.backward()
    opt.step()
    for a, b in zip(after_nft, params, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_positive_samples_get_closer_and_negative_ones_further(sign):
    config = NftConfig(centre=False, micro_batch=4)
    model, params, x0 = _policy()
    before = _fm_error(model, x0, config, seed=7)
    nft_update(model, torch.optim.SGD(params, lr=0.05), PROMPTS, x0, torch.full((4,), sign * 5),
               config, CFG, seed=7)
    after = _fm_error(model, x0, config, seed=7)
    assert (sign * (before - after)).mean() > 0


def test_draws_do_not_depend_on_the_micro_batch():
    results = []
    for micro in (1, 4):
        model, params, x0 = _policy()
        config = NftConfig(group_size=2, micro_batch=micro, inner_epochs=2)
        steps = nft_update(model, torch.optim.SGD(params, lr=0.1), PROMPTS, x0,
                           torch.tensor([1.0, -1.0, 2.0, -2.0]), config, CFG, seed=9)
        results.append(([s.loss for s in steps], [p.detach().clone() for p in params]))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-4)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_map_optimality_is_pooled_to_tokens_and_centred_per_group():
    config = NftConfig(group_size=2, a_max=1.0)
    adv = torch.zeros(4, 8, 8)
    adv[0, 0, 0] = 4.0  # one latent position of the top-left 4 x 4 token
    r = nft_optimality(adv, (4, 3, 8, 8), config, token_grid=(2, 2))
    assert r.shape == (4, 8, 8)
    # the token's mean 4 / 16 = 0.25, centred in its group: +-0.125, r = 0.5 +- 0.5 * 0.125
    torch.testing.assert_close(r[0, :4, :4], torch.full((4, 4), 0.5625))
    torch.testing.assert_close(r[1, :4, :4], torch.full((4, 4), 0.4375))
    torch.testing.assert_close(r[:2, 4:], torch.full((2, 4, 8), 0.5))
    torch.testing.assert_close(r[2:], torch.full((2, 8, 8), 0.5))
    shifted = nft_optimality(adv + torch.tensor([3.0, 3.0, -1.0, -1.0])[:, None, None],
                             (4, 3, 8, 8), config, token_grid=(2, 2))
    torch.testing.assert_close(shifted, r)  # a group's common offset carries no credit


def _trained(advantages: torch.Tensor, config: NftConfig, step_times=None) -> list[torch.Tensor]:
    model, params, x0 = _policy()
    nft_update(model, torch.optim.SGD(params, lr=0.5), PROMPTS, x0, advantages, config, CFG,
               seed=5, step_times=step_times)
    return [p.detach().clone() for p in params]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_step_maps_take_the_map_of_the_step_nearest_each_draw():
    _, _, x0 = _policy()
    h, w = x0.shape[-2:]
    m = torch.randn(4, h, w, generator=torch.Generator().manual_seed(0))
    config = NftConfig(group_size=2, t_min=0.3, t_max=0.7)
    plain, negated = _trained(m, config), _trained(-m, config)
    assert not _same(plain, negated)
    steps = torch.stack([m, -m], dim=1)  # [N, K = 2, h, w]
    # every draw in [0.3, 0.7] is nearer 0.5 than 0.0 (step 0), nearer 0.5 than 1.0 (step 1)
    assert _same(_trained(steps, config, torch.tensor([0.5, 0.0])), plain)
    assert _same(_trained(steps, config, torch.tensor([1.0, 0.5])), negated)
    assert _same(_trained(torch.stack([m, m], dim=1), config, torch.tensor([0.9, 0.1])), plain)
    # mixed: epoch 0's draws (the generator nft_update uses) pick each sample's map
    gen = torch.Generator().manual_seed(step_seed(5, 0))
    t = config.t_min + (config.t_max - config.t_min) * torch.rand(4, generator=gen)
    assert bool((t > 0.5).any()) and bool((t < 0.5).any())  # seed 5 draws both sides
    picked = torch.where((t > 0.5)[:, None, None], m, -m)
    assert _same(_trained(steps, config, torch.tensor([0.9, 0.1])), _trained(picked, config))


def test_step_maps_need_their_step_times():
    model, params, x0 = _policy()
    opt, h, w = torch.optim.SGD(params, lr=0.1), *x0.shape[-2:]
    with pytest.raises(ValueError, match="come with their steps' times"):
        nft_update(model, opt, PROMPTS, x0, torch.zeros(4, 2, h, w), NftConfig(), CFG, 0)
    with pytest.raises(ValueError, match="come with their steps' times"):
        nft_update(model, opt, PROMPTS, x0, torch.zeros(4, h, w), NftConfig(centre=False), CFG,
                   0, step_times=torch.tensor([0.9, 0.1]))
    with pytest.raises(ValueError, match="decrease strictly"):
        nft_update(model, opt, PROMPTS, x0, torch.zeros(4, 2, h, w), NftConfig(), CFG, 0,
                   step_times=torch.tensor([0.1, 0.9]))


def test_a_nan_advantage_skips_the_step_and_keeps_the_weights():
    model, params, x0 = _policy()
    lora = [p.detach().clone() for p in params]
    config = NftConfig(centre=False, micro_batch=4)
    steps = nft_update(model, torch.optim.Adam(params, lr=1e-2), PROMPTS, x0,
                       torch.tensor([1.0, float("nan"), 0.0, 0.0]), config, CFG, seed=1)
    assert steps[0].skipped and "non-finite" in steps[0].skip_reason and steps[0].loss is None
    assert all(torch.equal(a, b) for a, b in zip(lora, params, strict=True))


@pytest.mark.parametrize(
    "kwargs, match",
    [({"t_min": 0.5, "t_max": 0.4}, "t_min < t_max"), ({"beta": 0.0}, "beta"),
     ({"group_size": 0}, "group_size"), ({"a_max": float("inf")}, "a_max")],
)
def test_config_validation_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NftConfig(**kwargs)


def test_update_validation_says_what_to_fix():
    model, params, x0 = _policy()
    opt = torch.optim.SGD(params, lr=0.1)
    with pytest.raises(ValueError, match="groups of 3"):
        nft_update(model, opt, PROMPTS, x0, torch.zeros(4), NftConfig(group_size=3), CFG, 0)
    with pytest.raises(ValueError, match="latent grid"):
        nft_update(model, opt, PROMPTS, x0, torch.zeros(4, 8, 8), NftConfig(centre=False), CFG, 0)
    with pytest.raises(ValueError, match="one prompt per sample"):
        nft_update(model, opt, PROMPTS[:3], x0, torch.zeros(4), NftConfig(), CFG, 0)
