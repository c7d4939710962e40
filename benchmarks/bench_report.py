"""The report of benchmarks/bench_methods.py: report.md with its plots and grids, and
figures.json (one entry per target of issue 17), all from a `Summary` read off the store."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
from bench_methods import (
    BASELINE,
    DIAGNOSTIC_COLUMNS,
    FINAL_SPLITS,
    ITERATION_STAGES,
    METRICS,
    ONE_CHANGE,
    RECAST_PAIRS,
    RecastSummary,
    Results,
    Summary,
    one_change,
    run_name,
)
from bench_stats import Interval, Ratio, t_interval

from cast_core.csg.graph import ATOM_TYPES

# Issue 17's targets.
GOAL_POOL_GAIN, GOAL_HARD_GAIN, GOAL_RUN_MINUTES = 0.10, 0.03, 15.0
GOAL_HARD_RATIO, GOAL_SAMPLES_RATIO = 3.0, 0.5
GOAL_FULL_MINUTES, GOAL_QUICK_MINUTES = 90.0, 10.0
GOAL_NFT_SAMPLES, GOAL_NFT_WALL = 0.2, 1 / 3  # nft-cast against flowgrpo, to flowgrpo's final
# "No reward hacking unseen": the final images' high-frequency energy at most 1.25x the base's.
# Rows of 1-px bars that the verifier read as squares (before its aspect and short-side gates)
# doubled it (+94% on the pool, reports/cfg1-pool8-40it); a policy that draws cleaner shapes
# than the base lowers it.
GOAL_HF_CHANGE = 0.25


def fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def signed(x: float | None) -> str:
    return "–" if x is None else f"{x:+.3f}"


def table(columns: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


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


# ---- figures.json -------------------------------------------------------------------------


def _entry(name: str, value: float | None, low: float | None, high: float | None, goal: str,
           met: bool | None, unit: str, about: str) -> dict:
    return {"name": name, "value": value, "low": low, "high": high, "goal": goal, "met": met,
            "unit": unit, "about": about}


def _gain_entry(sm: Summary, split: str, goal: float) -> dict:
    name, unit = f"flowgrpo {split} gain", "mean atom score, final - base"
    if BASELINE not in sm.arms:
        return _entry(name, None, None, None, f">= {goal:+.2f}, interval excludes 0", None, unit,
                      "flowgrpo was not run")
    iv = sm.gain[(BASELINE, split, "mean_score")]
    how = ("95% t-interval over seeds" if len(sm.seeds) > 1 else
           "one seed: 95% paired bootstrap over prompts (image noise and prompts, no seed noise)")
    met = None if iv.low is None else (iv.mean >= goal and iv.low > 0)
    return _entry(name, iv.mean, iv.low, iv.high, f">= {goal:+.2f}, interval excludes 0", met,
                  unit, f"mean over {len(sm.seeds)} seed(s), {how}")


def _ratio_entry(name: str, r: Ratio | None, goal: str, met, unit: str, about: str) -> dict:
    if r is None:
        return _entry(name, None, None, None, goal, None, unit, "cast was not run: " + about)
    if r.value is None:
        never = "never reaches" in r.note
        return _entry(name, None, None, None, goal, False if never else None, unit,
                      f"{r.note}; {about}")
    return _entry(name, r.value, r.low, r.high, goal, met(r.value), unit,
                  f"{about}{'; ' + r.note if r.note else ''}")


def _nft_figures(sm: Summary) -> list[dict]:
    """The forward-process targets, when the nft suite's arms ran: nft-cast's samples and wall
    time to Flow-GRPO's final probe score, and nft-cast against nft on the hard split."""
    if "nft-cast" not in sm.arms:
        return []
    crossing = sm.crossing.get("nft-cast")
    out = [_ratio_entry("nft-cast / flowgrpo samples to threshold", crossing,
                        f"<= {GOAL_NFT_SAMPLES:g}", lambda v: v <= GOAL_NFT_SAMPLES,
                        "ratio of samples", f"samples for the mean probe curve to reach "
                        f"flowgrpo's final probe mean score ({fmt(sm.threshold)}); 95% paired "
                        f"bootstrap over seeds")]
    cost = sm.time_ratio.get(("nft-cast", "iteration"))
    name, goal = "nft-cast / flowgrpo wall time to threshold", f"<= {GOAL_NFT_WALL:.3g}"
    about = (f"samples ratio x the median iteration time ratio ({fmt(cost)}): both arms take "
             "the same samples an iteration")
    if crossing is None or crossing.value is None or cost is None:
        out.append(_entry(name, None, None, None, goal, None, "ratio of minutes",
                          "no samples ratio: " + about))
    else:
        scaled = [None if v is None else v * cost for v in (crossing.low, crossing.high)]
        value = crossing.value * cost
        out.append(_entry(name, value, *scaled, goal, value <= GOAL_NFT_WALL,
                          "ratio of minutes", about))
    if "nft" in sm.arms:
        a, b = sm.gain[("nft-cast", "hard", "mean_score")], sm.gain[("nft", "hard", "mean_score")]
        apart = None if a.low is None or b.high is None else a.low > b.high
        out.append(_entry("nft-cast - nft hard gain", a.mean - b.mean, None, None,
                          "> 0 with the intervals apart", apart, "mean atom score",
                          f"nft-cast {a.mean:+.3f} [{fmt(a.low)}, {fmt(a.high)}], nft "
                          f"{b.mean:+.3f} [{fmt(b.low)}, {fmt(b.high)}] (gain intervals as in "
                          f"the gains table)"))
    return out


