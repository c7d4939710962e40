"""Nothing lost or poisoned quietly (issue 19): a run is pinned to its recipe (item 2); damaged
outputs are found before an iteration builds on them, rebuilt when their inputs allow, reported by
`cast verify`, and kept out of other runs' queries (item 3); `cast gc` frees old iterations' bulky
blobs without touching what a resume or an evaluation needs (item 11).

The stages run directly on the CI recipe; `<stage>_task.fn` is the Prefect task's body, which
checks the pin and the iteration's inputs before the stage (tasks/stages/guard.py)."""

import shutil
import warnings
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pipeline_helpers import CI_RECIPE, SMALL, reference, run_iteration

from cast_core.hub_snapshot import file_sha256
from flows.cli import main
from tasks.reporting.report import iteration_report
from tasks.stages import score_atoms
from tasks.stages.build_csgs import build_csgs_task
from tasks.stages.evaluate import evaluate_checkpoint
from tasks.stages.guard import DamagedOutputError, prepare_iteration
from tasks.stages.recipe import Recipe
from tasks.stages.rollout import rollout_groups, rollout_task
from tasks.store.integrity import current_records, verify_store
from tasks.store.parts import DamagedPartWarning
from tasks.store.run_pin import RecipeMismatch, pin_recipe, read_pin
from tasks.store.stage import StageRef
from tasks.store.store import Store


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Recipe, Path]:
    """(store root, recipe, prompt file) of the reference run with iterations 0 and 1 trained."""
    ref_store, recipe, prompts, _ = reference(tmp_path_factory)
    root = shutil.copytree(ref_store.root, tmp_path_factory.mktemp("hardening") / "store")
    store = Store(root)
    for k in range(store.last_finished_iteration(recipe.run.name, "train_epoch") + 1, 2):
        run_iteration(store, recipe, k)
    return root, recipe, prompts


@pytest.fixture
def store(finished, tmp_path) -> Store:
    """A copy of the finished store this test may damage."""
    return Store(shutil.copytree(finished[0], tmp_path / "store"))


@pytest.fixture
def recipe(finished) -> Recipe:
    return finished[1]


def _ref(store: Store, recipe: Recipe, stage: str, iteration: int) -> StageRef:
    records, _ = current_records(store.stage_records(recipe.run.name))
    (record,) = [r for r in records if (r.stage, r.iteration) == (stage, iteration)]
    return StageRef.from_record(record)


def _run_level(store: Store, recipe: Recipe) -> tuple[StageRef, StageRef]:
    """The refs of build_csgs and calibrate_window."""
    return _ref(store, recipe, "build_csgs", -1), _ref(store, recipe, "calibrate_window", -1)


def _changed(recipe: Recipe, **sections) -> Recipe:
    """The recipe with some fields changed: _changed(r, train={"lr": 1e-3})."""
    return recipe.model_copy(update={name: getattr(recipe, name).model_copy(update=fields)
                                     for name, fields in sections.items()})


def _truncate(path: Path) -> bytes:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return data


def _scores_part(store: Store, recipe: Recipe, iteration: int) -> Path:
    return store.root / "tables" / "atom_scores" / f"{recipe.run.name}-{iteration:05d}.parquet"


def _repair_args(store: Store, recipe: Recipe, prompts: Path) -> list[str]:
    sets = [f"{k}={v}" for k, v in SMALL.items()] + [f'prompts.train="{prompts}"']
    return ["verify", "--root", str(store.root), "--repair", "--recipe", str(CI_RECIPE),
            *[a for s in sets for a in ("--set", s)]]


# -- item 2: a run is pinned to its recipe ------------------------------------------------------

def test_the_first_stage_pins_the_run_and_a_changed_recipe_is_refused(store, recipe):
    csgs, window = _run_level(store, recipe)
    assert read_pin(store, recipe.run.name) is None  # a store from before pinning
    assert build_csgs_task.fn(store, recipe).skipped
    pin = read_pin(store, recipe.run.name)
    assert pin.recipe_hash == recipe.pinned_hash() and pin.pinned == recipe.pinned()
    changed = _changed(recipe, train={"lr": 1e-3}, prompts={"per_iteration": 2})
    with pytest.raises(RecipeMismatch) as info:
        rollout_task.fn(store, changed, csgs, window, 2)
    message = str(info.value)
    assert "prompts.per_iteration: 4 (pinned) -> 2 (this recipe)" in message
    assert "train.lr: 0.0005 (pinned) -> 0.001 (this recipe)" in message
    assert f"--set run.name='\"{recipe.run.name}-2\"'" in message
    assert store.read_table("rollouts", {"iteration": 2}).num_rows == 0  # refused before work
    renamed = _changed(changed, run={"name": "another-run"})
    assert pin_recipe(store, renamed).created  # a new run id starts a new pin


