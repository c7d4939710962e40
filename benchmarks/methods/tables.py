"""The markdown tables of the methods benchmark's report, and their cells."""

from __future__ import annotations

import math

import numpy as np

from cast_core.csg.graph import ATOM_TYPES
from methods.arms import BASELINE, ONE_CHANGE
from methods.protocols import FINAL_SPLITS, METRICS, run_name
from methods.stats import Interval, Ratio, t_interval
from methods.store_reads import DIAGNOSTIC_COLUMNS, Results
from methods.summary import ITERATION_STAGES, Summary, one_change, one_change_ratios
from tasks.reporting.markdown import table


def fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def signed(x: float | None) -> str:
    return "–" if x is None else f"{x:+.3f}"


def interval_cell(iv: Interval | None, value=signed) -> str:
    if iv is None:
        return "– (no such atoms)"
    ci = "" if iv.low is None else f" [{value(iv.low)}, {value(iv.high)}]"
    return value(iv.mean) + ci


def ratio_cell(r: Ratio) -> str:
    if r.value is None:
        return r.note
    if r.low is None:
        return f"{r.value:.2f} ({r.note})"
    high = "inf" if math.isinf(r.high) else f"{r.high:.2f}"
    return f"{r.value:.2f} [{r.low:.2f}, {high}]"





def gains_table(sm: Summary) -> str:
    rows = []
    for a in sm.arms:
        for s in FINAL_SPLITS:
            for m, label in METRICS:
                iv = sm.gain[(a, s, m)]
                diff = "–" if a == BASELINE else interval_cell(sm.diff[(a, s, m)])
                ratio = "1 (baseline)" if a == BASELINE else ratio_cell(sm.ratio[(a, s, m)])
                rows.append([a, s, label, fmt(sm.base[(s, m)]), fmt(sm.base[(s, m)] + iv.mean),
                             interval_cell(iv), diff, ratio])
    return table(["arm", "split", "metric", "base", "final (mean)", "gain [95%]",
                  f"gain - {BASELINE} [95% t]", f"gain / {BASELINE} [95% bootstrap]"], rows)


def type_gains(res: Results, sm: Summary, prefix: str, last: int) -> dict:
    """{(arm, split, atom type): (base, Interval over seeds of final - base)} of the mean atom
    score of each type (the evaluate stage's `atom_type` rows; same prompts and noise as the base,
    so paired). Types a split lacks are left out."""
    out = {}
    for a in sm.arms:
        for s in FINAL_SPLITS:
            for t in ATOM_TYPES:
                base = res.type_evals.get((f"{prefix}-base", -1, s, t))
                finals = [res.type_evals.get((run_name(prefix, a, x), last, s, t))
                          for x in sm.seeds]
                if base is None or any(v is None for v in finals):
                    continue
                out[(a, s, t)] = (base, t_interval([v - base for v in finals]))
    return out


def type_gain_table(res: Results, sm: Summary, prefix: str, last: int) -> str:
    found = type_gains(res, sm, prefix, last)
    types = [t for t in ATOM_TYPES if any(k[2] == t for k in found)]
    rows = [[a, s, *(f"{fmt(found[(a, s, t)][0])} {interval_cell(found[(a, s, t)][1])}"
                     if (a, s, t) in found else "–" for t in types)]
            for a in sm.arms for s in FINAL_SPLITS]
    return table(["arm", "split", *(f"{t}: base, gain [95% t]" for t in types)], rows)


def checkpoint_table(sm: Summary) -> str:
    labels = ["base", *(f"{a} s{x}" for a in sm.arms for x in sm.seeds)]
    rows = []
    for label in labels:
        for s in FINAL_SPLITS:
            c = sm.checkpoint[(label, s)]
            noise = "–" if c.noise_half_width is None else f"±{c.noise_half_width:.3f}"
            rows.append([label, s, interval_cell(c.mean_score, fmt), noise,
                         interval_cell(c.strict_accuracy, fmt), c.images, c.mean_score.n])
    return table(["checkpoint", "split", "mean atom score [95% prompt bootstrap]",
                  "± image noise only", "strict accuracy [95% prompt bootstrap]", "images",
                  "prompts"], rows)


def seed_gain_table(sm: Summary) -> str:
    rows = [[a, x, s, *(interval_cell(sm.seed_gain[(a, x, s, m)]) for m, _ in METRICS)]
            for a in sm.arms for x in sm.seeds for s in FINAL_SPLITS]
    return table(["arm", "seed", "split", *(f"{label} gain [95% paired prompt bootstrap]"
                                            for _, label in METRICS)], rows)


def curve_table(sm: Summary) -> str:
    rows = []
    for a in sm.arms:
        for m, label in METRICS:
            curves = np.asarray(sm.curve[(a, m)])  # [seeds, K + 1]
            rows.append([a, label, *(interval_cell(t_interval(curves[:, k].tolist()), fmt)
                                     for k in range(curves.shape[1]))])
    its = ["base", *(f"it {k}" for k in range(len(sm.samples) - 1))]
    return table(["arm", "probe metric", *its], rows)


def efficiency_table(sm: Summary) -> str:
    rises = sm.threshold is not None and sm.threshold > sm.base[("probe", "mean_score")]

    def cell(v: float | None) -> str:
        if not rises:
            return "– (no threshold)"
        return "not reached" if v is None else f"{v:.0f}"

    rows = [[a, *(cell(sm.to_threshold[(a, x)]) for x in sm.seeds),
             "1 (baseline)" if a == BASELINE else ratio_cell(sm.crossing[a])] for a in sm.arms]
    return table(["arm", *(f"seed {x}" for x in sm.seeds),
                  f"mean-curve samples / {BASELINE}'s [95% bootstrap]"], rows)


