"""The DuckDB catalog of a store: `catalog.duckdb` holds only VIEWs over the Parquet files, one per
table (`tasks.store.schemas.view_sql`) and `excluded_parts`, rebuilt whole under `catalog.lock`.

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

import fcntl
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import duckdb

from tasks.store.files import fsync_and_hash, remove_files
from tasks.store.parts import damaged_parts
from tasks.store.schemas import TABLES, view_sql


def build_catalog(root: Path, catalog_path: Path,
                  parts: Callable[[str], list[Path]]) -> Path:
    """Rebuild `catalog_path` from the store under `root`, whose `parts(table)` lists a table's
    Parquet files: one view per table, and `excluded_parts`, built under an exclusive lock and
    swapped in whole. A table with an unreadable part gets a view over its readable parts by name
    (parts written later need another refresh); the others read a glob."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "catalog.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the lock file is closed
        tmp = root / f".catalog.tmp-{os.getpid()}.duckdb"
        try:
            remove_files(tmp, Path(f"{tmp}.wal"))
            con = duckdb.connect(str(tmp))
            try:
                excluded = []
                for spec in TABLES.values():
                    files = parts(spec.name)
                    bad = damaged_parts(files)
                    excluded += [(spec.name, f.relative_to(root).as_posix()) for f in bad]
                    source = ([str(f) for f in files if f not in bad] if bad else
                              str(root / "tables" / spec.name / "*.parquet"))
                    con.execute(view_sql(spec, source if files else None))
                    con.execute(f"COMMENT ON VIEW {spec.name} IS '{_quote(spec.doc)}'")
                con.execute(_excluded_view_sql(excluded))
                con.execute("CHECKPOINT")
            finally:
                con.close()
            fsync_and_hash(tmp)
            remove_files(Path(f"{catalog_path}.wal"))  # a stale WAL must not meet a new file
            os.replace(tmp, catalog_path)
        finally:
            remove_files(tmp, Path(f"{tmp}.wal"))
    return catalog_path


def connect_readonly(root: Path, catalog_path: Path) -> duckdb.DuckDBPyConnection:
    """A read-only connection to the catalog, locked down: files are read only under the
    store root, nothing outside it is reachable, extensions cannot be installed or loaded,
    nothing spills to disk, and the configuration is locked so SQL cannot undo any of it.
    (A read-only catalog still lets `COPY ... TO` write files; `flows.cli` also refuses every
    statement but a query.) Close it when done. DuckDB shares one open database per path
    within a process: a connection opened while an older one is still open sees the catalog
    as it was then, and its settings, so close connections rather than keeping them."""
    if not catalog_path.exists():
        raise FileNotFoundError(
            f"no catalog at {catalog_path}; build it with `cast refresh --root "
            f"{root}` or Store(root).refresh_catalog()")
    con = duckdb.connect(str(catalog_path), read_only=True,
                         config={"autoinstall_known_extensions": False,
                                 "autoload_known_extensions": False})
    if con.execute("SELECT current_setting('lock_configuration')").fetchone()[0]:
        return con  # another open connection of this process already locked it down
    quoted = str(root).replace("'", "''")
    for statement in (f"SET allowed_directories = ['{quoted}/']", "SET temp_directory = ''",
                      "SET enable_external_access = false", "SET lock_configuration = true"):
        con.execute(statement)
    return con


def _excluded_view_sql(excluded: Sequence[tuple[str, str]]) -> str:
    rows = ", ".join(f"('{_quote(t)}', '{_quote(p)}')" for t, p in excluded)
    source = (f"SELECT * FROM (VALUES {rows}) v(\"table_name\", path)" if excluded else
              "SELECT CAST(NULL AS VARCHAR) AS \"table_name\", CAST(NULL AS VARCHAR) AS path "
              "WHERE false")
    return (f"CREATE VIEW excluded_parts AS {source}; COMMENT ON VIEW excluded_parts IS "
            f"'Table parts left out of the views: their Parquet footer does not read (cast verify "
            f"names the stage that wrote each)'")


def _quote(text: str) -> str:
    return text.replace("'", "''")
