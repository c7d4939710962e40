"""Stage `train_epoch`: one RL update of the LoRA policy on this iteration's rollouts.

Reads the policy the rollouts were sampled with (`policy_state.policy_for`) and its AdamW state,
the stored window steps, and the advantages the recipe selects ("spatial": the CAST maps on the
log-prob grid; "scalar": Flow-GRPO's per-sample advantage), runs `cast_core.policy.policy_update`
(inner epochs x micro-batches, clipped objective, optional KL to the adapter-free base, NaN/Inf
guard that skips and records a bad micro-batch), and writes:
- `train_steps`: one row per micro-batch step with loss, clip fraction, ratio mean/std, approx KL,
  KL, grad norm, skip flag and reason, lr, this iteration's mean score per atom type, the fraction
  of zero-variance atom groups, and the wall seconds of this iteration's earlier stages;
- the new LoRA weights and optimizer state (safetensors blobs) and a `checkpoints` row, which the
  next iteration's rollout and training start from.
The first inner step must see ratio 1 (same weights as the rollout); when it does not, a warning
with the figures is logged and the row keeps them.
"""

from __future__ import annotations

import json
import logging

import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from cast_core.policy import PolicyConfig, policy_update
from cast_core.rollout import Rollout, RolloutSpec
from cast_core.window import SdeWindow
from tasks.models import (
    base_hash,
    load_optimizer_state,
    load_policy,
    lora_tensors,
    optimizer_tensors,
    set_threads,
)
from tasks.policy_state import policy_for
from tasks.recipe import Recipe
from tasks.rollout_groups import rollout_spec
from tasks.score_atoms import load_graphs, load_rollout_rows
from tasks.stage import StageRef, derive_seed, make_key, run_stage, stage_task
from tasks.store import Store

STAGE = "train_epoch"
ATOM_TYPES = ("object", "count", "attribute", "relation")


def _logger():
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:  # outside a Prefect run (tests, direct calls)
        return logging.getLogger("cast.train_epoch")


def _optimizer(store: Store, recipe: Recipe, params, optimizer_path: str | None):
    optimizer = torch.optim.AdamW(params, lr=recipe.train.lr,
                                  weight_decay=recipe.train.weight_decay)
    if optimizer_path:
        with safe_open(str(store.resolve(optimizer_path)), framework="pt") as f:
            groups = f.metadata()["param_groups"]
        load_optimizer_state(optimizer, store.get_tensors(optimizer_path), groups)
        for group in optimizer.param_groups:
            group["lr"] = recipe.train.lr
    return optimizer


def _stage_seconds(store: Store, run_id: str, iteration: int) -> str:
    rows = store.read_table("stages", (pc.field("run_id") == run_id)
                            & (pc.field("iteration") == iteration)).to_pylist()
    return json.dumps({r["stage"]: round((r["finished_at"] - r["started_at"]).total_seconds(), 3)
                       for r in rows}, sort_keys=True)


def _iteration_stats(store: Store, scores: StageRef, advantages: StageRef) -> dict:
    table = pq.read_table(store.resolve(scores.path_with("/atom_scores/")),
                          columns=["atom_type", "score"]).to_pylist()
    out = {}
    for kind in ATOM_TYPES:
        values = [r["score"] for r in table if r["atom_type"] == kind]
        out[f"reward_{kind}"] = sum(values) / len(values) if values else None
    adv = pq.read_table(store.resolve(advantages.path_with("/advantages/")),
                        columns=["prompt_id", "atom_id", "zero_variance"]).to_pylist()
    groups = {(r["prompt_id"], r["atom_id"]): r["zero_variance"] for r in adv}
    out["zero_variance_fraction"] = sum(groups.values()) / max(1, len(groups))
    return out


def cache_key(store: Store, recipe: Recipe, rollouts: StageRef, scores: StageRef,
              advantages: StageRef, iteration: int) -> str:
    policy = policy_for(store, recipe, iteration)
    return make_key(STAGE, {"train": recipe.section_hash("train", "advantage", "sampling"),
                            "seed": recipe.run.seed, "iteration": iteration},
                    {"policy": policy.policy_hash, "optimizer": policy.optimizer_path or "",
                     "rollouts": rollouts.content_hash, "scores": scores.content_hash,
                     "advantages": advantages.content_hash})


def _load_rollout(store: Store, rows: list[dict]) -> tuple[Rollout, RolloutSpec, list[int]]:
    blob = store.get_tensors(rows[0]["latents_path"])
    index = [r["blob_index"] for r in rows]
    rollout = Rollout(x0=blob["x0"][index], latents=blob["latents"][index],
                      next_latents=blob["next_latents"][index],
                      log_probs=blob["log_probs"][index], t=blob["t"], t_next=blob["t_next"])
    return rollout, SdeWindow(rows[0]["window_start"], rows[0]["window_end"]), index


