"""One RL update of LoRA parameters on stored window steps: clipped objective, KL, guards.

Variant: Flow-GRPO's update (PPO-style clipped surrogate on SDE steps, optional KL to the frozen
base model) with either CAST's per-position advantage maps ("spatial") or Flow-GRPO's scalar
advantages ("scalar"); the objectives themselves live in ``cast_core.loss``.

LoRA: ``add_lora`` adds one adapter through diffusers' PEFT integration (``add_adapter``) with
PEFT's default init (B = 0, so the adapted model starts equal to the base) and freezes every other
parameter of the backbone, text encoder included. ``reference_mode`` disables the adapters, which
gives the base model exactly: it is the KL reference, so no second copy of the model is kept.

Update loop: ``inner_epochs`` passes over the N samples in micro-batches of ``micro_batch``
samples (in order, or shuffled per epoch with ``shuffle_seed``). Within a micro-batch the K window
steps are replayed one at a time and each step's share of the loss (its objective / K, plus
kl_beta * its mean KL / K) is backpropagated at once, so activation memory is one step's, not K's.
Both objectives and the KL are means over steps, so the accumulated gradient equals the gradient
of the all-steps loss exactly; the recorded loss and statistics (overall, and the ratio mean and
clip fraction per window step) are recomputed from the detached all-steps log-probs. Then the grad
norm is clipped to ``max_grad_norm`` and the optimizer steps.

Guards: a micro-batch whose loss or grad norm is not finite gets its grads zeroed and no optimizer
step; its ``UpdateStep`` says skipped=True and why. The first inner step (weights still those of
the rollout) must give ratio_mean = 1; ``first_ratio_ok`` reports |ratio_mean - 1| <= ratio_tol
there so the caller can warn with the figures (rollout and replay disagree: dropout on, different
precision or CFG, or weights changed since the rollout). The model must be in eval mode
(no dropout) for ratios to be meaningful.

KL: the closed form for two Gaussians sharing the step's std (``loss.gaussian_step_kl``), averaged
over channels, positions, samples and steps; this equals Flow-GRPO's KL term (the all-dims mean of
(mu_p - mu_r)^2 / (2 std^2)). It needs std > 0, so a window containing a zero-std step (noise level
0, or the CPS step to t = 0) with kl_beta > 0 raises ValueError. The reference forward costs one
extra transformer pass per step and is skipped when kl_beta = 0 (UpdateStep.kl is then None).

Departures: Flow-GRPO takes one optimizer step per micro-batch *of steps*; here a micro-batch is
a set of samples with all their window steps. The update is ours to specify in full (shuffling,
guard, first-step ratio check); the CAST paper's code is not public.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from peft import LoraConfig
from torch import Tensor

from cast_core.loss import PolicyLoss, gaussian_step_kl, scalar_clipped_loss, spatial_clipped_loss
from cast_core.rollout import Rollout, RolloutSpec, replay_steps
from cast_core.sampling import encode_conditioning

AdvantageKind = Literal["spatial", "scalar"]


def add_lora(
    backbone, rank: int, alpha: float, target_modules: Sequence[str] | None = None
) -> list[torch.nn.Parameter]:
    """Add a LoRA adapter to backbone.transformer; return its parameters (the only trainable ones)
    in named_parameters order. target_modules defaults to backbone.lora_target_modules."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be an int >= 1; got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"LoRA alpha must be > 0 (scale = alpha / rank); got {alpha!r}")
    targets = list(target_modules or backbone.lora_target_modules)
    backbone.requires_grad_(False)
    backbone.transformer.add_adapter(
        LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=True)
    )
    lora = []
    for name, p in backbone.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_" in name:
            lora.append(p)
    return lora


@contextmanager
def reference_mode(backbone) -> Iterator[None]:
    """Run the base model (adapters disabled) inside the block; adapters are re-enabled after."""
    backbone.transformer.disable_adapters()
    try:
        yield
    finally:
        backbone.transformer.enable_adapters()


def _positive(name: str, value: float, fix: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"PolicyConfig.{name} must be a finite number > 0; got {value!r}; {fix}")


