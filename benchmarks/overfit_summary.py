"""Summarise `overfit_curve.py` rows: per arm, the gain at one iteration per seed, its mean with a
95% t-interval over seeds, and the paired difference to a reference arm (same seeds).

    .venv/bin/python benchmarks/overfit_summary.py --iteration 11 --reference flowgrpo \
        --arm flowgrpo=rows/flowgrpo.jsonl --arm cast=rows/cast.jsonl ... --out report_dir

Prints a markdown table and writes `figures.json` (one entry per arm: name, value, interval,
seeds, the per-seed gains, and the paired difference to the reference) to `--out` when given.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # the methods package, loaded by path

from methods import stats

from tasks.reporting.markdown import table


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the benchmark's 95% Student t-interval over `values` (nan bounds for
    one value)."""
    ci = stats.t_interval(values)
    nan = float("nan")
    return ci.mean, nan if ci.low is None else ci.low, nan if ci.high is None else ci.high


def gains(path: Path, iteration: int) -> dict[int, float]:
    """{seed: gain over the base at `iteration`} from an overfit_curve rows file (last row wins)."""
    out = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["iteration"] == iteration:
            out[row["seed"]] = row["gain"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iteration", type=int, required=True)
    ap.add_argument("--reference", required=True)
    ap.add_argument("--arm", action="append", required=True, metavar="NAME=ROWS.jsonl")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    arms = {name: gains(Path(path), args.iteration)
            for name, path in (a.split("=", 1) for a in args.arm)}
    if args.reference not in arms:
        raise SystemExit(f"--reference {args.reference!r} is not among the arms {list(arms)}")
    ref = arms[args.reference]
    rows, figures = [], []
    for name, by_seed in arms.items():
        seeds = sorted(by_seed)
        mean, lo, hi = t_interval([by_seed[s] for s in seeds])
        paired = sorted(set(seeds) & set(ref))
        d_mean, d_lo, d_hi = t_interval([by_seed[s] - ref[s] for s in paired])
        per_seed = " / ".join(f"{by_seed[s]:+.3f}" for s in seeds)
        diff = "-" if name == args.reference else f"{d_mean:+.3f} [{d_lo:+.3f}, {d_hi:+.3f}]"
        rows.append([name, per_seed, f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}]", diff])
        figures.append({"name": f"{name} gain at iteration {args.iteration}", "value": mean,
                        "interval": [lo, hi], "seeds": seeds,
                        "per_seed": [by_seed[s] for s in seeds],
                        "minus_reference": None if name == args.reference else d_mean,
                        "minus_reference_interval": None if name == args.reference
                        else [d_lo, d_hi],
                        "how": "mean atom score on 32 images with fresh noise, minus the base's; "
                               "mean over seeds, 95% t-interval over seeds; paired per seed"})
    text = table(["arm", "gain per seed", "mean [95% t]", f"- {args.reference}, paired [95% t]"],
                 rows)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
