"""The evaluation report of one run: the store's tables and blobs -> `report.md` with PNG plots
beside it, linked relatively, for a person to read.

    .venv/bin/python -m tasks.reporting.eval_report --store runs/store --run shapes-cast \\
        --out runs/report

The eval flow (`flows/evaluate.py`) writes it after each evaluation, to `<store>/reports/<run>/`
unless told otherwise. Sections: strict accuracy and mean atom score by iteration per split; per
atom type, per tag and per atom count, the first evaluated checkpoint (the base model, -1, when it
was evaluated) against the latest; the calibration curve with the chosen SDE window; training
diagnostics by iteration (ratio mean and clip fraction per window step, LoRA change norm, rollout
and eval high-frequency energy, zero-variance fraction, constant-reward alarms); and, for the
first `prompts` prompts of the latest trained iteration (in rollout order), every sample with
each atom's grounding heatmap and the pixel advantage map overlaid. The plots are drawn by
`tasks.reporting.eval_plots`.

Every number comes from a DuckDB query over the catalog (refreshed first) or from a blob that a
table row names; none is typed in. Files are written atomically (temporary name, fsync, rename),
the PNGs first and the markdown last, so a report always links PNGs that exist. Inside a Prefect
flow or task run the markdown is also published as a markdown artifact (key
`eval-report-<run>`; its relative image links do not resolve in the UI); outside one it is not.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task

from tasks.reporting.eval_plots import (
    accuracy_plot,
    atom_type_plot,
    calibration_plot,
    diagnostics_plot,
    rollout_plot,
)
from tasks.reporting.markdown import table
from tasks.store.files import atomic_write_bytes
from tasks.store.locations import store_root
from tasks.store.store import Store

REPORT = "report.md"
GROUP_KINDS = (("tag", "strict_accuracy", "strict"), ("atom_count", "strict_accuracy", "strict"),
               ("atom_type", "atom_accuracy", "atom acc"))

ACCURACY_SQL = """
SELECT iteration, split, images, strict_accuracy, atom_accuracy, mean_score, hf_energy, diversity
FROM evals WHERE run_id = $run AND group_kind = 'overall' ORDER BY iteration, split"""
GROUPS_SQL = """
SELECT iteration, split, group_name, images, strict_accuracy, atom_accuracy, mean_score, hf_energy
FROM evals WHERE run_id = $run AND group_kind = $kind AND iteration IN ($first, $last)
ORDER BY split, TRY_CAST(group_name AS INTEGER), group_name, iteration"""
DIAGNOSTICS_SQL = """
SELECT t.iteration, count(*) AS steps, count(*) FILTER (WHERE t.skipped) AS skipped,
       avg(t.loss) AS loss, avg(t.clip_fraction) AS clip_fraction, avg(t.ratio_mean) AS ratio_mean,
       any_value(t.zero_variance_fraction) AS zero_variance_fraction,
       any_value(c.param_change_norm) AS param_change_norm,
       any_value(c.rollout_hf_energy) AS rollout_hf_energy,
       any_value(c.constant_reward_alarm) AS alarm, any_value(c.alarm_reason) AS alarm_reason
FROM train_steps t JOIN checkpoints c ON c.run_id = t.run_id AND c.iteration = t.iteration
WHERE t.run_id = $run GROUP BY t.iteration ORDER BY t.iteration"""
PER_STEP_SQL = """
SELECT iteration, k, avg(ratio) AS ratio_mean, avg(clip) AS clip_fraction
FROM (SELECT iteration, generate_subscripts(ratio_mean_per_step, 1) - 1 AS k,
             unnest(ratio_mean_per_step) AS ratio, unnest(clip_fraction_per_step) AS clip
      FROM train_steps WHERE run_id = $run AND NOT skipped)
GROUP BY iteration, k ORDER BY iteration, k"""
PROMPTS_SQL = """
SELECT r.prompt_id, any_value(c.prompt) AS prompt, min(r.blob_index) AS first
FROM rollouts r JOIN csgs c ON c.run_id = r.run_id AND c.prompt_id = r.prompt_id
WHERE r.run_id = $run AND r.iteration = $k GROUP BY r.prompt_id ORDER BY first LIMIT $n"""
SAMPLES_SQL = """
SELECT r.sample_index, r.blob_index, r.image_path, m.reward, m.scalar_advantage, m.mass,
       m.coverage, m.blob_index AS map_index, m.map_path
FROM rollouts r JOIN advantage_maps m USING (run_id, iteration, prompt_id, sample_index)
WHERE r.run_id = $run AND r.iteration = $k AND r.prompt_id = $pid ORDER BY r.sample_index"""
ATOMS_SQL = """
SELECT s.sample_index, s.atom_id, a.atom_index, a.type, a.question, s.score, s.heatmap,
       s.heatmap_h, s.heatmap_w, v.advantage
