"""The methods benchmark's figures from its `Results`: gains over the base with intervals,
learning curves, sample efficiency, stage times (`summarise` -> `Summary`), the one-change pairs
(`one_change`) and the ReCAST comparison (`summarise_recast` -> `RecastSummary`).

Gain = final - base per arm, seed, split and metric (mean atom score, strict accuracy), mean over
seeds with a 95% t-interval over seeds (with one seed, the paired prompt-bootstrap interval of
that seed's gain); arm - flowgrpo per seed with a t-interval; gain ratios with a paired bootstrap
over seeds; each checkpoint's figures with a 95% bootstrap over prompts (clusters) and the
half-width image noise alone gives (`methods.stats`). Learning curves: the probe's mean atom
score and strict accuracy against samples seen (the checkpoint of iteration k has trained on
(k + 1) B G samples, the base on 0) and against wall time (the run's cumulative stage seconds,
from the `stages` table: CSGs and calibration, then each iteration's rollout, scores, advantages,
ReCAST gains if any, and training; evaluations excluded). Sample efficiency: the samples each
arm's mean probe curve needs to reach Flow-GRPO's final probe score (linear between checkpoints),
over Flow-GRPO's, bootstrap over seeds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from cast_core.csg.graph import ATOM_TYPES
from methods.arms import BASELINE, ONE_CHANGE, RECAST_PAIRS
from methods.protocols import FINAL_SPLITS, METRICS, Size, run_name
from methods.stats import (
    Interval,
    checkpoint_figures,
    crossing_ratio,
    paired_gain,
    ratio_bootstrap,
    samples_to_threshold,
    t_interval,
)
from methods.store_reads import Results
from tasks.stages.iteration import RUN_STAGES

ITERATION_STAGES = ("rollout", "score_atoms", "compute_advantages", "train_epoch")


@dataclass(frozen=True)
class Summary:
    """Everything the report shows, keyed by arm names of `arms`, seeds of `seeds`:
    base[(split, metric)] (final splits and "probe"); gains[(arm, split, metric)] = per-seed
    final - base; gain[(arm, split, metric)] = Interval over seeds (one seed: the paired prompt
    bootstrap); seed_gain[(arm, seed, split, metric)] = paired prompt-bootstrap Interval;
    checkpoint[(label, split)] = CheckpointFigures (label "base" or "<arm> s<seed>");
    diff[(arm, split, metric)] = Interval of arm - flowgrpo gains per seed; ratio[(arm, split,
    metric)] = gain ratio to flowgrpo; curve[(arm, metric)] = [seeds][K + 1] probe values (index 0
    the base); samples [K + 1]; wall[arm] = [seeds][K + 1] cumulative minutes; threshold (flowgrpo's
    final probe mean score, mean over seeds); to_threshold[(arm, seed)] = samples or None;
    crossing[arm] = Ratio to flowgrpo; stage_median[(arm, stage)] (stage "iteration" = the
    iteration's stages summed) and time_ratio to flowgrpo; minutes[(arm, seed)] = every stage of
    the run (training, probes, final evaluation); hf[(arm or "base", split)] = hf_energy (mean
    over seeds); diversity[(arm or "base", split)] the same for the evaluation's diversity (mean
    pairwise 1 - cos of one prompt's images' layout embeddings; None where a row lacks it);
    type_curve[(arm, atom type)] = [seeds][K + 1] probe mean scores of that type (index 0 the
    base), for the types the probe's prompts hold."""

    arms: list
    seeds: list
    base: dict
    gains: dict
    gain: dict
    seed_gain: dict
    checkpoint: dict
    diff: dict
    ratio: dict
    curve: dict
    samples: list
    wall: dict
    threshold: float | None
    to_threshold: dict
    crossing: dict
    stage_median: dict
    time_ratio: dict
    minutes: dict
    hf: dict
    diversity: dict = field(default_factory=dict)
    type_curve: dict = field(default_factory=dict)


def _value(res: Results, run: str, k: int, split: str, column: str) -> float:
    row = res.evals.get((run, k, split))
    if row is None:
        raise KeyError(f"no overall `evals` row for run {run}, iteration {k}, split {split}")
    return float(row[column])


def _gains(res: Results, names: list[str], seeds: list[int], prefix: str, last: int) -> tuple:
    base_run = f"{prefix}-base"
    keys = [(s, m) for s in FINAL_SPLITS for m, _ in METRICS]
    base = {(s, m): _value(res, base_run, -1, s, m) for s, m in keys}
    gains = {(a, s, m): [_value(res, run_name(prefix, a, x), last, s, m) - base[(s, m)]
                         for x in seeds] for a in names for s, m in keys}
    seed_gain = {}
    for a in names:
        for x in seeds:
            for s in FINAL_SPLITS:
                score, strict = paired_gain(res.scores[(run_name(prefix, a, x), last, s)],
                                            res.scores[(base_run, -1, s)])
                seed_gain |= {(a, x, s, "mean_score"): score, (a, x, s, "strict_accuracy"): strict}
    gain = {k: (t_interval(v) if len(seeds) > 1 else seed_gain[(k[0], seeds[0], *k[1:])])
            for k, v in gains.items()}
    diff = {(a, s, m): t_interval([x - y for x, y in zip(gains[(a, s, m)],
                                                         gains[(BASELINE, s, m)])])
            for a in names if a != BASELINE for s, m in keys}
    ratio = {(a, s, m): ratio_bootstrap(gains[(a, s, m)], gains[(BASELINE, s, m)])
             for a in names if a != BASELINE for s, m in keys}
    return base, gains, gain, seed_gain, diff, ratio


