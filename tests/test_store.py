"""The store: declared schemas enforced on write, atomic files, content-addressed tensors, stage
records that gate resume, the DuckDB catalog of views, concurrent writers, and the `cast` CLI."""

import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from flows.cli import EXAMPLE_QUERIES, main
from tasks.store.schemas import TABLES, SchemaError, duckdb_type, prompt_id
from tasks.store.stage import code_version, source_files
from tasks.store.store import Store

REPO = Path(__file__).resolve().parents[1]


def _value(t: pa.DataType):
    if pa.types.is_list(t):
        return [_value(t.value_type), _value(t.value_type)]
    if pa.types.is_string(t):
        return "x"
    if pa.types.is_integer(t):
        return 3
    if pa.types.is_floating(t):
        return 0.25
    if pa.types.is_boolean(t):
        return True
    assert pa.types.is_timestamp(t), t
    return datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def _row(table: str) -> dict:
    return {f.name: _value(f.type) for f in TABLES[table].schema}


def _atom_row(pid: str, index: int, run_id: str = "r") -> dict:
    return {"run_id": run_id, "prompt_id": pid, "atom_id": f"a{index}", "atom_index": index,
            "type": "object", "question": "is there a cube?", "answer": "yes", "parents": [],
            "subject": "cube", "object": None, "value": None}


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _describe(store: Store, table: str) -> list[tuple[str, str]]:
    con = store.connect_readonly()
    try:
        return [(r[0], r[1]) for r in con.execute(f"DESCRIBE {table}").fetchall()]
    finally:
        con.close()


def _declared(table: str) -> list[tuple[str, str]]:
    return [(f.name, duckdb_type(f.type)) for f in TABLES[table].schema]


def test_prompt_id_is_sha256_prefix():
    text = "a photo of a red cube"
    assert prompt_id(text) == hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def test_every_table_writes_its_declared_schema_and_catalog_columns(tmp_path):
    store = Store(tmp_path)
    for table, spec in TABLES.items():
        ref = store.write_table(table, [_row(table)], part="p0")
        assert ref.path == f"tables/{table}/p0.parquet" and ref.rows == 1
        written = store.resolve(ref.path)
        assert pq.read_schema(written).equals(spec.schema, check_metadata=True), table
        assert ref.content_hash == hashlib.sha256(written.read_bytes()).hexdigest()
        assert store.read_table(table).schema.equals(spec.schema)
        assert spec.schema.metadata[b"cast.version"] == str(spec.version).encode()
    store.refresh_catalog()
    for table in TABLES:
        assert _describe(store, table) == _declared(table), table


def test_catalog_views_exist_and_are_typed_when_empty(tmp_path):
    store = Store(tmp_path)
    store.refresh_catalog()
    con = store.connect_readonly()
    try:
        for table in TABLES:
            assert con.execute(f"SELECT count(*) FROM {table}").fetchall() == [(0,)]
    finally:
        con.close()
    for table in TABLES:
        assert _describe(store, table) == _declared(table), table
    assert store.read_table("atoms").num_rows == 0
    assert store.read_table("atoms").schema.equals(TABLES["atoms"].schema)


@pytest.mark.parametrize("change, column", [
    (lambda r: r.pop("question"), "question"),          # missing column
    (lambda r: r.update(colour="red"), "colour"),       # unexpected column
    (lambda r: r.update(atom_index="first"), "atom_index"),  # string into an int column
    (lambda r: r.update(atom_index=1.5), "atom_index"),  # float into an int column
    (lambda r: r.update(question=7), "question"),       # number into a string column
    (lambda r: r.update(subject=None), "subject"),      # null in a non-nullable column
])
def test_invalid_rows_raise_naming_table_and_column_and_write_nothing(tmp_path, change, column):
    rows = [_atom_row("p", 0), _atom_row("p", 1)]
    change(rows[1])
    with pytest.raises(SchemaError, match=rf"table 'atoms'.*{column}"):
        Store(tmp_path).write_table("atoms", rows, part="bad")
    assert _files(tmp_path) == []


