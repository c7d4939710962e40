"""A stage's Prefect task (`stage_task`) and what it checks before the stage runs; rebuilding a
damaged output from its recorded inputs.

`stage_task` wraps a stage function `fn(store, recipe, ...) -> StageRef` (`tasks.store.stage`'s
protocol) as a Prefect task. Prefect's result cache is keyed on the stage's content-hash key, but
only once the store confirms the stage is done; results are persisted as JSON (never pickle).
Before `fn` runs, the task calls `guard_stage`: the run must be pinned to this recipe
(`tasks.store.run_pin`), and a training iteration's stages first check what the iteration builds
on.

Before a training iteration k starts (`prepare_iteration`), the current records of the run-level
stages and of iteration k - 1 are checked (`tasks.store.integrity.check_record`). A damaged one is
rebuilt by running its stage again on its recorded inputs (its cache key computed now must be the
recorded one, up to a change of code version), and kept only if the rebuilt output has exactly the
recorded hash; otherwise `DamagedOutputError` names the files and the commands that repair them.
Older iterations are left to `cast verify` (`verify_store` over every record; `--repair` runs the
same rebuilds, `repair`): rehashing a whole run before each of its iterations would grow with the
run, while one iteration's outputs cost a fraction of a second for the shapes world (about 17 MB).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence

from tasks.stages.iteration import ITERATION_STAGES, RUN_STAGES
from tasks.stages.recipe import Recipe
from tasks.store import stage as stage_protocol  # code_version looked up at call time
from tasks.store.integrity import PROBLEMS, RecordCheck, check_record, current_records
from tasks.store.records import StageRecord
from tasks.store.run_pin import pin_recipe
from tasks.store.stage import RUN_LEVEL, StageRef
from tasks.store.store import Store

# The stages of a training iteration in the order the flow runs them (run-level ones first).
TRAINING_CHAIN = RUN_STAGES + ITERATION_STAGES


class DamagedOutputError(RuntimeError):
    """A recorded output is damaged and could not be rebuilt; the message says how to repair."""


class NotRebuildable(RuntimeError):
    """Why a damaged record cannot be rebuilt from its recorded inputs here."""


def stage_task(fn: Callable[..., StageRef], stage: str, key_fn: Callable[..., str]):
    """The Prefect task of a stage function `fn(store, recipe, ...) -> StageRef`.

    Prefect's result cache is keyed on `key_fn` (the stage's content-hash key, called with the
    parameters it names) but only once the store confirms the stage is done; results are
    persisted as JSON (never pickle) under Prefect's local storage path. The task runs
    `guard_stage` before `fn` (recipe pin; inputs of a training iteration).
    """
    from prefect import task

    names = list(inspect.signature(key_fn).parameters)
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def guarded(*args, **kwargs) -> StageRef:
        bound = signature.bind(*args, **kwargs).arguments
        guard_stage(bound["store"], bound["recipe"], stage, bound.get("iteration", RUN_LEVEL))
        return fn(*args, **kwargs)

    def cache_key_fn(context, parameters) -> str | None:
        store, recipe = parameters["store"], parameters["recipe"]
        key = key_fn(**{n: parameters[n] for n in names})
        iteration = parameters.get("iteration", RUN_LEVEL)
        if store.stage_done(recipe.run.name, iteration, stage, key) is None:
            return None
        return f"{recipe.run.name}-{iteration}-{stage}-{key}"

    return task(guarded, name=stage, cache_key_fn=cache_key_fn, persist_result=True,
                result_serializer="json")


def prepare_iteration(store: Store, recipe: Recipe, iteration: int) -> list[StageRef]:
    """Before training iteration `iteration`: the recipe pin holds, and the current records of
    the run-level stages and of the previous iteration are intact, each damaged one rebuilt ->
    the rebuilt stages' refs (usually none). Raises RecipeMismatch or DamagedOutputError."""
    pin_recipe(store, recipe)
    records, _ = current_records(store.stage_records(recipe.run.name))
    inputs = [r for r in records if r.stage in TRAINING_CHAIN
              and r.iteration in (RUN_LEVEL, iteration - 1)]
    collected = store.collected_paths()
    damaged = [c for c in (check_record(store, r, collected) for r in inputs) if c.damaged]
    return repair(store, recipe, damaged)


def guard_stage(store: Store, recipe: Recipe, stage: str, iteration: int) -> None:
    """What a stage's Prefect task checks before it runs: the recipe pin, and for the stages of
    a training iteration (iteration >= 0) what the iteration builds on (`prepare_iteration`)."""
    if stage in TRAINING_CHAIN and iteration >= 0:
        for ref in prepare_iteration(store, recipe, iteration):
            logging.getLogger("cast.integrity").warning(
                "rebuilt iteration %d's %s: its outputs were damaged (%s)", ref.iteration,
                ref.stage, ", ".join(ref.paths))
    else:
        pin_recipe(store, recipe)