def hf_table(sm: Summary) -> str:
    def diversity(a: str, s: str) -> list[str]:
        base, final = sm.diversity.get(("base", s)), sm.diversity.get((a, s))
        if base is None or final is None or base <= 0:
            return ["–", "–", "–"]
        return [f"{base:.4f}", f"{final:.4f}", f"{final / base - 1:+.0%}"]

    rows = [[a, s, f"{sm.hf[('base', s)]:.4f}", f"{sm.hf[(a, s)]:.4f}",
             f"{sm.hf[(a, s)] - sm.hf[('base', s)]:+.4f}", *diversity(a, s)]
            for a in sm.arms for s in FINAL_SPLITS]
    return table(["arm", "split", "base hf energy", "final (mean over seeds)", "change",
                  "base diversity", "final diversity", "diversity change"], rows)


def time_table(sm: Summary) -> str:
    stages = (*ITERATION_STAGES, "iteration")
    rows = [[a, *(f"{sm.stage_median[(a, st)]:.2f}" for st in stages),
             *(f"{sm.stage_median[(a, f'eval:{w}')]:.1f}" for w in ("probe", *FINAL_SPLITS)),
             f"{sm.stage_median[(a, 'calibrate_window')]:.1f}",
             fmt(sm.time_ratio.get((a, "iteration"))),
             f"{np.mean([sm.minutes[(a, x)] for x in sm.seeds]):.1f}"] for a in sm.arms]
    return table(["arm", *(f"{st} (s)" for st in stages), "probe (s)",
                  *(f"final {s} (s)" for s in FINAL_SPLITS), "calibration (s)",
                  "iteration / flowgrpo",
                  "minutes per run"], rows)


def diagnostics_table(res: Results, sm: Summary, prefix: str) -> str:
    """Per arm, the mean over seeds of each run's mean over its optimizer steps; columns the
    store does not have are left out."""
    found = {a: [res.diagnostics[r] for x in sm.seeds
                 if (r := run_name(prefix, a, x)) in res.diagnostics] for a in sm.arms}
    columns = [(c, label, spec) for c, label, spec in DIAGNOSTIC_COLUMNS
               if any(f.get(c) is not None for rows in found.values() for f in rows)]

    def cell(rows: list[dict], c: str, spec: str) -> str:
        values = [f[c] for f in rows if f.get(c) is not None]
        return format(float(np.mean(values)), spec) if values else "–"

    rows = [[a, *(cell(found[a], c, spec) for c, _, spec in columns),
             sum(f["steps"] for f in found[a])] for a in sm.arms]
    return table(["arm", *(label for _, label, _ in columns), "optimizer steps"], rows)


def one_change_table(sm: Summary) -> str:
    diffs, ratios, rows = one_change(sm, sm.arms), one_change_ratios(sm, sm.arms), []
    for a, r, about in ONE_CHANGE:
        for s in FINAL_SPLITS:
            if (a, r, s, METRICS[0][0]) in diffs:
                rows.append([about, f"{a} - {r}", s,
                             *(interval_cell(diffs[(a, r, s, m)]) for m, _ in METRICS),
                             ratio_cell(ratios[(a, r, s)])])
    return table(["change", "arms", "split", *(f"{label}, mean [95% t]" for _, label in METRICS),
                  "gain ratio arm / reference, mean score [95% paired bootstrap]"], rows)


def per_step_table(res: Results, sm: Summary, prefix: str) -> str | None:
    """Per arm, how far each window step moved the policy an iteration (checkpoints'
    update_kl_per_step: mean over iterations, then over seeds) and the ratio of the largest
    step's to the smallest's, the velocity change each step's KL implies (update_velocity_per_step,
    RMS a latent dim, averaged alike; "–" where the checkpoints predate it), and the steps' loss
    weights at the last iteration (mean over seeds; "1" where the arm does not weight them).
    None when no run of the store records per-step KLs."""
    rows = []

    def mean_of_runs(per_run: list) -> np.ndarray:  # [iterations x K] per run -> [K]
        return np.mean([np.mean(np.asarray(x, dtype=float), axis=0) for x in per_run], axis=0)

    for a in sm.arms:
        found = [res.per_step[r] for x in sm.seeds if (r := run_name(prefix, a, x)) in res.per_step]
        if not found:
            continue
        kl = mean_of_runs([kls for kls, _, _ in found])
        velocities = [v for _, _, v in found if v]
        weights = [w[-1] for _, w, _ in found if w]
        window = res.windows.get(run_name(prefix, a, sm.seeds[0]))
        rows.append([a, f"[{window[1]}, {window[2]})" if window else "–",
                     " / ".join(f"{v:.3g}" for v in kl), f"{kl.max() / kl.min():.1f}",
                     " / ".join(f"{v:.3g}" for v in mean_of_runs(velocities)) if velocities
                     else "–",
                     " / ".join(f"{v:.2f}" for v in np.mean(weights, axis=0)) if weights
                     else "1"])
    if not rows:
        return None
    return table(["arm", "window",
                  "KL moved per window step (nats a sample, mean over iterations and seeds)",
                  "largest / smallest",
                  "velocity change per window step (RMS a latent dim, mean alike)",
                  "loss weight per step, last iteration (mean over seeds)"], rows)
