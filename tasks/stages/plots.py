"""Plots of cast_core results for a person to look at, as PNG bytes (matplotlib's Agg canvas
directly: no pyplot state, no file). The stages store them as blobs and the reports show them.

- `figure` and `png`: a figure on its own Agg canvas, and its PNG bytes; every plot of the
  repository (stages, reports, benchmarks) is drawn with these two;
- `plot_calibration`: the window calibration's mean similarity curve (`cast_core.calibration`);
- `plot_recast_gains`: ReCAST's normalised gains and Sinkhorn plan (`cast_core.recast_gains`).

Matplotlib is imported inside each function, so importing this module costs nothing.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from cast_core.calibration import Calibration
    from cast_core.recast_gains import RecastGains


def figure(width: float, height: float, dpi: int = 90):
    """A matplotlib Figure of `width` x `height` inches on its own Agg canvas (no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def png(fig, rect: tuple[float, float, float, float] | None = None) -> bytes:
    """PNG bytes of `fig` after a tight layout, inside `rect` (left, bottom, right, top, in figure
    fractions) when given, else the whole figure."""
    if rect is None:
        fig.tight_layout()
    else:
        fig.tight_layout(rect=rect)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def plot_calibration(calibration: Calibration, sigmas: Tensor, title: str) -> bytes:
    """PNG bytes of the mean curve with a ±std band, the formation step and the window shaded.

    sigmas: [S] (``SimilarityCurves.sigmas``) or the schedule [S + 1]; the top axis labels step k
    with t_k. Uses matplotlib's Agg canvas directly (no pyplot state, no file).
    """
    from matplotlib.ticker import MaxNLocator

    mean = calibration.mean_curve.double().numpy()
    std = calibration.std_curve.double().numpy()
    steps = np.arange(len(mean))
    t = torch.as_tensor(sigmas, dtype=torch.float64).numpy()
    if len(t) not in (len(mean), len(mean) + 1):
        raise ValueError(f"sigmas must have {len(mean)} or {len(mean) + 1} entries; got {len(t)}")
    point, window = calibration.formation, calibration.window
    fig = figure(7.0, 4.0, dpi=100)
    ax = fig.add_subplot()
    ax.axvspan(window.start - 0.5, window.end - 0.5, color="tab:orange", alpha=0.2,
               label=f"SDE window [{window.start}, {window.end})")
    ax.fill_between(steps, mean - std, mean + std, color="tab:blue", alpha=0.25,
                    label="± std over prompts")
    ax.plot(steps, mean, color="tab:blue", marker="o", markersize=3, label="mean similarity")
    ax.axvline(point.step, color="tab:red", linestyle="--",
               label=f"formation step {point.step} ({point.method_used})")
    ax.set_xlim(-0.5, len(mean) - 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("denoising step k")
    ax.set_ylabel("cos(e(x0_hat_k), e(x_final))")
    ax.legend(loc="lower right", fontsize=8)
    top = ax.twiny()
    top.set_xlim(ax.get_xlim())
    ticks = np.unique(np.linspace(0, len(mean) - 1, min(len(mean), 6)).round().astype(int))
    top.set_xticks(ticks)
    top.set_xticklabels([f"{t[k]:.2f}" for k in ticks])
    top.set_xlabel("sigma t_k")
    fig.suptitle(title)
    return png(fig)


def plot_recast_gains(result: RecastGains, title: str) -> bytes:
    """PNG bytes: heatmaps of the normalised gains and of W (rewards x steps, sigma on the x
    ticks), each cell annotated. Matplotlib's Agg canvas directly (no pyplot state, no file)."""
    S = result.sigmas.shape[0]
    fig = figure(4.0 + 1.4 * S, 1.6 + 0.5 * len(result.rewards), dpi=100)
    panels = ((result.normalised, "normalised gain g~[k, t]", "{:.2f}"),
              (result.W, "Sinkhorn plan W[k, t]", "{:.3f}"))
    for i, (values, label, fmt) in enumerate(panels):
        ax = fig.add_subplot(1, 2, i + 1)
        grid = values.double().numpy()
        image = ax.imshow(grid, cmap="viridis", aspect="auto")
        for (r, c), value in np.ndenumerate(grid):
            ax.text(c, r, fmt.format(value), ha="center", va="center", fontsize=7,
                    color="white" if value < grid.mean() else "black")
        ax.set_xticks(range(S), [f"{float(t):.2f}" for t in result.sigmas], fontsize=7)
        ax.set_yticks(range(len(result.rewards)), result.rewards)
        ax.set_xlabel("sigma t (step 0 = noise)")
        ax.set_title(label, fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.04)
    fig.suptitle(f"{title} (alpha={result.alpha:g}, tau={result.tau:g})", fontsize=10)
    return png(fig)
