"""Benchmark: CAST against Flow-GRPO on the shapes world, at equal budget, with two ablations.

    .venv/bin/python benchmarks/bench_methods.py [--quick] [--suite all|methods] [--store DIR]
        [--report-dir DIR] [--seeds N] [--iterations N] [--threads N] [--arms A,B] [--lr LR]

Run it from the repository root. Arms (every one from the committed base model):
- flowgrpo: data/recipes/shapes-flowgrpo.toml (scalar reward = mean atom score, group z-score;
  hand-set fixed window, steps [0, 3); all-dims clip range 1e-3);
- cast: data/recipes/shapes-cast.toml (calibrated window; atom z-scores projected through the
  verifier's heatmaps; per-position clip range);
- cast-fixed-window: cast with the flowgrpo recipe's `[window]` section;
- cast-no-map: cast with `advantage.kind = "atom"`: the same gated atom z-scores, but each
  sample's map is the constant mean of them (atom-level credit, no pixel projection);
- cast-late-window: cast with a fixed window at steps [6, 9) (`LATE_WINDOW`), where the atom types
  become decidable on the base model (ReCAST's gains), added after the first full run showed the
  calibrated window landing on Flow-GRPO's [0, 3).
With `--suite all` (the default), the fixes the issue asks to try when CAST does not win, each
one change to the cast arm (`FIXES`): cast-no-global (`advantage.global_weight = 0`),
cast-std-floor (atom group std floored at 0.1, so near-tied atoms get small advantages instead of
unit-variance noise), cast-tight-clip (per-position clip range 0.01), cast-peak-norm (heatmaps
scaled to peak 1 instead of mean 1, `advantage.heatmap_norm`); two arms that split Flow-GRPO
from CAST one change at a time (`ONE_CHANGE`, the report's "One change at a time" table of paired
differences): flowgrpo-calibrated (the scalar reward with CAST's calibrated window) and
cast-no-map-fixed-window (atom advantages with a constant map in Flow-GRPO's window); and the
ReCAST comparison (issue 7; rewards = atom types):
- recast-equal: cast with `recast.weighting = "recast"` at equal budgets (its static counterpart
  is cast itself: static weights at equal budgets are 1, CAST's map);
- static-skewed / recast-skewed: static and ReCAST weighting at budgets `SKEWED` (count and
  relation, the base's weakest atom types, count double).
Equal budget: every arm runs the same iterations with the same seed list (`run.seed` = s), so it
draws the same train prompts at each iteration and starts each iteration's rollouts from the same
noise seeds; prompts, group size, sampler, LoRA and optimizer settings are equal (checked, see
`check_equal_budget`); only the advantage, the window and the clip range (Flow-GRPO's all-dims
ratio needs its own) differ, as the recipes say.

Protocol. Stages are called as functions (no Prefect server) on one store: each arm x seed is its
own run `<prefix>-<arm>-s<seed>` (prefix `bench`, `quick` with --quick); checkpoints are evaluated
every `eval_every` iterations and at the last one. The base model (iteration -1) is evaluated once,
as run `<prefix>-base`: it is the same for every arm (same weights, eval prompts and noise seeds,
which come from the prompt text; the eval spec hashes are checked equal). Eval prompts: an evenly
spaced subset of each split file (`eval_prompts` lines, stored as a blob), because the files are
grouped by tag and `eval.max_prompts` (the first N) would keep only the first tags.
Re-running on the same store resumes: finished stages are skipped (their recorded times stay).
Keep one benchmark size per store. Query it like any store, e.g. strict accuracy by arm:

    .venv/bin/cast sql --root runs/bench-methods "SELECT regexp_extract(run_id,
        '^bench-(.+)-s[0-9]+$', 1) AS arm, iteration, split, avg(strict_accuracy)
        FROM evals WHERE group_kind = 'overall' GROUP BY ALL ORDER BY ALL"

Statistics, from the store (DuckDB over `evals` and `stages`; arm and seed parsed from run_id):
improvement = metric of the last checkpoint - metric of the base, per arm, seed, split, for strict
accuracy and mean atom score. Mean over seeds with a 95% Student t-interval over seeds
(mean +- t_{0.975, n-1} s / sqrt(n); none with one seed). The base is one fixed evaluation, so the
interval is over training seeds only (the eval's prompts and noise are fixed). The ratio
improvement(arm) / improvement(flowgrpo) has a 95% percentile interval from a bootstrap over seeds,
paired (one resample of seed indices for both arms, since seed s shares prompts and noise), 10000
draws, fixed seed; no ratio when Flow-GRPO's mean improvement is <= 0, and no interval when more
than 2.5% of draws have a denominator <= 0 (the interval is unbounded) or with one seed. Time: the
body seconds of each stage from the `stages` table (the same records train_steps.
stage_seconds_json is made from, which lacks train_epoch itself); iteration = rollout +
score_atoms + compute_advantages + train_epoch; medians over seeds x iterations; ratio = median
CAST / median Flow-GRPO.

Full-mode size (the default): 14 arms x 3 seeds x 4 iterations of the default recipes (16 prompts
x 8 samples), evaluated at the last iteration on 64 prompts per split x 2 images (256 images per
checkpoint). Measured on this 2-core machine (2026-12-03, lr 3e-3): 74.5 min for the first 12 arms
(a one-thread probe beside it for ~25 min of it) and 13.0 min for the two one-change arms (a test
beside it for 5 min); the stages' bodies sum to 85.6 min; medians 16-18 s per iteration (rollout
8-9, training 7-8), ReCAST gains ~6 s per estimate, 17-20 s per evaluated checkpoint. On a quiet
machine expect about 65-75 min. `--iterations 12 --arms flowgrpo,cast` took 27 min.
`--suite methods` runs the first five arms only; `--arms flowgrpo,cast` any subset that
includes flowgrpo; `--lr X` replaces every arm's learning rate (a probe: use its own `--store`,
since run names do not carry the lr).
--quick: 2 seeds x 2 iterations, 4 prompts x 4 samples, 6 eval prompts per split x 2 images at
every iteration, the recipes' calibration (16 prompts; with fewer it can land on Flow-GRPO's
window, which makes cast and cast-fixed-window the same run): a smoke check of ~5 minutes.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

FLOWGRPO_RECIPE = "data/recipes/shapes-flowgrpo.toml"
CAST_RECIPE = "data/recipes/shapes-cast.toml"
BASELINE = "flowgrpo"
SPLITS = ("hard", "eval")
METRICS = (("strict_accuracy", "strict accuracy"), ("mean_score", "mean atom score"))
ITERATION_STAGES = ("rollout", "score_atoms", "compute_advantages", "train_epoch")
SAME_SECTIONS = ("backbone", "scorer", "builder", "prompts", "sampling", "eval")
SAME_TRAIN = ("lr", "lora_rank", "lora_alpha", "kl_beta", "inner_epochs", "micro_batch",
              "max_grad_norm", "weight_decay")
SUITES = ("methods", "all")
# Issue 7's second budget: the two weakest atom types of the base (count, relation) count double.
SKEWED = {"object": 1.0, "count": 2.0, "attribute": 1.0, "relation": 2.0}
# Window ablation: the steps where the atom types become decidable on the base model (ReCAST's
# gains peak at sigma 0.4-0.2, i.e. steps 6-8 of 10), instead of the calibrated [0, 3) / [1, 4).
LATE_WINDOW = {"window.mode": "fixed", "window.start": 6, "window.size": 3}
# Fixes the issue asks to try when CAST does not win (each one change to the cast arm).
FIXES = (("cast-no-global", {"advantage.global_weight": 0.0},
          "cast without the global term (pixels no atom covers get no credit)"),
         ("cast-std-floor", {"advantage.std_floor": 0.1},
          "cast with atom group std floored at 0.1 (near-tied atoms get small advantages)"),
         ("cast-tight-clip", {"train.clip_range": 0.01},
          "cast with per-position clip range 0.01 instead of 0.032"),
         ("cast-peak-norm", {"advantage.heatmap_norm": "peak"},
          "cast with heatmaps scaled to peak 1, not mean 1 (no A / area on small objects)"))
# ReCAST comparisons: (ReCAST arm, the static arm at the same budgets).
RECAST_PAIRS = (("recast-equal", "cast"), ("recast-skewed", "static-skewed"))
# One change at a time: (arm, reference arm, what the arm changes). Each row of the report's
# "One change at a time" table is the per-seed difference arm - reference (paired: same prompts
# and noise per seed); pairs whose arms were not run are left out.
ONE_CHANGE = (
    ("flowgrpo-calibrated", "flowgrpo", "window: calibrated, not hand-set (scalar reward)"),
    ("cast", "cast-fixed-window", "window: calibrated, not hand-set (atom maps)"),
    ("cast-late-window", "cast-fixed-window", "window: fixed [6, 9), not [0, 3) (atom maps)"),
    ("cast-no-map-fixed-window", "flowgrpo",
     ("advantage: atom z-scores (constant map, per-position ratio) instead of the scalar reward "
     "(hand-set window)")),
    ("cast-no-map", "flowgrpo-calibrated",
     "advantage: atom z-scores instead of the scalar reward (calibrated window)"),
    ("cast-fixed-window", "cast-no-map-fixed-window",
     "map: heatmap projection instead of a constant map (hand-set window)"),
    ("cast", "cast-no-map", ("map: heatmap projection instead of a constant map (calibrated "
     "window)")),
    *((name, "cast", about.removeprefix("cast ")) for name, _, about in FIXES),
    ("cast", "flowgrpo", "all of CAST at once (the headline comparison)"),
)
ATOM_TYPES = ("object", "count", "attribute", "relation")


@dataclass(frozen=True)
class Arm:
    """One method: a committed recipe plus overrides."""

    name: str
    recipe: str
    overrides: dict
    about: str


@dataclass(frozen=True)
class Size:
    """How big a benchmark is; None keeps the recipe's value."""

    iterations: int
    seeds: int
    eval_prompts: int
    images_per_prompt: int
    eval_every: int
    per_iteration: int | None = None
    group_size: int | None = None
    calibration_prompts: int | None = None

    def __post_init__(self) -> None:
        if min(self.iterations, self.seeds, self.eval_prompts, self.images_per_prompt,
               self.eval_every) < 1:
            raise ValueError(f"every size must be >= 1: {self}")

    def eval_at(self) -> tuple[int, ...]:
        """Evaluated iterations: every `eval_every`-th and the last."""
        every = range(self.eval_every - 1, self.iterations, self.eval_every)
        return tuple(sorted({*every, self.iterations - 1}))


