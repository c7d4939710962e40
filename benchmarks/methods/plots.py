"""The methods benchmark's plots as PNG bytes: learning curves, gains, stage times."""

from __future__ import annotations

import numpy as np

from methods.arms import BASELINE
from methods.protocols import FINAL_SPLITS, METRICS
from methods.stats import t_interval
from methods.summary import ITERATION_STAGES, Summary
from tasks.stages.plots import figure, png


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


def _curve(ax, x, curves: list[list[float]], color, arm: str, markersize: float) -> None:
    """One arm's mean over seeds against x, with its 95% t-band (none with one seed)."""
    mean, low, high = _band(curves)
    ax.plot(x, mean, "o-", color=color, label=arm, markersize=markersize,
            linewidth=2.0 if arm == BASELINE else 1.2)
    if low is not None:
        ax.fill_between(x, low, high, color=color, alpha=0.12)


def _legend_png(fig) -> bytes:
    handles, labels = fig.axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7)
    return png(fig, rect=(0, 0, 0.84, 1))


def plot_learning_curves(sm: Summary) -> bytes:
    """Probe mean atom score and strict accuracy against samples seen and wall minutes; mean over
    seeds with a 95% t-band; flowgrpo's final probe mean score dashed."""
    colors = _arm_colors(sm.arms)
    fig = figure(11, 7)
    for i, (m, label) in enumerate(METRICS):
        for j, axis in enumerate(("samples", "wall")):
            ax = fig.add_subplot(len(METRICS), 2, 2 * i + j + 1)
            for a in sm.arms:
                x = (np.asarray(sm.samples) if axis == "samples"
                     else np.asarray(sm.wall[a]).mean(axis=0))
                _curve(ax, x, sm.curve[(a, m)], colors[a], a, 3)
            if m == "mean_score" and sm.threshold is not None:
                ax.axhline(sm.threshold, color="grey", linestyle="--", linewidth=0.8,
                           label=f"{BASELINE} final")
            ax.set_xlabel("samples seen" if axis == "samples" else
                          "wall minutes (training stages, mean over seeds)", fontsize=8)
            ax.set_title(f"probe {label} (mean over seeds, 95% t-band)", fontsize=9)
            ax.grid(alpha=0.3)
    return _legend_png(fig)


def plot_type_curves(sm: Summary) -> bytes | None:
    """The probe's mean score of each atom type against samples seen, one panel per type; mean
    over seeds with a 95% t-band. None when the store has no per-type probe rows."""
    types = list(dict.fromkeys(t for _, t in sm.type_curve))
    if not types:
        return None
    colors = _arm_colors(sm.arms)
    fig = figure(11, 3.2 * ((len(types) + 1) // 2))
    for i, t in enumerate(types):
        ax = fig.add_subplot((len(types) + 1) // 2, 2, i + 1)
        for a in sm.arms:
            _curve(ax, sm.samples, sm.type_curve[(a, t)], colors[a], a, 2)
        ax.set_title(f"probe, {t} atoms: mean score (mean over seeds, 95% t-band)", fontsize=9)
        ax.set_xlabel("samples seen", fontsize=8)
        ax.grid(alpha=0.3)
    return _legend_png(fig)


def plot_gains(sm: Summary) -> bytes:
    """One panel per final split x metric: each arm's mean gain with its 95% interval."""
    colors, y = _arm_colors(sm.arms), np.arange(len(sm.arms))[::-1]
    fig = figure(10, 1.6 + 0.3 * len(sm.arms) * len(FINAL_SPLITS))
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
    return png(fig)


def plot_times(sm: Summary) -> bytes:
    from matplotlib import colormaps

    y, left = np.arange(len(sm.arms))[::-1], np.zeros(len(sm.arms))
    fig = figure(10, 1.8 + 0.3 * len(sm.arms))
    ax = fig.add_subplot()
    for k, st in enumerate((*ITERATION_STAGES, "eval:probe")):
        width = np.array([sm.stage_median[(a, st)] for a in sm.arms])
        ax.barh(y, width, left=left, color=colormaps["tab10"](k), label=st)
        left += width
    ax.set_yticks(y, sm.arms, fontsize=7)
    ax.set_xlabel("seconds (median over seeds x iterations)")
    ax.set_title("wall time per iteration, by stage (with its probe)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=5)
    return png(fig)