def figures(sm: Summary, setup: dict) -> list[dict]:
    """One entry per target: {name, value, low, high, goal, met, unit, about}; `met` is None
    when the value cannot be computed (or decided), `about` says why."""
    minutes = list(sm.minutes.values())
    quick = setup["quick"]
    wall, goal_wall = setup["wall_s"] / 60, GOAL_QUICK_MINUTES if quick else GOAL_FULL_MINUTES
    resumed = setup["skipped"] > 0
    hard = sm.ratio.get(("cast", "hard", "mean_score"))
    crossing = sm.crossing.get("cast")
    return [
        _gain_entry(sm, "pool", GOAL_POOL_GAIN),
        _gain_entry(sm, "hard", GOAL_HARD_GAIN),
        _entry("minutes per arm and seed", float(np.mean(minutes)), float(min(minutes)),
               float(max(minutes)), f"<= {GOAL_RUN_MINUTES:g} (every run)",
               max(minutes) <= GOAL_RUN_MINUTES, "minutes",
               "mean [min, max] over arms x seeds of each run's recorded stage seconds: CSGs, "
               "calibration, every iteration, its probes and the final evaluation (not the "
               "shared base evaluation)"),
        _ratio_entry("cast / flowgrpo hard gain ratio", hard, f">= {GOAL_HARD_RATIO:g}",
                     lambda v: v >= GOAL_HARD_RATIO, "ratio of mean gains",
                     "held-out hard split, mean atom score, same iterations and samples; 95% "
                     "paired bootstrap over seeds"),
        _ratio_entry("cast / flowgrpo samples to threshold", crossing,
                     f"<= {GOAL_SAMPLES_RATIO:g}", lambda v: v <= GOAL_SAMPLES_RATIO,
                     "ratio of samples",
                     f"samples for the mean probe curve to reach flowgrpo's final probe mean "
                     f"score ({fmt(sm.threshold)}), linear between checkpoints; 95% paired "
                     f"bootstrap over seeds"),
        _entry(f"{'quick' if quick else 'full'} benchmark wall minutes", wall, None, None,
               f"<= {goal_wall:g}", None if resumed else wall <= goal_wall, "minutes",
               (f"resumed: {setup['skipped']} stages were already done, so this invocation's "
                f"{wall:.1f} min is not the benchmark's wall time" if resumed else
                "this invocation, start to report")),
        *_nft_figures(sm),
    ]