def test_arrow_input_accepts_safe_casts_only(tmp_path):
    store = Store(tmp_path)
    rows = [_atom_row("p", i) for i in range(3)]
    table = pa.Table.from_pylist(rows).drop_columns(["object", "value"]).append_column(
        "object", pa.nulls(3)).append_column("value", pa.nulls(3))   # other order, null type
    assert table.schema.field("atom_index").type == pa.int64()
    store.write_table("atoms", table, part="ok")
    assert store.read_table("atoms").column("atom_index").to_pylist() == [0, 1, 2]
    too_big = table.set_column(table.schema.get_field_index("atom_index"), "atom_index",
                               pa.array([0, 1, 2**40]))
    as_text = table.set_column(table.schema.get_field_index("atom_index"), "atom_index",
                               pa.array(["0", "1", "2"]))
    for bad in (too_big, as_text):
        with pytest.raises(SchemaError, match="column 'atom_index'"):
            store.write_table("atoms", bad, part="bad")
    assert [p.name for p in _files(tmp_path)] == ["ok.parquet"]


def test_crash_inside_the_writer_leaves_no_file_and_keeps_the_old_part(tmp_path, monkeypatch):
    store = Store(tmp_path)
    store.write_table("atoms", [_atom_row("old", 0)], part="p")
    table_dir = tmp_path / "tables" / "atoms"
    temps_seen = []

    def fail_after_open(self, *args, **kwargs):
        temps_seen.extend(table_dir.glob(".*.tmp"))
        raise OSError("disk full")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", fail_after_open)
    for part in ("p", "q"):
        with pytest.raises(OSError, match="disk full"):
            store.write_table("atoms", [_atom_row("new", 0)], part=part)
    assert len(temps_seen) == 2  # the failure came after the temporary file was opened
    assert [p.name for p in _files(table_dir)] == ["p.parquet"]
    assert store.read_table("atoms").column("prompt_id").to_pylist() == ["old"]


def test_read_table_filters(tmp_path):
    store = Store(tmp_path)
    store.write_table("atoms", [_atom_row("p", i, run_id="a") for i in range(3)], part="a")
    store.write_table("atoms", [_atom_row("p", i, run_id="b") for i in range(2)], part="b")
    assert store.read_table("atoms").num_rows == 5
    assert store.read_table("atoms", {"run_id": "b"}).num_rows == 2
    assert store.read_table("atoms", {"run_id": "a", "atom_index": 2}).num_rows == 1
    assert store.read_table("atoms", pc.field("atom_index") >= 1).num_rows == 3



def test_read_output_reads_a_stages_own_part_in_file_order_and_checks_the_schema(tmp_path):
    from tasks.store.stage import StageRef

    store = Store(tmp_path)
    rows = [_atom_row("p", i) for i in (2, 0, 1)]
    mine = store.write_table("atoms", rows, part="mine")
    store.write_table("atoms", [_atom_row("q", 5)], part="other")  # another stage's part
    ref = StageRef("build_csgs", 0, "k", "h", 3, (mine.path,), False, 0.0)
    got = store.read_output(ref, "atoms", ["atom_id", "atom_index"])
    assert got.column_names == ["atom_id", "atom_index"]
    assert got["atom_index"].to_pylist() == [2, 0, 1]  # file order, this part only
    assert store.read_output(ref, "atoms").num_rows == 3
    with pytest.raises(SchemaError, match="declares no columns \\['colour'\\]"):
        store.read_output(ref, "atoms", ["atom_id", "colour"])
    with pytest.raises(KeyError, match="outputs matching '/csgs/'"):
        store.read_output(ref, "csgs")
    # a part written under another schema (atom_index as text): named, not read as if right
    legacy = pa.table({**{k: [v] for k, v in _atom_row("p", 0).items()}, "atom_index": ["0"]})
    odd = tmp_path / "tables" / "atoms" / "legacy.parquet"
    pq.write_table(legacy, odd)
    old = StageRef("build_csgs", 0, "k", "h", 1, (str(odd.relative_to(tmp_path)),), False, 0.0)
    with pytest.raises(SchemaError, match="atom_index.*string.*int32"):
        store.read_output(old, "atoms")
    assert store.read_output(old, "atoms", ["atom_id"]).num_rows == 1  # other columns still read

