"""Bad input and faults: a malformed prompt file, SIGKILL in the middle of a stage then resume, and
two flows writing one store at once (plus concurrent catalog refreshes). Stages are called directly
(no Prefect server); the runs that must be separate processes use `tests/pipeline_helpers.py` as a
child script."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from pipeline_helpers import (
    ITERATION_TABLES,
    REPO,
    STAGES,
    TRAIN_PROMPTS,
    assert_declared_schemas,
    child_env,
    ci_overrides,
    ci_recipe,
    finish_child,
    reference,
    run_iteration,
    start_child,
    table_rows,
    temp_files,
)

from tasks.stages.build_csgs import build_csgs
from tasks.stages.calibrate_window import calibrate_window
from tasks.store.schemas import TABLES
from tasks.store.store import Store

RUN_TABLES = ("csgs", "atoms", "calibration_curves", "windows")
# Columns that legitimately differ between two runs of the same seeds: wall-clock timings.
TIMING = ("stage_seconds_json",)


def _results(store: Store, run_id: str, drop: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """({table: run-level and iteration-0 rows without run_id, timings and `drop`}, LoRA
    tensors)."""
    tables = {table: [r for r in table_rows(store, table, run_id, ("run_id", *TIMING, *drop))
                      if r.get("iteration", 0) == 0]
              for table in RUN_TABLES + ITERATION_TABLES}
    return tables, store.get_tensors(tables["checkpoints"][0]["lora_path"])


def _assert_same_results(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    """Equal table contents (each non-empty) and bit-identical LoRA checkpoint tensors."""
    for table, rows in want[0].items():
        assert rows and got[0][table] == rows, table
    assert got[1].keys() == want[1].keys()
    assert all(torch.equal(got[1][name], want[1][name]) for name in want[1])


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"child exited ({proc.returncode}) before {path.name}:\n"
                                 f"{proc.stderr.read()[-4000:]}")
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.02)


def _recorded_stages(store: Store) -> list[str]:
    return sorted(store.read_table("stages").column("stage").to_pylist())


@pytest.mark.parametrize("bad_line", [
    '{"tag": "single_object", "include": [{"class": "circle", "count": 1}], "prompt": ',
    '{"tag": "no_such_tag", "include": [], "prompt": "a photo of a circle"}',
], ids=["bad-json", "bad-record"])
def test_malformed_prompt_file_names_file_and_line(tmp_path, bad_line):
    lines = TRAIN_PROMPTS.read_text().splitlines()[:10]
    lines[2] = bad_line
    prompts = tmp_path / "train-bad.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    recipe = ci_recipe(prompts)
    store = Store(tmp_path / "store")
    for stage in (build_csgs, calibrate_window):
        with pytest.raises(ValueError) as info:
            stage(store, recipe)
        message = str(info.value)
        assert str(prompts) in message and "line 3" in message, message
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*"))


@pytest.mark.parametrize("stage, delay", [
    ("train_epoch", 0.0),
    pytest.param("train_epoch", 1.0, marks=pytest.mark.slow),
    pytest.param("rollout", 0.5, marks=pytest.mark.slow),
    pytest.param("score_atoms", 0.05, marks=pytest.mark.slow),
    pytest.param("compute_advantages", 0.05, marks=pytest.mark.slow),
    pytest.param("calibrate_window", 0.5, marks=pytest.mark.slow),
    pytest.param("build_csgs", 0.5, marks=pytest.mark.slow),
])
def test_sigkill_mid_stage_then_resume(tmp_path_factory, tmp_path, stage, delay):
    """Kill the child `delay` s after `stage` starts (every earlier stage recorded). A fresh
    process skips exactly the stages that had finished, re-runs the rest, and the store then
    equals the uninterrupted reference run of the same seeds. With a delay the kill may land
    after the stage's own record: then that stage counts as finished, which is still correct."""
    ref_store, _, prompts, _ = reference(tmp_path_factory)
    root, markers = tmp_path / "store", tmp_path / "markers"
    markers.mkdir()
    overrides = ci_overrides(prompts)
    proc = start_child(tmp_path, root, overrides, markers)
    try:
        _wait_for(markers / f"{stage}.started", proc)
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    store = Store(root)
    index = STAGES.index(stage)
    finished = _recorded_stages(store)
    assert finished in (sorted(STAGES[:index]), sorted(STAGES[:index + 1])), finished
    if delay == 0.0:
        assert finished == sorted(STAGES[:index]), "the kill missed the stage"

    resumed = finish_child(start_child(tmp_path, root, overrides))
    assert {s for s, r in resumed.items() if r["skipped"]} == set(finished)
    assert all(resumed[s]["skipped"] is False for s in STAGES if s not in finished)
    assert _recorded_stages(store) == sorted(STAGES)
    _assert_same_results(_results(store, "shapes-ci"), _results(ref_store, "shapes-ci"))
    assert_declared_schemas(root)


