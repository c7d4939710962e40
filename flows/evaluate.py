"""Flow `cast-eval`: evaluate a run's latest checkpoint (or `iteration`; -1 = the base model) on
the recipe's eval splits; writes `evals` rows, image grids and a plot, prints the table, then
writes the run's markdown report with its plots (`tasks/reporting/eval_report.py`; default folder
`<store>/reports/<run>`, also a Prefect markdown artifact).

Deployed as `cast-eval/nightly` with a nightly cron schedule (prefect.yaml).

    .venv/bin/python -m flows.evaluate --recipe data/recipes/shapes-cast.toml

From the command line the recipe and its paths are checked, and a Prefect server is started, before
the stages are imported (`flows.launch`).
"""

from __future__ import annotations

import argparse
import sys

DEFAULT_RECIPE = "data/recipes/shapes-cast.toml"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flows.evaluate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=DEFAULT_RECIPE)
    p.add_argument("--iteration", type=int, default=None)
    p.add_argument("--store", default=None)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON")
    p.add_argument("--report-dir", default=None,
                   help="folder of the markdown report (default <store>/reports/<run>)")
    return p


if __name__ == "__main__":  # before the slow imports below: see flows.launch
    from flows.launch import launch

    sys.exit(launch("flows.evaluate", parser().parse_args()))

# The slow imports (torch, Prefect, the stages): the command line above runs before them.
from prefect import flow

from flows.preflight import checked_recipe
from tasks.reporting.eval_report import default_out, write_report_task
from tasks.reporting.report import eval_report_task
from tasks.stages.evaluate import evaluate_task, latest_checkpoint_task
from tasks.store.locations import store_root
from tasks.store.store import Store


@flow(name="cast-eval", log_prints=True)
def cast_eval(recipe: str = DEFAULT_RECIPE, iteration: int | None = None,
              store: str | None = None, overrides: dict | None = None,
              report_dir: str | None = None) -> dict:
    r = checked_recipe(recipe, overrides, store_root(store))
    st = Store(store_root(store))
    k = latest_checkpoint_task(st, r) if iteration is None else iteration
    evaluate_task(st, r, k)
    summary = eval_report_task(st, r, k)
    report = write_report_task(st, r.run.name, report_dir or default_out(st, r.run.name))
    print(f"evaluation report: {report.path}")
    return {**summary, "report": report.path}


def run(args: argparse.Namespace, overrides: dict | None) -> None:
    """The command line's flow call (`flows.launch` has checked the recipe and set the API)."""
    cast_eval(recipe=args.recipe, iteration=args.iteration, store=args.store,
              overrides=overrides, report_dir=args.report_dir)


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.evaluate` from Python: the same checks, server and run."""
    from flows.launch import launch

    return launch("flows.evaluate", parser().parse_args(argv))
