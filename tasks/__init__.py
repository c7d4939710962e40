"""The pipeline around the maths of `cast_core`, in three subpackages:

- `tasks.store`: the store (Parquet tables, blobs, the DuckDB catalog), every table's schema, the
  stage protocol (cache keys, completion records, seeds) and what guards the records;
- `tasks.stages`: one module per stage, named as its stage, the one stage order
  (`tasks.stages.iteration`), and what the stages share (recipes, models, prompt sets, the Prefect
  task wrapper with its guard, plots);
- `tasks.reporting`: what a person reads: the iteration and evaluation reports.

The arrows point one way: `store` imports nothing else from `tasks`; `stages` imports `store`;
`reporting` imports `store` and `stages` (`tests/test_layers.py` checks it). Nothing under `tasks`
imports `flows` or `benchmarks`.
"""
