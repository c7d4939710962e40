"""Stage `train_epoch`: one RL update of the LoRA policy on this iteration's rollouts.

Reads the policy the rollouts were sampled with (`policy_state.policy_for`) and its AdamW state,
the stored window steps, and the advantages the recipe selects ("spatial": the CAST maps on the
log-prob grid; "scalar": Flow-GRPO's per-sample advantage; "atom": the no-map credit as a constant
map on the spatial loss), runs `cast_core.policy.policy_update`
(inner epochs x `steps_per_epoch` optimizer steps, each accumulated over micro-batches of at most
`micro_batch` samples; clipped objective, optional KL to the adapter-free base, NaN/Inf guard that
skips and records a bad step), with the lr of each optimizer step set by a linear warm-up over the
first `warmup_steps` optimizer steps of the run (counted from the AdamW state's step, so across
iterations; `cast_core.lr_schedule.linear_warmup_lr`) applied to the iteration's lr
(`iteration_lr`: `train.lr`, or with `train.kl_target_nats` the previous iteration's lr scaled by
how far that iteration moved the policy, so that each iteration moves about the target, or with
`train.velocity_target` by the change of the velocity that move implies; with
`train.kl_target_per_step` as well, each window step's loss is weighted so that every step moves
about the same KL, `iteration_step_weights`). With
`recast.weighting` "static" or "recast" the loss takes one map per window step instead: the atom types' shares of CAST's map (`type_maps`)
weighted by `tasks.stages.recast_gains.reward_step_weights` (ReCAST: from this iteration's `gains`
stage) and clamped (`cast_core.pixel_map.step_weighted_maps`); under NFT, one map per step of
the sampling schedule that its forward-noise t draws can reach, each draw taking the map of the
step nearest its t (`cast_core.nft.covered_steps`, `credit_at_t`). It writes:
- `train_steps`: one row per optimizer step with the samples it used, loss, clip fraction, ratio
  mean/std (also the ratio mean and clip fraction per window step), the ratio's k3, the KL to the
  rollout policy and (kl_beta > 0) to the reference in nats per sample and window step (summed
  over latent dims) and the reference KL's all-dims mean, grad norm, skip flag and reason, the lr
  the step ran with, this iteration's mean score per atom type, the fraction of zero-variance
  atom groups, and the wall seconds of this iteration's earlier stages;
- the new LoRA weights and optimizer state (safetensors blobs) and a `checkpoints` row, which the
  next iteration's rollout and training start from, with the iteration's diagnostics
  (`cast_core.diagnostics`): the norm of the LoRA change over this training, how far it moved
  the policy (`update_kl_nats`: KL(rollout policy || trained policy) per sample and window step
  in nats, replayed on up to 64 of the samples after the last step, and `update_kl_per_step`,
  the same at each window step; `update_velocity_rms` and `update_velocity_per_step`, the
  velocity change it implies, RMS per latent dim), the mean high-frequency energy of the
  rollout images, the constant-reward alarm, the iteration's lr and the window steps' loss
  weights.
Weights that came out non-finite (e.g. a huge lr: each step is finite until the weights are not)
are never saved: the stage raises `NonFiniteWeights` (a `StageRefused`), which leaves a
`stage_failures` row with each step's loss, lr and skip reason, writes no blob, table row or
completion, and fails the flow; the policy stays at the previous checkpoint.
With `train.objective = "nft"` the update is `cast_core.nft_update.nft_update` instead: the
forward-process loss on the rollouts' clean latents x0 with the same advantages (the scalar ones,
or the maps, pooled to the token grid and group-centred there), the same optimizer, warm-up,
inner epochs, steps and micro-batches; its `train_steps` rows carry `objective` "nft", the
optimality's positive share and the loss per forward-noise t bin, and no ratio, clip or KL
columns; `update_kl_nats` is null when the rollouts used the ODE (noise level 0).
The first inner step must see ratio 1 (same weights as the rollout); when it does not, a warning
with the figures is logged and the row keeps them. A constant-reward alarm (every group of an atom
type tied, or all scalar rewards equal: no learning signal from that reward) is logged as a
warning with its figures and recorded.

Read -> compute -> write: the stage body reads the update's inputs (`read_batch`: prompts, window
steps, advantages) and the iteration's statistics from the stored rows (`iteration_stats`: the
mean score per atom type, the zero-variance fraction, the alarm), trains the loaded policy
(`train_policy`) and builds the rows from what came back (`train_step_rows`, `checkpoint_row`).
`iteration_stats`, `train_step_rows` and `checkpoint_row` (`tasks.stages.train_rows`) are tested
on plain inputs. The
training and its writes (`train_and_write`) take the loaded policy, so the Ray executor runs them
on resident policy actors (`tasks.stages.ray_workers`), data-parallel across `ray.train_workers`
of them (`cast_core.data_parallel`: each rank reads the window steps of its own samples only and
trains its part of every step, of either objective; the ranks check that they hold the same
trained LoRA and rank 0 alone writes). The mean
score per atom type and the rollout images' high-frequency energy are computed here, from the
stored atom scores and images: no earlier stage's table has a column for them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow.compute as pc
import torch
from safetensors import safe_open

from cast_core.csg.graph import ATOM_TYPES
from cast_core.data_parallel import SOLO, Shard, same_on_all_ranks
from cast_core.diagnostics import high_frequency_energy
from cast_core.lr_schedule import halflife_factor, kl_step_weights, kl_targeted_lr
from cast_core.nft import covered_steps
from cast_core.pixel_map import split_step_maps, step_weighted_maps
from cast_core.rollout import Rollout
from cast_core.window import SdeWindow
from tasks.stages.guard import stage_task
from tasks.stages.models import base_hash, load_optimizer_state, set_threads
from tasks.stages.policy_state import PolicyState, load_policy_of, policy_for
from tasks.stages.recast_gains import reward_step_weights
from tasks.stages.recipe import Recipe
from tasks.stages.rollout import rollout_spec
from tasks.stages.score_atoms import load_graphs, load_rollout_rows
from tasks.stages.train_rows import (
    IterationStats,
    checkpoint_row,
    iteration_stats,
    train_step_rows,
)
from tasks.stages.train_update import (
    TrainBatch,
    TrainOutcome,
    held_samples,
    nft_config,
    pick_advantage,
    policy_config,
    train_policy,
)
from tasks.store.stage import StageRef, make_key, run_stage
from tasks.store.store import Store, tensor_bytes

if TYPE_CHECKING:
    from tasks.stages.ray_workers import Workers

STAGE = "train_epoch"
ROLLOUT_ROWS = ("x0", "latents", "next_latents", "log_probs")  # per sample; t, t_next shared


def _logger():
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:  # outside a Prefect run (tests, direct calls)
        return logging.getLogger("cast.train_epoch")


def iteration_lr(recipe: Recipe, policy: PolicyState) -> float:
    """The lr this iteration trains at before the warm-up's factor: `train.lr`, or with
    `train.kl_target_nats` the previous iteration's lr scaled towards the KL target by how far it
    moved the policy (`cast_core.lr_schedule.kl_targeted_lr`; `train.lr` at iteration 0, and for a
    previous checkpoint written before checkpoints had an lr), or with `train.velocity_target`
    the same towards a change of the velocity (`update_velocity_rms`; a checkpoint without one
    keeps its lr). With `train.lr_halflife` the lr aimed at halves every that many iterations:
    the constant lr and the controller's bounds by the factor d, the velocity target by d and the
    KL target by d^2 (a move's KL is quadratic in the lr)."""
    tr = recipe.train
    d = halflife_factor(policy.iteration, tr.lr_halflife)
    if policy.iteration == 0 or (tr.kl_target_nats is None and tr.velocity_target is None):
        return tr.lr * d
    if tr.velocity_target is not None:  # the velocity change is about linear in the lr, the KL
        moved = policy.update_velocity_rms  # quadratic: square both, and the same controller
        moved, target = (None if moved is None else moved**2), (tr.velocity_target * d)**2
    else:
        moved, target = policy.update_kl_nats, tr.kl_target_nats * d**2
    return kl_targeted_lr(tr.lr if policy.lr is None else policy.lr, moved, target,
                          max_factor=tr.kl_lr_factor, lr_min=tr.kl_lr_floor * tr.lr * d,
                          lr_max=tr.kl_lr_ceiling * tr.lr * d)


def iteration_step_weights(recipe: Recipe, policy: PolicyState,
                           window_steps: int) -> tuple[float, ...] | None:
    """The loss weight of each of the `window_steps` window steps this iteration trains with:
    None (every step 1) without `train.kl_target_per_step`; with it, 1 at iteration 0 and then
    the previous iteration's weights moved so that every step's KL approaches the others'
    (`cast_core.lr_schedule.kl_step_weights` of its `update_kl_per_step`). A previous checkpoint
    without per-step KLs, or of another window size, starts again from 1."""
    tr = recipe.train
    if not tr.kl_target_per_step:
        return None
    kls, weights = policy.update_kl_per_step, policy.step_weights
    if policy.iteration == 0 or kls is None or len(kls) != window_steps:
        return (1.0,) * window_steps
    return kl_step_weights(weights if weights and len(weights) == window_steps else None, kls,
                           max_factor=tr.kl_lr_factor, floor=tr.kl_step_weight_floor)


def _optimizer(store: Store, recipe: Recipe, params, optimizer_path: str | None, lr: float):
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=recipe.train.weight_decay)
    if optimizer_path:
        with safe_open(str(store.resolve(optimizer_path)), framework="pt") as f:
            groups = f.metadata()["param_groups"]
        load_optimizer_state(optimizer, store.get_tensors(optimizer_path), groups)
        for group in optimizer.param_groups:
            group["lr"] = lr
    return optimizer


