"""Stage `compute_advantages`: atom scores -> per-atom group z-scores (`advantages`), the per-sample
pixel advantage map pooled onto the log-prob grid, and the Flow-GRPO scalar advantage of the same
sample (`advantage_maps`, maps in one safetensors blob, row `blob_index`).

The blob holds, row i = the sample's `blob_index` (N samples, h x w log-prob grid):
- `maps` [N, h, w]: CAST's clamped pixel map (`cast_core.advantage.pixel_advantage_map`), pooled;
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
Cached on the atom scores' content hash, the rollout's and the advantage section.
"""

from __future__ import annotations

import numpy as np
import torch
from safetensors import safe_open

from cast_core.advantage import (
    atom_advantages,
    atom_mean_credit,
    atom_reward,
    gate_by_parents,
    group_heatmaps,
    grouped_advantage_maps,
    pixel_advantage_map,
    pool_to_grid,
    scalar_advantages,
)
from cast_core.csg.graph import ATOM_TYPES
from tasks.recipe import Recipe
from tasks.score_atoms import load_rollout_rows
from tasks.stage import StageRef, make_key, run_stage, stage_task
from tasks.store import Store

STAGE = "compute_advantages"


def _log_prob_grid(store: Store, latents_path: str) -> tuple[int, int]:
    with safe_open(str(store.resolve(latents_path)), framework="pt") as f:
        shape = f.get_slice("log_probs").get_shape()  # [N, K, h, w]
    return int(shape[-2]), int(shape[-1])


def _parents(store: Store, run_id: str, prompt_ids: list[str], atom_ids: list[list[str]],
             a_max: int) -> torch.Tensor:
    """parents [B, A, A] bool from the run's `atoms` rows."""
    table = store.read_table("atoms", {"run_id": run_id})
    rows = {(r["prompt_id"], r["atom_id"]): r["parents"]
            for r in table.select(["prompt_id", "atom_id", "parents"]).to_pylist()}
    out = torch.zeros(len(prompt_ids), a_max, a_max, dtype=torch.bool)
    for b, (pid, ids) in enumerate(zip(prompt_ids, atom_ids)):
        index = {a: i for i, a in enumerate(ids)}
        for a, atom in enumerate(ids):
            for parent in rows[(pid, atom)]:
                out[b, a, index[parent]] = True
    return out


def cache_key(store: Store, recipe: Recipe, rollouts: StageRef, scores: StageRef) -> str:
    return make_key(STAGE, {"advantage": recipe.section_hash("advantage")},
                    {"scores": scores.content_hash, "rollouts": rollouts.content_hash})