FULL = Size(iterations=4, seeds=3, eval_prompts=64, images_per_prompt=2, eval_every=4)
QUICK = Size(iterations=2, seeds=2, eval_prompts=6, images_per_prompt=2, eval_every=1,
             per_iteration=4, group_size=4)


# ---- statistics ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Interval:
    """mean of n values with a two-sided interval [low, high] (None when n < 2)."""

    mean: float
    low: float | None
    high: float | None
    n: int


@dataclass(frozen=True)
class Ratio:
    """A ratio of mean improvements with its bootstrap interval; `note` says why one is None."""

    value: float | None
    low: float | None
    high: float | None
    n: int
    note: str


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile for p in (0.5, 1): bisection on the CDF, 0.5 + the integral of the
    density from 0 (Simpson's rule, 4000 intervals); |error| < 1e-6 for df >= 1, p <= 0.999."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"need 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float) -> float:
        u = np.linspace(0.0, x, 4001)
        f = np.exp(log_c - (df + 1) / 2 * np.log1p(u * u / df))
        return 0.5 + (u[1] - u[0]) / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def t_interval(values: list[float], level: float = 0.95) -> Interval:
    """mean +- t_{(1+level)/2, n-1} * s / sqrt(n) (s with n - 1); no interval for n < 2."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("t_interval needs at least one value")
    mean = float(x.mean())
    if x.size < 2:
        return Interval(mean, None, None, 1)
    half = t_quantile((1 + level) / 2, x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return Interval(mean, mean - half, mean + half, int(x.size))


def ratio_bootstrap(numerator: list[float], denominator: list[float], draws: int = 10000,
                    seed: int = 0, level: float = 0.95) -> Ratio:
    """mean(numerator) / mean(denominator) with a paired percentile bootstrap over the n seeds
    (module docstring); draws whose denominator mean is <= 0 count as +-infinity."""
    num, den = np.asarray(numerator, np.float64), np.asarray(denominator, np.float64)
    if num.shape != den.shape or num.ndim != 1 or num.size == 0:
        raise ValueError(f"need two equal, non-empty lists (paired by seed): got {num.shape}, "
                         f"{den.shape}")
    n, tail = int(num.size), (1 - level) / 2
    if den.mean() <= 0:
        return Ratio(None, None, None, n, "Flow-GRPO's mean improvement is <= 0: no ratio")
    value = float(num.mean() / den.mean())
    if n < 2:
        return Ratio(value, None, None, n, "one seed: no interval")
    idx = np.random.default_rng(seed).integers(0, n, size=(draws, n))  # [draws, n]
    d, m = den[idx].mean(axis=1), num[idx].mean(axis=1)
    if (d <= 0).mean() > tail:
        return Ratio(value, None, None, n, f"{(d <= 0).mean():.1%} of draws have a denominator "
                     f"<= 0: the interval is unbounded")
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(d > 0, m / d, np.copysign(np.inf, m))
    low, high = np.quantile(r, [tail, 1 - tail], method="inverted_cdf")
    return Ratio(value, float(low), float(high), n, "")


# ---- recipes and runs ---------------------------------------------------------------------


def arms(suite: str = "all") -> tuple[Arm, ...]:
    """The five method arms, plus with suite "all" the four fix arms (`FIXES`), the two arms
    that split Flow-GRPO from CAST one change at a time (`ONE_CHANGE`) and the three ReCAST arms;
    the fixed-window arms take the flowgrpo recipe's window section."""
    from tasks.recipe import load_recipe

    if suite not in SUITES:
        raise ValueError(f"suite must be one of {SUITES}; got {suite!r}")
    w = load_recipe(FLOWGRPO_RECIPE).window
    fixed = {"window.mode": w.mode, "window.start": w.start, "window.size": w.size}
    methods = (Arm("flowgrpo", FLOWGRPO_RECIPE, {}, "scalar reward, hand-set window"),
               Arm("cast", CAST_RECIPE, {}, "atom maps, calibrated window (= static weighting "
                   "at equal budgets)"),
               Arm("cast-fixed-window", CAST_RECIPE, fixed, "atom maps, Flow-GRPO's window"),
               Arm("cast-no-map", CAST_RECIPE, {"advantage.kind": "atom"},
                   "atom advantages, constant map, calibrated window"),
               Arm("cast-late-window", CAST_RECIPE, LATE_WINDOW,
                   "atom maps, fixed late window (sigma 0.4-0.2, where ReCAST's gains peak)"))
    if suite == "methods":
        return methods
    fixes = tuple(Arm(name, CAST_RECIPE, overrides, about) for name, overrides, about in FIXES)
    split = (Arm("flowgrpo-calibrated", FLOWGRPO_RECIPE, {"window.mode": "calibrated"},
                 "scalar reward, calibrated window (CAST's window on Flow-GRPO)"),
             Arm("cast-no-map-fixed-window", CAST_RECIPE, {"advantage.kind": "atom", **fixed},
                 "atom advantages, constant map, Flow-GRPO's window"))
    return (*methods, *fixes, *split,
            Arm("recast-equal", CAST_RECIPE, {"recast.weighting": "recast"},
                "cast + ReCAST step weights, equal budgets"),
            Arm("static-skewed", CAST_RECIPE, {"recast.weighting": "static",
                                               "recast.budgets": SKEWED},
                "cast + static type weights, budgets " + _budgets_text(SKEWED)),
            Arm("recast-skewed", CAST_RECIPE, {"recast.weighting": "recast",
                                               "recast.budgets": SKEWED},
                "cast + ReCAST step weights, budgets " + _budgets_text(SKEWED)))


def _budgets_text(budgets: dict[str, float]) -> str:
    return "/".join(f"{k} {v:g}" for k, v in budgets.items())


def run_name(prefix: str, arm: str, seed: int) -> str:
    return f"{prefix}-{arm}-s{seed}"


def eval_subsets(store, size: Size) -> dict[str, str]:
    """{split: path of an evenly spaced `eval_prompts`-line subset}, stored as blobs."""
    from tasks.recipe import load_recipe

    out = {}
    for split, path in sorted(load_recipe(CAST_RECIPE).eval.splits.items()):
        lines = [x for x in Path(path).read_text().splitlines() if x.strip()]
        keep = np.unique(np.linspace(0, len(lines) - 1, min(size.eval_prompts, len(lines)))
                         .round().astype(int))
        blob = store.put_blob("".join(lines[i] + "\n" for i in keep).encode(), "jsonl")
        out[split] = str(store.resolve(blob.path))
    return out


def recipe_for(arm: Arm, seed: int, size: Size, splits: dict[str, str], name: str,
               threads: int | None, lr: float | None = None):
    """The arm's recipe at this size and seed, run `name`, evaluated on `splits` (`lr`, when
    given, replaces every arm's learning rate)."""
    from tasks.recipe import load_recipe

    sized = {"prompts.per_iteration": size.per_iteration, "prompts.group_size": size.group_size,
             "window.calibration_prompts": size.calibration_prompts, "run.threads": threads,
             "train.lr": lr}
    return load_recipe(arm.recipe, {
        **arm.overrides, **{k: v for k, v in sized.items() if v is not None},
        "run.name": name, "run.seed": seed, "eval.splits": splits,
        "eval.images_per_prompt": size.images_per_prompt, "eval.max_prompts": None})


def check_equal_budget(recipes: list) -> None:
    """Raise unless the recipes share seed, prompts, sampler, eval, models, window size and the
    train settings other than the clip range."""
    def budget(r) -> dict:
        dump = r.model_dump(mode="json")
        return {"seed": r.run.seed, "window_size": r.window.size,
                **{s: dump[s] for s in SAME_SECTIONS},
                **{f"train.{f}": dump["train"][f] for f in SAME_TRAIN}}

    first = budget(recipes[0])
    for r in recipes[1:]:
        diff = [k for k, v in budget(r).items() if v != first[k]]
        if diff:
            raise ValueError(f"arms {recipes[0].run.name} and {r.run.name} differ in {diff}: "
                             f"the comparison would not be at equal budget")


def train_run(store, recipe, size: Size) -> int:
    """Run-level stages, the iterations and their evaluations -> stages that were skipped."""
    from tasks.build_csgs import build_csgs
    from tasks.calibrate_window import calibrate_window
    from tasks.compute_advantages import compute_advantages
    from tasks.evaluate_checkpoint import evaluate_checkpoint
    from tasks.recast_gains import gains_for_training
    from tasks.rollout_groups import rollout_groups
    from tasks.score_atoms import score_atoms
    from tasks.train_epoch import train_epoch

    csgs, window = build_csgs(store, recipe), calibrate_window(store, recipe)
    refs = [csgs, window]
    for k in range(size.iterations):
        ro = rollout_groups(store, recipe, csgs, window, k)
        sc = score_atoms(store, recipe, csgs, ro, k)
        ad = compute_advantages(store, recipe, ro, sc, k)
        gains = (gains_for_training(store, recipe, k) if recipe.recast.weighting == "recast"
                 else None)
        refs += [ro, sc, ad, train_epoch(store, recipe, csgs, ro, sc, ad, k, gains)]
        line = f"{recipe.run.name} iteration {k}: {sum(r.seconds for r in refs[-4:]):.1f} s"
        if gains is not None:
            refs.append(gains)
            line += f" + ReCAST gains {gains.seconds:.1f} s"
        if k in size.eval_at():
            refs.append(evaluate_checkpoint(store, recipe, k))
            line += f", eval {refs[-1].seconds:.1f} s"
        print(line, flush=True)
    return sum(r.skipped for r in refs)


# ---- results from the store ---------------------------------------------------------------

EVALS_SQL = """
SELECT run_id, iteration, split, strict_accuracy, mean_score
FROM evals WHERE group_kind = 'overall' AND list_contains($runs, run_id)
ORDER BY run_id, iteration, split"""
STAGES_SQL = """
SELECT run_id, iteration, stage,
       arg_max(epoch(finished_at) - epoch(started_at), finished_at) AS seconds
FROM stages WHERE list_contains($runs, run_id) GROUP BY ALL ORDER BY ALL"""
WINDOWS_SQL = """
SELECT run_id, method, window_start, window_end FROM windows WHERE list_contains($runs, run_id)"""


QUERY = """-- strict accuracy and mean atom score by arm, seed and iteration (the base: arm 'base')
SELECT coalesce(nullif(regexp_extract(run_id, '^{prefix}-(.+)-s[0-9]+$', 1), ''), 'base') AS arm,
       regexp_extract(run_id, '-s([0-9]+)$', 1) AS seed, iteration, split, strict_accuracy,
       mean_score
FROM evals WHERE group_kind = 'overall' AND starts_with(run_id, '{prefix}-')
ORDER BY ALL;"""


TRAIN_SQL = """
SELECT run_id, iteration, avg(reward_object) AS object, avg(reward_count) AS count,
       avg(reward_attribute) AS attribute, avg(reward_relation) AS relation,
       any_value(reward_step_weights_json) AS weights
FROM train_steps WHERE list_contains($runs, run_id) GROUP BY ALL"""
TYPE_EVALS_SQL = """
SELECT run_id, iteration, split, group_name AS atom_type, mean_score
FROM evals WHERE group_kind = 'atom_type' AND list_contains($runs, run_id)"""
DIAGNOSTICS_SQL = """
SELECT run_id, avg(clip_fraction) AS clip_fraction, avg(approx_kl) AS approx_kl,
       avg(ratio_std) AS ratio_std, avg(grad_norm) AS grad_norm,
       avg(zero_variance_fraction) AS zero_variance_fraction, count(*) AS steps
FROM train_steps WHERE list_contains($runs, run_id) AND NOT skipped GROUP BY ALL"""
GAINS_SQL = """
SELECT run_id, iteration, any_value(plot_path) AS plot_path
FROM recast_gains WHERE list_contains($runs, run_id) GROUP BY ALL"""


@dataclass(frozen=True)
class Results:
    """What the report needs, read from the store: evals {(run, iteration, split): row}, stage
    seconds {(run, iteration, stage): s}, windows {run: (method, start, end)}; for the ReCAST
    section: train rewards {(run, iteration): {atom type: mean rollout score, "weights": JSON}},
    type evals {(run, iteration, split, atom type): mean score}, gain plots {(run, iteration):
    store path of the PNG} (empty without ReCAST runs); diagnostics {run: {column: mean over the
    run's optimizer steps, "steps": count}} (`DIAGNOSTIC_COLUMNS`)."""

    evals: dict
    seconds: dict
    windows: dict
    train: dict
    type_evals: dict
    gain_plots: dict
    diagnostics: dict


def read_results(store, runs: list[str], with_gains: bool = False) -> Results:
    store.refresh_catalog()
    con = store.connect_readonly()
    try:
        def rows(sql: str) -> list[dict]:
            cursor = con.execute(sql, {"runs": runs})
            names = [d[0] for d in cursor.description]
            return [dict(zip(names, r)) for r in cursor.fetchall()]

        evals = {(r["run_id"], r["iteration"], r["split"]): r for r in rows(EVALS_SQL)}
        seconds = {(r["run_id"], r["iteration"], r["stage"]): float(r["seconds"])
                   for r in rows(STAGES_SQL)}
        windows = {r["run_id"]: (r["method"], r["window_start"], r["window_end"])
                   for r in rows(WINDOWS_SQL)}
        train = {(r["run_id"], r["iteration"]): r for r in rows(TRAIN_SQL)}
        types = {(r["run_id"], r["iteration"], r["split"], r["atom_type"]): float(r["mean_score"])
                 for r in rows(TYPE_EVALS_SQL)}
        plots = ({(r["run_id"], r["iteration"]): r["plot_path"] for r in rows(GAINS_SQL)}
                 if with_gains else {})
        diagnostics = {r["run_id"]: r for r in rows(DIAGNOSTICS_SQL)}
    finally:
        con.close()
    return Results(evals, seconds, windows, train, types, plots, diagnostics)


@dataclass(frozen=True)
class Summary:
    """improvement[(arm, split, metric)] = per-seed values; its Interval; ratios vs flowgrpo;
    base[(split, metric)]; curve[(arm, split, metric, iteration)] = Interval over seeds;
    stage medians[(arm, stage)] (stage 'iteration' = the four summed), time ratios vs flowgrpo."""

    improvement: dict
    interval: dict
    ratio: dict
    base: dict
    curve: dict
    stage_median: dict
    time_ratio: dict
    run_level: dict


def summarise(res: Results, arm_names: list[str], seeds: list[int], prefix: str,
              size: Size) -> Summary:
    last, base_run = size.iterations - 1, f"{prefix}-base"

    def value(run: str, k: int, split: str, metric: str) -> float:
        row = res.evals.get((run, k, split))
        if row is None:
            raise KeyError(f"no overall `evals` row for run {run}, iteration {k}, split {split}")
        return float(row[metric])

    keys = [(s, m) for s in SPLITS for m, _ in METRICS]
    base = {(s, m): value(base_run, -1, s, m) for s, m in keys}
    imp = {(a, s, m): [value(run_name(prefix, a, x), last, s, m) - base[(s, m)] for x in seeds]
           for a in arm_names for s, m in keys}
    curve = {(a, s, m, k): (t_interval([value(run_name(prefix, a, x), k, s, m) for x in seeds])
                            if k >= 0 else Interval(base[(s, m)], None, None, len(seeds)))
             for a in arm_names for s, m in keys for k in (-1, *size.eval_at())}
    ratio = {(a, s, m): ratio_bootstrap(imp[(a, s, m)], imp[(BASELINE, s, m)])
             for a in arm_names if a != BASELINE for s, m in keys}
    medians = {}
    for a in arm_names:
        per_it = [{st: res.seconds[(run_name(prefix, a, x), k, st)] for st in ITERATION_STAGES}
                  for x in seeds for k in range(size.iterations)]
        for st in ITERATION_STAGES:
            medians[(a, st)] = float(np.median([p[st] for p in per_it]))
        medians[(a, "iteration")] = float(np.median([sum(p.values()) for p in per_it]))
    time_ratio = {(a, st): medians[(a, st)] / medians[(BASELINE, st)]
                  for a in arm_names for st in (*ITERATION_STAGES, "iteration")}
    run_level = {(a, st): float(np.median([res.seconds[(run_name(prefix, a, x), k, st)]
                                           for x in seeds for k in ks]))
                 for a in arm_names for st, ks in (("build_csgs", [-1]), ("calibrate_window", [-1]),
                                                   ("evaluate", size.eval_at()))}
    return Summary(imp, {k: t_interval(v) for k, v in imp.items()}, ratio, base, curve, medians,
                   time_ratio, run_level)


def paired_difference(sm: Summary, arm: str, reference: str, split: str,
                      metric: str) -> Interval:
    """Interval over seeds of improvement(arm) - improvement(reference), seed by seed (paired:
    seed s gives both arms the same prompts and noise)."""
    return t_interval([x - y for x, y in zip(sm.improvement[(arm, split, metric)],
                                             sm.improvement[(reference, split, metric)])])


@dataclass(frozen=True)
class RecastSummary:
    """The ReCAST comparison (arms of the recast suite, `RECAST_PAIRS`): train[(arm, type)] =
    Interval over seeds of the arm's mean rollout score of that type over iterations 1..last
    minus cast's (same seed: same prompts and noise at every iteration, so the difference is
    paired; iteration 0 is the base policy in every arm; None when no prompt had the type);
    held_out[(arm, type)] = Interval of the eval split's per-type mean-score improvement over
    base; paired[(recast arm, split, metric)] = Interval of the per-seed difference ReCAST -
    static improvement; weights[arm] = {type: mean over seeds of the last iteration's step
    weights}; gain_plots[(arm, iteration)] = store path (seed 0, the first and the last
    estimate)."""

    arms: tuple[str, ...]
    train: dict
    held_out: dict
    paired: dict
    weights: dict
    gain_plots: dict


def summarise_recast(res: Results, sm: Summary, seeds: list[int], prefix: str,
                     size: Size) -> RecastSummary:
    import json

    last = size.iterations - 1
    names = tuple(dict.fromkeys(a for pair in RECAST_PAIRS for a in pair))
    def change(new: float | None, old: float | None) -> float | None:
        return None if new is None or old is None else new - old

    def interval(values: list[float | None]) -> Interval | None:
        kept = [v for v in values if v is not None]
        return t_interval(kept) if kept else None

    def trained(arm: str, seed: int, t: str) -> float | None:
        """Mean rollout score of type t over iterations 1..last (0 is the base policy)."""
        values = [res.train[(run_name(prefix, arm, seed), k)][t] for k in range(1, last + 1)]
        return None if not values or None in values else float(np.mean(values))

    train, held = {}, {}
    for a in names:
        for t in ATOM_TYPES:
            runs = [run_name(prefix, a, x) for x in seeds]
            train[(a, t)] = interval([change(trained(a, x, t), trained("cast", x, t))
                                      for x in seeds])
            base = res.type_evals.get((f"{prefix}-base", -1, "eval", t))
            held[(a, t)] = interval([change(res.type_evals.get((r, last, "eval", t)), base)
                                     for r in runs])
    paired = {(r, s, m): paired_difference(sm, r, st, s, m)
              for r, st in RECAST_PAIRS for s in SPLITS for m, _ in METRICS}
    weights = {}
    for a in names:
        found = [json.loads(w) for x in seeds
                 if (w := res.train[(run_name(prefix, a, x), last)]["weights"])]
        weights[a] = ({t: np.mean([f[t] for f in found], axis=0).tolist() for t in ATOM_TYPES}
                      if found else None)
    plots = {}
    for a, _ in RECAST_PAIRS:  # seed 0's first and last estimate
        found = {k: path for (run, k), path in res.gain_plots.items()
                 if run == run_name(prefix, a, seeds[0])}
        plots |= {(a, k): found[k] for k in {min(found), max(found)}} if found else {}
    return RecastSummary(names, train, held, paired, weights, plots)


# ---- report -------------------------------------------------------------------------------


def fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def signed(x: float | None) -> str:
    return "–" if x is None else f"{x:+.3f}"


def table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def ratio_cell(r: Ratio) -> str:
    if r.value is None:
        return r.note
    if r.low is None:
        return f"{r.value:.2f} ({r.note})"
    return f"{r.value:.2f} [{r.low:.2f}, {r.high:.2f}]"


def improvement_table(sm: Summary, arm_names: list[str]) -> str:
    rows = []
    for a in arm_names:
        for s in SPLITS:
            for m, label in METRICS:
                iv = sm.interval[(a, s, m)]
                ci = "–" if iv.low is None else f"[{signed(iv.low)}, {signed(iv.high)}]"
                ratio = ratio_cell(sm.ratio[(a, s, m)]) if a != BASELINE else "1 (baseline)"
                rows.append([a, s, label, fmt(sm.base[(s, m)]), signed(iv.mean), ci, iv.n, ratio])
    return table(["arm", "split", "metric", "base", "improvement (mean)", "95% t-interval",
                  "seeds", "ratio to flowgrpo [95% bootstrap]"], rows)


def time_table(sm: Summary, arm_names: list[str]) -> str:
    stages = (*ITERATION_STAGES, "iteration")
    rows = [[a, *(f"{sm.stage_median[(a, st)]:.2f}" for st in stages),
             *(f"{sm.run_level[(a, st)]:.2f}" for st in ("build_csgs", "calibrate_window",
                                                         "evaluate")),
             f"{sm.time_ratio[(a, 'iteration')]:.3f}"] for a in arm_names]
    return table(["arm", *(f"{st} (s)" for st in stages), "CSGs, once (s)", "calibration, once (s)",
                  "eval per checkpoint (s)", "iteration / flowgrpo"], rows)


TARGET_RATIO, TARGET_TIME = 3.0, 1.15  # issue 6: hard-split improvement >= 3x, time <= 1.15x


def targets_text(sm: Summary, arm_names: list[str]) -> str:
    """The issue's targets read off this run, for cast against flowgrpo: the hard-split
    improvement ratio (both metrics), whether the paired difference is outside the seed
    interval, and the time ratio per iteration."""
    if "cast" not in arm_names:
        return "cast was not run: no verdict on the targets."
    lines = []
    for m, label in METRICS:
        r = sm.ratio[("cast", "hard", m)]
        d = paired_difference(sm, "cast", BASELINE, "hard", m)
        met = r.value is not None and r.value >= TARGET_RATIO
        outside = d.low is not None and (d.low > 0 or d.high < 0)
        lines.append(
            f"- Hard split, {label}: cast {signed(sm.interval[('cast', 'hard', m)].mean)}, "
            f"flowgrpo {signed(sm.interval[(BASELINE, 'hard', m)].mean)}; ratio "
            f"{ratio_cell(r)} -> target >= {TARGET_RATIO:g}x {'met' if met else 'NOT met'}; "
            f"paired difference {_interval_cell(d)} -> "
            f"{'outside' if outside else 'inside'} the seed interval.")
    t = sm.time_ratio[("cast", "iteration")]
    lines.append(f"- Time per iteration: cast / flowgrpo = {t:.3f} (median of medians) -> target "
                 f"<= {TARGET_TIME:g} {'met' if t <= TARGET_TIME else 'NOT met'}.")
    return "\n".join(lines)


def one_change(sm: Summary, arm_names: list[str]) -> dict:
    """{(arm, reference, split, metric): Interval over seeds of the paired difference
    improvement(arm) - improvement(reference)} for the `ONE_CHANGE` pairs that were run."""
    return {(a, r, s, m): paired_difference(sm, a, r, s, m)
            for a, r, _ in ONE_CHANGE if a in arm_names and r in arm_names
            for s in SPLITS for m, _ in METRICS}


def one_change_table(sm: Summary, arm_names: list[str]) -> str:
    diffs, rows = one_change(sm, arm_names), []
    for a, r, about in ONE_CHANGE:
        for s in SPLITS:
            if (a, r, s, METRICS[0][0]) in diffs:
                rows.append([about, f"{a} - {r}", s,
                             *(_interval_cell(diffs[(a, r, s, m)]) for m, _ in METRICS)])
    return table(["change", "arms", "split", *(f"{label}, mean [95% t]" for _, label in METRICS)],
                 rows)


ONE_CHANGE_TEXT = (
    "Each row changes one thing: the per-seed difference of the two arms' improvements over base "
    "(same prompts and noise per seed, so paired), mean over seeds with a 95% t-interval. An "
    "interval that contains 0 means this benchmark cannot tell the change from seed noise.")


DIAGNOSTIC_COLUMNS = (("clip_fraction", "clip fraction", ".4f"), ("approx_kl", "approx KL", ".2e"),
                      ("ratio_std", "ratio std", ".4f"), ("grad_norm", "grad norm", ".4f"),
                      ("zero_variance_fraction", "zero-variance groups", ".3f"))


def diagnostics_table(res: Results, arm_names: list[str], seeds: list[int], prefix: str) -> str:
    """Per arm, the mean over seeds of each run's mean over its optimizer steps."""
    rows = []
    for a in arm_names:
        found = [res.diagnostics[r] for x in seeds
                 if (r := run_name(prefix, a, x)) in res.diagnostics]
        rows.append([a, *(format(float(np.mean([f[c] for f in found])), spec) if found else "–"
                          for c, _, spec in DIAGNOSTIC_COLUMNS), sum(f["steps"] for f in found)])
    return table(["arm", *(label for _, label, _ in DIAGNOSTIC_COLUMNS), "optimizer steps"], rows)


DIAGNOSTICS_TEXT = (
    "From `train_steps`: per optimizer step, the fraction of clipped ratios, the approximate "
    "KL between the policy and the rollout's (mean of (r - 1) - log r), the std of the ratios, "
    "the grad norm before clipping, and the fraction of atom (or prompt) groups with zero "
    "variance; mean over each run's steps, then over seeds. The ratios are per position for the "
    "atom arms and per sample for Flow-GRPO, so compare arms of one kind. Whether the policy "
    "moves at all shows here first: near-zero KL and clip fraction mean the LoRA barely changed "
    "the sampler, and any eval difference is then noise.")

# What earlier runs of this benchmark found (figures measured then; their stores are not
# committed). Kept here so every regenerated report carries the history.
WHAT_WAS_TRIED = """## What was tried (earlier runs)

All of these were measured with the third base model (`data/base/shapes-base` as committed in
56e1d68, "stage 2" in data/base/README.md: eval strict 0.086, hard strict 0.014 on the full
splits), not the one this report's figures come from.

1. **First full run at lr 5e-4** (commit bbc743e's report; this size, 3 seeds, the eight arms
   without the fixes): nothing separated from seed noise. Improvement over base, mean [95% t]:
   flowgrpo hard mean score -0.004 [-0.013, +0.005], eval mean score +0.011 [-0.018, +0.039];
   cast -0.002 [-0.024, +0.021] and +0.012 [-0.009, +0.033]; cast-late-window (fixed [6, 9))
   -0.005 [-0.014, +0.005] and +0.002 [-0.017, +0.020]. The diagnostics explained it: mean
   approx KL per step 1e-6 to 7e-6, clip fraction <= 0.001, ratio std <= 0.003 (atom arms) and
   <= 1e-4 (Flow-GRPO): in 4 iterations x 8 optimizer steps the LoRA barely moved the policy.
2. **Learning-rate probe** (seed 0 only, 4 iterations, same eval subsets; one seed, so each
   figure carries roughly +-0.02 of seed noise). Eval / hard mean-score improvement over base:

   | arm | lr | eval | hard | approx KL per step | clip fraction |
   |---|---|---|---|---|---|
   | cast | 5e-4 | +0.009 | -0.006 | 2.3e-6 | 0.0003 |
   | cast | 3e-3 | +0.021 | -0.014 | 3.1e-5 | 0.011 |
   | cast | 1e-2 | -0.004 | +0.002 | 2.0e-4 | 0.060 |
   | flowgrpo | 3e-3 | +0.058 | +0.026 | 8.6e-8 (per sample) | 0.034 |
   | flowgrpo | 1e-2 | +0.012 | -0.016 | 2.0e-6 (per sample) | 0.236 |
   | cast, no map | 3e-3 | +0.016 | -0.001 | 2.2e-5 | 0.007 |
   | cast, global weight 0 | 3e-3 | +0.039 | +0.001 | 3.8e-5 | 0.014 |
   | cast, atom std floor 0.1 | 3e-3 | +0.010 | +0.012 | 3.9e-5 | 0.013 |
   | cast, clip range 0.01 | 3e-3 | -0.002 | +0.013 | 1.3e-5 | 0.038 |

   lr 3e-3 is where both methods move without the clip dominating; the shapes recipes now use
   it, and the three CAST fixes became arms of this benchmark (cast-no-global, cast-std-floor,
   cast-tight-clip) so they are measured over seeds, not judged from one; a fourth,
   cast-peak-norm (the heatmap normalisation, the issue's remaining suggestion), was added
   without a probe.
3. **A later window** (cast-late-window, fixed at steps [6, 9) where ReCAST's gains say the atom
   types become decidable) was added after the first run: no better at lr 5e-4 (above).
4. **Longer training, lr 3e-3** (`--iterations 12 --arms flowgrpo,cast --store runs/bench-12it
   --report-dir reports/cast-vs-flowgrpo-12it`, committed beside this report; 3 seeds, evals at
   iterations 3, 7, 11). Flow-GRPO kept improving and CAST did not: eval mean atom score +0.075
   [+0.048, +0.102] vs +0.013 [-0.017, +0.043], paired cast - flowgrpo -0.062 [-0.090, -0.034]
   (outside the seed interval: Flow-GRPO is better on this metric); hard mean score +0.027 vs
   +0.008 and every strict accuracy difference inside the seed interval. CAST's time per iteration
   0.92x Flow-GRPO's there. Two readings, both measured: the benchmark's mean atom score is
   exactly Flow-GRPO's training reward (the mean of the atom scores), while CAST optimises a sum
   of per-atom z-scores, which weighs every atom's rank in its group equally; and in CAST's runs
   15% of the advantage mass comes from near-tied atom groups (group std < 0.05), which z-scoring
   inflates to unit variance (`advantages` table: gated and zero-variance groups carry none).
   The one-change table above points the same way: at equal window the atom advantage itself
   (cast-no-map-fixed-window - flowgrpo), not the map or the window, is where CAST loses.
5. **The full run at lr 3e-3 with that base** (14 arms x 3 seeds x 4 iterations; commit b989254's
   report). Improvement over base, mean [95% t]: hard strict cast +0.003 [-0.009, +0.014] vs
   flowgrpo +0.010 [-0.001, +0.022] (ratio 0.25, paired difference -0.008 [-0.027, +0.012], inside
   the seed interval); hard mean score -0.003 [-0.028, +0.021] vs +0.013 [-0.017, +0.044]; eval
   mean score +0.012 [-0.014, +0.038] vs +0.038 [-0.005, +0.082]; CAST's time per iteration 1.08x
   Flow-GRPO's. None of the fix or window arms separated from seed noise. The base's hard-split
   strict accuracy on the benchmark's subset was 0.000, so the hard ratio was measured on a floor;
   the base was then retrained (stages 3-5) to lift it.
"""


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=90)
    FigureCanvasAgg(fig)
    return fig


