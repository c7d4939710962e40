"""What runs inside the Ray executor's actors (`tasks.stages.ray_workers` creates them and
calls them from the flow's process).

A policy actor (`PolicyWorker`, `ray.rollout_workers` of them) holds a `ResidentPolicy`: the
backbone is loaded once and kept, with the current LoRA, across stages and iterations; only the
adapter's weights are swapped when the policy hash changes. It samples a rollout shard (written
through the store as one content-addressed blob) or an evaluation shard, estimates ReCAST's gains
(its images scored on the scorer actors), measures the window calibration's curves (adapter off:
the base model), builds a local LLM builder's graphs, and trains: alone, or as one rank of the
data-parallel group the first `ray.train_workers` of them join for the call
(`tasks.stages.train_group`), reading only its own samples' window steps; it then holds the
trained policy, so its next rollout reloads nothing. A rollout shard and the calibration count
their ODE steps for the flow's progress bar (`tasks.stages.ray_progress`). A scorer actor
(`ScorerWorker`) holds the recipe's scorer, reloaded only when the scorer section changes, and
scores the rows or images it is given, each with all its atoms.

Nothing here imports Ray: `ray_workers.connect` makes these classes actors.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from cast_core.csg.graph import SceneGraph
from cast_core.data_parallel import SOLO
from cast_core.lora import reference_mode
from cast_core.recast_gains import RecastGains
from tasks.stages.build_csgs import CsgRows, csg_rows
from tasks.stages.calibrate_window import MeasuredCurves, measure_curves
from tasks.stages.models import graph_builder, scorer, set_threads
from tasks.stages.policy_state import PolicyState
from tasks.stages.recast_gains import RecastConfig, estimate
from tasks.stages.recipe import Recipe
from tasks.stages.resident import Loads, ResidentPolicy
from tasks.stages.rollout import rollout_spec, sample_groups
from tasks.stages.score_atoms import score_in_chunks, score_rows
from tasks.stages.train_epoch import Trained, train_and_write
from tasks.stages.train_group import Group, joined, rendezvous
from tasks.store.records import BlobRef
from tasks.store.store import Store

if TYPE_CHECKING:
    from tasks.stages.ray_workers import Workers


class PolicyWorker:
    """A policy actor's state and calls (made a Ray actor by `ray_workers.connect`)."""

    def __init__(self) -> None:
        self.resident = ResidentPolicy()
        self.samples_read: tuple[int, ...] = ()  # by its last training: its rank's samples

    def rollout_shard(self, root: str, recipe: Recipe, policy: PolicyState, window_row: dict,
                      picks: list[dict], iteration: int,
                      progress: Callable[[int], object] | None = None) -> BlobRef:
        """Sample the groups of `picks` -> the blob of their window steps and images.
        `progress` is called after each ODE step of each chunk (a `ray_progress.Tally`, which
        counts it for the flow's progress bar)."""
        store = Store(root)
        set_threads(recipe)
        backbone, _ = self.resident.get(store, recipe, policy)
        sampled = sample_groups(backbone, recipe, rollout_spec(recipe, window_row), picks,
                                iteration, progress)
        r = sampled.rollout
        return store.put_tensors({"x0": r.x0, "latents": r.latents,
                                  "next_latents": r.next_latents, "log_probs": r.log_probs,
                                  "t": r.t, "t_next": r.t_next, "images": sampled.images})

    def eval_shard(self, root: str, recipe: Recipe, policy: PolicyState, prompts: list[str],
                   seeds: list[int]) -> torch.Tensor:
        """An evaluation's ODE samples of `prompts` with the held policy -> images [n, 3, H, W]
        float32 in [0, 1] on the CPU (`evaluate.sample_images`)."""
        from tasks.stages.evaluate import sample_images  # evaluate imports ray_workers, this

        set_threads(recipe)
        backbone, _ = self.resident.get(Store(root), recipe, policy)
        return sample_images(backbone, prompts, seeds, recipe)

    def recast_gains(self, root: str, recipe: Recipe, config: RecastConfig, policy: PolicyState,
                     workers: Workers) -> RecastGains:
        """`recast_gains.estimate` on the held policy (its adapter off for the base model: the
        local stage's `load_base`), scored on the scorer actors of `workers`."""
        set_threads(recipe)
        backbone, _ = self.resident.get(Store(root), recipe, policy)

        def score(images: torch.Tensor, graphs: list[SceneGraph]) -> list:
            return workers.score_images(recipe, images, graphs)

        with reference_mode(backbone) if policy.lora_path is None else nullcontext():
            return estimate(recipe, config, backbone, score)

    def calibration_curves(self, recipe: Recipe, prompts: list[str], seeds: list[int],
                           progress: Callable[[int], object] | None = None) -> MeasuredCurves:
        """`calibrate_window.measure_curves` on the held backbone with its adapter off (the base
        model, as the local stage's `load_base`); the embedder is loaded for the call.
        `progress` is called after each ODE step of each chunk (a `ray_progress.Tally`, which
        counts it for the flow's progress bar)."""
        set_threads(recipe)
        backbone = self.resident.base(recipe)
        with reference_mode(backbone):
            return measure_curves(backbone, recipe, prompts, seeds, progress)

    def csg_rows(self, recipe: Recipe, lines: list[tuple[int, dict]]) -> CsgRows:
        """`build_csgs.csg_rows` with the recipe's builder (a local LLM) loaded for the call; it
        is freed when the call returns, and on a fresh run before the backbone first loads."""
        set_threads(recipe)
        return csg_rows(recipe, lines, graph_builder(recipe))

    def rendezvous(self) -> str:
        """An address on this actor's node where a training group can meet."""
        return rendezvous()

    def train(self, root: str, recipe: Recipe, policy: PolicyState, group: Group | None,
              *inputs: Any) -> Trained:
        """`train_epoch.train_and_write` on the held policy, alone (`group` None) or as one rank
        of the training group; the actor then holds the trained policy."""
        store = Store(root)
        backbone, params = self.resident.get(store, recipe, policy)
        device = next(backbone.transformer.parameters()).device
        try:
            with nullcontext(SOLO) if group is None else joined(group, device) as shard:
                trained = train_and_write(store, recipe, backbone, params, policy, *inputs,
                                          shard=shard)
        except BaseException:
            self.resident.forget()
            raise
        self.resident.trained(trained.policy_hash)
        self.samples_read = trained.samples_read
        return trained

    def loads(self) -> Loads:
        return self.resident.loads


