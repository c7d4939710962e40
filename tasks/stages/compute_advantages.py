"""Stage `compute_advantages`: atom scores -> per-atom group z-scores (`advantages`), the per-sample
pixel advantage map pooled onto the log-prob grid, and the Flow-GRPO scalar advantage of the same
sample (`advantage_maps`, maps in one safetensors blob, row `blob_index`).

The blob holds, row i = the sample's `blob_index` (N samples, h x w log-prob grid):
- `maps` [N, h, w]: CAST's clamped pixel map (`cast_core.pixel_map.pixel_advantage_map`), pooled;
- `scalar` [N]: Flow-GRPO's scalar advantage;
- `atom` [N]: the no-map credit (`atom_mean_credit`: the clamped mean of the sample's gated atom
  advantages), which `advantage.kind = "atom"` trains on as a constant map;
- `type_maps` [N, 4, h, w]: the map split by atom type in the order of `ATOM_TYPES` (object,
  count, attribute, relation; `grouped_advantage_maps`), each type's share of the map before the
  clamp, pooled like `maps` (for ReCAST's per-type step weights). Pooling is linear, so
  `type_maps.sum(1)` is the pooled unclamped map: it equals `maps` wherever no pixel of a grid
  cell was clamped (everywhere when the grid is the heatmap's pixel grid, after the clamp).
All are always computed, so a run of one recipe can be inspected against the others;
`advantage.kind` decides which one the training stage uses. Gating (`advantage.gate_by_parents`)
zeroes a child atom's credit where a parent atom scored < 0.5.
With `advantage.heatmap_source = "group_others"` each sample's maps are built from the mean of
its group's other samples' heatmaps (`group_heatmaps`); the stored atom_scores keep every
sample's own heatmap.
Read -> pure functions -> write: `atom_batch` turns the stored rows into tensors,
`cast_core.batch_credit.batch_credit` does the maths, `advantage_rows` builds the rows; each is
tested on plain inputs. Cached on the atom scores' content hash, the rollout's and the advantage
section.
"""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc
import torch
from safetensors import safe_open

from cast_core.batch_credit import AtomBatch, BatchCredit, CreditConfig, batch_credit
from cast_core.csg.graph import ATOM_TYPES
from tasks.stages.guard import stage_task
from tasks.stages.recipe import Recipe
from tasks.stages.recipe_method import AdvantageSection
from tasks.stages.score_atoms import load_rollout_rows
from tasks.store.stage import StageRef, make_key, run_stage
from tasks.store.store import Store

STAGE = "compute_advantages"


def credit_config(section: AdvantageSection) -> CreditConfig:
    """The maths' config from the recipe's `advantage` section (every field but `kind` and
    `scalar_steps`, which the trainer applies: `tasks.stages.train_epoch`)."""
    return CreditConfig(**section.model_dump(exclude={"kind", "scalar_steps"}))


def atom_batch(score_rows: list[dict], prompt_ids: list[str], group_size: int,
               parents: dict[tuple[str, str], list[str]]) -> tuple[list[list[str]], AtomBatch]:
    """(each prompt's atom ids, in the order of its first sample's rows; the batch) from
    `atom_scores` rows (prompt_id, sample_index, atom_id, atom_type, score, heatmap as a
    row-major list, heatmap_h, heatmap_w) of the G = group_size samples of each prompt in
    `prompt_ids` (batch order), and each atom's direct parents by (prompt_id, atom_id)."""
    by_key: dict[tuple[str, int], list[dict]] = {}
    for r in score_rows:
        by_key.setdefault((r["prompt_id"], r["sample_index"]), []).append(r)
    missing = [(pid, gi) for pid in prompt_ids for gi in range(group_size)
               if (pid, gi) not in by_key]
    if missing:
        raise ValueError(f"atom scores are missing for (prompt, sample) {missing[:5]}; the "
                         f"scores stage must cover every sample of the rollout")
    atom_ids = [[r["atom_id"] for r in by_key[(pid, 0)]] for pid in prompt_ids]
    b, g, a_max = len(prompt_ids), group_size, max(len(ids) for ids in atom_ids)
    first = by_key[(prompt_ids[0], 0)][0]
    hh, ww = first["heatmap_h"], first["heatmap_w"]
    scores = torch.zeros(b, g, a_max, dtype=torch.float64)  # [B, G, A]
    heat = torch.zeros(b, g, a_max, hh, ww, dtype=torch.float32)  # [B, G, A, H, W]
    mask = torch.zeros(b, a_max, dtype=torch.bool)  # [B, A]
    types = torch.zeros(b, a_max, dtype=torch.int64)  # [B, A] index into ATOM_TYPES
    parent = torch.zeros(b, a_max, a_max, dtype=torch.bool)  # [B, A, A]
    for bi, pid in enumerate(prompt_ids):
        index = {a: i for i, a in enumerate(atom_ids[bi])}
        mask[bi, :len(index)] = True
        for ai, r in enumerate(by_key[(pid, 0)]):
            types[bi, ai] = ATOM_TYPES.index(r["atom_type"])
            for p in parents[(pid, r["atom_id"])]:
                parent[bi, ai, index[p]] = True
        for gi in range(g):
            for r in by_key[(pid, gi)]:
                ai = index[r["atom_id"]]
                scores[bi, gi, ai] = r["score"]
                heat[bi, gi, ai] = torch.from_numpy(np.asarray(r["heatmap"], np.float32)
                                                    ).view(hh, ww)
    return atom_ids, AtomBatch(scores, heat, mask, types, parent)