def _png(fig, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> bytes:
    """PNG bytes after a tight layout inside `rect` (figure fractions: room for a legend)."""
    fig.tight_layout(rect=rect)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _arm_colors(arm_names: list[str]) -> dict:
    """One distinct colour per arm: tab20's ten dark shades first (ten distinct hues), then its
    light ones, so few arms never share a hue; 20 before any repeats."""
    from matplotlib import colormaps

    cmap, order = colormaps["tab20"], [*range(0, 20, 2), *range(1, 20, 2)]
    return {a: cmap(order[j % 20]) for j, a in enumerate(arm_names)}


def plot_improvements(sm: Summary, arm_names: list[str]) -> bytes:
    """One panel per split x metric: each arm's mean improvement with its 95% t-interval, arms
    on the y axis (no legend to hide bars), flowgrpo's mean as a dashed line."""
    colors, y = _arm_colors(arm_names), np.arange(len(arm_names))[::-1]
    fig = _figure(10, 1.5 + 0.32 * len(arm_names) * len(SPLITS))
    for i, s in enumerate(SPLITS):
        for j, (m, label) in enumerate(METRICS):
            ax = fig.add_subplot(len(SPLITS), len(METRICS), i * len(METRICS) + j + 1)
            for k, a in enumerate(arm_names):
                v = sm.interval[(a, s, m)]
                err = None if v.low is None else [[v.mean - v.low], [v.high - v.mean]]
                ax.errorbar([v.mean], [y[k]], xerr=err, fmt="o", color=colors[a], capsize=3)
            ax.axvline(0, color="black", linewidth=0.6)
            ax.axvline(sm.interval[(BASELINE, s, m)].mean, color="grey", linestyle="--",
                       linewidth=0.8, label=f"{BASELINE} mean")
            ax.set_yticks(y, arm_names if j == 0 else [""] * len(arm_names), fontsize=7)
            ax.set_title(f"{s}: {label}, improvement over base (95% t)", fontsize=9)
            ax.grid(axis="x", alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=7, loc="lower right")
    return _png(fig)


def plot_curves(sm: Summary, arm_names: list[str], its: list[int]) -> bytes:
    colors = _arm_colors(arm_names)
    fig = _figure(11, 6.5)
    for i, (m, label) in enumerate(METRICS):
        for j, s in enumerate(SPLITS):
            ax = fig.add_subplot(len(METRICS), len(SPLITS), i * len(SPLITS) + j + 1)
            for a in arm_names:
                ivs = [sm.curve[(a, s, m, k)] for k in its]
                ax.plot(its, [v.mean for v in ivs], "o-", color=colors[a], label=a,
                        linewidth=2.0 if a == BASELINE else 1.0)
                if all(v.low is not None for v in ivs[1:]):
                    ax.fill_between(its[1:], [v.low for v in ivs[1:]], [v.high for v in ivs[1:]],
                                    color=colors[a], alpha=0.08)
            ax.set_title(f"{s}: {label} (mean over seeds, 95% band)", fontsize=9)
            ax.set_xlabel("iteration (-1 = base)", fontsize=8)
            ax.set_xticks(its)
    handles, labels = fig.axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7)
    return _png(fig, rect=(0, 0, 0.8, 1))


