"""Running the methods benchmark's stages: one arm x seed run with its probes and final
evaluation (`train_run`), many runs in spawned worker processes (`train_runs`), and the base
model's evaluations (`evaluate_base`). Stages are called as plain functions (no Prefect server) in
the order of `tasks.stages.iteration`, on one store; a stage already finished there is skipped, so a
re-run resumes."""

from __future__ import annotations

from methods.protocols import FINAL_SPLITS, EvalPass, Size, with_eval


def train_run(store, recipe, size: Size, passes: dict[str, EvalPass]) -> dict:
    """Run-level stages, the iterations with a probe after each, and the final evaluation ->
    {(iteration, what): StageRef} (what: a stage name, or "eval:<pass>")."""
    from tasks.stages.evaluate import evaluate_checkpoint
    from tasks.stages.iteration import plain_stages, run_iteration, run_setup

    stages = plain_stages()
    setup = run_setup(stages, store, recipe)
    refs = {(-1, name): ref for name, ref in setup.items()}
    for k in range(size.iterations):
        for name, ref in run_iteration(stages, store, recipe, setup, k).items():
            # ReCAST gains are recorded at the iteration they were estimated on
            refs[(ref.iteration if name == "recast_gains" else k, name)] = ref
        refs[(k, "eval:probe")] = evaluate_checkpoint(store, with_eval(recipe, passes["probe"]), k)
        spent = sum(r.seconds for (i, w), r in refs.items() if i == k and w != "eval:probe")
        print(f"{recipe.run.name} iteration {k}: {spent:.1f} s, probe "
              f"{refs[(k, 'eval:probe')].seconds:.1f} s", flush=True)
    last = size.iterations - 1
    for name in FINAL_SPLITS:
        refs[(last, f"eval:{name}")] = evaluate_checkpoint(store, with_eval(recipe, passes[name]),
                                                           last)
    print(f"{recipe.run.name} final evaluation: "
          f"{sum(refs[(last, f'eval:{n}')].seconds for n in FINAL_SPLITS):.1f} s", flush=True)
    return refs


def _train_run_in_worker(store_dir: str, recipe, size: Size, passes: dict[str, EvalPass]) -> dict:
    """`train_run` in a worker process: its own Store on the same root (every write is atomic and
    the catalog rebuild is locked, so runs of different names may write side by side)."""
    from tasks.store.store import Store

    return train_run(Store(store_dir), recipe, size, passes)


def train_runs(store, runs: list, size: Size, passes: dict[str, EvalPass],
               jobs: int = 1) -> dict:
    """`train_run` for each recipe of `runs` -> {run name: refs}; with jobs > 1, that many runs at
    a time in spawned worker processes (each with the recipe's own torch threads)."""
    if jobs <= 1:
        return {r.run.name: train_run(store, r, size, passes) for r in runs}
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {r.run.name: pool.submit(_train_run_in_worker, str(store.root), r, size, passes)
                   for r in runs}
        return {name: f.result() for name, f in futures.items()}


def evaluate_base(store, recipe, passes: dict[str, EvalPass]) -> dict:
    """Every pass on the base model (iteration -1) -> {(-1, "eval:<pass>"): StageRef}."""
    from tasks.stages.evaluate import evaluate_checkpoint

    return {(-1, f"eval:{p.name}"): evaluate_checkpoint(store, with_eval(recipe, p), -1)
            for p in passes.values()}


def recorded_refs(store, runs: list[str], iterations: int, passes: dict[str, EvalPass]) -> dict:
    """{run: {(iteration, what): StageRef}} as `train_runs` (iterations >= 1) or `evaluate_base`
    (iterations = -1: the base's passes) return them on a finished store, from the latest valid
    completion record of each stage whatever its cache key. An evaluation's pass is the split
    its `evals` part names. Raises FileNotFoundError naming what a run has not finished."""
    from tasks.stages.evaluate import STAGE as EVALUATE
    from tasks.stages.evaluate import evals_part
    from tasks.store.stage import StageRef

    out = {}
    for run in runs:
        refs = {}
        for record in store.stage_records(run):  # oldest first: a later record supersedes
            if store.stage_done(run, record.iteration, record.stage, record.cache_key) is None:
                continue
            what = record.stage
            if record.stage == EVALUATE:
                names = [p.name for p in passes.values() if f"tables/evals/"
                         f"{evals_part(run, record.iteration, list(p.splits))}.parquet"
                         in record.paths]
                if not names:
                    continue
                what = f"eval:{names[0]}"
            refs[(record.iteration, what)] = StageRef.from_record(record)
        last = iterations - 1
        wanted = ([(-1, f"eval:{p}") for p in passes] if iterations < 0 else
                  [(k, w) for k in range(iterations) for w in ("train_epoch", "eval:probe")]
                  + [(last, f"eval:{p}") for p in FINAL_SPLITS])
        missing = [key for key in wanted if key not in refs]
        if missing:
            raise FileNotFoundError(f"{run} has no finished {missing[:4]} in {store.root}: run "
                                    f"the benchmark without --report-only to finish it")
        out[run] = refs
    return out


def finished_refs(store, run: str, iterations: int, passes: dict[str, EvalPass],
                  required: bool) -> dict:
    """{run: refs} from `recorded_refs` when the store holds the run finished; {} when it does
    not and not `required` (the caller runs it), else its FileNotFoundError."""
    try:
        return recorded_refs(store, [run], iterations, passes)
    except FileNotFoundError:
        if required:
            raise
        return {}
