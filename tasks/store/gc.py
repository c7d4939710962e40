"""`cast gc`: delete the bulky blobs of old iterations, keep every table row.

What an iteration writes that grows a store fastest is three blobs: the rollout's window steps
(`rollouts.latents_path`: x0, latents, next latents and log-probs of every sample), the advantage
maps (`advantage_maps.map_path`) and the AdamW state after training (`checkpoints.optimizer_path`,
twice the LoRA's size). Nothing reads them once the next iteration has trained: training reads only
its own iteration's steps and maps and the previous optimizer state, the report reads the latest
trained iteration's maps, and an evaluation reads a checkpoint's LoRA weights.

`plan_gc(store, keep)` lists those blobs for every finished iteration of a run except its last
`keep` (>= 1), and never one that a record outside those iterations also names (content-addressed
blobs can be shared): so the latest checkpoint's optimizer state, every iteration after the last
finished one (an unfinished iteration's inputs), run-level outputs, every LoRA, image, plot and
table part all stay. `collect` first writes the `collected_blobs` rows, then deletes: a stage
record naming a collected blob stays valid (the stage is done; `cast verify` says "collected").
Blobs that no record names are left alone: they may belong to a stage still running.

Orphaned temp files: a writer killed outright (SIGKILL, a lost node) leaves the temp file of its
atomic write (`tasks.store.files.TEMP_NAME`, a dot-name no query reads). `plan_gc` lists those last
modified more than `STALE_TEMP_S` ago (no write of a store's file takes that long; a fresher one
may be a write in progress, on this host or another) and `collect` deletes them; no row records
them, as no record ever named them.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime

from tasks.store.files import TEMP_NAME
from tasks.store.integrity import current_records
from tasks.store.records import blob_name_hash
from tasks.store.store import Store

# (table, column) that names each kind of bulky blob, one per iteration.
BULKY = {"window_steps": ("rollouts", "latents_path"),
         "advantage_maps": ("advantage_maps", "map_path"),
         "optimizer_state": ("checkpoints", "optimizer_path")}
STALE_TEMP_S = 3600.0  # a temp file older than this is an interrupted write's, not a running one


@dataclass(frozen=True)
class Collectable:
    """One blob gc may delete: where, its size, and which run, iteration and kind it belongs to."""

    path: str
    bytes: int
    run_id: str
    iteration: int
    kind: str


@dataclass(frozen=True)
class GcPlan:
    """The blobs to delete and, per run, the finished iterations whose blobs are kept; the
    orphaned temp files to delete (path under the root, bytes)."""

    keep: int
    blobs: tuple[Collectable, ...]
    kept: dict[str, tuple[int, ...]]
    orphans: tuple[tuple[str, int], ...] = ()

    @property
    def orphan_bytes(self) -> int:
        return sum(n for _, n in self.orphans)

    @property
    def bytes(self) -> int:
        return sum(b.bytes for b in self.blobs)

    def bytes_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for b in self.blobs:
            out[b.kind] += b.bytes
        return dict(out)


def plan_gc(store: Store, keep: int, run_id: str | None = None) -> GcPlan:
    """What `collect` would delete, keeping each run's last `keep` finished iterations."""
    if keep < 1:
        raise ValueError(f"--keep must be at least 1 (got {keep}): resuming needs the latest "
                         f"checkpoint's optimizer state and the report the latest iteration's maps")
    records, _ = current_records(store.stage_records(run_id))
    finished: dict[str, list[int]] = defaultdict(list)
    for r in records:
        if r.stage == "train_epoch" and r.iteration >= 0:
            finished[r.run_id].append(r.iteration)
    kept = {run: tuple(sorted(set(its))[-keep:]) for run, its in finished.items()}
    old = {(run, k) for run, its in finished.items() for k in set(its) if k not in kept[run]}
    protected = {p for r in store.stage_records() for p in r.paths
                 if (r.run_id, r.iteration) not in old}
    gone = store.collected_paths()
    blobs = {}
    for kind, (table, column) in BULKY.items():
        for row in store.read_table(table, {"run_id": run_id} if run_id else None).to_pylist():
            path = row[column]
            full = store.resolve(path)
            if ((row["run_id"], row["iteration"]) in old and path not in protected
                    and path not in gone and full.exists() and blob_name_hash(path)):
                blobs[path] = Collectable(path, full.stat().st_size, row["run_id"],
                                          row["iteration"], kind)
    ordered = sorted(blobs.values(), key=lambda b: (b.run_id, b.iteration, b.kind))
    return GcPlan(keep, tuple(ordered), kept, orphaned_temp_files(store))


def orphaned_temp_files(store: Store, older_than_s: float = STALE_TEMP_S,
                        now: float | None = None) -> tuple[tuple[str, int], ...]:
    """(path relative to the store root, bytes) of every atomic write's temp file last modified
    more than `older_than_s` seconds before `now` (module docstring), sorted by path."""
    now = time.time() if now is None else now
    found = []
    for path in store.root.rglob(".*.tmp"):
        if not TEMP_NAME.match(path.name):
            continue
        try:
            stat = path.stat()
        except FileNotFoundError:  # its writer finished or removed it meanwhile
            continue
        if now - stat.st_mtime > older_than_s:
            found.append((str(path.relative_to(store.root)), stat.st_size))
    return tuple(sorted(found))


def collect(store: Store, plan: GcPlan) -> int:
    """Record the plan's blobs as collected, then delete them and the orphaned temp files ->
    bytes freed."""
    freed = 0
    for name, size in plan.orphans:
        with contextlib.suppress(FileNotFoundError):
            (store.root / name).unlink()
            freed += size
    if not plan.blobs:
        return freed
    now = datetime.now(UTC)
    rows = [{"path": b.path, "sha256": blob_name_hash(b.path), "bytes": b.bytes,
             "run_id": b.run_id, "iteration": b.iteration, "kind": b.kind, "collected_at": now}
            for b in plan.blobs]
    store.write_table("collected_blobs", rows,
                      f"gc-{now:%Y%m%dT%H%M%S}-{secrets.token_hex(4)}")
    for b in plan.blobs:
        path = store.resolve(b.path)
        if path.exists():
            path.unlink()
            freed += b.bytes
    return freed
