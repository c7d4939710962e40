"""Stage `rollout`: B prompts x G samples with the current policy, ODE outside and SDE inside the
window; stores images, the window steps (latents, sampled next latents, per-position log-probs)
and one `rollouts` row per sample.

Prompts: B distinct prompts of this run's `csgs` (P of them). "tag_balanced" and "uniform" draw them
with a generator seeded from (run seed, iteration): "tag_balanced" picks a tag uniformly, then a
prompt of it; "uniform" picks prompts uniformly. "cycle" takes, at iteration k, the prompts at
positions (k B + j) mod P, j < B, of the prompt file in file order (the csgs rows' stored order:
build_csgs writes them in file order, a repeated prompt at its first line), so each prompt comes
back once every ceil(P / B) iterations. B > P is an error. Seeds: derive_seed(run seed, iteration,
prompt id, sample index), so no draw depends on batch position; with `sampling.shared_noise` the
initial noise of every sample of a prompt comes from derive_seed(run seed, iteration, prompt id,
"initial-noise") instead (the SDE noise still from the sample's own seed). Blobs (content-addressed): `window
steps` safetensors {x0, latents, next_latents, log_probs, t, t_next} with sample i at row i,
`images` safetensors uint8 [N, 3, H, W] (row `blob_index` of each rollouts row), and a PNG contact
sheet (one row per prompt). A progress bar counts the denoising steps (`tasks.stages.progress`).

Sampling (`sample_groups`) and writing (`write_rollout`) are apart: with the Ray executor the
prompt groups are sampled in shards by resident policy actors (`tasks.stages.ray_workers`) and the
stage writes their concatenation, the same rows and blobs as one process's; the bar is then the
flow's too, moved by the steps the actors count (`tasks.stages.ray_progress`).

Cached on the policy hash, the window row, the chosen prompts and the sampling section.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from cast_core.rollout import Rollout, RolloutSpec, rollout
from cast_core.window import SdeWindow
from tasks.stages.calibrate_window import read_window
from tasks.stages.guard import stage_task
from tasks.stages.models import set_threads
from tasks.stages.policy_state import load_policy_of, policy_for
from tasks.stages.progress import stage_progress
from tasks.stages.recipe import Recipe
from tasks.stages.recipe_sections import SamplingSection
from tasks.store.stage import StageRef, derive_seed, make_key, run_stage
from tasks.store.store import Store

if TYPE_CHECKING:
    from tasks.stages.ray_workers import Workers

STAGE = "rollout"


def cycle_positions(iteration: int, b: int, p: int) -> list[int]:
    """The file positions of iteration k's B prompts under "cycle": (k B + j) mod P, j < B."""
    if b > p:
        raise ValueError(f"prompts.per_iteration = {b} exceeds the {p} prompts of the train file; "
                         f"set per_iteration <= {p} or use a larger prompt file")
    return [(iteration * b + j) % p for j in range(b)]


def select_prompts(store: Store, recipe: Recipe, csgs: StageRef, iteration: int) -> list[dict]:
    """The iteration's B prompt rows (prompt_id, prompt, tag, graph_json) in draw order."""
    rows = store.read_output(csgs, "csgs").to_pylist()  # file order
    b = recipe.prompts.per_iteration
    if b > len(rows):
        raise ValueError(f"prompts.per_iteration = {b} exceeds the {len(rows)} prompts of "
                         f"{recipe.prompts.train}; set per_iteration <= {len(rows)}")
    if recipe.prompts.selection == "cycle":
        return [rows[i] for i in cycle_positions(iteration, b, len(rows))]
    rows.sort(key=lambda r: r["prompt_id"])
    rng = np.random.default_rng(derive_seed(recipe.run.seed, "prompts", iteration))
    if recipe.prompts.selection == "uniform":
        return [rows[i] for i in rng.choice(len(rows), size=b, replace=False)]
    by_tag: dict[str, list[dict]] = {}
    for r in rows:
        by_tag.setdefault(r["tag"] or "untagged", []).append(r)
    tags, chosen, taken = sorted(by_tag), [], set()
    while len(chosen) < b:
        pool = [r for r in by_tag[tags[int(rng.integers(len(tags)))]] if r["prompt_id"] not in taken]
        if pool:
            pick = pool[int(rng.integers(len(pool)))]
            chosen.append(pick)
            taken.add(pick["prompt_id"])
    return chosen


def rollout_spec(recipe: Recipe, window_row: dict) -> RolloutSpec:
    s = recipe.sampling
    return RolloutSpec(num_steps=s.num_steps, guidance_scale=s.guidance_scale,
                       noise_level=s.noise_level, sde_kind=s.sde_kind,
                       window=SdeWindow(window_row["window_start"], window_row["window_end"]),
                       noise_block=s.noise_block)


