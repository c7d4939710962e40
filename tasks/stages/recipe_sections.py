"""The sections of a recipe (`tasks.stages.recipe.Recipe`), one frozen pydantic model per TOML
table: `run`, `backbone`, `scorer`, `builder`, `prompts`, `sampling`, `window`, `advantage`,
`train`, `eval`, `recast` and `ray`. Each field is typed, bounded and documented where it is declared;
an unknown field or a value outside the allowed set raises (`extra = "forbid"`, `Literal`
choices), and a section's own consistency (e.g. a soft-tifa scorer needs a path) is checked by
its validator. What spans sections (the window fits the sampler's steps, the objective suits the
sampler) is checked by `Recipe` itself.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cast_core.csg.graph import ATOM_TYPES, AtomType


class Section(BaseModel):
    """`hash_if_set`: fields added after stores existed; `section_hash` and `pinned` leave them
    out while they hold their default, so adding one does not invalidate every cached stage or
    pinned run. `unpinned`: fields that say where or how fast, not what (threads, devices,
    caches, timeouts, memory-only batch sizes), which a run may change between iterations
    (`Recipe.pinned`). Floats must be finite (`allow_inf_nan=False`): `train.lr = inf` used to
    pass `gt=0` and train a NaN LoRA."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    hash_if_set: ClassVar[tuple[str, ...]] = ()
    unpinned: ClassVar[tuple[str, ...]] = ()


class RunSection(Section):
    """`executor`: where the stages compute. "local" (the default): each stage in the flow's
    process, loading the models it needs. "ray": on resident Ray actors (`[ray]` section,
    `tasks.stages.ray_workers`), which keep the backbone and scorer loaded across stages and
    iterations; the rows are the same either way."""

    unpinned: ClassVar[tuple[str, ...]] = ("threads", "executor")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="the run id")
    seed: int = Field(0, ge=0)
    threads: int | None = Field(None, ge=1, description="torch threads; None = torch's default")
    executor: Literal["local", "ray"] = "local"


class BackboneSection(Section):
    """The model being trained. `path` is a local folder or a hub id; the real families (`flux2`:
    FLUX.2-dev / FLUX.2-klein, `qwen_image`: Qwen-Image / Qwen-Image-2512) read the image size,
    dtype and text settings below; `shapes` takes its size from its own folder."""

    unpinned: ClassVar[tuple[str, ...]] = ("device", "embedding_cache", "gradient_checkpointing")

    family: Literal["shapes", "flux2", "qwen_image"]
    path: str
    device: str = Field("cpu", description="torch device of the transformer, e.g. 'cuda'")
    dtype: Literal["float32", "bfloat16"] = "float32"
    height: int | None = Field(None, ge=16, description="image height (real families)")
    width: int | None = Field(None, ge=16, description="image width (real families)")
    max_sequence_length: int = Field(512, ge=1, le=1024)
    text_encoder_out_layers: tuple[int, ...] | None = Field(
        None, description="flux2: hidden-state layers stacked as prompt embeddings (None: the "
        "variant's default)")
    prompt_template_encode_start_idx: int = Field(
        34, ge=0, description="qwen_image: token length of the prompt template's prefix")
    embedding_cache: str | None = Field(
        None, description="folder for cached prompt embeddings (safetensors); None = no cache")
    gradient_checkpointing: bool = False

    @model_validator(mode="after")
    def _family_fields(self) -> BackboneSection:
        if self.family == "shapes":
            given = [f for f in ("height", "width") if getattr(self, f) is not None]
            if given or self.dtype != "float32":
                raise ValueError(f"backbone.family = 'shapes' takes its size and dtype from its "
                                 f"folder; remove {given or ['dtype']}")
        elif self.height is None or self.width is None:
            raise ValueError(f"backbone.family = {self.family!r} needs backbone.height and "
                             f"backbone.width (e.g. 1024 and 1024)")
        return self


