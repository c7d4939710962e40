"""Recipes: the typed, validated description of one CAST (or Flow-GRPO) run, read from TOML.

A recipe names the backbone, scorer and CSG builder, the prompt set, the sampler, how the SDE
window is chosen, how advantages are formed and how the LoRA policy is trained. The algorithm is a
recipe switch, on the same data and code:

    advantage.kind = "spatial"  CAST: per-atom z-scores projected through heatmaps (pixel maps)
    advantage.kind = "scalar"   Flow-GRPO: one reward per sample (mean or geometric mean of atoms)
    advantage.kind = "atom"     ablation: CAST's atom z-scores as one constant map (no heatmaps)
    advantage.kind = "scalar_map"  ablation: Flow-GRPO's scalar advantage through the spatial loss
    window.mode = "calibrated"  the window ends at the backbone's structure-formation step
    window.mode = "fixed"       the window is [window.start, window.start + window.size)

Every section and field is checked (pydantic, `extra = "forbid"`): an unknown or missing field, a
value outside the allowed set, or a float that is not finite (inf or nan, in any field), raises
`RecipeError` naming the file, the field and what is allowed. `Recipe.derived()` gives the
quantities the pipeline computes from the recipe; the flows print them at start. `Recipe.pinned()`
gives the fields that change a run's results, to which a run is pinned (`tasks.store.run_pin`).

The sections and their fields are declared in `tasks.stages.recipe_sections` and (the method's:
window, advantage, train, recast) `tasks.stages.recipe_method`; this module holds the whole recipe
(the checks across sections, the hashes, the pin, the derived quantities) and reading one from
TOML with command-line overrides.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ValidationError, model_validator

from tasks.stages.recipe_method import (
    AdvantageSection,
    RecastSection,
    TrainSection,
    WindowSection,
)
from tasks.stages.recipe_sections import (
    BackboneSection,
    BuilderSection,
    EvalSection,
    PromptsSection,
    RaySection,
    RunSection,
    SamplingSection,
    ScorerSection,
    Section,
)


class RecipeError(ValueError):
    """A recipe file that cannot be read or does not validate; the message names the field."""


class Recipe(Section):
    """`unpinned_sections`: sections that change no training result (evaluations are keyed by
    their own spec hash; `ray` says only where stages compute), left out of `pinned` whole."""

    unpinned_sections: ClassVar[tuple[str, ...]] = ("eval", "ray")

    run: RunSection
    backbone: BackboneSection
    scorer: ScorerSection
    builder: BuilderSection
    prompts: PromptsSection
    sampling: SamplingSection
    window: WindowSection
    advantage: AdvantageSection
    train: TrainSection
    eval: EvalSection
    recast: RecastSection = RecastSection()
    ray: RaySection = RaySection()

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        steps = self.sampling.num_steps
        if self.window.size > steps:
            raise ValueError(f"window.size ({self.window.size}) exceeds sampling.num_steps "
                             f"({steps}); choose a window of at most {steps} steps")
        if self.window.mode == "fixed" and self.window.start + self.window.size > steps:
            raise ValueError(f"window [start={self.window.start}, start+size="
                             f"{self.window.start + self.window.size}) does not fit in "
                             f"sampling.num_steps={steps}; lower window.start")
        n = self.prompts.per_iteration * self.prompts.group_size
        if self.train.steps_per_epoch > n:
            raise ValueError(f"train.steps_per_epoch ({self.train.steps_per_epoch}) exceeds the "
                             f"{n} samples of an iteration (prompts.per_iteration x group_size); "
                             f"each optimizer step needs at least one sample: set it <= {n}")
        if self.sampling.noise_level == 0 and self.train.objective != "nft":
            raise ValueError("sampling.noise_level = 0 samples with the ODE, which has no "
                             "log-probs for the SDE objective: set a noise level > 0 (e.g. 0.7) "
                             "or train.objective = 'nft'")
        if self.sampling.noise_level == 0 and self.sampling.shared_noise:
            raise ValueError("sampling.noise_level = 0 with sampling.shared_noise = true gives a "
                             "group G identical images (the ODE is deterministic): set "
                             "shared_noise = false")
        if self.sampling.noise_level == 0 and self.window.mode == "calibrated":
            raise ValueError("sampling.noise_level = 0 has no SDE window to calibrate: set "
                             "window.mode = 'fixed'")
        if self.train.kl_target_nats is not None and self.train.objective == "nft":
            raise ValueError("train.kl_target_nats sets the lr from the update's KL in nats, "
                             "which needs the SDE's likelihoods; train.objective = 'nft' has none: "
                             "drop kl_target_nats (use a constant train.lr)")
        if self.train.velocity_target is not None and self.train.kl_target_nats is not None:
            raise ValueError("train.velocity_target and train.kl_target_nats both set the lr from "
                             "the last update's move: keep one")
        if self.train.velocity_target is not None and (self.train.objective == "nft"
                                                       or self.sampling.noise_level == 0):
            raise ValueError("train.velocity_target reads the velocity change off the update's KL "
                             "on the SDE window, which ODE rollouts (sampling.noise_level = 0, "
                             "as train.objective = 'nft' uses) do not have: drop velocity_target "
                             "(use a constant train.lr)")
        if self.train.kl_target_per_step and self.train.kl_target_nats is None:
            raise ValueError("train.kl_target_per_step weights the window steps towards the KL "
                             "target each; it needs train.kl_target_nats (e.g. 0.03), or drop "
                             "kl_target_per_step")
        if self.train.objective == "nft" and self.sampling.noise_block != 1:
            raise ValueError("train.objective = 'nft' credits latent positions, which block "
                             "noise's tile-grid maps do not give: set sampling.noise_block = 1")
        if self.recast.weighting != "none" and self.advantage.kind != "spatial":
            raise ValueError(f"recast.weighting = {self.recast.weighting!r} weights the atom types' "
                             f"shares of CAST's map; it needs advantage.kind = 'spatial' (got "
                             f"{self.advantage.kind!r}) or recast.weighting = 'none'")
        if (self.recast.weighting == "recast" and self.backbone.family != "shapes"
                and self.recast.positives == "renderer"):
            raise ValueError(f"recast.weighting = 'recast' estimates gains against positive "
                             f"samples; the shapes renderer gives them only for the shapes family "
                             f"(backbone.family is {self.backbone.family!r}): set "
                             f"recast.positives to a folder of images from a stronger generator "
                             f"in GenEval's output layout (<folder>/<NNNNN>/metadata.jsonl and "
                             f"samples/*.png), or use weighting 'static'")
        self._scalar_steps()
        if self.train.map_ratio == "sample" and self.train.clip_range > 0.01:
            raise ValueError(f"train.map_ratio = 'sample' clips each sample's all-dims ratio, "
                             f"whose log is a mean over every dimension: train.clip_range = "
                             f"{self.train.clip_range:g} would never clip; use Flow-GRPO's range "
                             f"(1e-4 to 1e-3)")
        self._ray_devices()
        return self

    def _scalar_steps(self) -> None:
        """`advantage.scalar_steps` splits the window between Flow-GRPO's scalar and a map."""
        k = self.advantage.scalar_steps
        if k == 0:
            return
        if self.advantage.kind not in ("spatial", "atom"):
            raise ValueError(f"advantage.scalar_steps = {k} gives the window's first steps the "
                             f"scalar advantage and the rest the kind's map; advantage.kind = "
                             f"{self.advantage.kind!r} has no map: use kind 'spatial' or 'atom', "
                             f"or scalar_steps = 0")
        if k > self.window.size:
            raise ValueError(f"advantage.scalar_steps ({k}) exceeds window.size "
                             f"({self.window.size}): at most every window step can take the "
                             f"scalar advantage")
        if self.train.objective == "nft" or self.recast.weighting != "none":
            raise ValueError("advantage.scalar_steps splits the SDE window's steps; it is not "
                             "implemented with train.objective = 'nft' (no window steps) or with "
                             "recast.weighting (its own per-step maps): set scalar_steps = 0")

    def _ray_devices(self) -> None:
        """With the Ray executor, a model placed on a GPU needs actors that reserve one."""
        if self.run.executor != "ray":
            return
        for device, gpus, field in ((self.backbone.device, self.ray.num_gpus, "num_gpus"),
                                    (self.scorer.device, self.ray.scorer_num_gpus,
                                     "scorer_num_gpus")):
            if device.startswith("cuda") and gpus == 0:
                raise ValueError(f"run.executor = 'ray' with a model on {device!r} and "
                                 f"ray.{field} = 0: Ray hides the GPUs from an actor that "
                                 f"reserves none; set ray.{field} = 1 (or a fraction to share one)")
        self._ray_training()

    def _ray_training(self) -> None:
        """Data-parallel training (ray.train_workers > 1, either objective) needs, on GPUs, one
        whole GPU per rank (NCCL refuses two ranks on one device)."""
        r = self.ray
        if r.train_workers == 1:
            return
        if self.backbone.device.startswith("cuda") and r.num_gpus < 1:
            raise ValueError(f"ray.train_workers = {r.train_workers} on {self.backbone.device!r} "
                             f"with ray.num_gpus = {r.num_gpus:g}: NCCL needs a GPU of its own "
                             f"per rank; set ray.num_gpus = 1 or ray.train_workers = 1")

    def _executor(self) -> str:
        if self.run.executor == "local":
            return "local: every stage in the flow's process"
        r = self.ray
        cluster = "a local cluster started here" if not r.address else f"the cluster at {r.address}"
        return (f"ray on {cluster}: {r.rollout_workers} resident policy actor(s) roll out "
                f"(each {r.num_gpus:g} GPU, {r.num_cpus:g} CPU), the first {r.train_workers} "
                f"train; {r.scorer_workers} scorer actor(s) (each {r.scorer_num_gpus:g} GPU, "
                f"{r.scorer_num_cpus:g} CPU); {-(-self.prompts.per_iteration // r.rollout_workers)}"
                f" prompt group(s) per rollout shard at most")

    def _algorithm(self) -> str:
        kind, reward = self.advantage.kind, self.advantage.reward
        if self.train.objective == "nft":
            return {"spatial": "CAST's atom-pixel credit on the forward-process (NFT) loss",
                    "atom": "CAST's atom credit without maps on the forward-process (NFT) loss"
                    }.get(kind, f"DiffusionNFT (scalar {reward} reward)")
        if self.advantage.scalar_steps:
            k, size = self.advantage.scalar_steps, self.window.size
            what = {"spatial": "CAST's atom maps", "atom": "CAST's atom credit (constant map)"}
            return (f"Flow-GRPO's scalar {reward} reward on the window's first {k} step(s), "
                    f"{what[kind]} on the other {size - k}")
        return {"spatial": "CAST (spatial atom advantages)",
                "atom": "CAST without maps (atom advantages, constant map)",
                "scalar_map": f"Flow-GRPO's scalar {reward} reward through per-position ratios"
                }.get(
            kind, f"Flow-GRPO (scalar {reward} reward)")

    def _lr_schedule(self) -> str:
        tr = self.train
        lo, hi = tr.kl_lr_floor, tr.kl_lr_ceiling
        decay = ("" if tr.lr_halflife is None else
                 f"; the lr aimed at halves every {tr.lr_halflife:g} iterations (target and "
                 f"bounds with it)")
        if tr.velocity_target is not None:
            return (f"velocity-targeted: {tr.lr:g} at iteration 0, then x {tr.velocity_target:g} "
                    f"/ the last update's velocity change (RMS per latent dim) within "
                    f"x[1/{tr.kl_lr_factor:g}, {tr.kl_lr_factor:g}] an iteration and "
                    f"[{lo * tr.lr:g}, {hi * tr.lr:g}]" + decay)
        if tr.kl_target_nats is None:
            return f"constant {tr.lr:g}" + decay
        return (f"KL-targeted: {tr.lr:g} at iteration 0, then x sqrt({tr.kl_target_nats:g} nats / "
                f"the last update's KL) within x[1/{tr.kl_lr_factor:g}, {tr.kl_lr_factor:g}] an "
                f"iteration and [{lo * tr.lr:g}, {hi * tr.lr:g}]"
                + (f"; each window step's loss weighted towards the same KL (floor "
                   f"{tr.kl_step_weight_floor:g})" if tr.kl_target_per_step else "") + decay)

    def derived(self) -> dict[str, Any]:
        """Quantities the pipeline derives from the recipe (printed at the start of a flow)."""
        b, g = self.prompts.per_iteration, self.prompts.group_size
        n, steps = b * g, self.train.steps_per_epoch
        largest = -(-n // steps)  # samples in the largest optimizer step
        per_step = n // steps if n % steps == 0 else f"{n // steps} or {largest}"
        return {
            "run_id": self.run.name,
            "samples_per_iteration": n,
            "optimizer_steps_per_iteration": steps * self.train.inner_epochs,
            "samples_per_optimizer_step": per_step,
            "micro_batches_per_optimizer_step": -(-largest // self.train.micro_batch),
            "lr_warmup": (f"linear over the run's first {self.train.warmup_steps} optimizer steps"
                          if self.train.warmup_steps else "none"),
            "lr_schedule": self._lr_schedule(),
            "algorithm": self._algorithm(),
            "window": (f"calibrated: {self.window.size} steps ending at the formation step"
                       if self.window.mode == "calibrated" else
                       f"fixed: steps [{self.window.start}, "
                       f"{self.window.start + self.window.size})"),
            "lora_scale": self.train.lora_alpha / self.train.lora_rank,
            "reward_step_weights": {
                "none": "none (CAST's map)",
                "static": f"static budgets {self.recast.budget_map()}",
                "recast": f"ReCAST Sinkhorn W at budgets {self.recast.budget_map()}, re-estimated "
                          f"every {self.recast.every} iteration(s) on {self.recast.prompts} x "
                          f"{self.recast.samples_per_prompt} samples, positives from "
                          f"{self.recast.positives}"}[self.recast.weighting],
            "executor": self._executor(),
            "recipe_hash": self.content_hash()[:16],
        }

    def content_hash(self) -> str:
        """sha256 of the canonical JSON of the whole recipe."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def canonical_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def section_hash(self, *names: str) -> str:
        """sha256 of the canonical JSON of some sections (a stage's config part of its key)."""
        dump = self._dump_without_unset_later_fields()
        text = json.dumps({n: dump[n] for n in names}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def pinned(self) -> dict[str, dict[str, Any]]:
        """The fields a run is pinned to (`tasks.store.run_pin`): every section but
        `unpinned_sections`, without each section's `unpinned` fields, and without `hash_if_set`
        fields at their default (so a field added later does not unpin older runs)."""
        dump = self._dump_without_unset_later_fields()
        out = {}
        for name in type(self).model_fields:
            if name in self.unpinned_sections:
                continue
            skip = getattr(self, name).unpinned
            out[name] = {k: v for k, v in dump[name].items() if k not in skip}
        return out

    def pinned_hash(self) -> str:
        """sha256 of the canonical JSON of `pinned()`."""
        text = json.dumps(self.pinned(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def _dump_without_unset_later_fields(self) -> dict[str, dict[str, Any]]:
        dump = self.model_dump(mode="json")
        for name in type(self).model_fields:
            section = getattr(self, name)
            for field in section.hash_if_set:
                if getattr(section, field) == type(section).model_fields[field].default:
                    del dump[name][field]
        return dump


def _format_errors(error: ValidationError) -> str:
    lines = []
    for e in error.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(recipe)"
        given = e.get("input")
        if e["type"] == "missing":
            lines.append(f"  {field}: missing; add it")
        elif e["type"] == "extra_forbidden":
            lines.append(f"  {field}: unknown field (value {given!r}); remove it or fix its name")
        elif e["type"] == "finite_number":
            lines.append(f"  {field}: must be a finite number (got {given!r}); inf and nan are "
                         f"not allowed")
        else:
            lines.append(f"  {field}: {e['msg']} (got {given!r})")
    return "\n".join(lines)


def parse_recipe(data: dict[str, Any], source: str = "<recipe>") -> Recipe:
    """Validate a recipe dict; RecipeError lists every bad field with the allowed values."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(f"{source}: invalid recipe\n{_format_errors(e)}") from None


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Command-line overrides ["prompts.per_iteration=4", 'run.name="x"'] -> {field: value}; each
    value is JSON (strings in double quotes)."""
    out: dict[str, Any] = {}
    for item in items:
        field, sep, text = item.partition("=")
        if not sep or not field:
            raise RecipeError(f"override {item!r} must look like FIELD=VALUE, e.g. "
                              f"prompts.per_iteration=4")
        try:
            out[field] = json.loads(text)
        except json.JSONDecodeError as e:
            raise RecipeError(f"override {item!r}: the value is not JSON ({e}); quote strings, "
                              f"e.g. {field}='\"text\"'") from None
    return out


def load_recipe(path: str | Path, overrides: dict[str, Any] | None = None) -> Recipe:
    """Read and validate a TOML recipe; `overrides` maps dotted fields to values (e.g.
    {"prompts.per_iteration": 4}), applied before validation."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise RecipeError(f"{path}: no such recipe file; recipes live in data/recipes/") from None
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: not valid TOML: {e}") from None
    for dotted, value in (overrides or {}).items():
        *sections, leaf = dotted.split(".")
        node = data
        for name in sections:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise RecipeError(f"{path}: override {dotted!r}: {name!r} is not a section")
        node[leaf] = value
    return parse_recipe(data, str(path))
