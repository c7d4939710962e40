"""The one writer and reader of a CAST store: Parquet tables, content-addressed blobs, stage records
and the DuckDB catalog of views.

Layout under a store root:
    tables/<table>/<part>.parquet   one file per write, rewritten whole (never appended to)
    blobs/<hh>/<sha256>.<ext>       content-addressed binaries; tensors only as safetensors
    catalog.duckdb                  only VIEWs over the Parquet files, rebuilt by refresh_catalog
    catalog.lock                    the fcntl lock held while the catalog is rebuilt

Writing a file: `tasks.store.files` (atomic: complete under its final name, or absent). Paths in
refs and tables are POSIX paths relative to the root. The refs and completion records, and when a
stage counts as done: `tasks.store.records`. Reading parts, and a damaged part left out:
`tasks.store.parts`. The DuckDB views and the locked-down read-only connection:
`tasks.store.catalog`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import warnings
from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from cast_core.hub_snapshot import file_sha256
from tasks.store.catalog import build_catalog, connect_readonly
from tasks.store.files import atomic_write, atomic_write_bytes, remove_files
from tasks.store.parts import (
    DamagedPartWarning,
    Filters,
    parquet_readable,
    read_parts,
    write_parquet,
)
from tasks.store.records import (
    BlobRef,
    StageRecord,
    TableRef,
    blob_name_hash,
    combined_hash,
    package_version,
    stage_part,
    stage_record,
)
from tasks.store.schemas import SchemaError, conform, table_spec

_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+-]*")
_EXT = re.compile(r"[a-z0-9]+(\.[a-z0-9]+)*")


def _cat(parts: list[Any]) -> Any:
    import torch  # torch is imported only by the tensor functions

    return parts[0] if len(parts) == 1 else torch.cat(parts)


def tensor_bytes(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> bytes:
    """The safetensors bytes `Store.put_tensors` writes (their sha256 is the blob's hash)."""
    from safetensors.torch import save  # torch is imported only by the tensor functions

    contiguous = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    return save(contiguous, metadata=dict(metadata or {}))


class Store:
    """Reads and writes one store root; safe to use from several processes at once."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).resolve()
        self.catalog_path = self.root / "catalog.duckdb"

    def resolve(self, path: str | os.PathLike) -> Path:
        """A path stored in a table or ref (relative to the root, or absolute) -> absolute path."""
        return self.root / path

    def parts(self, table: str) -> list[Path]:
        table_spec(table)
        return sorted((self.root / "tables" / table).glob("*.parquet"))

    def write_table(self, table: str, data: pa.Table | Sequence[Mapping[str, Any]],
                    part: str, *, exclusive: bool = False) -> TableRef:
        """Validate rows against the declared schema and write them as `tables/<table>/<part>`;
        `exclusive`: only if that part does not exist yet (else FileExistsError, nothing
        written), decided atomically even between processes."""
        if not _PART.fullmatch(part):
            raise ValueError(f"part name {part!r} must match {_PART.pattern} (no slashes, no "
                             f"leading dot); build it from run id, iteration and shard")
        arrow = conform(table, data)
        schema = table_spec(table).schema
        final = self.root / "tables" / table / f"{part}.parquet"
        digest = atomic_write(final, lambda tmp: write_parquet(tmp, arrow, schema),
                              exclusive=exclusive)
        return TableRef(self._relative(final), digest, arrow.num_rows)

    def read_table(self, table: str, filters: Filters = None) -> pa.Table:
        """All readable parts of a table with its declared schema; `filters` is {column: value}
        or an Arrow expression. An empty table (declared schema) when nothing was written. A part
        whose footer cannot be read is left out with a warning naming it (`cast verify` says
        which stage wrote it and how to rebuild it)."""
        schema = table_spec(table).schema
        files = self.parts(table)
        try:
            return read_parts(files, schema, filters)
        except Exception:  # re-raised below unless a damaged part explains it
            damaged = [f for f in files if not parquet_readable(f)]
            if not damaged:
                raise
        for f in damaged:
            warnings.warn(f"{f}: not a readable Parquet file, left out of {table!r}; run `cast "
                          f"verify --root {self.root}` to see what wrote it and how to rebuild it",
                          DamagedPartWarning, stacklevel=2)
        return read_parts([f for f in files if f not in damaged], schema, filters)

    def read_output(self, ref: Any, table: str, columns: Sequence[str] | None = None) -> pa.Table:
        """The one part of `table` that stage `ref` (a StageRef, or anything with `path_with`)
        wrote, in file order, with `columns` (None: all) checked against the declared schema:
        every column must be declared, and stored with its declared type. The only way stages
        read each other's outputs (SchemaError names the table, the part and what differs)."""
        spec = table_spec(table)
        wanted = list(spec.schema.names if columns is None else columns)
        unknown = [c for c in wanted if c not in spec.schema.names]
        if unknown:
            raise SchemaError(f"table {table!r} declares no columns {unknown}; the declared "
                              f"columns (tasks/store/schemas.py) are {spec.schema.names}")
        path = self.resolve(ref.path_with(f"/{table}/"))
        stored = pq.read_schema(path)
        differ = [(c, str(stored.field(c).type) if c in stored.names else "missing",
                   str(spec.schema.field(c).type)) for c in wanted
                  if c not in stored.names or stored.field(c).type != spec.schema.field(c).type]
        if differ:
            raise SchemaError(f"{path}: the {table!r} part of stage {getattr(ref, 'stage', '?')!r}"
                              f" does not match the declared schema (column, stored, declared): "
                              f"{differ}; it was written by another schema version; rerun the "
                              f"stage (`cast verify` names it)")
        return pq.read_table(path, columns=wanted)

    def put_blob(self, data: bytes, ext: str) -> BlobRef:
        """Store bytes at `blobs/<hh>/<sha256>.<ext>`; the same bytes always give the same ref."""
        if not _EXT.fullmatch(ext):
            raise ValueError(f"blob extension {ext!r} must match {_EXT.pattern}, e.g. 'png'")
        digest = hashlib.sha256(data).hexdigest()
        final = self.root / "blobs" / digest[:2] / f"{digest}.{ext}"
        if not final.exists():
            atomic_write_bytes(final, data)
        return BlobRef(self._relative(final), digest)

    def put_tensors(self, tensors: Mapping[str, Any],
                    metadata: Mapping[str, str] | None = None) -> BlobRef:
        """Store named tensors as one safetensors blob (content-addressed, idempotent)."""
        return self.put_blob(tensor_bytes(tensors, metadata), "safetensors")

    def get_tensors(self, ref_or_path: BlobRef | str | os.PathLike) -> dict[str, Any]:
        """Load a safetensors blob (never pickle) -> {name: CPU tensor}."""
        from safetensors.torch import load_file

        path = self.resolve(ref_or_path.path if isinstance(ref_or_path, BlobRef) else ref_or_path)
        if path.suffix != ".safetensors":
            raise ValueError(f"{path} is not a .safetensors file; tensors are only read from "
                             f"safetensors blobs written by put_tensors")
        return load_file(str(path))

    def get_tensor_rows(self, ref_or_path: BlobRef | str | os.PathLike, rows: Sequence[int],
                        names: Collection[str]) -> dict[str, Any]:
        """Load a safetensors blob reading, of each tensor in `names`, only the first-axis `rows`
        (in that order; e.g. one data-parallel rank's samples), and the other tensors whole. Each
        run of consecutive rows is read as one slice, so only those rows' bytes come off the
        file: tensor[rows] of `get_tensors`, bitwise."""
        from safetensors import safe_open

        path = self.resolve(ref_or_path.path if isinstance(ref_or_path, BlobRef) else ref_or_path)
        if path.suffix != ".safetensors":
            raise ValueError(f"{path} is not a .safetensors file; tensors are only read from "
                             f"safetensors blobs written by put_tensors")
        rows = [int(i) for i in rows]
        runs: list[tuple[int, int]] = []  # [lo, hi) of consecutive rows
        for i in rows:
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        out = {}
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if name not in names:
                    out[name] = f.get_tensor(name)
                    continue
                part = f.get_slice(name)
                length = part.get_shape()[0]
                if any(not 0 <= i < length for i in rows):
                    raise IndexError(f"{path}: rows {rows} out of range for {name!r} of "
                                     f"{length} rows")
                out[name] = (_cat([part[lo:hi] for lo, hi in runs]) if runs
                             else part[0:0])
        return out

    def record_stage(self, run_id: str, iteration: int, stage: str, cache_key: str,
                     refs: Sequence[TableRef | BlobRef], *, code_version: str | None = None,
                     started_at: datetime | None = None) -> TableRef:
        """Write a stage's completion row; call it after every other write of the stage."""
        finished_at = datetime.now(UTC)
        row = {"run_id": run_id, "iteration": iteration, "stage": stage, "cache_key": cache_key,
               "rows": sum(getattr(r, "rows", 0) for r in refs),
               "content_hash": combined_hash(refs), "paths": [r.path for r in refs],
               "code_version": code_version or package_version(),
               "started_at": started_at or finished_at, "finished_at": finished_at,
               "path_hashes": [r.content_hash for r in refs]}
        return self.write_table("stages", [row], stage_part(run_id, iteration, stage, cache_key))

    def record_failure(self, run_id: str, iteration: int, stage: str, cache_key: str,
                       reason: str, details: Mapping[str, Any] | None = None, *,
                       code_version: str | None = None) -> TableRef:
        """Write why a stage refused to record completion (`stage_failures`); a later failure of
        the same (run, iteration, stage, key) replaces it."""
        row = {"run_id": run_id, "iteration": iteration, "stage": stage, "cache_key": cache_key,
               "reason": reason, "code_version": code_version or package_version(),
               "details_json": json.dumps(details, sort_keys=True, default=str) if details
               else None, "failed_at": datetime.now(UTC)}
        return self.write_table("stage_failures", [row],
                                stage_part(run_id, iteration, stage, cache_key))

    def restore_record(self, record: StageRecord, replacing: str) -> None:
        """Make `record` its stage's record again after a call under cache key `replacing`
        wrote another (a rebuild whose output differed): that one is removed, `record` rewritten
        as it was."""
        other = self.root / "tables" / "stages" / (
            stage_part(record.run_id, record.iteration, record.stage, replacing) + ".parquet")
        if replacing != record.cache_key:
            remove_files(other)
        row = {**record.__dict__, "paths": list(record.paths),
               "path_hashes": list(record.path_hashes) if record.path_hashes else None}
        self.write_table("stages", [row], stage_part(record.run_id, record.iteration,
                                                     record.stage, record.cache_key))

    def stage_records(self, run_id: str | None = None) -> list[StageRecord]:
        """Every readable completion record (of one run, or all), oldest first."""
        rows = self.read_table("stages", {"run_id": run_id} if run_id else None).to_pylist()
        return sorted((stage_record(r) for r in rows), key=lambda r: (r.finished_at, r.stage))

    def stage_done(self, run_id: str, iteration: int, stage: str,
                   cache_key: str) -> StageRecord | None:
        """The stage's record if it exists and every path it names exists; otherwise None."""
        name = stage_part(run_id, iteration, stage, cache_key)
        part = self.root / "tables" / "stages" / f"{name}.parquet"
        if not part.exists():
            return None
        record = stage_record(pq.read_table(part).to_pylist()[0])
        same = (record.run_id, record.iteration, record.stage, record.cache_key) == (
            run_id, iteration, stage, cache_key)
        return record if same and self._outputs_intact(record) else None

    def last_finished_iteration(self, run_id: str, stage: str) -> int:
        """The largest iteration whose `stage` record is valid (paths exist); -1 if none."""
        rows = self.read_table("stages", {"run_id": run_id, "stage": stage}).to_pylist()
        return max((r["iteration"] for r in rows if self._paths_exist(stage_record(r))), default=-1)

    def collected_paths(self) -> set[str]:
        """Blob paths `cast gc` deleted on purpose (`collected_blobs`)."""
        if not self.parts("collected_blobs"):
            return set()
        return set(self.read_table("collected_blobs").column("path").to_pylist())

    def refresh_catalog(self) -> Path:
        """Rebuild catalog.duckdb, swapped in whole (`tasks.store.catalog.build_catalog`)."""
        return build_catalog(self.root, self.catalog_path, self.parts)

    def connect_readonly(self) -> duckdb.DuckDBPyConnection:
        """A locked-down read-only connection to the catalog; close it when done (see
        `tasks.store.catalog.connect_readonly`)."""
        return connect_readonly(self.root, self.catalog_path)

    def _paths_exist(self, record: StageRecord) -> bool:
        missing = [p for p in record.paths if not self.resolve(p).exists()]
        return not missing or set(missing) <= self.collected_paths()

    def _outputs_intact(self, record: StageRecord) -> bool:
        """Every path exists (or was collected by gc) and still holds the bytes the stage wrote
        (a later run of the same run id under another config may have rewritten a table part)."""
        if not self._paths_exist(record):
            return False
        refs = [BlobRef(p, file_sha256(self.resolve(p)) if self.resolve(p).exists()
                        else blob_name_hash(p)) for p in record.paths]
        return combined_hash(refs) == record.content_hash

    def _relative(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()
