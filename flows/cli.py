"""`cast`: look into a CAST store with SQL.

    cast sql "SELECT ..." [--root ROOT] [--format table|csv|json]
    cast tables [--root ROOT]        every declared table with its row count
    cast examples                    the example queries docs/running.md shows
    cast refresh [--root ROOT]       (re)build the catalog of views
    cast verify [--root ROOT] [--run RUN] [--repair --recipe FILE [--set FIELD=JSON ...]]
                                     check every recorded output against its hashes
    cast gc --keep N [--root ROOT] [--run RUN] [--dry-run]
                                     delete old iterations' bulky blobs and the temp files
                                     of killed writers (tasks.store.gc)
    cast serve-scorer --scorer soft-tifa --model PATH [--host H --port P --device cuda]
                                     serve a scorer over HTTP (flows.scorer_service)

ROOT defaults to $CAST_STORE, else runs/store. `sql` and `tables` open the catalog read-only and
refresh nothing; `refresh` rebuilds it under the store's lock. Decimal results print as floats.

`sql` runs one query and nothing else: any statement but SELECT (or EXPLAIN) is refused before it
runs, and the connection itself (`Store.connect_readonly`) reads files only under the store and
cannot write, attach, load extensions or change its settings. `verify` exits 1 when a current
record's file is missing, changed or unreadable (`tasks.store.integrity`); `--repair` first
rebuilds (`tasks.stages.guard`) what the recipe's run can rebuild from recorded inputs. `gc`
prints what it deletes and the bytes freed.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
from collections.abc import Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import duckdb

from tasks.store.schemas import TABLES
from tasks.store.store import Store

_QUERY_TYPES = (duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN)

EXAMPLE_QUERIES: dict[str, str] = {
    "mean score per atom type and iteration": (
        "SELECT iteration, atom_type, avg(score) AS mean_score\n"
        "FROM atom_scores\n"
        "GROUP BY ALL ORDER BY ALL"),
    "prompts whose relation atoms fail most": (
        "SELECT c.prompt, avg(s.score) AS relation_score, count(*) AS scored\n"
        "FROM atom_scores s JOIN csgs c USING (run_id, prompt_id)\n"
        "WHERE s.atom_type = 'relation'\n"
        "GROUP BY ALL ORDER BY relation_score, c.prompt LIMIT 10"),
    "heatmap of the worst-scored relation atom": (
        "SELECT s.prompt_id, s.sample_index, a.question, s.score,\n"
        "       s.heatmap_h, s.heatmap_w, s.heatmap\n"
        "FROM atom_scores s JOIN atoms a USING (run_id, prompt_id, atom_id)\n"
        "WHERE s.atom_type = 'relation'\n"
        "ORDER BY s.score, s.iteration, s.prompt_id, s.sample_index, s.atom_id LIMIT 1"),
}

_CELL_WIDTH = 60


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve-scorer"]:  # its own CLI, with its own --help
        from flows.scorer_service import main as serve_scorer

        return serve_scorer(argv[1:]) or 0
    args = _parser().parse_args(argv)
    try:
        return _main(args)
    except BrokenPipeError:  # output piped into `head`: stop quietly, as the Python docs advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _main(args: argparse.Namespace) -> int:
    if args.command == "examples":
        for title, query in EXAMPLE_QUERIES.items():
            print(f"-- {title}\n{query};\n")
        return 0
    store = Store(args.root)
    if args.command == "refresh":
        print(f"catalog written: {store.refresh_catalog()}")
        return 0
    if args.command == "verify":
        return _verify(store, args)
    if args.command == "gc":
        return _gc(store, args)
    try:
        con = store.connect_readonly()
    except FileNotFoundError as e:
        print(f"cast: {e}", file=sys.stderr)
        return 2
    try:
        if args.command == "tables":
            query = " UNION ALL ".join(
                f"SELECT '{name}' AS \"table\", {spec.version} AS version, count(*) AS \"rows\" "
                f"FROM {name}" for name, spec in TABLES.items())
            print(_run(con, query, "table"))
        else:
            print(_run(con, _only_a_query(con, args.query), args.format))
        _warn_excluded(con, store)
    except (duckdb.Error, ValueError) as e:
        print(f"cast: query failed: {e}", file=sys.stderr)
        if f"{store.root}/tables/" in str(e):
            print(f"cast: a table part may be damaged: `cast refresh --root {store.root}` leaves "
                  f"unreadable parts out of the views, `cast verify --root {store.root}` names "
                  f"what wrote them", file=sys.stderr)
        return 1
    finally:
        con.close()
    return 0


def _only_a_query(con: duckdb.DuckDBPyConnection, query: str) -> duckdb.Statement:
    """The one statement of `query` if it is a SELECT (or EXPLAIN); ValueError otherwise."""
    statements = con.extract_statements(query)
    if len(statements) != 1:
        raise ValueError(f"give exactly one statement (got {len(statements)})")
    if statements[0].type not in _QUERY_TYPES:
        raise ValueError(f"cast sql is read-only: only SELECT (or EXPLAIN) runs, not "
                         f"{statements[0].type.name}; write to a store through the flows")
    return statements[0]


def _warn_excluded(con: duckdb.DuckDBPyConnection, store: Store) -> None:
    try:
        excluded = con.execute("SELECT \"table_name\", path FROM excluded_parts").fetchall()
    except duckdb.CatalogException:  # a catalog built before excluded_parts existed
        return
    if excluded:
        print(f"cast: note: {len(excluded)} damaged part(s) left out of the views "
              f"({', '.join(p for _, p in excluded)}); see `cast verify --root {store.root}`",
              file=sys.stderr)


def _verify(store: Store, args: argparse.Namespace) -> int:
    from tasks.stages.guard import DamagedOutputError, repair
    from tasks.stages.recipe import RecipeError, load_recipe, parse_overrides
    from tasks.store.integrity import verify_store

    if args.repair:
        if not args.recipe:
            print("cast: verify --repair needs --recipe (the run's recipe file)", file=sys.stderr)
            return 2
        try:
            recipe = load_recipe(args.recipe, parse_overrides(args.set))
            damaged = [c for c in verify_store(store, recipe.run.name)
                       if c.record is not None and c.status == "damaged"]
            for ref in repair(store, recipe, damaged):
                print(f"rebuilt: iteration {ref.iteration} {ref.stage}")
        except (RecipeError, DamagedOutputError) as e:
            print(f"cast: {e}", file=sys.stderr)
    checks = verify_store(store, args.run)
    rows = [[c.record.run_id if c.record else "?",
             (c.record.iteration if c.record.iteration >= 0 else "run") if c.record else "?",
             c.record.stage if c.record else "(no record)", c.status, len(c.paths),
             ", ".join(sorted({p.status for p in c.paths} - {"ok"}))] for c in checks]
    rows.sort(key=lambda r: (str(r[0]), str(r[1]), str(r[2])))
    print(_table(["run_id", "iteration", "stage", "status", "files", "not ok"], rows))
    bad = [c for c in checks if c.status == "damaged"]
    for c in bad:
        print("damaged: " + c.problems().replace("; ", "\ndamaged: "))
    print(f"{len(bad)} damaged record(s) of {len(checks)}" + (
        f"; rebuild with `cast verify --repair --recipe RECIPE --root {store.root}`" if bad
        else ""))
    return 1 if bad else 0


def _gc(store: Store, args: argparse.Namespace) -> int:
    from tasks.store.gc import collect, plan_gc

    try:
        plan = plan_gc(store, args.keep, args.run)
    except ValueError as e:
        print(f"cast: {e}", file=sys.stderr)
        return 2
    for run, kept in sorted(plan.kept.items()):
        print(f"{run}: keeping the blobs of iterations {list(kept)}")
    by_kind = ", ".join(f"{k} {_mb(v)}" for k, v in sorted(plan.bytes_by_kind().items()))
    orphans = (f"; and {len(plan.orphans)} orphaned temp file(s) of interrupted writes, "
               f"{_mb(plan.orphan_bytes)}" if plan.orphans else "")
    if args.dry_run:
        print(f"would delete {len(plan.blobs)} blob(s), {_mb(plan.bytes)}"
              + (f" ({by_kind})" if by_kind else "") + orphans + "; nothing deleted (--dry-run)")
        return 0
    freed = collect(store, plan)
    print(f"deleted {len(plan.blobs)} blob(s), freed {_mb(freed)}"
          + (f" ({by_kind})" if by_kind else "") + orphans)
    return 0


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cast", description="Query a CAST store with SQL.")
    commands = parser.add_subparsers(dest="command", required=True)
    default_root = os.environ.get("CAST_STORE", "runs/store")
    sql = commands.add_parser("sql", help="run one SQL query on the catalog (read-only)")
    sql.add_argument("query")
    sql.add_argument("--format", choices=("table", "csv", "json"), default="table")
    tables = commands.add_parser("tables", help="list the tables with their row counts")
    refresh = commands.add_parser("refresh", help="rebuild catalog.duckdb over the Parquet files")
    verify = commands.add_parser("verify", help="check every recorded output against its hashes "
                                 "(exit 1 on damage)")
    verify.add_argument("--run", default=None, help="only this run's records")
    verify.add_argument("--repair", action="store_true",
                        help="first rebuild the recipe's damaged outputs from their inputs")
    verify.add_argument("--recipe", default=None, help="the run's recipe file (with --repair)")
    verify.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                        help="override a recipe field, as the flows do")
    gc = commands.add_parser("gc", help="delete old iterations' window tensors, advantage maps "
                             "and optimizer states; keep every table row")
    gc.add_argument("--keep", type=int, required=True,
                    help="keep the blobs of each run's last N finished iterations (N >= 1)")
    gc.add_argument("--run", default=None, help="only this run")
    gc.add_argument("--dry-run", action="store_true", help="say what would go, delete nothing")
    commands.add_parser("examples", help="print the example queries")
    commands.add_parser("serve-scorer", help="serve a scorer over HTTP (see: cast serve-scorer "
                        "--help)")
    for command in (sql, tables, refresh, verify, gc):
        command.add_argument("--root", default=default_root,
                             help="store root (default: $CAST_STORE or runs/store)")
    return parser


def _run(con: duckdb.DuckDBPyConnection, query: str | duckdb.Statement, fmt: str) -> str:
    result = con.execute(query)
    if result.description is None:
        return "(no result)"
    names = [d[0] for d in result.description]
    rows = [[_plain(v) for v in row] for row in result.fetchall()]
    if fmt == "json":
        return json.dumps([dict(zip(names, row)) for row in rows], default=str, indent=1)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(names)
        writer.writerows([[json.dumps(v) if isinstance(v, list) else v for v in row]
                          for row in rows])
        return out.getvalue().rstrip("\n")
    return _table(names, rows)


def _plain(value: Any) -> Any:
    """DuckDB value -> JSON-friendly Python value (Decimal -> float, dates -> ISO text)."""
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _cell(value: Any) -> str:
    if value is None:
        text = "NULL"
    elif isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, list):
        text = "[" + ", ".join(_cell(v) for v in value) + "]"
    else:
        text = str(value)
    return text if len(text) <= _CELL_WIDTH else text[:_CELL_WIDTH - 3] + "..."


def _table(names: list[str], rows: list[list[Any]]) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(n)] + [len(r[i]) for r in cells]) for i, n in enumerate(names)]
    lines = ["  ".join(n.ljust(w) for n, w in zip(names, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(line.rstrip() for line in lines)


if __name__ == "__main__":
    sys.exit(main())
