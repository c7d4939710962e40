"""Group-relative advantages per atom, DSG-style gating, the credit norm, the scalar baseline.

Variant: CAST atom advantages plus the Flow-GRPO scalar baseline.

Atom advantage. Within the G samples of one prompt, each atom's score is centred on its group
mean and divided by a scale, `atom_norm` "atom" (the CAST paper's per-atom z-score) or "pooled":
    "atom":    A[b, g, a] = (s[b, g, a] - mean_g s[b, :, a]) / max(std_g s[b, :, a], std_floor)
    "pooled":  A[b, g, a] = (s[b, g, a] - mean_g s[b, :, a]) / max(sigma_b, std_floor),
               sigma_b^2 = mean over the prompt's valid atoms a of var_g s[b, :, a].
"atom" gives every atom unit spread however little its score varies, so an atom that is nearly
decided (scores 1.00 in 15 samples, 0.94 in one) turns rounding-size differences into advantages
of -3.9, which then outweigh the atoms that matter (measured on the shapes world, issue 17).
"pooled" (ours) keeps each atom's deviation in the units of the prompt's pooled spread: nearly
decided atoms get nearly 0, and the mean over atoms is (R - mean_g R) / sigma_b with R the mean
atom score, i.e. Flow-GRPO's scalar advantage times std_g R / sigma_b (<= 1): with uniform
heatmaps, CAST's credit is Flow-GRPO's up to a per-prompt factor. A prompt whose pooled spread
is <= std_floor is a tie (all its advantages 0).
Every std is the *population* std (ddof = 0), as numpy's default that Flow-GRPO's group
statistics use: it is defined for every G >= 1 and gives each group's z-scores a root-mean-square
of exactly 1, so the advantage scale does not depend on G. A group whose std is <= std_floor is
a tie: its advantages are set to exactly 0 (the mean of equal floats can be off by one rounding,
which must not leak 1e-8 credits). Padded atoms (atom_mask False) get 0 and are never read.

Gating (DSG-style, ours to specify): a child atom gets 0 in sample g when any of its *direct*
parents scored below `present_threshold` in that sample. It is applied after z-scoring, so group
statistics still include the gated samples; pass a transitive closure to gate on ancestors.
Gating the score instead (`gate_scores`, `gate_on = "score"`, DSG's own rule: a question whose
parent is answered "no" counts as failed): the child's *score* is set to 0 where a parent is
absent, before the z-score, and repeated until nothing changes, so a failure reaches every
descendant. Why (issue 17, reports/cfg1-pool8-rank32-credit-fixes): zeroing the *credit* removes
the mostly negative credits of a missing object's count, attribute and relation atoms, so the
gated credit of a group sums to about +0.10 SD 0.42 and orders 4% of its sample pairs against
their mean atom score (a sample that leaves the object out can outrank one that draws it in the
wrong colour); a score of 0 instead ranks a missing object below every way of drawing it.

Credit norm (`credit_norm`, ours; "none" is the paper's). With "group", after gating, each
sample's atom advantages are shifted by its group's mean credit and divided by the spread of
the per-sample credits: with c[b, g] = mean of sample g's valid atom advantages,
    A[b, g, a] <- (A[b, g, a] - mean_g c[b, :]) / max(std_g c[b, :], std_floor),
so every sample's mean atom credit is the group z-score of c, as Flow-GRPO's scalar advantage is
the group z-score of the reward. Why: parent gating zeroes children where the parent failed,
which removes mostly negative credits, so a group's gated credits sum to about +0.10 SD 0.42
instead of 0 (issue 17, reports/cfg1-pool8-rank32-map-decomp); and the pooled norm weighs each
prompt by std_g R / sigma_b instead of 1. Without gating and with `atom_norm` "pooled" the
group-normalised credit's per-sample mean is Flow-GRPO's advantage (c is an affine map of the
mean atom score R), so the two differ only where gating (or the map) makes them differ; the one
exception is a group whose reward std is within a std floor (Flow-GRPO calls it a tie, the
credit's spread std_g R / sigma_b may not), and an atom whose own std is within the floor (its
advantage is set to 0, not to its deviation of at most a few floors).

Scalar baseline (Flow-GRPO): reward = mean or geometric mean of a sample's valid atom scores;
"group" z-scores with per-prompt mean and std, "global_std" with per-prompt mean and one std over
the whole batch. In both modes a prompt whose group std is <= std_floor gets exactly 0.

The pixel map that projects these advantages through heatmaps, and the no-map credit, are in
`cast_core.pixel_map`.
"""

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

AtomNorm = Literal["atom", "pooled"]
CreditNorm = Literal["none", "group"]
GateOn = Literal["credit", "score"]