def test_put_tensors_is_content_addressed_idempotent_and_exact(tmp_path):
    import torch

    g = torch.Generator().manual_seed(0)
    tensors = {"x": torch.randn(3, 2, generator=g).T, "ids": torch.arange(4),
               "b": torch.randn(5, generator=g).to(torch.bfloat16)}
    store = Store(tmp_path)
    ref = store.put_tensors(tensors)
    path = store.resolve(ref.path)
    assert ref.path == f"blobs/{ref.sha256[:2]}/{ref.sha256}.safetensors"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == ref.sha256
    stamp = path.stat().st_mtime_ns
    assert store.put_tensors({k: v.clone() for k, v in tensors.items()}) == ref
    assert path.stat().st_mtime_ns == stamp and len(_files(tmp_path)) == 1
    loaded = store.get_tensors(ref)
    assert sorted(loaded) == sorted(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t)
    assert store.get_tensors(ref.path)["ids"].tolist() == [0, 1, 2, 3]
    assert store.put_tensors({"x": tensors["x"] + 1}).path != ref.path
    with pytest.raises(ValueError, match="safetensors"):
        store.get_tensors(store.put_blob(b"not tensors", "bin"))


def test_tensor_rows_are_the_rows_of_the_whole_read(tmp_path):
    """A rank's read of some rows (runs and single rows, in any order, or none) is the whole
    tensor indexed by them, bitwise; tensors not named come back whole."""
    import torch

    g = torch.Generator().manual_seed(0)
    tensors = {"latents": torch.randn(7, 2, 3, 4, generator=g), "t": torch.rand(2, generator=g),
               "log_probs": torch.randn(7, 2, generator=g).to(torch.bfloat16)}
    store = Store(tmp_path)
    ref = store.put_tensors(tensors)
    for rows in ([0, 1, 2], [5, 6, 0, 3], [4], []):
        got = store.get_tensor_rows(ref, rows, {"latents", "log_probs"})
        assert sorted(got) == sorted(tensors)
        for name in ("latents", "log_probs"):
            assert got[name].dtype == tensors[name].dtype
            assert torch.equal(got[name], tensors[name][rows]), (name, rows)
        assert torch.equal(got["t"], tensors["t"])
    with pytest.raises(IndexError, match="out of range"):
        store.get_tensor_rows(ref.path, [6, 7], {"latents"})


def test_stage_records_gate_resume(tmp_path):
    store = Store(tmp_path)
    assert store.stage_done("r", 0, "score_atoms", "k1") is None
    ref = store.write_table("atoms", [_atom_row("p", i) for i in range(4)], part="r-0")
    blob = store.put_blob(b"heatmaps", "bin")
    store.record_stage("r", 0, "score_atoms", "k1", [ref, blob], code_version="test")
    record = store.stage_done("r", 0, "score_atoms", "k1")
    assert record is not None and record.paths == (ref.path, blob.path)
    assert record.rows == 4 and record.code_version == "test"
    lines = sorted([f"{ref.path}\t{ref.content_hash}", f"{blob.path}\t{blob.sha256}"])
    assert record.content_hash == hashlib.sha256("\n".join(lines).encode()).hexdigest()
    assert record.started_at <= record.finished_at and record.finished_at.tzinfo is not None
    assert store.stage_done("r", 0, "score_atoms", "k2") is None   # other cache key
    assert store.stage_done("r", 1, "score_atoms", "k1") is None   # other iteration
    store.resolve(blob.path).unlink()
    assert store.stage_done("r", 0, "score_atoms", "k1") is None