@dataclass(frozen=True)
class Credit:
    """The update's advantages (`_advantages`) and, for step maps, what `train_steps` records."""

    advantages: torch.Tensor
    loss_kind: str
    weights_json: str | None = None
    step_times: torch.Tensor | None = None


def _advantages(store: Store, recipe: Recipe, blob: dict[str, torch.Tensor], window: SdeWindow,
                gains: StageRef | None, schedule: torch.Tensor | None = None) -> Credit:
    """`pick_advantage`; with `advantage.scalar_steps` its map on the later window steps and the
    scalar advantage on the first ones (`split_step_maps`, [N, K, h, w]); with `recast.weighting`
    the type maps weighted per window step ([N, K, h, w]), or under NFT per step of `schedule`
    (the backbone's step times [S]) that its t draws reach (`nft.covered_steps`), returned with
    those steps' times."""
    start, end, times = window.start, window.end, None
    nft_steps = _nft_step_maps(recipe)
    if nft_steps:
        if schedule is None:
            raise ValueError("NFT with recast.weighting needs the schedule's step times")
        start, end = covered_steps(schedule, recipe.train.nft_t_min, recipe.train.nft_t_max)
        times = schedule[start:end].double()
    weights = reward_step_weights(store, recipe, start, end, gains)  # [4, K]
    if weights is None:
        adv, kind = pick_advantage(blob, recipe.advantage.kind)
        if recipe.advantage.scalar_steps:
            adv = split_step_maps(blob["scalar"], adv, window.end - window.start,
                                  recipe.advantage.scalar_steps)
        return Credit(adv, kind)
    maps = step_weighted_maps(blob["type_maps"], weights, recipe.advantage.clip)
    record = {k: [round(float(x), 6) for x in weights[i]] for i, k in enumerate(ATOM_TYPES)}
    if nft_steps:
        record["step_times"] = [round(float(x), 6) for x in times]
    return Credit(maps, "spatial", json.dumps(record), times)


