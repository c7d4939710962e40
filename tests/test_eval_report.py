"""The markdown evaluation report on a real tiny run (CI recipe, two iterations, the base model and
the latest checkpoint evaluated): every linked PNG exists and is a PNG, the report's tables equal
the store's numbers, and the diagnostics columns (schema version 2) hold what they claim."""

import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image
from pipeline_helpers import (
    CI_RECIPE,
    REPO,
    assert_declared_schemas,
    child_env,
    ci_overrides,
    reference,
    run_iteration,
)

from cast_core.diagnostics import high_frequency_energy, param_change_norm
from cast_core.shapes.prompts import load_prompt_file
from tasks.reporting.eval_report import REPORT, main, write_report
from tasks.stages.evaluate import evaluate_checkpoint
from tasks.stages.models import graph_builder, load_policy
from tasks.store.schemas import TABLES
from tasks.store.store import Store


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(store, recipe, report ref, markdown) of a copy of the session's reference run with a
    second iteration, the base model and iteration 1 evaluated, and the report written."""
    src, recipe, _, _ = reference(tmp_path_factory)
    base = tmp_path_factory.mktemp("eval-report")
    shutil.copytree(src.root, base / "store", ignore=shutil.ignore_patterns("catalog.*"))
    store = Store(base / "store")
    run_iteration(store, recipe, 1)
    for k in (-1, 1):
        evaluate_checkpoint(store, recipe, k)
    ref = write_report(store, recipe.run.name, base / "report")
    return store, recipe, ref, Path(ref.path).read_text()


def _tables(markdown: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table as (header cells, body rows of cells)."""
    blocks, current = [], []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            blocks.append(current)
            current = []
    split = [[[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in b]
             for b in blocks]
    return [(cells[0], cells[2:]) for cells in split]


def _table(markdown: str, *header: str) -> list[dict]:
    """The one table whose header starts with `header`, as {column: cell} rows."""
    hits = [(h, rows) for h, rows in _tables(markdown) if tuple(h[:len(header)]) == header]
    assert len(hits) == 1, f"{len(hits)} tables start with {header}"
    columns, rows = hits[0]
    return [dict(zip(columns, r)) for r in rows]


def _same(cell: str, value) -> bool:
    """A report cell shows `value` (to the precision it prints)."""
    if value is None:
        return cell == "–"
    if isinstance(value, bool):
        return cell == ("yes" if value else "no")
    if isinstance(value, int):
        return cell == str(value)
    return float(cell) == pytest.approx(value, rel=6e-3, abs=6e-4)


def _rows(store: Store, table: str, **match) -> list[dict]:
    return [r for r in store.read_table(table).to_pylist()
            if all(r[k] == v for k, v in match.items())]


def test_report_links_only_pngs_that_exist(run):
    _, _, ref, markdown = run
    out = Path(ref.path).parent
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)
    assert {"accuracy.png", "atom_types.png", "calibration.png", "diagnostics.png"} <= set(links)
    assert len([x for x in links if x.startswith("rollouts-")]) == 3
    assert sorted(links) == sorted(Path(p).name for p in ref.images)
    for link in links:
        assert "/" not in link and (out / link).is_file(), link
        with Image.open(out / link) as image:
            assert image.format == "PNG"
            image.verify()
    assert not ref.artifact  # outside a Prefect run no artifact is made
    assert not list(out.glob(".*")), "temporary files left behind"


def test_accuracy_table_equals_the_overall_evals_rows(run):
    store, recipe, _, markdown = run
    rows = _table(markdown, "iteration", "split", "images", "strict")
    want = sorted(_rows(store, "evals", run_id=recipe.run.name, group_kind="overall"),
                  key=lambda r: (r["iteration"], r["split"]))
    assert [(int(r["iteration"]), r["split"]) for r in rows] == [
        (w["iteration"], w["split"]) for w in want] and len(want) == 4
    for cells, w in zip(rows, want):
        for column, field in (("images", "images"), ("strict", "strict_accuracy"),
                              ("atom acc", "atom_accuracy"), ("mean score", "mean_score"),
                              ("HF energy", "hf_energy"), ("diversity", "diversity")):
            assert _same(cells[column], w[field]), (column, cells[column], w[field])


