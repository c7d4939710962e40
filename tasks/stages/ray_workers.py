"""The Ray executor (`run.executor = "ray"`): the run's resident actors as the stage bodies call
them (`Workers`), the shards they split a stage into, and the cluster they run on.

The actors themselves are `tasks.stages.ray_actors`: policy actors (`PolicyWorker`,
`ray.rollout_workers` of them), each holding the backbone with the current LoRA across stages
and iterations, and scorer actors (`ScorerWorker`) holding the recipe's scorer. A rollout splits
the iteration's prompt groups into contiguous shards, one an actor; each shard's samples (window
steps and images) are written through the store as one content-addressed blob, and the stage
reads them back in shard order and writes the same blobs and rows as one process would (seeds
derive from (run seed, iteration, prompt id, sample index), never from a position in a batch).
The training runs on the first `ray.train_workers` policy actors, data-parallel when there are
several, and rank 0 writes. The samples to score are split between the scorer actors, each with
all its atoms. An evaluation (`tasks.stages.evaluate`) samples on the policy actors in shards of
whole chunks and scores on the scorer actors. ReCAST's gains, the window calibration's curves
and a local LLM builder's graphs are computed on the first policy actor. The rollout's and the
calibration's progress is relayed from the actors to the stage's bar in the flow's process
(`tasks.stages.ray_progress`). The stage's completion record is written by `run_stage` after
the body returns, so after every shard has finished. A remote scorer service
(`scorer.kind = "remote"`) stays the option for scorers on other machines: the scorer actors
then call it.

Scheduling is Ray's: actors are placed by the resources they reserve (`[ray]` section), named
per run (`<run>-policy-<i>`, `<run>-scorer-<i>` in namespace "cast", so a later flow run on the
same cluster finds them loaded; with them the run's progress counter, `<run>-progress`, which
reserves nothing), and restarted by Ray when their process dies, the call in flight retried on
the new process (`max_restarts`, `max_task_retries`): a shard is redone whole, and its blob,
content-addressed, is written once whatever the tries. The stages stay plain functions;
Prefect's task runner is not involved (docs/design.md, "The Ray executor", says why).

Ray is imported inside the functions that need it: the local executor never imports it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cast_core.csg.graph import SceneGraph
from cast_core.recast_gains import RecastGains
from cast_core.rollout import Rollout
from tasks.stages.build_csgs import CsgRows
from tasks.stages.calibrate_window import MeasuredCurves, calibration_bar
from tasks.stages.policy_state import PolicyState
from tasks.stages.ray_actors import PolicyWorker, ScorerWorker
from tasks.stages.ray_progress import remote_progress, start_counter
from tasks.stages.recast_gains import RecastConfig
from tasks.stages.recipe import Recipe
from tasks.stages.rollout import Sampled, rollout_bar
from tasks.stages.train_epoch import Trained
from tasks.stages.train_group import Group
from tasks.store.records import BlobRef
from tasks.store.store import Store

NAMESPACE = "cast"
RETRIES = 2  # restarts of a dead actor, and tries of the call it had in flight
STRAGGLER_S = 30.0  # after a training rank failed, how long the others get to fail too
_REPO_ROOT = Path(__file__).resolve().parents[2]  # this file is tasks/stages/ray_workers.py
_ROLLOUT_KEYS = ("x0", "latents", "next_latents", "log_probs")  # per sample; t, t_next shared


def shards(items: Sequence, n: int) -> list[list]:
    """`items` in n contiguous parts whose sizes differ by at most one (empty ones dropped)."""
    parts = [list(items[i * len(items) // n:(i + 1) * len(items) // n]) for i in range(n)]
    return [p for p in parts if p]


@dataclass(frozen=True)
class Workers:
    """Handles of the run's resident actors; what the stages call with the Ray executor."""

    policy: tuple
    scorers: tuple
    counter: Any  # the `ray_progress.ProgressCounter` the actors count their progress into

    def rollout(self, store: Store, recipe: Recipe, policy: PolicyState, window_row: dict,
                picks: list[dict], iteration: int) -> Sampled:
        """The groups of `picks` sampled in shards -> their samples, prompt-major; the actors'
        progress moves the local stage's bar here (`rollout.rollout_bar`, a shard's chunks
        counted apart)."""
        parts = shards(picks, len(self.policy))
        g = recipe.prompts.group_size
        with remote_progress(*rollout_bar([len(p) * g for p in parts], recipe.sampling,
                                          iteration), self.counter) as bar:
            calls = [actor.rollout_shard.remote(str(store.root), recipe, policy, window_row,
                                                part, iteration, bar.tally)
                     for actor, part in zip(self.policy, parts)]
            blobs = bar.get(calls)
        return _gather(store, blobs)

    def score(self, store: Store, recipe: Recipe, rows: list[dict], graphs: list[SceneGraph]
              ) -> tuple[str, list[tuple[np.ndarray, np.ndarray]]]:
        """(scorer id, results in row order) from the rows scored in shards."""
        import ray

        index = shards(range(len(rows)), len(self.scorers))
        calls = [actor.score_shard.remote(str(store.root), recipe, [rows[i] for i in part],
                                          [graphs[i] for i in part])
                 for actor, part in zip(self.scorers, index)]
        return _one_scorer(ray.get(calls))

    def sample_eval(self, store: Store, recipe: Recipe, policy: PolicyState, prompts: list[str],
                    seeds: list[int]) -> torch.Tensor:
        """An evaluation's images, sampled on the policy actors in shards of whole chunks of
        `sampling.chunk_size` (the batches one process samples) -> [N, 3, H, W] in prompt order."""
        import ray

        parts = chunk_shards(len(prompts), recipe.sampling.chunk_size, len(self.policy))
        calls = [actor.eval_shard.remote(str(store.root), recipe, policy, prompts[lo:hi],
                                         seeds[lo:hi])
                 for actor, (lo, hi) in zip(self.policy, parts)]
        return torch.cat(ray.get(calls))

    def score_images(self, recipe: Recipe, images: torch.Tensor, graphs: list[SceneGraph]
                     ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Images [N, 3, H, W] scored on the scorer actors in shards of whole chunks -> each
        image's (scores [A], heatmaps [A, h, w]) in image order."""
        import ray

        parts = chunk_shards(len(images), recipe.sampling.chunk_size, len(self.scorers))
        calls = [actor.score_images.remote(recipe, images[lo:hi], graphs[lo:hi])
                 for actor, (lo, hi) in zip(self.scorers, parts)]
        return _one_scorer(ray.get(calls))[1]

    def calibration_curves(self, recipe: Recipe, prompts: list[str], seeds: list[int]
                           ) -> MeasuredCurves:
        """The window calibration's curves, measured on the first policy actor; its progress
        moves the local stage's bar here (`calibrate_window.calibration_bar`)."""
        with remote_progress(*calibration_bar(len(prompts), recipe.sampling),
                             self.counter) as bar:
            call = self.policy[0].calibration_curves.remote(recipe, prompts, seeds, bar.tally)
            return bar.get([call])[0]

    def csg_rows(self, recipe: Recipe, lines: list[tuple[int, dict]]) -> CsgRows:
        """The build_csgs rows of the prompt file's `lines`, built on the first policy actor."""
        import ray

        return ray.get(self.policy[0].csg_rows.remote(recipe, lines))

    def recast_gains(self, store: Store, recipe: Recipe, config: RecastConfig,
                     policy: PolicyState) -> RecastGains:
        """ReCAST's gains (`recast_gains.estimate`) of `policy` (no LoRA: the base model) on the
        first policy actor, its images scored on the scorer actors."""
        import ray

        return ray.get(self.policy[0].recast_gains.remote(str(store.root), recipe, config,
                                                          policy, self))

    def train(self, store: Store, recipe: Recipe, policy: PolicyState, *inputs: Any) -> Trained:
        """The iteration's training on the first policy actor, or data-parallel on the first
        `ray.train_workers` of them -> rank 0's result (the one that wrote)."""
        import ray

        root, trainers = str(store.root), self.policy[:recipe.ray.train_workers]
        if len(trainers) == 1:
            return ray.get(trainers[0].train.remote(root, recipe, policy, None, *inputs))
        address = ray.get(trainers[0].rendezvous.remote())
        # a rank retried alone could never meet the others: a failed group training fails the
        # stage, which the next flow run redoes (rank 0 writes only after every rank finished)
        calls = [actor.train.options(max_task_retries=0).remote(
                     root, recipe, policy, Group(address, rank, len(trainers)), *inputs)
                 for rank, actor in enumerate(trainers)]
        try:
            return ray.get(calls)[0]
        except Exception:
            _restart_stragglers(trainers, calls)
            raise

    def loads(self) -> dict[str, list]:
        """Each actor's load counts: {"policy": [Loads], "scorer": [int]}."""
        import ray

        return {"policy": ray.get([a.loads.remote() for a in self.policy]),
                "scorer": ray.get([a.loads.remote() for a in self.scorers])}

    def release(self) -> None:
        """End the actors (they are otherwise kept, loaded, for the run's next flow call)."""
        import ray

        for actor in (*self.policy, *self.scorers, self.counter):
            ray.kill(actor, no_restart=True)


def chunk_shards(n: int, chunk: int, workers: int) -> list[tuple[int, int]]:
    """n items as at most `workers` contiguous [lo, hi) runs of whole chunks of `chunk` (only the
    last run may end in a short chunk)."""
    return [(part[0], min(part[-1] + chunk, n)) for part in shards(range(0, n, chunk), workers)]


def _one_scorer(answers: list[tuple[str, list]]) -> tuple[str, list]:
    """The scorer actors' (scorer id, results) answers -> (the id, results in shard order)."""
    ids = {scorer_id for scorer_id, _ in answers}
    if len(ids) != 1:
        raise RuntimeError(f"the scorer actors answered with different scorer ids {ids}; "
                           f"they must load the same scorer")
    return ids.pop(), [result for _, results in answers for result in results]


def _restart_stragglers(actors: Sequence, calls: list) -> None:
    """After a rank of a group training failed: restart the ranks still in it (a lost peer can
    leave them waiting in a collective until `train_group.TIMEOUT`), so that the actors answer
    the next call; they reload the backbone."""
    import ray

    _, running = ray.wait(calls, num_returns=len(calls), timeout=STRAGGLER_S)
    for actor, call in zip(actors, calls):
        if call in running:
            ray.kill(actor, no_restart=False)


def _gather(store: Store, parts: list[BlobRef]) -> Sampled:
    """The shards' blobs read back in shard order and concatenated; the shard blobs, now in the
    stage's own blobs, are removed."""
    loaded = [store.get_tensors(p) for p in parts]
    rollout = Rollout(**{k: torch.cat([t[k] for t in loaded]) for k in _ROLLOUT_KEYS},
                      t=loaded[0]["t"], t_next=loaded[0]["t_next"])
    images = torch.cat([t["images"] for t in loaded])  # uint8 [N, 3, H, W]
    for part in parts:
        store.resolve(part.path).unlink(missing_ok=True)
    return Sampled(rollout, images)


def connect(recipe: Recipe) -> Workers:
    """Join (or start, `ray.address = ""`) the cluster and get the run's actors, creating the
    ones not running yet; an error when the cluster cannot hold what the recipe reserves."""
    import ray

    r = recipe.ray
    if not ray.is_initialized():
        init_ray(r.address)
    _check_capacity(recipe, ray.cluster_resources())
    options = {"namespace": NAMESPACE, "get_if_exists": True, "lifetime": "detached",
               "max_restarts": RETRIES, "max_task_retries": RETRIES,
               "runtime_env": _runtime_env()}
    policy = ray.remote(PolicyWorker)
    score = ray.remote(ScorerWorker)
    run = recipe.run.name
    return Workers(
        tuple(policy.options(name=f"{run}-policy-{i}", num_gpus=r.num_gpus,
                             num_cpus=r.num_cpus, **options).remote()
              for i in range(r.rollout_workers)),
        tuple(score.options(name=f"{run}-scorer-{i}", num_gpus=r.scorer_num_gpus,
                            num_cpus=r.scorer_num_cpus, **options).remote()
              for i in range(r.scorer_workers)),
        start_counter(name=f"{run}-progress", **options))


def _runtime_env() -> dict:
    """The actors' runtime environment: the driver's code on their import path (a shared disk)."""
    return {"env_vars": {"PYTHONPATH": str(_REPO_ROOT)}}


def init_ray(address: str, **options: Any) -> None:
    """`ray.init` in namespace "cast": join the cluster at `address` (or `$RAY_ADDRESS`), or
    start a local one whose workers run at nice 0. Ray starts its workers at nice 15 by default
    (`worker_niceness`, to keep its own daemons responsive); the actors are the run's compute,
    and at nice 15 any other load on the machine starves them (a cluster started with
    `ray start` takes `RAY_worker_niceness=0` in its environment instead). `options` go to
    `ray.init` (e.g. `num_cpus`)."""
    import ray

    joins = address or os.environ.get("RAY_ADDRESS")
    local = {} if joins else {"_system_config": {"worker_niceness": 0}}
    ray.init(address=address or None, namespace=NAMESPACE, **local, **options)


def _check_capacity(recipe: Recipe, cluster: dict[str, float]) -> None:
    r = recipe.ray
    for resource, per_policy, per_scorer, field in (
            ("CPU", r.num_cpus, r.scorer_num_cpus, "num_cpus"),
            ("GPU", r.num_gpus, r.scorer_num_gpus, "num_gpus")):
        wanted = r.rollout_workers * per_policy + r.scorer_workers * per_scorer
        if wanted > cluster.get(resource, 0.0) + 1e-9:
            raise RuntimeError(
                f"the recipe's actors reserve {wanted:g} {resource} ({r.rollout_workers} x "
                f"ray.{field} + {r.scorer_workers} x ray.scorer_{field}) but the Ray cluster has "
                f"{cluster.get(resource, 0.0):g}; they would wait forever: lower the workers or "
                f"their resources, or add nodes")


@contextmanager
def executor(recipe: Recipe) -> Iterator[Workers | None]:
    """What the stages compute on: None for `run.executor = "local"`, else the run's actors."""
    yield connect(recipe) if recipe.run.executor == "ray" else None