def test_fields_that_cannot_change_results_may_differ(store, recipe):
    pin_recipe(store, recipe)
    free = _changed(recipe, run={"threads": 2}, train={"micro_batch": 2},
                    sampling={"chunk_size": 3}, backbone={"device": "cpu:0"},
                    scorer={"timeout_s": 5.0, "retries": 0}, builder={"cache_dir": "elsewhere"},
                    eval={"max_prompts": 1, "seed_offset": 100})
    assert not pin_recipe(store, free).created
    for section, field, value in (("sampling", "shared_noise", True), ("run", "seed", 1),
                                  ("advantage", "atom_norm", "pooled"),
                                  ("backbone", "path", "elsewhere")):
        with pytest.raises(RecipeMismatch, match=rf"{section}.{field}: "):
            pin_recipe(store, _changed(recipe, **{section: {field: value}}))


def test_a_field_added_later_is_pinned_only_when_set(recipe):
    assert "shared_noise" not in recipe.pinned()["sampling"]  # at its default: as before it existed
    assert _changed(recipe, sampling={"shared_noise": True}).pinned()["sampling"]["shared_noise"]
    assert "threads" not in recipe.pinned()["run"] and "eval" not in recipe.pinned()


def test_the_pin_is_written_once_even_when_two_processes_race(store, recipe):
    pin_recipe(store, recipe)
    part = store.root / "tables" / "runs" / f"{recipe.run.name}.parquet"
    before = part.read_bytes()
    with pytest.raises(FileExistsError):
        store.write_table("runs", pq.read_table(part), recipe.run.name, exclusive=True)
    assert part.read_bytes() == before and not [p for p in part.parent.iterdir()
                                                if p.name.startswith(".")]


# -- item 3: damaged outputs --------------------------------------------------------------------

def test_a_truncated_part_is_rebuilt_before_the_next_iteration(store, recipe):
    part = _scores_part(store, recipe, 1)
    original = _truncate(part)
    csgs, window = _run_level(store, recipe)
    ref = rollout_task.fn(store, recipe, csgs, window, 2)  # the guard rebuilds, then it samples
    assert part.read_bytes() == original
    assert not ref.skipped and store.read_table("rollouts", {"iteration": 2}).num_rows == 16
    assert all(c.status != "damaged" for c in verify_store(store))


def test_damage_that_cannot_be_rebuilt_stops_the_iteration_and_says_how_to_repair(
        store, recipe):
    part = store.root / "tables" / "rollouts" / f"{recipe.run.name}-00001.parquet"
    _truncate(part)
    damaged = part.read_bytes()
    changed = _changed(recipe, sampling={"chunk_size": 3})  # unpinned, but in the rollout's key
    csgs, window = _run_level(store, recipe)
    with pytest.raises(DamagedOutputError) as info:
        rollout_task.fn(store, changed, csgs, window, 2)
    message = str(info.value)
    assert "iteration 1's rollout output is damaged" in message
    assert f"{part.relative_to(store.root)}: sha256 differs from the recorded one" in message
    assert "its cache key differs now" in message
    assert f"cast verify --repair --recipe RECIPE --root {store.root}" in message
    assert part.read_bytes() == damaged
    assert not part.with_name(f"{recipe.run.name}-00002.parquet").exists()  # never began


def test_a_rebuild_with_other_bytes_is_not_kept(store, recipe, monkeypatch):
    part = _scores_part(store, recipe, 1)
    _truncate(part)
    before = {r.cache_key: r for r in store.stage_records(recipe.run.name)}
    real = score_atoms.score_in_chunks
    monkeypatch.setattr(score_atoms, "score_in_chunks", lambda *a: [
        (scores * 0.5, heat) for scores, heat in real(*a)])  # a scorer that changed its mind
    with pytest.raises(DamagedOutputError, match="gave other bytes than the recorded ones"):
        prepare_iteration(store, recipe, 2)
    assert {r.cache_key: r for r in store.stage_records(recipe.run.name)} == before
    assert [c.record.stage for c in verify_store(store) if c.status == "damaged"] == [
        "score_atoms"]  # still reported, not replaced by a record nothing was built on


def test_a_rebuild_under_changed_code_is_kept_when_its_bytes_match(store, recipe, monkeypatch):
    part = _scores_part(store, recipe, 1)
    original = _truncate(part)
    monkeypatch.setattr("tasks.store.stage.code_version", lambda: "0123456789abcdef")
    (ref,) = prepare_iteration(store, recipe, 2)
    assert (ref.stage, ref.iteration) == ("score_atoms", 1) and part.read_bytes() == original
    statuses = {(c.record.stage, c.record.code_version): c.status for c in verify_store(store)
                if c.record.iteration == 1 and c.record.stage == "score_atoms"}
    assert sorted(statuses.values()) == ["ok", "superseded"]
    assert statuses[("score_atoms", "0123456789abcdef")] == "ok"


