"""The reports a flow prints when it ends: the end-of-iteration report (refresh the DuckDB catalog,
query this iteration's atom scores and training diagnostics, print where results are) and the
evaluation's summary (`eval_report`: this checkpoint's `evals` rows per group and the history of
strict accuracy).

The iteration report also draws the iteration's labelled rollout contact sheet
(`tasks.reporting.contact_sheet`: the prompt above each row, each sample's mean atom score under
it) and copies the run's window calibration plot, both into `<store>/reports/<run>/`
(`report_paths`), and inside a Prefect run attaches both as image artifacts, so they show in the
UI.
"""

from __future__ import annotations

import base64
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
from prefect import task

from tasks.reporting.contact_sheet import SheetRow, labelled_sheet
from tasks.stages.recipe import Recipe
from tasks.store.store import Store

__all__ = ["eval_report", "eval_report_task", "iteration_report", "iteration_report_task",
           "report_paths"]

ITERATION_QUERY = """
SELECT atom_type,
       count(*)                                             AS atoms,
       round(avg(score), 3)::DOUBLE                         AS mean_score,
       round(avg(CASE WHEN score > 0.5 THEN 1 ELSE 0 END), 3)::DOUBLE AS pass_rate
FROM atom_scores
WHERE run_id = $run_id AND iteration = $iteration
GROUP BY atom_type ORDER BY atom_type
"""

# one row per rollout sample, in rollout order: its image, its prompt, its mean atom score
SHEET_QUERY = """
SELECT r.blob_index, r.image_path, r.prompt_id, c.prompt, avg(s.score)::DOUBLE AS mean_score
FROM rollouts r
JOIN (SELECT DISTINCT run_id, prompt_id, prompt FROM csgs) c USING (run_id, prompt_id)
LEFT JOIN atom_scores s ON s.run_id = r.run_id AND s.iteration = r.iteration
     AND s.prompt_id = r.prompt_id AND s.sample_index = r.sample_index
WHERE r.run_id = $run_id AND r.iteration = $iteration
GROUP BY ALL ORDER BY r.blob_index
"""


@dataclass(frozen=True)
class ReportPaths:
    """Where the report puts an iteration's pictures: the labelled rollout contact sheet and the
    copy of the run's window calibration plot."""

    rollout_sheet: Path
    calibration_plot: Path


def report_paths(store: Store, run_id: str, iteration: int) -> ReportPaths:
    folder = store.root / "reports" / run_id
    return ReportPaths(folder / f"iteration-{iteration:05d}-rollouts.png",
                       folder / "window-calibration.png")


def format_rows(columns: list[str], rows: list[tuple]) -> str:
    widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) for i, c in enumerate(columns)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, rows)])


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)
    return path


def rollout_sheet(store: Store, con: duckdb.DuckDBPyConnection, run_id: str,
                  iteration: int) -> bytes | None:
    """The iteration's labelled contact sheet (PNG), or None when it has no rollouts."""
    samples = con.execute(SHEET_QUERY, {"run_id": run_id, "iteration": iteration}).fetchall()
    if not samples:
        return None
    images = {path: store.get_tensors(path)["images"].numpy()  # uint8 [N, 3, H, W]
              for path in {s[1] for s in samples}}
    rows: dict[str, tuple[str, list, list]] = {}
    for index, path, prompt_id, prompt, score in samples:
        _, pictures, scores = rows.setdefault(prompt_id, (prompt, [], []))
        pictures.append(images[path][index])
        scores.append(math.nan if score is None else score)
    sheet_rows = [SheetRow(p, np.stack(pics), s) for p, pics, s in rows.values()]
    return labelled_sheet(sheet_rows, f"{run_id}, iteration {iteration}: rollouts, mean atom "
                                      f"score under each image")


def _calibration_plot(store: Store, con: duckdb.DuckDBPyConnection, run_id: str) -> bytes | None:
    row = con.execute("SELECT plot_path FROM windows WHERE run_id = $run_id AND plot_path "
                      "IS NOT NULL LIMIT 1", {"run_id": run_id}).fetchone()
    return store.resolve(row[0]).read_bytes() if row else None


def publish_images(run_id: str, iteration: int, images: dict[str, bytes]) -> bool:
    """Attach PNGs {name: bytes} as Prefect image artifacts (data URLs, so the UI shows them with
    no file server) when inside a flow or task run; else do nothing."""
    from prefect.artifacts import create_image_artifact
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return False
    run_key = re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-")
    for name, png in images.items():
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        create_image_artifact(image_url=url, key=f"{run_key}-{name}",
                              description=f"{run_id}, iteration {iteration}: {name}")
    return True


