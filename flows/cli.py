"""`cast`: look into a CAST store with SQL.

    cast sql "SELECT ..." [--root ROOT] [--format table|csv|json]
    cast tables [--root ROOT]        every declared table with its row count
    cast examples                    the example queries the README shows
    cast refresh [--root ROOT]       (re)build the catalog of views
    cast serve-scorer --scorer soft-tifa --model PATH [--host H --port P --device cuda]
                                     serve a scorer over HTTP (cast_core.scorers.service)

ROOT defaults to $CAST_STORE, else runs/store. `sql` and `tables` open the catalog read-only and
refresh nothing; `refresh` rebuilds it under the store's lock. Decimal results print as floats.
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

from tasks.schemas import TABLES
from tasks.store import Store

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
        from cast_core.scorers.service import main as serve_scorer

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
            print(_run(con, args.query, args.format))
    except duckdb.Error as e:
        print(f"cast: query failed: {e}", file=sys.stderr)
        return 1
    finally:
        con.close()
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cast", description="Query a CAST store with SQL.")
    commands = parser.add_subparsers(dest="command", required=True)
    default_root = os.environ.get("CAST_STORE", "runs/store")
    sql = commands.add_parser("sql", help="run one SQL query on the catalog (read-only)")
    sql.add_argument("query")
    sql.add_argument("--format", choices=("table", "csv", "json"), default="table")
    tables = commands.add_parser("tables", help="list the tables with their row counts")
    refresh = commands.add_parser("refresh", help="rebuild catalog.duckdb over the Parquet files")
    commands.add_parser("examples", help="print the example queries")
    commands.add_parser("serve-scorer", help="serve a scorer over HTTP (see: cast serve-scorer "
                        "--help)")
    for command in (sql, tables, refresh):
        command.add_argument("--root", default=default_root,
                             help="store root (default: $CAST_STORE or runs/store)")
    return parser


def _run(con: duckdb.DuckDBPyConnection, query: str, fmt: str) -> str:
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
