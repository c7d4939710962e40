"""Small tasks around the stages: which iteration is next, and the end-of-iteration report
(refresh the DuckDB catalog, query this iteration's atom scores and training diagnostics, print
where results are)."""

from __future__ import annotations

from prefect import task

from tasks.locations import store_root
from tasks.recipe import Recipe
from tasks.store import Store

__all__ = ["iteration_report", "iteration_report_task", "next_iteration", "next_iteration_task",
           "store_root"]

ITERATION_QUERY = """
SELECT atom_type,
       count(*)                                             AS atoms,
       round(avg(score), 3)::DOUBLE                         AS mean_score,
       round(avg(CASE WHEN score > 0.5 THEN 1 ELSE 0 END), 3)::DOUBLE AS pass_rate
FROM atom_scores
WHERE run_id = $run_id AND iteration = $iteration
GROUP BY atom_type ORDER BY atom_type
"""


def next_iteration(store: Store, recipe: Recipe) -> int:
    """Last iteration whose training finished, plus one (0 for a new run)."""
    return store.last_finished_iteration(recipe.run.name, "train_epoch") + 1


def format_rows(columns: list[str], rows: list[tuple]) -> str:
    widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) for i, c in enumerate(columns)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, rows)])


def iteration_report(store: Store, recipe: Recipe, iteration: int) -> dict:
    """Refresh the catalog, run ITERATION_QUERY, and return (and print) a short report."""
    store.refresh_catalog()
    con = store.connect_readonly()
    try:
        cursor = con.execute(ITERATION_QUERY, {"run_id": recipe.run.name, "iteration": iteration})
        columns = [d[0] for d in cursor.description]
        rows = cursor.fetchall()
        loss = con.execute(
            "SELECT round(avg(loss), 5)::DOUBLE, round(avg(clip_fraction), 4)::DOUBLE, "
            "count(*) FILTER (WHERE skipped) FROM train_steps "
            "WHERE run_id = $run_id AND iteration = $iteration",
            {"run_id": recipe.run.name, "iteration": iteration}).fetchone()
        diagnostics = con.execute(
            "SELECT param_change_norm, rollout_hf_energy, constant_reward_alarm, alarm_reason "
            "FROM checkpoints WHERE run_id = $run_id AND iteration = $iteration",
            {"run_id": recipe.run.name, "iteration": iteration}).fetchone()
    finally:
        con.close()
    table = format_rows(columns, rows)
    change, hf, alarm, reason = diagnostics or (None, None, None, None)
    print(f"run {recipe.run.name!r}, iteration {iteration} finished.\n"
          f"store: {store.root}\ncatalog: {store.catalog_path} "
          f"(query with: cast sql \"SELECT ...\" --root {store.root})\n"
          f"train: mean loss {loss[0]}, mean clip fraction {loss[1]}, skipped steps {loss[2]}\n"
          f"diagnostics: LoRA change norm {change}, rollout high-frequency energy {hf}, "
          f"constant-reward alarm: {reason if alarm else 'none'}\n"
          f"atom scores of this iteration:\n{table}")
    return {"run_id": recipe.run.name, "iteration": iteration, "store": str(store.root),
            "atom_scores": [dict(zip(columns, r)) for r in rows],
            "diagnostics": {"param_change_norm": change, "rollout_hf_energy": hf,
                            "constant_reward_alarm": alarm, "alarm_reason": reason}}


next_iteration_task = task(next_iteration, name="next_iteration")
iteration_report_task = task(iteration_report, name="report")
