"""The one writer and reader of a CAST store: Parquet tables, content-addressed blobs, stage records
and the DuckDB catalog of views.

Layout under a store root:
    tables/<table>/<part>.parquet   one file per write, rewritten whole (never appended to)
    blobs/<hh>/<sha256>.<ext>       content-addressed binaries; tensors only as safetensors
    catalog.duckdb                  only VIEWs over the Parquet files, rebuilt by refresh_catalog
    catalog.lock                    the fcntl lock held while the catalog is rebuilt

Every file appears under its final name only when complete: it is written to a temporary name in
the same directory (a dot-name that no glob matches), fsynced, then `os.replace`d, so a crash
leaves the old file or the new one, never half of one. Paths in refs and tables are POSIX paths
relative to the root. A stage is done when its `stages` row exists and every path that row names
exists with the content it had when the row was written (combined sha256, and since `stages`
version 2 one sha256 per path); stages write that row last. A blob that `cast gc` deleted on
purpose (listed in `collected_blobs`) counts as present: the stage stays done.

Views read their files at query time, so a part written after a refresh is already listed; only
a table's first part needs a refresh (its view is empty until). A part whose Parquet footer cannot
be read (a truncated or overwritten file) is left out of its table's view, which then lists the
good parts by name, and out of `read_table` (with a warning); the `excluded_parts` view names what
was left out, so one damaged file does not break the queries on every other run (views are built
at refresh: a part damaged after the last refresh breaks its table's queries until the next).
Read-only connections are locked down with DuckDB's own settings: no file outside the store can be
read or written, no extension installed or loaded, nothing spilled to disk, the configuration
locked; a statement like COPY could still write under the store, so `cast sql` runs queries only.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from cast_core.hub_snapshot import file_sha256
from tasks.store.schemas import TABLES, SchemaError, conform, table_spec, view_sql

_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+-]*")
_STAGE = re.compile(r"[a-z][a-z0-9_]*")
_EXT = re.compile(r"[a-z0-9]+(\.[a-z0-9]+)*")


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


Filters = Mapping[str, Any] | pc.Expression | None


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
        digest = atomic_write(final, lambda tmp: _write_parquet(tmp, arrow, schema),
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
            return _read_parts(files, schema, filters)
        except Exception:  # re-raised below unless a damaged part explains it
            damaged = [f for f in files if not parquet_readable(f)]
            if not damaged:
                raise
        for f in damaged:
            warnings.warn(f"{f}: not a readable Parquet file, left out of {table!r}; run `cast "
                          f"verify --root {self.root}` to see what wrote it and how to rebuild it",
                          DamagedPartWarning, stacklevel=2)
        return _read_parts([f for f in files if f not in damaged], schema, filters)

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
        from safetensors.torch import save  # torch is imported only by the tensor methods

        contiguous = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
        return self.put_blob(save(contiguous, metadata=dict(metadata or {})), "safetensors")

    def get_tensors(self, ref_or_path: BlobRef | str | os.PathLike) -> dict[str, Any]:
        """Load a safetensors blob (never pickle) -> {name: CPU tensor}."""
        from safetensors.torch import load_file

        path = self.resolve(ref_or_path.path if isinstance(ref_or_path, BlobRef) else ref_or_path)
        if path.suffix != ".safetensors":
            raise ValueError(f"{path} is not a .safetensors file; tensors are only read from "
                             f"safetensors blobs written by put_tensors")
        return load_file(str(path))

    def record_stage(self, run_id: str, iteration: int, stage: str, cache_key: str,
                     refs: Sequence[TableRef | BlobRef], *, code_version: str | None = None,
                     started_at: datetime | None = None) -> TableRef:
        """Write a stage's completion row; call it after every other write of the stage."""
        finished_at = datetime.now(UTC)
        row = {"run_id": run_id, "iteration": iteration, "stage": stage, "cache_key": cache_key,
               "rows": sum(getattr(r, "rows", 0) for r in refs),
               "content_hash": combined_hash(refs), "paths": [r.path for r in refs],
               "code_version": code_version or _package_version(),
               "started_at": started_at or finished_at, "finished_at": finished_at,
               "path_hashes": [r.content_hash for r in refs]}
        return self.write_table("stages", [row], _stage_part(run_id, iteration, stage, cache_key))

    def record_failure(self, run_id: str, iteration: int, stage: str, cache_key: str,
                       reason: str, details: Mapping[str, Any] | None = None, *,
                       code_version: str | None = None) -> TableRef:
        """Write why a stage refused to record completion (`stage_failures`); a later failure of
        the same (run, iteration, stage, key) replaces it."""
        row = {"run_id": run_id, "iteration": iteration, "stage": stage, "cache_key": cache_key,
               "reason": reason, "code_version": code_version or _package_version(),
               "details_json": json.dumps(details, sort_keys=True, default=str) if details
               else None, "failed_at": datetime.now(UTC)}
        return self.write_table("stage_failures", [row],
                                _stage_part(run_id, iteration, stage, cache_key))

    def restore_record(self, record: StageRecord, replacing: str) -> None:
        """Make `record` its stage's record again after a call under cache key `replacing`
        wrote another (a rebuild whose output differed): that one is removed, `record` rewritten
        as it was."""
        other = self.root / "tables" / "stages" / (
            _stage_part(record.run_id, record.iteration, record.stage, replacing) + ".parquet")
        if replacing != record.cache_key:
            _remove(other)
        row = {**record.__dict__, "paths": list(record.paths),
               "path_hashes": list(record.path_hashes) if record.path_hashes else None}
        self.write_table("stages", [row], _stage_part(record.run_id, record.iteration,
                                                      record.stage, record.cache_key))

    def stage_records(self, run_id: str | None = None) -> list[StageRecord]:
        """Every readable completion record (of one run, or all), oldest first."""
        rows = self.read_table("stages", {"run_id": run_id} if run_id else None).to_pylist()
        return sorted((_record(r) for r in rows), key=lambda r: (r.finished_at, r.stage))

    def stage_done(self, run_id: str, iteration: int, stage: str,
                   cache_key: str) -> StageRecord | None:
        """The stage's record if it exists and every path it names exists; otherwise None."""
        name = _stage_part(run_id, iteration, stage, cache_key)
        part = self.root / "tables" / "stages" / f"{name}.parquet"
        if not part.exists():
            return None
        record = _record(pq.read_table(part).to_pylist()[0])
        same = (record.run_id, record.iteration, record.stage, record.cache_key) == (
            run_id, iteration, stage, cache_key)
        return record if same and self._outputs_intact(record) else None

    def last_finished_iteration(self, run_id: str, stage: str) -> int:
        """The largest iteration whose `stage` record is valid (paths exist); -1 if none."""
        rows = self.read_table("stages", {"run_id": run_id, "stage": stage}).to_pylist()
        return max((r["iteration"] for r in rows if self._paths_exist(_record(r))), default=-1)

    def collected_paths(self) -> set[str]:
        """Blob paths `cast gc` deleted on purpose (`collected_blobs`)."""
        if not self.parts("collected_blobs"):
            return set()
        return set(self.read_table("collected_blobs").column("path").to_pylist())

    def refresh_catalog(self) -> Path:
        """Rebuild catalog.duckdb (one view per table, and `excluded_parts`) under an exclusive
        lock, swapped in whole. A table with an unreadable part gets a view over its readable
        parts by name (parts written later need another refresh); the others read a glob."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "catalog.lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the lock file is closed
            tmp = self.root / f".catalog.tmp-{os.getpid()}.duckdb"
            try:
                _remove(tmp, Path(f"{tmp}.wal"))
                con = duckdb.connect(str(tmp))
                try:
                    excluded = []
                    for spec in TABLES.values():
                        files = self.parts(spec.name)
                        bad = [f for f in files if not parquet_readable(f)]
                        excluded += [(spec.name, self._relative(f)) for f in bad]
                        source = ([str(f) for f in files if f not in bad] if bad else
                                  str(self.root / "tables" / spec.name / "*.parquet"))
                        con.execute(view_sql(spec, source if files else None))
                        con.execute(f"COMMENT ON VIEW {spec.name} IS '{_quote(spec.doc)}'")
                    con.execute(_excluded_view_sql(excluded))
                    con.execute("CHECKPOINT")
                finally:
                    con.close()
                _fsync_and_hash(tmp)
                _remove(Path(f"{self.catalog_path}.wal"))  # a stale WAL must not meet a new file
                os.replace(tmp, self.catalog_path)
            finally:
                _remove(tmp, Path(f"{tmp}.wal"))
        return self.catalog_path

    def connect_readonly(self) -> duckdb.DuckDBPyConnection:
        """A read-only connection to the catalog, locked down: files are read only under the
        store root, nothing outside it is reachable, extensions cannot be installed or loaded,
        nothing spills to disk, and the configuration is locked so SQL cannot undo any of it.
        (A read-only catalog still lets `COPY ... TO` write files; `flows.cli` also refuses every
        statement but a query.) Close it when done. DuckDB shares one open database per path
        within a process: a connection opened while an older one is still open sees the catalog
        as it was then, and its settings, so close connections rather than keeping them."""
        if not self.catalog_path.exists():
            raise FileNotFoundError(
                f"no catalog at {self.catalog_path}; build it with `cast refresh --root "
                f"{self.root}` or Store(root).refresh_catalog()")
        con = duckdb.connect(str(self.catalog_path), read_only=True,
                             config={"autoinstall_known_extensions": False,
                                     "autoload_known_extensions": False})
        if con.execute("SELECT current_setting('lock_configuration')").fetchone()[0]:
            return con  # another open connection of this process already locked it down
        root = str(self.root).replace("'", "''")
        for statement in (f"SET allowed_directories = ['{root}/']", "SET temp_directory = ''",
                          "SET enable_external_access = false", "SET lock_configuration = true"):
            con.execute(statement)
        return con

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


def _stage_part(run_id: str, iteration: int, stage: str, cache_key: str) -> str:
    if not _STAGE.fullmatch(stage):
        raise ValueError(f"stage name {stage!r} must match {_STAGE.pattern}, e.g. 'score_atoms'")
    key = hashlib.sha256(f"{run_id}\n{iteration}\n{stage}\n{cache_key}".encode()).hexdigest()
    return f"{stage}-{iteration}-{key[:24]}"


def _record(row: Mapping[str, Any]) -> StageRecord:
    hashes = row.get("path_hashes")
    return StageRecord(**{**row, "paths": tuple(row["paths"]),
                          "path_hashes": tuple(hashes) if hashes is not None else None})


class DamagedPartWarning(UserWarning):
    """A table part that cannot be read was left out of a read."""


def parquet_readable(path: str | os.PathLike) -> bool:
    """Whether a Parquet file's footer (schema and row groups) reads; a truncated file's does
    not. Cheap: the data pages are not read (`cast verify` checks whole files' hashes)."""
    try:
        pq.read_metadata(path)
    except Exception:  # noqa: BLE001 (a damaged footer fails as OSError, Arrow or Unicode errors)
        return False
    return True


def _excluded_view_sql(excluded: Sequence[tuple[str, str]]) -> str:
    rows = ", ".join(f"('{_quote(t)}', '{_quote(p)}')" for t, p in excluded)
    source = (f"SELECT * FROM (VALUES {rows}) v(\"table_name\", path)" if excluded else
              "SELECT CAST(NULL AS VARCHAR) AS \"table_name\", CAST(NULL AS VARCHAR) AS path "
              "WHERE false")
    return (f"CREATE VIEW excluded_parts AS {source}; COMMENT ON VIEW excluded_parts IS "
            f"'Table parts left out of the views: their Parquet footer does not read (cast verify "
            f"names the stage that wrote each)'")


def _read_parts(files: Sequence[Path], schema: pa.Schema, filters: Filters) -> pa.Table:
    if not files:
        return schema.empty_table()
    dataset = ds.dataset([str(f) for f in files], schema=schema, format="parquet")
    return dataset.to_table(filter=_expression(filters))


def _expression(filters: Filters) -> pc.Expression | None:
    if filters is None or isinstance(filters, pc.Expression):
        return filters
    terms = [pc.field(name) == value for name, value in filters.items()]
    expression = terms[0] if terms else None
    for term in terms[1:]:
        expression = expression & term
    return expression


def _write_parquet(path: str, table: pa.Table, schema: pa.Schema) -> None:
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        writer.write_table(table)


def atomic_write_bytes(final: str | os.PathLike, data: bytes) -> str:
    """Write `data` to `final` atomically (see `atomic_write`); -> sha256 of the bytes."""
    return atomic_write(Path(final), lambda tmp: Path(tmp).write_bytes(data))


def atomic_write(final: Path, write: Callable[[str], None], *, exclusive: bool = False) -> str:
    """Write via `write(tmp_path)` into a temp file beside `final`, fsync, rename; -> sha256.
    `exclusive`: link instead of rename, so an existing `final` raises FileExistsError and
    stays as it was (the temp file is removed either way)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(final.parent / f".{final.name}.{os.getpid()}-{secrets.token_hex(6)}.tmp")
    try:
        open(tmp, "xb").close()  # unlike mkstemp, honours the umask (readable by the group)
        write(tmp)
        digest = _fsync_and_hash(Path(tmp))
        if exclusive:
            os.link(tmp, final)
            _remove(Path(tmp))
        else:
            os.replace(tmp, final)
    except BaseException:
        _remove(Path(tmp))
        raise
    directory = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return digest


def _fsync_and_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
        os.fsync(f.fileno())
    return digest.hexdigest()


def _remove(*paths: Path) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _quote(text: str) -> str:
    return text.replace("'", "''")


def _package_version() -> str:
    try:
        return f"cast-rl {metadata.version('cast-rl')}"
    except metadata.PackageNotFoundError:
        return "cast-rl unknown"
