"""Benchmark of one RL iteration: bare compute, the stage functions, the Prefect flow, and a re-run.

    .venv/bin/python benchmarks/bench_iteration.py [--recipe data/recipes/shapes-cast.toml]
        [--repeats 3] [--ray-repeats N] [--threads N] [--set FIELD=JSON ...] [--json figures.json]
        [--keep]

Run it from the repository root. Every timed repeat is iteration 0 of a fresh store, so nothing is
skipped and every arm samples the same prompts with the same seeds:
- bare: the cast_core functions called directly in this process, no store and no Prefect. It loads
  the backbone from disk twice (once to sample, once to train), as the rollout and train stages
  each do; it includes decoding to uint8 images (what the verifier sees in the pipeline), the
  verifier, the advantage math, `policy_update` and the diagnostics the training stage computes
  (the update's KL in nats, which sets the next lr, and the rollouts' high-frequency energy).
  Prompt choice and the window are taken from a
  store built once beforehand (the run-level stages) and are not timed. It calls the stages' own
  pure functions (`group_seeds`, `decode_uint8`, `atom_score_rows`, `atom_batch`,
  `batch_credit`, `pick_advantage`, `policy_config`), so it does exactly the stages' work: its
  LoRA must equal the stages' bitwise (printed as the same-work check;
  tests/test_bench_iteration.py).
- stages: the stage functions of tasks/stages/*.py called directly on a fresh store (next_iteration,
  rollout, score_atoms, compute_advantages, train_epoch, report). The run-level stages
  (build_csgs, calibrate_window) run first on that store and are reported apart: they run once per
  run, not per iteration.
- flow: `flows.cast.cast` in-process (Prefect's temporary local server, started before the timed
  runs by a no-op flow; a second no-op flow is reported as the cost of an empty flow run), on a
  copy of a store whose run-level stages are done; the flow-run wall time as seen by this process.
  Its flow runs send no heartbeats, as the command line's on its temporary server
  (`flows.launch.temporary_server_settings`).
- rerun: the flow again with `iteration=0` on the store the flow just finished (every stage skips).
- executors: the iteration through `tasks.stages.iteration` on the local executor and on resident
  Ray actors (a local cluster), alternating; ray / local is Ray's fixed cost (benchmarks/ray_arm.py).
Within each repeat the stages arm runs before the bare arm, so one-time warm-up costs fall on the
pipeline, not on the baseline. Imports of tasks/flows happen inside functions because Prefect reads
PREFECT_HOME when it is imported; unless set, PREFECT_HOME is a folder in the work dir.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from ray_arm import TARGET_RAY, executor_arms, executor_lines, ray_ratio

from tasks.stages.iteration import RUN_STAGES

TARGET_FLOW_S = 45.0  # a default iteration (16 prompts x 8 samples) finishes in <= ~45 s wall
TARGET_OVERHEAD = 0.05  # orchestration + store overhead: flow / bare <= 1.05 (10% before 2026-12)
TARGET_RERUN = 0.10  # a finished iteration re-runs in <= 10% of its first run
ITERATION_STAGES = ("next_iteration", "rollout", "score_atoms", "compute_advantages",
                    "train_epoch", "report")
BARE_PARTS = ("load (rollout)", "rollout", "score", "advantages", "load (train)", "train",
              "train: update KL", "train: rollout hf energy")


class Clock:
    """Wall seconds per named part, in call order."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}

    def run(self, name: str, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.parts[name] = time.perf_counter() - start
        return out


def bare_iteration(recipe, picks: list[dict], window_row: dict) -> tuple[dict, dict]:
    """One iteration of the math alone -> (seconds per part, final LoRA tensors)."""
    from cast_core.batch_credit import batch_credit
    from cast_core.csg.graph import ATOM_TYPES, SceneGraph
    from cast_core.diagnostics import high_frequency_energy
    from cast_core.lr_schedule import linear_warmup_lr
    from cast_core.policy import policy_update
    from cast_core.rollout import rollout
    from cast_core.update_kl import update_kl_nats
    from tasks.stages.compute_advantages import atom_batch, credit_config
    from tasks.stages.models import load_policy, lora_tensors, scorer, set_threads
    from tasks.stages.rollout import decode_uint8, group_seeds, rollout_spec
    from tasks.stages.score_atoms import atom_score_rows
    from tasks.stages.train_update import pick_advantage, policy_config
    from tasks.store.stage import derive_seed

    set_threads(recipe)
    clock, g, cfg, tr = Clock(), recipe.prompts.group_size, recipe.advantage, recipe.train
    spec = rollout_spec(recipe, window_row)
    prompts = [p["prompt"] for p in picks for _ in range(g)]
    seeds, noise_seeds = group_seeds(recipe, picks, 0)
    graphs = [SceneGraph.from_json(p["graph_json"]) for p in picks]

    def sample(backbone):
        chunk = recipe.sampling.chunk_size
        result = rollout(backbone, prompts, seeds, spec, chunk_size=chunk, noise_seeds=noise_seeds)
        images = decode_uint8(backbone, result.x0, chunk)  # [N, 3, H, W]
        return result, images

    def score(images):
        return scorer(recipe)[1](images.float() / 255.0, [gr for gr in graphs for _ in range(g)])

    def advantages(scored, grid):
        samples = [{"prompt_id": p["prompt_id"], "sample_index": j} for p in picks
                   for j in range(g)]
        rows = atom_score_rows({}, samples, [gr for gr in graphs for _ in range(g)], scored, "")
        parents = {(p["prompt_id"], a.id): list(a.parents) for p, gr in zip(picks, graphs)
                   for a in gr.atoms()}
        _, batch = atom_batch(rows, [p["prompt_id"] for p in picks], g, parents)
        credit = batch_credit(batch, credit_config(cfg), grid, len(ATOM_TYPES))
        return pick_advantage({"maps": credit.maps, "atom": credit.atom,
                               "scalar": credit.scalar.advantages.reshape(-1).float()}, cfg.kind)

    def load_for_training():
        backbone, params = load_policy(recipe, None)
        return backbone, params, torch.optim.AdamW(params, lr=tr.lr, weight_decay=tr.weight_decay)

    def train(backbone, optimizer, result, adv):
        adv, loss_kind = adv
        return policy_update(backbone, optimizer, prompts, result, spec, adv,
                             policy_config(recipe, loss_kind),
                             lr_for_step=lambda j: linear_warmup_lr(tr.lr, tr.warmup_steps, j),
                             shuffle_seed=derive_seed(recipe.run.seed, "shuffle", 0))

    start = time.perf_counter()
    backbone, _ = clock.run("load (rollout)", load_policy, recipe, None)
    result, images = clock.run("rollout", sample, backbone)
    scored = clock.run("score", score, images)
    adv = clock.run("advantages", advantages, scored, tuple(result.log_probs.shape[-2:]))
    backbone, _, optimizer = clock.run("load (train)", load_for_training)
    clock.run("train", train, backbone, optimizer, result, adv)
    if recipe.sampling.noise_level > 0:  # the stage measures how far the update moved the policy
        clock.run("train: update KL", lambda: update_kl_nats(backbone, prompts, result, spec,
                                                             micro_batch=tr.micro_batch))
    clock.run("train: rollout hf energy",
              lambda: float(high_frequency_energy(images / 255.0).mean()))
    total = time.perf_counter() - start
    return {"total": total, **clock.parts}, lora_tensors(backbone)


def stage_iteration(recipe, root: Path) -> dict:
    """Run-level stages, then one iteration, through the stage functions on a fresh store."""
    from tasks.reporting.report import iteration_report
    from tasks.stages.build_csgs import build_csgs
    from tasks.stages.calibrate_window import calibrate_window
    from tasks.stages.compute_advantages import compute_advantages
    from tasks.stages.iteration import next_iteration
    from tasks.stages.rollout import rollout_groups
    from tasks.stages.score_atoms import score_atoms
    from tasks.stages.train_epoch import train_epoch
    from tasks.store.store import Store

    st, clock = Store(root), Clock()
    csgs = clock.run("build_csgs", build_csgs, st, recipe)
    window = clock.run("calibrate_window", calibrate_window, st, recipe)
    start = time.perf_counter()
    k = clock.run("next_iteration", next_iteration, st, recipe)
    ro = clock.run("rollout", rollout_groups, st, recipe, csgs, window, k)
    sc = clock.run("score_atoms", score_atoms, st, recipe, csgs, ro, k)
    ad = clock.run("compute_advantages", compute_advantages, st, recipe, ro, sc, k)
    clock.run("train_epoch", train_epoch, st, recipe, csgs, ro, sc, ad, k)
    with contextlib.redirect_stdout(io.StringIO()):
        clock.run("report", iteration_report, st, recipe, k)
    total = time.perf_counter() - start
    if any(ref.skipped for ref in (ro, sc, ad)) or k != 0:
        raise RuntimeError(f"stages arm at {root} skipped work or is not iteration 0")
    return {"total": total, **clock.parts}


def recorded_stage_seconds(root: Path, run_id: str, iteration: int) -> dict:
    """{stage: body seconds} of an iteration from the store's completion records."""
    from tasks.store.store import Store

    rows = Store(root).read_table("stages", {"run_id": run_id, "iteration": iteration}).to_pylist()
    return {r["stage"]: (r["finished_at"] - r["started_at"]).total_seconds() for r in rows}


def stored_lora(root: Path, run_id: str) -> dict:
    from tasks.store.store import Store

    st = Store(root)
    row = st.read_table("checkpoints", {"run_id": run_id, "iteration": 0}).to_pylist()[0]
    return st.get_tensors(row["lora_path"])


def start_prefect() -> tuple[float, float]:
    """Run a no-op flow so the temporary server is up before the timed flows, then a second one:
    (seconds of the first, incl. the server start; seconds of an empty flow run)."""
    from prefect import flow

    def bench_noop() -> None:
        return None

    noop, seconds = flow(name="bench-noop")(bench_noop), []
    for _ in range(2):
        start = time.perf_counter()
        noop()
        seconds.append(time.perf_counter() - start)
    return seconds[0], seconds[1]


def timed_flow(recipe_path: str, root: Path, overrides: dict, iteration: int | None) -> float:
    from flows.cast import cast

    start = time.perf_counter()
    cast(recipe=recipe_path, iteration=iteration, store=str(root), overrides=overrides or None)
    return time.perf_counter() - start


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values), "values": values}


