"""Flow `cast-eval`: evaluate a run's latest checkpoint (or `iteration`; -1 = the base model) on
the recipe's eval splits; writes `evals` rows, image grids and a plot, prints the table, then
writes the run's markdown report with its plots (`tasks/eval_report.py`; default folder
`<store>/reports/<run>`, also a Prefect markdown artifact).

Deployed as `cast-eval/nightly` with a nightly cron schedule (prefect.yaml).

    .venv/bin/python -m flows.evaluate --recipe data/recipes/shapes-cast.toml
"""

from __future__ import annotations

import argparse

from prefect import flow

from tasks.eval_report import default_out, write_report_task
from tasks.evaluate_checkpoint import eval_report_task, evaluate_task, latest_checkpoint_task
from tasks.recipe import load_recipe, parse_overrides
from tasks.report import store_root
from tasks.store import Store

DEFAULT_RECIPE = "data/recipes/shapes-cast.toml"


@flow(name="cast-eval", log_prints=True)
def cast_eval(recipe: str = DEFAULT_RECIPE, iteration: int | None = None,
              store: str | None = None, overrides: dict | None = None,
              report_dir: str | None = None) -> dict:
    r = load_recipe(recipe, overrides)
    st = Store(store_root(store))
    k = latest_checkpoint_task(st, r) if iteration is None else iteration
    evaluate_task(st, r, k)
    summary = eval_report_task(st, r, k)
    report = write_report_task(st, r.run.name, report_dir or default_out(st, r.run.name))
    print(f"evaluation report: {report.path}")
    return {**summary, "report": report.path}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    parser.add_argument("--iteration", type=int, default=None)
    parser.add_argument("--store", default=None)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON")
    parser.add_argument("--report-dir", default=None,
                        help="folder of the markdown report (default <store>/reports/<run>)")
    args = parser.parse_args(argv)
    overrides = parse_overrides(args.set)
    cast_eval(recipe=args.recipe, iteration=args.iteration, store=args.store,
              overrides=overrides or None, report_dir=args.report_dir)


if __name__ == "__main__":
    main()
