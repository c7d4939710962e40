"""Stage `train_epoch`: one RL update of the LoRA policy on this iteration's rollouts.

Reads the policy the rollouts were sampled with (`policy_state.policy_for`) and its AdamW state,
the stored window steps, and the advantages the recipe selects ("spatial": the CAST maps on the
log-prob grid; "scalar": Flow-GRPO's per-sample advantage; "atom": the no-map credit as a constant
map on the spatial loss), runs `cast_core.policy.policy_update`
(inner epochs x `steps_per_epoch` optimizer steps, each accumulated over micro-batches of at most
`micro_batch` samples; clipped objective, optional KL to the adapter-free base, NaN/Inf guard that
skips and records a bad step), with the lr of each optimizer step set by a linear warm-up over the
first `warmup_steps` optimizer steps of the run (counted from the AdamW state's step, so across
iterations; `cast_core.policy.linear_warmup_lr`) applied to the iteration's lr (`iteration_lr`:
`train.lr`, or with `train.kl_target_nats` the previous iteration's lr scaled by how far that
iteration moved the policy, so that each iteration moves about the target). With `recast.weighting` "static" or "recast"
the loss takes one map per window step instead: the atom types' shares of CAST's map (`type_maps`)
weighted by `tasks.stages.recast_gains.reward_step_weights` (ReCAST: from this iteration's `gains`
stage) and clamped (`cast_core.advantage.step_weighted_maps`). It writes:
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
  in nats, replayed on up to 64 of the samples after the last step), the mean high-frequency
  energy of the rollout images, the constant-reward alarm, and the iteration's lr.
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
"""

from __future__ import annotations

import json
import logging

import pyarrow.compute as pc
import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from cast_core.advantage import step_weighted_maps
from cast_core.csg.graph import ATOM_TYPES
from cast_core.diagnostics import (
    RewardAlarm,
    constant_reward_alarm,
    high_frequency_energy,
    param_change_norm,
)
from cast_core.nft_update import NftConfig, NftStep, nft_update
from cast_core.policy import (
    PolicyConfig,
    UpdateStep,
    kl_targeted_lr,
    linear_warmup_lr,
    policy_update,
    update_kl_nats,
)
from cast_core.rollout import Rollout
from cast_core.window import SdeWindow
from tasks.stages.guard import stage_task
from tasks.stages.models import (
    base_hash,
    load_optimizer_state,
    lora_tensors,
    optimizer_tensors,
    set_threads,
)
from tasks.stages.policy_state import PolicyState, load_policy_of, policy_for
from tasks.stages.recast_gains import reward_step_weights
from tasks.stages.recipe import Recipe
from tasks.stages.rollout import rollout_spec
from tasks.stages.score_atoms import load_graphs, load_rollout_rows
from tasks.store.stage import StageRef, StageRefused, derive_seed, make_key, run_stage
from tasks.store.store import Store

STAGE = "train_epoch"


