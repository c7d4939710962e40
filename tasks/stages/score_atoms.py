"""Stage `score_atoms`: every atom of every rollout image -> a soft score in [0, 1] and a grounding
heatmap at the scorer's native grid (`atom_scores`, one row per (sample, atom), the heatmap as a
row-major float list with its H and W). The scorer sees the stored uint8 images as float32 in
[0, 1] on the CPU, `sampling.chunk_size` images per call.

The CSG of each sample comes from this run's `csgs` rows; images from the rollout's images blob.
With the Ray executor the samples are split between resident scorer actors
(`tasks.stages.ray_workers`), each with all its atoms (a scorer takes whole images).

Cached on the rollout's content hash (which covers every image hash), the CSGs and the scorer id.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from cast_core.csg.graph import SceneGraph
from tasks.stages.guard import stage_task
from tasks.stages.models import Scorer, scorer, scorer_id, set_threads
from tasks.stages.recipe import Recipe
from tasks.store.stage import StageRef, make_key, run_stage
from tasks.store.store import Store

if TYPE_CHECKING:
    from tasks.stages.ray_workers import Workers

STAGE = "score_atoms"


def load_rollout_rows(store: Store, rollouts: StageRef) -> list[dict]:
    rows = store.read_output(rollouts, "rollouts").to_pylist()
    return sorted(rows, key=lambda r: r["blob_index"])


def score_in_chunks(score: Scorer, images: torch.Tensor, graphs: list[SceneGraph],
                    chunk_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`score` over chunks of `chunk_size` images (bounded memory for a local model, bounded
    request bodies for a remote one); images [N, 3, H, W] in [0, 1] on the CPU; results in
    image order."""
    out = []
    for lo in range(0, len(images), chunk_size):
        out += list(score(images[lo:lo + chunk_size], graphs[lo:lo + chunk_size]))
    return out


def atom_score_rows(keys: dict, samples: list[dict], graphs: list[SceneGraph],
                    results: list[tuple[np.ndarray, np.ndarray]], scorer_id: str) -> list[dict]:
    """`atom_scores` rows, one per sample and atom in graph order: samples (prompt_id,
    sample_index), their graphs and the scorer's (scores [A], heatmaps [A, H, W]) in the same
    order; keys = the columns every row shares (run_id, iteration)."""
    out = []
    for sample, graph, (scores, heatmaps) in zip(samples, graphs, results, strict=True):
        atoms = graph.atoms()
        if len(scores) != len(atoms) or len(heatmaps) != len(atoms):
            raise ValueError(f"the scorer returned {len(scores)} scores and {len(heatmaps)} "
                             f"heatmaps for the {len(atoms)} atoms of {graph.prompt!r}; it must "
                             f"return one of each per atom, in graph order")
        for atom, s, heat in zip(atoms, scores, heatmaps):
            out.append({**keys, "prompt_id": sample["prompt_id"],
                        "sample_index": sample["sample_index"], "atom_id": atom.id,
                        "atom_type": atom.type, "score": float(s),
                        "heatmap": heat.astype("float32").ravel(),
                        "heatmap_h": heat.shape[0], "heatmap_w": heat.shape[1],
                        "scorer_id": scorer_id})
    return out


def load_graphs(store: Store, csgs: StageRef) -> dict[str, str]:
    """{prompt_id: graph JSON} of the run's CSGs."""
    rows = store.read_output(csgs, "csgs", ["prompt_id", "graph_json"]).to_pylist()
    return {r["prompt_id"]: r["graph_json"] for r in rows}


def cache_key(store: Store, recipe: Recipe, csgs: StageRef, rollouts: StageRef) -> str:
    return make_key(STAGE, {"scorer": scorer_id(recipe)},
                    {"rollouts": rollouts.content_hash, "csgs": csgs.content_hash})


def score_rows(store: Store, score: Scorer, rows: list[dict], graphs: list[SceneGraph],
               chunk_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`score` on the stored images of rollout `rows` (all from one images blob) with their
    graphs, `chunk_size` images a call; results in row order."""
    images = store.get_tensors(rows[0]["image_path"])["images"]  # uint8 [N, 3, H, W]
    images = images[[r["blob_index"] for r in rows]].float() / 255.0
    return score_in_chunks(score, images, graphs, chunk_size)


def score_atoms(store: Store, recipe: Recipe, csgs: StageRef, rollouts: StageRef,
                iteration: int, workers: Workers | None = None) -> StageRef:
    """The stage; with `workers` (the Ray executor) the samples are scored in shards by its
    resident scorer actors, and the rows written here once every shard has finished."""
    run_id = recipe.run.name

    def body():
        rows = load_rollout_rows(store, rollouts)
        graph_json = load_graphs(store, csgs)
        graphs = [SceneGraph.from_json(graph_json[r["prompt_id"]]) for r in rows]
        if workers is None:
            set_threads(recipe)
            scorer_id, score = scorer(recipe)
            results = score_rows(store, score, rows, graphs, recipe.sampling.chunk_size)
        else:
            scorer_id, results = workers.score(store, recipe, rows, graphs)
        out = atom_score_rows({"run_id": run_id, "iteration": iteration}, rows, graphs, results,
                              scorer_id)
        return [store.write_table("atom_scores", out, f"{run_id}-{iteration:05d}")]

    return run_stage(store, run_id, iteration, STAGE, cache_key(store, recipe, csgs, rollouts),
                     body)


score_atoms_task = stage_task(score_atoms, STAGE, cache_key)
