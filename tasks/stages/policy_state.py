"""Which policy an iteration samples with: the checkpoint written by the previous iteration's
`train_epoch`, or the base model (with a fresh, zero-effect LoRA adapter) at iteration 0."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow.compute as pc

from tasks.stages.models import base_hash, load_policy
from tasks.stages.recipe import Recipe
from tasks.store.store import Store


@dataclass(frozen=True)
class PolicyState:
    """policy_hash: sha256 of the LoRA blob (or 'base-<weights hash>'); lora_path /
    optimizer_path: blobs relative to the store root, None at iteration 0. lr and
    update_kl_nats: the lr the previous iteration trained at and how far that moved the policy
    (nats per sample and window step), None at iteration 0 or when its checkpoint lacks them;
    update_kl_per_step and step_weights: that KL at each window step and the loss weights of the
    steps it trained with (`train.kl_target_per_step`), None likewise or when unused;
    update_velocity_rms: the change of the velocity that move implies (RMS per action dim), None
    likewise."""

    iteration: int
    policy_hash: str
    lora_path: str | None
    optimizer_path: str | None
    lr: float | None = None
    update_kl_nats: float | None = None
    update_kl_per_step: tuple[float, ...] | None = None
    step_weights: tuple[float, ...] | None = None
    update_velocity_rms: float | None = None


def base_policy(recipe: Recipe) -> PolicyState:
    """Iteration 0's policy: the base weights with the fresh, zero-effect adapter."""
    return PolicyState(0, f"base-{base_hash(recipe)[:16]}", None, None)


def policy_for(store: Store, recipe: Recipe, iteration: int) -> PolicyState:
    """The policy that iteration `iteration` rolls out and starts training from."""
    if iteration == 0:
        return base_policy(recipe)
    previous = iteration - 1
    rows = store.read_table("checkpoints", (pc.field("run_id") == recipe.run.name)
                            & (pc.field("iteration") == previous)).to_pylist()
    if not rows or not store.resolve(rows[0]["lora_path"]).exists():
        raise FileNotFoundError(
            f"run {recipe.run.name!r}: no checkpoint of iteration {previous} in {store.root}; "
            f"finish iteration {previous} first (run the flow without an explicit iteration)")
    row = rows[0]
    return PolicyState(iteration, row["policy_hash"], row["lora_path"], row["optimizer_path"],
                       row["lr"], row["update_kl_nats"], _tuple(row.get("update_kl_per_step")),
                       _tuple(row.get("step_weights")), row.get("update_velocity_rms"))


def _tuple(values: list[float] | None) -> tuple[float, ...] | None:
    return None if values is None else tuple(values)


def load_policy_of(store: Store, recipe: Recipe, policy: PolicyState):
    """The backbone with this policy's LoRA (a fresh, zero-effect one at iteration 0) ->
    (backbone, LoRA parameters), as `models.load_policy`."""
    lora = store.get_tensors(policy.lora_path) if policy.lora_path else None
    return load_policy(recipe, lora)