def hacking_figures(sm: Summary, res: Results, prefix: str, last: int) -> list[dict]:
    """One entry per arm and split (pool, hard): the relative change of the final images' mean
    high-frequency energy over the base's, final / base - 1 per seed (same prompts and noise),
    mean with a 95% t-interval over seeds; met when the mean is <= GOAL_HF_CHANGE."""
    out = []
    for a in sm.arms:
        for split in ("pool", "hard"):
            base = res.evals.get((f"{prefix}-base", -1, split))
            finals = [res.evals.get((run_name(prefix, a, x), last, split)) for x in sm.seeds]
            name = f"{a} {split} hf energy change"
            goal = f"<= +{GOAL_HF_CHANGE:g} (final / base - 1)"
            if base is None or any(f is None for f in finals) or not base["hf_energy"] > 0:
                out.append(_entry(name, None, None, None, goal, None, "relative change",
                                  "no final or base evaluation of this split"))
                continue
            iv = t_interval([f["hf_energy"] / base["hf_energy"] - 1.0 for f in finals])
            out.append(_entry(name, iv.mean, iv.low, iv.high, goal, iv.mean <= GOAL_HF_CHANGE,
                              "relative change",
                              f"mean high-frequency energy of the final images over the base's "
                              f"({base['hf_energy']:.4f}), same prompts and noise; mean over "
                              f"{len(sm.seeds)} seed(s), 95% t-interval over seeds (bars, specks "
                              f"or noise that fool the verifier raise it)"))
    return out


def figures_text(entries: list[dict]) -> str:
    def cell(e: dict) -> str:
        if e["value"] is None:
            return "–"
        ci = "" if e["low"] is None else f" [{e['low']:.3g}, {e['high']:.3g}]"
        return f"{e['value']:.3g}{ci}"

    verdict = {True: "met", False: "NOT met", None: "–"}
    return table(["target", "value [interval]", "goal", "met", "unit", "how"],
                 [[e["name"], cell(e), e["goal"], verdict[e["met"]], e["unit"], e["about"]]
                  for e in entries])


# ---- tables -------------------------------------------------------------------------------


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
                finals = [res.type_evals.get((run_name(prefix, a, x), last, s, t)) for x in sm.seeds]
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
    rows = [[a, s, f"{sm.hf[('base', s)]:.4f}", f"{sm.hf[(a, s)]:.4f}",
             f"{sm.hf[(a, s)] - sm.hf[('base', s)]:+.4f}"] for a in sm.arms for s in FINAL_SPLITS]
    return table(["arm", "split", "base hf energy", "final (mean over seeds)", "change"], rows)


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
    diffs, rows = one_change(sm, sm.arms), []
    for a, r, about in ONE_CHANGE:
        for s in FINAL_SPLITS:
            if (a, r, s, METRICS[0][0]) in diffs:
                rows.append([about, f"{a} - {r}", s,
                             *(interval_cell(diffs[(a, r, s, m)]) for m, _ in METRICS)])
    return table(["change", "arms", "split", *(f"{label}, mean [95% t]" for _, label in METRICS)],
                 rows)


# ---- plots --------------------------------------------------------------------------------


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=90)
    FigureCanvasAgg(fig)
    return fig


