"""Stage `calibrate_window`: the backbone's own structure-formation step -> the SDE window.

mode "calibrated": P prompts (evenly spaced through `window.calibration_file`, default the train
set), one content-derived seed each, run the base model's ODE sampler at the recipe's steps and CFG;
curves of cos(e(x0_hat_k), e(x_final)) with the recipe's image embedder (`shapes-layout-v1` for the
shapes world, CLIP for the real backbones; `image_embedder`) -> `cast_core.calibration.calibrate_window`.
Writes `calibration_curves` (mean/std per step), `windows` (one row) and a PNG plot blob; a
progress bar counts the ODE steps (`tasks.stages.progress`).
mode "fixed": writes only the `windows` row (method "fixed", formation_step = window_end - 1).

With the Ray executor (`run.executor = "ray"`) the curves are measured on the first policy actor,
which holds the backbone for the whole run (run with its adapter off: the base model), and its
embedder is loaded there; the flow's process loads neither and writes the same rows, and shows
the same progress bar, moved by the steps the actor counts (`tasks.stages.ray_progress`).

Run-level (iteration -1); cached on the base weights' hash, the sampling and window sections, the
calibration prompts' hash and the embedder spec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cast_core.calibration import SimilarityCurves, similarity_curves
from cast_core.calibration import calibrate_window as calibrate
from cast_core.hub_snapshot import file_sha256 as file_hash
from cast_core.window import fixed_window
from tasks.stages.guard import stage_task
from tasks.stages.models import base_hash, load_base, set_threads
from tasks.stages.plots import plot_calibration
from tasks.stages.progress import stage_progress
from tasks.stages.prompt_sets import load_prompts
from tasks.stages.recipe import Recipe
from tasks.stages.recipe_sections import SamplingSection
from tasks.store.schemas import prompt_id
from tasks.store.stage import RUN_LEVEL, StageRef, derive_seed, make_key, run_stage
from tasks.store.store import Store

if TYPE_CHECKING:
    from tasks.stages.ray_workers import Workers

STAGE = "calibrate_window"


def _embedder_kind(recipe: Recipe) -> str:
    return recipe.window.embedder or ("layout" if recipe.backbone.family == "shapes" else "clip")


def image_embedder(recipe: Recipe):
    """The calibration's image embedder: the shapes layout embedder or CLIP (ViT-L/14 unless
    `window.embedder_path` names another), on the backbone's device."""
    if _embedder_kind(recipe) == "layout":
        from cast_core.shapes.embedder import LayoutEmbedder

        return LayoutEmbedder()
    from cast_core.clip_embedder import DEFAULT_MODEL, ClipEmbedder

    return ClipEmbedder.from_pretrained(recipe.window.embedder_path or DEFAULT_MODEL,
                                        device=recipe.backbone.device)


def image_embedder_spec(recipe: Recipe) -> str:
    """The embedder's spec for the cache key, without loading a CLIP model."""
    if _embedder_kind(recipe) == "layout":
        return image_embedder(recipe).spec
    from cast_core.clip_embedder import DEFAULT_MODEL, ClipEmbedder

    return ClipEmbedder.spec_for(recipe.window.embedder_path or DEFAULT_MODEL)


def _calibration_file(recipe: Recipe) -> str:
    return recipe.window.calibration_file or recipe.prompts.train


def cache_key(store: Store, recipe: Recipe) -> str:
    inputs = {"base": base_hash(recipe)}
    if recipe.window.mode == "calibrated":
        inputs |= {"prompts": file_hash(_calibration_file(recipe)),
                   "embedder": image_embedder_spec(recipe)}
    return make_key(STAGE, {"sampling": recipe.section_hash("sampling", "window"),
                            "seed": recipe.run.seed}, inputs)


@dataclass(frozen=True)
class MeasuredCurves:
    """The calibration prompts' curves (`SimilarityCurves`: curves [P, S], sigmas [S]) and the
    spec of the image embedder that measured them."""

    similarity: SimilarityCurves
    embedder: str