def contact_sheet(images: torch.Tensor, columns: int) -> bytes:
    """uint8 [N, 3, H, W] -> PNG bytes of a grid with `columns` images per row."""
    from PIL import Image

    n, _, h, w = images.shape
    rows = -(-n // columns)
    sheet = np.full((rows * (h + 1), columns * (w + 1), 3), 255, dtype=np.uint8)
    for i, img in enumerate(images.permute(0, 2, 3, 1).numpy()):
        r, c = divmod(i, columns)
        sheet[r * (h + 1):r * (h + 1) + h, c * (w + 1):c * (w + 1) + w] = img
    buffer = io.BytesIO()
    Image.fromarray(sheet).resize((sheet.shape[1] * 2, sheet.shape[0] * 2), Image.NEAREST).save(
        buffer, format="png")
    return buffer.getvalue()


def group_seeds(recipe: Recipe, picks: list[dict], iteration: int
                ) -> tuple[list[int], list[int] | None]:
    """(each sample's seed, each sample's initial-noise seed or None) for the G samples of each
    picked prompt, prompt-major (module docstring)."""
    g, seed = recipe.prompts.group_size, recipe.run.seed
    seeds = [derive_seed(seed, iteration, p["prompt_id"], j) for p in picks for j in range(g)]
    if not recipe.sampling.shared_noise:
        return seeds, None
    return seeds, [derive_seed(seed, iteration, p["prompt_id"], "initial-noise")
                   for p in picks for _ in range(g)]


@torch.no_grad()
def decode_uint8(backbone, x0: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Latents [N, C, h, w] -> uint8 images [N, 3, H, W] on the CPU, decoded `chunk_size` at a
    time (a VAE decode at full resolution is the memory peak of a rollout)."""
    return torch.cat([(backbone.decode(x) * 255).round().to(torch.uint8).cpu()
                      for x in x0.split(chunk_size)])


def cache_key(store: Store, recipe: Recipe, csgs: StageRef, window: StageRef,
              iteration: int) -> str:
    policy = policy_for(store, recipe, iteration)
    return make_key(STAGE, {"sampling": recipe.section_hash("sampling", "prompts"),
                            "seed": recipe.run.seed, "iteration": iteration},
                    {"policy": policy.policy_hash, "window": window.content_hash,
                     "csgs": csgs.content_hash})


@dataclass(frozen=True)
class Sampled:
    """A rollout's samples, prompt-major: the window steps and the images uint8 [N, 3, H, W]."""

    rollout: Rollout
    images: torch.Tensor


def rollout_bar(samples: Sequence[int], sampling: SamplingSection, iteration: int
                ) -> tuple[int, str]:
    """The rollout's progress bar for processes sampling `samples[i]` samples each (one process
    locally, one shard a policy actor with Ray): (its total, one unit an ODE step of a chunk of
    `sampling.chunk_size` samples, as `cast_core.rollout.rollout` counts them; its description)."""
    chunks = sum(-(-n // sampling.chunk_size) for n in samples)
    return chunks * sampling.num_steps, f"rollout {iteration} ({sum(samples)} samples)"


def sample_groups(backbone, recipe: Recipe, spec: RolloutSpec, picks: list[dict],
                  iteration: int, progress: Callable[[int], object] | None = None) -> Sampled:
    """The G samples of each picked prompt with the loaded policy; every draw is seeded from
    (run seed, iteration, prompt id, sample index), so any split of `picks` gives the same rows.
    `progress` is called after each ODE step of each chunk (`rollout_bar` counts them)."""
    g, chunk = recipe.prompts.group_size, recipe.sampling.chunk_size
    prompts = [p["prompt"] for p in picks for _ in range(g)]
    seeds, noise_seeds = group_seeds(recipe, picks, iteration)
    result = rollout(backbone, prompts, seeds, spec, chunk_size=chunk, noise_seeds=noise_seeds,
                     progress=progress)
    return Sampled(result, decode_uint8(backbone, result.x0, chunk))  # images [N, 3, H, W]


def write_rollout(store: Store, recipe: Recipe, picks: list[dict], policy_hash: str,
                  spec: RolloutSpec, sampled: Sampled, iteration: int) -> list:
    """The stage's blobs and `rollouts` part for the samples of `picks` (prompt-major)."""
    run_id, g = recipe.run.name, recipe.prompts.group_size
    result, images = sampled.rollout, sampled.images
    seeds, _ = group_seeds(recipe, picks, iteration)
    steps = store.put_tensors({"x0": result.x0, "latents": result.latents,
                               "next_latents": result.next_latents,
                               "log_probs": result.log_probs, "t": result.t,
                               "t_next": result.t_next})
    image_blob = store.put_tensors({"images": images})
    sheet = store.put_blob(contact_sheet(images, g), "png")
    rows = [{"run_id": run_id, "iteration": iteration, "prompt_id": picks[i // g]["prompt_id"],
             "sample_index": i % g, "seed": seeds[i], "policy_hash": policy_hash,
             "blob_index": i, "image_path": image_blob.path,
             "image_hash": hashlib.sha256(images[i].numpy().tobytes()).hexdigest(),
             "latents_path": steps.path, "latents_hash": steps.sha256,
             "window_start": spec.window.start, "window_end": spec.window.end,
             "num_steps": spec.num_steps} for i in range(len(seeds))]
    table = store.write_table("rollouts", rows, f"{run_id}-{iteration:05d}")
    return [steps, image_blob, sheet, table]


def rollout_groups(store: Store, recipe: Recipe, csgs: StageRef, window: StageRef,
                   iteration: int, workers: Workers | None = None) -> StageRef:
    """The stage; with `workers` (the Ray executor) the prompt groups are sampled by its
    resident policy actors, in shards, and written here once every shard has finished."""

    def body():
        policy = policy_for(store, recipe, iteration)
        window_row = read_window(store, window)
        spec = rollout_spec(recipe, window_row)
        picks = select_prompts(store, recipe, csgs, iteration)
        if workers is None:
            set_threads(recipe)
            backbone, _ = load_policy_of(store, recipe, policy)
            samples = len(picks) * recipe.prompts.group_size
            with stage_progress(*rollout_bar([samples], recipe.sampling, iteration)) as advance:
                sampled = sample_groups(backbone, recipe, spec, picks, iteration, advance)
        else:  # the bar in this process, moved by the actors' progress
            sampled = workers.rollout(store, recipe, policy, window_row, picks, iteration)
        return write_rollout(store, recipe, picks, policy.policy_hash, spec, sampled, iteration)

    key = cache_key(store, recipe, csgs, window, iteration)
    return run_stage(store, recipe.run.name, iteration, STAGE, key, body)


rollout_task = stage_task(rollout_groups, STAGE, cache_key)
