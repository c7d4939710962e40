"""The methods benchmark from sizes to report: every arm x seed trained with its probes, the
finals and the base evaluated, the results read off the store, summarised and written
(`run_benchmark`)."""

from __future__ import annotations

import time
from pathlib import Path

from methods.arms import BASELINE, RECAST_PAIRS, check_equal_budget, select_arms
from methods.protocols import (
    FINAL_SPLITS,
    Size,
    check_paired_evals,
    eval_passes,
    held_out_files,
    pool_file,
    recipe_for,
    run_name,
    runs_as,
)
from methods.report import write_report
from methods.run import evaluate_base, finished_refs, train_runs
from methods.store_reads import read_results
from methods.summary import summarise, summarise_recast


def run_benchmark(size: Size, store_dir: str | Path, report_dir: str | Path, prefix: str,
                  threads: int | None = None, command: str = "", suite: str = "main",
                  lr: float | None = None, only: list[str] | None = None,
                  quick: bool = False, guidance: float | None = None,
                  pool_prompts: int | None = None, jobs: int = 1,
                  kl_target: float | None = None, settings: dict | None = None,
                  report_only: bool = False, reuse_finished: bool = False,
                  aliases: dict[str, str] | None = None) -> dict:
    """Train every arm x seed with its probes, evaluate finals and base, summarise from the
    store, write report.md and figures.json -> {"summary", "recast", "report", "figures",
    "wall_s"}. With `report_only` nothing runs: the report is written from the latest finished
    record of every stage in the store (`recorded_refs`), whatever the code version in its
    cache key (every code change makes the calls run again). With `reuse_finished` the runs (and
    the base evaluation) that the store holds finished are read so, and only the others run: arms
    added to a finished store after a code change train alone (the report's recipes table says
    which code each run's records carry only through their keys; that the results do not depend
    on it is for the caller to know). `aliases` {arm: stored name} reads and writes an arm's runs
    under another name (`methods.protocols.runs_as`), e.g. runs trained before the arm's recipe
    was renamed; the run pin checks that they were trained with the arm's recipe."""
    from tasks.stages.prompt_sets import load_prompts
    from tasks.store.run_pin import pin_recipe
    from tasks.store.store import Store

    start, store = time.perf_counter(), Store(store_dir)
    arm_defs, seeds = select_arms(suite, only), list(range(size.seeds))
    names, aliases = [a.name for a in arm_defs], aliases or {}
    with runs_as(aliases, names):
        pool = pool_file(store, pool_prompts)
        recipes = {(a.name, x): recipe_for(a, x, size, run_name(prefix, a.name, x), threads, lr,
                                           guidance, pool, kl_target, settings)
                   for a in arm_defs for x in seeds}
        pool_size = len(load_prompts(recipes[(BASELINE, 0)], pool))
        if size.per_iteration > pool_size:
            raise ValueError(f"per_iteration {size.per_iteration} exceeds the pool's {pool_size} "
                             f"prompts ({pool}); set --per-iteration <= {pool_size}")
        passes = eval_passes(size, held_out_files(store, size), pool)
        base = recipe_for(arm_defs[0], 0, size, f"{prefix}-base", threads, lr, guidance, pool,
                          kl_target, settings)
        for x in seeds:
            check_equal_budget([recipes[(a.name, x)] for a in arm_defs])
        check_paired_evals([base, *recipes.values()], passes)
        refs = {}
        if report_only or reuse_finished:  # what the store holds, whatever code wrote it
            refs = finished_refs(store, base.run.name, -1, passes, required=report_only)
            for r in recipes.values():
                refs |= finished_refs(store, r.run.name, size.iterations, passes,
                                      required=report_only)
        for r in recipes.values():  # a run name reused with another recipe (another --lr, say) is
            pin_recipe(store, r)    # refused here, before any work mixes two recipes in one run
        if base.run.name not in refs:
            refs[base.run.name] = evaluate_base(store, base, passes)
        order = [recipes[(arm_defs[(i + x) % len(arm_defs)].name, x)]  # rotate the order per seed
                 for x in seeds for i in range(len(arm_defs))]
        refs |= train_runs(store, [r for r in order if r.run.name not in refs], size, passes, jobs)
        last = size.iterations - 1
        outputs = {(base.run.name, -1, p): passes[p] for p in FINAL_SPLITS}
        outputs |= {(r.run.name, last, p): passes[p] for r in recipes.values()
                    for p in FINAL_SPLITS}
        res = read_results(store, refs, outputs)
        sm = summarise(res, names, seeds, prefix, size)
        with_recast = all(a in names for pair in RECAST_PAIRS for a in pair)
        rs = summarise_recast(res, sm, prefix, size) if with_recast else None
        skipped = sum(r.skipped for by in refs.values() for r in by.values())
        setup = {"arms": names, "arm_defs": arm_defs, "seeds": seeds, "size": size,
                 "prefix": prefix, "store": store, "command": command, "skipped": skipped,
                 "quick": quick,
                 "wall_s": time.perf_counter() - start, "passes": passes,
                 "recipes": {a: recipes[(a, 0)] for a in names}, "aliases": aliases,
                 "recast": recipes[("recast-equal", 0)].recast if with_recast else None}
        written = write_report(Path(report_dir), sm, res, setup, rs)
        print(f"wall time {setup['wall_s']:.1f} s; report {written['report']}")
        return {"summary": sm, "recast": rs, "wall_s": setup["wall_s"], **written}