def calibration_prompts(recipe: Recipe) -> tuple[list[str], list[int]]:
    """P prompts evenly spaced through the calibration file, and one content-derived seed each."""
    w = recipe.window
    records = load_prompts(recipe, _calibration_file(recipe))
    picks = [records[i * len(records) // w.calibration_prompts]
             for i in range(min(w.calibration_prompts, len(records)))]
    prompts = [r["prompt"] for r in picks]
    return prompts, [derive_seed(recipe.run.seed, "calibrate", prompt_id(p)) for p in prompts]


def calibration_bar(num_prompts: int, sampling: SamplingSection) -> tuple[int, str]:
    """The calibration's progress bar: (its total, one unit an ODE step of a chunk of
    `sampling.chunk_size` prompts, as `similarity_curves` counts them; its description)."""
    chunks = -(-num_prompts // sampling.chunk_size)
    return chunks * sampling.num_steps, f"window calibration ({num_prompts} prompts)"


def measure_curves(backbone, recipe: Recipe, prompts: list[str], seeds: list[int],
                   progress: Callable[[int], object] | None = None) -> MeasuredCurves:
    """The similarity curves of `prompts` sampled by `backbone` (the base model) at the recipe's
    steps and CFG, embedded by the recipe's image embedder (loaded here)."""
    s = recipe.sampling
    embedder = image_embedder(recipe)
    curves = similarity_curves(backbone, embedder, prompts, seeds, s.num_steps,
                               s.guidance_scale, chunk_size=s.chunk_size, progress=progress)
    return MeasuredCurves(curves, embedder.spec)


def calibrate_window(store: Store, recipe: Recipe, workers: Workers | None = None) -> StageRef:
    """The stage; with `workers` (the Ray executor) the curves are measured on the first policy
    actor, with the backbone it holds, and the rows are written here."""
    run_id, s, w = recipe.run.name, recipe.sampling, recipe.window
    backbone_id = f"{recipe.backbone.family}:{base_hash(recipe)[:16]}"

    def body():
        part = f"{run_id}-run"
        row = {"run_id": run_id, "backbone_id": backbone_id, "num_steps": s.num_steps,
               "noise_level": s.noise_level}
        if w.mode == "fixed":
            window = fixed_window(w.start, w.size, s.num_steps)
            row |= {"formation_step": window.end - 1, "method": "fixed",
                    "window_start": window.start, "window_end": window.end, "plot_path": None}
            return [store.write_table("windows", [row], part)]
        set_threads(recipe)
        prompts, seeds = calibration_prompts(recipe)
        if workers is None:
            with stage_progress(*calibration_bar(len(prompts), s)) as advance:
                measured = measure_curves(load_base(recipe), recipe, prompts, seeds, advance)
        else:  # the bar in this process, moved by the actor's progress
            measured = workers.calibration_curves(recipe, prompts, seeds)
        curves = measured.similarity
        result = calibrate(curves.curves, s.num_steps, w.size, method=w.method,
                           threshold=w.threshold)
        plot = store.put_blob(plot_calibration(result, curves.sigmas,
                                               f"{run_id}: window calibration ({backbone_id})"),
                              "png")
        curve_rows = [{"run_id": run_id, "backbone_id": backbone_id, "step": k,
                       "sigma": float(curves.sigmas[k]), "similarity_mean": float(m),
                       "similarity_std": float(sd), "num_prompts": len(prompts),
                       "embedder": measured.embedder}
                      for k, (m, sd) in enumerate(zip(result.mean_curve, result.std_curve))]
        row |= {"formation_step": result.formation.step, "method": result.formation.method_used,
                "window_start": result.window.start, "window_end": result.window.end,
                "plot_path": plot.path}
        return [store.write_table("calibration_curves", curve_rows, part), plot,
                store.write_table("windows", [row], part)]

    return run_stage(store, run_id, RUN_LEVEL, STAGE, cache_key(store, recipe), body)


def read_window(store: Store, ref: StageRef) -> dict:
    """The windows row a calibrate_window call wrote."""
    rows = store.read_output(ref, "windows").to_pylist()
    return rows[0]


calibrate_window_task = stage_task(calibrate_window, STAGE, cache_key)