def train_epoch(store: Store, recipe: Recipe, csgs: StageRef, rollouts: StageRef,
                scores: StageRef, advantages: StageRef, iteration: int) -> StageRef:
    run_id, tr = recipe.run.name, recipe.train

    def body():
        set_threads(recipe)
        policy = policy_for(store, recipe, iteration)
        lora = store.get_tensors(policy.lora_path) if policy.lora_path else None
        backbone, params = load_policy(recipe, lora)
        optimizer = _optimizer(store, recipe, params, policy.optimizer_path)
        steps_before = int(optimizer.state[params[0]]["step"]) if optimizer.state else 0
        rows = load_rollout_rows(store, rollouts)
        rollout, window, index = _load_rollout(store, rows)
        spec = rollout_spec(recipe, {"window_start": window.start, "window_end": window.end})
        texts = {pid: json.loads(g)["prompt"] for pid, g in load_graphs(store, csgs).items()}
        prompts = [texts[r["prompt_id"]] for r in rows]
        adv_blob = store.get_tensors(pq.read_table(store.resolve(
            advantages.path_with("/advantage_maps/")), columns=["map_path"])["map_path"][0]
            .as_py())
        adv = adv_blob["maps"] if recipe.advantage.kind == "spatial" else adv_blob["scalar"]
        config = PolicyConfig(advantage=recipe.advantage.kind, clip_range=tr.clip_range,
                              kl_beta=tr.kl_beta, inner_epochs=tr.inner_epochs,
                              micro_batch=tr.micro_batch, max_grad_norm=tr.max_grad_norm)
        total = -(-len(rows) // tr.micro_batch) * tr.inner_epochs
        with tqdm(total=total, desc=f"train {iteration}", unit="step", mininterval=1.0) as bar:
            def show(u) -> None:
                bar.set_postfix(loss="skipped" if u.skipped else f"{u.loss:.4f}",
                                clip=f"{u.clip_fraction:.3f}")
                bar.update()

            updates = policy_update(backbone, optimizer, prompts, rollout, spec, adv[index],
                                    config, shuffle_seed=derive_seed(recipe.run.seed, "shuffle",
                                                                     iteration), on_step=show)
        first = updates[0]
        if first.first_ratio_ok is False:
            _logger().warning(
                "first inner step ratio is not 1: ratio_mean=%.6f ratio_std=%.6f (tolerance "
                "%.0e); rollout and replay disagree (dropout, precision, CFG or changed weights)",
                first.ratio_mean, first.ratio_std, config.ratio_tol)
        stats = _iteration_stats(store, scores, advantages)
        seconds = _stage_seconds(store, run_id, iteration)
        step_rows = [{"run_id": run_id, "iteration": iteration, "step": steps_before + j,
                      "inner_epoch": u.epoch, "loss": None if u.skipped else u.loss,
                      "clip_fraction": None if u.skipped else u.clip_fraction,
                      "ratio_mean": None if u.skipped else u.ratio_mean,
                      "ratio_std": None if u.skipped else u.ratio_std,
                      "approx_kl": None if u.skipped else u.approx_kl, "kl": u.kl,
                      "grad_norm": None if u.skipped else u.grad_norm, "adv_mass": u.adv_mass,
                      "skipped": u.skipped, "skip_reason": u.skip_reason, "lr": tr.lr,
                      **stats, "stage_seconds_json": seconds} for j, u in enumerate(updates)]
        lora_blob = store.put_tensors(lora_tensors(backbone))
        opt_tensors, groups = optimizer_tensors(optimizer)
        opt_blob = store.put_tensors(opt_tensors, metadata={"param_groups": groups})
        optimizer_steps = int(optimizer.state[params[0]]["step"]) if optimizer.state else 0
        part = f"{run_id}-{iteration:05d}"
        checkpoint = {"run_id": run_id, "iteration": iteration, "policy_hash": lora_blob.sha256,
                      "lora_path": lora_blob.path, "optimizer_path": opt_blob.path,
                      "optimizer_hash": opt_blob.sha256, "base_hash": base_hash(recipe),
                      "lora_rank": tr.lora_rank, "lora_alpha": tr.lora_alpha,
                      "optimizer_steps": optimizer_steps}
        return [store.write_table("train_steps", step_rows, part), lora_blob, opt_blob,
                store.write_table("checkpoints", [checkpoint], part)]

    key = cache_key(store, recipe, rollouts, scores, advantages, iteration)
    return run_stage(store, run_id, iteration, STAGE, key, body)


train_epoch_task = stage_task(train_epoch, STAGE, cache_key)