def plot_times(sm: Summary, arm_names: list[str]) -> bytes:
    """Per arm, the median seconds of each stage stacked into the iteration."""
    from matplotlib import colormaps

    y, left = np.arange(len(arm_names))[::-1], np.zeros(len(arm_names))
    fig = _figure(10, 1.8 + 0.3 * len(arm_names))
    ax = fig.add_subplot()
    for k, st in enumerate(ITERATION_STAGES):
        width = np.array([sm.stage_median[(a, st)] for a in arm_names])
        ax.barh(y, width, left=left, color=colormaps["tab10"](k), label=st)
        left += width
    for k, a in enumerate(arm_names):
        ax.text(left[k], y[k], f" {sm.time_ratio[(a, 'iteration')]:.2f}x", va="center",
                fontsize=7)
    ax.set_yticks(y, arm_names, fontsize=7)
    ax.set_xlabel("seconds (median over seeds x iterations); label: iteration / flowgrpo")
    ax.set_title("wall time per iteration, by stage", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4)
    ax.margins(x=0.08)
    return _png(fig)


def per_seed_table(sm: Summary, arm_names: list[str], seeds: list[int]) -> str:
    rows = [[a, s, label, *(signed(v) for v in sm.improvement[(a, s, m)])]
            for a in arm_names for s in SPLITS for m, label in METRICS]
    return table(["arm", "split", "metric", *(f"seed {x}" for x in seeds)], rows)


