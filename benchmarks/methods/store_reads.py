"""What the methods benchmark's report needs, read from the store's DuckDB catalog in one pass
(`read_results` -> `Results`), plus the per-image scores and grids of the final evaluations."""

from __future__ import annotations

from dataclasses import dataclass, field

from methods.stats import PromptScores

EVALS_SQL = """
SELECT run_id, iteration, split, eval_spec_hash, strict_accuracy, mean_score, hf_energy, diversity,
       images
FROM evals WHERE group_kind = 'overall' AND list_contains($runs, run_id)"""
STAGES_SQL = """
SELECT run_id, iteration, stage, cache_key, epoch(finished_at) - epoch(started_at) AS seconds
FROM stages WHERE list_contains($runs, run_id)"""
WINDOWS_SQL = """
SELECT run_id, method, window_start, window_end FROM windows WHERE list_contains($runs, run_id)"""
TRAIN_SQL = """
SELECT run_id, iteration, avg(reward_object) AS object, avg(reward_count) AS count,
       avg(reward_attribute) AS attribute, avg(reward_relation) AS relation,
       any_value(reward_step_weights_json) AS weights
FROM train_steps WHERE list_contains($runs, run_id) GROUP BY ALL"""
TYPE_EVALS_SQL = """
SELECT run_id, iteration, split, group_name AS atom_type, mean_score
FROM evals WHERE group_kind = 'atom_type' AND list_contains($runs, run_id)"""
GAINS_SQL = """
SELECT run_id, iteration, any_value(plot_path) AS plot_path
FROM recast_gains WHERE list_contains($runs, run_id) GROUP BY ALL"""
# Per optimizer step, read when the column exists (train_steps gained and renamed columns over
# time: approx_kl became ratio_k3; policy_kl_nats and ref_kl_nats are newer); update_kl_nats is
# per iteration, from checkpoints.
DIAGNOSTIC_COLUMNS = (("clip_fraction", "clip fraction", ".4f"), ("ratio_k3", "ratio k3", ".2e"),
                      ("approx_kl", "approx KL (older name)", ".2e"),
                      ("policy_kl_nats", "policy KL (nats)", ".3g"),
                      ("update_kl_nats", "KL moved an iteration (nats)", ".3g"),
                      ("update_velocity_rms", "velocity change an iteration (RMS a latent dim)",
                       ".3g"),
                      ("iteration_lr", "lr (mean over iterations)", ".3g"),
                      ("ref_kl_nats", "ref KL (nats)", ".3g"),
                      ("ratio_std", "ratio std", ".4f"), ("grad_norm", "grad norm", ".4f"),
                      ("zero_variance_fraction", "zero-variance groups", ".3f"))


@dataclass(frozen=True)
class Results:
    """What the report needs, read from the store: evals {(run, iteration, split): overall row};
    seconds {(run, iteration, what): body seconds} of the stage records this invocation's calls
    name (what: a stage, or "eval:<pass>"); scores {(run, iteration, split): PromptScores} and
    grids {(run, iteration, split): store path} of the final evaluations; windows {run: (method,
    start, end)}; for the ReCAST section train rewards {(run, iteration): {type: mean, "weights":
    JSON}}, type evals {(run, iteration, split, type): mean score}, gain plots {(run, iteration):
    path}; diagnostics {run: {column: mean over the run's optimizer steps, "steps": count}};
    per_step {run: (update KL of each window step per iteration, the steps' loss weights per
    iteration or None, the velocity change of each step per iteration or None)} where the
    checkpoints record them."""

    evals: dict
    seconds: dict
    scores: dict
    grids: dict
    windows: dict
    train: dict
    type_evals: dict
    gain_plots: dict
    diagnostics: dict
    per_step: dict = field(default_factory=dict)


def _rows(con, sql: str, runs: list[str]) -> list[dict]:
    cursor = con.execute(sql, {"runs": runs})
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, r)) for r in cursor.fetchall()]