def line(name: str, values: list[float]) -> str:
    s = summary(values)
    return (f"  {name:<36} median {s['median']:8.3f} s  (min {s['min']:.3f}, "
            f"max {s['max']:.3f}, n={s['n']})")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="data/recipes/shapes-cast.toml")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ray-repeats", type=int, default=None,
                        help="local/Ray pairs of the executor arms (default: --repeats)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (sets run.threads); default: the recipe's")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                        help="override a recipe field, e.g. --set prompts.per_iteration=4")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--workdir", default=None, help="where stores go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    args = parser.parse_args()
    if args.repeats < 1 or (args.ray_repeats or 1) < 1:
        parser.error("--repeats and --ray-repeats must be >= 1")
    from tasks.stages.recipe import parse_overrides

    overrides = parse_overrides(args.set)
    if args.threads is not None:
        overrides["run.threads"] = args.threads
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-iteration-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect-home"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")  # busy CPUs
    try:
        figures = measure(args.recipe, overrides, args.repeats, work,
                          args.ray_repeats or args.repeats)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report(figures)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1, default=str))
        print(f"figures written to {args.json}")


def measure(recipe_path: str, overrides: dict, repeats: int, work: Path,
            ray_repeats: int) -> dict:
    from tasks.stages.build_csgs import build_csgs
    from tasks.stages.calibrate_window import calibrate_window, read_window
    from tasks.stages.recipe import load_recipe
    from tasks.stages.rollout import select_prompts
    from tasks.store.store import Store

    recipe = load_recipe(recipe_path, overrides or None)
    run_id, load_before = recipe.run.name, os.getloadavg()
    template = Store(work / "template")  # run-level stages once: prompts and window for all arms
    csgs, window = build_csgs(template, recipe), calibrate_window(template, recipe)
    picks = select_prompts(template, recipe, csgs, 0)
    window_row = read_window(template, window)

    bare, stages = [], []
    for i in range(repeats):
        stages.append(stage_iteration(recipe, work / f"stages-{i}"))
        print(f"repeat {i}: stages {stages[-1]['total']:.2f} s", flush=True)
        parts, lora = bare_iteration(recipe, picks, window_row)
        bare.append(parts)
        print(f"repeat {i}: bare {parts['total']:.2f} s", flush=True)
        if i == 0:  # the two arms must do the same work: same prompts, seeds, update
            stored = stored_lora(work / "stages-0", run_id)
            lora_diff = max(float((stored[n] - t).abs().max()) for n, t in lora.items())

    executors = executor_arms(recipe_path, overrides, ray_repeats, template.root, work)
    from prefect.settings import temporary_settings

    from flows.launch import temporary_server_settings

    with temporary_settings(updates=temporary_server_settings()):  # as `python -m flows.cast`
        server_s, noop_s = start_prefect()
        flow, rerun, flow_stages = [], [], []
        for i in range(repeats):
            root = work / f"flow-{i}"
            shutil.copytree(template.root, root)
            flow.append(timed_flow(recipe_path, root, overrides, None))
            flow_stages.append(recorded_stage_seconds(root, run_id, 0))
            rerun.append(timed_flow(recipe_path, root, overrides, 0))
            print(f"repeat {i}: flow {flow[-1]:.2f} s, rerun {rerun[-1]:.2f} s", flush=True)

    def column(rows: list[dict], name: str) -> list[float]:
        return [r[name] for r in rows if name in r]

    figures = {
        "recipe": recipe_path, "overrides": overrides, "repeats": repeats,
        "threads": recipe.run.threads, "samples": recipe.derived()["samples_per_iteration"],
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "cpu_count": os.cpu_count(), "prefect_server_start_s": server_s,
        "prefect_empty_flow_s": noop_s,
        "lora_max_abs_diff_bare_vs_stages": lora_diff,
        "bare": {"total": summary(column(bare, "total")),
                 "parts": {p: summary(column(bare, p)) for p in BARE_PARTS
                           if column(bare, p)}},
        "stages": {"total": summary(column(stages, "total")),
                   "parts": {p: summary(column(stages, p)) for p in ITERATION_STAGES},
                   "run_level": {p: summary(column(stages, p)) for p in RUN_STAGES}},
        "flow": {"total": summary(flow),
                 "recorded_stage_bodies": {p: summary(column(flow_stages, p))
                                           for p in ITERATION_STAGES[1:-1]}},
        "rerun": {"total": summary(rerun),
                  "ratio_to_first_run": summary([r / f for r, f in zip(rerun, flow)])},
        "executors": executors,
    }
    return figures | {"ratios": ratios(figures)}


