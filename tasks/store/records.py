"""What a store's writes return and what records a stage's completion: the refs of a written table
part or blob, the `stages` row (`StageRecord`), its part name and the combined hash of the outputs
it names. A stage is done when its `stages` row exists and every path that row names exists with
the content it had when the row was written (combined sha256, and since `stages` version 2 one
sha256 per path); stages write that row last. A blob that `cast gc` deleted on purpose (listed in
`collected_blobs`) counts as present: the stage stays done.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib import metadata
from typing import Any

_STAGE = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class TableRef:
    """A written Parquet part: path (relative to the root), sha256 of its bytes, row count."""

    path: str
    content_hash: str
    rows: int


@dataclass(frozen=True)
class BlobRef:
    """A content-addressed file: path (relative to the root) and the sha256 of its bytes."""

    path: str
    sha256: str

    @property
    def content_hash(self) -> str:
        return self.sha256


@dataclass(frozen=True)
class StageRecord:
    """One completion row of the `stages` table; `path_hashes` (the sha256 of each of `paths`) is
    None in rows written before `stages` version 2."""

    run_id: str
    iteration: int
    stage: str
    cache_key: str
    rows: int
    content_hash: str
    paths: tuple[str, ...]
    code_version: str
    started_at: datetime
    finished_at: datetime
    path_hashes: tuple[str, ...] | None = None


def blob_name_hash(path: str) -> str | None:
    """The sha256 a content-addressed blob path names (`blobs/<hh>/<sha256>.<ext>`), else None."""
    parts = path.split("/")
    if len(parts) != 3 or parts[0] != "blobs":
        return None
    digest = parts[2].split(".", 1)[0]
    return digest if re.fullmatch(r"[0-9a-f]{64}", digest) else None


def combined_hash(refs: Sequence[TableRef | BlobRef]) -> str:
    """sha256 over the sorted (path, content hash) pairs of a stage's outputs."""
    lines = sorted(f"{r.path}\t{r.content_hash}" for r in refs)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def stage_part(run_id: str, iteration: int, stage: str, cache_key: str) -> str:
    if not _STAGE.fullmatch(stage):
        raise ValueError(f"stage name {stage!r} must match {_STAGE.pattern}, e.g. 'score_atoms'")
    key = hashlib.sha256(f"{run_id}\n{iteration}\n{stage}\n{cache_key}".encode()).hexdigest()
    return f"{stage}-{iteration}-{key[:24]}"


def stage_record(row: Mapping[str, Any]) -> StageRecord:
    hashes = row.get("path_hashes")
    return StageRecord(**{**row, "paths": tuple(row["paths"]),
                          "path_hashes": tuple(hashes) if hashes is not None else None})


def package_version() -> str:
    try:
        return f"cast-rl {metadata.version('cast-rl')}"
    except metadata.PackageNotFoundError:
        return "cast-rl unknown"
