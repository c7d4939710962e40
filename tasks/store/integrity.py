"""Checking recorded outputs against their hashes, and rebuilding a damaged one from its inputs.

Every completion row of `stages` names its outputs and their sha256 (one per path since `stages`
version 2; older rows only a combined hash, and a blob's name is its hash). `check_record` rehashes
a record's files: each is ok, missing, changed (other bytes than recorded), unreadable (a Parquet
part whose footer does not read) or collected (deleted on purpose by `cast gc`). Only a path's
latest record speaks for it: a record whose table part a later record of the same stage rewrote
(another config, another code version) is superseded, not damaged.

Before a training iteration k starts (`prepare_iteration`, run by every training stage's Prefect
task through `guard_stage`), the run is checked against its pinned recipe and the current records
of the run-level stages and of iteration k - 1 are checked. A damaged one is rebuilt by running
its stage again on its recorded inputs (its cache key computed now must be the recorded one, up to
a change of code version), and kept only if the rebuilt output has exactly the recorded hash;
otherwise `DamagedOutputError` names the files and the commands that repair them. Older
iterations are left to `cast verify` (`verify_store` over every record; `--repair` runs the same
rebuilds): rehashing a whole run before each of its iterations would grow with the run, while one
iteration's outputs cost a fraction of a second for the shapes world (about 17 MB).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from cast_core.hub_snapshot import file_sha256
from tasks.stages.recipe import Recipe
from tasks.store import stage as stage_protocol  # code_version looked up at call time
from tasks.store.run_pin import pin_recipe
from tasks.store.stage import RUN_LEVEL, StageRef
from tasks.store.store import (
    BlobRef,
    StageRecord,
    Store,
    blob_name_hash,
    combined_hash,
    parquet_readable,
)

PathStatus = Literal["ok", "missing", "changed", "unreadable", "collected"]
# The stages of a training iteration in the order the flow runs them (run-level ones first).
TRAINING_CHAIN = ("build_csgs", "calibrate_window", "rollout", "score_atoms",
                  "compute_advantages", "recast_gains", "train_epoch")
_PROBLEMS = {"missing": "missing", "changed": "sha256 differs from the recorded one",
             "unreadable": "not a readable Parquet file"}


class DamagedOutputError(RuntimeError):
    """A recorded output is damaged and could not be rebuilt; the message says how to repair."""


class NotRebuildable(RuntimeError):
    """Why a damaged record cannot be rebuilt from its recorded inputs here."""


@dataclass(frozen=True)
class PathCheck:
    path: str
    status: PathStatus


@dataclass(frozen=True)
class RecordCheck:
    """One record (or, `record` None, a table part no record names) and its files' checks."""

    record: StageRecord | None
    paths: tuple[PathCheck, ...]
    superseded: bool = False

    @property
    def damaged(self) -> tuple[PathCheck, ...]:
        return tuple(p for p in self.paths if p.status in _PROBLEMS)

    @property
    def status(self) -> str:
        if self.superseded:
            return "superseded"
        return "damaged" if self.damaged else "ok"

    def problems(self) -> str:
        return "; ".join(f"{p.path}: {_PROBLEMS[p.status]}" for p in self.damaged)


def check_record(store: Store, record: StageRecord, collected: set[str]) -> RecordCheck:
    """Rehash each file a record names and compare with what the record says."""
    checks, actual = [], []
    for i, path in enumerate(record.paths):
        expected = (record.path_hashes[i] if record.path_hashes is not None
                    else blob_name_hash(path))
        full = store.resolve(path)
        if not full.exists():
            checks.append(PathCheck(path, "collected" if path in collected else "missing"))
            actual.append(BlobRef(path, expected or ""))
            continue
        digest = file_sha256(full)
        actual.append(BlobRef(path, digest))
        if expected is not None:
            checks.append(PathCheck(path, "ok" if digest == expected else "changed"))
        else:  # a table part of a version-1 record: only the combined hash knows its bytes
            checks.append(PathCheck(path, "ok" if parquet_readable(full) else "unreadable"))
    if record.path_hashes is None and all(c.status in ("ok", "collected") for c in checks) \
            and combined_hash(actual) != record.content_hash:
        checks = [PathCheck(c.path, "changed") if blob_name_hash(c.path) is None else c
                  for c in checks]
    return RecordCheck(record, tuple(checks))


def current_records(records: Sequence[StageRecord]) -> tuple[list[StageRecord], list[StageRecord]]:
    """(current, superseded): a record is superseded when a later record rewrote one of its
    table parts (blobs are content-addressed, so sharing one supersedes nothing)."""
    ordered = sorted(records, key=lambda r: r.finished_at)
    owner = {p: id(r) for r in ordered for p in r.paths if p.startswith("tables/")}
    current = [r for r in ordered
               if all(owner[p] == id(r) for p in r.paths if p.startswith("tables/"))]
    kept = {id(r) for r in current}
    return current, [r for r in ordered if id(r) not in kept]


def verify_store(store: Store, run_id: str | None = None) -> list[RecordCheck]:
    """Every record of the store (or of one run) checked, superseded ones marked, and every
    unreadable table part that no record names (e.g. a `stages` part itself)."""
    collected = store.collected_paths()
    records = store.stage_records()
    current, superseded = current_records(records)
    mine = [r for r in current if run_id in (None, r.run_id)]
    checks = [check_record(store, r, collected) for r in mine]
    checks += [RecordCheck(r, (), superseded=True) for r in superseded
               if run_id in (None, r.run_id)]
    named = {p for r in records for p in r.paths}
    for table in sorted({p.parent.name for p in (store.root / "tables").glob("*/*.parquet")}):
        for part in store.parts(table):
            relative = part.relative_to(store.root).as_posix()
            if relative not in named and not parquet_readable(part):
                checks.append(RecordCheck(None, (PathCheck(relative, "unreadable"),)))
    return checks


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
    from tasks.stages import (
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
    files = "\n".join(f"  {p.path}: {_PROBLEMS[p.status]}" for p in check.damaged)
    where = "the run-level" if r.iteration == RUN_LEVEL else f"iteration {r.iteration}'s"
    return (f"run {r.run_id!r}: {where} {r.stage} output is damaged and was not rebuilt:\n"
            f"{files}\nIt cannot be rebuilt here: {why}.\n"
            f"Repair: restore the file(s) from a backup; or, with the code and recipe that wrote "
            f"them, run `cast verify --repair --recipe RECIPE --root {store.root}`; or continue "
            f"as a new run (--set run.name='\"{recipe.run.name}-2\"'). "
            f"`cast verify --root {store.root}` lists every damaged file.")