def _concurrent_runs(tmp_path: Path, prompts: Path, names: tuple[str, str],
                     **extra) -> tuple[Store, dict]:
    """Child runs names[1] while this process runs names[0], both on one store, starting
    together (the parent waits until the child is about to call its first stage)."""
    root, markers = tmp_path / "store", tmp_path / "markers"
    markers.mkdir()
    proc = start_child(tmp_path, root, ci_overrides(prompts, **extra, **{"run.name": names[1]}),
                       markers, refresh=True)
    try:
        _wait_for(markers / "build_csgs.started", proc)
        store = Store(root)
        mine = run_iteration(store, ci_recipe(prompts, **extra, **{"run.name": names[0]}))
        store.refresh_catalog()
        theirs = finish_child(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return store, {names[0]: {s: r.to_dict() for s, r in mine.items()}, names[1]: theirs}


def _catalog_counts(store: Store, table: str) -> dict[str, int]:
    con = store.connect_readonly()
    try:
        rows = con.execute(f"SELECT run_id, count(*) FROM {table} GROUP BY run_id").fetchall()
    finally:
        con.close()
    return dict(rows)


def test_two_flows_write_one_store_at_once(tmp_path_factory, tmp_path):
    """Two runs (2 prompts x 2 samples each, to stay quick) in two processes on one store."""
    prompts = reference(tmp_path_factory)[2]
    tiny = {"prompts.per_iteration": 2, "prompts.group_size": 2, "train.micro_batch": 2}
    store, refs = _concurrent_runs(tmp_path, prompts, ("ci-a", "ci-b"), **tiny)
    assert all(not r["skipped"] for run in refs.values() for r in run.values())
    assert assert_declared_schemas(store.root) == 2 * (len(RUN_TABLES) + len(ITERATION_TABLES)
                                                       + len(STAGES))
    assert temp_files(store.root) == []
    store.refresh_catalog()
    for table in ("stages", "rollouts", "atom_scores", "advantages", "checkpoints",
                  "train_steps"):
        want = {run: store.read_table(table, {"run_id": run}).num_rows for run in refs}
        assert _catalog_counts(store, table) == want, table
    assert _catalog_counts(store, "rollouts") == {"ci-a": 4, "ci-b": 4}
    assert _catalog_counts(store, "stages") == {"ci-a": len(STAGES), "ci-b": len(STAGES)}
    assert _catalog_counts(store, "train_steps") == {"ci-a": 2, "ci-b": 2}
    # Same seeds, different run ids: the runs agree in everything but run_id and the
    # calibration plot (its title names the run), though they wrote the same blobs at once.
    a, b = (_results(store, run, ("plot_path",)) for run in refs)
    _assert_same_results(a, b)
    for run in refs:
        plot = store.read_table("windows", {"run_id": run})["plot_path"][0].as_py()
        assert store.resolve(plot).read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_two_flows_of_the_same_run_at_once(tmp_path_factory, tmp_path):
    ref_store, _, prompts, _ = reference(tmp_path_factory)
    store, _ = _concurrent_runs(tmp_path, prompts, ("shapes-ci", "shapes-ci"))
    assert_declared_schemas(store.root)
    assert temp_files(store.root) == []
    assert _recorded_stages(store) == sorted(STAGES)
    _assert_same_results(_results(store, "shapes-ci"), _results(ref_store, "shapes-ci"))


_REFRESH = """
import sys
from tasks.store.store import Store
store = Store(sys.argv[1])
for _ in range(int(sys.argv[2])):
    store.refresh_catalog()
    con = store.connect_readonly()
    try:
        print(con.execute("SELECT count(*) FROM rollouts").fetchone()[0], flush=True)
    finally:
        con.close()
"""


def test_concurrent_catalog_refreshes(tmp_path_factory, tmp_path):
    ref_store, _, _, _ = reference(tmp_path_factory)
    root = tmp_path / "store"
    shutil.copytree(ref_store.root, root, ignore=shutil.ignore_patterns("catalog.*"))
    store = Store(root)
    rounds = 8
    procs = [subprocess.Popen([sys.executable, "-c", _REFRESH, str(root), str(rounds)], cwd=REPO,
                              env=child_env(tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-4000:]
        counts = [int(line) for line in out.split()]
        assert counts == [store.read_table("rollouts").num_rows] * rounds
    assert temp_files(root) == []
    con = store.connect_readonly()
    try:
        views = {r[0] for r in con.execute(
            "SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
        scores = con.execute("SELECT count(*) FROM atom_scores").fetchone()[0]
    finally:
        con.close()
    assert views == set(TABLES) | {"excluded_parts"}  # the parts left out (none here)
    assert scores == store.read_table("atom_scores").num_rows