def _nft_step_maps(recipe: Recipe) -> bool:
    """Whether the update takes per-step maps over the NFT objective's t (which need the
    backbone's schedule)."""
    return recipe.train.objective == "nft" and recipe.recast.weighting != "none"


def read_batch(store: Store, recipe: Recipe, rows: list[dict], csgs: StageRef,
               advantages: StageRef, gains: StageRef | None, device: torch.device,
               iteration: int = 0, shard: Shard = SOLO,
               schedule: torch.Tensor | None = None) -> TrainBatch:
    """The update's inputs for the rollout `rows` (in blob order): their window steps on the
    transformer's `device` (where the replay's velocities are), prompts and advantages
    (`schedule`: the backbone's step times, needed by NFT with `recast.weighting`). A rank
    of a data-parallel group reads the window steps of its samples only (`held_samples` of the
    `iteration`'s update; `Store.get_tensor_rows`), the prompts and advantages of all."""
    held = held_samples(recipe, len(rows), iteration, shard)
    if held is None:
        blob = {k: v.to(device) for k, v in store.get_tensors(rows[0]["latents_path"]).items()}
        index = [r["blob_index"] for r in rows]
    else:
        index = [rows[i]["blob_index"] for i in held.tolist()]
        blob = {k: v.to(device) for k, v in store.get_tensor_rows(
            rows[0]["latents_path"], index, ROLLOUT_ROWS).items()}
        index = list(range(len(index)))
    rollout = Rollout(x0=blob["x0"][index], latents=blob["latents"][index],
                      next_latents=blob["next_latents"][index],
                      log_probs=blob["log_probs"][index], t=blob["t"], t_next=blob["t_next"])
    window = SdeWindow(rows[0]["window_start"], rows[0]["window_end"])
    spec = rollout_spec(recipe, {"window_start": window.start, "window_end": window.end})
    texts = {pid: json.loads(g)["prompt"] for pid, g in load_graphs(store, csgs).items()}
    adv_blob = store.get_tensors(store.read_output(advantages, "advantage_maps",
                                                   ["map_path"])["map_path"][0].as_py())
    credit = _advantages(store, recipe, adv_blob, window, gains, schedule)
    return TrainBatch([texts[r["prompt_id"]] for r in rows], rollout, spec,
                      credit.advantages[[r["blob_index"] for r in rows]], credit.loss_kind,
                      credit.weights_json, held, credit.step_times)