@dataclass(frozen=True)
class AtomAdvantages:
    """advantages [B, G, A] (0 at padded or tied atoms); mean, std [B, A] over the group
    (0 at padded atoms); zero_variance [B, A] bool: a valid atom whose group std <= std_floor
    (or, with "pooled", whose prompt's pooled spread is); scale [B, A]: the divisor used
    (clamped to std_floor; the atom's std for "atom", the prompt's sigma_b for "pooled")."""

    advantages: Tensor
    mean: Tensor
    std: Tensor
    zero_variance: Tensor
    scale: Tensor


@dataclass(frozen=True)
class ScalarAdvantages:
    """advantages [B, G]; mean [B] per prompt; std [B] (the one batch std repeated for
    "global_std"); zero_variance [B] bool: prompts whose group std <= std_floor (advantage 0)."""

    advantages: Tensor
    mean: Tensor
    std: Tensor
    zero_variance: Tensor


def _check_atoms(scores: Tensor, atom_mask: Tensor) -> None:
    if scores.dim() != 3 or atom_mask.shape != (scores.shape[0], scores.shape[2]):
        raise ValueError(
            f"scores must be [B, G, A] and atom_mask [B, A]: got {tuple(scores.shape)} and "
            f"{tuple(atom_mask.shape)}; pad atoms to a common A and mask the padding"
        )
    if atom_mask.dtype != torch.bool:
        raise ValueError(f"atom_mask must be bool, got {atom_mask.dtype}; pass mask.bool()")
    valid = atom_mask[:, None, :].expand_as(scores)
    if not torch.isfinite(scores[valid]).all():
        raise ValueError(
            "scores at valid atoms must be finite; fix the scorer output or mask the atom"
        )


def atom_advantages(scores: Tensor, atom_mask: Tensor, std_floor: float = 1e-4,
                    norm: AtomNorm = "atom") -> AtomAdvantages:
    """Centred, scaled atom scores within each prompt group (module docstring).
    scores [B, G, A], atom_mask [B, A] bool; norm "atom" (per-atom z-score) or "pooled"."""
    _check_atoms(scores, atom_mask)
    if std_floor <= 0:
        raise ValueError(f"std_floor must be > 0, got {std_floor}; use e.g. 1e-4")
    if norm not in ("atom", "pooled"):
        raise ValueError(f"norm must be 'atom' or 'pooled'; got {norm!r}")
    s = torch.where(atom_mask[:, None, :], scores, torch.zeros_like(scores))  # [B, G, A]
    mean = s.mean(dim=1)  # [B, A]
    std = s.std(dim=1, correction=0)  # [B, A]
    zero_variance = (std <= std_floor) & atom_mask  # [B, A]
    if norm == "atom":
        scale = std
    else:
        n_valid = atom_mask.sum(dim=1).clamp_min(1).to(std.dtype)  # [B]
        pooled = (torch.where(atom_mask, std, 0.0) ** 2).sum(dim=1) / n_valid  # [B]
        scale = pooled.sqrt()[:, None].expand_as(std)  # [B, A]
        zero_variance = zero_variance | ((scale <= std_floor) & atom_mask)
    scale = scale.clamp_min(std_floor)
    live = atom_mask & ~zero_variance  # [B, A]
    z = (s - mean[:, None, :]) / scale[:, None, :]  # [B, G, A]
    advantages = torch.where(live[:, None, :], z, torch.zeros_like(z))
    return AtomAdvantages(advantages, mean, std, zero_variance, scale)


def gate_by_parents(
    advantages: Tensor, scores: Tensor, parents: Tensor, present_threshold: float = 0.5
) -> Tensor:
    """Zero a child's advantage where a direct parent scored < present_threshold.

    advantages, scores [B, G, A]; parents [B, A, A] bool, parents[b, a, p] = p is a parent of a.
    Returns [B, G, A]. Atoms without parents are unchanged.
    """
    B, _, A = scores.shape
    if advantages.shape != scores.shape or parents.shape != (B, A, A):
        raise ValueError(
            f"need advantages == scores [B, G, A] and parents [B, A, A]: got "
            f"{tuple(advantages.shape)}, {tuple(scores.shape)}, {tuple(parents.shape)}"
        )
    if parents.dtype != torch.bool:
        raise ValueError(f"parents must be bool, got {parents.dtype}; pass parents.bool()")
    absent = (scores < present_threshold).to(torch.float32)  # [B, G, A_p]
    n_absent = absent @ parents.transpose(1, 2).to(torch.float32)  # [B, G, A]
    return torch.where(n_absent > 0, torch.zeros_like(advantages), advantages)


