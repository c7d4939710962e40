"""`cast sql` is read-only (issue 19, item 4): every form of writing, reading outside the store,
attaching, loading extensions or undoing the lock is refused and leaves the store as it was; plain
queries, and reads of the store's own files, still work."""

import hashlib
from pathlib import Path

import duckdb
import pytest

from flows.cli import main
from tasks.store.store import Store


def _store(root: Path) -> Store:
    """A store with one checkpoints row and one atoms row, and its catalog."""
    store = Store(root)
    store.write_table("atoms", [{"run_id": "r", "prompt_id": "p", "atom_id": "a0",
                                 "atom_index": 0, "type": "object", "question": "a cube?",
                                 "answer": "yes", "parents": [], "subject": "cube",
                                 "object": None, "value": None}], part="r-run")
    store.refresh_catalog()
    return store


def _digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def store(tmp_path) -> Store:
    return _store(tmp_path / "store")


def _refused(store: Store, query: str, capsys) -> str:
    before = _digests(store.root.parent)
    assert main(["sql", query, "--root", str(store.root)]) == 1
    assert _digests(store.root.parent) == before  # nothing written, nothing removed
    return capsys.readouterr().err


ATOMS_PART = "tables/atoms/r-run.parquet"


@pytest.mark.parametrize("query, says", [
    # The attack: overwrite a part with an empty copy of itself.
    (f"COPY (SELECT * FROM atoms WHERE false) TO '{{root}}/{ATOMS_PART}'", "COPY"),
    ("COPY (SELECT 1 AS x) TO '{outside}/out.csv'", "COPY"),
    ("COPY atoms TO '{root}/tables/atoms/extra.parquet' (FORMAT parquet)", "COPY"),
    ("EXPORT DATABASE '{outside}/dump'", "EXPORT"),
    ("ATTACH '{outside}/new.duckdb' AS scratch", "ATTACH"),
    ("INSTALL httpfs", "read-only"),
    ("LOAD httpfs", "read-only"),
    ("SET enable_external_access = true", "SET"),
    ("SET lock_configuration = false", "SET"),
    ("RESET lock_configuration", "read-only"),
    ("CREATE TEMP TABLE scratch AS SELECT 1", "CREATE"),
    ("SELECT 1; COPY (SELECT 1) TO '{outside}/second.csv'", "exactly one statement"),
], ids=["copy-over-a-part", "copy-outside", "copy-new-part", "export", "attach", "install",
        "load", "set-external-access", "set-unlock", "reset-unlock", "temp-table",
        "second-statement"])
def test_cli_refuses_every_statement_but_a_query(store, tmp_path, capsys, query, says):
    err = _refused(store, query.format(root=store.root, outside=tmp_path), capsys)
    assert "query failed" in err and says in err
    assert not (tmp_path / "out.csv").exists() and not (tmp_path / "second.csv").exists()


def test_cli_cannot_read_files_outside_the_store(store, tmp_path, capsys):
    secret = tmp_path / "secret.csv"
    secret.write_text("password\nhunter2\n")
    for query in (f"SELECT * FROM read_csv('{secret}')",
                  f"SELECT * FROM read_text('{store.root}/../secret.csv')",
                  "SELECT * FROM read_text('/etc/hostname')",
                  f"SELECT * FROM glob('{tmp_path}/*')"):
        err = _refused(store, query, capsys)
        assert "query failed" in err and "hunter2" not in err


def test_cli_still_answers_queries_and_reads_the_stores_own_files(store, capsys):
    assert main(["sql", "SELECT count(*) AS n FROM atoms", "--root", str(store.root)]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == ["1", "(1 row)"]
    part = store.root / ATOMS_PART
    assert main(["sql", f"SELECT atom_id FROM read_parquet('{part}')", "--root",
                 str(store.root), "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ["atom_id", "a0"]
    assert main(["sql", "EXPLAIN SELECT * FROM atoms", "--root", str(store.root)]) == 0


@pytest.mark.parametrize("statement", [
    "COPY (SELECT 1 AS x) TO '{outside}/out.csv'",
    "SELECT * FROM read_csv('{outside}/secret.csv')",
    "ATTACH '{outside}/new.duckdb' AS scratch",
    "LOAD httpfs",
    "SET enable_external_access = true",
    "SET allowed_directories = ['/']",
    "SET lock_configuration = false",
])
def test_the_connection_itself_is_locked_down(store, tmp_path, statement):
    """Below the CLI's statement check, `connect_readonly`'s own settings refuse each form."""
    (tmp_path / "secret.csv").write_text("x\n1\n")
    con = store.connect_readonly()
    try:
        with pytest.raises(duckdb.Error):
            con.execute(statement.format(outside=tmp_path))
        assert con.execute("SELECT count(*) FROM atoms").fetchone() == (1,)
    finally:
        con.close()
    assert not (tmp_path / "out.csv").exists() and not (tmp_path / "new.duckdb").exists()