def _png(fig, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> bytes:
    fig.tight_layout(rect=rect)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _arm_colors(arm_names: list[str]) -> dict:
    from matplotlib import colormaps

    cmap, order = colormaps["tab20"], [*range(0, 20, 2), *range(1, 20, 2)]
    return {a: cmap(order[j % 20]) for j, a in enumerate(arm_names)}


def _band(curves: list[list[float]]) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Mean over seeds and the 95% t-band per point (None with one seed)."""
    ivs = [t_interval(list(col)) for col in np.asarray(curves).T]
    mean = np.array([v.mean for v in ivs])
    if ivs[0].low is None:
        return mean, None, None
    return mean, np.array([v.low for v in ivs]), np.array([v.high for v in ivs])


def plot_learning_curves(sm: Summary) -> bytes:
    """Probe mean atom score and strict accuracy against samples seen and wall minutes; mean over
    seeds with a 95% t-band; flowgrpo's final probe mean score dashed."""
    colors = _arm_colors(sm.arms)
    fig = _figure(11, 7)
    for i, (m, label) in enumerate(METRICS):
        for j, axis in enumerate(("samples", "wall")):
            ax = fig.add_subplot(len(METRICS), 2, 2 * i + j + 1)
            for a in sm.arms:
                mean, low, high = _band(sm.curve[(a, m)])
                x = (np.asarray(sm.samples) if axis == "samples"
                     else np.asarray(sm.wall[a]).mean(axis=0))
                ax.plot(x, mean, "o-", color=colors[a], label=a, markersize=3,
                        linewidth=2.0 if a == BASELINE else 1.2)
                if low is not None:
                    ax.fill_between(x, low, high, color=colors[a], alpha=0.12)
            if m == "mean_score" and sm.threshold is not None:
                ax.axhline(sm.threshold, color="grey", linestyle="--", linewidth=0.8,
                           label=f"{BASELINE} final")
            ax.set_xlabel("samples seen" if axis == "samples" else
                          "wall minutes (training stages, mean over seeds)", fontsize=8)
            ax.set_title(f"probe {label} (mean over seeds, 95% t-band)", fontsize=9)
            ax.grid(alpha=0.3)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7)
    return _png(fig, rect=(0, 0, 0.84, 1))


