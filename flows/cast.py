"""Flow `cast`: one RL iteration (k = last finished + 1, or `iteration`) of a recipe.

Deployed as `cast/train-iteration` (prefect.yaml). Every stage is a cached, resumable task
(tasks/store/stage.py); re-running after a crash finishes the iteration and skips finished stages.
With `recast.weighting = "recast"` the ReCAST gains of the policy (re-estimated every
`recast.every` iterations) run before training, which weights each atom type's share of the map
per step. With `run.executor = "ray"` the rollout, scoring, ReCAST gains and training run on the
run's resident Ray actors (`tasks.stages.ray_workers`); the other stages, and the wiring, stay
here.

    .venv/bin/python -m flows.cast --recipe data/recipes/shapes-cast.toml

From the command line the recipe and its paths are checked, and a Prefect server is started, before
the stages are imported (`flows.launch`): a bad recipe fails in about a second with one line.
"""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_RECIPE = "data/recipes/shapes-cast.toml"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flows.cast", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=DEFAULT_RECIPE)
    p.add_argument("--iteration", type=int, default=None)
    p.add_argument("--store", default=None)
    p.add_argument("--iterations", type=int, default=1, help="run this many in a row")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                   help="override a recipe field, e.g. --set prompts.per_iteration=4")
    return p


if __name__ == "__main__":  # before the slow imports below: see flows.launch
    from flows.launch import launch

    sys.exit(launch("flows.cast", parser().parse_args()))

# The slow imports (torch, Prefect, the stages): the command line above runs before them.
from prefect import flow, task

from flows.preflight import checked_recipe
from tasks.reporting.report import iteration_report_task
from tasks.stages.build_csgs import build_csgs_task
from tasks.stages.calibrate_window import calibrate_window_task
from tasks.stages.compute_advantages import compute_advantages_task
from tasks.stages.iteration import Stages, next_iteration, run_iteration, run_setup
from tasks.stages.ray_workers import executor
from tasks.stages.recast_gains import gains_for_training_task
from tasks.stages.rollout import rollout_task
from tasks.stages.score_atoms import score_atoms_task
from tasks.stages.train_epoch import train_epoch_task
from tasks.store.locations import store_root
from tasks.store.store import Store

TASKS = Stages(build_csgs_task, calibrate_window_task, rollout_task, score_atoms_task,
               compute_advantages_task, gains_for_training_task, train_epoch_task)
next_iteration_task = task(next_iteration, name="next_iteration")


@flow(name="cast", log_prints=True)
def cast(recipe: str = DEFAULT_RECIPE, iteration: int | None = None, store: str | None = None,
         overrides: dict | None = None) -> dict:
    r = checked_recipe(recipe, overrides, store_root(store))
    print(f"recipe {recipe}: " + json.dumps(r.derived(), indent=1))
    st = Store(store_root(store))
    with executor(r) as workers:
        setup = run_setup(TASKS, st, r, workers=workers)
        k = next_iteration_task(st, r) if iteration is None else iteration
        run_iteration(TASKS, st, r, setup, k, workers=workers)
    return iteration_report_task(st, r, k)


def run(args: argparse.Namespace, overrides: dict | None) -> None:
    """The command line's flow calls (`flows.launch` has checked the recipe and set the API)."""
    for _ in range(args.iterations):
        cast(recipe=args.recipe, iteration=args.iteration, store=args.store, overrides=overrides)


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.cast` from Python: the same checks, server and runs."""
    from flows.launch import launch

    return launch("flows.cast", parser().parse_args(argv))