def ratios(fig: dict) -> dict:
    """Ratios of the arms' medians and the three targets' verdicts."""
    bare, stages = fig["bare"]["total"]["median"], fig["stages"]["total"]["median"]
    flow = fig["flow"]["total"]["median"]
    rerun = fig["rerun"]["ratio_to_first_run"]["median"]
    return {"stages_over_bare": stages / bare, "flow_over_stages": flow / stages,
            "flow_over_bare": flow / bare, "overhead_share_of_flow": (flow - bare) / flow,
            "rerun_over_first_run": rerun, "ray_over_local": ray_ratio(fig["executors"]),
            "pass_iteration_wall": flow <= TARGET_FLOW_S,
            "pass_overhead": flow / bare - 1 <= TARGET_OVERHEAD,
            "pass_rerun": rerun <= TARGET_RERUN,
            "pass_ray_overhead": ray_ratio(fig["executors"]) <= TARGET_RAY}


def report(fig: dict) -> None:
    flow, rerun = fig["flow"]["total"]["median"], fig["rerun"]["total"]["median"]
    r = fig["ratios"]
    load = ", ".join(f"{x:.2f}" for x in fig["load_average_before"])
    print(f"\nrecipe {fig['recipe']}  overrides {fig['overrides']}  samples/iteration "
          f"{fig['samples']}  threads {fig['threads']}  repeats {fig['repeats']}")
    print(f"load average before: {load} (cpus: {fig['cpu_count']}); other load skews all figures")
    print("bare (cast_core only; backbone loaded twice, as the stages do):")
    for name, s in fig["bare"]["parts"].items():
        print(line(name, s["values"]))
    print(line("TOTAL bare", fig["bare"]["total"]["values"]))
    print("stages (tasks/stages/*.py functions on a fresh store, no Prefect):")
    for name, s in fig["stages"]["parts"].items():
        print(line(name, s["values"]))
    print(line("TOTAL stages (per iteration)", fig["stages"]["total"]["values"]))
    for name, s in fig["stages"]["run_level"].items():
        print(line(f"run-level: {name}", s["values"]))
    print("flow (flows.cast.cast in-process, run-level stages already done):")
    for name, s in fig["flow"]["recorded_stage_bodies"].items():
        print(line(f"recorded body: {name}", s["values"]))
    print(line("TOTAL flow (per iteration)", fig["flow"]["total"]["values"]))
    print(line("rerun of a finished iteration", fig["rerun"]["total"]["values"]))
    print(f"  untimed: Prefect temporary server start + first flow {fig['prefect_server_start_s']:.1f}"
          f" s; an empty flow run {fig['prefect_empty_flow_s']:.2f} s")
    print(f"  same work check: max |LoRA bare - LoRA stages| = "
          f"{fig['lora_max_abs_diff_bare_vs_stages']:.2e} (must be 0)")
    print("\n".join(executor_lines(fig["executors"], line)))
    print("ratios (of medians):")
    print(f"  stages / bare = {r['stages_over_bare']:.3f}  "
          f"(store overhead {r['stages_over_bare'] - 1:+.1%})")
    print(f"  flow / stages = {r['flow_over_stages']:.3f}  "
          f"(Prefect overhead {r['flow_over_stages'] - 1:+.1%})")
    print(f"  flow / bare   = {r['flow_over_bare']:.3f}  (orchestration + store overhead "
          f"{r['flow_over_bare'] - 1:+.1%}; {r['overhead_share_of_flow']:.1%} of the flow's wall)")
    print(f"  rerun / first run = {r['rerun_over_first_run']:.3f} (median of per-repeat ratios; "
          f"of medians {rerun / flow:.3f})")
    print("targets:")
    print(f"  {verdict(r['pass_iteration_wall'])}  iteration wall (flow median) {flow:.1f} s "
          f"<= ~{TARGET_FLOW_S:.0f} s (meant for the default recipe, {fig['samples']} samples here)")
    print(f"  {verdict(r['pass_overhead'])}  orchestration + store overhead "
          f"{r['flow_over_bare'] - 1:.1%} <= {TARGET_OVERHEAD:.0%} (flow vs bare)")
    print(f"  {verdict(r['pass_rerun'])}  rerun {r['rerun_over_first_run']:.1%} of the first run "
          f"<= {TARGET_RERUN:.0%}")
    print(f"  {verdict(r['pass_ray_overhead'])}  Ray executor {r['ray_over_local']:.3f}x the local "
          f"executor <= {TARGET_RAY}x (its fixed cost; on {fig['cpu_count']} cores)")


if __name__ == "__main__":
    main()