FROM atom_scores s JOIN atoms a USING (run_id, prompt_id, atom_id)
JOIN advantages v USING (run_id, iteration, prompt_id, sample_index, atom_id)
WHERE s.run_id = $run AND s.iteration = $k AND s.prompt_id = $pid
ORDER BY a.atom_index, s.sample_index"""


@dataclass(frozen=True)
class ReportRef:
    """The written report: the markdown's path, the PNGs it links (paths), whether a Prefect
    artifact was created."""

    path: str
    images: tuple[str, ...]
    artifact: bool


def _rows(con, sql: str, params: dict[str, Any]) -> list[dict]:
    cursor = con.execute(sql, params)
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, r)) for r in cursor.fetchall()]


def fmt(value: Any) -> str:
    """A table cell: floats to 3 decimals (2-digit scientific below 0.01), None as '–'."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}" if value == 0 or abs(value) >= 0.01 else f"{value:.2e}"
    return str(value).replace("|", "\\|")


def _table(columns: list[str], rows: list[list]) -> str:
    return table(columns, [[fmt(v) for v in r] for r in rows])


def _accuracy_section(rows: list[dict]) -> list[str]:
    return ["## Accuracy by iteration", "",
            "Overall rows of `evals` (strict: every atom of the image scores > 0.5).", "",
            _table(["iteration", "split", "images", "strict", "atom acc", "mean score",
                    "HF energy", "diversity"],
                   [[r["iteration"], r["split"], r["images"], r["strict_accuracy"],
                     r["atom_accuracy"], r["mean_score"], r["hf_energy"], r["diversity"]]
                    for r in rows]), "", "![accuracy by iteration](accuracy.png)", ""]


def _group_table(rows: list[dict], kind: str, metric: str, label: str, its: list[int]) -> str:
    by_key = {(r["split"], r["group_name"], r["iteration"]): r for r in rows}
    keys = list(dict.fromkeys((r["split"], r["group_name"]) for r in rows))
    columns = ["split", kind, "images", *(f"{label} (it {i})" for i in its),
               *(f"mean score (it {i})" for i in its), f"HF energy (it {its[-1]})"]
    table = []
    for split, name in keys:
        cells = [by_key.get((split, name, i)) for i in its]
        latest = cells[-1] or {}
        table.append([split, name, latest.get("images"),
                      *(None if c is None else c[metric] for c in cells),
                      *(None if c is None else c["mean_score"] for c in cells),
                      latest.get("hf_energy")])
    return _table(columns, table)


def _diagnostics_section(diag: list[dict], per_step: list[dict]) -> list[str]:
    steps = {d["iteration"]: [r for r in per_step if r["iteration"] == d["iteration"]]
             for d in diag}
    joined = {i: (" / ".join(fmt(r["ratio_mean"]) for r in s),
                  " / ".join(fmt(r["clip_fraction"]) for r in s)) for i, s in steps.items()}
    table = _table(
        ["iteration", "steps", "skipped", "loss", "clip fraction", "ratio mean",
         "ratio mean per step", "clip fraction per step", "LoRA change", "rollout HF energy",
         "zero-var groups", "alarm"],
        [[d["iteration"], d["steps"], d["skipped"], d["loss"], d["clip_fraction"],
          d["ratio_mean"], *joined[d["iteration"]], d["param_change_norm"],
          d["rollout_hf_energy"], d["zero_variance_fraction"], d["alarm"]] for d in diag])
    alarms = [f"- iteration {d['iteration']}: {d['alarm_reason']}" for d in diag if d["alarm"]]
    return ["## Training diagnostics", "",
            ("From `train_steps` (means over optimizer steps; per window step k in window "
             "order) and `checkpoints` (one row per iteration)."), "", table, "",
            *(["Constant-reward alarms:", "", *alarms, ""] if alarms else []),
            "![training diagnostics](diagnostics.png)", ""]


def _rollout_section(store: Store, con, run: str, k: int, n: int) -> tuple[list[str], dict]:
    lines, pngs = [f"## Rollouts of iteration {k}", "",
                   ("Each atom's grounding heatmap (peak-normalised) and the pixel advantage map "
                    "(on the log-prob grid, red > 0) over the image; s = atom score, A = atom "
                    "advantage, R = scalar reward."), ""], {}
    for i, p in enumerate(_rows(con, PROMPTS_SQL, {"run": run, "k": k, "n": n})):
        params = {"run": run, "k": k, "pid": p["prompt_id"]}
        samples, atoms = _rows(con, SAMPLES_SQL, params), _rows(con, ATOMS_SQL, params)
        name = f"rollouts-{i}-{p['prompt_id']}.png"
        maps = store.get_tensors(samples[0]["map_path"])["maps"]  # [N, h, w]
        images = store.get_tensors(samples[0]["image_path"])["images"]  # uint8 [N, 3, H, W]
        pngs[name] = rollout_plot(p["prompt"], samples, atoms, maps, images)
        by_atom: dict[str, list[dict]] = {}
        for a in atoms:
            by_atom.setdefault(a["atom_id"], []).append(a)
        lines += [f"### {p['prompt']}", "", f"prompt id `{p['prompt_id']}`", "",
                  _table(["sample", "reward", "scalar advantage", "map mass", "coverage"],
                         [[s["sample_index"], s["reward"], s["scalar_advantage"], s["mass"],
                           s["coverage"]] for s in samples]), "",
                  _table(["atom", "type", "question", "scores by sample", "advantages by sample"],
                         [[aid, a[0]["type"], a[0]["question"],
                           " / ".join(fmt(x["score"]) for x in a),
                           " / ".join(fmt(x["advantage"]) for x in a)]
                          for aid, a in by_atom.items()]), "", f"![{p['prompt']}]({name})", ""]
    return lines, pngs