def _diagnostics(con, runs: list[str]) -> dict:
    present = {r[0] for r in con.execute("SELECT column_name FROM (DESCRIBE train_steps)")
               .fetchall()}
    columns = [c for c, _, _ in DIAGNOSTIC_COLUMNS if c in present]
    skipped = "AND NOT skipped" if "skipped" in present else ""
    sql = (f"SELECT run_id, {''.join(f'avg({c}) AS {c}, ' for c in columns)}count(*) AS steps "
           f"FROM train_steps WHERE list_contains($runs, run_id) {skipped} GROUP BY ALL")
    out = {r["run_id"]: r for r in _rows(con, sql, runs)}
    # checkpoints.update_kl_nats and (v6) update_velocity_rms: one per iteration, how far its
    # training moved the policy in nats and the velocity change that implies
    in_checkpoints = {r[0] for r in con.execute("SELECT column_name FROM (DESCRIBE checkpoints)")
                      .fetchall()}
    for column in ("update_kl_nats", "update_velocity_rms"):
        if column not in in_checkpoints:
            continue
        for r in _rows(con, f"SELECT run_id, avg({column}) AS {column} FROM checkpoints WHERE "
                       "list_contains($runs, run_id) GROUP BY ALL", runs):
            out.setdefault(r["run_id"], {"steps": 0})[column] = r[column]
    if "lr" in {r[0] for r in con.execute("SELECT column_name FROM (DESCRIBE checkpoints)")
                .fetchall()}:  # the iteration's lr (KL-targeted or constant), checkpoints v4
        for r in _rows(con, "SELECT run_id, avg(lr) AS iteration_lr FROM checkpoints WHERE "
                       "list_contains($runs, run_id) GROUP BY ALL", runs):
            out.setdefault(r["run_id"], {"steps": 0})["iteration_lr"] = r["iteration_lr"]
    return out


def _per_step(con, runs: list[str]) -> dict:
    """{run: (per-step update KLs [iterations x K], per-step loss weights [iterations x K] or
    None, per-step velocity changes [iterations x K] or None)} from `checkpoints` v5 (the
    velocities v6), for the runs whose checkpoints have them (in iteration order)."""
    present = {r[0] for r in con.execute("SELECT column_name FROM (DESCRIBE checkpoints)")
               .fetchall()}
    if "update_kl_per_step" not in present:
        return {}
    velocity = ("update_velocity_per_step" if "update_velocity_per_step" in present
                else "NULL::DOUBLE[]")
    out = {}
    for r in _rows(con, "SELECT run_id, list(update_kl_per_step ORDER BY iteration) AS kls, "
                   "list(step_weights ORDER BY iteration) AS weights, "
                   f"list({velocity} ORDER BY iteration) AS velocities FROM checkpoints WHERE "
                   "list_contains($runs, run_id) AND update_kl_per_step IS NOT NULL GROUP BY ALL",
                   runs):
        weights = [w for w in r["weights"] if w is not None]
        velocities = [v for v in r["velocities"] if v is not None]
        out[r["run_id"]] = (r["kls"], weights or None, velocities or None)
    return out


def read_results(store, refs: dict, outputs: dict) -> Results:
    """`refs` {run: {(iteration, what): StageRef}} from the calls (or the store's records);
    `outputs` {(run, iteration, pass): EvalPass} of the evaluations whose per-image scores and
    grids to read (found through their refs' paths)."""
    from tasks.stages.evaluate import outputs_of, read_image_scores

    store.refresh_catalog()
    runs = sorted(refs)
    con = store.connect_readonly()
    try:
        evals = {(r["run_id"], r["iteration"], r["split"]): r for r in _rows(con, EVALS_SQL, runs)}
        recorded = {(r["run_id"], r["iteration"], r["cache_key"]): float(r["seconds"])
                    for r in _rows(con, STAGES_SQL, runs)}
        windows = {r["run_id"]: (r["method"], r["window_start"], r["window_end"])
                   for r in _rows(con, WINDOWS_SQL, runs)}
        train = {(r["run_id"], r["iteration"]): r for r in _rows(con, TRAIN_SQL, runs)}
        types = {(r["run_id"], r["iteration"], r["split"], r["atom_type"]): float(r["mean_score"])
                 for r in _rows(con, TYPE_EVALS_SQL, runs)}
        plots = {(r["run_id"], r["iteration"]): r["plot_path"] for r in _rows(con, GAINS_SQL, runs)}
        diagnostics = _diagnostics(con, runs)
        per_step = _per_step(con, runs)
    finally:
        con.close()
    seconds = {(run, k, what): recorded[(run, ref.iteration, ref.cache_key)]
               for run, by in refs.items() for (k, what), ref in by.items()}
    scores, grids = {}, {}
    for (run, k, name), p in outputs.items():
        found = outputs_of(refs[run][(k, f"eval:{name}")].paths, list(p.splits))
        for split, data in read_image_scores(store, found).items():
            scores[(run, k, split)] = PromptScores.from_json(data)
            grids[(run, k, split)] = found.grids[split]
    return Results(evals, seconds, scores, grids, windows, train, types, plots, diagnostics,
                   per_step)