def curve_table(sm: Summary, arm_names: list[str], its: list[int]) -> str:
    rows = [[a, s, label, *(fmt(sm.curve[(a, s, m, k)].mean) for k in its)]
            for a in arm_names for s in SPLITS for m, label in METRICS]
    return table(["arm", "split", "metric", *(f"it {k}" for k in its)], rows)


def _interval_cell(iv: Interval | None) -> str:
    if iv is None:
        return "– (no such atoms)"
    ci = "" if iv.low is None else f" [{signed(iv.low)}, {signed(iv.high)}]"
    return signed(iv.mean) + ci


def recast_section(rs: RecastSummary, store, out: Path, recast) -> list[str]:
    """Markdown lines of the ReCAST comparison (`recast`: the ReCAST arms' recipe section);
    copies the gain plots (seed 0) next to it."""
    from tasks.store import atomic_write_bytes

    train = table(["arm", *ATOM_TYPES],
                  [[a, *(_interval_cell(rs.train[(a, t)]) for t in ATOM_TYPES)] for a in rs.arms])
    held = table(["arm", *ATOM_TYPES],
                 [[a, *(_interval_cell(rs.held_out[(a, t)]) for t in ATOM_TYPES)]
                  for a in rs.arms])
    paired = table(["ReCAST arm", "static arm", "split", "metric",
                    "ReCAST - static (mean [95% t-interval])"],
                   [[r, st, s, label, _interval_cell(rs.paired[(r, s, m)])]
                    for r, st in RECAST_PAIRS for s in SPLITS for m, label in METRICS])
    weights = table(["arm", "atom type", "weight per window step (mean over seeds)"],
                    [[a, t, ", ".join(f"{x:.2f}" for x in w[t])]
                     for a in rs.arms if (w := rs.weights[a]) for t in ATOM_TYPES])
    intro = (
        "Rewards are the atom types. `cast` is also the static arm at equal budgets (static "
        "weights lambda_k / mean(lambda) = 1 give CAST's map exactly; tested). ReCAST weights "
        "each type's share of the map at window step t by K W[k, t] / mean(lambda), W "
        f"re-estimated every {recast.every} iteration(s) on {recast.prompts} prompts x "
        f"{recast.samples_per_prompt} samples of the current policy against exact renders "
        f"(Renyi alpha {recast.alpha}, tau {recast.tau}).")
    train_text = ("Training reward: the rollouts' mean atom score per type over iterations 1 to "
                  "the last, minus cast's (same seed: the same train prompts and noise at each "
                  "iteration, so paired; prompts differ between iterations, so a change over "
                  "iterations would mix in prompt difficulty). Mean over seeds [95% t-interval]:")
    lines = ["## ReCAST: per-reward step weights against static budgets", "", intro, "",
             train_text, "", train, "",
             "Held-out: improvement over base of the eval split's mean score per atom type:", "",
             held, "", "Paired by seed, ReCAST minus static at the same budgets:", "", paired,
             "", "Weights the loss used at the last iteration:", "", weights, ""]
    for (arm, k), path in sorted(rs.gain_plots.items()):
        name = f"gains-{arm}-it{k}.png"
        atomic_write_bytes(out / name, store.resolve(path).read_bytes())
        lines += [f"![{arm} gains and W at iteration {k} (seed 0)]({name})", ""]
    return lines


