"""CAST's pixel advantage map: atom advantages projected through heatmaps, group maps, the
no-map credit and pooling onto the log-prob grid. The atom advantages come from
`cast_core.advantage`.

Pixel map, for one sample and its valid atoms a (heatmaps H_a >= 0 on an H x W grid):
    Hn_a(u)     = H_a(u) / max_u H_a(u)                    peak-normalised, in [0, 1]
    H~_a(u)     = Hn_a(u) / mean_u Hn_a(u)  (= H_a / mean_u H_a, so each map has mean 1)
    coverage(u) = max_a Hn_a(u)                            in [0, 1]
    A_bar       = mean_a A_a
    M(u)        = (1/|A_valid|) sum_a A_a [lam H~_a(u) + 1 - lam]
                  + global_weight * (1 - coverage(u)) * A_bar
    M(u)       <- clamp(M(u), -clip, clip);   mass = mean_u |M(u)|.
`spatial_mix` lam in [0, 1] (ours; 1 = the CAST paper's map) mixes each atom's heatmap with a uniform
map of the same mean: lam = 0 gives the constant A_bar (no projection), and before the clamp the
policy gradient is linear in M, so lam interpolates between the projected and the uniform credit.
It exists because pixel credit assumes that an atom's outcome depends on the actions inside its
region; on the shapes backbone the SDE noise of the first window steps moves the other quadrants'
colour as much, in total, as its own (issue 17's locality probe), so lam < 1 hedges that bias.
With `heatmap_norm = "peak"` (an option, not the paper's) H~_a = Hn_a: an atom's credit is at
most A_a per pixel whatever its region's area, instead of being concentrated as A_a / area on a
small region (the mass normalisation above, whose clamp then cuts small objects' credit).
An all-zero heatmap is treated as uniform (H~ = 1 and coverage 1 everywhere): an atom the scorer
could not ground credits the whole image. A sample with no valid atom gets M = 0. A uniform
heatmap with one atom gives M = A_a exactly (Hn is exactly 1, so no rounding enters).
Departures from the CAST paper's map: we average over atoms (1/|A_valid|) instead of summing, so the map's
scale does not grow with the atom count (before the global term and the clamp the spatial mean of
M is A_bar); the global term (pixels no atom covers still get the sample's overall credit) is ours.

Heatmap source (`heatmap_source`, ours). With "own" (the CAST paper's) a sample's credit at u
comes from its own heatmaps; with "group_others" each sample's heatmap of atom a is replaced by
the mean over the *other* G - 1 samples of its group of their peak-normalised heatmaps of a (an
all-zero heatmap counts as uniform, as above):
    H_a^(g)(u)  <-  1/(G - 1) sum_{g' != g} Hn_a^(g')(u).
Why: at a window step the policy factorises over positions, pi(x) = prod_u pi_u(x_u | s), and the
estimator sum_u c_u grad log pi_u(x_u | s) has the expectation sum_u grad_u E[c_u], where grad_u
moves only position u's action distribution and c_u is treated as that position's reward. With
c_u = A H~(u) and H~ drawn by the sample's own pixels, H~(u) depends on the action at u itself:
position u is rewarded for *being inside the heatmap* when A > 0 and for leaving it when A < 0,
i.e. "grow the objects of above-mean atoms, erase those of below-mean ones", whatever the atom
depends on (a count atom that fails with one square drawn teaches the policy to erase that
square). The other samples' heatmaps do not depend on this sample's actions (given the group's
starting state), so E[c_u | s, x_u] = H_bar(u) E[A | s, x_u] and the estimator becomes
sum_u H_bar(u) grad_u E[A]: the exact per-position gradient reweighted by a non-negative,
action-independent prior (unbiased up to that reweighting, like the scalar estimator with
H_bar = 1). It needs G >= 2; with `sampling.shared_noise` the group's layouts share one starting
noise, so H_bar is sharp where the group agrees. A closed form in the tests: two pixels, each on
with probability q, one count atom "exactly one object pixel", heatmap = the on pixels; E[score]
peaks at q = 1/2, where own heatmaps still push both pixels on (expected credit gradient 1/4 per
pixel with G = 2) and at q = 0.7 point the wrong way, while the others' heatmaps give exactly twice
the true gradient. Measured on the shapes world in issue 17.

Group maps (e.g. one per atom type, for ReCAST's per-reward step weights): with each valid atom in
one group T, group T's share of M before the clamp is
    M_T(u) = (1/|A_valid|) sum_{a in T} A_a [H~_a(u) + global_weight * (1 - coverage(u))],
coverage over all atoms; so sum_T M_T(u) = M(u) before the clamp, i.e. clamp(sum_T M_T) = M.
Group maps are not clamped; `step_weighted_maps` weights them per window step and clamps the sum
(ReCAST: group = atom type, weight = the reward's weight at that step).

No-map credit (the "atom" ablation: atom-level credit without pixel projection): one constant per
sample, c = clamp(A_bar, -clip, clip), A_bar = mean_a A_a over valid atoms (0 without any). It is
the spatial mean of M's atom term; a map equal to c everywhere trains on the same atom advantages
with the heatmaps taken out.

Pooling onto the latent/token grid uses adaptive average pooling for any h x w: with H, W
multiples of h, w it is the block mean; for h > H (or w > W) each cell averages the one or two
pixels its window touches, which for integer factors is nearest-neighbour replication.
"""

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

