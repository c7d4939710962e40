"""The sections of a recipe (`tasks.stages.recipe.Recipe`), one frozen pydantic model per TOML
table: here `run`, `backbone`, `scorer`, `builder`, `prompts`, `sampling`, `eval` and `ray`, what
is generated and scored; the method's `window`, `advantage`, `train` and `recast` are in
`tasks.stages.recipe_method`. Each field is typed, bounded and documented where it is declared;
an unknown field or a value outside the allowed set raises (`extra = "forbid"`, `Literal`
choices), and a section's own consistency (e.g. a soft-tifa scorer needs a path) is checked by
its validator. What spans sections (the window fits the sampler's steps, the objective suits the
sampler) is checked by `Recipe` itself.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


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