def write_report(out: Path, sm: Summary, res: Results, setup: dict,
                 recast: list[str] | None = None) -> Path:
    """report.md with improvements.png, accuracy_by_iteration.png, stage_times.png, and the
    ReCAST section's `recast` lines when given."""
    from tasks.store import atomic_write_bytes

    names, seeds = setup["arms"], setup["seeds"]
    its = [-1, *setup["size"].eval_at()]
    pngs = {"improvements.png": plot_improvements(sm, names),
            "accuracy_by_iteration.png": plot_curves(sm, names, its),
            "stage_times.png": plot_times(sm, names)}
    windows = {a: sorted({res.windows[run_name(setup["prefix"], a, x)] for x in seeds})
               for a in names}
    size = setup["size"]
    arm_rows = [[a.name, f"`{a.recipe}`", ", ".join(f"{k}={v}" for k, v in a.overrides.items())
                 or "–", a.about, "; ".join(f"{m} [{s}, {e})" for m, s, e in windows[a.name]),
                 setup["recipes"][a.name].train.clip_range] for a in setup["arm_defs"]]
    r0, prefix = setup["recipes"][names[0]], setup["prefix"]
    provenance = (
        f"Generated by `{setup['command']}` from store `{setup['store']}` (runs "
        f"`{prefix}-<arm>-s<seed>`, base `{prefix}-base`); every number below is read from "
        f"that store's `evals`, `stages` and `windows` tables (and, for the ReCAST section, "
        f"`train_steps` and `recast_gains`). The stages' recorded bodies sum to "
        f"{sum(res.seconds.values()) / 60:.1f} min; this invocation took "
        f"{setup['wall_s'] / 60:.1f} min ({setup['skipped']} stages skipped as already done).")
    budget = (
        f"Equal budget (checked): {size.iterations} iterations x {r0.prompts.per_iteration} "
        f"prompts x {r0.prompts.group_size} samples, seeds {seeds} (run.seed; same train "
        f"prompts and noise per seed across arms), {r0.sampling.num_steps} sampling steps, CFG "
        f"{r0.sampling.guidance_scale}, LoRA {r0.train.lora_rank}/{r0.train.lora_alpha}, lr "
        f"{r0.train.lr}. Eval: {size.eval_prompts} evenly spaced prompts per split x "
        f"{size.images_per_prompt} images, {r0.eval.num_steps} steps, CFG "
        f"{r0.eval.guidance_scale}, at iterations {list(size.eval_at())}; the base (-1) is one "
        f"shared evaluation.")
    statistics = (
        "Mean over seeds of (last checkpoint - base); 95% Student t-interval over seeds (t with "
        "n - 1 degrees of freedom; the eval prompts and noise are fixed, so it reflects training "
        "seeds). Ratio: mean improvement of the arm / that of flowgrpo, 95% percentile interval "
        "of a paired bootstrap over seeds (10000 draws; coarse with few seeds).")
    timing = (
        "Body seconds of each stage from the `stages` table (what train_steps.stage_seconds_json "
        "is built from), medians over seeds x iterations; iteration = the four stages summed. "
        "Other processes on the machine slow the arms unevenly: compare ratios, not seconds.")
    ratios = ", ".join(f"{st} {sm.time_ratio[('cast', st)]:.3f}"
                       for st in (*ITERATION_STAGES, "iteration"))
    md = ["# CAST vs Flow-GRPO on the shapes world", "", provenance, "", "## Setup", "",
          table(["arm", "recipe", "overrides", "what", "window (per seed)", "clip range"],
                arm_rows), "", budget, "",
          "## Against the issue's targets", "", targets_text(sm, names), "",
          "## Improvement over the base model (last iteration)", "", statistics, "",
          improvement_table(sm, names), "", "![improvements](improvements.png)", "",
          "Per seed:", "", per_seed_table(sm, names, seeds), "",
          "## Accuracy by iteration", "", "Mean over seeds (iteration -1 = base).", "",
          curve_table(sm, names, its), "",
          "![accuracy by iteration](accuracy_by_iteration.png)", "",
          "## Wall time", "", timing, "", time_table(sm, names), "",
          f"CAST / Flow-GRPO time ratio (of medians) per stage: {ratios}.", "",
          "![stage times](stage_times.png)", "",
          "## Training diagnostics", "", DIAGNOSTICS_TEXT, "",
          diagnostics_table(res, names, seeds, prefix), "",
          *(["## One change at a time", "", ONE_CHANGE_TEXT, "", one_change_table(sm, names), ""]
            if one_change(sm, names) else []),
          *(recast or []),
          WHAT_WAS_TRIED, "## Query the store", "", "```sql", QUERY.format(prefix=prefix), "```", ""]
    for name, data in pngs.items():
        atomic_write_bytes(out / name, data)
    atomic_write_bytes(out / "report.md", "\n".join(md).encode())
    return out / "report.md"