HeatmapNorm = Literal["mass", "peak"]
HeatmapSource = Literal["own", "group_others"]


@dataclass(frozen=True)
class PixelMap:
    """map [N, H, W] clamped advantage per pixel; coverage [N, H, W] in [0, 1];
    mass [N] = mean_u |map|."""

    map: Tensor
    coverage: Tensor
    mass: Tensor


def _check_map_inputs(advantages: Tensor, heatmaps: Tensor, atom_mask: Tensor) -> None:
    N, A = advantages.shape
    if heatmaps.dim() != 4 or heatmaps.shape[:2] != (N, A) or atom_mask.shape != (N, A):
        raise ValueError(
            f"need advantages [N, A], heatmaps [N, A, H, W], atom_mask [N, A]: got "
            f"{tuple(advantages.shape)}, {tuple(heatmaps.shape)}, {tuple(atom_mask.shape)}"
        )


def _atom_weights(advantages: Tensor, atom_mask: Tensor) -> Tensor:
    """A_a / |A_valid| [N, A] (0 at padded atoms); its sum over atoms is A_bar."""
    n_valid = atom_mask.sum(dim=1).clamp_min(1).to(advantages.dtype)  # [N]
    return torch.where(atom_mask, advantages, 0.0) / n_valid[:, None]


