"""Learning-rate schedules of the policy update: the per-step lr of a linear warm-up (passed to
``cast_core.policy.policy_update`` as ``lr_for_step``), the next iteration's lr from how far
the last one moved the policy (a KL target), and an lr half-life over iterations.
"""

from __future__ import annotations

import math


def linear_warmup_lr(lr: float, warmup_steps: int, step: int) -> float:
    """The lr of optimizer step `step` (0-based, counted over the whole run) under a linear
    warm-up: lr * min(1, (step + 1) / warmup_steps); lr itself when warmup_steps = 0."""
    if warmup_steps < 0 or step < 0:
        raise ValueError(f"need warmup_steps >= 0 and step >= 0: got {warmup_steps}, {step}")
    return lr if warmup_steps == 0 else lr * min(1.0, (step + 1) / warmup_steps)


def halflife_factor(iteration: int, halflife: float | None) -> float:
    """The lr's decay factor at `iteration` (0-based) under a half-life of `halflife` iterations:
    0.5 ** (iteration / halflife); 1 when halflife is None (no decay)."""
    if iteration < 0 or (halflife is not None and not halflife > 0):
        raise ValueError(f"need iteration >= 0 and halflife > 0 (or None): got {iteration}, "
                         f"{halflife}")
    return 1.0 if halflife is None else 0.5 ** (iteration / halflife)


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


def kl_step_weights(weights: tuple[float, ...] | None, per_step_kl: tuple[float, ...] | None, *,
                    max_factor: float, floor: float) -> tuple[float, ...] | None:
    """The next iteration's loss weight of each window step, so that every step moves the policy
    about the same KL (nats per sample) rather than the window's mean meeting a target that its
    late steps set.

    A window step's KL grows as its noise std shrinks (the same change of the velocity moves a
    narrower Gaussian by more nats), so on a wide window the late steps move far more than the
    early ones at one lr. If a step's move comes mostly from its own gradient, its KL is about
    quadratic in its loss weight: KL_k ~ c_k w_k^2. w_k * sqrt(g / KL_k), with g the geometric
    mean of the KL_k, then gives every step the same KL, and the KL-targeted lr sets what that
    KL is. The steps share the weights they train, so the factor is clamped to
    [1 / max_factor, max_factor] and the controller iterates (as `kl_targeted_lr` does). The
    weights are renormalised to mean 1 and then floored at `floor`, so no step stops training.
    weights None starts from 1 at every step; per_step_kl None (no estimate, e.g. the ODE)
    keeps the weights. A non-finite KL takes the smallest factor, a KL <= 0 the largest."""
    if not (max_factor >= 1 and 0 < floor <= 1):
        raise ValueError(f"need max_factor >= 1 and 0 < floor <= 1: got {max_factor}, {floor}")
    if per_step_kl is None:
        return weights
    current = weights if weights is not None else (1.0,) * len(per_step_kl)
    if len(current) != len(per_step_kl) or not current:
        raise ValueError(f"need one weight per window step: got {len(current)} weights for "
                         f"{len(per_step_kl)} steps' KLs")
    usable = [kl for kl in per_step_kl if math.isfinite(kl) and kl > 0]
    if not usable:
        return current
    reference = math.exp(sum(math.log(kl) for kl in usable) / len(usable))

    def factor(kl: float) -> float:
        if not math.isfinite(kl):
            return 1.0 / max_factor
        if kl <= 0:
            return max_factor
        return min(max_factor, max(1.0 / max_factor, math.sqrt(reference / kl)))

    raw = [w * factor(kl) for w, kl in zip(current, per_step_kl)]
    mean = sum(raw) / len(raw)
    return tuple(max(floor, w / mean) for w in raw)