def build_report(store: Store, run: str, prompts: int = 3) -> tuple[str, dict[str, bytes]]:
    """(markdown, {PNG file name: bytes}) of a run, from the store's catalog."""
    store.refresh_catalog()
    con = store.connect_readonly()
    try:
        q = {"run": run}
        accuracy = _rows(con, ACCURACY_SQL, q)
        if not accuracy:
            raise ValueError(f"run {run!r} has no overall `evals` rows in {store.root}; evaluate "
                             f"a checkpoint first (python -m flows.evaluate)")
        first, last = accuracy[0]["iteration"], accuracy[-1]["iteration"]
        its = sorted({first, last})
        lines = [f"# Evaluation report: run `{run}`", "",
                 (f"Store `{store.root}`; evaluated checkpoints: "
                  f"{sorted({r['iteration'] for r in accuracy})} (-1 = base model)."), "",
                 *_accuracy_section(accuracy)]
        pngs = {"accuracy.png": accuracy_plot(accuracy)}
        for kind, metric, label in GROUP_KINDS:
            rows = _rows(con, GROUPS_SQL, {**q, "kind": kind, "first": first, "last": last})
            lines += [f"## By {kind.replace('_', ' ')}", "", _group_table(
                rows, kind, metric, label, its), ""]
            if kind == "atom_type":
                pngs["atom_types.png"] = atom_type_plot(rows, first, last)
                lines += ["![atom accuracy by type](atom_types.png)", ""]
        window = _rows(con, "SELECT * FROM windows WHERE run_id = $run", q)
        curve = _rows(con, "SELECT * FROM calibration_curves WHERE run_id = $run ORDER BY step", q)
        if window:
            w = window[0]
            lines += ["## SDE window", "", _table(
                ["method", "formation step", "window start", "window end", "steps", "noise level"],
                [[w["method"], w["formation_step"], w["window_start"], w["window_end"],
                  w["num_steps"], w["noise_level"]]]), ""]
            if curve:
                pngs["calibration.png"] = calibration_plot(curve, w)
                lines += ["![calibration curve](calibration.png)", ""]
        diag = _rows(con, DIAGNOSTICS_SQL, q)
        if diag:
            per_step = _rows(con, PER_STEP_SQL, q)
            pngs["diagnostics.png"] = diagnostics_plot(diag, per_step, accuracy)
            lines += _diagnostics_section(diag, per_step)
            section, images = _rollout_section(store, con, run, diag[-1]["iteration"], prompts)
            lines += section
            pngs |= images
    finally:
        con.close()
    return "\n".join(lines), pngs


def _publish(markdown: str, run: str) -> bool:
    """Create a Prefect markdown artifact when inside a flow or task run; else do nothing."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return False
    key = "eval-report-" + re.sub(r"[^a-z0-9-]+", "-", run.lower()).strip("-")
    create_markdown_artifact(markdown=markdown, key=key, description=f"evaluation report: {run}")
    return True


def write_report(store: Store, run: str, out: str | os.PathLike, prompts: int = 3) -> ReportRef:
    """Build the report and write `out/report.md` with its PNGs (atomically, PNGs first)."""
    markdown, pngs = build_report(store, run, prompts)
    out = Path(out)
    for name, data in pngs.items():
        atomic_write_bytes(out / name, data)
    atomic_write_bytes(out / REPORT, markdown.encode())
    return ReportRef(str(out / REPORT), tuple(str(out / n) for n in pngs), _publish(markdown, run))


def default_out(store: Store, run: str) -> Path:
    return store.root / "reports" / run


write_report_task = task(write_report, name="eval_report_markdown")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default=None, help="store root (default $CAST_STORE, "
                        "else runs/store)")
    parser.add_argument("--run", required=True, help="run id (the recipe's run.name)")
    parser.add_argument("--out", default=None, help="output folder (default "
                        "<store>/reports/<run>)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts shown with heatmaps")
    args = parser.parse_args(argv)
    store = Store(store_root(args.store))
    ref = write_report(store, args.run, args.out or default_out(store, args.run), args.prompts)
    print(f"report: {ref.path} ({len(ref.images)} plots)")


if __name__ == "__main__":
    main()
