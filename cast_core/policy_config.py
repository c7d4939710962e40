"""What one RL update (``cast_core.policy.policy_update``) takes and returns: its settings
(`PolicyConfig`, validated on construction) and the record of each optimizer step (`UpdateStep`,
whose KL fields ``cast_core.policy``'s docstring defines)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from cast_core.checks import require_count, require_positive

AdvantageKind = Literal["spatial", "scalar"]


def _positive(name: str, value: float, fix: str) -> None:
    require_positive("PolicyConfig", name, value, fix)


def _count(name: str, value: int) -> None:
    require_count("PolicyConfig", name, value)


@dataclass(frozen=True)
class PolicyConfig:
    """Update settings. clip_range has no default: per-position ratios need a wider range than
    Flow-GRPO's scalar one (see ``loss.per_position_clip_range``). steps_per_epoch: optimizer
    steps per pass over the samples; micro_batch: the most samples in one forward/backward.
    map_ratio (spatial only): "position", a ratio per position (CAST's), or "sample", the map
    inside the sample's all-dims ratio (``loss.sample_ratio_spatial_loss``; clip_range is then
    the all-dims range). step_weights (optional, one per window step, > 0): each window step's
    share of the loss (objective and KL to the reference) is multiplied by its weight, e.g. the
    per-step KL controller's (``lr_schedule.kl_step_weights``); None weighs every step 1."""

    advantage: AdvantageKind
    clip_range: float
    kl_beta: float = 0.0
    inner_epochs: int = 1
    steps_per_epoch: int = 1
    micro_batch: int = 4
    max_grad_norm: float = 1.0
    ratio_tol: float = 1e-3
    map_ratio: Literal["position", "sample"] = "position"
    step_weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.advantage not in ("spatial", "scalar"):
            raise ValueError(
                f"PolicyConfig.advantage must be 'spatial' or 'scalar'; got {self.advantage!r}"
            )
        _positive("clip_range", self.clip_range, "use loss.per_position_clip_range for 'spatial'")
        if self.map_ratio not in ("position", "sample"):
            raise ValueError(f"PolicyConfig.map_ratio must be 'position' or 'sample'; got "
                             f"{self.map_ratio!r}")
        if not (math.isfinite(self.kl_beta) and self.kl_beta >= 0):
            raise ValueError(
                f"PolicyConfig.kl_beta must be finite and >= 0 (0 = no KL); got {self.kl_beta!r}"
            )
        _count("inner_epochs", self.inner_epochs)
        _count("steps_per_epoch", self.steps_per_epoch)
        _count("micro_batch", self.micro_batch)
        _positive("max_grad_norm", self.max_grad_norm, "e.g. 1.0")
        _positive("ratio_tol", self.ratio_tol, "e.g. 1e-3")
        if self.step_weights is not None and not (
                self.step_weights and all(math.isfinite(w) and w > 0 for w in self.step_weights)):
            raise ValueError(f"PolicyConfig.step_weights must be finite and > 0, one per window "
                             f"step (or None: every step 1); got {self.step_weights!r}")


@dataclass(frozen=True)
class UpdateStep:
    """One optimizer step: `step` is its index within the epoch, `samples` how many samples it
    used, `lr` the lr it ran with. loss (objective + kl_beta ref_kl_mean_dim) and the statistics
    are floats over all the step's samples, window steps and positions (as if from one
    micro-batch); ratio_mean_per_step and clip_fraction_per_step have K entries (window-step
    order). policy_kl_nats / policy_kl_k1_nats: KL(rollout policy || current) per sample and
    window step, summed over dims (k3, k1); ratio_k3: k3 of the loss's own ratio, not a KL per
    sample; ref_kl_nats / ref_kl_mean_dim: exact KL to the reference summed over dims / its mean
    over dims, None when kl_beta = 0. grad_norm is the norm before clipping; first_ratio_ok is
    None except on the first step."""

    epoch: int
    step: int
    samples: int
    lr: float
    loss: float
    clip_fraction: float
    ratio_mean: float
    ratio_std: float
    ratio_k3: float
    adv_mass: float
    policy_kl_nats: float
    policy_kl_k1_nats: float
    ref_kl_nats: float | None
    ref_kl_mean_dim: float | None
    grad_norm: float
    skipped: bool
    skip_reason: str | None
    first_ratio_ok: bool | None
    ratio_mean_per_step: tuple[float, ...]
    clip_fraction_per_step: tuple[float, ...]
