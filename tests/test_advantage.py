"""Atom and scalar advantages, gating, pixel maps and grid pooling against closed forms."""

import itertools
import math

import pytest
import torch

from cast_core.advantage import atom_advantages, atom_reward, gate_by_parents, scalar_advantages
from cast_core.pixel_map import (
    atom_mean_credit,
    group_heatmaps,
    grouped_advantage_maps,
    pixel_advantage_map,
    pool_to_grid,
)


def test_identical_atom_scores_give_exactly_zero():
    # 0.1 is not representable; the group mean of 7 copies can be off by one rounding.
    scores = torch.full((3, 7, 4), 0.1)
    scores[1, :, 2] = 0.7
    out = atom_advantages(scores, torch.ones(3, 4, dtype=torch.bool))
    assert torch.equal(out.advantages, torch.zeros_like(scores))
    assert out.zero_variance.all()


def test_z_scores_match_hand_formula():
    s = torch.tensor([[[0.2, 0.9], [0.4, 0.9], [0.9, 0.1]]])  # [B=1, G=3, A=2]
    out = atom_advantages(s, torch.ones(1, 2, dtype=torch.bool))
    for a in range(2):
        col = [float(s[0, g, a]) for g in range(3)]
        mean = sum(col) / 3
        std = math.sqrt(sum((x - mean) ** 2 for x in col) / 3)  # population std
        expected = torch.tensor([(x - mean) / std for x in col])
        torch.testing.assert_close(out.advantages[0, :, a], expected)
        assert out.mean[0, a].item() == pytest.approx(mean)
        assert out.std[0, a].item() == pytest.approx(std)
    # unit root-mean-square per group with the population std
    torch.testing.assert_close(out.advantages.pow(2).mean(dim=1), torch.ones(1, 2))


def test_masked_atoms_give_zero_and_do_not_leak():
    torch.manual_seed(0)
    scores = torch.rand(2, 5, 3)
    scores[0, :, 2] = float("nan")  # padding may hold anything
    mask = torch.tensor([[True, True, False], [True, True, True]])
    out = atom_advantages(scores, mask)
    assert torch.equal(out.advantages[0, :, 2], torch.zeros(5))
    assert not out.zero_variance[0, 2]
    ref = atom_advantages(scores[1:], mask[1:])
    torch.testing.assert_close(out.advantages[1], ref.advantages[0])


def test_gating_zeroes_children_only_when_parent_absent():
    # atoms: 0 = object (parent), 1 = its colour (child of 0), 2 = independent object
    adv = torch.tensor([[[1.0, 2.0, 3.0], [-1.0, -2.0, -3.0]]])  # [1, 2, 3]
    scores = torch.tensor([[[0.9, 0.8, 0.1], [0.2, 0.8, 0.1]]])  # parent present in g=0 only
    parents = torch.zeros(1, 3, 3, dtype=torch.bool)
    parents[0, 1, 0] = True
    gated = gate_by_parents(adv, scores, parents, present_threshold=0.5)
    expected = torch.tensor([[[1.0, 2.0, 3.0], [-1.0, 0.0, -3.0]]])
    assert torch.equal(gated, expected)


@pytest.mark.parametrize("mode", ["group", "global_std"])
def test_scalar_advantages_match_formulas(mode):
    r = torch.tensor([[0.1, 0.5, 0.9, 0.3], [0.2, 0.2, 0.6, 0.8]])
    out = scalar_advantages(r, mode=mode)
    mean = r.mean(dim=1, keepdim=True)
    if mode == "group":
        std = ((r - mean) ** 2).mean(dim=1, keepdim=True).sqrt()
    else:
        std = ((r - r.mean()) ** 2).mean().sqrt()
    torch.testing.assert_close(out.advantages, (r - mean) / std)


