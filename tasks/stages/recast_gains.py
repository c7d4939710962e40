"""Stage `recast_gains`: ReCAST's per-reward, per-step gains and Sinkhorn weights for one policy.

Rewards are the atom types (object, count, attribute, relation; `RecastConfig.budgets` chooses a
subset and its budgets lambda_k, None = all four at 1/4). P prompts (evenly spaced through
`prompts.train`) x M samples: positives are exact scenes the shapes renderer draws for each
record (`render.sample_scene`, encoded with `backbone.encode_images`), the policy samples its own
ODE; both at the recipe's steps and CFG, scored by the recipe's scorer through
`cast_core.recast_gains` (see there for the math). Scene and noise seeds derive from (run seed,
prompt id, sample index) only, so every iteration sees the same positives and noise and the gains
move with the policy alone. Writes `recast_gains` (one row per reward and schedule step) and a
PNG heatmap blob whose path every row carries. The computation is `estimate`; with the Ray
executor (`workers`) it runs on the first resident policy actor, on the policy it holds, its
images scored on the scorer actors, and the rows are written here.

Training (`recast.weighting` in the recipe): `gains_for_training` runs this stage on the policy of
every `recast.every`-th iteration, and `reward_step_weights` turns the result (restricted to the
window) or the static budgets into the per-type, per-step weights the trainer applies to the
type maps of `compute_advantages` (`cast_core.pixel_map.step_weighted_maps`).

Positives (`RecastConfig.positives`): "renderer" (shapes family: exact renders, above) or a folder
of images from a stronger generator in GenEval's output layout, the one GenEval's generation
script writes: `<folder>/<NNNNN>/metadata.jsonl` (the prompt's record: `prompt` and `include`
clauses) and `<folder>/<NNNNN>/samples/*.png` (`read_positive_folder`). Then the P prompts are
evenly spaced through the folder's prompt folders (sorted by name), each gives up to M of its
images (sorted by name), centre-cropped to the backbone's aspect and resized (Lanczos) to its
height x width, encoded with `backbone.encode_images`; the policy samples M images of the same
prompts. The graphs come from the records' `include` clauses (the GenEval parser), so records
without them are refused. Any family. The policy is the base model (`policy_lora` None) or a LoRA
blob of the store (e.g. `policy_for(store, recipe, k).lora_path`). Cached on the base weights'
hash, the policy hash (the LoRA blob's sha256, or 'base-<hash>'), the sampling and scorer
sections, the prompt file's hash, asdict(config), the iteration and the code version.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image, ImageOps

from cast_core.csg.geneval import graph_from_geneval
from cast_core.hub_snapshot import file_sha256 as file_hash
from cast_core.recast_gains import (
    ATOM_TYPES,
    RecastGains,
    atom_type_statistics,
    policy_statistics,
    positive_statistics,
    restrict_to_window,
    static_weights,
    training_weights,
)
from cast_core.recast_gains import (
    recast_gains as estimate_gains,
)
from cast_core.shapes.render import render, sample_scene
from tasks.stages.guard import stage_task
from tasks.stages.models import base_hash, load_base, load_policy, scorer, scorer_id, set_threads
from tasks.stages.plots import plot_recast_gains
from tasks.stages.policy_state import PolicyState, policy_for
from tasks.stages.prompt_sets import load_prompts
from tasks.stages.recipe import Recipe
from tasks.store.schemas import prompt_id
from tasks.store.stage import StageRef, derive_seed, make_key, run_stage
from tasks.store.store import Store

if TYPE_CHECKING:
    from tasks.stages.ray_workers import Workers

STAGE = "recast_gains"
RENDERER = "renderer"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


class PositiveFolderError(ValueError):
    """A positives folder that is not in GenEval's output layout; the message names the path."""


@dataclass(frozen=True)
class RecastConfig:
    """prompts P and samples_per_prompt M (P M samples on each side); alpha: Renyi order in
    (0, 1); tau: kernel temperature; budgets: atom type -> lambda_k > 0 (None: the four types
    at 1/4); variance_floor: floor of the fitted variances; positives: "renderer" or a folder
    in GenEval's output layout (module docstring)."""

    prompts: int = 16
    samples_per_prompt: int = 2
    alpha: float = 0.5
    tau: float = 1.0
    budgets: dict[str, float] | None = None
    variance_floor: float = 1e-4
    positives: str = RENDERER

    def __post_init__(self) -> None:
        p, m = self.prompts, self.samples_per_prompt
        if p < 1 or m < 1 or p * m < 2:
            raise ValueError(f"need prompts >= 1, samples_per_prompt >= 1 and at least 2 samples "
                             f"to fit a variance; got {p} x {m}")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must lie in (0, 1) so the divergence stays finite; got "
                             f"{self.alpha} (0.5 is the Bhattacharyya case)")
        if not (self.tau > 0 and self.variance_floor > 0):
            raise ValueError(f"tau and variance_floor must be > 0; got {self.tau}, "
                             f"{self.variance_floor}")
        budgets = self.budgets if self.budgets is not None else {}
        unknown = sorted(set(budgets) - set(ATOM_TYPES))
        bad = {k: v for k, v in budgets.items() if not (math.isfinite(v) and v > 0)}
        if (self.budgets is not None and not budgets) or unknown or bad:
            raise ValueError(f"budgets must map atom types {ATOM_TYPES} to finite values > 0 "
                             f"(leave a reward out to drop it); unknown {unknown}, bad {bad}")

    def budget_map(self) -> dict[str, float]:
        if self.budgets is None:
            return {k: 1.0 / len(ATOM_TYPES) for k in ATOM_TYPES}
        return {k: float(self.budgets[k]) for k in ATOM_TYPES if k in self.budgets}