def _count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"PolicyConfig.{name} must be an int >= 1; got {value!r}")


@dataclass(frozen=True)
class PolicyConfig:
    """Update settings. clip_range has no default: per-position ratios need a wider range than
    Flow-GRPO's scalar one (see ``loss.per_position_clip_range``)."""

    advantage: AdvantageKind
    clip_range: float
    kl_beta: float = 0.0
    inner_epochs: int = 1
    micro_batch: int = 4
    max_grad_norm: float = 1.0
    ratio_tol: float = 1e-3

    def __post_init__(self) -> None:
        if self.advantage not in ("spatial", "scalar"):
            raise ValueError(
                f"PolicyConfig.advantage must be 'spatial' or 'scalar'; got {self.advantage!r}"
            )
        _positive("clip_range", self.clip_range, "use loss.per_position_clip_range for 'spatial'")
        if not (math.isfinite(self.kl_beta) and self.kl_beta >= 0):
            raise ValueError(
                f"PolicyConfig.kl_beta must be finite and >= 0 (0 = no KL); got {self.kl_beta!r}"
            )
        _count("inner_epochs", self.inner_epochs)
        _count("micro_batch", self.micro_batch)
        _positive("max_grad_norm", self.max_grad_norm, "e.g. 1.0")
        _positive("ratio_tol", self.ratio_tol, "e.g. 1e-3")


@dataclass(frozen=True)
class UpdateStep:
    """One micro-batch step. loss (objective + kl_beta KL) and the PolicyLossStats fields are floats
    over the micro-batch's samples, steps and positions; ratio_mean_per_step and
    clip_fraction_per_step have K entries (window-step order), each over the micro-batch's samples
    and positions; kl is None when kl_beta = 0; grad_norm is the norm before clipping;
    first_ratio_ok is None except on the first inner step."""

    epoch: int
    micro_batch: int
    loss: float
    clip_fraction: float
    ratio_mean: float
    ratio_std: float
    approx_kl: float
    adv_mass: float
    kl: float | None
    grad_norm: float
    skipped: bool
    skip_reason: str | None
    first_ratio_ok: bool | None
    ratio_mean_per_step: tuple[float, ...]
    clip_fraction_per_step: tuple[float, ...]


def _check_advantages(advantages: Tensor, rollout: Rollout, kind: AdvantageKind) -> None:
    n, k, h, w = rollout.log_probs.shape
    wants = [(n, h, w), (n, k, h, w)] if kind == "spatial" else [(n,)]
    if tuple(advantages.shape) not in wants:
        hint = (
            "pool the pixel map onto the latent grid (one map a sample, or one per window step)"
            if kind == "spatial"
            else "one per sample"
        )
        raise ValueError(
            f"{kind} advantages must have shape {' or '.join(map(str, wants))}; got "
            f"{tuple(advantages.shape)}; {hint}"
        )


def _objective(
    kind: AdvantageKind, new: Tensor, old: Tensor, adv: Tensor, clip: float
) -> PolicyLoss:
    if kind == "spatial":
        return spatial_clipped_loss(new, old, adv, clip)
    return scalar_clipped_loss(new, old, adv, clip)


def _micro_batch_backward(
    backbone,
    prompts: list[str],
    steps: Rollout,
    adv: Tensor,
    spec: RolloutSpec,
    config: PolicyConfig,
) -> tuple[PolicyLoss, Tensor | None]:
    """Backprop the loss of n samples step by step (steps: n samples, K steps; adv [n, h, w],
    [n, K, h, w] (one map per window step) or [n]). Returns the PolicyLoss of the detached
    all-steps log-probs and the mean KL (or None)."""
    cond, uncond = encode_conditioning(backbone, prompts, spec.guidance_scale)
    num_k = steps.t.shape[0]
    new, kls = [], []
    for k in range(num_k):
        step = steps.select(steps=[k])
        replay = replay_steps(backbone, cond, uncond, step, spec)  # log_probs [n, 1, h, w]
        step_adv = adv[:, k : k + 1] if adv.dim() == 4 else adv  # this step's map
        total = _objective(
            config.advantage, replay.log_probs, step.log_probs, step_adv, config.clip_range
        ).loss
        if config.kl_beta > 0:
            with torch.no_grad(), reference_mode(backbone):
                ref = replay_steps(backbone, cond, uncond, step, spec)
            kl = gaussian_step_kl(replay.means[:, 0], ref.means[:, 0], replay.stds[:, 0]).mean()
            total = total + config.kl_beta * kl
            kls.append(kl.detach())
        (total / num_k).backward()
        new.append(replay.log_probs.detach())
    with torch.no_grad():
        full = _objective(
            config.advantage, torch.cat(new, dim=1), steps.log_probs, adv, config.clip_range
        )
    kl_mean = torch.stack(kls).mean() if kls else None
    return full, kl_mean