class ScorerWorker:
    """A scorer actor's state and calls: the recipe's scorer, loaded once per scorer section."""

    def __init__(self) -> None:
        self._section: str | None = None
        self._scorer: tuple[str, Any] | None = None
        self.load_count = 0

    def score_shard(self, root: str, recipe: Recipe, rows: list[dict],
                    graphs: list[SceneGraph]) -> tuple[str, list[tuple[np.ndarray, np.ndarray]]]:
        """(scorer id, each row's (scores [A], heatmaps [A, h, w])) for rollout `rows`."""
        scorer_id, score = self._held(recipe)
        return scorer_id, score_rows(Store(root), score, rows, graphs, recipe.sampling.chunk_size)

    def score_images(self, recipe: Recipe, images: torch.Tensor, graphs: list[SceneGraph]
                     ) -> tuple[str, list[tuple[np.ndarray, np.ndarray]]]:
        """(scorer id, each image's (scores [A], heatmaps [A, h, w])) for images [n, 3, H, W]."""
        scorer_id, score = self._held(recipe)
        return scorer_id, score_in_chunks(score, images, graphs, recipe.sampling.chunk_size)

    def _held(self, recipe: Recipe) -> tuple[str, Any]:
        """The recipe's (scorer id, scorer), loaded when its scorer section changed."""
        set_threads(recipe)
        section = recipe.scorer.model_dump_json()
        if section != self._section:
            self._scorer, self._section = scorer(recipe), section
            self.load_count += 1
        return self._scorer

    def loads(self) -> int:
        return self.load_count