@pytest.mark.parametrize("mode", ["group", "global_std"])
def test_identical_rewards_give_exactly_zero(mode):
    r = torch.tensor([[0.1] * 7, [0.3, 0.9, 0.5, 0.1, 0.2, 0.6, 0.4]])
    out = scalar_advantages(r, mode=mode)
    assert torch.equal(out.advantages[0], torch.zeros(7))
    assert out.advantages[1].abs().sum() > 0


def test_scalar_unknown_mode_raises():
    with pytest.raises(ValueError, match="mode"):
        scalar_advantages(torch.rand(2, 3), mode="batch")  # type: ignore[arg-type]


def test_atom_reward_mean_and_geometric():
    s = torch.tensor([[[0.5, 0.8, 0.0], [0.0, 1.0, 0.3]]])  # [1, 2, 3]
    mask = torch.tensor([[True, True, False]])
    mean = atom_reward(s, mask, kind="mean")
    torch.testing.assert_close(mean, torch.tensor([[(0.5 + 0.8) / 2, (0.0 + 1.0) / 2]]))
    floor = 1e-6
    geo = atom_reward(s, mask, kind="geometric", log_floor=floor)
    expected = torch.tensor([[math.sqrt(0.5 * 0.8), math.sqrt(floor * 1.0)]])
    torch.testing.assert_close(geo, expected)


def test_uniform_heatmap_one_atom_gives_constant_map():
    adv = torch.tensor([[0.73], [-1.9]])  # [N=2, A=1]
    heat = torch.full((2, 1, 6, 5), 0.37)
    out = pixel_advantage_map(
        adv, heat, torch.ones(2, 1, dtype=torch.bool), global_weight=0.5, clip=5.0
    )
    assert torch.equal(out.map, adv[:, :, None].expand(2, 6, 5))
    assert torch.equal(out.coverage, torch.ones(2, 6, 5))
    torch.testing.assert_close(out.mass, adv[:, 0].abs())