def _guarded_step(
    optimizer: torch.optim.Optimizer,
    params: list[Tensor],
    full: PolicyLoss,
    kl: Tensor | None,
    config: PolicyConfig,
    epoch: int,
    mb: int,
    records: list[UpdateStep],
) -> UpdateStep:
    """Clip the accumulated grads and step, unless the loss or grad norm is not finite."""
    loss = full.loss + (config.kl_beta * kl if kl is not None else 0.0)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
    reason = None
    if not torch.isfinite(loss):
        reason = "non-finite loss"
    elif not torch.isfinite(grad_norm):
        reason = "non-finite grad norm"
    if reason is None:
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    stats = full.stats
    first = None if records else bool(abs(float(stats.ratio_mean) - 1.0) <= config.ratio_tol)
    return UpdateStep(
        epoch=epoch,
        micro_batch=mb,
        loss=float(loss),
        clip_fraction=float(stats.clip_fraction),
        ratio_mean=float(stats.ratio_mean),
        ratio_std=float(stats.ratio_std),
        approx_kl=float(stats.approx_kl),
        adv_mass=float(stats.adv_mass),
        kl=None if kl is None else float(kl),
        grad_norm=float(grad_norm),
        skipped=reason is not None,
        skip_reason=reason,
        first_ratio_ok=first,
        ratio_mean_per_step=tuple(stats.ratio_mean_per_step.tolist()),
        clip_fraction_per_step=tuple(stats.clip_fraction_per_step.tolist()),
    )


def policy_update(
    backbone,
    optimizer: torch.optim.Optimizer,
    prompts: list[str],
    rollout: Rollout,
    spec: RolloutSpec,
    advantages: Tensor,
    config: PolicyConfig,
    shuffle_seed: int | None = None,
    on_step: Callable[[UpdateStep], None] | None = None,
) -> list[UpdateStep]:
    """Inner epochs x micro-batches of clipped-objective steps on the rollout's window steps.

    prompts: N; rollout: N samples, K steps; advantages: [N, h, w] (spatial, on the log-prob grid),
    [N, K, h, w] (spatial, one map per window step: ReCAST's step weights) or [N] (scalar). Returns one UpdateStep per micro-batch, in order; `on_step` (e.g. a progress
    bar) is called with each one as it is made.
    """
    n = rollout.latents.shape[0]
    if len(prompts) != n:
        raise ValueError(f"need one prompt per rollout sample: got {len(prompts)} for {n} samples")
    _check_advantages(advantages, rollout, config.advantage)
    advantages = advantages.to(rollout.log_probs.device, torch.float32)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    generator = torch.Generator().manual_seed(shuffle_seed) if shuffle_seed is not None else None
    records: list[UpdateStep] = []
    for epoch in range(config.inner_epochs):
        order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
        for mb, lo in enumerate(range(0, n, config.micro_batch)):
            idx = order[lo : lo + config.micro_batch]
            optimizer.zero_grad(set_to_none=True)
            full, kl = _micro_batch_backward(
                backbone,
                [prompts[i] for i in idx.tolist()],
                rollout.select(idx),
                advantages[idx.to(advantages.device)],
                spec,
                config,
            )
            records.append(_guarded_step(optimizer, params, full, kl, config, epoch, mb, records))
            if on_step is not None:
                on_step(records[-1])
    return records
