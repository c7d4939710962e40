"""The deployment `cast/train-iteration` with `run.executor = "ray"`: its flow, loaded from the
entrypoint prefect.yaml names and called with the deployment's parameters as a worker's flow run
is (the CI recipe, a store, overrides), runs the setup and iterations 0 and 1 on the Ray actors
and writes the rows that the same flow writes with the local executor. The flow starts its own
local cluster (`ray.address = ""`), as a flow run on a machine without one does; the two policy
and two scorer actors reserve two CPUs, as in the other Ray tests. The second flow run finds the
first one's actors on the cluster, still loaded: no backbone is read again, only the trained LoRA
is swapped in where an actor did not train it. The window calibration's progress bar, moved by
the actor, and the rollout's, moved by the policy actors' shards, show in the Ray flow runs' logs
as the local ones do.

The flows run in a child process (`python -m tests.test_ray_flow ROOTS OVERRIDES OUT`, which
writes the actors' loads to OUT as JSON), where Prefect starts a temporary server and the flow
its Ray cluster, both ending with the child. Slow: a Prefect server
and a Ray cluster start, and four flow runs each take an iteration.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.store.store import Store
from tests.pipeline_helpers import (
    CI_RECIPE,
    RAY_TWO_CPUS,
    REPO,
    child_env,
    ci_overrides,
    table_rows,
    write_small_prompts,
)

RAY = RAY_TWO_CPUS
FLOW_RUNS = 2  # iterations 0 and 1: the deployment's `iteration` unset takes the next one
TABLES = ("csgs", "atoms", "calibration_curves", "windows", "rollouts", "atom_scores",
          "advantages", "advantage_maps", "checkpoints")
WALL_TIMES = ("stage_seconds_json",)
# a calibration bar's last line in a flow run's logs, naming its task run
FULL_BAR = re.compile(r"Task run '(calibrate_window-\w+)' - window calibration \(\d+ prompts\): 100%")
FULL_ROLLOUT_BAR = re.compile(r"Task run '(rollout-\w+)' - rollout \d+ \(\d+ samples\): 100%")


def deployment(name: str = "train-iteration") -> dict:
    """The deployment's entry in prefect.yaml."""
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    return next(d for d in spec["deployments"] if d["name"] == name)


def run_flows(roots: dict[str, str], overrides: dict[str, dict]) -> dict:
    """The deployment's flow, FLOW_RUNS times for each executor (`roots` and `overrides` by
    "local" and "ray") -> the Ray actors' loads after: {"policy": [[backbone, lora]], "scorer":
    [loads]}."""
    from prefect.flows import load_flow_from_entrypoint

    from tasks.stages.ray_workers import connect
    from tasks.stages.recipe import load_recipe

    entry = deployment()
    flow = load_flow_from_entrypoint(entry["entrypoint"])
    for arm in ("local", "ray"):
        for _ in range(FLOW_RUNS):
            flow(**{**entry["parameters"], "recipe": str(CI_RECIPE.relative_to(REPO)),
                    "store": roots[arm], "overrides": overrides[arm]})
    workers = connect(load_recipe(CI_RECIPE, overrides["ray"]))  # the cluster the flow started
    loads = workers.loads()
    workers.release()
    return {"policy": [[n.backbone, n.lora] for n in loads["policy"]], "scorer": loads["scorer"]}


def _records(store: Store) -> list[tuple]:
    """The store's stage records as (stage, iteration, content hash); train_epoch's hash left
    out: its train_steps rows carry the stages' wall times."""
    return sorted((r.stage, r.iteration, None if r.stage == "train_epoch" else r.content_hash)
                  for r in store.stage_records())


@pytest.mark.slow
def test_the_deployment_runs_on_ray_and_writes_the_local_rows(tmp_path):
    pytest.importorskip("ray")
    prompts = write_small_prompts(tmp_path / "prompts" / "train-small.jsonl")
    overrides = {"local": ci_overrides(prompts), "ray": ci_overrides(prompts, **RAY)}
    roots = {arm: str(tmp_path / arm / "store") for arm in overrides}
    out = tmp_path / "loads.json"
    done = subprocess.run([sys.executable, "-m", "tests.test_ray_flow", json.dumps(roots),
                           json.dumps(overrides), str(out)], cwd=REPO, env=child_env(tmp_path),
                          capture_output=True, text=True, timeout=1200, check=False)
    assert done.returncode == 0, done.stderr[-6000:]
    loads = json.loads(out.read_text())
    stores = {arm: Store(root) for arm, root in roots.items()}
    run = "shapes-ci"
    for table in TABLES:
        rows = {arm: table_rows(store, table, run) for arm, store in stores.items()}
        assert rows["ray"] == rows["local"], table
        assert rows["ray"], table
    steps = {arm: table_rows(store, "train_steps", run, WALL_TIMES)
             for arm, store in stores.items()}
    assert steps["ray"] == steps["local"]
    assert {r["iteration"] for r in steps["ray"]} == set(range(FLOW_RUNS))
    assert _records(stores["ray"]) == _records(stores["local"])  # same stages, same contents
    # one backbone read per policy actor over both flow runs: actor 0 trained iteration 0's
    # policy and holds it; actor 1 swapped in its LoRA for iteration 1
    assert loads == {"policy": [[1, 0], [1, 1]], "scorer": [1, 1]}
    # each executor's first flow run calibrated, and its bar reached 100% in the run's logs
    assert len(set(FULL_BAR.findall(done.stderr))) == 2, done.stderr[-6000:]
    # every flow run's rollout bar reached 100% in its logs, on the actors as in the process
    assert len(set(FULL_ROLLOUT_BAR.findall(done.stderr))) == 2 * FLOW_RUNS, done.stderr[-6000:]


if __name__ == "__main__":
    _loads = run_flows(json.loads(sys.argv[1]), json.loads(sys.argv[2]))
    Path(sys.argv[3]).write_text(json.dumps(_loads))