def repair(store: Store, recipe: Recipe, damaged: Sequence[RecordCheck]) -> list[StageRef]:
    """Rebuild each damaged record of the recipe's run, upstream stages first -> their refs;
    DamagedOutputError (files, reason, repair commands) for the first that cannot be."""
    order = sorted(damaged, key=lambda c: (c.record.iteration,
                                           TRAINING_CHAIN.index(c.record.stage)
                                           if c.record.stage in TRAINING_CHAIN else 99))
    rebuilt = []
    for check in order:
        try:
            rebuilt.append(rebuild(store, recipe, check.record))
        except NotRebuildable as why:
            raise DamagedOutputError(_repair_message(store, recipe, check, str(why))) from None
    return rebuilt


def rebuild(store: Store, recipe: Recipe, record: StageRecord) -> StageRef:
    """Run a damaged record's stage again on its recorded inputs; NotRebuildable unless the new
    output has exactly the recorded hash. The stage runs only if its cache key computed now is
    the recorded one, or differs only as far as the code version can explain (the code changed
    since: then the bytes decide). When the bytes differ, the old record is put back, so the
    damage stays reported rather than replaced by a record the later stages were not built on."""
    if record.run_id != recipe.run.name:
        raise NotRebuildable(f"it belongs to run {record.run_id!r}, not the recipe's run "
                             f"{recipe.run.name!r}")
    key, run = _stage_call(store, recipe, record.stage, record.iteration)
    code_now = stage_protocol.code_version()
    if key != record.cache_key and record.code_version == code_now:
        raise NotRebuildable("its cache key differs now: a cache-relevant setting (such as "
                             "sampling.chunk_size or train.micro_batch) or an input file changed")
    ref = run()
    if ref.content_hash != record.content_hash:
        store.restore_record(record, replacing=ref.cache_key)
        changed = (f" with today's code (version {code_now}; it was written by "
                   f"{record.code_version})" if record.code_version != code_now else "")
        raise NotRebuildable(f"running the stage again{changed} gave other bytes than the "
                             f"recorded ones, so the stages built on them would no longer match")
    return ref


def _stage_call(store: Store, recipe: Recipe, stage: str,
                iteration: int) -> tuple[str, Callable[[], StageRef]]:
    """(the stage's cache key now, a call that runs it) from the current intact records of its
    inputs; NotRebuildable for a stage this module does not rebuild."""
    from tasks.stages import (  # not at the top: each stage module imports this one
        build_csgs,
        calibrate_window,
        compute_advantages,
        rollout,
        score_atoms,
        train_epoch,
    )

    def up(name: str, k: int) -> StageRef:
        return _intact_ref(store, recipe.run.name, name, k)

    i = iteration
    if stage == "build_csgs":
        return build_csgs.cache_key(store, recipe), lambda: build_csgs.build_csgs(store, recipe)
    if stage == "calibrate_window":
        return (calibrate_window.cache_key(store, recipe),
                lambda: calibrate_window.calibrate_window(store, recipe))
    csgs = up("build_csgs", RUN_LEVEL)
    if stage == "rollout":
        window = up("calibrate_window", RUN_LEVEL)
        return (rollout.cache_key(store, recipe, csgs, window, i),
                lambda: rollout.rollout_groups(store, recipe, csgs, window, i))
    rollouts = up("rollout", i)
    if stage == "score_atoms":
        return (score_atoms.cache_key(store, recipe, csgs, rollouts),
                lambda: score_atoms.score_atoms(store, recipe, csgs, rollouts, i))
    scores = up("score_atoms", i)
    if stage == "compute_advantages":
        return (compute_advantages.cache_key(store, recipe, rollouts, scores),
                lambda: compute_advantages.compute_advantages(store, recipe, rollouts, scores, i))
    if stage == "train_epoch" and recipe.recast.weighting != "recast":
        adv = up("compute_advantages", i)
        return (train_epoch.cache_key(store, recipe, rollouts, scores, adv, i),
                lambda: train_epoch.train_epoch(store, recipe, csgs, rollouts, scores, adv, i))
    raise NotRebuildable(f"stage {stage!r} is not rebuilt automatically (only the stages of a "
                         f"training iteration without ReCAST gains are)")


def _intact_ref(store: Store, run_id: str, stage: str, iteration: int) -> StageRef:
    records, _ = current_records(store.stage_records(run_id))
    collected = store.collected_paths()
    for record in reversed(records):
        if (record.stage, record.iteration) == (stage, iteration) and \
                not check_record(store, record, collected).damaged:
            return StageRef.from_record(record)
    raise NotRebuildable(f"its input {stage!r} of iteration {iteration} has no intact record")


def _repair_message(store: Store, recipe: Recipe, check: RecordCheck, why: str) -> str:
    r = check.record
    files = "\n".join(f"  {p.path}: {PROBLEMS[p.status]}" for p in check.damaged)
    where = "the run-level" if r.iteration == RUN_LEVEL else f"iteration {r.iteration}'s"
    return (f"run {r.run_id!r}: {where} {r.stage} output is damaged and was not rebuilt:\n"
            f"{files}\nIt cannot be rebuilt here: {why}.\n"
            f"Repair: restore the file(s) from a backup; or, with the code and recipe that wrote "
            f"them, run `cast verify --repair --recipe RECIPE --root {store.root}`; or continue "
            f"as a new run (--set run.name='\"{recipe.run.name}-2\"'). "
            f"`cast verify --root {store.root}` lists every damaged file.")
