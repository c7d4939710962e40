"""The rows stage `train_epoch` writes, built from what it read and what training returned: the
iteration's reward statistics (`iteration_stats`), one `train_steps` row per optimizer step of
either objective (`train_step_rows`) and the trained policy's `checkpoints` row
(`checkpoint_row`). Pure functions of plain inputs, tested as such (tests/test_train_epoch.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cast_core.csg.graph import ATOM_TYPES
from cast_core.diagnostics import RewardAlarm, constant_reward_alarm
from cast_core.nft_update import NftConfig, NftStep
from cast_core.policy import UpdateStep
from tasks.stages.recipe_method import TrainSection
from tasks.stages.train_update import TrainOutcome
from tasks.store.records import BlobRef


@dataclass(frozen=True)
class IterationStats:
    """The iteration's reward statistics, carried by every `train_steps` row and the checkpoint.

    rewards: {"reward_<type>": mean score of the type's atoms over all samples, None when no
    prompt has one}; zero_variance_fraction: share of (prompt, atom) groups whose G scores tie;
    alarm: the constant-reward alarm."""

    rewards: dict[str, float | None]
    zero_variance_fraction: float
    alarm: RewardAlarm


def iteration_stats(score_rows: list[dict], advantage_rows: list[dict], rewards: list[float],
                    std_floor: float) -> IterationStats:
    """The iteration's statistics from `atom_scores` rows (prompt_id, atom_id, atom_type, score),
    `advantages` rows (prompt_id, atom_id, zero_variance) and the samples' scalar rewards [N]
    (`advantage_maps.reward`); std_floor: the alarm's tie threshold."""
    means = {}
    for kind in ATOM_TYPES:
        values = [r["score"] for r in score_rows if r["atom_type"] == kind]
        means[f"reward_{kind}"] = sum(values) / len(values) if values else None
    groups = {(r["prompt_id"], r["atom_id"]): r["zero_variance"] for r in advantage_rows}
    types = {(r["prompt_id"], r["atom_id"]): r["atom_type"] for r in score_rows}
    by_type: dict[str, list[bool]] = {}
    for key, flag in sorted(groups.items()):
        by_type.setdefault(types[key], []).append(flag)
    alarm = constant_reward_alarm({k: torch.tensor(v) for k, v in by_type.items()},
                                  torch.tensor(rewards, dtype=torch.float64), std_floor)
    return IterationStats(means, sum(groups.values()) / max(1, len(groups)), alarm)


def _step_row(u: UpdateStep) -> dict:
    """The train_steps columns of one UpdateStep (diagnostics null when it was skipped)."""
    def kept(value):
        return None if u.skipped else value

    return {"inner_epoch": u.epoch, "samples": u.samples, "loss": kept(u.loss),
            "clip_fraction": kept(u.clip_fraction), "ratio_mean": kept(u.ratio_mean),
            "ratio_std": kept(u.ratio_std), "ratio_k3": kept(u.ratio_k3),
            "policy_kl_nats": kept(u.policy_kl_nats),
            "policy_kl_k1_nats": kept(u.policy_kl_k1_nats), "ref_kl_nats": u.ref_kl_nats,
            "ref_kl_mean_dim": u.ref_kl_mean_dim, "grad_norm": kept(u.grad_norm),
            "adv_mass": u.adv_mass, "skipped": u.skipped, "skip_reason": u.skip_reason,
            "lr": u.lr,
            "ratio_mean_per_step": kept(list(u.ratio_mean_per_step)),
            "clip_fraction_per_step": kept(list(u.clip_fraction_per_step)),
            "objective": "sde", "positive_share": None, "nft_loss_by_t_json": None}


def _nft_step_row(u: NftStep, config: NftConfig, adv_mass: float) -> dict:
    """The train_steps columns of one NftStep: no ratio, clip or KL (no likelihoods)."""
    width = (config.t_max - config.t_min) / config.t_buckets
    bins = [[round(config.t_min + k * width, 6), round(config.t_min + (k + 1) * width, 6)]
            for k in range(config.t_buckets)]
    none = dict.fromkeys(("clip_fraction", "ratio_mean", "ratio_std", "ratio_k3",
                          "policy_kl_nats", "policy_kl_k1_nats", "ref_kl_nats",
                          "ref_kl_mean_dim", "ratio_mean_per_step", "clip_fraction_per_step"))
    return {**none, "inner_epoch": u.epoch, "samples": u.samples, "loss": u.loss,
            "grad_norm": u.grad_norm, "adv_mass": adv_mass, "skipped": u.skipped,
            "skip_reason": u.skip_reason, "lr": u.lr, "objective": "nft",
            "positive_share": u.positive_share,
            "nft_loss_by_t_json": None if u.skipped else json.dumps(
                {"t_bins": bins, "loss": list(u.loss_by_t)})}


def train_step_rows(keys: dict, updates: Sequence[UpdateStep | NftStep], first_step: int,
                    shared: dict, nft: NftConfig | None = None,
                    adv_mass: float = 0.0) -> list[dict]:
    """One `train_steps` row per optimizer step, `updates[j]` as run step first_step + j: the
    step's own columns (an NFT step's with `nft`, its config, and adv_mass, the mean |advantage|
    of the samples), then `shared`, the columns every row of the iteration carries; keys =
    run_id and iteration."""
    return [{**keys, "step": first_step + j,
             **(_step_row(u) if nft is None else _nft_step_row(u, nft, adv_mass)), **shared}
            for j, u in enumerate(updates)]


def checkpoint_row(keys: dict, lora: BlobRef, optimizer: BlobRef, base: str,
                   train: TrainSection, outcome: TrainOutcome, hf_energy: float,
                   alarm: RewardAlarm, lr: float) -> dict:
    """The `checkpoints` row of the trained policy: its blobs, base and adapter shape, and the
    iteration's diagnostics (hf_energy: the rollout images' mean high-frequency energy; lr: the
    iteration's lr before the warm-up); keys = run_id and iteration."""
    return {**keys, "policy_hash": lora.sha256, "lora_path": lora.path,
            "optimizer_path": optimizer.path, "optimizer_hash": optimizer.sha256,
            "base_hash": base, "lora_rank": train.lora_rank, "lora_alpha": train.lora_alpha,
            "optimizer_steps": outcome.optimizer_steps,
            "param_change_norm": outcome.param_change_norm,
            "update_kl_nats": outcome.update_kl_nats, "rollout_hf_energy": hf_energy,
            "constant_reward_alarm": alarm.alarm, "alarm_reason": alarm.reason, "lr": lr,
            "update_kl_per_step": (None if outcome.update_kl_per_step is None
                                   else list(outcome.update_kl_per_step)),
            "step_weights": None if outcome.step_weights is None else list(outcome.step_weights),
            "update_velocity_rms": None if outcome.velocity is None else outcome.velocity.rms,
            "update_velocity_per_step": (None if outcome.velocity is None
                                         else list(outcome.velocity.per_step))}
