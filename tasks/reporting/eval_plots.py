"""The plots of the evaluation report (`tasks.reporting.eval_report`), each from rows its queries
returned (and, for the rollouts, the blobs those rows name) to PNG bytes: accuracy by iteration,
atom accuracy by type, the calibration curve with its window, the training diagnostics, and one
prompt's samples with each atom's heatmap and the advantage map. Nothing here reads the store.
"""

from __future__ import annotations

import textwrap

import numpy as np
import torch

from tasks.stages.plots import figure, png


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _integer_ticks(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def accuracy_plot(rows: list[dict]) -> bytes:
    fig = figure(6.5, 3.5)
    ax = fig.add_subplot()
    for i, split in enumerate(sorted({r["split"] for r in rows})):
        mine = [r for r in rows if r["split"] == split]
        its = [r["iteration"] for r in mine]
        ax.plot(its, [r["strict_accuracy"] for r in mine], "o-", color=f"C{i}",
                label=f"{split}: strict accuracy")
        ax.plot(its, [r["mean_score"] for r in mine], "s--", color=f"C{i}",
                label=f"{split}: mean atom score")
    ax.set_xlabel("iteration (-1 = base model)")
    _integer_ticks(ax)
    ax.set_ylim(-0.02, 1.02)
    _legend(ax)
    return png(fig)


def atom_type_plot(rows: list[dict], first: int, last: int) -> bytes:
    splits = sorted({r["split"] for r in rows})
    fig = figure(3.5 * len(splits), 3.2)
    for s, split in enumerate(splits):
        ax = fig.add_subplot(1, len(splits), s + 1)
        types = sorted({r["group_name"] for r in rows if r["split"] == split})
        value = {(r["iteration"], r["group_name"]): r["atom_accuracy"] for r in rows
                 if r["split"] == split}
        for j, it in enumerate(sorted({first, last})):
            x = np.arange(len(types)) + (0.4 * j if first != last else 0.2)
            ax.bar(x, [value.get((it, t), 0.0) for t in types], width=0.4, label=f"iteration {it}")
        ax.set_xticks(np.arange(len(types)) + 0.2, types, fontsize=8)
        ax.set_ylim(0, 1)
        ax.set_title(f"{split}: atom accuracy", fontsize=9)
        _legend(ax)
    return png(fig)


def calibration_plot(curve: list[dict], window: dict) -> bytes:
    from cast_core.calibration import Calibration
    from cast_core.window import FormationPoint, SdeWindow
    from tasks.stages.plots import plot_calibration

    mean = torch.tensor([r["similarity_mean"] for r in curve], dtype=torch.float64)
    std = torch.tensor([r["similarity_std"] for r in curve], dtype=torch.float64)
    point = FormationPoint(window["formation_step"], window["method"], mean, torch.zeros_like(mean))
    calibration = Calibration(point, SdeWindow(window["window_start"], window["window_end"]),
                              mean, std)
    sigmas = torch.tensor([r["sigma"] for r in curve], dtype=torch.float64)
    return plot_calibration(calibration, sigmas, f"{window['backbone_id']}: window calibration")


def diagnostics_plot(diag: list[dict], per_step: list[dict], accuracy: list[dict]) -> bytes:
    fig = figure(12, 6)
    its = [d["iteration"] for d in diag]
    alarms = [d["iteration"] for d in diag if d["alarm"]]
    axes = [fig.add_subplot(2, 3, i + 1) for i in range(6)]
    for ax, field, title in ((axes[0], "clip_fraction", "clip fraction per window step"),
                             (axes[1], "ratio_mean", "ratio mean per window step")):
        for k in sorted({r["k"] for r in per_step}):
            mine = [r for r in per_step if r["k"] == k]
            ax.plot([r["iteration"] for r in mine], [r[field] for r in mine], "o-",
                    label=f"k = {k}")
        ax.set_title(title, fontsize=9)
        _legend(ax)
    for ax, field, title in ((axes[2], "param_change_norm", "LoRA change norm"),
                             (axes[4], "zero_variance_fraction", "zero-variance atom groups"),
                             (axes[5], "loss", "mean loss")):
        ax.plot(its, [d[field] for d in diag], "o-")
        ax.set_title(title, fontsize=9)
    axes[3].plot(its, [d["rollout_hf_energy"] for d in diag], "o-", label="rollouts")
    for split in sorted({r["split"] for r in accuracy}):
        mine = [r for r in accuracy if r["split"] == split]
        axes[3].plot([r["iteration"] for r in mine], [r["hf_energy"] for r in mine], "s--",
                     label=f"eval {split}")
    axes[3].set_title("high-frequency energy", fontsize=9)
    _legend(axes[3])
    if alarms:
        fig.suptitle("red lines: iterations with a constant-reward alarm", fontsize=9)
    for ax in axes:
        for it in alarms:
            ax.axvline(it, color="tab:red", alpha=0.3)
        ax.set_xlabel("iteration", fontsize=8)
        _integer_ticks(ax)
    return png(fig)


def rollout_plot(prompt: str, samples: list[dict], atoms: list[dict], maps: torch.Tensor,
                 images: torch.Tensor) -> bytes:
    """Rows: samples; columns: the image, each atom's heatmap over it, the advantage map. samples:
    SAMPLES_SQL rows, atoms: ATOMS_SQL rows; maps [N, h, w] and uint8 images [N, 3, H, W]: the
    blobs the samples' rows name (row `map_index`, `blob_index`)."""
    ids = list(dict.fromkeys(a["atom_id"] for a in atoms))
    cell = {(a["atom_id"], a["sample_index"]): a for a in atoms}
    limit = max(float(maps[s["map_index"]].abs().max()) for s in samples) or 1.0
    cols = len(ids) + 2
    fig = figure(1.5 * cols, 1.6 * len(samples) + 0.8)
    for row, s in enumerate(samples):
        image = images[s["blob_index"]].permute(1, 2, 0).numpy()  # [H, W, 3]
        extent = (0, image.shape[1], image.shape[0], 0)
        for col in range(cols):
            ax = fig.add_subplot(len(samples), cols, row * cols + col + 1)
            ax.imshow(image, extent=extent, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if col == 0:
                ax.set_ylabel(f"g={s['sample_index']}\nR={s['reward']:.2f}", fontsize=7)
                title = "image"
            elif col <= len(ids):
                a = cell[(ids[col - 1], s["sample_index"])]
                heat = np.asarray(a["heatmap"], dtype=np.float32).reshape(a["heatmap_h"],
                                                                          a["heatmap_w"])
                ax.imshow(heat / max(float(heat.max()), 1e-12), extent=extent, cmap="magma",
                          alpha=0.6, vmin=0, vmax=1, interpolation="nearest")
                ax.set_xlabel(f"s={a['score']:.2f} A={a['advantage']:+.2f}", fontsize=7)
                title = "\n".join(textwrap.wrap(f"{a['type']}: {a['question']}", 22)[:3])
            else:
                ax.imshow(maps[s["map_index"]].numpy(), extent=extent, cmap="coolwarm",
                          vmin=-limit, vmax=limit, alpha=0.7, interpolation="nearest")
                ax.set_xlabel(f"mass={s['mass']:.2f}", fontsize=7)
                title = "advantage map"
            if row == 0:
                ax.set_title(title, fontsize=6)
    fig.suptitle(prompt, fontsize=9)
    return png(fig)