def test_cast_verify_finds_the_damage_and_repair_rebuilds_it(store, recipe, finished, capsys):
    assert main(["verify", "--root", str(store.root)]) == 0
    assert "0 damaged record(s)" in capsys.readouterr().out
    part = _scores_part(store, recipe, 1)
    original = _truncate(part)
    rollouts = next((store.root / "tables" / "rollouts").glob("*-00000.parquet"))
    rollouts.write_bytes(rollouts.read_bytes()[:-1] + b"\0")  # one byte of the footer's magic
    assert main(["verify", "--root", str(store.root)]) == 1
    out = capsys.readouterr().out
    damaged = [line.split() for line in out.splitlines() if line.split()[3:4] == ["damaged"]]
    assert [(row[1], row[2]) for row in damaged] == [("0", "rollout"), ("1", "score_atoms")]
    assert f"{part.relative_to(store.root)}: sha256 differs" in out
    assert main(_repair_args(store, recipe, finished[2])) == 0
    out = capsys.readouterr().out
    assert "rebuilt: iteration 0 rollout" in out and "rebuilt: iteration 1 score_atoms" in out
    assert part.read_bytes() == original and "0 damaged record(s)" in out


def test_one_damaged_part_does_not_break_queries_on_other_runs(store, recipe, capsys):
    rows = store.read_table("atom_scores", {"iteration": 0}).to_pylist()
    store.write_table("atom_scores", [{**r, "run_id": "other"} for r in rows], "other-00000")
    good = store.read_table("atom_scores", {"iteration": 1}).num_rows
    store.refresh_catalog()
    _truncate(_scores_part(store, recipe, 0))
    assert main(["sql", "SELECT count(*) FROM atom_scores", "--root", str(store.root)]) == 1
    assert "`cast refresh --root" in capsys.readouterr().err  # a catalog from before the damage
    store.refresh_catalog()
    con = store.connect_readonly()
    try:
        counts = dict(con.execute("SELECT run_id, count(*) FROM atom_scores GROUP BY ALL")
                      .fetchall())
        excluded = con.execute("SELECT * FROM excluded_parts").fetchall()
    finally:
        con.close()
    assert counts == {"other": len(rows), recipe.run.name: good}
    assert excluded == [("atom_scores", f"tables/atom_scores/{recipe.run.name}-00000.parquet")]
    query = "SELECT count(*) AS n FROM atom_scores WHERE run_id = 'other'"
    assert main(["sql", query, "--root", str(store.root)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[-2] == str(len(rows)) and "damaged part" in captured.err
    with pytest.warns(DamagedPartWarning, match=f"{recipe.run.name}-00000.parquet"):
        assert store.read_table("atom_scores", {"run_id": "other"}).num_rows == len(rows)
    assert iteration_report(store, recipe, 1)["atom_scores"]  # the report of a good iteration


def test_superseded_and_older_records_are_told_apart_from_damage(tmp_path):
    store = Store(tmp_path)
    first = store.put_blob(b"one", "bin")
    part = store.write_table("windows", [_window(1)], "r-run")
    store.record_stage("r", -1, "calibrate_window", "k1", [part, first])
    first_part = part.content_hash
    rewritten = store.write_table("windows", [_window(2)], "r-run")  # another config, later
    store.record_stage("r", -1, "calibrate_window", "k2", [rewritten])
    assert sorted(c.status for c in verify_store(store)) == ["ok", "superseded"]
    # A record from before `stages` version 2 has no per-file hashes: the combined hash decides.
    (part,) = [f for f in store.parts("stages")
               if pq.read_table(f)["cache_key"][0].as_py() == "k2"]
    row = pq.read_table(part).to_pylist()[0]
    store.write_table("stages", [{**row, "path_hashes": None}], part.stem)
    assert [r.path_hashes for r in store.stage_records()] == [(first_part, first.sha256), None]
    assert sorted(c.status for c in verify_store(store)) == ["ok", "superseded"]
    path = store.resolve(rewritten.path)
    data = bytearray(path.read_bytes())
    data[8] ^= 0xFF  # a flipped byte in the first data page: the footer still reads
    path.write_bytes(bytes(data))
    (bad,) = [c for c in verify_store(store) if c.status == "damaged"]
    assert bad.problems() == f"{rewritten.path}: sha256 differs from the recorded one"


def _window(start: int) -> dict:
    return {"run_id": "r", "backbone_id": "b", "formation_step": 3, "method": "fixed",
            "window_start": start, "window_end": start + 2, "num_steps": 6, "noise_level": 0.7,
            "plot_path": None}


# -- item 11: cast gc ---------------------------------------------------------------------------

def _bulky(store: Store, iteration: int) -> dict[str, Path]:
    ro = store.read_table("rollouts", {"iteration": iteration}).to_pylist()[0]
    out = {"window_steps": store.resolve(ro["latents_path"]),
           "images": store.resolve(ro["image_path"])}
    maps = store.read_table("advantage_maps", {"iteration": iteration}).to_pylist()
    checkpoint = store.read_table("checkpoints", {"iteration": iteration}).to_pylist()
    if maps:
        out["advantage_maps"] = store.resolve(maps[0]["map_path"])
    if checkpoint:
        out["optimizer_state"] = store.resolve(checkpoint[0]["optimizer_path"])
        out["lora"] = store.resolve(checkpoint[0]["lora_path"])
    return out


def test_gc_frees_old_bulky_blobs_and_keeps_what_resume_and_evaluation_need(
        store, recipe, capsys):
    csgs, window = _run_level(store, recipe)
    rollout_groups(store, recipe, csgs, window, 2)  # iteration 2 begun, not finished
    blobs = {k: _bulky(store, k) for k in (0, 1, 2)}
    collectable = [blobs[0][kind] for kind in ("window_steps", "advantage_maps", "optimizer_state")]
    size = sum(p.stat().st_size for p in collectable)
    assert main(["gc", "--keep", "1", "--root", str(store.root), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would delete 3 blob(s), {size / 1e6:.2f} MB" in out and "nothing deleted" in out
    assert all(p.exists() for p in collectable)
    assert main(["gc", "--keep", "1", "--root", str(store.root)]) == 0
    assert f"deleted 3 blob(s), freed {size / 1e6:.2f} MB" in capsys.readouterr().out
    assert not any(p.exists() for p in collectable)
    kept = [blobs[0]["lora"], blobs[0]["images"], *blobs[1].values(), *blobs[2].values()]
    assert all(p.exists() for p in kept)
    collected = store.read_table("collected_blobs").to_pylist()
    assert sorted(r["kind"] for r in collected) == ["advantage_maps", "optimizer_state",
                                                    "window_steps"]
    assert sum(r["bytes"] for r in collected) == size and {r["iteration"] for r in collected} == {0}
    # Collected is not damage; the old stages stay done; resume, evaluation and gc again work.
    assert main(["verify", "--root", str(store.root)]) == 0
    assert "collected" in capsys.readouterr().out
    assert rollout_groups(store, recipe, csgs, window, 0).skipped
    assert prepare_iteration(store, recipe, 2) == []
    refs = run_iteration(store, recipe, 2)
    assert refs["rollout"].skipped and not refs["train_epoch"].skipped
    assert not evaluate_checkpoint(store, recipe, 0).skipped
    assert main(["gc", "--keep", "1", "--root", str(store.root)]) == 0
    assert "deleted 3 blob(s)" in capsys.readouterr().out
    assert not blobs[1]["optimizer_state"].exists() and blobs[2]["window_steps"].exists()


def test_gc_refuses_to_keep_nothing(store, capsys):
    assert main(["gc", "--keep", "0", "--root", str(store.root)]) == 2
    assert "--keep must be at least 1" in capsys.readouterr().err


def test_stage_records_name_their_files_hashes(store):
    for record in store.stage_records():
        assert record.path_hashes == tuple(file_sha256(store.resolve(p)) for p in record.paths)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store.read_table("stages")  # nothing left out


def test_gc_deletes_the_temp_files_of_killed_writers_once_they_are_old(tmp_path, capsys):
    """A writer killed outright leaves its atomic write's temp file; gc deletes it once it is
    older than STALE_TEMP_S, never a fresh one (a write in progress) or another dot-file."""
    import os
    import time

    from tasks.store.gc import STALE_TEMP_S, orphaned_temp_files

    st = Store(tmp_path / "store")
    blobs = st.root / "blobs" / "ab"
    blobs.mkdir(parents=True)
    old = blobs / ".ab12.safetensors.4242-0123456789ab.tmp"
    fresh = blobs / ".ab34.safetensors.4243-0123456789cd.tmp"
    other = blobs / ".notes.tmp"  # not an atomic write's name
    for path, data in ((old, b"x" * 1000), (fresh, b"y" * 10), (other, b"z")):
        path.write_bytes(data)
    past = time.time() - STALE_TEMP_S - 60
    os.utime(old, (past, past))
    os.utime(other, (past, past))
    assert orphaned_temp_files(st) == ((str(old.relative_to(st.root)), 1000),)
    assert main(["gc", "--keep", "1", "--root", str(st.root), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "1 orphaned temp file(s) of interrupted writes, 0.00 MB" in out and old.exists()
    assert main(["gc", "--keep", "1", "--root", str(st.root)]) == 0
    assert "1 orphaned temp file(s)" in capsys.readouterr().out
    assert not old.exists() and fresh.exists() and other.exists()
