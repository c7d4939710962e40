"""Flow `cast-eval`: evaluate a run's latest checkpoint (or `iteration`; -1 = the base model) on
the recipe's eval splits; writes `evals` rows, image grids and a plot, then prints the table.

Deployed as `cast-eval/nightly` with a nightly cron schedule (prefect.yaml).

    .venv/bin/python -m flows.evaluate --recipe data/recipes/shapes-cast.toml
"""

from __future__ import annotations

import argparse

from prefect import flow

from tasks.evaluate_checkpoint import eval_report_task, evaluate_task, latest_checkpoint_task
from tasks.recipe import load_recipe, parse_overrides
from tasks.report import store_root
from tasks.store import Store

DEFAULT_RECIPE = "data/recipes/shapes-cast.toml"


@flow(name="cast-eval", log_prints=True)
def cast_eval(recipe: str = DEFAULT_RECIPE, iteration: int | None = None,
              store: str | None = None, overrides: dict | None = None) -> dict:
    r = load_recipe(recipe, overrides)
    st = Store(store_root(store))
    k = latest_checkpoint_task(st, r) if iteration is None else iteration
    evaluate_task(st, r, k)
    return eval_report_task(st, r, k)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    parser.add_argument("--iteration", type=int, default=None)
    parser.add_argument("--store", default=None)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON")
    args = parser.parse_args(argv)
    overrides = parse_overrides(args.set)
    cast_eval(recipe=args.recipe, iteration=args.iteration, store=args.store,
              overrides=overrides or None)


if __name__ == "__main__":
    main()