def test_atom_count_groups_follow_the_prompts_and_match_the_report(run):
    store, recipe, _, markdown = run
    ev, build = recipe.eval, graph_builder(recipe)
    rows = _rows(store, "evals", run_id=recipe.run.name, group_kind="atom_count", iteration=1)
    for split, path in ev.splits.items():
        counts = Counter(str(len(build(r).atoms()))
                         for r in load_prompt_file(path)[:ev.max_prompts])
        want = {n: c * ev.images_per_prompt for n, c in counts.items()}
        assert {r["group_name"]: r["images"] for r in rows if r["split"] == split} == want
    table = _table(markdown, "split", "atom_count")
    assert len(table) == len(rows)
    for cells in table:
        for k in (-1, 1):
            (w,) = _rows(store, "evals", run_id=recipe.run.name, group_kind="atom_count",
                         iteration=k, split=cells["split"], group_name=cells["atom_count"])
            assert _same(cells[f"strict (it {k})"], w["strict_accuracy"])
            assert _same(cells[f"mean score (it {k})"], w["mean_score"])
        assert _same(cells["HF energy (it 1)"], w["hf_energy"])
    atom_types = _table(markdown, "split", "atom_type")
    (w,) = _rows(store, "evals", run_id=recipe.run.name, group_kind="atom_type", iteration=1,
                 split=atom_types[0]["split"], group_name=atom_types[0]["atom_type"])
    assert _same(atom_types[0]["atom acc (it 1)"], w["atom_accuracy"])


def test_diagnostics_table_equals_train_steps_and_checkpoints(run):
    store, recipe, _, markdown = run
    table = _table(markdown, "iteration", "steps", "skipped")
    assert [int(r["iteration"]) for r in table] == [0, 1]
    for cells in table:
        k = int(cells["iteration"])
        (ckpt,) = _rows(store, "checkpoints", run_id=recipe.run.name, iteration=k)
        steps = _rows(store, "train_steps", run_id=recipe.run.name, iteration=k)
        assert _same(cells["steps"], len(steps))
        assert _same(cells["LoRA change"], ckpt["param_change_norm"])
        assert _same(cells["rollout HF energy"], ckpt["rollout_hf_energy"])
        assert _same(cells["alarm"], ckpt["constant_reward_alarm"])
        assert _same(cells["zero-var groups"], steps[0]["zero_variance_fraction"])
        per_step = [sum(s["clip_fraction_per_step"][j] for s in steps) / len(steps)
                    for j in range(len(steps[0]["clip_fraction_per_step"]))]
        shown = cells["clip fraction per step"].split(" / ")
        assert len(shown) == len(per_step) and all(map(_same, shown, per_step))
        if ckpt["constant_reward_alarm"]:
            assert f"- iteration {k}: {ckpt['alarm_reason']}" in markdown


def test_rollout_tables_equal_the_atom_scores(run):
    store, recipe, _, markdown = run
    tables = [rows for header, rows in _tables(markdown) if header[:3] == ["atom", "type",
                                                                            "question"]]
    prompts = re.findall(r"prompt id `([0-9a-f]+)`", markdown)
    assert len(tables) == len(prompts) == 3
    scores = _rows(store, "atom_scores", run_id=recipe.run.name, iteration=1)
    advantages = _rows(store, "advantages", run_id=recipe.run.name, iteration=1)
    for prompt, rows in zip(prompts, tables):
        atoms = _rows(store, "atoms", run_id=recipe.run.name, prompt_id=prompt)
        assert [r[0] for r in rows] == [a["atom_id"] for a in sorted(
            atoms, key=lambda a: a["atom_index"])]
        for atom, kind, _, shown_scores, shown_advantages in rows:
            def by_sample(table, atom=atom, prompt=prompt):
                return sorted((r for r in table if r["prompt_id"] == prompt
                               and r["atom_id"] == atom), key=lambda r: r["sample_index"])

            want = by_sample(scores)
            assert len(want) == recipe.prompts.group_size and want[0]["atom_type"] == kind
            assert all(map(_same, shown_scores.split(" / "), [r["score"] for r in want]))
            assert all(map(_same, shown_advantages.split(" / "),
                           [r["advantage"] for r in by_sample(advantages)]))


