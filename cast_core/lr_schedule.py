"""Learning-rate schedules of the policy update: the per-step lr of a linear warm-up (passed to
``cast_core.policy.policy_update`` as ``lr_for_step``) and the next iteration's lr from how far
the last one moved the policy (a KL target).
"""

from __future__ import annotations

import math


def linear_warmup_lr(lr: float, warmup_steps: int, step: int) -> float:
    """The lr of optimizer step `step` (0-based, counted over the whole run) under a linear
    warm-up: lr * min(1, (step + 1) / warmup_steps); lr itself when warmup_steps = 0."""
    if warmup_steps < 0 or step < 0:
        raise ValueError(f"need warmup_steps >= 0 and step >= 0: got {warmup_steps}, {step}")
    return lr if warmup_steps == 0 else lr * min(1.0, (step + 1) / warmup_steps)


def kl_targeted_lr(lr: float, kl_nats: float | None, target_nats: float, *,
                   max_factor: float, lr_min: float, lr_max: float) -> float:
    """The next iteration's lr from this iteration's lr and how far it moved the policy.

    One SDE step is a Gaussian with a fixed std, so the KL a small update moves the policy by is
    quadratic in the change of its mean, which is about linear in the lr: KL(c lr) ~ c^2 KL(lr).
    lr * sqrt(target / kl) would then move `target_nats`. The factor is clamped to
    [1 / max_factor, max_factor] (the KL is estimated on a few samples, and Adam's moments lag)
    and the result to [lr_min, lr_max]. kl_nats None (no estimate, e.g. the ODE) keeps lr; a
    kl_nats <= 0 (no move) takes the largest factor."""
    if not (lr > 0 and target_nats > 0 and max_factor >= 1 and 0 < lr_min <= lr_max):
        raise ValueError(f"need lr > 0, target_nats > 0, max_factor >= 1 and 0 < lr_min <= "
                         f"lr_max: got {lr}, {target_nats}, {max_factor}, {lr_min}, {lr_max}")
    if kl_nats is None:
        factor = 1.0
    elif not math.isfinite(kl_nats):
        factor = 1.0 / max_factor
    elif kl_nats <= 0:
        factor = max_factor
    else:
        factor = min(max_factor, max(1.0 / max_factor, math.sqrt(target_nats / kl_nats)))
    return min(lr_max, max(lr_min, lr * factor))