class ScorerSection(Section):
    """Who scores atoms: the embedded exact verifier, Soft-TIFA on a local Qwen3-VL (`path`), or a
    scorer service (`url`, see `cast serve-scorer`)."""

    unpinned: ClassVar[tuple[str, ...]] = ("device", "url", "timeout_s", "retries")

    kind: Literal["shapes-verifier", "soft-tifa", "remote"]
    path: str | None = Field(None, description="soft-tifa: Qwen3-VL folder or hub id")
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"
    layers: tuple[int, ...] | None = Field(None, description="soft-tifa: attention layers for "
                                           "heatmaps (None: the middle-to-late half)")
    relative_attention: bool = False
    max_pixels: int | None = Field(262144, ge=784)
    url: str | None = Field(None, description="remote: http://host:port of the scorer service")
    timeout_s: float = Field(300.0, gt=0.0)
    retries: int = Field(3, ge=0)

    @model_validator(mode="after")
    def _kind_fields(self) -> ScorerSection:
        if self.kind == "soft-tifa" and not self.path:
            raise ValueError("scorer.kind = 'soft-tifa' needs scorer.path (a Qwen3-VL folder or "
                             "hub id, e.g. 'Qwen/Qwen3-VL-8B-Instruct')")
        if self.kind == "remote" and not self.url:
            raise ValueError("scorer.kind = 'remote' needs scorer.url (e.g. http://host:8765)")
        return self


class BuilderSection(Section):
    """Who turns prompts into scene graphs: the GenEval-grammar parser, an LLM behind an
    OpenAI-compatible endpoint (`base_url`, `model`), or a local causal LM (`model` = folder).
    `allow_metadata_only`: the GenEval parser builds a record whose text it cannot read from its
    `include` metadata alone, instead of refusing the prompt file (`tasks.stages.prompt_sets`)."""

    hash_if_set: ClassVar[tuple[str, ...]] = ("allow_metadata_only",)
    unpinned: ClassVar[tuple[str, ...]] = ("device", "api_key_env", "timeout_s", "cache_dir")

    kind: Literal["geneval-parser", "llm-chat", "llm-local"]
    base_url: str | None = Field(None, description="llm-chat: e.g. http://localhost:8000/v1")
    model: str | None = Field(None, description="llm-chat: served model id; llm-local: folder")
    api_key_env: str | None = Field(None, description="llm-chat: env variable with the API key")
    max_tries: int = Field(3, ge=1)
    max_tokens: int = Field(1024, ge=16)
    timeout_s: float = Field(120.0, gt=0.0)
    device: str = "cpu"
    cache_dir: str = Field("runs/cache/csg_llm", description="accepted LLM answers, one JSON file "
                           "per (prompt, model, template version)")
    allow_metadata_only: bool = False

    @model_validator(mode="after")
    def _kind_fields(self) -> BuilderSection:
        if self.kind == "llm-chat" and not (self.base_url and self.model):
            raise ValueError("builder.kind = 'llm-chat' needs builder.base_url and builder.model")
        if self.kind == "llm-local" and not self.model:
            raise ValueError("builder.kind = 'llm-local' needs builder.model (a model folder)")
        return self


class PromptsSection(Section):
    """`selection`: how an iteration's B prompts are chosen from the `train` file
    (`tasks.stages.rollout.select_prompts`): "tag_balanced" and "uniform" draw them at random,
    "cycle" walks the file in order, B at a time, so a small fixed pool is visited evenly."""

    train: str
    per_iteration: int = Field(ge=1, description="prompts B per iteration")
    group_size: int = Field(ge=2, description="samples G per prompt")
    selection: Literal["tag_balanced", "uniform", "cycle"] = "tag_balanced"