# ---- the command --------------------------------------------------------------------------


def select_arms(suite: str, only: list[str] | None) -> tuple[Arm, ...]:
    """The suite's arms, or those named in `only` (which must include the baseline)."""
    defs = arms(suite)
    if only is None:
        return defs
    unknown = sorted(set(only) - {a.name for a in defs})
    if unknown or BASELINE not in only:
        raise ValueError(f"--arms must name arms of suite {suite!r} and include {BASELINE!r} "
                         f"(the ratios are against it); unknown: {unknown}; the suite has "
                         f"{[a.name for a in defs]}")
    return tuple(a for a in defs if a.name in only)


def run_benchmark(size: Size, store_dir: str | Path, report_dir: str | Path, prefix: str,
                  threads: int | None = None, command: str = "", suite: str = "all",
                  lr: float | None = None, only: list[str] | None = None) -> dict:
    """Train every arm x seed, evaluate, summarise from the store, write the report -> figures.
    `lr` replaces every arm's learning rate; `only` keeps the named arms (with the baseline)."""
    from tasks.evaluate_checkpoint import eval_spec_hash, evaluate_checkpoint
    from tasks.store import Store

    start, store = time.perf_counter(), Store(store_dir)
    arm_defs, seeds = select_arms(suite, only), list(range(size.seeds))
    names = [a.name for a in arm_defs]
    with_recast = all(a in names for pair in RECAST_PAIRS for a in pair)
    splits = eval_subsets(store, size)
    recipes = {(a.name, x): recipe_for(a, x, size, splits, run_name(prefix, a.name, x), threads,
                                       lr)
               for a in arm_defs for x in seeds}
    for x in seeds:
        check_equal_budget([recipes[(a.name, x)] for a in arm_defs])
    if len({eval_spec_hash(r) for r in recipes.values()}) != 1:
        raise ValueError("the arms' eval specs differ: one shared base evaluation would be wrong")
    base = recipe_for(arms()[1], 0, size, splits, f"{prefix}-base", threads)
    skipped = int(evaluate_checkpoint(store, base, -1).skipped)
    for x in seeds:
        for i in range(len(arm_defs)):
            arm = arm_defs[(i + x) % len(arm_defs)]  # rotate the order per seed
            skipped += train_run(store, recipes[(arm.name, x)], size)
    runs = [f"{prefix}-base", *(run_name(prefix, a, x) for a in names for x in seeds)]
    res = read_results(store, runs, with_gains=with_recast)
    sm = summarise(res, names, seeds, prefix, size)
    rs = summarise_recast(res, sm, seeds, prefix, size) if with_recast else None
    setup = {"arms": names, "arm_defs": arm_defs, "seeds": seeds, "size": size, "prefix": prefix,
             "store": str(store.root), "command": command, "skipped": skipped,
             "wall_s": time.perf_counter() - start,
             "recipes": {a: recipes[(a, 0)] for a in names}}
    recast = (recast_section(rs, store, Path(report_dir), recipes[("recast-equal", 0)].recast)
              if rs is not None else None)
    path = write_report(Path(report_dir), sm, res, setup, recast)
    print(f"\n{improvement_table(sm, names)}\n\n{time_table(sm, names)}\n")
    if one_change(sm, names):
        print(f"{one_change_table(sm, names)}\n")
    print(f"{targets_text(sm, names)}\n")
    if recast:
        print("\n".join(recast))
    print(f"wall time {setup['wall_s']:.1f} s; report {path}")
    return {"summary": sm, "recast": rs, "report": path, "wall_s": setup["wall_s"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke-check size")
    parser.add_argument("--store", default=None, help="store root (default runs/bench-methods, "
                        "runs/bench-methods-quick/store with --quick)")
    parser.add_argument("--report-dir", default=None, help="default reports/cast-vs-flowgrpo, "
                        "runs/bench-methods-quick/report with --quick")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (run.threads)")
    parser.add_argument("--suite", choices=SUITES, default="all",
                        help="methods: the five method arms; all: also the fix and ReCAST arms")
    parser.add_argument("--arms", default=None,
                        help="comma-separated arm names to run (must include flowgrpo)")
    parser.add_argument("--lr", type=float, default=None,
                        help="replace every arm's learning rate (e.g. a probe: --seeds 1 --lr 1e-2 "
                             "--arms flowgrpo,cast --store runs/probe-lr1e-2)")
    args = parser.parse_args(argv)
    if args.lr is not None and not args.lr > 0:
        parser.error(f"--lr must be > 0; got {args.lr}")
    size = QUICK if args.quick else FULL
    size = replace(size, seeds=args.seeds or size.seeds,
                   iterations=args.iterations or size.iterations)
    quick = Path("runs/bench-methods-quick")
    store = Path(args.store or (quick / "store" if args.quick else "runs/bench-methods"))
    report = args.report_dir or (quick / "report" if args.quick else "reports/cast-vs-flowgrpo")
    (store / ".prefect-home").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(store.resolve() / ".prefect-home"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    command = "python benchmarks/bench_methods.py " + " ".join(sys.argv[1:] if argv is None
                                                               else argv)
    only = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
    run_benchmark(size, store, report, "quick" if args.quick else "bench", args.threads,
                  command.strip(), args.suite, args.lr, only)


if __name__ == "__main__":
    main()