def _grouped_maps(
    advantages: Tensor, heatmaps: Tensor, atom_mask: Tensor, onehot: Tensor, global_weight: float,
    heatmap_norm: HeatmapNorm = "mass", spatial_mix: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """(unclamped maps M_T [N, T, H, W], coverage [N, H, W]); onehot [N, A, T] puts atoms in
    groups (module docstring)."""
    if heatmap_norm not in ("mass", "peak"):
        raise ValueError(f"heatmap_norm must be 'mass' or 'peak'; got {heatmap_norm!r}")
    if not 0.0 <= spatial_mix <= 1.0:
        raise ValueError(f"spatial_mix must lie in [0, 1] (1 = heatmaps only, 0 = uniform); "
                         f"got {spatial_mix!r}")
    valid = atom_mask[:, :, None, None]  # [N, A, 1, 1]
    h = torch.where(valid, heatmaps, torch.ones_like(heatmaps))  # [N, A, H, W]
    if not torch.isfinite(h).all() or (h < 0).any():
        raise ValueError("heatmaps at valid atoms must be finite and >= 0; clamp the scorer's maps")
    dtype = torch.promote_types(advantages.dtype, h.dtype)
    h = h.to(dtype)
    peak = h.amax(dim=(-2, -1), keepdim=True)  # [N, A, 1, 1]
    hn = torch.where(peak > 0, h / peak.clamp_min(torch.finfo(dtype).tiny), 1.0)  # [N, A, H, W]
    h_tilde = hn / hn.mean(dim=(-2, -1), keepdim=True) if heatmap_norm == "mass" else hn
    if spatial_mix != 1.0:
        h_tilde = spatial_mix * h_tilde + (1.0 - spatial_mix)  # [N, A, H, W]
    coverage = torch.where(valid, hn, 0.0).amax(dim=1)  # [N, H, W]
    w = _atom_weights(advantages.to(dtype), atom_mask)[:, :, None] * onehot.to(dtype)  # [N, A, T]
    atom_term = torch.einsum("nat,nahw->nthw", w, h_tilde)  # [N, T, H, W]
    uncovered = global_weight * (1.0 - coverage)[:, None]  # [N, 1, H, W]
    return atom_term + uncovered * w.sum(dim=1)[:, :, None, None], coverage


def group_heatmaps(heatmaps: Tensor, source: HeatmapSource) -> Tensor:
    """The heatmaps each sample's map is built from: heatmaps [B, G, A, H, W] (>= 0) ->
    [B, G, A, H, W]. "own" returns them unchanged; "group_others" replaces sample g's heatmap of
    atom a by the mean of the other samples' peak-normalised heatmaps of a (module docstring)."""
    if heatmaps.dim() != 5:
        raise ValueError(f"need heatmaps [B, G, A, H, W]; got {tuple(heatmaps.shape)}")
    if source == "own":
        return heatmaps
    if source != "group_others":
        raise ValueError(f"heatmap_source must be 'own' or 'group_others'; got {source!r}")
    g = heatmaps.shape[1]
    if g < 2:
        raise ValueError(f"heatmap_source 'group_others' needs a group of >= 2 samples; got G = {g}"
                         f" (set prompts.group_size >= 2 or heatmap_source = 'own')")
    if not torch.isfinite(heatmaps).all() or (heatmaps < 0).any():
        raise ValueError("heatmaps must be finite and >= 0; clamp the scorer's maps")
    peak = heatmaps.amax(dim=(-2, -1), keepdim=True)  # [B, G, A, 1, 1]
    hn = torch.where(peak > 0, heatmaps / peak.clamp_min(torch.finfo(heatmaps.dtype).tiny),
                     1.0)  # [B, G, A, H, W]
    return (hn.sum(dim=1, keepdim=True) - hn) / (g - 1)  # [B, G, A, H, W]


def pixel_advantage_map(
    advantages: Tensor, heatmaps: Tensor, atom_mask: Tensor, global_weight: float, clip: float,
    heatmap_norm: HeatmapNorm = "mass", spatial_mix: float = 1.0,
) -> PixelMap:
    """Project atom advantages [N, A] through heatmaps [N, A, H, W] (>= 0); see module docstring."""
    _check_map_inputs(advantages, heatmaps, atom_mask)
    if clip <= 0:
        raise ValueError(f"clip must be > 0, got {clip}; use e.g. 5.0")
    one_group = atom_mask[:, :, None]  # [N, A, 1]
    m, coverage = _grouped_maps(advantages, heatmaps, atom_mask, one_group, global_weight,
                                heatmap_norm, spatial_mix)
    has_atoms = atom_mask.any(dim=1)[:, None, None]  # [N, 1, 1]
    m = torch.where(has_atoms, m[:, 0].clamp(-clip, clip), 0.0)  # [N, H, W]
    return PixelMap(m, coverage, m.abs().mean(dim=(-2, -1)))


def grouped_advantage_maps(
    advantages: Tensor,
    heatmaps: Tensor,
    atom_mask: Tensor,
    groups: Tensor,
    num_groups: int,
    global_weight: float,
    heatmap_norm: HeatmapNorm = "mass",
    spatial_mix: float = 1.0,
) -> Tensor:
    """Group T's share of the unclamped pixel map -> [N, T, H, W] (module docstring): advantages
    [N, A], heatmaps [N, A, H, W], atom_mask [N, A], groups [N, A] int64 in [0, num_groups) at
    valid atoms (padded atoms' entries are ignored). Summed over T: the map before its clamp."""
    _check_map_inputs(advantages, heatmaps, atom_mask)
    if groups.shape != atom_mask.shape or groups.dtype != torch.int64:
        raise ValueError(f"groups must be int64 [N, A] like atom_mask {tuple(atom_mask.shape)}; "
                         f"got {groups.dtype} {tuple(groups.shape)}")
    g = torch.where(atom_mask, groups, 0)  # [N, A]
    if num_groups < 1 or (g < 0).any() or (g >= num_groups).any():
        raise ValueError(f"groups at valid atoms must lie in [0, num_groups={num_groups}); got "
                         f"values {sorted(set(g[atom_mask].tolist()))}")
    onehot = F.one_hot(g, num_groups) * atom_mask[:, :, None]  # [N, A, T]
    return _grouped_maps(advantages, heatmaps, atom_mask, onehot, global_weight, heatmap_norm,
                         spatial_mix)[0]


def step_weighted_maps(group_maps: Tensor, weights: Tensor, clip: float) -> Tensor:
    """Per-step maps from group maps: group_maps [N, T, h, w] (the unclamped shares of
    `grouped_advantage_maps`, possibly pooled), weights [T, K] ->
        M_k(u) = clamp(sum_T weights[T, k] M_T(u), -clip, clip)      [N, K, h, w].
    With every weight 1 it is the clamp of the summed shares, i.e. the CAST map (module
    docstring); ReCAST passes its per-reward, per-step weights here."""
    if group_maps.dim() != 4 or weights.dim() != 2 or weights.shape[0] != group_maps.shape[1]:
        raise ValueError(f"need group_maps [N, T, h, w] and weights [T, K] with the same T; got "
                         f"{tuple(group_maps.shape)} and {tuple(weights.shape)}")
    if not torch.isfinite(weights).all():
        raise ValueError(f"weights must be finite; got {weights.tolist()}")
    w = weights.to(group_maps)
    return torch.einsum("nthw,tk->nkhw", group_maps, w).clamp(-clip, clip)  # [N, K, h, w]


def split_step_maps(scalar: Tensor, maps: Tensor, num_steps: int, scalar_steps: int) -> Tensor:
    """One map per window step: the first `scalar_steps` steps take the scalar advantage as a
    constant map, the others the map. scalar [N], maps [N, h, w] ->
        M_k(u) = scalar_n          for k < scalar_steps,
        M_k(u) = maps_n(u)         for scalar_steps <= k < num_steps,        [N, K, h, w].
    Inside each sample's all-dims ratio (`cast_core.loss.sample_ratio_spatial_loss`) a constant
    map is exactly Flow-GRPO's loss, so the early steps train as Flow-GRPO and the later ones as
    CAST (issue 17: Flow-GRPO gains most on the window [0, 3), CAST's map beats the scalar on
    [3, 6))."""
    if scalar.dim() != 1 or maps.dim() != 3 or maps.shape[0] != scalar.shape[0]:
        raise ValueError(f"need scalar [N] and maps [N, h, w] with the same N; got "
                         f"{tuple(scalar.shape)} and {tuple(maps.shape)}")
    if not 0 <= scalar_steps <= num_steps or num_steps < 1:
        raise ValueError(f"need 0 <= scalar_steps <= num_steps and num_steps >= 1; got "
                         f"scalar_steps {scalar_steps}, num_steps {num_steps}")
    out = maps[:, None].expand(-1, num_steps, -1, -1).clone()  # [N, K, h, w]
    out[:, :scalar_steps] = scalar.to(maps)[:, None, None, None]
    return out


def atom_mean_credit(advantages: Tensor, atom_mask: Tensor, clip: float) -> Tensor:
    """The no-map credit [N]: clamp(mean of the valid atoms' advantages, -clip, clip), 0 for a
    sample without valid atoms; advantages, atom_mask [N, A] (module docstring)."""
    if advantages.dim() != 2 or atom_mask.shape != advantages.shape:
        raise ValueError(f"need advantages and atom_mask [N, A]: got {tuple(advantages.shape)} "
                         f"and {tuple(atom_mask.shape)}")
    if clip <= 0:
        raise ValueError(f"clip must be > 0, got {clip}; use e.g. 5.0")
    return _atom_weights(advantages, atom_mask).sum(dim=1).clamp(-clip, clip)  # [N]


def pool_to_grid(pixel_map: Tensor, h: int, w: int) -> Tensor:
    """Area-pool a map [N, H, W] onto an h x w grid -> [N, h, w] (adaptive average pooling)."""
    if pixel_map.dim() != 3 or h < 1 or w < 1:
        raise ValueError(
            f"need pixel_map [N, H, W] and h, w >= 1: got {tuple(pixel_map.shape)}, {h}, {w}"
        )
    return F.adaptive_avg_pool2d(pixel_map[:, None], (h, w))[:, 0]  # [N, h, w]
