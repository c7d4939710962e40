"""Reading and writing a table's Parquet parts, and telling a damaged one: a part whose Parquet
footer cannot be read (a truncated or overwritten file) is left out of `Store.read_table` with a
`DamagedPartWarning`, so one damaged file does not break the reads of every other run (`cast
verify` says which stage wrote it).
"""

from __future__ import annotations

import os
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


def read_parts(files: Sequence[Path], schema: pa.Schema, filters: Filters) -> pa.Table:
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


def write_parquet(path: str, table: pa.Table, schema: pa.Schema) -> None:
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        writer.write_table(table)
