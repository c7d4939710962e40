"""The Ray executor (`run.executor = "ray"`): resident policy and scorer actors that the stage
bodies call, and the shards they split a stage into.

Policy actors (`PolicyWorker`, `ray.rollout_workers` of them) each hold a `ResidentPolicy`: the
backbone is loaded once and kept, with the current LoRA, across stages and iterations; only the
adapter's weights are swapped when the policy hash changes. A rollout splits the iteration's
prompt groups into contiguous shards, one an actor; each shard's samples (window steps and
images) are written through the store as one content-addressed blob, and the stage reads them
back in shard order and writes the same blobs and rows as one process would (seeds derive from
(run seed, iteration, prompt id, sample index), never from a position in a batch). The training
runs on the first `ray.train_workers` policy actors, data-parallel when there are several: they
join a torch.distributed group for the call (`tasks.stages.train_group`), each reads its own
samples' window steps from the store and trains its part of every optimizer step, and rank 0
writes; each then holds the trained policy, so the next
rollout on it reloads nothing. Scorer actors (`ScorerWorker`) hold the recipe's scorer; the samples to score are
split between them, each with all its atoms, and each actor reads its images from the store. An
evaluation (`tasks.stages.evaluate`) runs on the same actors: its images sampled by the policy
actors in shards of whole chunks, and scored by the scorer actors, passed through Ray. ReCAST's
gains (`tasks.stages.recast_gains`) are estimated on the first policy actor with the policy it
holds, its images scored on the scorer actors (the policy actor calls them); so are the window
calibration's curves (adapter off: the base model) and a local LLM builder's graphs. The
stage's completion record is written by `run_stage` after the body returns, so after every shard
has finished. A remote scorer service (`scorer.kind = "remote"`) stays the option for scorers on
other machines: the scorer actors then call it.

Scheduling is Ray's: actors are placed by the resources they reserve (`[ray]` section), named
per run (`<run>-policy-<i>`, `<run>-scorer-<i>` in namespace "cast", so a later flow run on the
same cluster finds them loaded), and restarted by Ray when their process dies, the call in flight
retried on the new process (`max_restarts`, `max_task_retries`): a shard is redone whole, and its
blob, content-addressed, is written once whatever the tries. The stages stay plain functions;
Prefect's task runner is not involved (docs/design.md, "The Ray executor", says why).

Ray is imported inside the functions that need it: the local executor never imports it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cast_core.csg.graph import SceneGraph
from cast_core.data_parallel import SOLO
from cast_core.lora import reference_mode
from cast_core.recast_gains import RecastGains
from cast_core.rollout import Rollout
from tasks.stages.build_csgs import CsgRows, csg_rows
from tasks.stages.calibrate_window import MeasuredCurves, measure_curves
from tasks.stages.models import graph_builder, scorer, set_threads
from tasks.stages.policy_state import PolicyState
from tasks.stages.recast_gains import RecastConfig, estimate
from tasks.stages.recipe import Recipe
from tasks.stages.resident import Loads, ResidentPolicy
from tasks.stages.rollout import Sampled, rollout_spec, sample_groups
from tasks.stages.score_atoms import score_in_chunks, score_rows
from tasks.stages.train_epoch import Trained, train_and_write
from tasks.stages.train_group import Group, joined, rendezvous
from tasks.store.records import BlobRef
from tasks.store.store import Store

NAMESPACE = "cast"
RETRIES = 2  # restarts of a dead actor, and tries of the call it had in flight
STRAGGLER_S = 30.0  # after a training rank failed, how long the others get to fail too
_REPO_ROOT = Path(__file__).resolve().parents[2]  # this file is tasks/stages/ray_workers.py
_ROLLOUT_KEYS = ("x0", "latents", "next_latents", "log_probs")  # per sample; t, t_next shared


class PolicyWorker:
    """A policy actor's state and calls (made a Ray actor by `connect`)."""

    def __init__(self) -> None:
        self.resident = ResidentPolicy()
        self.samples_read: tuple[int, ...] = ()  # by its last training: its rank's samples

    def rollout_shard(self, root: str, recipe: Recipe, policy: PolicyState, window_row: dict,
                      picks: list[dict], iteration: int) -> BlobRef:
        """Sample the groups of `picks` -> the blob of their window steps and images."""
        store = Store(root)
        set_threads(recipe)
        backbone, _ = self.resident.get(store, recipe, policy)
        sampled = sample_groups(backbone, recipe, rollout_spec(recipe, window_row), picks,
                                iteration)
        r = sampled.rollout
        return store.put_tensors({"x0": r.x0, "latents": r.latents,
                                  "next_latents": r.next_latents, "log_probs": r.log_probs,
                                  "t": r.t, "t_next": r.t_next, "images": sampled.images})

    def eval_shard(self, root: str, recipe: Recipe, policy: PolicyState, prompts: list[str],
                   seeds: list[int]) -> torch.Tensor:
        """An evaluation's ODE samples of `prompts` with the held policy -> images [n, 3, H, W]
        float32 in [0, 1] on the CPU (`evaluate.sample_images`)."""
        from tasks.stages.evaluate import sample_images  # evaluate imports this module

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

    def calibration_curves(self, recipe: Recipe, prompts: list[str], seeds: list[int]
                           ) -> MeasuredCurves:
        """`calibrate_window.measure_curves` on the held backbone with its adapter off (the base
        model, as the local stage's `load_base`); the embedder is loaded for the call."""
        set_threads(recipe)
        backbone = self.resident.base(recipe)
        with reference_mode(backbone):
            return measure_curves(backbone, recipe, prompts, seeds)

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


def shards(items: Sequence, n: int) -> list[list]:
    """`items` in n contiguous parts whose sizes differ by at most one (empty ones dropped)."""
    parts = [list(items[i * len(items) // n:(i + 1) * len(items) // n]) for i in range(n)]
    return [p for p in parts if p]


@dataclass(frozen=True)
class Workers:
    """Handles of the run's resident actors; what the stages call with the Ray executor."""

    policy: tuple
    scorers: tuple

    def rollout(self, store: Store, recipe: Recipe, policy: PolicyState, window_row: dict,
                picks: list[dict], iteration: int) -> Sampled:
        """The groups of `picks` sampled in shards -> their samples, prompt-major."""
        import ray

        calls = [actor.rollout_shard.remote(str(store.root), recipe, policy, window_row, part,
                                            iteration)
                 for actor, part in zip(self.policy, shards(picks, len(self.policy)))]
        return _gather(store, ray.get(calls))

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
        """The window calibration's curves, measured on the first policy actor."""
        import ray

        return ray.get(self.policy[0].calibration_curves.remote(recipe, prompts, seeds))

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

        for actor in (*self.policy, *self.scorers):
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
    env = {"env_vars": {"PYTHONPATH": str(_REPO_ROOT)}}  # the driver's code, on a shared disk
    options = {"namespace": NAMESPACE, "get_if_exists": True, "lifetime": "detached",
               "max_restarts": RETRIES, "max_task_retries": RETRIES, "runtime_env": env}
    policy = ray.remote(PolicyWorker)
    score = ray.remote(ScorerWorker)
    run = recipe.run.name
    return Workers(
        tuple(policy.options(name=f"{run}-policy-{i}", num_gpus=r.num_gpus,
                             num_cpus=r.num_cpus, **options).remote()
              for i in range(r.rollout_workers)),
        tuple(score.options(name=f"{run}-scorer-{i}", num_gpus=r.scorer_num_gpus,
                            num_cpus=r.scorer_num_cpus, **options).remote()
              for i in range(r.scorer_workers)))


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