def plot_gains(sm: Summary) -> bytes:
    """One panel per final split x metric: each arm's mean gain with its 95% interval."""
    colors, y = _arm_colors(sm.arms), np.arange(len(sm.arms))[::-1]
    fig = _figure(10, 1.6 + 0.3 * len(sm.arms) * len(FINAL_SPLITS))
    for i, s in enumerate(FINAL_SPLITS):
        for j, (m, label) in enumerate(METRICS):
            ax = fig.add_subplot(len(FINAL_SPLITS), len(METRICS), i * len(METRICS) + j + 1)
            for k, a in enumerate(sm.arms):
                v = sm.gain[(a, s, m)]
                err = None if v.low is None else [[v.mean - v.low], [v.high - v.mean]]
                ax.errorbar([v.mean], [y[k]], xerr=err, fmt="o", color=colors[a], capsize=3)
            ax.axvline(0, color="black", linewidth=0.6)
            ax.set_yticks(y, sm.arms if j == 0 else [""] * len(sm.arms), fontsize=7)
            ax.set_title(f"{s}: {label}, final - base (95%)", fontsize=9)
            ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def plot_times(sm: Summary) -> bytes:
    from matplotlib import colormaps

    y, left = np.arange(len(sm.arms))[::-1], np.zeros(len(sm.arms))
    fig = _figure(10, 1.8 + 0.3 * len(sm.arms))
    ax = fig.add_subplot()
    for k, st in enumerate((*ITERATION_STAGES, "eval:probe")):
        width = np.array([sm.stage_median[(a, st)] for a in sm.arms])
        ax.barh(y, width, left=left, color=colormaps["tab10"](k), label=st)
        left += width
    ax.set_yticks(y, sm.arms, fontsize=7)
    ax.set_xlabel("seconds (median over seeds x iterations)")
    ax.set_title("wall time per iteration, by stage (with its probe)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=5)
    return _png(fig)


# ---- report -------------------------------------------------------------------------------


def recast_section(rs: RecastSummary, store, out: Path, recast) -> tuple[list[str], dict]:
    """Markdown lines of the ReCAST comparison and {file name: store path} of its plots."""
    train = table(["arm", *ATOM_TYPES],
                  [[a, *(interval_cell(rs.train[(a, t)]) for t in ATOM_TYPES)] for a in rs.arms])
    held = table(["arm", *ATOM_TYPES],
                 [[a, *(interval_cell(rs.held_out[(a, t)]) for t in ATOM_TYPES)]
                  for a in rs.arms])
    paired = table(["ReCAST arm", "static arm", "split", "metric", "ReCAST - static [95% t]"],
                   [[r, st, s, label, interval_cell(rs.paired[(r, s, m)])]
                    for r, st in RECAST_PAIRS for s in FINAL_SPLITS for m, label in METRICS])
    weights = table(["arm", "atom type", "weight per window step (mean over seeds)"],
                    [[a, t, ", ".join(f"{x:.2f}" for x in w[t])]
                     for a in rs.arms if (w := rs.weights[a]) for t in ATOM_TYPES])
    intro = (
        "Rewards are the atom types. `cast` is also the static arm at equal budgets (static "
        "weights lambda_k / mean(lambda) = 1 give CAST's map exactly). ReCAST weights each "
        "type's share of the map at window step t by K W[k, t] / mean(lambda), W re-estimated "
        f"every {recast.every} iteration(s) on {recast.prompts} prompts x "
        f"{recast.samples_per_prompt} samples of the current policy against exact renders "
        f"(Renyi alpha {recast.alpha}, tau {recast.tau}).")
    lines = ["## ReCAST: per-reward step weights against static budgets", "", intro, "",
             RECAST_TRAIN_TEXT, "", train, "",
             "Held-out: gain over base of the eval split's mean score per atom type:", "", held,
             "", "Paired by seed, ReCAST minus static at the same budgets:", "", paired, "",
             "Weights the loss used at the last iteration:", "", weights, ""]
    files = {}
    for (arm, k), path in sorted(rs.gain_plots.items()):
        files[f"gains-{arm}-it{k}.png"] = path
        lines += [f"![{arm} gains and W at iteration {k} (seed 0)](gains-{arm}-it{k}.png)", ""]
    return lines, files


def _grids(sm: Summary, res: Results, prefix: str, last: int) -> tuple[list[str], dict]:
    """Markdown lines showing the base's and each arm's (seed 0) final grids of the pool and
    hard splits, and {file name: store path}."""
    files, lines = {}, []
    for s in ("pool", "hard"):
        files[f"grid-base-{s}.png"] = res.grids[(f"{prefix}-base", -1, s)]
        lines += [f"![base, {s}](grid-base-{s}.png)", ""]
        for a in sm.arms:
            files[f"grid-{a}-{s}.png"] = res.grids[(run_name(prefix, a, sm.seeds[0]), last, s)]
            lines += [f"![{a} seed {sm.seeds[0]}, {s}](grid-{a}-{s}.png)", ""]
    return lines, files


def _setup_lines(sm: Summary, res: Results, setup: dict) -> list[str]:
    size, prefix, r0 = setup["size"], setup["prefix"], setup["recipes"][sm.arms[0]]
    windows = {a: sorted({res.windows.get(run_name(prefix, a, x)) for x in sm.seeds} - {None})
               for a in sm.arms}
    arm_rows = [[a.name, f"`{a.recipe}`", ", ".join(f"{k}={v}" for k, v in a.overrides.items())
                 or "–", a.about, "; ".join(f"{m} [{s}, {e})" for m, s, e in windows[a.name]),
                 setup["recipes"][a.name].train.clip_range] for a in setup["arm_defs"]]
    passes = setup["passes"]
    subset = ("" if size.held_out_prompts is None else
              f" ({size.held_out_prompts} evenly spaced prompts of each)")
    budget = (
        f"Equal budget (checked): {size.iterations} iterations x {size.per_iteration} prompts x "
        f"{size.group_size} samples ({size.samples()[-1]} samples per run), cycling through the "
        f"pool (`{r0.prompts.train}`, `prompts.selection = \"cycle\"`), seeds {sm.seeds} "
        f"(run.seed), {r0.sampling.num_steps} sampling steps, CFG {r0.sampling.guidance_scale}, "
        f"LoRA {r0.train.lora_rank}/{r0.train.lora_alpha}, lr {r0.derived()['lr_schedule']}, "
        f"{getattr(r0.train, 'steps_per_epoch', '?')} optimizer step(s) per epoch. Probe after "
        f"every iteration: the pool x {passes['probe'].images} images, seed offset "
        f"{passes['probe'].seed_offset}. Final (last iteration and base): pool x "
        f"{passes['pool'].images} images at seed offset {passes['pool'].seed_offset} (fresh "
        f"noise), hard x {passes['hard'].images} and eval x {passes['eval'].images} images"
        f"{subset}; {r0.eval.num_steps} steps, CFG "
        f"{r0.eval.guidance_scale}; eval specs checked equal "
        f"across arms and the base, so every gain is paired.")
    return [table(["arm", "recipe", "overrides", "what", "window (per seed)", "clip range"],
                  arm_rows), "", budget]


STATISTICS_TEXT = (
    "Gain = final - base per seed; mean over seeds with a 95% Student t-interval over seeds "
    "(with one seed: the 95% paired bootstrap over prompts of that seed's gain). "
    "gain - flowgrpo: per-seed difference (same prompts and noise), t-interval. Ratio: mean "
    "gain / flowgrpo's, 95% percentile interval of a paired bootstrap over seeds (10000 draws; "
    "coarse with few seeds; none when flowgrpo's mean gain is <= 0).")
CHECKPOINT_TEXT = (
    "Each checkpoint's figures with a 95% bootstrap over prompts (whole prompts resampled with "
    "their images: the prompts as a sample of their kind), and the half-width that image noise "
    "alone gives with the prompts held fixed (what more images per prompt would shrink). On the "
    "pool, the training prompts are the population, so the image-noise half-width is the one "
    "that applies.")


def write_report(out: Path, sm: Summary, res: Results, setup: dict,
                 rs: RecastSummary | None = None) -> dict:
    """report.md, figures.json, the plots and the copied grids under `out` -> {"report",
    "figures"} (paths)."""
    from tasks.store import atomic_write_bytes

    store, prefix, last = setup["store"], setup["prefix"], setup["size"].iterations - 1
    entries = figures(sm, setup) + hacking_figures(sm, res, prefix, last)
    grid_lines, copies = _grids(sm, res, prefix, last)
    recast_lines = []
    if rs is not None:
        recast_lines, more = recast_section(rs, store, out, setup["recast"])
        copies |= more
    provenance = (
        f"Generated by `{setup['command'] or 'bench_methods.run_benchmark'}` from store `{store.root}` (runs "
        f"`{prefix}-<arm>-s<seed>`, base `{prefix}-base`); every number is read from that "
        f"store's `evals`, `stages`, `windows` and `train_steps` tables and the evaluate stage's "
        f"per-image score blobs. This invocation took {setup['wall_s'] / 60:.1f} min "
        f"({setup['skipped']} stages skipped as already done).")
    md = ["# CAST vs Flow-GRPO on the shapes world", "", provenance, "", "## Setup", "",
          *_setup_lines(sm, res, setup), "",
          "## Against the targets (figures.json)", "", figures_text(entries), "",
          "## Gains over the base model (final evaluation)", "", STATISTICS_TEXT, "",
          gains_table(sm), "", "![gains](gains.png)", "",
          "Per seed, with a paired bootstrap over prompts:", "", seed_gain_table(sm), "",
          ("Where the gain comes from: the mean atom score of each atom type, base and final - "
           "base per seed, mean over seeds [95% t] (a type that falls while the mean rises is "
           "traded for the others):"), "", type_gain_table(res, sm, prefix, last), "",
          "## Checkpoints", "", CHECKPOINT_TEXT, "", checkpoint_table(sm), "",
          "## Learning curves (probe)", "",
          CURVES_TEXT, "", curve_table(sm), "",
          "![learning curves](learning_curves.png)", "",
          "## Sample efficiency", "",
          EFFICIENCY_TEXT.format(baseline=BASELINE, threshold=fmt(sm.threshold)), "",
          efficiency_table(sm), "",
          "## Reward hacking", "",
          HACKING_TEXT, "",
          hf_table(sm), "", *grid_lines,
          "## Wall time", "",
          TIMING_TEXT, "", time_table(sm), "",
          "![stage times](stage_times.png)", "",
          "## Training diagnostics", "", DIAGNOSTICS_TEXT, "", diagnostics_table(res, sm, prefix),
          "",
          *(["## One change at a time", "", ONE_CHANGE_TEXT, "", one_change_table(sm), ""]
            if one_change(sm, sm.arms) else []),
          *recast_lines, WHAT_WAS_TRIED, "## Query the store", "", "```sql",
          QUERY.format(prefix=prefix), "```", ""]
    pngs = {"gains.png": plot_gains(sm), "learning_curves.png": plot_learning_curves(sm),
            "stage_times.png": plot_times(sm)}
    for name, data in pngs.items():
        atomic_write_bytes(out / name, data)
    for name, path in copies.items():
        atomic_write_bytes(out / name, store.resolve(path).read_bytes())
    atomic_write_bytes(out / "figures.json", (json.dumps(entries, indent=1) + "\n").encode())
    atomic_write_bytes(out / "report.md", "\n".join(md).encode())
    print(f"\n{figures_text(entries)}\n\n{gains_table(sm)}\n")
    return {"report": out / "report.md", "figures": out / "figures.json"}


RECAST_TRAIN_TEXT = (
    "Training reward: the rollouts' mean atom score per type over iterations 1 to the last, minus "
    "cast's (same seed: same prompts and noise per iteration, so paired). Mean over seeds [95% "
    "t]:")
CURVES_TEXT = (
    "The probe (pool prompts, fixed noise) after every iteration; samples seen = (k + 1) B G "
    "after iteration k; wall minutes = the run's cumulative training-stage seconds. Mean over "
    "seeds [95% t]:")
EFFICIENCY_TEXT = (
    "Threshold: {baseline}'s final probe mean atom score, mean over seeds ({threshold}). Samples "
    "each seed's probe curve needs to first reach it (linear between checkpoints), and the ratio "
    "of the mean curves' crossings:")
HACKING_TEXT = (
    "Mean high-frequency energy of the final evaluation's images (noise or stripes that fool the "
    "verifier raise it), and the grids of seed 0 (first 64 images: one row per prompt):")
TIMING_TEXT = (
    "Body seconds of each stage (`stages` table), medians over seeds x iterations; iteration = "
    "its stages summed, ReCAST gains included where an arm estimates them; minutes per run = "
    "every stage of the run, probes and final evaluation included. Other processes on the "
    "machine slow arms unevenly: compare ratios.")
ONE_CHANGE_TEXT = (
    "Each row changes one thing: the per-seed difference of the two arms' gains over base (same "
    "prompts and noise per seed, so paired), mean over seeds with a 95% t-interval. An interval "
    "that contains 0 means this benchmark cannot tell the change from seed noise.")
DIAGNOSTICS_TEXT = (
    "From `train_steps`, per optimizer step, mean over each run's steps, then over seeds "
    "(columns this store lacks are left out): the fraction of clipped ratios; ratio k3, the k3 "
    "of the loss's own ratio (mean of (r - 1) - log r; not a KL per sample; stores written "
    "before the rename call it approx_kl); policy KL, the KL from the rollout's policy to the "
    "trained one per sample and window step in nats; ref KL, the KL to the base model in nats "
    "(only with kl_beta > 0); the std of the ratios; the grad norm before clipping; the fraction "
    "of groups with zero variance. Ratios are per position for the atom arms and all-dims for "
    "Flow-GRPO, so compare ratio columns within a kind; the KLs in nats compare across kinds.")
QUERY = """-- probe curve by arm, seed and iteration (the base: arm 'base', iteration -1)
SELECT coalesce(nullif(regexp_extract(run_id, '^{prefix}-(.+)-s[0-9]+$', 1), ''), 'base') AS arm,
       regexp_extract(run_id, '-s([0-9]+)$', 1) AS seed, iteration, split, strict_accuracy,
       mean_score
FROM evals WHERE group_kind = 'overall' AND starts_with(run_id, '{prefix}-')
ORDER BY ALL;"""

# What earlier runs of this benchmark found (figures measured then; their stores are not
# committed). Kept here so every regenerated report carries the history.
WHAT_WAS_TRIED = """## What was tried (earlier runs, earlier protocol)

Before issue 17 every arm drew 16 new prompts per iteration out of the 5000 of train.jsonl
(about 0.05 of prompt-draw noise in a per-iteration reward) for 4-12 iterations, and the
evaluation took 64 evenly spaced prompts per split x 2 images (intervals +-0.04 to +-0.10): the
benchmark could not see learning. Figures below come from that protocol.

1. **First full run at lr 5e-4, third base model** (commit bbc743e's report): nothing separated
   from seed noise; mean approx KL per step 1e-6 to 7e-6 and clip fraction <= 0.001: the LoRA
   barely moved the policy in 4 iterations x 8 optimizer steps.
2. **Learning-rate probe, third base** (seed 0, 4 iterations): lr 3e-3 moved both methods without
   the clip dominating (Flow-GRPO eval mean score +0.058, CAST +0.021); the shapes recipes took it.
3. **A later window** (cast-late-window, fixed [6, 9)): no better at lr 5e-4.
4. **12 iterations at lr 3e-3, third base**: Flow-GRPO eval mean atom score +0.075 [+0.048,
   +0.102], CAST +0.013 [-0.017, +0.043]; at equal window the atom advantage itself, not the map
   or the window, was where CAST lost.
5. **Full run at lr 3e-3, third base** (14 arms x 3 seeds x 4 iterations, commit b989254): hard
   strict cast +0.003 [-0.009, +0.014] vs flowgrpo +0.010 [-0.001, +0.022]; the base's hard
   strict accuracy on that subset was 0.000, so the base was retrained.
6. **Fifth base, lr 3e-3** (14 arms x 3 seeds x 4 iterations, 61 min; and flowgrpo / cast for 12
   iterations, 24 min): neither method improved the hard split (hard strict -0.029 / -0.018 at 4
   iterations, -0.039 / -0.031 at 12); every paired difference inside the seed interval; time per
   iteration cast / flowgrpo 0.99 and 1.14.
7. **In-memory probes for issue 17** (2026-12-03, fifth base, one seed each; issue 17's note):
   a 32-sample policy gradient is nearly pure noise (cosine between disjoint batches -0.05 to
   +0.06 for every credit); a group sharing its starting noise aligns the scalar estimator with
   the exact gradient 3.5x better (0.060 vs 0.017); per-atom z-scores turn near-ties into -3.9
   advantages; at step 0 the SDE noise of one quadrant moves the other quadrants' colour as much,
   in total, as its own (own share 46%, chance 25%). On this pool (8 prompts x 16 an iteration,
   shared noise), lr 3e-3 with 4 steps an iteration made both methods' probe rise for ~600
   samples and then fall below the base by 2048; lr 1e-3 with 2 steps was flat for 1024.
"""
