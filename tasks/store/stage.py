"""What every stage shares: cache keys from content hashes, the completion-record protocol, and
seeds derived from ids.

A stage is a pure function `run(...) -> StageRef` plus a thin Prefect task. `run_stage` is the
protocol: if the store holds a valid completion record for (run, iteration, stage, cache key) the
stage is skipped and its recorded outputs are returned; otherwise the body writes its tables and
blobs (each atomically) and the completion row is written last. A crash therefore loses at most
the stage in flight, and correctness never depends on Prefect's own cache.

Cache keys are sha256 digests of canonical JSON: the stage name, the recipe sections it reads, the
content hashes of its inputs (upstream stages' outputs, prompt files, weights) and the code version
(a hash of the Python sources of cast_core/ and tasks/, `source_files`). The Prefect wrapper
(`tasks.stages.guard.stage_task`) uses the same key for Prefect's result cache (results persisted
as JSON under Prefect's local storage), but only once the store confirms the stage is done, so a
Prefect cache hit can never stand in for outputs that are gone.

Invalid output is never recorded: a body that raises `StageRefused` (e.g. non-finite LoRA weights)
or writes a table part with no rows leaves a `stage_failures` row saying why, no completion row,
and the error propagates (the flow exits non-zero).

The Prefect wrapper also guards each stage before it runs (`tasks.stages.guard.guard_stage`): the
run must be pinned to this recipe (`tasks.store.run_pin`), and a training iteration's stages first
check what the iteration builds on (the run-level outputs and the previous iteration's) against
their recorded hashes (`tasks.store.integrity`), rebuilding a damaged one when its recorded inputs
allow.

Run-level stages (CSGs, window calibration) are recorded with iteration RUN_LEVEL (-1).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tasks.store.records import BlobRef, StageRecord, TableRef
from tasks.store.store import Store

RUN_LEVEL = -1
_PACKAGES = ("cast_core", "tasks")
_REPO_ROOT = Path(__file__).resolve().parents[2]  # this file is tasks/store/stage.py


class StageRefused(RuntimeError):
    """A stage's output is invalid, so it records no completion; `details` (JSON-able figures)
    go to the `stage_failures` row with the message."""

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.details = details or {}


@dataclass(frozen=True)
class StageRef:
    """The small result of a stage: what it wrote (paths relative to the store root), a combined
    content hash of those outputs, their row count, and whether this call skipped the work."""

    stage: str
    iteration: int
    cache_key: str
    content_hash: str
    rows: int
    paths: tuple[str, ...]
    skipped: bool
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "paths": list(self.paths)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageRef:
        return cls(**{**data, "paths": tuple(data["paths"])})

    @classmethod
    def from_record(cls, record: StageRecord, skipped: bool = True,
                    seconds: float = 0.0) -> StageRef:
        """The ref of a recorded stage (what a skipped call returns)."""
        return cls(record.stage, record.iteration, record.cache_key, record.content_hash,
                   record.rows, tuple(record.paths), skipped, seconds)

    def path_with(self, marker: str) -> str:
        """The one output path containing `marker` (e.g. '/rollouts/' or '.safetensors')."""
        hits = [p for p in self.paths if marker in p]
        if len(hits) != 1:
            raise KeyError(f"stage {self.stage!r} has {len(hits)} outputs matching {marker!r}: "
                           f"{list(self.paths)}")
        return hits[0]


def source_files() -> list[Path]:
    """Every .py file under cast_core/ and tasks/ (their subpackages included), package by
    package, each package's files sorted: what `code_version` hashes."""
    return [path for package in _PACKAGES
            for path in sorted((_REPO_ROOT / package).rglob("*.py"))]


@functools.cache
def code_version() -> str:
    """sha256 over the Python sources of cast_core and tasks (relative path + bytes), 16 hex."""
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(path.relative_to(_REPO_ROOT).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def make_key(stage: str, config: Any, inputs: dict[str, str]) -> str:
    """The cache key of a stage call: sha256 of its config, input hashes and the code version."""
    payload = {"stage": stage, "config": config, "inputs": inputs, "code": code_version()}
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from ids (run seed, iteration, prompt id, sample index, purpose...)."""
    text = "|".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def run_stage(store: Store, run_id: str, iteration: int, stage: str, cache_key: str,
              body: Callable[[], Sequence[TableRef | BlobRef]]) -> StageRef:
    """Skip if done (valid completion record), else run `body` and record completion last. A
    body that raises `StageRefused`, or writes an empty table part, records why (`stage_failures`)
    instead, and the error propagates."""
    t0 = time.perf_counter()
    done = store.stage_done(run_id, iteration, stage, cache_key)
    if done is not None:
        return StageRef.from_record(done, skipped=True, seconds=time.perf_counter() - t0)
    started = datetime.now(UTC)
    try:
        refs = list(body())
        _check_output(stage, iteration, refs)
    except StageRefused as refused:
        store.record_failure(run_id, iteration, stage, cache_key, str(refused), refused.details,
                             code_version=code_version())
        raise
    store.record_stage(run_id, iteration, stage, cache_key, refs, code_version=code_version(),
                       started_at=started)
    record = store.stage_done(run_id, iteration, stage, cache_key)
    if record is None:
        raise RuntimeError(f"stage {stage!r} wrote its record but it does not validate: a path it "
                           f"names is missing under {store.root}")
    return StageRef.from_record(record, skipped=False, seconds=time.perf_counter() - t0)


def _check_output(stage: str, iteration: int, refs: Sequence[TableRef | BlobRef]) -> None:
    """Every table part a stage writes must hold rows (an empty prompt file once gave 0 CSGs)."""
    empty = [r.path for r in refs if isinstance(r, TableRef) and r.rows == 0]
    if empty:
        raise StageRefused(f"stage {stage!r} (iteration {iteration}) wrote no rows to {empty}; "
                           f"empty output is invalid, so no completion was recorded: check the "
                           f"stage's inputs (prompt file, prompt selection, scorer)",
                           {"empty_parts": empty})