def iteration_report(store: Store, recipe: Recipe, iteration: int) -> dict:
    """Refresh the catalog, run ITERATION_QUERY, write the pictures, and return (and print) a
    short report."""
    run_id = recipe.run.name
    store.refresh_catalog()
    con = store.connect_readonly()
    try:
        cursor = con.execute(ITERATION_QUERY, {"run_id": run_id, "iteration": iteration})
        columns = [d[0] for d in cursor.description]
        rows = cursor.fetchall()
        loss = con.execute(
            "SELECT round(avg(loss), 5)::DOUBLE, round(avg(clip_fraction), 4)::DOUBLE, "
            "count(*) FILTER (WHERE skipped) FROM train_steps "
            "WHERE run_id = $run_id AND iteration = $iteration",
            {"run_id": run_id, "iteration": iteration}).fetchone()
        diagnostics = con.execute(
            "SELECT param_change_norm, rollout_hf_energy, constant_reward_alarm, alarm_reason "
            "FROM checkpoints WHERE run_id = $run_id AND iteration = $iteration",
            {"run_id": run_id, "iteration": iteration}).fetchone()
        sheet = rollout_sheet(store, con, run_id, iteration)
        plot = _calibration_plot(store, con, run_id)
    finally:
        con.close()
    paths = report_paths(store, run_id, iteration)
    pictures = {name: (path, png) for name, path, png in
                (("rollouts", paths.rollout_sheet, sheet),
                 ("window-calibration", paths.calibration_plot, plot)) if png is not None}
    for path, png in pictures.values():
        _write(path, png)
    publish_images(run_id, iteration, {name: png for name, (_, png) in pictures.items()})
    table = format_rows(columns, rows)
    change, hf, alarm, reason = diagnostics or (None, None, None, None)
    print(f"run {run_id!r}, iteration {iteration} finished.\n"
          f"store: {store.root}\ncatalog: {store.catalog_path} "
          f"(query with: cast sql \"SELECT ...\" --root {store.root})\n"
          f"train: mean loss {loss[0]}, mean clip fraction {loss[1]}, skipped steps {loss[2]}\n"
          f"diagnostics: LoRA change norm {change}, rollout high-frequency energy {hf}, "
          f"constant-reward alarm: {reason if alarm else 'none'}\n"
          + "".join(f"{name.replace('-', ' ')}: {path}\n" for name, (path, _) in pictures.items())
          + f"atom scores of this iteration:\n{table}")
    return {"run_id": run_id, "iteration": iteration, "store": str(store.root),
            "atom_scores": [dict(zip(columns, r)) for r in rows],
            "pictures": {name: str(path) for name, (path, _) in pictures.items()},
            "diagnostics": {"param_change_norm": change, "rollout_hf_energy": hf,
                            "constant_reward_alarm": alarm, "alarm_reason": reason}}


def eval_report(store: Store, recipe: Recipe, iteration: int) -> dict:
    """Refresh the catalog and print this checkpoint's table per group (and the history)."""
    store.refresh_catalog()
    con = store.connect_readonly()
    try:
        cursor = con.execute(
            "SELECT split, group_kind, group_name, images, round(strict_accuracy, 3)::DOUBLE AS "
            "strict, round(mean_score, 3)::DOUBLE AS mean_score, round(diversity, 4)::DOUBLE AS "
            "diversity, round(hf_energy, 4)::DOUBLE AS hf_energy FROM evals WHERE run_id = $run "
            "AND iteration = $k ORDER BY split, group_kind DESC, TRY_CAST(group_name AS INTEGER), "
            "group_name",
            {"run": recipe.run.name, "k": iteration})
        columns, rows = [d[0] for d in cursor.description], cursor.fetchall()
        history = con.execute(
            "SELECT iteration, split, round(strict_accuracy, 3)::DOUBLE FROM evals WHERE run_id = "
            "$run AND group_kind = 'overall' ORDER BY iteration, split",
            {"run": recipe.run.name}).fetchall()
    finally:
        con.close()
    print(f"run {recipe.run.name!r}, checkpoint of iteration {iteration} (-1 = base):\n"
          f"{format_rows(columns, rows)}\n\nstrict accuracy (overall) by iteration:\n"
          f"{format_rows(['iteration', 'split', 'strict'], history)}")
    return {"run_id": recipe.run.name, "iteration": iteration,
            "rows": [dict(zip(columns, r)) for r in rows]}


iteration_report_task = task(iteration_report, name="report")
eval_report_task = task(eval_report, name="eval_report")