def _policy_hash(store: Store, recipe: Recipe, policy_lora: str | None) -> str:
    """The LoRA blob's sha256 (a checkpoint's policy hash), or the base model's name as
    `policy_for` gives it at iteration 0."""
    if policy_lora is None:
        return f"base-{base_hash(recipe)[:16]}"
    return file_hash(store.resolve(policy_lora))


def cache_key(store: Store, recipe: Recipe, iteration: int, config: RecastConfig = RecastConfig(),
              policy_lora: str | None = None) -> str:
    source = (file_hash(recipe.prompts.train) if config.positives == RENDERER
              else folder_hash(read_positive_folder(config.positives)))
    return make_key(STAGE, {"sections": recipe.section_hash("sampling", "scorer", "backbone"),
                            "seed": recipe.run.seed, "iteration": iteration,
                            "recast": asdict(config)},
                    {"base": base_hash(recipe), "policy": _policy_hash(store, recipe, policy_lora),
                     "prompts": source, "scorer": scorer_id(recipe)})


def read_positive_folder(folder: str | Path) -> list[tuple[dict, list[Path]]]:
    """[(record, image paths)] per prompt folder of a GenEval-layout folder, sorted by name;
    raises PositiveFolderError naming the path when the layout or a record is wrong."""
    root = Path(folder)
    if not root.is_dir():
        raise PositiveFolderError(f"recast.positives: {root} is not a folder (expected GenEval's "
                                  f"output layout <folder>/<NNNNN>/metadata.jsonl + samples/*.png)")
    out = []
    for sub in sorted(d for d in root.iterdir() if d.is_dir()):
        meta = sub / "metadata.jsonl"
        if not meta.is_file():
            raise PositiveFolderError(f"{sub}: no metadata.jsonl (each prompt folder holds the "
                                      f"prompt's GenEval record and a samples/ folder)")
        lines = [x for x in meta.read_text(encoding="utf-8").splitlines() if x.strip()]
        try:
            record = json.loads(lines[0]) if len(lines) == 1 else None
        except json.JSONDecodeError as err:
            raise PositiveFolderError(f"{meta}: not valid JSON ({err})") from err
        if not (isinstance(record, dict) and isinstance(record.get("prompt"), str)
                and isinstance(record.get("include"), list)):
            raise PositiveFolderError(f"{meta}: expected one JSON line with a string 'prompt' and "
                                      f"GenEval 'include' clauses (the graphs come from them)")
        images = sorted(p for p in (sub / "samples").glob("*")
                        if p.suffix.lower() in IMAGE_SUFFIXES)
        if not images:
            raise PositiveFolderError(f"{sub / 'samples'}: no images ({', '.join(IMAGE_SUFFIXES)})")
        out.append((record, images))
    if not out:
        raise PositiveFolderError(f"recast.positives: {root} has no prompt folders "
                                  f"(<NNNNN>/metadata.jsonl + samples/*.png)")
    return out


def folder_hash(entries: list[tuple[dict, list[Path]]]) -> str:
    """sha256 over the records and the bytes of every image (so edited images re-run)."""
    h = hashlib.sha256()
    for record, images in entries:
        h.update(json.dumps(record, sort_keys=True).encode())
        for p in images:
            h.update(p.name.encode() + bytes.fromhex(file_hash(p)))
    return h.hexdigest()


def load_images(paths: list[Path], height: int, width: int) -> torch.Tensor:
    """Images [N, 3, height, width] in [0, 1]: RGB, centre-cropped to the aspect and resized
    with Lanczos (an image already at the size passes unchanged)."""
    out = []
    for p in paths:
        with Image.open(p) as im:
            fitted = ImageOps.fit(im.convert("RGB"), (width, height), Image.Resampling.LANCZOS)
        out.append(np.asarray(fitted, dtype=np.uint8))
    return torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2).float() / 255.0


