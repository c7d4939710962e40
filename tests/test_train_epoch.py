"""The training stage's pure parts on plain inputs: stored rows -> IterationStats, the update's
steps -> `train_steps` rows, the trained policy's blobs and diagnostics -> the `checkpoints` row,
the advantage blob -> what the loss trains on. The stage itself runs in test_pipeline.py."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cast_core.diagnostics import RewardAlarm
from cast_core.lr_schedule import kl_step_weights, kl_targeted_lr
from cast_core.nft_update import NftConfig, NftStep
from cast_core.policy import UpdateStep
from cast_core.update_kl import VelocityChange
from tasks.stages.policy_state import PolicyState
from tasks.stages.recipe import load_recipe
from tasks.stages.recipe_method import TrainSection
from tasks.stages.train_epoch import iteration_lr, iteration_step_weights
from tasks.stages.train_rows import checkpoint_row, iteration_stats, train_step_rows
from tasks.stages.train_update import TrainOutcome, pick_advantage
from tasks.store.records import BlobRef
from tasks.store.schemas import conform

CI = Path(__file__).resolve().parents[1] / "data" / "recipes" / "shapes-ci.toml"

KEYS = {"run_id": "r", "iteration": 3}
# prompt -> atom -> (type, the G = 2 samples' scores)
SCORES = {"p0": {"o": ("object", [1.0, 0.0]), "c": ("count", [0.5, 0.5])},
          "p1": {"o": ("object", [0.25, 0.75]), "c": ("count", [1.0, 1.0])}}


def _score_rows() -> list[dict]:
    return [{"prompt_id": pid, "atom_id": atom, "atom_type": kind, "score": s}
            for pid, atoms in SCORES.items() for atom, (kind, values) in atoms.items()
            for s in values]


def _advantage_rows() -> list[dict]:
    """One row per sample and atom; zero_variance where the G scores tie."""
    return [{"prompt_id": pid, "atom_id": atom, "zero_variance": values[0] == values[1]}
            for pid, atoms in SCORES.items() for atom, (_, values) in atoms.items()
            for _ in values]


def test_iteration_stats_means_per_type_fraction_and_alarm():
    stats = iteration_stats(_score_rows(), _advantage_rows(), [0.5, 0.25, 0.6, 0.9], 1e-4)
    assert stats.rewards == {"reward_object": (1.0 + 0.0 + 0.25 + 0.75) / 4,
                             "reward_count": (0.5 + 0.5 + 1.0 + 1.0) / 4,
                             "reward_attribute": None, "reward_relation": None}
    assert stats.zero_variance_fraction == 2 / 4  # of the (prompt, atom) groups, not the rows
    assert stats.alarm.alarm and stats.alarm.constant_types == ("count",)
    assert "'count'" in stats.alarm.reason and "2 of 2 groups" in stats.alarm.reason


def test_iteration_stats_alarm_on_equal_rewards_only():
    rows = [r for r in _score_rows() if r["atom_type"] == "object"]
    adv = [r for r in _advantage_rows() if r["atom_id"] == "o"]
    spread = iteration_stats(rows, adv, [0.1, 0.9, 0.3, 0.7], 1e-4)
    assert not spread.alarm.alarm and spread.alarm.reason is None
    assert spread.zero_variance_fraction == 0.0
    tied = iteration_stats(rows, adv, [0.5] * 4, 1e-4)
    assert tied.alarm.alarm and "all 4 scalar rewards are equal" in tied.alarm.reason


def _sde_step(j: int, skipped: bool = False) -> UpdateStep:
    return UpdateStep(epoch=0, step=j, samples=8, lr=1e-4 * (j + 1), loss=0.5 + j,
                      clip_fraction=0.1, ratio_mean=1.0, ratio_std=0.01, ratio_k3=1e-5,
                      adv_mass=0.7, policy_kl_nats=0.02, policy_kl_k1_nats=0.021,
                      ref_kl_nats=None, ref_kl_mean_dim=None, grad_norm=2.0, skipped=skipped,
                      skip_reason="non-finite loss" if skipped else None,
                      first_ratio_ok=True if j == 0 else None,
                      ratio_mean_per_step=(1.0, 0.99), clip_fraction_per_step=(0.0, 0.2))


SHARED = {"reward_object": 0.5, "reward_count": None, "reward_attribute": None,
          "reward_relation": 1.0, "zero_variance_fraction": 0.25,
          "stage_seconds_json": "{}", "reward_step_weights_json": None}


def test_sde_step_rows_number_the_run_steps_and_null_a_skipped_steps_diagnostics():
    rows = train_step_rows(KEYS, [_sde_step(0), _sde_step(1, skipped=True)], 6, SHARED)
    conform("train_steps", rows)  # every declared column, of its declared type
    assert [r["step"] for r in rows] == [6, 7]
    kept, skipped = rows
    assert kept["loss"] == 0.5 and kept["ratio_mean_per_step"] == [1.0, 0.99]
    assert kept["objective"] == "sde" and kept["positive_share"] is None
    assert all(skipped[c] is None for c in ("loss", "clip_fraction", "ratio_mean", "ratio_std",
                                            "ratio_k3", "policy_kl_nats", "grad_norm",
                                            "ratio_mean_per_step", "clip_fraction_per_step"))
    assert skipped["skip_reason"] == "non-finite loss" and skipped["lr"] == 2e-4
    assert skipped["adv_mass"] == 0.7  # the step's own, kept when skipped
    assert all({**r, **KEYS, **SHARED} == r for r in rows)


def test_nft_step_rows_carry_the_t_bins_and_the_given_mass():
    config = NftConfig(t_min=0.2, t_max=0.8, t_buckets=3, group_size=2)
    steps = [NftStep(epoch=0, samples=4, loss=0.3, grad_norm=1.5, positive_share=0.75,
                     loss_by_t=(0.1, None, 0.5), lr=1e-4, skipped=False, skip_reason=None),
             NftStep(epoch=1, samples=4, loss=None, grad_norm=None, positive_share=0.5,
                     loss_by_t=(None, None, None), lr=1e-4, skipped=True,
                     skip_reason="non-finite loss")]
    rows = train_step_rows(KEYS, steps, 0, SHARED, config, adv_mass=0.4)
    conform("train_steps", rows)
    assert [(r["step"], r["inner_epoch"], r["objective"]) for r in rows] == [(0, 0, "nft"),
                                                                             (1, 1, "nft")]
    assert json.loads(rows[0]["nft_loss_by_t_json"]) == {
        "t_bins": [[0.2, 0.4], [0.4, 0.6], [0.6, 0.8]], "loss": [0.1, None, 0.5]}
    assert rows[1]["nft_loss_by_t_json"] is None
    assert all(r["adv_mass"] == 0.4 and r["ratio_mean"] is None and r["policy_kl_nats"] is None
               for r in rows)


def test_checkpoint_row_names_the_blobs_and_carries_the_diagnostics():
    train = TrainSection(lr=1e-3, lora_rank=4, lora_alpha=8.0, clip_range=0.1)
    outcome = TrainOutcome(updates=[], first_step=2, lora={}, optimizer_state={},
                           param_groups="[]", optimizer_steps=4, param_change_norm=0.125,
                           update_kl_nats=None)
    alarm = RewardAlarm(True, "all 4 scalar rewards are equal", (), 0.0, 0.5)
    row = checkpoint_row(KEYS, BlobRef("blobs/ab/lora", "ab" * 32),
                         BlobRef("blobs/cd/opt", "cd" * 32), "base-id", train, outcome, 0.03,
                         alarm, 5e-4)
    conform("checkpoints", [row])
    assert row == {**KEYS, "policy_hash": "ab" * 32, "lora_path": "blobs/ab/lora",
                   "optimizer_path": "blobs/cd/opt", "optimizer_hash": "cd" * 32,
                   "base_hash": "base-id", "lora_rank": 4, "lora_alpha": 8.0,
                   "optimizer_steps": 4, "param_change_norm": 0.125, "update_kl_nats": None,
                   "rollout_hf_energy": 0.03, "constant_reward_alarm": True,
                   "alarm_reason": "all 4 scalar rewards are equal", "lr": 5e-4,
                   "update_kl_per_step": None, "step_weights": None,
                   "update_velocity_rms": None, "update_velocity_per_step": None}
    moved = replace(outcome, update_kl_nats=0.5, update_kl_per_step=(0.25, 0.75),
                    velocity=VelocityChange(0.02, (0.01, 0.025)))
    row = checkpoint_row(KEYS, BlobRef("blobs/ab/lora", "ab" * 32),
                         BlobRef("blobs/cd/opt", "cd" * 32), "base-id", train, moved, 0.03,
                         alarm, 5e-4)
    conform("checkpoints", [row])
    assert (row["update_kl_per_step"], row["update_velocity_rms"],
            row["update_velocity_per_step"]) == ([0.25, 0.75], 0.02, [0.01, 0.025])


def test_pick_advantage_per_kind():
    maps = torch.arange(2 * 3 * 3, dtype=torch.float32).view(2, 3, 3)  # [N, h, w]
    blob = {"maps": maps, "scalar": torch.tensor([0.5, -0.5]), "atom": torch.tensor([1.0, -2.0])}
    assert pick_advantage(blob, "spatial") == (maps, "spatial")
    scalar, kind = pick_advantage(blob, "scalar")
    assert kind == "scalar" and torch.equal(scalar, blob["scalar"])
    constant, kind = pick_advantage(blob, "atom")  # the no-map credit as a constant map
    assert kind == "spatial" and constant.shape == maps.shape
    assert torch.equal(constant, torch.tensor([1.0, -2.0])[:, None, None].expand(2, 3, 3))
    constant, kind = pick_advantage(blob, "scalar_map")  # the scalar advantage as a constant map
    assert kind == "spatial"
    assert torch.equal(constant, torch.tensor([0.5, -0.5])[:, None, None].expand(2, 3, 3))
    with pytest.raises(ValueError, match="'spatial', 'scalar', 'atom' or 'scalar_map'"):
        pick_advantage(blob, "map")


def test_iteration_step_weights_start_at_one_and_follow_the_last_per_step_kls():
    off = load_recipe(CI, {"train.kl_target_nats": 0.03})
    on = load_recipe(CI, {"train.kl_target_nats": 0.03, "train.kl_target_per_step": True})
    last = PolicyState(3, "h", "l", "o", 1e-4, 0.05, (0.01, 0.04, 0.16), (1.0, 1.0, 1.0))
    assert iteration_step_weights(off, last, 3) is None  # unweighted
    assert iteration_step_weights(on, PolicyState(0, "h", None, None), 3) == (1.0, 1.0, 1.0)
    got = iteration_step_weights(on, last, 3)
    assert got == pytest.approx(kl_step_weights((1.0,) * 3, (0.01, 0.04, 0.16), max_factor=2.0,
                                                floor=0.05))
    assert got[0] > got[1] > got[2]  # the step that moved least gets the most weight
    # no per-step KLs (an older checkpoint) or another window size: start again from 1
    assert iteration_step_weights(on, PolicyState(3, "h", "l", "o", 1e-4, 0.05), 3) == (1.0,) * 3
    assert iteration_step_weights(on, last, 2) == (1.0, 1.0)



def test_lr_halflife_halves_the_lr_aimed_at_every_halflife_iterations():
    """A constant lr decays by d = 0.5^(k / H); under a KL target the target falls by d^2 (a
    move's KL is quadratic in the lr) and the bounds by d, so a move at the target's lr gives
    the decayed lr; a velocity target falls by d (linear in the lr)."""
    lr, h = 1e-3, 10.0
    const = load_recipe(CI, {"train.lr": lr, "train.lr_halflife": h})
    assert iteration_lr(const, PolicyState(0, "h", None, None)) == lr
    assert iteration_lr(const, PolicyState(10, "h", "l", "o", lr)) == pytest.approx(lr / 2)
    assert iteration_lr(const, PolicyState(30, "h", "l", "o", lr)) == pytest.approx(lr / 8)
    assert iteration_lr(load_recipe(CI, {"train.lr": lr}),
                        PolicyState(30, "h", "l", "o", lr)) == lr  # no half-life: constant
    # KL: the last iteration (lr 2e-4) moved exactly the undecayed target; at k = H the target
    # is a quarter, so sqrt(1/4) halves the lr
    kl = load_recipe(CI, {"train.lr": lr, "train.kl_target_nats": 0.03, "train.lr_halflife": h})
    assert iteration_lr(kl, PolicyState(10, "h", "l", "o", 2e-4, 0.03)) == pytest.approx(1e-4)
    assert iteration_lr(kl, PolicyState(10, "h", "l", "o", 2e-4, 0.03)) == pytest.approx(
        kl_targeted_lr(2e-4, 0.03, 0.03 / 4, max_factor=2.0, lr_min=0.5e-4, lr_max=5e-3))
    # the floor decays with it: 0.1 lr at k = 0, 0.025 lr at k = 2H
    assert iteration_lr(kl, PolicyState(20, "h", "l", "o", 2e-5, 10.0)) == pytest.approx(2.5e-5)
    vel = load_recipe(CI, {"train.lr": lr, "train.kl_target_nats": None,
                           "train.velocity_target": 0.02, "train.lr_halflife": h})
    assert iteration_lr(vel, PolicyState(10, "h", "l", "o", 4e-4, 0.5, update_velocity_rms=0.02)
                        ) == pytest.approx(2e-4)
