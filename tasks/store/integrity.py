"""Checking recorded outputs against their hashes.

Every completion row of `stages` names its outputs and their sha256 (one per path since `stages`
version 2; older rows only a combined hash, and a blob's name is its hash). `check_record` rehashes
a record's files: each is ok, missing, changed (other bytes than recorded), unreadable (a Parquet
part whose footer does not read) or collected (deleted on purpose by `cast gc`). Only a path's
latest record speaks for it: a record whose table part a later record of the same stage rewrote
(another config, another code version) is superseded, not damaged.

`verify_store` checks every record of a store (`cast verify`). Rebuilding a damaged output runs
its stage again, so it lives with the stages: `tasks.stages.guard` (before each training
iteration, and `cast verify --repair`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from cast_core.hub_snapshot import file_sha256
from tasks.store.parts import parquet_readable
from tasks.store.records import BlobRef, StageRecord, blob_name_hash, combined_hash
from tasks.store.store import Store

PathStatus = Literal["ok", "missing", "changed", "unreadable", "collected"]
# what a damaged path's status means, for messages
PROBLEMS = {"missing": "missing", "changed": "sha256 differs from the recorded one",
            "unreadable": "not a readable Parquet file"}


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
        return tuple(p for p in self.paths if p.status in PROBLEMS)

    @property
    def status(self) -> str:
        if self.superseded:
            return "superseded"
        return "damaged" if self.damaged else "ok"

    def problems(self) -> str:
        return "; ".join(f"{p.path}: {PROBLEMS[p.status]}" for p in self.damaged)


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