def test_last_finished_iteration(tmp_path):
    store = Store(tmp_path)
    assert store.last_finished_iteration("r", "train_epoch") == -1
    blobs = {}
    for iteration in range(3):
        blobs[iteration] = store.put_blob(f"ckpt {iteration}".encode(), "bin")
        store.record_stage("r", iteration, "train_epoch", f"k{iteration}", [blobs[iteration]])
    store.record_stage("other", 7, "train_epoch", "k", [])
    assert store.last_finished_iteration("r", "train_epoch") == 2
    assert store.last_finished_iteration("r", "evaluate") == -1
    store.resolve(blobs[2].path).unlink()
    assert store.last_finished_iteration("r", "train_epoch") == 1


def test_readonly_connection_cannot_write(tmp_path):
    store = Store(tmp_path)
    with pytest.raises(FileNotFoundError, match="refresh"):
        store.connect_readonly()
    store.refresh_catalog()
    con = store.connect_readonly()
    try:
        with pytest.raises(duckdb.Error):
            con.execute("CREATE TABLE scratch (i INTEGER)")
    finally:
        con.close()


PROMPTS = ("a red cube left of a blue ball", "a green cone above a cube", "two yellow balls")
ATOM_TYPES = (("object", "object", "relation"), ("object", "object", "relation"),
              ("object", "count"))


def _example_store(root: Path) -> tuple[Store, list[dict]]:
    """3 prompts x 2 iterations x 2 samples; score = (7 it + 3 p + s + 11 a + 1) / 100."""
    store = Store(root)
    csgs, atoms, scores = [], [], []
    for p, text in enumerate(PROMPTS):
        pid = prompt_id(text)
        csgs.append({"run_id": "r", "prompt_id": pid, "prompt": text, "tag": None,
                     "split": "train", "builder": "geneval", "graph_json": "{}",
                     "num_atoms": len(ATOM_TYPES[p])})
        for a, kind in enumerate(ATOM_TYPES[p]):
            atoms.append({**_atom_row(pid, a), "type": kind, "question": f"q{p}.{a}"})
            for it in range(2):
                for s in range(2):
                    score = (7 * it + 3 * p + s + 11 * a + 1) / 100
                    scores.append({"run_id": "r", "iteration": it, "prompt_id": pid,
                                   "sample_index": s, "atom_id": f"a{a}", "atom_type": kind,
                                   "score": score, "heatmap": [score * k for k in range(6)],
                                   "heatmap_h": 2, "heatmap_w": 3, "scorer_id": "exact"})
    store.write_table("csgs", csgs, part="r")
    store.write_table("atoms", atoms, part="r")
    store.write_table("atom_scores", scores[:20], part="r-a")
    store.write_table("atom_scores", scores[20:], part="r-b")
    store.refresh_catalog()
    return store, scores


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def test_example_queries_on_a_synthetic_store(tmp_path):
    store, scores = _example_store(tmp_path)
    con = store.connect_readonly()
    try:
        by_type, weakest, heatmap = (con.execute(q).fetchall() for q in EXAMPLE_QUERIES.values())
    finally:
        con.close()
    keys = sorted({(r["iteration"], r["atom_type"]) for r in scores})
    assert [k for *k, _ in by_type] == [list(k) for k in keys]
    for (it, kind, mean), key in zip(by_type, keys):
        assert mean == pytest.approx(_mean(r["score"] for r in scores
                                           if (r["iteration"], r["atom_type"]) == key))
    relation = {text: _mean(r["score"] for r in scores if r["atom_type"] == "relation"
                            and r["prompt_id"] == prompt_id(text)) for text in PROMPTS[:2]}
    assert [(text, pytest.approx(mean), 4) for text, mean in sorted(
        relation.items(), key=lambda kv: kv[1])] == weakest
    worst = min((r for r in scores if r["atom_type"] == "relation"), key=lambda r: r["score"])
    (pid, sample, question, score, h, w, values), = heatmap
    assert (pid, sample, question, h, w) == (worst["prompt_id"], 0, "q0.2", 2, 3)
    assert score == worst["score"] == (3 * 0 + 11 * 2 + 1) / 100
    assert values == pytest.approx([worst["score"] * k for k in range(6)])


