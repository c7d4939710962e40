"""Benchmark: reading one run's stage records from a store of many runs, before and after the
per-process part cache (`tasks.store.parts`).

    .venv/bin/python benchmarks/bench_store_reads.py [--runs 20] [--iterations 40]
        [--stages 7] [--repeats 5] [--json out.json]

Run it from the repository root. It writes a synthetic store of `runs` x `iterations` x
`stages` completion records (one `stages` part each, as the stages write them), then measures, in
CPU seconds (medians over `repeats`, each from a fresh cache):
- scan: one filtered dataset scan of every part (the read before the cache, and still a
  process's first read of a table);
- second: a process's second read (every part read whole once, into the cache);
- warm: every later read (the parts' stats and one filter).
It prints the three and warm / scan. `Store.stage_records(run)` does this read in every Prefect
task's guard and `train_epoch` in every iteration, so a process that trains many iterations pays
`second` once and `warm` after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow.compute as pc
import pyarrow.dataset as ds

from tasks.store import parts
from tasks.store.records import stage_part
from tasks.store.schemas import TABLES
from tasks.store.store import Store


def fill(store: Store, runs: int, iterations: int, stages: int) -> int:
    """Write runs x iterations x stages completion rows -> their number."""
    now = datetime.now(UTC)
    n = 0
    for r in range(runs):
        for it in range(iterations):
            for s in range(stages):
                row = {"run_id": f"run-{r}", "iteration": it, "stage": f"stage_{s}",
                       "cache_key": f"k{r}-{it}-{s}", "rows": 1, "content_hash": "0" * 64,
                       "paths": [f"tables/x/run-{r}-{it}.parquet"], "code_version": "bench",
                       "started_at": now, "finished_at": now, "path_hashes": ["0" * 64]}
                store.write_table("stages", [row],
                                  stage_part(f"run-{r}", it, f"stage_{s}", row["cache_key"]))
                n += 1
    return n


def cpu(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--stages", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(tmp)
        n = fill(store, args.runs, args.iterations, args.stages)
        files = store.parts("stages")
        schema = TABLES["stages"].schema
        wanted = pc.field("run_id") == "run-0"

        def scan():
            ds.dataset([str(f) for f in files], schema=schema,
                       format="parquet").to_table(filter=wanted)

        times = {"scan": [], "first": [], "second": [], "warm": []}
        for _ in range(args.repeats):
            parts.clear_cache()
            times["scan"].append(cpu(scan))
            for label in ("first", "second", "warm"):
                times[label].append(cpu(lambda: store.stage_records("run-0")))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{n} stage parts ({args.runs} runs x {args.iterations} iterations x "
              f"{args.stages} stages); CPU s, median of {args.repeats}:")
        for k, v in med.items():
            print(f"  {k:7s} {v:.3f}   [{min(times[k]):.3f}, {max(times[k]):.3f}]")
        print(f"  warm / scan {med['warm'] / med['scan']:.3f}; second / scan "
              f"{med['second'] / med['scan']:.2f}")
        if args.json:
            Path(args.json).write_text(json.dumps({"parts": n, "cpu_s": times,
                                                   "median": med}, indent=1) + "\n")


if __name__ == "__main__":
    main()