def test_global_term_only_where_uncovered():
    # atom 0 covers the left half, atom 1 is uniform but masked out (padding)
    H, W, gw = 4, 6, 0.3
    heat = torch.zeros(1, 2, H, W)
    heat[0, 0, :, : W // 2] = 2.0
    heat[0, 1] = 1.0
    adv = torch.tensor([[1.5, 9.0]])
    mask = torch.tensor([[True, False]])
    out = pixel_advantage_map(adv, heat, mask, global_weight=gw, clip=10.0)
    a_bar = 1.5
    # left: A * H~ with H~ = H / mean(H) = 2 / 1 = 2 and coverage 1; right: only gw * A_bar
    torch.testing.assert_close(out.map[0, :, : W // 2], torch.full((H, W // 2), 1.5 * 2.0))
    torch.testing.assert_close(out.map[0, :, W // 2 :], torch.full((H, W // 2), gw * a_bar))
    torch.testing.assert_close(out.coverage[0, :, W // 2 :], torch.zeros(H, W // 2))


def test_two_atoms_average_and_clip_bound():
    torch.manual_seed(1)
    heat = torch.rand(3, 4, 8, 8)
    adv = 10 * torch.randn(3, 4)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2] = False  # no valid atom -> zero map
    clip = 2.0
    out = pixel_advantage_map(adv, heat, mask, global_weight=0.5, clip=clip)
    assert out.map.abs().max() <= clip
    assert torch.equal(out.map[2], torch.zeros(8, 8))
    unclipped = pixel_advantage_map(adv, heat, mask, global_weight=0.0, clip=1e9).map
    h_tilde = heat / heat.mean(dim=(-2, -1), keepdim=True)
    expected = (adv[:, :, None, None] * h_tilde).mean(dim=1)
    torch.testing.assert_close(unclipped[:2], expected[:2])


def test_pool_equals_block_means_when_divisible():
    torch.manual_seed(2)
    m = torch.randn(2, 8, 12)
    pooled = pool_to_grid(m, 2, 3)
    blocks = m.reshape(2, 2, 4, 3, 4).mean(dim=(2, 4))
    torch.testing.assert_close(pooled, blocks)


def test_pool_non_divisible_matches_window_formula():
    torch.manual_seed(3)
    m = torch.randn(1, 7, 5)
    h, w = 3, 4
    pooled = pool_to_grid(m, h, w)
    for i in range(h):
        r0, r1 = (i * 7) // h, -((-(i + 1) * 7) // h)
        for j in range(w):
            c0, c1 = (j * 5) // w, -((-(j + 1) * 5) // w)
            assert pooled[0, i, j].item() == pytest.approx(
                m[0, r0:r1, c0:c1].mean().item(), abs=1e-6
            )


def test_pool_upsampling_integer_factor_is_nearest():
    m = torch.arange(6.0).reshape(1, 2, 3)
    up = pool_to_grid(m, 4, 9)
    assert torch.equal(up, m.repeat_interleave(2, dim=1).repeat_interleave(3, dim=2))
    assert pool_to_grid(m, 5, 2).shape == (1, 5, 2)


def test_atom_mean_credit_is_the_clamped_mean_over_valid_atoms():
    adv = torch.tensor([[1.0, -2.0, 4.0], [3.0, 9.0, -7.0], [5.0, 5.0, 5.0]])  # [N=3, A=3]
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    credit = atom_mean_credit(adv, mask, clip=10.0)
    torch.testing.assert_close(credit, torch.tensor([(1.0 - 2.0 + 4.0) / 3, 3.0, 0.0]))
    torch.testing.assert_close(atom_mean_credit(adv, mask, clip=0.5), torch.tensor([0.5, 0.5, 0.0]))
    torch.testing.assert_close(atom_mean_credit(-adv, mask, clip=0.5),
                               torch.tensor([-0.5, -0.5, 0.0]))
    with pytest.raises(ValueError, match="clip must be > 0"):
        atom_mean_credit(adv, mask, clip=0.0)


def test_atom_mean_credit_is_the_spatial_mean_of_the_atom_term():
    # mean_u H~_a = 1 for every atom, so without the global term and the clamp mean_u M = A_bar
    torch.manual_seed(4)
    heat = torch.rand(4, 3, 8, 8, dtype=torch.float64)
    adv = torch.randn(4, 3, dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, False, True], [False, True, False],
                         [True, True, False]])
    m = pixel_advantage_map(adv, heat, mask, global_weight=0.0, clip=1e9).map
    torch.testing.assert_close(m.mean(dim=(-2, -1)), atom_mean_credit(adv, mask, clip=1e9))


def test_group_maps_closed_form_with_partial_coverage():
    # atom 0 (group 1) covers the left half with H = 2; atom 1 (group 2) is uniform; group 0 empty
    H, W, gw = 4, 6, 0.3
    heat = torch.zeros(1, 2, H, W)
    heat[0, 0, :, : W // 2] = 2.0
    heat[0, 1] = 1.0
    adv = torch.tensor([[1.5, -0.8]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    maps = grouped_advantage_maps(adv, heat, mask, torch.tensor([[1, 2]]), 3, gw)
    assert maps.shape == (1, 3, H, W)
    assert torch.equal(maps[0, 0], torch.zeros(H, W))
    # atom 1 covers everything (coverage 1): no global term anywhere; each share is A_a / |A| * H~
    torch.testing.assert_close(maps[0, 1], torch.full((H, W), 1.5 / 2 * 2.0) * (heat[0, 0] > 0))
    torch.testing.assert_close(maps[0, 2], torch.full((H, W), -0.8 / 2))


def test_group_maps_sum_to_the_unclamped_map_and_clamp_to_the_map():
    torch.manual_seed(5)
    heat = torch.rand(3, 5, 8, 8)
    heat[0, 1, :4] = 0.0  # partial coverage so the global term is not zero
    heat[1, 2] = 0.0  # an ungrounded atom: uniform
    adv = 3 * torch.randn(3, 5)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2] = False  # no valid atom: all zero
    groups = torch.randint(0, 4, (3, 5))
    maps = grouped_advantage_maps(adv, heat, mask, groups, 4, global_weight=0.7)  # [N, 4, H, W]
    unclamped = pixel_advantage_map(adv, heat, mask, global_weight=0.7, clip=1e9).map
    torch.testing.assert_close(maps.sum(dim=1), unclamped)
    clip = 1.0
    clamped = pixel_advantage_map(adv, heat, mask, global_weight=0.7, clip=clip).map
    assert (unclamped.abs() > clip).any(), "the clamp never binds: the check below tests nothing"
    torch.testing.assert_close(maps.sum(dim=1).clamp(-clip, clip), clamped)
    assert torch.equal(maps[2], torch.zeros(4, 8, 8))
    for t in range(4):  # a group holding no valid atom of a sample has a zero map
        empty = ~((groups == t) & mask).any(dim=1)
        assert torch.equal(maps[empty, t], torch.zeros_like(maps[empty, t]))


def test_group_maps_reject_groups_out_of_range():
    adv, heat = torch.ones(1, 2), torch.ones(1, 2, 3, 3)
    mask = torch.tensor([[True, False]])
    with pytest.raises(ValueError, match="num_groups=2"):
        grouped_advantage_maps(adv, heat, mask, torch.tensor([[2, 0]]), 2, 0.0)
    grouped_advantage_maps(adv, heat, mask, torch.tensor([[1, 7]]), 2, 0.0)  # padding ignored
    with pytest.raises(ValueError, match="int64"):
        grouped_advantage_maps(adv, heat, mask, torch.tensor([[1.0, 0.0]]), 2, 0.0)


def test_peak_normalisation_credits_a_small_region_at_the_atoms_advantage():
    # one atom grounded on a 2 x 2 region of a 6 x 6 image (area 1/9), no global term
    heat = torch.zeros(1, 1, 6, 6)
    heat[0, 0, 1:3, 2:4] = 0.4
    adv, mask = torch.tensor([[1.5]]), torch.ones(1, 1, dtype=torch.bool)
    inside = torch.zeros(6, 6, dtype=torch.bool)
    inside[1:3, 2:4] = True
    mass = pixel_advantage_map(adv, heat, mask, global_weight=0.0, clip=100.0).map[0]
    peak = pixel_advantage_map(adv, heat, mask, global_weight=0.0, clip=100.0,
                               heatmap_norm="peak").map[0]
    torch.testing.assert_close(mass[inside], torch.full((4,), 1.5 * 9))  # A / area
    torch.testing.assert_close(peak[inside], torch.full((4,), 1.5))  # A, whatever the area
    assert torch.equal(mass[~inside], torch.zeros(32)) and torch.equal(peak[~inside],
                                                                       torch.zeros(32))
    # a uniform heatmap is the same map under both
    flat = torch.full((1, 1, 6, 6), 0.2)
    assert torch.equal(pixel_advantage_map(adv, flat, mask, 0.5, 5.0, "peak").map,
                       pixel_advantage_map(adv, flat, mask, 0.5, 5.0).map)
    with pytest.raises(ValueError, match="heatmap_norm"):
        pixel_advantage_map(adv, heat, mask, 0.0, 5.0, heatmap_norm="area")


def test_peak_group_maps_sum_to_the_peak_map():
    torch.manual_seed(6)
    heat, adv = torch.rand(2, 4, 8, 8), 2 * torch.randn(2, 4)
    heat[0, 1, :5] = 0.0
    mask = torch.ones(2, 4, dtype=torch.bool)
    groups = torch.randint(0, 4, (2, 4))
    maps = grouped_advantage_maps(adv, heat, mask, groups, 4, 0.7, heatmap_norm="peak")
    unclamped = pixel_advantage_map(adv, heat, mask, 0.7, 1e9, heatmap_norm="peak").map
    torch.testing.assert_close(maps.sum(dim=1), unclamped)
    assert not torch.allclose(unclamped, pixel_advantage_map(adv, heat, mask, 0.7, 1e9).map)


def test_pooled_norm_matches_hand_formula_and_mean_is_scaled_scalar():
    s = torch.tensor([[[0.2, 0.9, 0.5], [0.4, 0.9, 0.5], [0.9, 0.1, 0.5], [0.6, 0.8, 0.5]]],
                     dtype=torch.float64)  # [B=1, G=4, A=3]; atom 2 is tied
    mask = torch.ones(1, 3, dtype=torch.bool)
    out = atom_advantages(s, mask, norm="pooled")
    cols = [[float(s[0, g, a]) for g in range(4)] for a in range(3)]
    means = [sum(c) / 4 for c in cols]
    variances = [sum((x - m) ** 2 for x in c) / 4 for c, m in zip(cols, means)]
    sigma = math.sqrt(sum(variances) / 3)  # pooled over the prompt's three atoms
    for a in range(3):
        expected = torch.tensor([(x - means[a]) / sigma for x in cols[a]], dtype=torch.float64)
        torch.testing.assert_close(out.advantages[0, :, a], expected)
    assert torch.equal(out.advantages[0, :, 2], torch.zeros(4, dtype=torch.float64))  # exact 0
    assert out.zero_variance.tolist() == [[False, False, True]]
    torch.testing.assert_close(out.scale, torch.full((1, 3), sigma, dtype=torch.float64))
    # the mean over atoms is Flow-GRPO's scalar advantage times std(R) / sigma
    reward = atom_reward(s, mask)  # [1, 4]
    scalar = scalar_advantages(reward).advantages
    factor = reward.std(dim=1, correction=0) / sigma  # [1]
    torch.testing.assert_close(out.advantages.mean(dim=-1), scalar * factor[:, None])
    assert float(factor) <= 1.0


def test_pooled_norm_keeps_a_nearly_decided_atom_small():
    # 15 samples at 1.00 and one at 0.94: the per-atom z-score gives the odd one -3.9, the
    # pooled scale (dominated by the atom that varies, sigma ~ 0.22) gives it -0.056 / 0.22
    g = 16
    decided = torch.ones(g, dtype=torch.float64)
    decided[3] = 0.94
    varying = torch.linspace(0.0, 1.0, g, dtype=torch.float64)
    s = torch.stack([decided, varying], dim=-1)[None]  # [1, 16, 2]
    mask = torch.ones(1, 2, dtype=torch.bool)
    per_atom = atom_advantages(s, mask, norm="atom").advantages[0, 3, 0]
    pooled = atom_advantages(s, mask, norm="pooled").advantages[0, 3, 0]
    assert per_atom < -3.8
    sigma = math.sqrt((s[0].var(dim=0, correction=0)).mean().item())
    assert pooled.item() == pytest.approx(-0.06 * 15 / 16 / sigma)
    assert -0.3 < pooled < 0.0


def test_pooled_norm_tied_prompt_and_padding_give_exact_zero():
    s = torch.rand(2, 5, 3, dtype=torch.float64)
    s[1] = 0.3  # prompt 1: every atom tied
    mask = torch.tensor([[True, True, False], [True, True, True]])
    out = atom_advantages(s, mask, norm="pooled")
    assert torch.equal(out.advantages[1], torch.zeros(5, 3, dtype=torch.float64))
    assert torch.equal(out.advantages[0, :, 2], torch.zeros(5, dtype=torch.float64))
    assert out.zero_variance[1].all()
    with pytest.raises(ValueError, match="'atom' or 'pooled'"):
        atom_advantages(s, mask, norm="z")


def test_spatial_mix_interpolates_between_the_map_and_the_constant_credit():
    torch.manual_seed(1)
    adv = torch.randn(3, 2)  # [N, A]
    heat = torch.rand(3, 2, 8, 8)
    mask = torch.ones(3, 2, dtype=torch.bool)
    full = pixel_advantage_map(adv, heat, mask, global_weight=0.0, clip=100.0).map
    flat = pixel_advantage_map(adv, heat, mask, global_weight=0.0, clip=100.0,
                               spatial_mix=0.0).map
    torch.testing.assert_close(flat, adv.mean(dim=1)[:, None, None].expand(3, 8, 8))
    mixed = pixel_advantage_map(adv, heat, mask, global_weight=0.0, clip=100.0,
                                spatial_mix=0.3).map
    torch.testing.assert_close(mixed, 0.3 * full + 0.7 * flat)
    # every mix keeps the spatial mean (mass normalisation): A_bar
    torch.testing.assert_close(mixed.mean(dim=(-2, -1)), adv.mean(dim=1))
    with pytest.raises(ValueError, match="spatial_mix"):
        pixel_advantage_map(adv, heat, mask, 0.0, 5.0, spatial_mix=1.5)


def test_group_heatmaps_own_is_identity_and_others_is_the_leave_one_out_mean():
    torch.manual_seed(0)
    heat = torch.rand(2, 3, 2, 4, 5) * 3.0  # [B, G, A, H, W], peaks != 1
    assert group_heatmaps(heat, "own") is heat
    out = group_heatmaps(heat, "group_others")
    hn = heat / heat.amax(dim=(-2, -1), keepdim=True)
    for b in range(2):
        for g in range(3):
            others = [hn[b, o] for o in range(3) if o != g]
            torch.testing.assert_close(out[b, g], (others[0] + others[1]) / 2)


def test_group_heatmaps_others_do_not_depend_on_the_sample_itself():
    torch.manual_seed(1)
    heat = torch.rand(1, 4, 3, 6, 6)
    changed = heat.clone()
    changed[0, 2] = torch.rand(3, 6, 6) * 7.0  # sample 2 draws something else
    a, b = group_heatmaps(heat, "group_others"), group_heatmaps(changed, "group_others")
    torch.testing.assert_close(a[0, 2], b[0, 2])  # its own credit map is unchanged
    assert not torch.allclose(a[0, 0], b[0, 0])  # the others' maps see it


def test_group_heatmaps_zero_counts_as_uniform_and_two_samples_swap():
    heat = torch.zeros(1, 2, 1, 2, 2)
    heat[0, 0, 0, 0, 0] = 0.5  # sample 0: one pixel; sample 1: all zero (ungrounded)
    out = group_heatmaps(heat, "group_others")
    torch.testing.assert_close(out[0, 0, 0], torch.ones(2, 2))
    torch.testing.assert_close(out[0, 1, 0], torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    # identical heatmaps across the group give the same map as the samples' own
    same = torch.rand(1, 1, 2, 3, 3).expand(1, 4, 2, 3, 3).contiguous()
    adv = torch.randn(4, 2)
    mask = torch.ones(4, 2, dtype=torch.bool)
    own = pixel_advantage_map(adv, same.view(4, 2, 3, 3), mask, 0.0, 5.0).map
    others = pixel_advantage_map(adv, group_heatmaps(same, "group_others").view(4, 2, 3, 3), mask,
                                 0.0, 5.0).map
    torch.testing.assert_close(own, others)


def test_group_heatmaps_rejects_single_sample_groups_and_unknown_sources():
    with pytest.raises(ValueError, match="G = 1"):
        group_heatmaps(torch.ones(2, 1, 1, 2, 2), "group_others")
    with pytest.raises(ValueError, match="heatmap_source"):
        group_heatmaps(torch.ones(2, 2, 1, 2, 2), "mine")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        group_heatmaps(-torch.ones(2, 2, 1, 2, 2), "group_others")


def _expected_credit_gradient(q: float, source: str, g: int = 2) -> torch.Tensor:
    """Exact E[sum_g sum_u M_g(u) d log pi_u / d theta_u] [2] for a two-pixel world: each pixel is
    "on" with probability q = sigmoid(theta_u) independently (d log pi_u / d theta_u = x_u - q),
    one count atom "exactly one object pixel" (score 1 or 0), heatmap = the on pixels (none on:
    all zero, which the map treats as uniform). Enumerates every group of g samples."""
    configs = list(itertools.product([0, 1], repeat=2))
    out = torch.zeros(2, dtype=torch.float64)
    for joint in itertools.product(configs, repeat=g):
        x = torch.tensor(joint, dtype=torch.float64)  # [G, 2]
        prob = torch.prod(torch.where(x > 0, q, 1 - q))
        score = (x.sum(1) == 1).double()  # [G]
        adv = atom_advantages(score[None, :, None], torch.ones(1, 1, dtype=torch.bool)).advantages
        heat = group_heatmaps(x[None, :, None, None, :], source)[0]  # [G, 1, 1, 2]
        m = pixel_advantage_map(adv[0], heat, torch.ones(g, 1, dtype=torch.bool), 0.0, 100.0).map
        out += prob * (m[:, 0] * (x - q)).sum(0)
    return out


@pytest.mark.parametrize("q", [0.5, 0.7, 0.3])
def test_own_heatmaps_bias_the_policy_gradient_and_the_group_others_do_not(q):
    """Closed form (cast_core.pixel_map, "Heatmap source"): E[score] = 2 q (1 - q) has the
    per-pixel gradient q (1 - q)(1 - 2 q) (0 at its maximum q = 1/2). With the other sample's
    heatmap (mass-normalised, E = 1 per pixel) and G = 2 z-scores (A = score - other score) the
    expected credit gradient is exactly 2x the true one. With each sample's own heatmap a pixel
    is credited for being on when the atom held: at q = 1/2 it pushes every pixel on with
    expectation 1/4 (hand-derived: (1/4)(1/4 + 1/2 + 0 - 1/4) per sample, two samples), and at
    q = 0.7 it has the wrong sign: it grows the objects past the count."""
    truth = q * (1 - q) * (1 - 2 * q)
    others = _expected_credit_gradient(q, "group_others")
    torch.testing.assert_close(others, torch.full((2,), 2 * truth, dtype=torch.float64),
                               atol=1e-6, rtol=0)
    own = _expected_credit_gradient(q, "own")
    assert (own > 0).all()  # more object pixels, whatever the atom needs
    if q == 0.5:
        torch.testing.assert_close(own, torch.full((2,), 0.25, dtype=torch.float64), atol=1e-6,
                                   rtol=0)
    if q == 0.7:
        assert truth < 0  # the truth: fewer pixels on


def test_group_normalise_credit_closed_form_tie_and_padding():
    from cast_core.advantage import group_normalise_credit

    adv = torch.tensor([[[1.0, 3.0, 9.0], [-1.0, 1.0, 9.0]],  # c = 2, 0: mean 1, std 1
                        [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]], dtype=torch.float64)  # c tied
    mask = torch.tensor([[True, True, False], [True, True, False]])
    out = group_normalise_credit(adv, mask)
    assert out[0].tolist() == [[0.0, 2.0, 0.0], [-2.0, 0.0, 0.0]]
    assert (out[1] == 0).all()
    with pytest.raises(ValueError, match="std_floor"):
        group_normalise_credit(adv, mask, std_floor=0.0)


def test_gate_scores_fails_every_descendant_of_a_missing_parent():
    from cast_core.advantage import gate_scores

    # atoms: 0 object, 1 its colour (child of 0), 2 a relation on the colour (child of 1)
    parents = torch.zeros(1, 3, 3, dtype=torch.bool)
    parents[0, 1, 0] = parents[0, 2, 1] = True
    scores = torch.tensor([[[0.9, 0.8, 0.7],     # all present: unchanged
                            [0.2, 0.8, 0.7],     # object missing: colour and relation fail
                            [0.9, 0.3, 0.7]]])   # colour wrong: the relation on it fails
    out = gate_scores(scores, parents)
    want = torch.tensor([[[0.9, 0.8, 0.7], [0.2, 0.0, 0.0], [0.9, 0.3, 0.0]]])
    assert torch.equal(out, want)