def _curves(res: Results, names: list[str], seeds: list[int], prefix: str, size: Size) -> tuple:
    base_run, its = f"{prefix}-base", range(size.iterations)
    curve = {(a, m): [[_value(res, base_run, -1, "probe", m),
                       *(_value(res, run_name(prefix, a, x), k, "probe", m) for k in its)]
                      for x in seeds] for a in names for m, _ in METRICS}
    wall = {}
    for a in names:
        per_seed = []
        for x in seeds:
            run = run_name(prefix, a, x)
            t = sum(res.seconds[(run, -1, st)] for st in RUN_STAGES)
            steps = [t]
            for k in its:
                t += sum(v for (r, i, w), v in res.seconds.items()
                         if r == run and i == k and not w.startswith("eval:"))
                steps.append(t)
            per_seed.append([v / 60 for v in steps])
        wall[a] = per_seed
    return curve, wall


def _type_curves(res: Results, names: list[str], seeds: list[int], prefix: str,
                 size: Size) -> dict:
    """{(arm, atom type): [seeds][K + 1]} probe mean score per type, index 0 the base; a type
    goes in when the base and every run's every probe have it."""
    base_run, its = f"{prefix}-base", range(size.iterations)
    out = {}
    for t in ATOM_TYPES:
        keys = [(base_run, -1)] + [(run_name(prefix, a, x), k) for a in names for x in seeds
                                    for k in its]
        if not all((r, k, "probe", t) in res.type_evals for r, k in keys):
            continue
        for a in names:
            out[(a, t)] = [[res.type_evals[(base_run, -1, "probe", t)],
                            *(res.type_evals[(run_name(prefix, a, x), k, "probe", t)] for k in its)]
                           for x in seeds]
    return out


def _efficiency(curve: dict, names: list[str], seeds: list[int], samples: list[int]) -> tuple:
    if BASELINE not in names:
        return None, {}, {}
    base_curves = curve[(BASELINE, "mean_score")]
    threshold = float(np.mean([c[-1] for c in base_curves]))
    to_threshold = {(a, x): samples_to_threshold(samples, c, threshold)
                    for a in names for x, c in zip(seeds, curve[(a, "mean_score")])}
    crossing = {a: crossing_ratio(curve[(a, "mean_score")], base_curves, samples)
                for a in names if a != BASELINE}
    return threshold, to_threshold, crossing


def _times(res: Results, names: list[str], seeds: list[int], prefix: str, size: Size) -> tuple:
    medians = {}
    for a in names:
        per_it = [{st: res.seconds.get((run_name(prefix, a, x), k, st), 0.0)
                   for st in (*ITERATION_STAGES, "recast_gains")}
                  for x in seeds for k in range(size.iterations)]
        for st in (*ITERATION_STAGES, "recast_gains"):
            medians[(a, st)] = float(np.median([p[st] for p in per_it]))
        medians[(a, "iteration")] = float(np.median([sum(p.values()) for p in per_it]))
        for what in ("eval:probe", *(f"eval:{s}" for s in FINAL_SPLITS)):
            medians[(a, what)] = float(np.median([
                v for (r, _, w), v in res.seconds.items()
                if w == what and r in {run_name(prefix, a, x) for x in seeds}]))
        for st in RUN_STAGES:
            medians[(a, st)] = float(np.median([res.seconds[(run_name(prefix, a, x), -1, st)]
                                                for x in seeds]))
    ratio = {(a, st): medians[(a, st)] / medians[(BASELINE, st)]
             for a in names for st in (*ITERATION_STAGES, "iteration")
             if medians[(BASELINE, st)] > 0}
    minutes = {(a, x): sum(v for (r, _, _), v in res.seconds.items()
                           if r == run_name(prefix, a, x)) / 60 for a in names for x in seeds}
    return medians, ratio, minutes


