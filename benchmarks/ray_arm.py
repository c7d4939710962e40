"""bench_iteration's executor arms: one iteration through `tasks.stages.iteration`, computed in
this process (`run.executor = "local"`) and on the run's resident Ray actors (`"ray"`), in the
same benchmark run, alternating which goes first, each on its own copy of a store whose
run-level stages are done (iteration 0, nothing skipped, the same prompts and seeds).

What the ratio ray / local measures: Ray's fixed cost on one machine. A timed Ray iteration
opens the executor (`ray_workers.executor`: find the running cluster and the run's actors, as
each flow run does) and runs the iteration's stages on the actors: the calls' pickled arguments,
the rollout shards written as blobs and gathered by this process, the scorer actors reading
their images from the store. The actors are resident, as across a run's iterations: each holds
the backbone already, and only swaps the LoRA (`ResidentPolicy`); the local executor loads the
backbone from disk in the rollout and in the training, as always. By default the Ray arm has one
policy actor (it rolls out and trains, with the recipe's `run.threads`, as the local process does)
and one scorer actor: the same compute, so the ratio is Ray's overhead. Two policy actors on 2
cores (`--set ray.rollout_workers=2 --set ray.num_cpus=0.5`) run two rollout shards of
`run.threads` threads each at once: that measures the cores' oversubscription as well.

Untimed, reported apart: the cluster start (`ray_workers.init_ray`: with `ray.address` "", a
local cluster whose workers run at this process's priority) and the first Ray iteration, which
also starts the actors' processes and loads their models (once per run against a running
cluster). Every iteration's outputs (the content hashes of the
rollout, scoring and advantages, and the checkpoint row) are compared with the first Ray
iteration's: local and Ray write the same rows and blobs when each rollout shard samples in
the local run's batches (shard sizes a multiple of `sampling.chunk_size`, or the local chunks as
large as a shard; e.g. shapes-cast's 128 samples in chunks of 64 on 2 actors), else to float
rounding (a transformer batch of another size rounds differently on CPU), and with
`ray.train_workers` = 1 (data-parallel training agrees to float rounding).
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

TARGET_RAY = 1.3  # a Ray iteration on 2 cores costs at most 1.3x a local one
# one policy and one scorer actor, a CPU each: the local executor's compute, moved onto actors
RAY_DEFAULTS = {"ray.rollout_workers": 1, "ray.num_cpus": 1.0, "ray.scorer_workers": 1,
                "ray.scorer_num_cpus": 1.0}
COMPARED = ("rollout", "score_atoms", "compute_advantages")  # train_epoch's holds wall times


def executor_recipes(recipe_path: str, overrides: dict) -> dict:
    """{"local": recipe, "ray": recipe}: the same recipe under each executor (`overrides` win
    over RAY_DEFAULTS; `run.executor` is set per arm)."""
    from tasks.stages.recipe import load_recipe

    return {"local": load_recipe(recipe_path, {**overrides, "run.executor": "local"}),
            "ray": load_recipe(recipe_path, {**RAY_DEFAULTS, **overrides,
                                             "run.executor": "ray"})}


def executor_iteration(recipe, template: Path, root: Path) -> tuple[float, dict[str, str]]:
    """Iteration 0 on a copy of `template` under the recipe's executor -> (wall seconds of
    opening the executor and running the iteration's stages, {stage: content hash} and the
    checkpoint row (its LoRA's and AdamW's blobs are content-addressed))."""
    from tasks.stages.iteration import plain_stages, run_iteration, run_setup
    from tasks.stages.ray_workers import executor
    from tasks.store.store import Store

    shutil.copytree(template, root)
    store, stages = Store(root), plain_stages()
    setup = run_setup(stages, store, recipe)  # skipped: the template holds them
    start = time.perf_counter()
    with executor(recipe) as workers:
        refs = run_iteration(stages, store, recipe, setup, 0, workers=workers)
    seconds = time.perf_counter() - start
    if any(refs[s].skipped for s in (*COMPARED, "train_epoch")):
        raise RuntimeError(f"executor arm at {root} skipped work")
    checkpoint = store.read_output(refs["train_epoch"], "checkpoints").to_pylist()
    return seconds, {**{s: refs[s].content_hash for s in COMPARED}, "checkpoints": checkpoint}


def executor_arms(recipe_path: str, overrides: dict, repeats: int, template: Path,
                  work: Path) -> dict:
    """The local and Ray arms, `repeats` each, alternating -> their figures (see the module)."""
    import ray

    from tasks.stages.ray_workers import executor, init_ray

    recipes = executor_recipes(recipe_path, overrides)
    start = time.perf_counter()
    init_ray(recipes["ray"].ray.address, include_dashboard=False)
    cluster_s = time.perf_counter() - start
    try:
        first_s, want = executor_iteration(recipes["ray"], template, work / "ray-first")
        seconds: dict[str, list[float]] = {"local": [], "ray": []}
        same = True
        for i in range(repeats):
            for arm in ("local", "ray") if i % 2 == 0 else ("ray", "local"):
                s, hashes = executor_iteration(recipes[arm], template, work / f"{arm}-{i}")
                seconds[arm].append(s)
                same = same and hashes == want
            print(f"repeat {i}: local {seconds['local'][-1]:.2f} s, ray {seconds['ray'][-1]:.2f}"
                  f" s", flush=True)
        with executor(recipes["ray"]) as workers:
            loads = workers.loads()
            workers.release()
    finally:
        ray.shutdown()
    ray_row = recipes["ray"].ray
    return {"local": seconds["local"], "ray": seconds["ray"],
            "ray_over_local_per_repeat": [r / lo for r, lo in zip(seconds["ray"],
                                                                    seconds["local"])],
            "ray_cluster_start_s": cluster_s, "ray_first_iteration_s": first_s,
            "same_outputs": same, "ray_section": ray_row.model_dump(),
            "backbone_loads": [n.backbone for n in loads["policy"]],
            "scorer_loads": loads["scorer"]}


def executor_lines(arms: dict, line) -> list[str]:
    """The report's lines for the executor arms (`line`: bench_iteration's figure line)."""
    r = arms["ray_section"]
    local, ray_ = statistics.median(arms["local"]), statistics.median(arms["ray"])
    ratio = ray_ / local
    head = (f"executors (tasks.stages.iteration, alternating; Ray: local cluster, "
            f"{r['rollout_workers']} policy actor(s), {r['train_workers']} training, "
            f"{r['scorer_workers']} scorer actor(s), resident):")
    untimed = (f"  untimed: Ray cluster start {arms['ray_cluster_start_s']:.1f} s; first Ray "
               f"iteration (actors start, models load) {arms['ray_first_iteration_s']:.1f} s; "
               f"backbone loads per policy actor over all Ray iterations "
               f"{arms['backbone_loads']}")
    per_repeat = ", ".join(f"{x:.3f}" for x in arms["ray_over_local_per_repeat"])
    paired = statistics.median(arms["ray_over_local_per_repeat"])
    return [head, line("local executor", arms["local"]), line("ray executor", arms["ray"]),
            untimed,
            f"  same outputs, local vs ray (stage hashes, checkpoint): {arms['same_outputs']}",
            f"  ray / local = {ratio:.3f} (of medians; per repeat {per_repeat}, median {paired:.3f})"]


def ray_ratio(arms: dict) -> float:
    """Median Ray iteration over median local iteration."""
    return statistics.median(arms["ray"]) / statistics.median(arms["local"])