def gate_scores(scores: Tensor, parents: Tensor, present_threshold: float = 0.5) -> Tensor:
    """DSG's rule on scores (module docstring): a child's score set to 0 where a direct parent,
    itself gated, scored < present_threshold. scores [B, G, A]; parents [B, A, A] bool
    (parents[b, a, p] = p is a parent of a) -> [B, G, A]."""
    gated = scores
    for _ in range(scores.shape[-1]):  # a chain of A atoms needs at most A rounds
        nxt = gate_by_parents(scores, gated, parents, present_threshold)
        if torch.equal(nxt, gated):
            break
        gated = nxt
    return gated


def group_normalise_credit(advantages: Tensor, atom_mask: Tensor,
                           std_floor: float = 1e-4) -> Tensor:
    """Put each sample's atom credit on Flow-GRPO's scale (module docstring, "Credit norm").

    advantages [B, G, A] (gated or not), atom_mask [B, A] bool -> [B, G, A]: with c[b, g] the
    mean of sample g's valid atom advantages, every valid atom's advantage becomes
    (A[b, g, a] - mean_g c[b, :]) / max(std_g c[b, :], std_floor), so the new per-sample means
    are the group z-scores of c; a group whose c has std <= std_floor is a tie (all 0), padded
    atoms stay 0."""
    _check_atoms(advantages, atom_mask)
    if std_floor <= 0:
        raise ValueError(f"std_floor must be > 0, got {std_floor}; use e.g. 1e-4")
    mask = atom_mask[:, None, :]  # [B, 1, A]
    n = atom_mask.sum(dim=-1).clamp_min(1).to(advantages.dtype)[:, None]  # [B, 1]
    c = torch.where(mask, advantages, 0.0).sum(dim=-1) / n  # [B, G]
    c_mean = c.mean(dim=1)  # [B]
    c_std = c.std(dim=1, correction=0)  # [B]
    tied = c_std <= std_floor  # [B]
    out = (advantages - c_mean[:, None, None]) / c_std.clamp_min(std_floor)[:, None, None]
    live = mask & ~tied[:, None, None]  # [B, 1, A]
    return torch.where(live, out, torch.zeros_like(out))


def scalar_advantages(
    rewards: Tensor, mode: Literal["group", "global_std"] = "group", std_floor: float = 1e-4
) -> ScalarAdvantages:
    """Flow-GRPO advantages from scalar rewards [B, G]: per-prompt mean, std per prompt or global."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, G], got {tuple(rewards.shape)}")
    if std_floor <= 0:
        raise ValueError(f"std_floor must be > 0, got {std_floor}; use e.g. 1e-4")
    mean = rewards.mean(dim=1)  # [B]
    group_std = rewards.std(dim=1, correction=0)  # [B]
    if mode == "group":
        std = group_std
    elif mode == "global_std":
        std = rewards.std(correction=0).expand_as(mean)  # [B]
    else:
        raise ValueError(f"mode must be 'group' or 'global_std', got {mode!r}")
    tied = group_std <= std_floor  # [B]
    z = (rewards - mean[:, None]) / std.clamp_min(std_floor)[:, None]  # [B, G]
    advantages = torch.where(tied[:, None], torch.zeros_like(z), z)
    return ScalarAdvantages(advantages, mean, std, tied)


def atom_reward(
    scores: Tensor,
    atom_mask: Tensor,
    kind: Literal["mean", "geometric"] = "mean",
    log_floor: float = 1e-6,
) -> Tensor:
    """Scalar reward [B, G] from atom scores [B, G, A] in [0, 1] over valid atoms.

    "mean": sum_a s / |A_valid|. "geometric": exp(sum_a log(max(s, log_floor)) / |A_valid|);
    the floor keeps one zero score from sending the reward to exactly 0 (and log to -inf).
    """
    _check_atoms(scores, atom_mask)
    count = atom_mask.sum(dim=-1)  # [B]
    if (count == 0).any():
        raise ValueError(
            "every prompt needs at least one valid atom for a reward; drop atom-less prompts"
        )
    mask = atom_mask[:, None, :]  # [B, 1, A]
    n = count[:, None].to(scores.dtype)  # [B, 1]
    if kind == "mean":
        return torch.where(mask, scores, 0.0).sum(dim=-1) / n
    if kind == "geometric":
        log_s = torch.log(torch.where(mask, scores, 1.0).clamp_min(log_floor))  # [B, G, A]
        return torch.exp(torch.where(mask, log_s, 0.0).sum(dim=-1) / n)
    raise ValueError(f"kind must be 'mean' or 'geometric', got {kind!r}")
