"""Reading and writing a table's Parquet parts, and telling a damaged one: a part whose Parquet
footer cannot be read (a truncated or overwritten file) is left out of `Store.read_table` with a
`DamagedPartWarning`, so one damaged file does not break the reads of every other run (`cast
verify` says which stage wrote it).

Small parts are cached per process (`read_parts`): a store holds one `stages` part per stage
record, so reading one run's records (which every training stage and every Prefect task's guard
does) reads every part of every run, and the cost grew with the store: 1.2 s of CPU per filtered
read of 2,000 parts, 3 s for 5,300. A process's first read of a table scans it with the filter
pushed down to the Parquet statistics, as before (a one-shot command pays nothing more); from
its second read on, every part is read whole once and kept, and a read costs the parts' stats
(0.04 s for 2,000 parts). A cached part is keyed on its path, inode, size and mtime, so a part
rewritten under the same name (always by an atomic rename, a new inode) is read again, and a
deleted one is no longer listed. Parts over `CACHE_PART_BYTES` are read each time, and the cache
drops its least recently used parts beyond `CACHE_TOTAL_BYTES` of files.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

# What `Store.read_table` filters on: {column: value}, or an Arrow expression.
Filters = Mapping[str, Any] | pc.Expression | None


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


def damaged_parts(files: Sequence[Path]) -> list[Path]:
    """The parts of `files` whose footer does not read (`parquet_readable`), in order. A part
    whose footer read before in this process is not read again while it keeps its path, inode,
    size and mtime: parts are only replaced by an atomic rename (a new inode), and a truncation
    changes the size. So a catalog refresh reads the new parts' footers only, not the whole
    store's (0.42 s for the 1,742 parts of a 3-run benchmark store at iteration 25; every
    iteration's report refreshes). `cast verify` reads every footer (`parquet_readable`)."""
    bad = []
    for f in files:
        try:
            key = _key(Path(f))
        except OSError:  # gone since it was listed
            bad.append(f)
            continue
        if key in _footers_read:
            continue
        if parquet_readable(f):
            with _lock:
                _footers_read.add(key)
        else:
            bad.append(f)
    return bad


CACHE_PART_BYTES = 256 << 10
CACHE_TOTAL_BYTES = 64 << 20
_cache: OrderedDict[tuple, pa.Table] = OrderedDict()  # (path, inode, size, mtime) -> its rows
_cached_bytes = 0
_combined: dict[str, tuple[tuple, pa.Table]] = {}  # table dir -> (part keys, their rows)
_read_before: set[str] = set()  # table dirs this process has read
_footers_read: set[tuple] = set()  # (path, inode, size, mtime) of parts whose footer read
_lock = threading.Lock()


def clear_cache() -> None:
    """Forget every cached part, every table read and every footer read so far (the next read
    scans again)."""
    global _cached_bytes
    with _lock:
        _cache.clear()
        _combined.clear()
        _read_before.clear()
        _footers_read.clear()
        _cached_bytes = 0


def read_parts(files: Sequence[Path], schema: pa.Schema, filters: Filters) -> pa.Table:
    """The rows of `files` (in order) in the declared `schema` (a column a part lacks is null,
    one it has beyond the schema left out), filtered; small parts come from the cache (module
    docstring). All of a call's files are of one table, so they share the schema."""
    if not files:
        return schema.empty_table()
    table_dir = str(Path(files[0]).parent)
    if table_dir not in _read_before:  # a first read scans with the filter pushed down
        _read_before.add(table_dir)
        dataset = ds.dataset([str(f) for f in files], schema=schema, format="parquet")
        return dataset.to_table(filter=_expression(filters))
    keys = tuple(_key(Path(f)) for f in files)
    with _lock:  # Prefect may run tasks in threads
        last = _combined.get(table_dir)
        if last is not None and last[0] == keys:
            table = last[1]
        else:
            parts = _read_new(keys, schema)
            table = pa.concat_tables([parts[k] for k in keys]).combine_chunks()
            if all(k in _cache for k in keys):
                _combined[table_dir] = (keys, table)
    expression = _expression(filters)
    return table if expression is None else table.filter(expression)


def _key(path: Path) -> tuple:
    st = path.stat()
    return str(path), st.st_ino, st.st_size, st.st_mtime_ns


def _read_new(keys: tuple, schema: pa.Schema) -> dict[tuple, pa.Table]:
    """{key: rows} of every part, the uncached ones read in one dataset scan and cached when
    small (least recently used ones dropped beyond CACHE_TOTAL_BYTES)."""
    global _cached_bytes
    out = {}
    for k in keys:
        if k in _cache:
            _cache.move_to_end(k)
            out[k] = _cache[k]
    missing = [k for k in keys if k not in out]
    if not missing:
        return out
    batches = {k[0]: [] for k in missing}
    dataset = ds.dataset(list(batches), schema=schema, format="parquet")
    for tagged in dataset.scanner().scan_batches():
        batches[tagged.fragment.path].append(tagged.record_batch)
    for k in missing:
        out[k] = pa.Table.from_batches(batches[k[0]], schema=schema)
        if k[2] <= CACHE_PART_BYTES:
            _cache[k] = out[k]
            _cached_bytes += k[2]
    while _cached_bytes > CACHE_TOTAL_BYTES:
        old, _ = _cache.popitem(last=False)
        _cached_bytes -= old[2]
    return out


def _expression(filters: Filters) -> pc.Expression | None:
    if filters is None or isinstance(filters, pc.Expression):
        return filters
    terms = [pc.field(name) == value for name, value in filters.items()]
    expression = terms[0] if terms else None
    for term in terms[1:]:
        expression = expression & term
    return expression


def write_parquet(path: str, table: pa.Table, schema: pa.Schema) -> None:
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        writer.write_table(table)