def read_stats(store: Store, scores: StageRef, advantages: StageRef,
               std_floor: float) -> IterationStats:
    """`iteration_stats` of the iteration's stored atom scores and advantages."""
    score_rows = store.read_output(scores, "atom_scores",
                                   ["prompt_id", "atom_id", "atom_type", "score"]).to_pylist()
    adv_rows = store.read_output(advantages, "advantages",
                                 ["prompt_id", "atom_id", "zero_variance"]).to_pylist()
    rewards = store.read_output(advantages, "advantage_maps", ["reward"])["reward"].to_pylist()
    return iteration_stats(score_rows, adv_rows, rewards, std_floor)


def _rollout_hf_energy(store: Store, rows: list[dict]) -> float:
    """The mean high-frequency energy of the rollout images of `rows`."""
    images = store.get_tensors(rows[0]["image_path"])["images"]  # uint8 [N, 3, H, W]
    images = images[[r["blob_index"] for r in rows]]
    return float(high_frequency_energy(images / 255.0).mean())


def _stage_seconds(store: Store, run_id: str, iteration: int) -> str:
    rows = store.read_table("stages", (pc.field("run_id") == run_id)
                            & (pc.field("iteration") == iteration)).to_pylist()
    return json.dumps({r["stage"]: round((r["finished_at"] - r["started_at"]).total_seconds(), 3)
                       for r in rows}, sort_keys=True)


def _warn(outcome: TrainOutcome, stats: IterationStats, recipe: Recipe, batch: TrainBatch,
          iteration: int) -> None:
    """Log a first inner step whose ratio is not 1, and the constant-reward alarm."""
    first = outcome.updates[0]
    if getattr(first, "first_ratio_ok", None) is False:
        _logger().warning(
            "first inner step ratio is not 1: ratio_mean=%.6f ratio_std=%.6f (tolerance "
            "%.0e); rollout and replay disagree (dropout, precision, CFG or changed weights)",
            first.ratio_mean, first.ratio_std, policy_config(recipe, batch.loss_kind).ratio_tol)
    if stats.alarm.alarm:
        _logger().warning("constant-reward alarm at iteration %d: %s", iteration,
                          stats.alarm.reason)


def cache_key(store: Store, recipe: Recipe, rollouts: StageRef, scores: StageRef,
              advantages: StageRef, iteration: int, gains: StageRef | None = None) -> str:
    policy = policy_for(store, recipe, iteration)
    return make_key(STAGE, {"train": recipe.section_hash("train", "advantage", "sampling",
                                                         "recast"),
                            "seed": recipe.run.seed, "iteration": iteration,
                            "lr": iteration_lr(recipe, policy),
                            **_weights_key(recipe, policy)},
                    {"policy": policy.policy_hash, "optimizer": policy.optimizer_path or "",
                     "rollouts": rollouts.content_hash, "scores": scores.content_hash,
                     "advantages": advantages.content_hash,
                     "gains": gains.content_hash if gains is not None else ""})


def _weights_key(recipe: Recipe, policy: PolicyState) -> dict:
    """What the window steps' loss weights follow from, in the cache key when the recipe uses
    them: the previous checkpoint's weights and per-step KLs (with the rollouts' window size,
    which the rollouts' hash holds), as the lr follows from its lr and KL."""
    if not recipe.train.kl_target_per_step:
        return {}
    return {"step_weights_from": [policy.step_weights, policy.update_kl_per_step]}


@dataclass(frozen=True)
class Trained:
    """What `train_and_write` wrote (the stage's outputs), the trained policy's hash and the
    samples whose window steps this process read (all N on one process, a rank's own)."""

    refs: list
    policy_hash: str
    samples_read: tuple[int, ...] = ()