def test_diagnostic_columns_hold_what_they_claim(run):
    store, recipe, _, _ = run
    assert_declared_schemas(store.root)
    for table, version in (("train_steps", 5), ("checkpoints", 6), ("evals", 2)):
        assert TABLES[table].version == version
    run_id = recipe.run.name
    k_steps = recipe.window.size
    for s in _rows(store, "train_steps", run_id=run_id):
        assert len(s["ratio_mean_per_step"]) == len(s["clip_fraction_per_step"]) == k_steps
        assert sum(s["ratio_mean_per_step"]) / k_steps == pytest.approx(s["ratio_mean"], abs=1e-6)
        assert all(0.0 <= c <= 1.0 for c in s["clip_fraction_per_step"])
        assert s["reward_step_weights_json"] is None  # recast.weighting = "none"
        assert s["samples"] >= 1 and s["policy_kl_nats"] >= 0.0 and s["ref_kl_nats"] is None
    ckpts = {r["iteration"]: r for r in _rows(store, "checkpoints", run_id=run_id)}
    init, _ = load_policy(recipe, None)
    init_lora = {n: p.detach() for n, p in init.named_parameters() if p.requires_grad}
    lora = {k: store.get_tensors(c["lora_path"]) for k, c in ckpts.items()}
    names = sorted(init_lora)
    assert ckpts[0]["param_change_norm"] == pytest.approx(param_change_norm(
        [init_lora[n] for n in names], [lora[0][n] for n in names]), rel=1e-9)
    assert ckpts[1]["param_change_norm"] == pytest.approx(param_change_norm(
        [lora[0][n] for n in names], [lora[1][n] for n in names]), rel=1e-9)
    for k, c in ckpts.items():
        (rollout,) = {r["image_path"] for r in _rows(store, "rollouts", run_id=run_id,
                                                     iteration=k)}
        images = store.get_tensors(rollout)["images"].to(torch.float64) / 255.0
        assert c["rollout_hf_energy"] == pytest.approx(
            float(high_frequency_energy(images).mean()), rel=1e-6)  # FFT summation order
        assert (c["alarm_reason"] is None) == (not c["constant_reward_alarm"])
        assert c["lr"] == recipe.train.lr  # no KL target: the recipe's constant lr
        assert len(c["update_velocity_per_step"]) == k_steps and c["update_velocity_rms"] > 0
        assert c["update_velocity_rms"] == pytest.approx(
            (sum(r * r for r in c["update_velocity_per_step"]) / k_steps) ** 0.5, rel=1e-9)
    evals = _rows(store, "evals", run_id=run_id)
    assert {r["group_kind"] for r in evals} == {"overall", "tag", "atom_type", "atom_count"}
    assert all(0.0 <= r["hf_energy"] <= 1.0 for r in evals)


def test_the_command_line_writes_the_same_report(run, tmp_path, capsys):
    store, recipe, ref, markdown = run
    main(["--store", str(store.root), "--run", recipe.run.name, "--out", str(tmp_path)])
    assert str(tmp_path / REPORT) in capsys.readouterr().out
    assert (tmp_path / REPORT).read_text() == markdown
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(
        Path(p).name for p in ref.images)


_FLOW = """
import json, sys
from prefect import flow
from prefect.artifacts import Artifact
from flows.evaluate import cast_eval
from tasks.reporting.eval_report import write_report_task
from tasks.store.store import Store

recipe, root, overrides, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
result = cast_eval(recipe=recipe, iteration=1, store=root, overrides=overrides, report_dir=out)


@flow
def publish() -> bool:
    return write_report_task(Store(root), result["run_id"], out + "-again").artifact


made = publish()
artifact = Artifact.get("eval-report-" + result["run_id"])
print(json.dumps({"report": result["report"], "artifact": made,
                  "markdown": artifact.data if artifact else None}))
"""


@pytest.mark.slow
def test_the_eval_flow_writes_the_report_and_a_prefect_artifact(run, tmp_path_factory, tmp_path):
    """The `cast-eval` flow in a child process (Prefect starts a temporary server there)."""
    store, _, _, markdown = run
    prompts = reference(tmp_path_factory)[2]
    out = tmp_path / "flow-report"
    done = subprocess.run([sys.executable, "-c", _FLOW, str(CI_RECIPE), str(store.root),
                           json.dumps(ci_overrides(prompts)), str(out)], cwd=REPO,
                          env=child_env(tmp_path), capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["report"] == str(out / REPORT) and result["artifact"] is True
    assert (out / REPORT).read_text() == markdown == result["markdown"]