def _image_size(backbone) -> tuple[int, int]:
    config = backbone.config
    if hasattr(config, "image_size"):
        return config.image_size, config.image_size
    return config.height, config.width


def _pick(items: list, n: int) -> list:
    """n items evenly spaced through `items` (all when n >= len)."""
    return [items[i * len(items) // n] for i in range(min(n, len(items)))]


def positive_images(records: list[dict], seeds: list[int]) -> torch.Tensor:
    """One exact render per (record, seed): images [N, 3, H, W] in [0, 1]."""
    images = [render(sample_scene(r, np.random.default_rng(s))).image
              for r, s in zip(records, seeds, strict=True)]
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255.0


def _rows(result: RecastGains, run_id: str, iteration: int, policy_hash: str,
          plot_path: str) -> list[dict]:
    return [{"run_id": run_id, "iteration": iteration, "policy_hash": policy_hash, "reward": name,
             "step": t, "sigma": float(result.sigmas[t]),
             "divergence": float(result.divergence[k, t]), "gain": float(result.gains[k, t]),
             "normalised_gain": float(result.normalised[k, t]), "weight": float(result.W[k, t]),
             "n_positive": int(result.n_positive[k]), "n_policy": int(result.n_policy[k]),
             "budget": float(result.budgets[k]), "alpha": result.alpha, "tau": result.tau,
             "plot_path": plot_path}
            for k, name in enumerate(result.rewards) for t in range(result.sigmas.shape[0])]


def estimate(recipe: Recipe, config: RecastConfig, backbone, score) -> RecastGains:
    """The stage's computation: the gains of the loaded policy `backbone` (base or LoRA), its
    samples and the positives scored by `score(images, graphs) -> [(scores [A], heatmaps)]`
    (the recipe's scorer, here or on the Ray executor's scorer actors)."""
    s = recipe.sampling
    m = config.samples_per_prompt
    if config.positives == RENDERER:
        picks = _pick(load_prompts(recipe, recipe.prompts.train), config.prompts)
        positive_images_of = None
    else:
        entries = _pick(read_positive_folder(config.positives), config.prompts)
        picks, positive_images_of = [r for r, _ in entries], [p[:m] for _, p in entries]
    samples = [(r, j) for r in picks for j in range(m)]
    prompts = [r["prompt"] for r, _ in samples]
    graphs = [graph_from_geneval(r) for r, _ in samples]
    seeds = [derive_seed(recipe.run.seed, "recast-noise", prompt_id(r["prompt"]), j)
             for r, j in samples]
    statistics = atom_type_statistics(score, tuple(config.budget_map()))
    if positive_images_of is None:
        scenes = [derive_seed(recipe.run.seed, "recast-scene", prompt_id(r["prompt"]), j)
                  for r, j in samples]
        images, kept = positive_images([r for r, _ in samples], scenes), samples
    else:
        kept = [(r, j) for r, paths in zip(picks, positive_images_of, strict=True)
                for j in range(len(paths))]
        images = load_images([p for paths in positive_images_of for p in paths],
                             *_image_size(backbone))
    index = {(prompt_id(r["prompt"]), j): i for i, (r, j) in enumerate(samples)}
    take = [index[(prompt_id(r["prompt"]), j)] for r, j in kept]
    x0 = backbone.encode_images(images)
    args = (s.num_steps, s.guidance_scale, statistics, s.chunk_size)
    positive = positive_statistics(backbone, x0, [prompts[i] for i in take],
                                   [graphs[i] for i in take], [seeds[i] for i in take], *args)
    policy = policy_statistics(backbone, prompts, graphs, seeds, *args)
    return estimate_gains(positive, policy, config.budget_map(), config.alpha, config.tau,
                          config.variance_floor)


def recast_gains(store: Store, recipe: Recipe, iteration: int,
                 config: RecastConfig = RecastConfig(), policy_lora: str | None = None,
                 workers: Workers | None = None) -> StageRef:
    """The stage (module docstring); with `workers` (the Ray executor) the gains are estimated
    on the first resident policy actor (holding the policy, no backbone load) with the samples
    scored on the scorer actors, and written here."""
    run_id = recipe.run.name
    if config.positives == RENDERER and recipe.backbone.family != "shapes":
        raise ValueError(f"recast_gains: the renderer gives positives only for the shapes family "
                         f"(backbone.family is {recipe.backbone.family!r}); set recast.positives "
                         f"to a GenEval-layout folder of images from a stronger generator")

    def body():
        set_threads(recipe)
        if workers is not None:
            result = workers.recast_gains(store, recipe, config, PolicyState(
                iteration, _policy_hash(store, recipe, policy_lora), policy_lora, None))
        else:
            backbone = (load_base(recipe) if policy_lora is None
                        else load_policy(recipe, store.get_tensors(policy_lora))[0])
            result = estimate(recipe, config, backbone, scorer(recipe)[1])
        policy_hash = _policy_hash(store, recipe, policy_lora)
        plot = store.put_blob(plot_recast_gains(
            result, f"{run_id} iteration {iteration}: ReCAST gains ({policy_hash[:12]})"), "png")
        rows = _rows(result, run_id, iteration, policy_hash, plot.path)
        part = f"{run_id}-{iteration:05d}-{policy_hash[:16]}"
        return [plot, store.write_table("recast_gains", rows, part)]

    key = cache_key(store, recipe, iteration, config, policy_lora)
    return run_stage(store, run_id, iteration, STAGE, key, body)


def read_recast_gains(store: Store, ref: StageRef) -> RecastGains:
    """The RecastGains a recast_gains call wrote (for `restrict_to_window` in the trainer)."""
    rows = store.read_output(ref, "recast_gains").to_pylist()
    rewards = tuple(dict.fromkeys(r["reward"] for r in rows))
    steps = sorted({r["step"] for r in rows})
    cell = {(r["reward"], r["step"]): r for r in rows}

    def grid(column: str) -> torch.Tensor:
        return torch.tensor([[cell[k, t][column] for t in steps] for k in rewards],
                            dtype=torch.float64)  # [R, S]

    first = [cell[k, steps[0]] for k in rewards]
    return RecastGains(rewards, grid("sigma")[0], grid("divergence"), grid("gain"),
                       grid("normalised_gain"), grid("weight"),
                       torch.tensor([r["n_positive"] for r in first]),
                       torch.tensor([r["n_policy"] for r in first]),
                       torch.tensor([r["budget"] for r in first], dtype=torch.float64),
                       first[0]["alpha"], first[0]["tau"])


def config_from_recipe(recipe: Recipe) -> RecastConfig:
    """The gain estimate's config from the recipe's `[recast]` section."""
    r = recipe.recast
    return RecastConfig(prompts=r.prompts, samples_per_prompt=r.samples_per_prompt, alpha=r.alpha,
                        tau=r.tau, budgets=r.budget_map(), variance_floor=r.variance_floor,
                        positives=r.positives)


def gains_iteration(recipe: Recipe, iteration: int) -> int:
    """The iteration whose policy W is estimated on for training iteration `iteration`: the last
    multiple of `recast.every` (W is re-estimated every `every` iterations)."""
    return iteration - iteration % recipe.recast.every


def _training_args(store: Store, recipe: Recipe, iteration: int) -> tuple[int, str | None]:
    k0 = gains_iteration(recipe, iteration)
    return k0, policy_for(store, recipe, k0).lora_path


def training_cache_key(store: Store, recipe: Recipe, iteration: int) -> str:
    k0, lora = _training_args(store, recipe, iteration)
    return cache_key(store, recipe, k0, config_from_recipe(recipe), lora)


def gains_for_training(store: Store, recipe: Recipe, iteration: int,
                       workers: Workers | None = None) -> StageRef:
    """The gains training iteration `iteration` weights its loss with: estimated on the policy of
    `gains_iteration` (recorded at that iteration; later iterations reuse the cached result);
    `workers`: the Ray executor's actors, or None to compute here."""
    if recipe.recast.weighting != "recast":
        raise ValueError(f"gains_for_training needs recast.weighting = 'recast'; the recipe has "
                         f"{recipe.recast.weighting!r}")
    k0, lora = _training_args(store, recipe, iteration)
    return recast_gains(store, recipe, k0, config_from_recipe(recipe), lora, workers)


def reward_step_weights(store: Store, recipe: Recipe, window_start: int, window_end: int,
                        gains: StageRef | None) -> torch.Tensor | None:
    """[4, K] float64 weights of the atom types (ATOM_TYPES order) at the window's K steps, for
    `recast.weighting` ("none": None; "static": lambda_k / mean(lambda); "recast": K W[k, t] /
    mean(lambda) with W re-solved over the window from `gains`); `cast_core.recast_gains`."""
    weighting = recipe.recast.weighting
    if weighting == "none":
        return None
    if weighting == "static":
        return static_weights(recipe.recast.budget_map(), window_end - window_start)
    if gains is None:
        raise ValueError("recast.weighting = 'recast' needs the gains of this iteration "
                         "(tasks.stages.recast_gains.gains_for_training); none were passed")
    window = restrict_to_window(read_recast_gains(store, gains), window_start, window_end)
    return training_weights(window)


recast_gains_task = stage_task(recast_gains, STAGE, cache_key)
gains_for_training_task = stage_task(gains_for_training, STAGE, training_cache_key)