class SamplingSection(Section):
    """`shared_noise`: the G samples of a prompt start from one initial noise (seeded per prompt
    and iteration) and differ only by their SDE window noise, so a group's advantages measure what
    the window's actions did, not which starting noise a sample drew (a per-state baseline: the
    policy gradient stays unbiased, its variance falls). `noise_block` b: the window noise is
    constant on b x b tiles of the latent grid (`cast_core.sde`'s block noise: the tile means
    keep the isotropic SDE's law, the rest of each step is the Euler step); the policy's actions
    are the C h w / b^2 tile means, log-probs and advantage maps live on the tile grid; 1 is the
    isotropic SDE of Flow-GRPO."""

    hash_if_set: ClassVar[tuple[str, ...]] = ("shared_noise", "noise_block")
    unpinned: ClassVar[tuple[str, ...]] = ("chunk_size",)

    num_steps: int = Field(ge=2)
    guidance_scale: float = Field(ge=1.0)
    noise_level: float = Field(ge=0.0, description="0: the ODE sampler (train.objective nft)")
    sde_kind: Literal["flow_sde", "cps"] = "flow_sde"
    chunk_size: int = Field(64, ge=1)
    shared_noise: bool = False
    noise_block: int = Field(1, ge=1, description="SDE noise constant on b x b latent tiles")


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
    more than 0; `cast_core.advantage.group_normalise_credit`)."""

    hash_if_set: ClassVar[tuple[str, ...]] = ("heatmap_norm", "atom_norm", "spatial_mix",
                                              "heatmap_source", "credit_norm", "gate_on")

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

    `map_ratio` (ours; spatial credit only): "position" gives each position its own PPO ratio
    (CAST's), "sample" puts the map inside the sample's all-dims ratio, so that a constant map is
    exactly Flow-GRPO's loss; the per-position ratio's second-order term pushes positive-credit
    positions away from the rollout policy after the first optimizer step of an iteration
    (`cast_core.loss.sample_ratio_spatial_loss`)."""

    unpinned: ClassVar[tuple[str, ...]] = ("micro_batch",)
    hash_if_set: ClassVar[tuple[str, ...]] = (
        "objective", "nft_beta", "nft_t_min", "nft_t_max", "nft_a_max", "nft_adaptive_weight",
        "nft_centre", "nft_guidance", "kl_target_nats", "kl_lr_factor", "kl_lr_floor",
        "kl_lr_ceiling", "map_ratio")

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


class EvalSection(Section):
    """Image i of a prompt starts from the noise seeded by (prompt text, `seed_offset` + i)
    (`tasks.stages.evaluate.content_seed`): two evaluations with disjoint index ranges see fresh
    noise on the same prompts, and equal ones the same noise."""

    hash_if_set: ClassVar[tuple[str, ...]] = ("seed_offset",)

    splits: dict[str, str]
    images_per_prompt: int = Field(4, ge=1)
    num_steps: int = Field(10, ge=1)
    guidance_scale: float = Field(4.0, ge=1.0)
    max_prompts: int | None = Field(None, ge=1, description="first N prompts of each split")
    seed_offset: int = Field(0, ge=0, description="first image index of each prompt's seeds")


class RaySection(Section):
    """The Ray executor (`run.executor = "ray"`; read by nothing else). `address`: "" starts a
    local cluster in the flow's process, anything else is passed to `ray.init` (e.g. "auto" or
    "ray://head:10001") to join a running one. `rollout_workers` resident policy actors split each
    rollout's prompt groups between them; the first `train_workers` of them train, data-parallel
    when more than one (a torch.distributed group: gloo on CPU, NCCL on GPU, with a GPU per rank;
    either `train.objective`, each rank reading only its samples' window steps).
    `scorer_workers` resident scorer actors split the samples to score. `num_gpus` / `num_cpus`: what each policy actor reserves,
    `scorer_num_gpus` / `scorer_num_cpus` each scorer actor (fractions share a device). Nothing
    here changes a result, so the whole section is unpinned."""

    address: str = Field("", description='"" starts a local cluster; else ray.init(address)')
    rollout_workers: int = Field(2, ge=1, description="policy actors that roll out")
    train_workers: int = Field(1, ge=1, description="policy actors that train (first ones)")
    scorer_workers: int = Field(1, ge=1, description="scorer actors")
    num_gpus: float = Field(0.0, ge=0.0, description="GPUs per policy actor")
    num_cpus: float = Field(1.0, gt=0.0, description="CPUs per policy actor")
    scorer_num_gpus: float = Field(0.0, ge=0.0, description="GPUs per scorer actor")
    scorer_num_cpus: float = Field(1.0, gt=0.0, description="CPUs per scorer actor")

    @model_validator(mode="after")
    def _workers(self) -> RaySection:
        if self.train_workers > self.rollout_workers:
            raise ValueError(f"ray.train_workers ({self.train_workers}) exceeds "
                             f"ray.rollout_workers ({self.rollout_workers}): training runs on "
                             f"the first policy actors, so set train_workers <= rollout_workers")
        return self
