"""A lost Ray cluster: the flow's process and the local cluster it started are SIGKILLed while
the iteration's training runs on the actors; the same iteration run again on the same store (a
new cluster, new actors) skips the stages already recorded, redoes the training, and leaves the
rows and blobs of an uninterrupted run, each once.

The killed run is a child process (`python -m tests.test_ray_resume STORE OVERRIDES MARKERS`):
it starts its own local cluster, whose raylet and GCS share the child's fate, and touches
`MARKERS/<stage>.started` before each stage. Slow: two clusters start and load their actors.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.stages.iteration import ITERATION_STAGES, plain_stages, run_iteration, run_setup
from tasks.stages.ray_workers import executor, init_ray
from tasks.stages.recipe import load_recipe
from tasks.store.store import Store
from tests.pipeline_helpers import (
    CI_RECIPE,
    RAY_TWO_CPUS,
    REPO,
    child_env,
    ci_overrides,
    reference,
    table_rows,
    temp_files,
)

RAY = RAY_TWO_CPUS
KILLED_IN = "train_epoch"
BEFORE = ("rollout", "score_atoms", "compute_advantages")  # recorded when the kill comes
TABLES = ("rollouts", "atom_scores", "advantages", "advantage_maps", "checkpoints")


def run_on_ray(store: Store, recipe, markers: Path | None = None) -> dict:
    """Setup and iteration 0 on the recipe's actors (a cluster of two CPUs started here) ->
    {stage: StageRef}; with `markers`, touches `<stage>.started` there before each stage."""
    import ray

    def start(stage: str) -> None:
        if markers is not None:
            (markers / f"{stage}.started").touch()

    stages = plain_stages()
    init_ray("", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        setup = run_setup(stages, store, recipe)
        with executor(recipe) as workers:
            refs = run_iteration(stages, store, recipe, setup, 0, start, workers=workers)
            workers.release()
    finally:
        ray.shutdown()
    return refs


def _killed_run(tmp: Path, root: Path, overrides: dict) -> None:
    """Start the child, wait until it starts `KILLED_IN`, SIGKILL its process group."""
    markers = tmp / "markers"
    markers.mkdir()
    with open(tmp / "child.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.test_ray_resume", str(root),
                                 json.dumps(overrides), str(markers)], cwd=REPO,
                                env=child_env(tmp), stdout=log, stderr=log,
                                start_new_session=True)
    deadline = time.monotonic() + 600
    while not (markers / f"{KILLED_IN}.started").exists():
        assert proc.poll() is None, (tmp / "child.log").read_text()[-4000:]
        assert time.monotonic() < deadline, f"the child never reached {KILLED_IN}"
        time.sleep(0.05)
    time.sleep(0.3)  # the training call is on its way to the actor
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    _wait_gone(proc.pid)


def _wait_gone(session: int, timeout: float = 60) -> None:
    """Wait until no process of the child's session (its cluster, its actors) is left."""
    deadline = time.monotonic() + timeout
    while _session_pids(session):
        assert time.monotonic() < deadline, f"left running: {_session_pids(session)}"
        for pid in _session_pids(session):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


def _session_pids(session: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == session:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                pass
    return pids


@pytest.mark.slow
def test_a_lost_cluster_resumes_from_the_store(tmp_path, tmp_path_factory):
    pytest.importorskip("ray")
    local_store, _, prompts, local = reference(tmp_path_factory)
    overrides = ci_overrides(prompts, **RAY)
    root = tmp_path / "store"
    _killed_run(tmp_path, root, overrides)
    store = Store(root)
    recorded = {r.stage for r in store.stage_records() if r.iteration == 0}
    assert recorded == set(BEFORE), f"the kill came after {KILLED_IN} finished: {recorded}"

    recipe = load_recipe(CI_RECIPE, overrides)
    refs = run_on_ray(store, recipe)
    assert {s: refs[s].skipped for s in ITERATION_STAGES if s in refs} == {
        **{s: True for s in BEFORE}, KILLED_IN: False}
    run = recipe.run.name
    for table in TABLES:
        assert table_rows(store, table, run) == table_rows(local_store, table, run), table
    timing = ("stage_seconds_json",)
    assert (table_rows(store, "train_steps", run, timing)
            == table_rows(local_store, "train_steps", run, timing))
    for stage in BEFORE:
        assert refs[stage].content_hash == local[stage].content_hash, stage
    records = [(r.stage, r.iteration) for r in store.stage_records()]
    assert sorted(records) == sorted(set(records))  # each stage recorded once
    paths = {p for r in store.stage_records() for p in r.paths}
    blobs = {p.relative_to(root).as_posix() for p in (root / "blobs").rglob("*.*")}
    assert blobs == {p for p in paths if p.startswith("blobs/")}  # no shard or stray blob
    assert temp_files(root) == []


if __name__ == "__main__":
    _store, _overrides, _markers = sys.argv[1:4]
    run_on_ray(Store(_store), load_recipe(CI_RECIPE, json.loads(_overrides)), Path(_markers))