class NonFiniteWeights(StageRefused):
    """Training left a LoRA or optimizer tensor with inf or nan entries; nothing was saved."""


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
    moved the policy (`cast_core.policy.kl_targeted_lr`; `train.lr` at iteration 0, and for a
    previous checkpoint written before checkpoints had an lr)."""
    tr = recipe.train
    if tr.kl_target_nats is None or policy.iteration == 0:
        return tr.lr
    return kl_targeted_lr(tr.lr if policy.lr is None else policy.lr, policy.update_kl_nats,
                          tr.kl_target_nats, max_factor=tr.kl_lr_factor,
                          lr_min=tr.kl_lr_floor * tr.lr, lr_max=tr.kl_lr_ceiling * tr.lr)


def _optimizer(store: Store, recipe: Recipe, params, optimizer_path: str | None, lr: float):
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=recipe.train.weight_decay)
    if optimizer_path:
        with safe_open(str(store.resolve(optimizer_path)), framework="pt") as f:
            groups = f.metadata()["param_groups"]
        load_optimizer_state(optimizer, store.get_tensors(optimizer_path), groups)
        for group in optimizer.param_groups:
            group["lr"] = lr
    return optimizer


def _stage_seconds(store: Store, run_id: str, iteration: int) -> str:
    rows = store.read_table("stages", (pc.field("run_id") == run_id)
                            & (pc.field("iteration") == iteration)).to_pylist()
    return json.dumps({r["stage"]: round((r["finished_at"] - r["started_at"]).total_seconds(), 3)
                       for r in rows}, sort_keys=True)


def _iteration_stats(store: Store, scores: StageRef, advantages: StageRef,
                     std_floor: float) -> tuple[dict, RewardAlarm]:
    """(mean score per atom type and the zero-variance fraction, the constant-reward alarm)."""
    table = store.read_output(scores, "atom_scores",
                              ["prompt_id", "atom_id", "atom_type", "score"]).to_pylist()
    out = {}
    for kind in ATOM_TYPES:
        values = [r["score"] for r in table if r["atom_type"] == kind]
        out[f"reward_{kind}"] = sum(values) / len(values) if values else None
    adv = store.read_output(advantages, "advantages",
                            ["prompt_id", "atom_id", "zero_variance"]).to_pylist()
    groups = {(r["prompt_id"], r["atom_id"]): r["zero_variance"] for r in adv}
    out["zero_variance_fraction"] = sum(groups.values()) / max(1, len(groups))
    types = {(r["prompt_id"], r["atom_id"]): r["atom_type"] for r in table}
    by_type: dict[str, list[bool]] = {}
    for key, flag in sorted(groups.items()):
        by_type.setdefault(types[key], []).append(flag)
    rewards = store.read_output(advantages, "advantage_maps", ["reward"])["reward"].to_pylist()
    alarm = constant_reward_alarm({k: torch.tensor(v) for k, v in by_type.items()},
                                  torch.tensor(rewards, dtype=torch.float64), std_floor)
    return out, alarm


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


def pick_advantage(blob: dict[str, torch.Tensor], kind: str) -> tuple[torch.Tensor, str]:
    """(advantages, loss kind) for `advantage.kind`: "spatial" the maps [N, h, w], "scalar" the
    scalar advantages [N], "atom" the no-map credit [N] broadcast to a constant map [N, h, w]
    (the spatial loss, so the only difference from CAST is the map)."""
    if kind == "spatial":
        return blob["maps"], "spatial"
    if kind == "scalar":
        return blob["scalar"], "scalar"
    if kind == "atom":
        return blob["atom"][:, None, None].expand_as(blob["maps"]).contiguous(), "spatial"
    raise ValueError(f"advantage.kind must be 'spatial', 'scalar' or 'atom'; got {kind!r}")


def policy_config(recipe: Recipe, loss_kind: str) -> PolicyConfig:
    """The update's config from the recipe's `train` section, for the loss `pick_advantage` (or
    ReCAST's step maps) chose: "spatial" or "scalar"."""
    tr = recipe.train
    return PolicyConfig(advantage=loss_kind, clip_range=tr.clip_range, kl_beta=tr.kl_beta,
                        inner_epochs=tr.inner_epochs, steps_per_epoch=tr.steps_per_epoch,
                        micro_batch=tr.micro_batch, max_grad_norm=tr.max_grad_norm)


def cache_key(store: Store, recipe: Recipe, rollouts: StageRef, scores: StageRef,
              advantages: StageRef, iteration: int, gains: StageRef | None = None) -> str:
    policy = policy_for(store, recipe, iteration)
    return make_key(STAGE, {"train": recipe.section_hash("train", "advantage", "sampling",
                                                         "recast"),
                            "seed": recipe.run.seed, "iteration": iteration,
                            "lr": iteration_lr(recipe, policy)},
                    {"policy": policy.policy_hash, "optimizer": policy.optimizer_path or "",
                     "rollouts": rollouts.content_hash, "scores": scores.content_hash,
                     "advantages": advantages.content_hash,
                     "gains": gains.content_hash if gains is not None else ""})


def _advantages(store: Store, recipe: Recipe, blob: dict[str, torch.Tensor], window: SdeWindow,
                gains: StageRef | None) -> tuple[torch.Tensor, str, str | None]:
    """(advantages, loss kind, step weights as JSON or None): `pick_advantage`, or with
    `recast.weighting` the type maps weighted per window step ([N, K, h, w])."""
    weights = reward_step_weights(store, recipe, window.start, window.end, gains)  # [4, K]
    if weights is None:
        return *pick_advantage(blob, recipe.advantage.kind), None
    maps = step_weighted_maps(blob["type_maps"], weights, recipe.advantage.clip)
    text = json.dumps({k: [round(float(x), 6) for x in weights[i]]
                       for i, k in enumerate(ATOM_TYPES)})
    return maps, "spatial", text


def _load_rollout(store: Store, rows: list[dict],
                  device: torch.device) -> tuple[Rollout, SdeWindow, list[int]]:
    """The rows' window steps on the transformer's `device` (where the replay's velocities are),
    their window and their blob indices."""
    blob = {k: v.to(device) for k, v in store.get_tensors(rows[0]["latents_path"]).items()}
    index = [r["blob_index"] for r in rows]
    rollout = Rollout(x0=blob["x0"][index], latents=blob["latents"][index],
                      next_latents=blob["next_latents"][index],
                      log_probs=blob["log_probs"][index], t=blob["t"], t_next=blob["t_next"])
    return rollout, SdeWindow(rows[0]["window_start"], rows[0]["window_end"]), index


def train_epoch(store: Store, recipe: Recipe, csgs: StageRef, rollouts: StageRef,
                scores: StageRef, advantages: StageRef, iteration: int,
                gains: StageRef | None = None) -> StageRef:
    run_id, tr = recipe.run.name, recipe.train

    def body():
        set_threads(recipe)
        policy = policy_for(store, recipe, iteration)
        backbone, params = load_policy_of(store, recipe, policy)
        lr = iteration_lr(recipe, policy)
        optimizer = _optimizer(store, recipe, params, policy.optimizer_path, lr)
        steps_before = int(optimizer.state[params[0]]["step"]) if optimizer.state else 0
        rows = load_rollout_rows(store, rollouts)
        device = next(backbone.transformer.parameters()).device
        rollout, window, index = _load_rollout(store, rows, device)
        spec = rollout_spec(recipe, {"window_start": window.start, "window_end": window.end})
        texts = {pid: json.loads(g)["prompt"] for pid, g in load_graphs(store, csgs).items()}
        prompts = [texts[r["prompt_id"]] for r in rows]
        adv_blob = store.get_tensors(store.read_output(advantages, "advantage_maps",
                                                       ["map_path"])["map_path"][0].as_py())
        adv, loss_kind, weights_json = _advantages(store, recipe, adv_blob, window, gains)
        config = policy_config(recipe, loss_kind)
        total = tr.steps_per_epoch * tr.inner_epochs
        before = [p.detach().clone() for p in params]

        def lr_for_step(j: int) -> float:
            return linear_warmup_lr(lr, tr.warmup_steps, steps_before + j)

        with tqdm(total=total, desc=f"train {iteration}", unit="step", mininterval=1.0) as bar:
            def show(u) -> None:
                if u.skipped:
                    bar.set_postfix(loss="skipped")
                elif isinstance(u, NftStep):
                    bar.set_postfix(loss=f"{u.loss:.4f}", positive=f"{u.positive_share:.2f}")
                else:
                    bar.set_postfix(loss=f"{u.loss:.4f}", clip=f"{u.clip_fraction:.3f}",
                                    kl=f"{u.policy_kl_nats:.3g}")
                bar.update()

            if tr.objective == "nft":
                nft = nft_config(recipe)
                scale = nft_training_guidance(recipe)
                updates = nft_update(backbone, optimizer, prompts, rollout.x0, adv[index], nft,
                                     scale, derive_seed(recipe.run.seed, "nft", iteration),
                                     lr_for_step=lr_for_step, on_step=show)
            else:
                updates = policy_update(
                    backbone, optimizer, prompts, rollout, spec, adv[index], config,
                    shuffle_seed=derive_seed(recipe.run.seed, "shuffle", iteration),
                    on_step=show, lr_for_step=lr_for_step)
        opt_tensors, groups = optimizer_tensors(optimizer)
        _refuse_non_finite(lora_tensors(backbone), opt_tensors, updates, iteration, lr)
        moved = (update_kl_nats(backbone, prompts, rollout, spec, micro_batch=tr.micro_batch)
                 if recipe.sampling.noise_level > 0 else None)  # the ODE has no likelihoods
        first = updates[0]
        if getattr(first, "first_ratio_ok", None) is False:
            _logger().warning(
                "first inner step ratio is not 1: ratio_mean=%.6f ratio_std=%.6f (tolerance "
                "%.0e); rollout and replay disagree (dropout, precision, CFG or changed weights)",
                first.ratio_mean, first.ratio_std, config.ratio_tol)
        stats, alarm = _iteration_stats(store, scores, advantages, recipe.advantage.std_floor)
        if alarm.alarm:
            _logger().warning("constant-reward alarm at iteration %d: %s", iteration, alarm.reason)
        images = store.get_tensors(rows[0]["image_path"])["images"][index]  # uint8 [N, 3, H, W]
        seconds = _stage_seconds(store, run_id, iteration)
        mass = float(adv[index].abs().mean())
        step_rows = [{"run_id": run_id, "iteration": iteration, "step": steps_before + j,
                      **(_nft_step_row(u, nft, mass) if tr.objective == "nft" else _step_row(u)),
                      **stats, "stage_seconds_json": seconds,
                      "reward_step_weights_json": weights_json}
                     for j, u in enumerate(updates)]
        lora_blob = store.put_tensors(lora_tensors(backbone))
        opt_blob = store.put_tensors(opt_tensors, metadata={"param_groups": groups})
        optimizer_steps = int(optimizer.state[params[0]]["step"]) if optimizer.state else 0
        part = f"{run_id}-{iteration:05d}"
        checkpoint = {"run_id": run_id, "iteration": iteration, "policy_hash": lora_blob.sha256,
                      "lora_path": lora_blob.path, "optimizer_path": opt_blob.path,
                      "optimizer_hash": opt_blob.sha256, "base_hash": base_hash(recipe),
                      "lora_rank": tr.lora_rank, "lora_alpha": tr.lora_alpha,
                      "optimizer_steps": optimizer_steps,
                      "param_change_norm": param_change_norm(before, params),
                      "update_kl_nats": moved,
                      "rollout_hf_energy": float(high_frequency_energy(images / 255.0).mean()),
                      "constant_reward_alarm": alarm.alarm, "alarm_reason": alarm.reason,
                      "lr": lr}
        return [store.write_table("train_steps", step_rows, part), lora_blob, opt_blob,
                store.write_table("checkpoints", [checkpoint], part)]

    key = cache_key(store, recipe, rollouts, scores, advantages, iteration, gains)
    return run_stage(store, run_id, iteration, STAGE, key, body)


train_epoch_task = stage_task(train_epoch, STAGE, cache_key)