def _concurrent_writer(root: str, writer: int, barrier, parts: int) -> None:
    store = Store(root)
    barrier.wait()
    for k in range(parts):
        rows = [_atom_row(f"w{writer}-{k}", i) for i in range(40)]
        store.write_table("atoms", rows, part=f"w{writer}-{k}")
        store.refresh_catalog()


def test_two_concurrent_writer_processes(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    barrier, parts = ctx.Barrier(2), 4
    workers = [ctx.Process(target=_concurrent_writer, args=(str(tmp_path), w, barrier, parts))
               for w in range(2)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(timeout=120)
    assert [p.exitcode for p in workers] == [0, 0]
    store = Store(tmp_path)
    files = store.parts("atoms")
    assert [f.stem for f in files] == sorted(f"w{w}-{k}" for w in range(2) for k in range(parts))
    for f in files:
        assert pq.read_schema(f).equals(TABLES["atoms"].schema, check_metadata=True)
        assert pq.read_table(f).num_rows == 40
    assert not [p for p in _files(tmp_path) if p.name.startswith(".")]
    con = store.connect_readonly()
    try:
        counts = con.execute("SELECT count(*), count(DISTINCT prompt_id) FROM atoms").fetchall()
    finally:
        con.close()
    assert counts == [(2 * parts * 40, 2 * parts)]


def test_cli_prints_query_results(tmp_path, capsys):
    _example_store(tmp_path)
    query = "SELECT atom_type, count(*) AS n FROM atom_scores GROUP BY ALL ORDER BY ALL"
    assert main(["sql", query, "--root", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["atom_type", "n"]
    assert [line.split() for line in lines[2:]] == [["count", "4"], ["object", "20"],
                                                    ["relation", "8"], ["(3", "rows)"]]
    decimal = "SELECT sum(x)::DECIMAL(6, 2) AS d FROM (VALUES (1.25), (2.5)) t(x)"
    assert main(["sql", decimal, "--root", str(tmp_path), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"d": 3.75}]
    assert main(["sql", "SELECT 1 AS a, [1, 2] AS l", "--root", str(tmp_path),
                 "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ["a,l", '1,"[1, 2]"']
    assert main(["sql", "SELECT nope FROM atoms", "--root", str(tmp_path)]) == 1
    assert "query failed" in capsys.readouterr().err


def test_cli_tables_and_examples(tmp_path, capsys):
    _example_store(tmp_path)
    assert main(["tables", "--root", str(tmp_path)]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert set(TABLES) <= set(rows)
    assert rows["atom_scores"] == ["1", "32"] and rows["evals"] == [str(TABLES["evals"].version), "0"]
    assert main(["examples"]) == 0
    out = capsys.readouterr().out
    assert all(q in out for q in EXAMPLE_QUERIES.values())


def test_cli_says_how_to_build_a_missing_catalog(tmp_path, capsys):
    assert main(["sql", "SELECT 1", "--root", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "no catalog at" in err and "cast refresh" in err
    assert main(["refresh", "--root", str(tmp_path / "nowhere")]) == 0
    assert main(["sql", "SELECT count(*) AS n FROM rollouts", "--root",
                 str(tmp_path / "nowhere")]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == ["0", "(1 row)"]


def test_cli_runs_as_a_module_with_the_root_from_the_environment(tmp_path):
    _example_store(tmp_path)
    env = {**os.environ, "CAST_STORE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "flows.cli", "sql",
                           "SELECT count(*) AS n FROM atoms"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["n", "-", "8", "(1 row)"]


def test_code_version_hashes_every_source_of_cast_core_and_tasks():
    """The code version covers every .py file under cast_core/ and tasks/, subpackages included
    (tasks/store/stage.py sits two folders below the repository root)."""
    root = Path(__file__).resolve().parents[1]
    expected = [p for package in ("cast_core", "tasks")
                for p in sorted((root / package).rglob("*.py"))]
    assert [p.resolve() for p in source_files()] == [p.resolve() for p in expected]
    listed = {p.resolve().relative_to(root).as_posix() for p in source_files()}
    assert {"tasks/store/stage.py", "tasks/stages/rollout.py", "tasks/reporting/report.py",
            "cast_core/csg/graph.py"} <= listed
    digest = hashlib.sha256()
    for path in expected:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    assert code_version() == digest.hexdigest()[:16]


def test_cached_part_reads_equal_a_dataset_read_and_follow_rewrites_and_deletes(tmp_path):
    """read_table serves small parts from a per-process cache: it must read what a fresh
    dataset scan reads, see a part rewritten under the same name, and drop a deleted one."""
    import pyarrow.dataset as ds

    store = Store(tmp_path)
    for k in range(3):
        store.write_table("atoms", [_atom_row(f"p{k}", i) for i in range(2)], part=f"part{k}")
    spec = TABLES["atoms"]

    def scanned(filters=None):
        files = [str(f) for f in store.parts("atoms")]
        return ds.dataset(files, schema=spec.schema, format="parquet").to_table(filter=filters)

    from tasks.store import parts

    for _ in range(2):  # the first read scans, the second reads every part, then the cache
        assert store.read_table("atoms").equals(scanned())
        assert store.read_table("atoms", {"prompt_id": "p1"}).equals(
            scanned(pc.field("prompt_id") == "p1"))
    assert sum(k[0].startswith(str(tmp_path)) for k in parts._cache) == 3
    store.write_table("atoms", [_atom_row("new", 0)], part="part1")
    assert store.read_table("atoms").column("prompt_id").to_pylist() == ["p0", "p0", "new",
                                                                          "p2", "p2"]
    (tmp_path / "tables" / "atoms" / "part0.parquet").unlink()
    assert store.read_table("atoms").equals(scanned())
    assert store.read_table("atoms").num_rows == 3


def test_catalog_refresh_reads_each_footer_once_and_finds_a_later_truncation(tmp_path,
                                                                             monkeypatch):
    """Every iteration's report refreshes the catalog; it must not read the whole store's
    footers each time, yet a part truncated since it was read is still left out."""
    from tasks.store import parts

    store = Store(tmp_path)
    for k in range(3):
        store.write_table("atoms", [_atom_row(f"p{k}", 0)], part=f"part{k}")
    parts.clear_cache()
    reads = []
    real = parts.parquet_readable
    monkeypatch.setattr(parts, "parquet_readable", lambda f: reads.append(Path(f).name) or real(f))
    store.refresh_catalog()
    assert sorted(reads) == ["part0.parquet", "part1.parquet", "part2.parquet"]
    reads.clear()
    store.write_table("atoms", [_atom_row("p3", 0)], part="part3")
    store.refresh_catalog()
    assert reads == ["part3.parquet"]
    reads.clear()
    damaged = tmp_path / "tables" / "atoms" / "part1.parquet"
    damaged.write_bytes(damaged.read_bytes()[:-9])  # in place: same inode, shorter
    store.refresh_catalog()
    assert reads == ["part1.parquet"]
    con = store.connect_readonly()
    try:
        assert con.execute("SELECT * FROM excluded_parts").fetchall() == [
            ("atoms", "tables/atoms/part1.parquet")]
        assert sorted(r[0] for r in con.execute("SELECT prompt_id FROM atoms").fetchall()) == [
            "p0", "p2", "p3"]
    finally:
        con.close()
