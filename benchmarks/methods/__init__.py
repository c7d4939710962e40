"""The methods benchmark (CAST against Flow-GRPO on the shapes world), one concern a module.
`benchmarks/bench_methods.py` is its command line; `methods.benchmark.run_benchmark` runs it.

In import order (a module imports only modules above it):
- `arms`: the arms (a recipe plus overrides), their suites and the equal-budget check;
- `stats`: intervals, bootstraps and crossings, pure numpy;
- `protocols`: sizes, named protocols, eval passes, prompt files, each arm's recipe (<- arms);
- `run`: the stages of one run, many runs in worker processes, the base's evaluations
  (<- protocols);
- `store_reads`: the SQL over the store's catalog -> `Results` (<- protocols, stats);
- `summary`: `Results` -> `Summary` (gains, curves, efficiency, times) and the ReCAST summary
  (<- arms, protocols, stats, store_reads);
- `tables`, `plots`: the report's markdown tables and PNG plots (<- summary and what it imports);
- `figures`: figures.json, the targets and whether each was met (<- tables, summary, ...);
- `report`: report.md with everything beside it (<- figures, plots, tables, summary, ...);
- `benchmark`: `run_benchmark`, from sizes to report (<- report, run, summary, ...).
Outside the package they import `tasks` (stages, store, recipe; `tasks.reporting.markdown.table`
and `tasks.stages.plots.png` for tables and plots) and `cast_core.csg.graph`; `tasks` never
imports them.
"""
