"""The methods benchmark (CAST against Flow-GRPO on the shapes world), one concern a module.
`benchmarks/bench_methods.py` is its command line; `methods.benchmark.run_benchmark` runs it.

- `arms`: the arms (a recipe plus overrides), their suites and the equal-budget check;
- `protocols`: sizes, named protocols, eval passes, prompt files, each arm's recipe;
- `run`: the stages of one run, many runs in worker processes, the base's evaluations;
- `store_reads`: the SQL over the store's catalog -> `Results`;
- `stats`: intervals, bootstraps and crossings, pure numpy;
- `summary`: `Results` -> `Summary` (gains, curves, efficiency, times) and the ReCAST summary;
- `tables`, `plots`, `figures`: the report's markdown tables, PNG plots and figures.json;
- `report`: report.md with everything beside it;
- `benchmark`: `run_benchmark`, from sizes to report.

Imports run one way, down this list reversed: `arms` imports no module of the package;
`protocols` imports `arms`; `run` imports `protocols`; `store_reads` imports `protocols` and
`stats`; `summary` imports those four below it but `run`; `tables`, `plots` and `figures` import
`summary` and what it imports (`figures` also `tables`); `report` imports the presentation
modules; `benchmark` imports `report`, `run` and what they import.
"""