def train_and_write(store: Store, recipe: Recipe, backbone, params, policy: PolicyState,
                    csgs: StageRef, rollouts: StageRef, scores: StageRef, advantages: StageRef,
                    iteration: int, gains: StageRef | None = None, *,
                    shard: Shard = SOLO) -> Trained:
    """Train the loaded `policy` (backbone and its LoRA `params`) on the iteration and write the
    stage's outputs; the caller records completion. With a `shard` of a data-parallel group each
    rank trains its part of every step, the ranks check that they hold the same trained LoRA, and
    only rank 0 writes (the others return no refs)."""
    run_id = recipe.run.name
    set_threads(recipe)
    lr = iteration_lr(recipe, policy)
    optimizer = _optimizer(store, recipe, params, policy.optimizer_path, lr)
    rows = load_rollout_rows(store, rollouts)
    device = next(backbone.transformer.parameters()).device
    schedule = (backbone.sigmas(recipe.sampling.num_steps)[:-1].double().cpu()
                if _nft_step_maps(recipe) else None)
    batch = read_batch(store, recipe, rows, csgs, advantages, gains, device, iteration, shard,
                       schedule)
    weights = iteration_step_weights(recipe, policy, batch.rollout.t.shape[0])
    outcome = train_policy(backbone, params, optimizer, batch, recipe, iteration, lr, shard,
                           weights)
    policy_hash = _same_policy(outcome.lora, shard, device)
    read = tuple(range(len(rows)) if batch.held is None else batch.held.tolist())
    if shard.rank > 0:
        return Trained([], policy_hash, read)
    stats = read_stats(store, scores, advantages, recipe.advantage.std_floor)
    _warn(outcome, stats, recipe, batch, iteration)
    keys, part = {"run_id": run_id, "iteration": iteration}, f"{run_id}-{iteration:05d}"
    shared = {**stats.rewards, "zero_variance_fraction": stats.zero_variance_fraction,
              "stage_seconds_json": _stage_seconds(store, run_id, iteration),
              "reward_step_weights_json": batch.weights_json}
    nft = nft_config(recipe) if recipe.train.objective == "nft" else None
    steps = train_step_rows(keys, outcome.updates, outcome.first_step, shared, nft,
                            float(batch.advantages.abs().mean()))
    lora = store.put_tensors(outcome.lora)
    opt = store.put_tensors(outcome.optimizer_state,
                            metadata={"param_groups": outcome.param_groups})
    checkpoint = checkpoint_row(keys, lora, opt, base_hash(recipe), recipe.train, outcome,
                                _rollout_hf_energy(store, rows), stats.alarm, lr)
    return Trained([store.write_table("train_steps", steps, part), lora, opt,
                    store.write_table("checkpoints", [checkpoint], part)], lora.sha256, read)


def _same_policy(lora: dict[str, torch.Tensor], shard: Shard, device: torch.device) -> str:
    """The trained LoRA's policy hash (its blob's sha256), checked equal on every rank."""
    digest = hashlib.sha256(tensor_bytes(lora)).hexdigest()
    if shard.world > 1 and not same_on_all_ranks(bytes.fromhex(digest), device):
        raise RuntimeError(
            f"rank {shard.rank} of {shard.world}: the data-parallel ranks ended on different "
            f"LoRAs (this rank's hash {digest[:12]}); their inputs or kernels differ. Nothing was "
            f"written; check that every training actor runs the same code and backbone")
    return digest


def train_epoch(store: Store, recipe: Recipe, csgs: StageRef, rollouts: StageRef,
                scores: StageRef, advantages: StageRef, iteration: int,
                gains: StageRef | None = None, workers: Workers | None = None) -> StageRef:
    """The stage; with `workers` (the Ray executor) it trains on a resident policy actor, which
    keeps the trained policy for the next iteration's rollout."""
    inputs = (csgs, rollouts, scores, advantages, iteration, gains)

    def body():
        policy = policy_for(store, recipe, iteration)
        if workers is not None:
            return workers.train(store, recipe, policy, *inputs).refs
        backbone, params = load_policy_of(store, recipe, policy)
        return train_and_write(store, recipe, backbone, params, policy, *inputs).refs

    key = cache_key(store, recipe, rollouts, scores, advantages, iteration, gains)
    return run_stage(store, recipe.run.name, iteration, STAGE, key, body)


train_epoch_task = stage_task(train_epoch, STAGE, cache_key)
