"""The update `train_epoch` runs, on inputs it has already read: the recipe's `train` section as
the update's config (`policy_config`, `nft_config`), the advantages the recipe trains on
(`pick_advantage`), and `train_policy`, which takes the loaded policy and its optimizer through
one iteration's optimizer steps (`cast_core.policy.policy_update`, or
`cast_core.nft_update.nft_update` with `train.objective = "nft"`) under the warm-up
(`cast_core.lr_schedule.linear_warmup_lr`), refuses weights that came out non-finite
(`NonFiniteWeights`) and measures how far the update moved the policy
(`cast_core.update_kl.update_kl_nats`, `cast_core.diagnostics.param_change_norm`). Nothing here
reads or writes the store; the stage module says what the update's results become.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from tqdm.auto import tqdm

from cast_core.data_parallel import SOLO, Shard
from cast_core.diagnostics import param_change_norm
from cast_core.lr_schedule import linear_warmup_lr
from cast_core.nft_update import NftConfig, NftStep, nft_step_indices, nft_update
from cast_core.policy import PolicyConfig, UpdateStep, policy_update, step_indices
from cast_core.rollout import Rollout, RolloutSpec
from cast_core.update_kl import VelocityChange, update_kl_nats
from tasks.stages.models import lora_tensors, optimizer_tensors
from tasks.stages.recipe import Recipe
from tasks.store.stage import StageRefused, derive_seed


class NonFiniteWeights(StageRefused):
    """Training left a LoRA or optimizer tensor with inf or nan entries; nothing was saved."""



@dataclass(frozen=True)
class TrainBatch:
    """What the update trains on: the N samples of the rollout in blob order.

    prompts: [N] each sample's prompt text; rollout: their window steps on the transformer's
    device; spec: the sampler and window they were drawn with; advantages: [N, h, w] maps or [N]
    scalars (`pick_advantage`), or [N, K, h, w] step maps (ReCAST); loss_kind: "spatial" or
    "scalar"; weights_json: the ReCAST step weights as `train_steps` stores them, or None;
    held: None when `rollout` holds all N samples, else the sorted indices of the samples it
    holds (a data-parallel rank's, `held_samples`); prompts and advantages are always all N's;
    step_times: with NFT and step maps, the schedule times [K] of their steps (else None)."""

    prompts: list[str]
    rollout: Rollout
    spec: RolloutSpec
    advantages: Tensor
    loss_kind: str
    weights_json: str | None
    held: Tensor | None = None
    step_times: Tensor | None = None



@dataclass(frozen=True)
class TrainOutcome:
    """One update's result: its optimizer steps (run steps first_step, first_step + 1, ...), the
    trained LoRA and AdamW state (tensors and param_groups JSON), AdamW's step count after, the
    LoRA change norm, and KL(rollout policy || trained policy) in nats (None for ODE rollouts):
    the window's mean and each step's; step_weights: the window steps' loss weights it trained
    with (None: every step 1); velocity: the change of the velocity the KL implies (RMS per
    action dim, `cast_core.update_kl.velocity_change`; None for ODE rollouts)."""

    updates: list[UpdateStep] | list[NftStep]
    first_step: int
    lora: dict[str, Tensor]
    optimizer_state: dict[str, Tensor]
    param_groups: str
    optimizer_steps: int
    param_change_norm: float
    update_kl_nats: float | None
    update_kl_per_step: tuple[float, ...] | None = None
    step_weights: tuple[float, ...] | None = None
    velocity: VelocityChange | None = None



def nft_training_guidance(recipe: Recipe) -> float:
    """The guidance scale of the velocity the NFT loss trains: 1 (the conditional velocity) with
    `train.nft_guidance = "none"`, the sampler's scale with "sampler"."""
    if recipe.train.nft_guidance == "sampler":
        return recipe.sampling.guidance_scale
    return 1.0


def nft_config(recipe: Recipe) -> NftConfig:
    """The recipe's `train.nft_*` fields as the update's config."""
    tr = recipe.train
    return NftConfig(beta=tr.nft_beta, t_min=tr.nft_t_min, t_max=tr.nft_t_max,
                     a_max=tr.nft_a_max, adaptive_weight=tr.nft_adaptive_weight,
                     centre=tr.nft_centre, group_size=recipe.prompts.group_size,
                     inner_epochs=tr.inner_epochs, steps_per_epoch=tr.steps_per_epoch,
                     micro_batch=tr.micro_batch, max_grad_norm=tr.max_grad_norm)


def update_steps(recipe: Recipe, n: int, iteration: int) -> list[Tensor]:
    """Every optimizer step's sample indices (of the n samples) in the order the recipe's update
    takes them: its seeded shuffle (`policy.step_indices`, `nft_update.nft_step_indices`)."""
    seed = recipe.run.seed
    if recipe.train.objective == "nft":
        return nft_step_indices(n, nft_config(recipe), derive_seed(seed, "nft", iteration))
    return step_indices(n, policy_config(recipe, "scalar"),
                        derive_seed(seed, "shuffle", iteration))


def held_samples(recipe: Recipe, n: int, iteration: int, shard: Shard) -> Tensor | None:
    """The samples whose window steps a rank of the training group needs: those of its parts of
    every optimizer step (`Shard.rows`), sorted; None (all n) on one process."""
    if shard.world == 1:
        return None
    return shard.rows(update_steps(recipe, n, iteration))


def first_pass_split(recipe: Recipe, n: int, iteration: int, world: int) -> list[Tensor]:
    """Every rank's samples in the first inner epoch: a partition of the n samples (the ranks'
    shares of `update_kl_nats`)."""
    first = update_steps(recipe, n, iteration)[:recipe.train.steps_per_epoch]
    return [Shard(rank, world).rows(first) for rank in range(world)]


def pick_advantage(blob: dict[str, torch.Tensor], kind: str) -> tuple[torch.Tensor, str]:
    """(advantages, loss kind) for `advantage.kind`: "spatial" the maps [N, h, w], "scalar" the
    scalar advantages [N], "atom" the no-map credit [N] broadcast to a constant map [N, h, w]
    (the spatial loss, so the only difference from CAST is the map), "scalar_map" the scalar
    advantages broadcast likewise (the only difference from "scalar" is the loss's ratio)."""
    if kind == "spatial":
        return blob["maps"], "spatial"
    if kind == "scalar":
        return blob["scalar"], "scalar"
    if kind == "atom":
        return blob["atom"][:, None, None].expand_as(blob["maps"]).contiguous(), "spatial"
    if kind == "scalar_map":
        return blob["scalar"][:, None, None].expand_as(blob["maps"]).contiguous(), "spatial"
    raise ValueError(f"advantage.kind must be 'spatial', 'scalar', 'atom' or 'scalar_map'; got "
                     f"{kind!r}")


def policy_config(recipe: Recipe, loss_kind: str,
                  step_weights: tuple[float, ...] | None = None) -> PolicyConfig:
    """The update's config from the recipe's `train` section, for the loss `pick_advantage` (or
    ReCAST's step maps) chose: "spatial" or "scalar"; `step_weights` the window steps' loss
    weights (`train.kl_target_per_step`; None: every step 1)."""
    tr = recipe.train
    return PolicyConfig(advantage=loss_kind, clip_range=tr.clip_range, kl_beta=tr.kl_beta,
                        inner_epochs=tr.inner_epochs, steps_per_epoch=tr.steps_per_epoch,
                        micro_batch=tr.micro_batch, max_grad_norm=tr.max_grad_norm,
                        map_ratio=tr.map_ratio, step_weights=step_weights)



def _refuse_non_finite(lora: dict[str, torch.Tensor], optimizer_state: dict[str, torch.Tensor],
                       updates: list[UpdateStep], iteration: int, lr: float) -> None:
    """Raise NonFiniteWeights when any LoRA or optimizer tensor has an inf or nan entry."""
    bad = sorted(n for n, t in {**lora, **optimizer_state}.items() if not torch.isfinite(t).all())
    if not bad:
        return
    previous = (f"the checkpoint of iteration {iteration - 1}" if iteration > 0 else
                "the base model with its fresh adapter (iteration 0)")
    losses = [None if u.skipped else round(u.loss, 6) for u in updates]
    raise NonFiniteWeights(
        f"iteration {iteration}: training left {len(bad)} LoRA/optimizer tensor(s) with inf or "
        f"nan entries (e.g. {bad[0]!r}); nothing was saved and the policy stays at {previous}. "
        f"Step losses {losses} (None: skipped, {[u.skip_reason for u in updates]}). Lower "
        f"train.lr (now {lr:g}) or check this iteration's advantages; then run the iteration again",
        {"tensors": bad, "losses": losses, "lrs": [u.lr for u in updates],
         "skip_reasons": [u.skip_reason for u in updates],
         "grad_norms": [None if u.skipped else u.grad_norm for u in updates]})


def _postfix(u: UpdateStep | NftStep) -> dict[str, str]:
    """The progress bar's figures for one optimizer step."""
    if u.skipped:
        return {"loss": "skipped"}
    if isinstance(u, NftStep):
        return {"loss": f"{u.loss:.4f}", "positive": f"{u.positive_share:.2f}"}
    return {"loss": f"{u.loss:.4f}", "clip": f"{u.clip_fraction:.3f}",
            "kl": f"{u.policy_kl_nats:.3g}"}


def _update(backbone, optimizer: torch.optim.Optimizer, batch: TrainBatch, recipe: Recipe,
            iteration: int, lr_for_step: Callable[[int], float], shard: Shard,
            step_weights: tuple[float, ...] | None = None) -> list:
    """The recipe's update (the SDE policy objective or NFT) with a progress bar (rank 0's)."""
    tr, seed = recipe.train, recipe.run.seed
    with tqdm(total=tr.steps_per_epoch * tr.inner_epochs, desc=f"train {iteration}", unit="step",
              mininterval=1.0, disable=shard.rank > 0) as bar:
        def show(u: UpdateStep | NftStep) -> None:
            bar.set_postfix(**_postfix(u))
            bar.update()

        if tr.objective == "nft":
            return nft_update(backbone, optimizer, batch.prompts, batch.rollout.x0,
                              batch.advantages, nft_config(recipe), nft_training_guidance(recipe),
                              derive_seed(seed, "nft", iteration), lr_for_step=lr_for_step,
                              on_step=show, shard=shard, held=batch.held,
                              step_times=batch.step_times)
        return policy_update(backbone, optimizer, batch.prompts, batch.rollout, batch.spec,
                             batch.advantages,
                             policy_config(recipe, batch.loss_kind, step_weights),
                             shuffle_seed=derive_seed(seed, "shuffle", iteration), on_step=show,
                             lr_for_step=lr_for_step, shard=shard, held=batch.held)


def _adam_steps(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> int:
    return int(optimizer.state[params[0]]["step"]) if optimizer.state else 0


def train_policy(backbone, params: list[Tensor], optimizer: torch.optim.Optimizer,
                 batch: TrainBatch, recipe: Recipe, iteration: int, lr: float,
                 shard: Shard = SOLO,
                 step_weights: tuple[float, ...] | None = None) -> TrainOutcome:
    """One iteration's update of the loaded policy (`params`: its LoRA parameters, trained by
    `optimizer`) at the iteration's `lr`, warmed up over the run's first optimizer steps; raises
    NonFiniteWeights when the weights came out non-finite, else measures how far it moved. With
    a `shard` of a data-parallel group every rank trains its part (of the SDE or the NFT
    objective, its batch holding the rows `held_samples` names) and ends on the same weights,
    and the move's KL is computed across the ranks. `step_weights`: the SDE objective's loss
    weight of each window step (None: every step 1)."""
    tr = recipe.train
    first_step = _adam_steps(optimizer, params)
    before = [p.detach().clone() for p in params]
    updates = _update(backbone, optimizer, batch, recipe, iteration,
                      lambda j: linear_warmup_lr(lr, tr.warmup_steps, first_step + j), shard,
                      step_weights)
    lora, (state, groups) = lora_tensors(backbone), optimizer_tensors(optimizer)
    _refuse_non_finite(lora, state, updates, iteration, lr)
    split = (first_pass_split(recipe, len(batch.prompts), iteration, shard.world)
             if shard.world > 1 else None)
    moved = (update_kl_nats(backbone, batch.prompts, batch.rollout, batch.spec,
                            micro_batch=tr.micro_batch, shard=shard, held=batch.held,
                            split=split)
             if recipe.sampling.noise_level > 0 else None)  # the ODE has no likelihoods
    return TrainOutcome(updates, first_step, lora, state, groups, _adam_steps(optimizer, params),
                        param_change_norm(before, params),
                        None if moved is None else moved.nats,
                        None if moved is None else moved.per_step, step_weights,
                        None if moved is None else moved.velocity)


