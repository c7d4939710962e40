"""One iteration's credit from its atom scores: every advantage the trainer may train on.

Composes `cast_core.advantage` and `cast_core.pixel_map` for one batch of B prompt groups of G samples (N = B G samples,
sample n = b G + g, prompt-major as the rollout stores them):
1. atom advantages: group z-scores of the atom scores (`atom_advantages`, `atom_norm`), then,
   with `gate_by_parents`, a child atom's credit zeroed in the samples where a direct parent
   scored < 0.5 (`gate_by_parents`), or with `gate_on` "score" the child's score set to 0
   there before the z-score (`gate_scores`; the scalar reward stays ungated); with
   `credit_norm` "group", each sample's credits then
   shifted and scaled so that its mean atom credit is the group z-score of those means
   (`group_normalise_credit`);
2. the scalar reward of each sample (`atom_reward`) and its Flow-GRPO advantage
   (`scalar_advantages`);
3. CAST's pixel map (`pixel_advantage_map`) from the gated advantages and the heatmaps that
   `heatmap_source` selects (`group_heatmaps`), pooled onto the log-prob grid h x w;
4. the no-map credit (`atom_mean_credit`) and the map's per-atom-type shares in the order of
   the batch's type indices (`grouped_advantage_maps`, pooled like the map; for ReCAST).
Every output is always computed, so a run of one recipe can be inspected against the others; the
recipe's `advantage.kind` picks what trains. Pooling is linear, so `type_maps.sum(1)` is the
pooled unclamped map: it equals `maps` wherever no pixel of a grid cell was clamped.
"""

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from cast_core.advantage import (
    AtomAdvantages,
    AtomNorm,
    CreditNorm,
    GateOn,
    ScalarAdvantages,
    atom_advantages,
    atom_reward,
    gate_by_parents,
    gate_scores,
    group_normalise_credit,
    scalar_advantages,
)
from cast_core.pixel_map import (
    HeatmapNorm,
    HeatmapSource,
    atom_mean_credit,
    group_heatmaps,
    grouped_advantage_maps,
    pixel_advantage_map,
    pool_to_grid,
)


@dataclass(frozen=True)
class AtomBatch:
    """One iteration's atom scores as tensors. scores [B, G, A] (float, in [0, 1]); heatmaps
    [B, G, A, H, W] (>= 0); mask [B, A] bool, the valid atoms (padded atoms are never read);
    types [B, A] int64 in [0, num_types) at valid atoms; parents [B, A, A] bool, parents[b, a, p]
    when atom p is a direct parent of atom a."""

    scores: Tensor
    heatmaps: Tensor
    mask: Tensor
    types: Tensor
    parents: Tensor

    def __post_init__(self) -> None:
        b, g, a = self.scores.shape if self.scores.dim() == 3 else (None, None, None)
        shapes = {"scores": (self.scores, (b, g, a)), "mask": (self.mask, (b, a)),
                  "types": (self.types, (b, a)), "parents": (self.parents, (b, a, a))}
        bad = [f"{name} {tuple(t.shape)}" for name, (t, want) in shapes.items()
               if b is None or tuple(t.shape) != want]
        if b is None or self.heatmaps.dim() != 5 or self.heatmaps.shape[:3] != (b, g, a):
            bad.append(f"heatmaps {tuple(self.heatmaps.shape)}")
        if bad:
            raise ValueError("an AtomBatch needs scores [B, G, A], heatmaps [B, G, A, H, W], "
                             "mask and types [B, A], parents [B, A, A]; got " + ", ".join(bad))
        if self.mask.dtype != torch.bool or self.parents.dtype != torch.bool:
            raise ValueError(f"mask and parents must be bool; got {self.mask.dtype}, "
                             f"{self.parents.dtype}")

    @property
    def group_size(self) -> int:
        return self.scores.shape[1]


