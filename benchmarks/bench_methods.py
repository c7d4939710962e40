"""Benchmark: CAST against Flow-GRPO on the shapes world, trained on a fixed prompt pool, with
learning curves, paired final evaluations and sample efficiency.

    .venv/bin/python benchmarks/bench_methods.py [--quick] [--protocol NAME]
        [--suite main|ablations|recast|nft] [--arms A,B] [--store DIR] [--report-dir DIR]
        [--jobs N] [--threads N] [--lr LR] [--guidance G] [--pool-prompts N] [--seeds N]
        [--iterations N] [--per-iteration B] [--group-size G] [--probe-images N] [--set K=V]
        [--pool-images N] [--hard-images N] [--eval-images N] [--held-out-prompts N]

Protocols (`PROTOCOLS`; every flag overrides its field). The default, `cfg1-pool8` (the recipes'
footing): CFG 1 for every rollout and evaluation, the pool's first 8 prompts, each iteration's lr
set to move the policy 0.03 nats a sample and window step (from 1e-3), 3 seeds x 40 iterations of
8 prompts x 16 samples, probe 8 images a prompt, final pool 16, hard and eval 2 on 64 prompts
each (reports/cfg1-pool8-40it-kl003; 14-17 min per arm and seed, 2 runs at a time with `--jobs 2
--threads 1`). `cfg1-pool8-lr4e-4`: the same at a constant lr 4e-4
(reports/cfg1-pool8-40it-lr4e-4). `cfg4-pool32`: the recipes' footing before 2026-12-06, CFG 4
and a constant lr 1e-3 on all 32 pool prompts, `FULL` below (reports/cast-vs-flowgrpo). `quick`
(--quick): the default's footing for Flow-GRPO alone, 1 seed x 16 iterations (`QUICK`).
`--set SECTION.FIELD=VALUE` puts one more lever on every arm (e.g. `train.lora_rank=32`).

Run it from the repository root. Arms (every one from the committed base model; `arms()`):
flowgrpo (data/recipes/shapes-flowgrpo.toml: scalar reward = mean atom score, group z-score,
hand-set window [0, 3), all-dims clip range) and cast (data/recipes/shapes-cast.toml: calibrated
window, atom z-scores projected through the verifier's heatmaps, per-position clip range) form
suite `main`; suite `ablations` adds the one-change arms of `ONE_CHANGE` (window:
cast-fixed-window, flowgrpo-calibrated, cast-late-window; map: cast-no-map,
cast-no-map-fixed-window; per-atom vs scalar credit, which in cast-no-map-fixed-window - flowgrpo
comes with the per-position ratio instead of the all-dims one: no arm changes the ratio alone; and
the `FIXES`); suite `recast` adds the ReCAST pairs (recast-equal against cast, recast-skewed
against static-skewed at budgets `SKEWED`); suite `nft` adds the forward-process arms nft
(scalar reward) and nft-cast (CAST's map as a per-position optimality), which sample with the ODE
(`NFT`). `--arms` picks any arms of any suite, flowgrpo among them.

Protocol. Every arm trains on data/prompts/pool.jsonl (32 hard-tag train prompts, disjoint from
every evaluation prompt) with `prompts.selection = "cycle"`: iteration k trains on pool positions
(k B + j) mod 32, so every prompt comes back every 32 / B iterations and all arms see the same
prompts at the same iteration; run seed s gives every arm the same rollout noise. The train
settings other than the clip range are equal across arms (checked, `check_equal_budget`). Stages
are called as functions (no Prefect server) on one store; each arm x seed is run
`<prefix>-<arm>-s<seed>` (prefix `bench`, `quick` with --quick), the base model run
`<prefix>-base` (evaluated once, shared). Evaluations (the evaluate stage, one `evals` part per
split; `EvalPass`):
- probe, after every iteration and for the base (iteration -1): the 32 pool prompts x
  `probe_images`, seed offset 0 (the same noise at every checkpoint, so the curve shows a trend
  rather than a draw);
- final, after the last iteration and for the base: split "pool" (the training prompts with fresh
  noise, seed offset 1000) x `pool_images`, and the held-out splits "hard"
  (data/prompts/hard.jsonl) x `hard_images` and "eval" (data/prompts/eval.jsonl) x `eval_images`
  (seed offset 0; `held_out_prompts` keeps an evenly spaced subset of each for small runs). Every
  arm and the base use the same prompts and noise: the eval specs are checked equal, so every
  gain and every difference between arms is paired.
Re-running on the same store resumes: finished stages are skipped. Keep one size per store.

Statistics (benchmarks/methods/stats.py; the report states each): gain = final - base per arm, seed,
split and metric (mean atom score, strict accuracy), mean over seeds with a 95% t-interval over
seeds (with one seed, the paired prompt-bootstrap interval of that seed's gain); cast - flowgrpo
per seed with a t-interval; gain ratios with a paired bootstrap over seeds; each checkpoint's
figures with a 95% bootstrap over prompts (clusters) and the half-width image noise alone gives.
Learning curves: the probe's mean atom score and strict accuracy against samples seen (the
checkpoint of iteration k has trained on (k + 1) B G samples, the base on 0) and against wall time
(the run's cumulative stage seconds, from the `stages` table: CSGs and calibration, then each
iteration's rollout, scores, advantages, ReCAST gains if any, and training; evaluations excluded).
Sample efficiency: the samples each arm's mean probe curve needs to reach Flow-GRPO's final probe
score (linear between checkpoints), over Flow-GRPO's, bootstrap over seeds. figures.json beside
report.md: one entry per target of issue 17 (`methods.figures.figures`).

Sizing, measured on this 2-core machine (2026-12-03, the committed base model; two other jobs
shared the cores, so the loaded figures are upper bounds). The base's images, each scored by its
mean atom score (pool: 32 prompts x 16 images at seed offset 1000; hard 200 x 2; eval 207 x 2):

    split  per-image SD  within-prompt SD  SD of prompt means  mean
    pool   0.189         0.174             0.087 (x16 images)  0.621
    hard   0.182         0.170             0.136 (x2)          0.586
    eval   0.276         0.207             0.234 (x2)          0.577

A 95% half-width of 0.01 from image noise (prompts held fixed) needs (1.96 x within-prompt SD /
0.01)^2 images: pool 1166 (36 a prompt), hard 1115 (6), eval 1654 (8); treating images as
independent (per-image SD), 1375, 1268 and 2933. With prompts as clusters, the spread between
prompts sets a floor that more images cannot lower: about +-0.026 on the pool (32 prompts; but
the pool is the whole population being trained, so the image-noise half-width is the one that
applies there), +-0.009 on hard and +-0.025 on eval. Times at 2 threads, at a quiet moment: one
iteration at B = 8, G = 16 took 17.4 s (rollout 9.9, scores 0.3, advantages 0.2, training 7.0;
cast), the probe 11.0 s for its 128 images, i.e. 0.086 s an evaluated image (the same figures as
the earlier quiet runs: 16-18 s per 128-sample iteration, 9.15 s to sample 128 images); under the
load, 50-200 s an iteration and 0.19-0.21 s an image (threads 1).
- FULL (the default; suite main): 3 seeds x 16 iterations x 8 prompts x 16 samples (2048 samples
  a run, every pool prompt 4 times), probe 4 images a prompt, final pool 32 images a prompt (1024
  images: +-0.011 from image noise), hard 6 (1200: +-0.010; with prompt clusters about +-0.013),
  eval 4 (828: +-0.014; with prompt clusters about +-0.029; 8 a prompt would reach +-0.010 from
  image noise for 71 s more per run, which the time budget does not hold). Estimate at the quiet
  figures: 2 + 16 x (17.5 + 11.0) + 3052 x 0.086 = 720 s = 12.0 min per arm and seed, the base
  4.6 min, about 77 min for the 2 arms x 3 seeds; on a loaded machine up to twice that.
  Measured with the recipes' 2 inner epochs x 2 optimizer steps (2026-12-03, mostly quiet):
  80.1 min wall, 12.5 min a run (10.4-15.3), an iteration 22.6 s (flowgrpo) / 23.8 s (cast),
  the probe 8.2-8.7 s, the final pool / hard / eval 67 / 79 / 57 s. Suite
  ablations (11 arms) takes about 6.7 h, suite recast (5 arms) about 3.2 h.
- QUICK: flowgrpo, 1 seed, 16 iterations, probe 8, final pool 16 images a prompt, hard and eval
  2 images on 64 evenly spaced prompts each, at the quick protocol's CFG 1 and 8 pool prompts.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the methods package, loaded by path

from methods.arms import BASELINE, SUITES
from methods.benchmark import run_benchmark
from methods.protocols import DEFAULT_PROTOCOL, PROTOCOLS, QUICK, Protocol, Size


def _protocol_from_args(args) -> Protocol:
    """The named protocol (default: "quick" with --quick, else DEFAULT_PROTOCOL; --quick with
    another protocol takes its settings at QUICK's size) with the command line's flags in place
    of its fields."""
    name = args.protocol or ("quick" if args.quick else DEFAULT_PROTOCOL)
    p = PROTOCOLS[name]
    return replace(p, size=_size_from_args(args, QUICK if args.quick else p.size),
                   guidance=p.guidance if args.guidance is None else args.guidance,
                   pool_prompts=p.pool_prompts if args.pool_prompts is None else args.pool_prompts,
                   lr=p.lr if args.lr is None else args.lr,
                   kl_target=p.kl_target if args.kl_target is None else args.kl_target)


def parse_settings(pairs: list[str]) -> dict:
    """["train.lora_rank=32", "window.start=2", ...] -> {dotted key: value}; each VALUE is read
    as JSON (numbers, true/false, lists, quoted text), else kept as text. The recipe loader
    checks the keys and values."""
    import json

    out = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip() or "." not in key:
            raise ValueError(f"--set takes SECTION.FIELD=VALUE (e.g. train.lora_rank=32); "
                             f"got {pair!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[key.strip()] = value
    return out


def _size_from_args(args, size: Size) -> Size:
    given = {f: getattr(args, f) for f in ("seeds", "iterations", "per_iteration", "group_size",
                                           "probe_images", "pool_images", "hard_images",
                                           "eval_images", "held_out_prompts")
             if getattr(args, f) is not None}
    return replace(size, **given)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="protocol 'quick': flowgrpo only, one seed x 16 iterations, under "
                             "10 minutes; its probe curve should rise")
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default=None,
                        help=f"the settings every arm trains and is judged with (default "
                             f"{DEFAULT_PROTOCOL}: " + PROTOCOLS[DEFAULT_PROTOCOL].about +
                             "; 'quick' with --quick); the flags below override its fields")
    parser.add_argument("--store", default=None, help="store root (default the protocol's, "
                        "runs/bench-methods-quick/store with --quick)")
    parser.add_argument("--report-dir", default=None, help="default the protocol's, "
                        "runs/bench-methods-quick/report with --quick")
    parser.add_argument("--suite", choices=SUITES, default="main",
                        help="main: flowgrpo and cast; ablations: and the one-change arms; "
                        "recast: and the ReCAST pair")
    parser.add_argument("--arms", default=None,
                        help="comma-separated arm names of any suite (must include flowgrpo)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (run.threads)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="arm x seed runs trained at a time, each in its own process on the "
                             "same store (2 on the 2-core machine with --threads 1)")
    parser.add_argument("--lr", type=float, default=None,
                        help="replace every arm's learning rate (a probe: use its own --store)")
    parser.add_argument("--kl-target", type=float, default=None,
                        help="every arm's train.kl_target_nats: each iteration's lr set so that "
                             "it moves the policy this many nats per sample and window step "
                             "(--lr is then the first iteration's; use its own --store)")
    parser.add_argument("--pool-prompts", type=int, default=None,
                        help="train (and probe) on the pool's first N prompts only (a set small "
                             "enough to overfit; use its own --store)")
    parser.add_argument("--guidance", type=float, default=None,
                        help="CFG scale of every arm's rollouts and of every evaluation (1: a "
                             "CFG-free policy, trained and judged without guidance; see "
                             "reports/learning-probes section 6; use its own --store)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="set a recipe field on every arm and the base, after the arms' own "
                             "overrides (repeatable; VALUE read as JSON, else as text), e.g. "
                             "--set train.lora_rank=32: one lever at a time for the methods "
                             "together; use its own --store")
    for flag in ("seeds", "iterations", "per-iteration", "group-size", "probe-images",
                 "pool-images", "hard-images", "eval-images", "held-out-prompts"):
        parser.add_argument(f"--{flag}", type=int, default=None,
                            help=f"override Size.{flag.replace('-', '_')}")
    args = parser.parse_args(argv)
    if args.lr is not None and not args.lr > 0:
        parser.error(f"--lr must be > 0; got {args.lr}")
    if args.kl_target is not None and not args.kl_target > 0:
        parser.error(f"--kl-target must be > 0 nats; got {args.kl_target}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1; got {args.jobs}")
    if args.guidance is not None and not args.guidance >= 1.0:
        parser.error(f"--guidance must be >= 1 (1 is no guidance); got {args.guidance}")
    try:
        settings = parse_settings(args.set)
    except ValueError as e:
        parser.error(str(e))
    protocol = _protocol_from_args(args)
    size = protocol.size
    only = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
    if args.quick and only is None:
        only = [BASELINE]
    quick = Path("runs/bench-methods-quick")
    store = Path(args.store or (quick / "store" if args.quick else protocol.store))
    report = args.report_dir or (quick / "report" if args.quick else protocol.report)
    (store / ".prefect-home").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(store.resolve() / ".prefect-home"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    command = "python benchmarks/bench_methods.py " + " ".join(sys.argv[1:] if argv is None
                                                               else argv)
    print(f"protocol: {protocol.about} -> "
          f"{size}, CFG {protocol.guidance or 'of the recipes'}, pool prompts "
          f"{protocol.pool_prompts or 'all'}, lr {protocol.lr or 'of the recipes'}"
          f"{f', KL target {protocol.kl_target:g} nats' if protocol.kl_target else ''}"
          f"{f', set {settings}' if settings else ''}; store "
          f"{store}, report {report}", flush=True)
    run_benchmark(size, store, report, "quick" if args.quick else "bench", args.threads,
                  command.strip(), args.suite, protocol.lr, only, quick=args.quick,
                  guidance=protocol.guidance, pool_prompts=protocol.pool_prompts, jobs=args.jobs,
                  kl_target=protocol.kl_target, settings=settings)


if __name__ == "__main__":
    main()
