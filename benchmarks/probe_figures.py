"""Tables and figures.json from the in-memory probes' JSONL rows (credit_probe, nft_probe,
grad_snr `--out` files).

    .venv/bin/python benchmarks/probe_figures.py --dir reports/learning-probes

Reads `<dir>/one-prompt.jsonl` and `<dir>/pool.jsonl` (probe rows: name "<arm>-s<seed>",
samples, probe) and `<dir>/grad-snr.jsonl` (grad_snr rows), writes `<dir>/tables.md` and
`<dir>/figures.json`. A learning arm's figure is its gain (probe at its last common checkpoint
minus the base's, paired: the same probe noise at both) per seed, with the mean over seeds and a
95% t-interval over seeds (none with one seed). A gradient estimator's figure is its mean
pairwise cosine with +-1.96 standard errors over pairs (pairs share batches: a rough interval).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from tasks.reporting.markdown import table

T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}  # t quantiles by degrees of freedom


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def learning_arms(rows: list[dict]) -> list[dict]:
    """One entry per arm: per-seed gains at the last checkpoint every seed reached."""
    curves: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        arm, seed = r["name"].rsplit("-s", 1)
        curves[arm][seed][r["samples"]] = r["probe"]  # a re-run overwrites: last row wins
    out = []
    for arm, seeds in sorted(curves.items()):
        common = set.intersection(*(set(c) for c in seeds.values()))
        last = max(common - {0}, default=None)
        if last is None:
            continue
        gains = [seeds[s][last] - seeds[s][0] for s in sorted(seeds)]
        mean = statistics.mean(gains)
        half = (T95[len(gains) - 1] * statistics.stdev(gains) / len(gains) ** 0.5
                if len(gains) > 1 else None)
        curve = {k: statistics.mean(seeds[s][k] for s in seeds) for k in sorted(common)}
        out.append({"arm": arm, "samples": last, "seeds": len(gains), "gains": gains,
                    "gain": mean, "interval": None if half is None else [mean - half, mean + half],
                    "base": statistics.mean(seeds[s][0] for s in seeds), "curve": curve})
    return out


def snr_rows(rows: list[dict]) -> list[dict]:
    return [{"estimator": r["name"], "batch": r["batch"], "pairs": r["pairs"],
             "cosine": r["cosine"], "interval": [r["cosine"] - 1.96 * r["se"],
                                                 r["cosine"] + 1.96 * r["se"]],
             "per_sample_snr": r["snr"], "seconds_per_batch": r["seconds_per_batch"]}
            for r in rows]


def learning_table(title: str, arms: list[dict]) -> list[str]:
    rows = []
    for a in arms:
        iv = ("" if a["interval"] is None
              else f" [{a['interval'][0]:+.3f}, {a['interval'][1]:+.3f}]")
        curve = ", ".join(f"{k}: {v:.3f}" for k, v in a["curve"].items())
        rows.append([a["arm"], a["seeds"], a["samples"], f"{a['base']:.3f}",
                     f"{a['gain']:+.3f}{iv}", " ".join(f"{g:+.3f}" for g in a["gains"]), curve])
    return [f"### {title}", "",
            table(["arm", "seeds", "samples", "base", "gain, mean [95% t]", "per seed",
                   "mean probe curve (samples: score)"], rows), ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="reports/learning-probes")
    args = ap.parse_args()
    d = Path(args.dir)
    one = learning_arms(read(d / "one-prompt.jsonl"))
    pool = learning_arms(read(d / "pool.jsonl"))
    snr = snr_rows(read(d / "grad-snr.jsonl"))
    lines = ["<!-- written by benchmarks/probe_figures.py from the JSONL rows beside it -->", ""]
    lines += learning_table("One prompt (a photo of a blue square)", one)
    lines += learning_table("Pool (32 hard prompts, 8 an iteration x 16; `pool8-` arms: its "
                            "first 8, all 8 every iteration)", pool)
    title = "### Gradient signal-to-noise (mean pairwise cosine of independent batch gradients)"
    lines += [title, "", table(
        ["estimator", "batch", "pairs", "cosine [+-1.96 SE]", "per-sample SNR", "s a batch"],
        [[s["estimator"], s["batch"], s["pairs"],
          f"{s['cosine']:+.4f} [{s['interval'][0]:+.4f}, {s['interval'][1]:+.4f}]",
          f"{s['per_sample_snr']:.1e}", f"{s['seconds_per_batch']:.1f}"] for s in snr])]
    (d / "tables.md").write_text("\n".join(lines) + "\n")
    (d / "figures.json").write_text(json.dumps(
        {"one_prompt": one, "pool": pool, "gradient_snr": snr}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
