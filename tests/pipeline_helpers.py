"""Shared pieces of the pipeline tests: a small prompt file, the CI recipe made small and
single-threaded, one iteration through the stages called directly (no Prefect server), a cached
reference store per pytest session, and a script (`python tests/pipeline_helpers.py`) that runs
the same stages in a child process for the fault tests.

Child protocol: `python tests/pipeline_helpers.py STORE OVERRIDES_JSON [--markers DIR]
[--refresh]` runs build_csgs, calibrate_window and one iteration (the next one) and prints one
JSON line {stage: StageRef dict}. With --markers it touches `DIR/<stage>.started` just before
each stage is called, so a parent can kill it while a chosen stage runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from tasks.stages.recipe import Recipe, load_recipe
from tasks.store.schemas import TABLES
from tasks.store.store import Store

REPO = Path(__file__).resolve().parents[1]
CI_RECIPE = REPO / "data" / "recipes" / "shapes-ci.toml"
# The Ray tests' executor: two policy and two scorer actors share a local cluster of two CPUs.
RAY_TWO_CPUS = {"run.executor": "ray", "ray.rollout_workers": 2, "ray.num_cpus": 0.5,
                "ray.scorer_workers": 2, "ray.scorer_num_cpus": 0.5}
TRAIN_PROMPTS = REPO / "data" / "prompts" / "train.jsonl"
STAGES = ("build_csgs", "calibrate_window", "rollout", "score_atoms", "compute_advantages",
          "train_epoch")
ITERATION_TABLES = ("rollouts", "atom_scores", "advantages", "advantage_maps", "checkpoints",
                    "train_steps")
# Keeps the run small: the CI recipe already has 4 prompts x 4 samples and 6 steps. Training takes
# two optimizer steps of 8 samples, each accumulated over two micro-batches of 4, so accumulation
# and a step skipped by the NaN guard next to a kept one run end to end.
SMALL = {"run.threads": 1, "window.calibration_prompts": 2, "train.steps_per_epoch": 2,
         "train.micro_batch": 4}
FLOW_GRPO = {"advantage.kind": "scalar", "window.mode": "fixed", "train.clip_range": 1e-3}


def write_small_prompts(path: Path, every: int = 50) -> Path:
    """Every `every`-th line of the train set (100 prompts over all train tags) -> `path`."""
    lines = TRAIN_PROMPTS.read_text().splitlines()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines[::every]))
    return path


def ci_overrides(prompts: Path, **extra) -> dict:
    return {**SMALL, "prompts.train": str(prompts), **extra}


def ci_recipe(prompts: Path, **extra) -> Recipe:
    return load_recipe(CI_RECIPE, ci_overrides(prompts, **extra))


def run_iteration(store: Store, recipe: Recipe, iteration: int | None = None,
                  markers: Path | None = None) -> dict:
    """build_csgs, calibrate_window and one iteration's stages -> {stage: StageRef}."""
    from tasks.stages.iteration import next_iteration, plain_stages, run_iteration, run_setup

    def start(stage: str) -> None:
        if markers is not None:
            (markers / f"{stage}.started").touch()

    stages = plain_stages()
    refs = run_setup(stages, store, recipe, start)
    k = next_iteration(store, recipe) if iteration is None else iteration
    return refs | run_iteration(stages, store, recipe, refs, k, start)


@functools.cache
def reference_run(base: str) -> tuple[Store, Recipe, Path, dict]:
    """The session's uninterrupted CI run (iteration 0) under `base`/reference: the store, the
    recipe, the small prompt file and the StageRefs of the call that did the work. Cached so
    that test modules share one run."""
    base_path = Path(base)
    prompts = write_small_prompts(base_path / "prompts" / "train-small.jsonl")
    recipe = ci_recipe(prompts)
    store = Store(base_path / "reference")
    return store, recipe, prompts, run_iteration(store, recipe, 0)


def reference(tmp_path_factory) -> tuple[Store, Recipe, Path, dict]:
    """`reference_run` under this pytest session's base temp dir (one per session)."""
    return reference_run(str(tmp_path_factory.getbasetemp() / "cast-reference"))


def child_env(tmp: Path) -> dict:
    """Environment of a child process: one thread, Prefect's home in a temp dir, no telemetry."""
    env = dict(os.environ, PREFECT_HOME=str(tmp / "prefect-home"), OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    return env


def child_command(store: Path, overrides: dict, markers: Path | None = None,
                  refresh: bool = False) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), str(store), json.dumps(overrides)]
    if markers is not None:
        cmd += ["--markers", str(markers)]
    if refresh:
        cmd.append("--refresh")
    return cmd


def start_child(tmp: Path, store: Path, overrides: dict, markers: Path | None = None,
                refresh: bool = False) -> subprocess.Popen:
    return subprocess.Popen(child_command(store, overrides, markers, refresh), cwd=REPO,
                            env=child_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish_child(proc: subprocess.Popen, timeout: float = 300) -> dict:
    """Wait for a child; -> its {stage: StageRef dict}; fails with its stderr if it failed."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


def parquet_files(root: Path) -> list[Path]:
    return sorted((root / "tables").rglob("*.parquet"))


def temp_files(root: Path) -> list[Path]:
    """Leftover temporary files: the store's dot-names (`.<name>.<pid>-<hex>.tmp`, catalog)."""
    return sorted(p for p in root.rglob(".*") if p.is_file())


def assert_declared_schemas(root: Path) -> int:
    """Every Parquet file under root/tables has exactly its table's declared schema (metadata
    included); -> the number of files checked."""
    files = parquet_files(root)
    for path in files:
        table = path.parent.name
        declared = TABLES[table].schema
        got = pq.read_schema(path)
        assert got.equals(declared, check_metadata=True), f"{path}:\n{got}\n!=\n{declared}"
        assert pq.read_table(path).schema.equals(declared, check_metadata=True), path
    return len(files)


def table_rows(store: Store, table: str, run_id: str, drop: tuple[str, ...] = ()) -> list[dict]:
    """A run's rows of a table without the `drop` columns, sorted canonically (to compare two
    stores or two runs)."""
    rows = [{k: v for k, v in r.items() if k not in drop}
            for r in store.read_table(table, {"run_id": run_id}).to_pylist()]
    return sorted(rows, key=lambda r: json.dumps(r, sort_keys=True, default=str))


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="run one CI iteration (tests' child process)")
    parser.add_argument("store")
    parser.add_argument("overrides", help="recipe overrides as a JSON object")
    parser.add_argument("--markers", default=None)
    parser.add_argument("--refresh", action="store_true", help="refresh the catalog at the end")
    args = parser.parse_args(argv)
    recipe = load_recipe(CI_RECIPE, json.loads(args.overrides))
    store = Store(args.store)
    markers = Path(args.markers) if args.markers else None
    refs = run_iteration(store, recipe, markers=markers)
    if args.refresh:
        store.refresh_catalog()
    print(json.dumps({stage: ref.to_dict() for stage, ref in refs.items()}))


if __name__ == "__main__":
    _main()
