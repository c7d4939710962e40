"""report.md of the methods benchmark, with its plots, its copied grids and figures.json beside
it (`write_report`), all from a `Summary` and the `Results` read off the store. Its section on
what earlier runs found is read from reports/bench-methods-history.md (`what_was_tried`)."""

from __future__ import annotations

import json
from pathlib import Path

from cast_core.csg.graph import ATOM_TYPES
from methods.arms import BASELINE, RECAST_PAIRS
from methods.figures import figures, figures_text, hacking_figures
from methods.plots import plot_gains, plot_learning_curves, plot_times, plot_type_curves
from methods.protocols import FINAL_SPLITS, METRICS, run_name
from methods.store_reads import Results
from methods.summary import RecastSummary, Summary, one_change
from methods.tables import (
    checkpoint_table,
    curve_table,
    diagnostics_table,
    efficiency_table,
    fmt,
    gains_table,
    hf_table,
    interval_cell,
    one_change_table,
    per_step_table,
    seed_gain_table,
    time_table,
    type_gain_table,
)
from tasks.reporting.markdown import table

HISTORY = Path(__file__).resolve().parents[2] / "reports" / "bench-methods-history.md"
TRIED_HEADING = "## What was tried"


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
    arm_rows = [[a.name, f"`{a.recipe}`", ", ".join(f"{k}={v}" for k, v in
                                                   {**a.overrides, **a.fixed}.items())
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
    from tasks.store.files import atomic_write_bytes

    store, prefix, last = setup["store"], setup["prefix"], setup["size"].iterations - 1
    entries = figures(sm, setup) + hacking_figures(sm, res, prefix, last)
    grid_lines, copies = _grids(sm, res, prefix, last)
    recast_lines = []
    if rs is not None:
        recast_lines, more = recast_section(rs, store, out, setup["recast"])
        copies |= more
    provenance = (
        f"Generated by `{setup['command'] or 'methods.benchmark.run_benchmark'}` from store "
        f"`{store.root}` (runs `{prefix}-<arm>-s<seed>`, base `{prefix}-base`); every number is "
        f"read from that store's `evals`, `stages`, `windows` and `train_steps` tables and the "
        f"evaluate stage's per-image score blobs. This invocation took "
        f"{setup['wall_s'] / 60:.1f} min ({setup['skipped']} stages skipped as already done).")
    if setup.get("aliases"):
        provenance += (" Runs read under another name (`--runs-as`, checked against each run's "
                       "pinned recipe): " + ", ".join(f"{a} as `{prefix}-{s}-s<seed>`"
                                                      for a, s in setup["aliases"].items()) + ".")
    types_png = plot_type_curves(sm)
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
          *([TYPE_CURVES_TEXT, "", "![probe per atom type](type_curves.png)", ""]
            if types_png is not None else []),
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
          "", *([PER_STEP_TEXT, "", steps, ""] if (steps := per_step_table(res, sm, prefix))
                else []),
          *(["## One change at a time", "", ONE_CHANGE_TEXT, "", one_change_table(sm), ""]
            if one_change(sm, sm.arms) else []),
          *recast_lines, what_was_tried(), "## Query the store", "", "```sql",
          QUERY.format(prefix=prefix), "```", ""]
    pngs = {"gains.png": plot_gains(sm), "learning_curves.png": plot_learning_curves(sm),
            "stage_times.png": plot_times(sm),
            **({"type_curves.png": types_png} if types_png is not None else {})}
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
TYPE_CURVES_TEXT = (
    "The same probe per atom type (the evaluate stage's `atom_type` rows): which kinds of atom "
    "the policy learns, and which stay where the base left them.")
EFFICIENCY_TEXT = (
    "Threshold: {baseline}'s final probe mean atom score, mean over seeds ({threshold}). Samples "
    "each seed's probe curve needs to first reach it (linear between checkpoints), and the ratio "
    "of the mean curves' crossings:")
HACKING_TEXT = (
    "Mean high-frequency energy of the final evaluation's images (noise or stripes that fool the "
    "verifier raise it); their diversity, the mean over prompts of the mean pairwise (1 - cosine) "
    "between the layout embeddings of one prompt's images (a policy that draws one image for "
    "every noise lowers it, which the hf energy need not show); and the grids of seed 0 (first "
    "64 images: one row per prompt):")
TIMING_TEXT = (
    "Body seconds of each stage (`stages` table), medians over seeds x iterations; iteration = "
    "its stages summed, ReCAST gains included where an arm estimates them; minutes per run = "
    "every stage of the run, probes and final evaluation included. Other processes on the "
    "machine slow arms unevenly: compare ratios.")
ONE_CHANGE_TEXT = (
    "Each row changes one thing: the per-seed difference of the two arms' gains over base (same "
    "prompts and noise per seed, so paired), mean over seeds with a 95% t-interval. An interval "
    "that contains 0 means this benchmark cannot tell the change from seed noise. The last "
    "column is the ratio of the two arms' mean-score gains (arm over reference), with a paired "
    "bootstrap over seeds: none where the reference's mean gain is <= 0.")
DIAGNOSTICS_TEXT = (
    "From `train_steps`, per optimizer step, mean over each run's steps, then over seeds "
    "(columns this store lacks are left out): the fraction of clipped ratios; ratio k3, the k3 "
    "of the loss's own ratio (mean of (r - 1) - log r; not a KL per sample; stores written "
    "before the rename call it approx_kl); policy KL, the KL from the rollout's policy to the "
    "trained one per sample and window step in nats; ref KL, the KL to the base model in nats "
    "(only with kl_beta > 0); the std of the ratios; the grad norm before clipping; the fraction "
    "of groups with zero variance. Ratios are per position for the atom arms and all-dims for "
    "Flow-GRPO, so compare ratio columns within a kind; the KLs in nats compare across kinds.")
PER_STEP_TEXT = (
    "Per window step, from `checkpoints` (update_kl_per_step, update_velocity_per_step, "
    "step_weights): the KL each step moved an iteration, replayed after training, in nats a "
    "sample (a later step has a smaller noise std, so the same change of the velocity moves it "
    "further), the change of the velocity that KL implies (RMS a latent dim, "
    "`cast_core.update_kl.velocity_change`), and the loss weight each "
    "step trained with under `train.kl_target_per_step` (which weights the steps towards equal "
    "KLs):")
QUERY = """-- probe curve by arm, seed and iteration (the base: arm 'base', iteration -1)
SELECT coalesce(nullif(regexp_extract(run_id, '^{prefix}-(.+)-s[0-9]+$', 1), ''), 'base') AS arm,
       regexp_extract(run_id, '-s([0-9]+)$', 1) AS seed, iteration, split, strict_accuracy,
       mean_score
FROM evals WHERE group_kind = 'overall' AND starts_with(run_id, '{prefix}-')
ORDER BY ALL;"""


def what_was_tried(path: Path = HISTORY) -> str:
    """The history file's section "## What was tried ...", from its heading to the next heading
    (or the end), ending in one newline: what earlier runs of this benchmark found, so that every
    regenerated report carries it."""
    text = path.read_text(encoding="utf-8")
    start = text.find("\n" + TRIED_HEADING)
    if start < 0:
        raise ValueError(f"{path} has no section starting {TRIED_HEADING!r}; the report copies "
                         f"that section, so restore its heading")
    end = text.find("\n## ", start + 1)
    return text[start + 1:None if end < 0 else end].rstrip("\n") + "\n"