def summarise(res: Results, names: list[str], seeds: list[int], prefix: str,
              size: Size) -> Summary:
    last, base_run = size.iterations - 1, f"{prefix}-base"
    base, gains, gain, seed_gain, diff, ratio = _gains(res, names, seeds, prefix, last)
    base |= {("probe", m): _value(res, base_run, -1, "probe", m) for m, _ in METRICS}
    checkpoint = {("base", s): checkpoint_figures(res.scores[(base_run, -1, s)])
                  for s in FINAL_SPLITS}
    checkpoint |= {(f"{a} s{x}", s): checkpoint_figures(res.scores[(run_name(prefix, a, x), last,
                                                                     s)])
                   for a in names for x in seeds for s in FINAL_SPLITS}
    curve, wall = _curves(res, names, seeds, prefix, size)
    samples = size.samples()
    threshold, to_threshold, crossing = _efficiency(curve, names, seeds, samples)
    medians, time_ratio, minutes = _times(res, names, seeds, prefix, size)
    hf = {("base", s): _value(res, base_run, -1, s, "hf_energy") for s in FINAL_SPLITS}
    hf |= {(a, s): float(np.mean([_value(res, run_name(prefix, a, x), last, s, "hf_energy")
                                  for x in seeds])) for a in names for s in FINAL_SPLITS}
    diversity = {("base", s): _maybe(res, base_run, -1, s, "diversity") for s in FINAL_SPLITS}
    diversity |= {(a, s): _mean_or_none([_maybe(res, run_name(prefix, a, x), last, s,
                                                "diversity") for x in seeds])
                  for a in names for s in FINAL_SPLITS}
    return Summary(names, seeds, base, gains, gain, seed_gain, checkpoint, diff, ratio, curve,
                   samples, wall, threshold, to_threshold, crossing, medians, time_ratio, minutes,
                   hf, diversity, _type_curves(res, names, seeds, prefix, size))


def _maybe(res: Results, run: str, k: int, split: str, column: str) -> float | None:
    """`_value`, or None where the row's column is null or absent (older stores)."""
    row = res.evals.get((run, k, split))
    return None if row is None or row.get(column) is None else float(row[column])


def _mean_or_none(values: list[float | None]) -> float | None:
    return None if any(v is None for v in values) else float(np.mean(values))


def paired_difference(sm: Summary, arm: str, reference: str, split: str,
                      metric: str) -> Interval:
    """Interval over seeds of gain(arm) - gain(reference), seed by seed (paired: seed s gives
    both arms the same prompts and noise)."""
    return t_interval([x - y for x, y in zip(sm.gains[(arm, split, metric)],
                                             sm.gains[(reference, split, metric)])])


def one_change(sm: Summary, arm_names: list[str]) -> dict:
    """{(arm, reference, split, metric): Interval over seeds of the paired difference} for the
    `ONE_CHANGE` pairs that were run."""
    return {(a, r, s, m): paired_difference(sm, a, r, s, m)
            for a, r, _ in ONE_CHANGE if a in arm_names and r in arm_names
            for s in FINAL_SPLITS for m, _ in METRICS}


def one_change_ratios(sm: Summary, arm_names: list[str]) -> dict:
    """{(arm, reference, split): gain ratio arm / reference of the mean atom score, with a paired
    bootstrap over seeds} for the `ONE_CHANGE` pairs that were run: e.g. CAST's map over the
    scalar on one window, a ratio the headline's (against flowgrpo) does not give."""
    return {(a, r, s): ratio_bootstrap(sm.gains[(a, s, "mean_score")],
                                       sm.gains[(r, s, "mean_score")], reference=r)
            for a, r, _ in ONE_CHANGE if a in arm_names and r in arm_names for s in FINAL_SPLITS}


@dataclass(frozen=True)
class RecastSummary:
    """The ReCAST comparison (`RECAST_PAIRS`): train[(arm, type)] = Interval over seeds of the
    arm's mean rollout score of that type over iterations 1..last minus cast's (same seed: same
    prompts and noise at every iteration, so paired; None when no prompt had the type);
    held_out[(arm, type)] = Interval of the eval split's per-type mean-score gain over base;
    paired[(recast arm, split, metric)] = Interval of ReCAST - static gains per seed;
    weights[arm] = {type: mean over seeds of the last iteration's step weights};
    gain_plots[(arm, iteration)] = store path (seed 0, the first and the last estimate)."""

    arms: tuple[str, ...]
    train: dict
    held_out: dict
    paired: dict
    weights: dict
    gain_plots: dict


def summarise_recast(res: Results, sm: Summary, prefix: str, size: Size) -> RecastSummary:
    last, seeds = size.iterations - 1, sm.seeds
    names = tuple(dict.fromkeys(a for pair in RECAST_PAIRS for a in pair))

    def interval(values: list[float | None]) -> Interval | None:
        kept = [v for v in values if v is not None]
        return t_interval(kept) if kept else None

    def trained(arm: str, seed: int, t: str) -> float | None:
        values = [res.train[(run_name(prefix, arm, seed), k)][t] for k in range(1, last + 1)]
        return None if not values or None in values else float(np.mean(values))

    def change(new: float | None, old: float | None) -> float | None:
        return None if new is None or old is None else new - old

    train, held = {}, {}
    for a in names:
        for t in ATOM_TYPES:
            train[(a, t)] = interval([change(trained(a, x, t), trained("cast", x, t))
                                      for x in seeds])
            base = res.type_evals.get((f"{prefix}-base", -1, "eval", t))
            held[(a, t)] = interval([change(res.type_evals.get((run_name(prefix, a, x), last,
                                                                "eval", t)), base)
                                     for x in seeds])
    paired = {(r, s, m): paired_difference(sm, r, st, s, m)
              for r, st in RECAST_PAIRS for s in FINAL_SPLITS for m, _ in METRICS}
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
