"""Benchmark: CAST against Flow-GRPO on the shapes world, trained on a fixed prompt pool, with
learning curves, paired final evaluations and sample efficiency.

    .venv/bin/python benchmarks/bench_methods.py [--quick] [--protocol NAME]
        [--suite main|ablations|recast|nft] [--arms A,B] [--store DIR] [--report-dir DIR]
        [--jobs N] [--threads N] [--lr LR] [--guidance G] [--pool-prompts N] [--seeds N]
        [--iterations N] [--per-iteration B] [--group-size G] [--probe-images N] [--set K=V]
        [--pool-images N] [--hard-images N] [--eval-images N] [--held-out-prompts N]

Run it from the repository root. Protocols (`methods.protocols.PROTOCOLS`; every flag overrides
its field): the default, `cfg1-pool8` (the recipes' footing): CFG 1 for every rollout and
evaluation, the pool's first 8 prompts, each iteration's lr set to move the policy 0.03 nats a
sample and window step (from 1e-3), 3 seeds x 40 iterations of 8 prompts x 16 samples, probe 8
images a prompt, final pool 16, hard and eval 2 on 64 prompts each
(reports/cfg1-pool8-40it-rank32 with the recipes' LoRA rank 32; reports/cfg1-pool8-40it-kl003
with rank 8). `cfg1-pool8-lr4e-4`: the same at a constant lr 4e-4
(reports/cfg1-pool8-40it-lr4e-4). `cfg4-pool32`: CFG 4 and a constant lr 1e-3 on all 32 pool
prompts, 3 seeds x 16 iterations (`FULL`; reports/cast-vs-flowgrpo). `quick` (--quick): the
default's footing for Flow-GRPO alone, 1 seed x 16 iterations (`QUICK`). `--suite` picks the
arms (`methods.arms`), `--arms` any arms of any suite, flowgrpo among them; `--set
SECTION.FIELD=VALUE` puts one more lever on every arm (e.g. `train.lora_rank=32`).

Each arm x seed is run `<prefix>-<arm>-s<seed>` (prefix `bench`, `quick` with --quick), the base
model run `<prefix>-base` (evaluated once, shared), all on one store. Re-running on the same store
resumes: finished stages are skipped. Keep one size per store. report.md and figures.json go to
the report directory.

The package `benchmarks/methods/` does the work, one concern a module (its `__init__` lists them).
Dated sizing, timings and what earlier runs found: reports/bench-methods-history.md.
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
    parser.add_argument("--velocity-target", type=float, default=None,
                        help="every SDE arm's train.velocity_target instead of a KL target: each "
                             "iteration's lr set so that it changes the window's velocity by this "
                             "RMS per latent dim (about 0.0165 is the KL target 0.03 on Flow-GRPO's "
                             "[0, 3) at noise 0.7; use its own --store)")
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
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: write the report from what the store holds (the "
                             "latest finished record of every stage), e.g. after a code change, "
                             "which would make every stage run again")
    parser.add_argument("--reuse-finished", action="store_true",
                        help="read the runs the store holds finished as they are (whatever code "
                             "wrote them) and train only the others, e.g. new arms beside a "
                             "finished baseline after a code change")
    parser.add_argument("--runs-as", action="append", default=[], metavar="ARM=STORED",
                        help="read and write ARM's runs as <prefix>-STORED-s<seed> (repeatable), "
                             "e.g. runs trained before the arm's recipe changed name; the run "
                             "pin refuses runs trained with another recipe")
    for flag in ("seeds", "iterations", "per-iteration", "group-size", "probe-images",
                 "pool-images", "hard-images", "eval-images", "held-out-prompts"):
        parser.add_argument(f"--{flag}", type=int, default=None,
                            help=f"override Size.{flag.replace('-', '_')}")
    args = parser.parse_args(argv)
    if args.lr is not None and not args.lr > 0:
        parser.error(f"--lr must be > 0; got {args.lr}")
    if args.kl_target is not None and not args.kl_target > 0:
        parser.error(f"--kl-target must be > 0 nats; got {args.kl_target}")
    if args.velocity_target is not None and not args.velocity_target > 0:
        parser.error(f"--velocity-target must be > 0; got {args.velocity_target}")
    if args.velocity_target is not None and args.kl_target is not None:
        parser.error("--velocity-target replaces the KL target: drop --kl-target")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1; got {args.jobs}")
    if args.guidance is not None and not args.guidance >= 1.0:
        parser.error(f"--guidance must be >= 1 (1 is no guidance); got {args.guidance}")
    try:
        settings = parse_settings(args.set)
    except ValueError as e:
        parser.error(str(e))
    if args.velocity_target is not None:
        settings["train.velocity_target"] = args.velocity_target
    aliases = {}
    for pair in args.runs_as:
        arm, sep, stored = pair.partition("=")
        if not sep or not arm.strip() or not stored.strip():
            parser.error(f"--runs-as takes ARM=STORED (e.g. cast=cast-sample-ratio); got {pair!r}")
        aliases[arm.strip()] = stored.strip()
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
    shown_kl = protocol.kl_target if args.velocity_target is None else None  # else in settings
    print(f"protocol: {protocol.about} -> "
          f"{size}, CFG {protocol.guidance or 'of the recipes'}, pool prompts "
          f"{protocol.pool_prompts or 'all'}, lr {protocol.lr or 'of the recipes'}"
          f"{f', KL target {protocol.kl_target:g} nats' if shown_kl else ''}"
          f"{f', set {settings}' if settings else ''}; store "
          f"{store}, report {report}", flush=True)
    run_benchmark(size, store, report, "quick" if args.quick else "bench", args.threads,
                  command.strip(), args.suite, protocol.lr, only, quick=args.quick,
                  guidance=protocol.guidance, pool_prompts=protocol.pool_prompts, jobs=args.jobs,
                  kl_target=protocol.kl_target, settings=settings, report_only=args.report_only,
                  reuse_finished=args.reuse_finished, aliases=aliases)


if __name__ == "__main__":
    main()