def advantage_rows(keys: dict, prompt_ids: list[str], atom_ids: list[list[str]],
                   credit: BatchCredit, blob_path: str, blob_hash: str,
                   grid: tuple[int, int]) -> tuple[list[dict], list[dict]]:
    """(`advantages` rows, one per sample and atom; `advantage_maps` rows, one per sample) of
    one batch's credit; keys = the columns every row shares (run_id, iteration)."""
    adv, a, g = credit.atoms, credit.advantages, credit.rewards.shape[1]
    adv_rows, map_rows = [], []
    for bi, pid in enumerate(prompt_ids):
        for gi in range(g):
            i, sample = bi * g + gi, {**keys, "prompt_id": pid, "sample_index": gi}
            adv_rows += [{**sample, "atom_id": atom, "advantage": float(a[bi, gi, ai]),
                          "group_mean": float(adv.mean[bi, ai]),
                          "group_std": float(adv.std[bi, ai]),
                          "zero_variance": bool(adv.zero_variance[bi, ai]),
                          "gated": bool(credit.gated[bi, gi, ai])}
                         for ai, atom in enumerate(atom_ids[bi])]
            map_rows.append({**sample, "reward": float(credit.rewards[bi, gi]),
                             "scalar_advantage": float(credit.scalar.advantages[bi, gi]),
                             "blob_index": i, "map_path": blob_path, "map_hash": blob_hash,
                             "map_h": grid[0], "map_w": grid[1], "mass": float(credit.mass[i]),
                             "coverage": float(credit.coverage[i])})
    return adv_rows, map_rows


def _log_prob_grid(store: Store, latents_path: str) -> tuple[int, int]:
    with safe_open(str(store.resolve(latents_path)), framework="pt") as f:
        shape = f.get_slice("log_probs").get_shape()  # [N, K, h, w]
    return int(shape[-2]), int(shape[-1])


def _parents(store: Store, run_id: str,
             prompt_ids: list[str]) -> dict[tuple[str, str], list[str]]:
    """Each atom's direct parents by (prompt_id, atom_id), from the run's `atoms` rows of
    `prompt_ids` only (the run's table holds every prompt of the training set)."""
    wanted = (pc.field("run_id") == run_id) & pc.field("prompt_id").isin(sorted(set(prompt_ids)))
    table = store.read_table("atoms", wanted)
    return {(r["prompt_id"], r["atom_id"]): r["parents"]
            for r in table.select(["prompt_id", "atom_id", "parents"]).to_pylist()}


def cache_key(store: Store, recipe: Recipe, rollouts: StageRef, scores: StageRef) -> str:
    return make_key(STAGE, {"advantage": recipe.section_hash("advantage")},
                    {"scores": scores.content_hash, "rollouts": rollouts.content_hash})


def compute_advantages(store: Store, recipe: Recipe, rollouts: StageRef, scores: StageRef,
                       iteration: int) -> StageRef:
    run_id, g = recipe.run.name, recipe.prompts.group_size

    def body():
        samples = load_rollout_rows(store, rollouts)  # in blob order: prompt-major, G per prompt
        prompt_ids = [samples[i]["prompt_id"] for i in range(0, len(samples), g)]
        score_rows = store.read_output(scores, "atom_scores").to_pylist()
        atom_ids, batch = atom_batch(score_rows, prompt_ids, g, _parents(store, run_id, prompt_ids))
        grid = _log_prob_grid(store, samples[0]["latents_path"])
        credit = batch_credit(batch, credit_config(recipe.advantage), grid, len(ATOM_TYPES))
        blob = store.put_tensors({"maps": credit.maps,
                                  "scalar": credit.scalar.advantages.reshape(-1).float(),
                                  "atom": credit.atom, "type_maps": credit.type_maps})
        adv_rows, map_rows = advantage_rows({"run_id": run_id, "iteration": iteration},
                                            prompt_ids, atom_ids, credit, blob.path,
                                            blob.sha256, grid)
        part = f"{run_id}-{iteration:05d}"
        return [blob, store.write_table("advantages", adv_rows, part),
                store.write_table("advantage_maps", map_rows, part)]

    return run_stage(store, run_id, iteration, STAGE,
                     cache_key(store, recipe, rollouts, scores), body)


compute_advantages_task = stage_task(compute_advantages, STAGE, cache_key)
