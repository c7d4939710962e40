"""The method's sections of a recipe (`tasks.stages.recipe.Recipe`): `window`, `advantage`,
`train` and `recast`, where the arms of a comparison differ (the other sections, which say what
is generated and scored, are in `tasks.stages.recipe_sections`). Same rules: each field typed,
bounded and documented where it is declared, unknown fields refused, a section's own
consistency checked by its validator.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from cast_core.csg.graph import ATOM_TYPES, AtomType
from tasks.stages.recipe_sections import Section


class WindowSection(Section):
    mode: Literal["calibrated", "fixed"]
    size: int = Field(ge=1)
    start: int = Field(0, ge=0, description="first window step (mode = 'fixed' only)")
    calibration_prompts: int = Field(16, ge=1)
    calibration_file: str | None = None
    method: Literal["curvature", "threshold"] = "curvature"
    threshold: float = Field(0.9, gt=0.0, lt=1.0)
    embedder: Literal["layout", "clip"] | None = Field(
        None, description="image embedder of the calibration (None: 'layout' for the shapes "
        "family, 'clip' otherwise)")
    embedder_path: str | None = Field(None, description="clip: folder or hub id (None: "
                                      "openai/clip-vit-large-patch14)")


class AdvantageSection(Section):
    """How rollouts are credited. `kind`: "spatial" (CAST: per-atom group z-scores, gated by
    parents, projected through the scorer's heatmaps into a pixel map pooled onto the log-prob
    grid), "scalar" (Flow-GRPO: one `reward` per sample, z-scored by `scalar_mode`), or "atom"
    (ablation: CAST's gated atom z-scores without the pixel projection; each sample's map is the
    constant mean of its atoms' advantages, clamped to `clip`, trained through the spatial loss),
    or "scalar_map" (ablation: Flow-GRPO's scalar advantage as a constant map through the spatial
    loss, so the only difference from "scalar" is the per-position ratio and its clip).
    `gate_by_parents`, `global_weight` and `clip` shape the atom kinds; `reward` and
    `scalar_mode` the scalar one; `std_floor` bounds every group std; `heatmap_norm` "mass"
    (each heatmap rescaled to mean 1, the paper's) or "peak" (to peak 1; `cast_core.pixel_map`);
    `atom_norm` "atom" (per-atom z-score, the paper's) or "pooled" (each atom's deviation over
    the prompt's pooled atom spread, so nearly decided atoms get nearly no credit and the mean
    over atoms is Flow-GRPO's advantage up to a per-prompt factor); `spatial_mix` in [0, 1]: the
    share of each atom's credit projected through its heatmap, the rest spread uniformly (1 =
    the paper's map, 0 = no projection); `heatmap_source` "own" (each sample's credit through
    its own heatmaps, the paper's) or "group_others" (through the mean of the other samples' of its
    group, which do not depend on the sample's own actions; `cast_core.pixel_map`, issue 17);
    `gate_on` "credit" (a gated child's advantage set to 0) or "score" (its score set to 0
    before the z-score, DSG's rule, so a missing object ranks below every way of drawing it;
    `cast_core.advantage.gate_scores`); `credit_norm` "none" (the paper's) or "group" (after gating, each sample's atom credits
    shifted and scaled so that its mean atom credit is the group z-score of those means, as
    Flow-GRPO's advantage is of the reward: gating otherwise leaves a group's credits summing to
    more than 0; `cast_core.advantage.group_normalise_credit`); `scalar_steps` (kinds "spatial"
    and "atom", the SDE objective): the window's first `scalar_steps` steps take Flow-GRPO's
    scalar advantage as a constant map instead of the kind's map (0, the default: every step the
    kind's; `cast_core.pixel_map.split_step_maps`), e.g. 3 in a window of 6: Flow-GRPO's credit on
    the early steps that decide the layout, CAST's map on the later ones (issue 17)."""

    hash_if_set: ClassVar[tuple[str, ...]] = ("heatmap_norm", "atom_norm", "spatial_mix",
                                              "heatmap_source", "credit_norm", "gate_on",
                                              "scalar_steps")

    kind: Literal["spatial", "scalar", "atom", "scalar_map"]
    gate_by_parents: bool = True
    global_weight: float = Field(1.0, ge=0.0)
    clip: float = Field(5.0, gt=0.0)
    reward: Literal["mean", "geometric"] = "mean"
    scalar_mode: Literal["group", "global_std"] = "group"
    std_floor: float = Field(1e-4, gt=0.0)
    heatmap_norm: Literal["mass", "peak"] = "mass"
    atom_norm: Literal["atom", "pooled"] = "atom"
    spatial_mix: float = Field(1.0, ge=0.0, le=1.0)
    heatmap_source: Literal["own", "group_others"] = "own"
    credit_norm: Literal["none", "group"] = "none"
    gate_on: Literal["credit", "score"] = "credit"
    scalar_steps: int = Field(0, ge=0)


class TrainSection(Section):
    """The LoRA update (`cast_core.policy`). Each of the `inner_epochs` passes over the
    iteration's B * G samples takes `steps_per_epoch` optimizer steps, each on an equal share of
    the (shuffled) samples, its gradient accumulated over micro-batches of at most `micro_batch`
    samples (memory only: the gradient is that of the share's mean loss whatever the micro-batch).
    `warmup_steps`: the lr rises linearly over the run's first optimizer steps, lr * (j + 1) /
    warmup_steps at step j (0 = constant lr). `kl_beta` weights the all-dims mean KL to the base
    model (Flow-GRPO's convention: the summed KL per sample and step divided by D = C h w).
    `steps_per_epoch` and `warmup_steps` are hashed always, not `hash_if_set`: what a micro-batch
    means changed with them (it used to be one optimizer step), so an older cached training must
    not be reused.

    `objective`: "sde" (the clipped policy objectives on the SDE window's log-probs,
    `cast_core.policy`) or "nft" (the forward-process loss on the rollouts' clean samples,
    `cast_core.nft_update`; rollouts may then use the ODE sampler, `sampling.noise_level = 0`, and
    `clip_range` and `kl_beta` are not used). The `nft_*` fields, with their sources:
    `nft_beta` the implicit policies' step (DiffusionNFT's loss form; 1 is our default, at which
    an all-positive batch is plain flow matching); `nft_t_min`/`nft_t_max` the uniform range of
    the forward-noise t (ours: keeps away from the endpoints); `nft_a_max` the |advantage| at which
    the optimality r = 1/2 + 1/2 clip(A / a_max, -1, 1) reaches 0 or 1 (DiffusionNFT's normalised
    reward form; 2 group SDs is ours); `nft_adaptive_weight` each sample's loss over the old
    policy's own error at its t (DiffusionNFT's adaptive weighting, in our form
    `nft.adaptive_weight`); `nft_centre` group-centres the credit (ours: measured necessary for
    CAST's map, whose credits lean positive); `nft_guidance` "none" (the default) trains the
    conditional velocity alone (DiffusionNFT's CFG-free training), "sampler" the guided one at
    the sampler's CFG scale (ours, the first default: fitting the guided velocity to images undoes
    what guidance adds, measured in reports/learning-probes section 6: supervised fine-tuning on
    exact renders through it took the CFG-4 probe from 0.614 to 0.468, the CFG-1 level, in 512
    renders; through the conditional velocity it stayed at 0.594-0.643). The old policy is the one that sampled the iteration (a hard update each
    iteration).

    `kl_target_nats` (ours; None = the constant `lr`): a KL-targeted lr, so that every objective
    moves the policy the same distance an iteration. Iteration 0 runs at `lr`; iteration k at the
    previous iteration's lr times sqrt(kl_target_nats / its `update_kl_nats`) (a small move's KL
    is quadratic in the lr), the factor clamped to [1 / kl_lr_factor, kl_lr_factor] and the lr to
    [kl_lr_floor, kl_lr_ceiling] x lr (`cast_core.lr_schedule.kl_targeted_lr`; the warm-up
    multiplies it as usual).
    Why: at a constant lr the objectives move different distances (Flow-GRPO 0.010 nats an
    iteration at lr 4e-4 on the shapes pool; CAST's map more), and at lr 1e-3 Flow-GRPO's move
    grew from 0.03-0.06 nats in its first 13 iterations to 0.1-0.6 after, where its images broke
    (reports/learning-probes section 7). SDE objective only: the ODE rollouts of NFT have no
    likelihood to measure the move with.

    `kl_target_per_step` (ours; with `kl_target_nats`): the KL target met by every window step on
    its own, not by the window's mean. A later step has a smaller noise std, so one lr moves it
    by more nats; on the 6-step window [0, 6) the late steps moved 3-10x what the early ones did,
    the mean's target therefore ran the early steps at about 0.6x the lr they get on [0, 3)
    (reports/cfg1-pool8-rank32-constlr-wide). With it each step's loss is weighted by its own
    controller (`cast_core.lr_schedule.kl_step_weights`: x sqrt(the steps' geometric-mean KL /
    its KL) an iteration, within the lr's factor, renormalised to mean 1 and floored at
    `kl_step_weight_floor`), and the lr's target then acts on KLs the steps share.
    Measured (reports/cfg1-pool8-rank32-klstep, 3 seeds): it does not work, so it stays off. The
    steps share the LoRA, so a uniform change of the velocity moves a later step by more nats
    whatever its weight (1 : 1.7 : 3.9 ... over the schedule), and the controller puts every
    weight but the first at the floor. Step 0's gradient alone did not learn: Flow-GRPO on
    [0, 3) lost its whole gain (-0.075 [-0.093, -0.056] on the pool against the window-mean
    target).

    `velocity_target` (ours; instead of `kl_target_nats`): the same controller on the change of
    the velocity the update's KL implies, an RMS per latent dim over the window
    (`cast_core.update_kl.velocity_change`): iteration k runs at the previous lr times
    velocity_target / its `update_velocity_rms` (the velocity change is about linear in the lr),
    clamped alike. The KL of one velocity change grows down the schedule and as the noise level
    falls (Flow-SDE a = 0.7, 10 steps: 1 : 1.7 : 3.9 : 6.6 : 10 : 16 : 23 : 36 : 62 : 140 over
    the steps; steps 0-2 at a = 0.2: 8.8x a = 0.7's), so a KL target gives a wide or late window,
    or a lower noise, a smaller velocity step than Flow-GRPO's [0, 3) at a = 0.7; a velocity
    target gives every window and noise level the same one. About 0.0165 is what the KL target
    0.03 gave Flow-GRPO on [0, 3) at a = 0.7: its first update changed the three steps'
    velocities 1 : 2.7 : 6.6 (RMS 0.085 at 0.79 nats; reports/cfg1-pool8-rank32-klstep's store).
    Measured (reports/cfg1-pool8-rank32-velocity, 3 seeds): it gives the split window [0, 6)
    Flow-GRPO's lr, but the split still does not beat Flow-GRPO (hard +0.006 [-0.095, +0.107]),
    and Flow-GRPO gains no more than under the KL target (pool -0.026 [-0.090, +0.037]): off.

    `lr_halflife` (ours; None = no decay): the lr aimed at halves every that many iterations
    (`cast_core.lr_schedule.halflife_factor`): a constant lr by the factor d = 0.5^(k / half-
    life), the velocity target by d, the KL target by d^2 (a move's KL is quadratic in the lr),
    and the controller's bounds by d. Why: on the shapes pool Flow-GRPO's training reward and
    probe stop rising after about 30 iterations at a constant step, and the policy then does a
    random walk in function space (reports/cfg1-pool8-rank32-80it); a step that shrinks should
    let it settle. Measured (reports/cfg1-pool8-rank32-hl20, 3 seeds): a half-life of 20 gains
    less within 40 iterations (pool -0.010 [-0.030, +0.009], probe over the last 10 iterations
    -0.034 [-0.068, -0.001] against the constant step): unset.

    `map_ratio` (ours; spatial credit only): "position" gives each position its own PPO ratio
    (CAST's), "sample" puts the map inside the sample's all-dims ratio, so that a constant map is
    exactly Flow-GRPO's loss; the per-position ratio's second-order term pushes positive-credit
    positions away from the rollout policy after the first optimizer step of an iteration
    (`cast_core.loss.sample_ratio_spatial_loss`)."""

    unpinned: ClassVar[tuple[str, ...]] = ("micro_batch",)
    hash_if_set: ClassVar[tuple[str, ...]] = (
        "objective", "nft_beta", "nft_t_min", "nft_t_max", "nft_a_max", "nft_adaptive_weight",
        "nft_centre", "nft_guidance", "kl_target_nats", "kl_lr_factor", "kl_lr_floor",
        "kl_lr_ceiling", "map_ratio", "kl_target_per_step", "kl_step_weight_floor",
        "velocity_target", "lr_halflife")

    lr: float = Field(gt=0.0)
    lora_rank: int = Field(ge=1)
    lora_alpha: float = Field(gt=0.0)
    clip_range: float = Field(gt=0.0)
    kl_beta: float = Field(0.0, ge=0.0)
    inner_epochs: int = Field(1, ge=1)
    steps_per_epoch: int = Field(1, ge=1, description="optimizer steps per pass over the samples")
    micro_batch: int = Field(8, ge=1, description="most samples in one forward/backward")
    warmup_steps: int = Field(0, ge=0, description="linear lr warm-up, in optimizer steps")
    max_grad_norm: float = Field(1.0, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    objective: Literal["sde", "nft"] = "sde"
    nft_beta: float = Field(1.0, gt=0.0)
    nft_t_min: float = Field(0.02, gt=0.0, lt=1.0)
    nft_t_max: float = Field(0.98, gt=0.0, lt=1.0)
    nft_a_max: float = Field(2.0, gt=0.0)
    nft_adaptive_weight: bool = True
    nft_centre: bool = True
    nft_guidance: Literal["sampler", "none"] = "none"
    kl_target_nats: float | None = Field(
        None, gt=0.0, description="per iteration: each iteration's lr set so that the update "
        "moves the policy this far (KL per sample and window step, nats); None: constant lr")
    kl_lr_factor: float = Field(2.0, gt=1.0, description="most the lr changes per iteration")
    kl_lr_floor: float = Field(0.1, gt=0.0, le=1.0,
                               description="the targeted lr stays >= this multiple of lr")
    kl_lr_ceiling: float = Field(10.0, ge=1.0,
                                 description="the targeted lr stays <= this multiple of lr")
    kl_target_per_step: bool = Field(
        False, description="with kl_target_nats: weight each window step's loss so that every "
        "step moves about the same KL (cast_core.lr_schedule.kl_step_weights), so the late "
        "steps of a wide window no longer set the lr of the early ones")
    kl_step_weight_floor: float = Field(0.05, gt=0.0, le=1.0,
                                        description="no window step's loss weight goes below this")
    velocity_target: float | None = Field(
        None, gt=0.0, description="instead of kl_target_nats: each iteration's lr set so that the "
        "update changes the window's velocity by this RMS per latent dim (the KL it moved, "
        "converted through each step's sampler gain: cast_core.update_kl.velocity_change)")
    lr_halflife: float | None = Field(
        None, gt=0.0, description="iterations: the lr aimed at (constant, or the KL or velocity "
        "controller's) halves every this many iterations; None: no decay")
    map_ratio: Literal["position", "sample"] = Field(
        "position", description="spatial credit: a PPO ratio per position (CAST's) or the map "
        "inside the sample's all-dims ratio (cast_core.loss.sample_ratio_spatial_loss; then "
        "clip_range is the all-dims range)")

    @model_validator(mode="after")
    def _t_range(self) -> TrainSection:
        if not self.nft_t_min < self.nft_t_max:
            raise ValueError(f"train.nft_t_min ({self.nft_t_min}) must be below train.nft_t_max "
                             f"({self.nft_t_max})")
        return self


class RecastSection(Section):
    """Per-reward step weights on CAST's map (ReCAST; rewards = the atom types). `weighting`:
    "none" (CAST's map as is), "static" (type k's share of the map weighted by
    lambda_k / mean(lambda) at every window step), "recast" (by K W[k, t] / mean(lambda), W the
    Sinkhorn plan of the per-step discriminability gains over the window, re-estimated from fresh
    policy samples every `every` iterations; shapes family only: positives come from the
    renderer). `budgets` lambda_k maps atom types to relative weights > 0 (a type left out gets
    weight 0; None = the four types equally). The rest configure the gain estimate
    (`tasks.stages.recast_gains.RecastConfig`): `prompts` x `samples_per_prompt` samples a side,
    Renyi order `alpha`, kernel temperature `tau`, `variance_floor`. `positives` is where the
    positive samples come from: "renderer" (shapes family: exact scenes of the training prompts)
    or a folder of images from a stronger generator in GenEval's output layout
    (`<folder>/<NNNNN>/metadata.jsonl` + `<folder>/<NNNNN>/samples/*.png`; any family)."""

    weighting: Literal["none", "static", "recast"] = "none"
    budgets: dict[AtomType, float] | None = None
    every: int = Field(1, ge=1, description="re-estimate W every N iterations")
    prompts: int = Field(16, ge=1)
    samples_per_prompt: int = Field(2, ge=1)
    alpha: float = Field(0.5, gt=0.0, lt=1.0)
    tau: float = Field(1.0, gt=0.0)
    variance_floor: float = Field(1e-4, gt=0.0)
    positives: str = Field("renderer", min_length=1,
                           description='"renderer" or a GenEval-layout folder of images')

    @model_validator(mode="after")
    def _budgets(self) -> RecastSection:
        if self.budgets is not None:
            bad = {k: v for k, v in self.budgets.items() if not (0.0 < v < float("inf"))}
            if not self.budgets or bad:
                raise ValueError(f"budgets must give at least one atom type a finite value > 0 "
                                 f"(leave a type out to drop it); bad: {bad or 'empty'}")
        return self

    def budget_map(self) -> dict[str, float]:
        """{atom type: lambda_k} in type order (None: each of the four types at 1)."""
        if self.budgets is None:
            return dict.fromkeys(ATOM_TYPES, 1.0)
        return {k: float(self.budgets[k]) for k in ATOM_TYPES if k in self.budgets}
