"""Flow `cast`: one RL iteration (k = last finished + 1, or `iteration`) of a recipe.

Deployed as `cast/train-iteration` (prefect.yaml). Every stage is a cached, resumable task
(tasks/stage.py); re-running after a crash finishes the iteration and skips finished stages. With
`recast.weighting = "recast"` the ReCAST gains of the policy (re-estimated every `recast.every`
iterations) run before training, which weights each atom type's share of the map per step.

    .venv/bin/python -m flows.cast --recipe data/recipes/shapes-cast.toml
"""

from __future__ import annotations

import argparse
import json

from prefect import flow

from tasks.build_csgs import build_csgs_task
from tasks.calibrate_window import calibrate_window_task
from tasks.compute_advantages import compute_advantages_task
from tasks.recast_gains import gains_for_training_task
from tasks.recipe import load_recipe, parse_overrides
from tasks.report import iteration_report_task, next_iteration_task, store_root
from tasks.rollout_groups import rollout_task
from tasks.score_atoms import score_atoms_task
from tasks.store import Store
from tasks.train_epoch import train_epoch_task

DEFAULT_RECIPE = "data/recipes/shapes-cast.toml"


@flow(name="cast", log_prints=True)
def cast(recipe: str = DEFAULT_RECIPE, iteration: int | None = None, store: str | None = None,
         overrides: dict | None = None) -> dict:
    r = load_recipe(recipe, overrides)
    print(f"recipe {recipe}: " + json.dumps(r.derived(), indent=1))
    st = Store(store_root(store))
    csgs = build_csgs_task(st, r)
    window = calibrate_window_task(st, r)
    k = next_iteration_task(st, r) if iteration is None else iteration
    rollouts = rollout_task(st, r, csgs, window, k)
    scores = score_atoms_task(st, r, csgs, rollouts, k)
    advantages = compute_advantages_task(st, r, rollouts, scores, k)
    gains = gains_for_training_task(st, r, k) if r.recast.weighting == "recast" else None
    train_epoch_task(st, r, csgs, rollouts, scores, advantages, k, gains)
    return iteration_report_task(st, r, k)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    parser.add_argument("--iteration", type=int, default=None)
    parser.add_argument("--store", default=None)
    parser.add_argument("--iterations", type=int, default=1, help="run this many in a row")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                        help="override a recipe field, e.g. --set prompts.per_iteration=4")
    args = parser.parse_args(argv)
    overrides = parse_overrides(args.set)
    for _ in range(args.iterations):
        cast(recipe=args.recipe, iteration=args.iteration, store=args.store,
             overrides=overrides or None)


if __name__ == "__main__":
    main()