@dataclass(frozen=True)
class CreditConfig:
    """The recipe's `advantage` section without `kind`
    (tasks.stages.recipe_method.AdvantageSection documents each field)."""

    gate_by_parents: bool = True
    global_weight: float = 1.0
    clip: float = 5.0
    reward: Literal["mean", "geometric"] = "mean"
    scalar_mode: Literal["group", "global_std"] = "group"
    std_floor: float = 1e-4
    heatmap_norm: HeatmapNorm = "mass"
    atom_norm: AtomNorm = "atom"
    spatial_mix: float = 1.0
    heatmap_source: HeatmapSource = "own"
    credit_norm: CreditNorm = "none"
    gate_on: GateOn = "credit"


@dataclass(frozen=True)
class BatchCredit:
    """atoms: the ungated atom advantages with their group statistics ([B, G, A], [B, A]);
    advantages [B, G, A] after gating and the credit norm; gated [B, G, A] bool, where a
    parent was absent (the credits gating zeroed, or the scores it set to 0); rewards
    [B, G]; scalar: Flow-GRPO's advantages of them; maps [N, h, w] CAST's clamped pixel map on
    the log-prob grid; atom [N] the no-map credit; type_maps [N, T, h, w] the map's unclamped
    share of each atom type; mass [N] mean |map| at pixel resolution; coverage [N] the mean
    heatmap coverage."""

    atoms: AtomAdvantages
    advantages: Tensor
    gated: Tensor
    rewards: Tensor
    scalar: ScalarAdvantages
    maps: Tensor
    atom: Tensor
    type_maps: Tensor
    mass: Tensor
    coverage: Tensor


def batch_credit(batch: AtomBatch, config: CreditConfig, grid: tuple[int, int],
                 num_types: int) -> BatchCredit:
    """Every credit of one batch (module docstring); grid = (h, w) of the log-probs, num_types
    the number of atom types `batch.types` indexes."""
    s, mask, g = batch.scores.double(), batch.mask, batch.group_size
    b, _, a_max, hh, ww = batch.heatmaps.shape
    on_scores = config.gate_by_parents and config.gate_on == "score"
    s_credit = gate_scores(s, batch.parents) if on_scores else s  # [B, G, A]
    adv = atom_advantages(s_credit, mask, config.std_floor, config.atom_norm)
    a, gated = adv.advantages, torch.zeros_like(adv.advantages, dtype=torch.bool)  # [B, G, A]
    if config.gate_by_parents:
        gated = gate_by_parents(torch.ones_like(a), s_credit, batch.parents) == 0
        if not on_scores:
            a = gate_by_parents(adv.advantages, s, batch.parents)
    if config.credit_norm == "group":
        a = group_normalise_credit(a, mask, config.std_floor)
    rewards = atom_reward(s, mask, config.reward)  # [B, G]
    scalar = scalar_advantages(rewards, config.scalar_mode, config.std_floor)
    flat_a = a.reshape(b * g, a_max).float()  # [N, A]
    heat = group_heatmaps(batch.heatmaps.float(), config.heatmap_source)
    flat_heat = heat.reshape(b * g, a_max, hh, ww)  # [N, A, H, W]
    flat_mask = mask.repeat_interleave(g, 0)  # [N, A]
    pix = pixel_advantage_map(flat_a, flat_heat, flat_mask, config.global_weight, config.clip,
                              config.heatmap_norm, config.spatial_mix)
    by_type = grouped_advantage_maps(flat_a, flat_heat, flat_mask,
                                     batch.types.repeat_interleave(g, 0), num_types,
                                     config.global_weight, config.heatmap_norm,
                                     config.spatial_mix)  # [N, T, H, W]
    h, w = grid
    type_maps = pool_to_grid(by_type.flatten(0, 1), h, w).view(b * g, num_types, h, w)
    return BatchCredit(atoms=adv, advantages=a, gated=gated, rewards=rewards, scalar=scalar,
                       maps=pool_to_grid(pix.map, h, w),
                       atom=atom_mean_credit(flat_a, flat_mask, config.clip),
                       type_maps=type_maps, mass=pix.mass,
                       coverage=pix.coverage.mean(dim=(-2, -1)))