def compute_advantages(store: Store, recipe: Recipe, rollouts: StageRef, scores: StageRef,
                       iteration: int) -> StageRef:
    run_id, cfg = recipe.run.name, recipe.advantage

    def body():
        samples = load_rollout_rows(store, rollouts)  # in blob order: prompt-major, G per prompt
        g = recipe.prompts.group_size
        prompt_ids = [samples[i]["prompt_id"] for i in range(0, len(samples), g)]
        b = len(prompt_ids)
        table = store.read_output(scores, "atom_scores")
        by_key = {}
        for r in table.to_pylist():
            by_key.setdefault((r["prompt_id"], r["sample_index"]), []).append(r)
        atom_ids = [[r["atom_id"] for r in by_key[(pid, 0)]] for pid in prompt_ids]
        a_max = max(len(ids) for ids in atom_ids)
        first = by_key[(prompt_ids[0], 0)][0]
        hh, ww = first["heatmap_h"], first["heatmap_w"]
        s = torch.zeros(b, g, a_max, dtype=torch.float64)  # [B, G, A]
        heat = torch.zeros(b, g, a_max, hh, ww, dtype=torch.float32)  # [B, G, A, H, W]
        mask = torch.zeros(b, a_max, dtype=torch.bool)  # [B, A]
        types = torch.zeros(b, a_max, dtype=torch.int64)  # [B, A] index into ATOM_TYPES
        for bi, pid in enumerate(prompt_ids):
            mask[bi, :len(atom_ids[bi])] = True
            for ai, r in enumerate(by_key[(pid, 0)]):
                types[bi, ai] = ATOM_TYPES.index(r["atom_type"])
            for gi in range(g):
                for ai, r in enumerate(by_key[(pid, gi)]):
                    s[bi, gi, ai] = r["score"]
                    heat[bi, gi, ai] = torch.from_numpy(np.asarray(r["heatmap"], np.float32)
                                                        ).view(hh, ww)
        adv = atom_advantages(s, mask, cfg.std_floor, cfg.atom_norm)
        a = adv.advantages
        gated = torch.zeros_like(a, dtype=torch.bool)  # [B, G, A]
        if cfg.gate_by_parents:
            parents = _parents(store, run_id, prompt_ids, atom_ids, a_max)
            a = gate_by_parents(a, s, parents)
            gated = gate_by_parents(torch.ones_like(a), s, parents) == 0
        rewards = atom_reward(s, mask, cfg.reward)  # [B, G]
        scalar = scalar_advantages(rewards, cfg.scalar_mode, cfg.std_floor)
        flat_a = a.reshape(b * g, a_max).float()  # [N, A]
        flat_heat = group_heatmaps(heat, cfg.heatmap_source).reshape(b * g, a_max, hh, ww)
        flat_mask = mask.repeat_interleave(g, 0)  # [N, A]
        pix = pixel_advantage_map(flat_a, flat_heat, flat_mask, cfg.global_weight, cfg.clip,
                                  cfg.heatmap_norm, cfg.spatial_mix)
        by_type = grouped_advantage_maps(flat_a, flat_heat, flat_mask,
                                         types.repeat_interleave(g, 0), len(ATOM_TYPES),
                                         cfg.global_weight, cfg.heatmap_norm,
                                         cfg.spatial_mix)  # [N, 4, H, W]
        h, w = _log_prob_grid(store, samples[0]["latents_path"])
        maps = pool_to_grid(pix.map, h, w)  # [N, h, w]
        type_maps = pool_to_grid(by_type.flatten(0, 1), h, w).view(b * g, len(ATOM_TYPES), h, w)
        blob = store.put_tensors({"maps": maps, "scalar": scalar.advantages.reshape(-1).float(),
                                  "atom": atom_mean_credit(flat_a, flat_mask, cfg.clip),
                                  "type_maps": type_maps})
        adv_rows, map_rows = [], []
        for bi, pid in enumerate(prompt_ids):
            for gi in range(g):
                i = bi * g + gi
                keys = {"run_id": run_id, "iteration": iteration, "prompt_id": pid,
                        "sample_index": gi}
                adv_rows += [{**keys, "atom_id": atom, "advantage": float(a[bi, gi, ai]),
                              "group_mean": float(adv.mean[bi, ai]),
                              "group_std": float(adv.std[bi, ai]),
                              "zero_variance": bool(adv.zero_variance[bi, ai]),
                              "gated": bool(gated[bi, gi, ai])}
                             for ai, atom in enumerate(atom_ids[bi])]
                map_rows.append({**keys, "reward": float(rewards[bi, gi]),
                                 "scalar_advantage": float(scalar.advantages[bi, gi]),
                                 "blob_index": i, "map_path": blob.path, "map_hash": blob.sha256,
                                 "map_h": h, "map_w": w, "mass": float(pix.mass[i]),
                                 "coverage": float(pix.coverage[i].mean())})
        part = f"{run_id}-{iteration:05d}"
        return [blob, store.write_table("advantages", adv_rows, part),
                store.write_table("advantage_maps", map_rows, part)]

    return run_stage(store, run_id, iteration, STAGE,
                     cache_key(store, recipe, rollouts, scores), body)


compute_advantages_task = stage_task(compute_advantages, STAGE, cache_key)
