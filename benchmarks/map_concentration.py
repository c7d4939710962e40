"""How CAST's stored advantage maps spread their credit, per run, read from a store.

    .venv/bin/python benchmarks/map_concentration.py --store runs/NAME/store RUN [RUN ...]
        [--json out.json]

Run it from the repository root. For every iteration of each run it reads the compute_advantages
stage's blob (`maps` [N, h, w], the CAST map pooled on the log-prob grid; `atom` [N], the no-map
credit; `scalar` [N], Flow-GRPO's advantage; every run stores all three whatever its
`advantage.kind`) and prints the medians over iterations [min, max] of:
- the map noise factor F (`cast_core.diagnostics.map_noise_factor`): how much more gradient noise
  the map's spatial shape costs, inside each sample's all-dims ratio, than a constant map with
  the same per-sample credit (1 for a constant map; 1 / f for credit concentrated on a fraction f
  of the positions);
- the correlation over samples of the map's spatial mean with the scalar advantage;
- the mean over prompts of each group's mean credit (map's spatial mean; the no-map credit) and the
  SD of that credit over samples: a scalar z-score has group mean 0, and a group mean above 0
  adds noise to the SDE objective's gradient (the score has mean 0) without signal;
- the share of within-group sample pairs that the no-map credit and the scalar advantage order
  oppositely (`cast_core.diagnostics.order_disagreement`; 0 for a credit that ranks a group as
  its mean atom score does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cast_core.diagnostics import map_noise_factor, order_disagreement
from tasks.store.store import Store


def iteration_figures(maps: Tensor, atom: Tensor, scalar: Tensor, prompts: list[str]) -> dict:
    """The figures of one iteration: maps [N, h, w], atom [N], scalar [N], prompts [N] (ids,
    each prompt's samples contiguous and equally many)."""
    maps, atom, scalar = maps.double(), atom.double(), scalar.double()
    mean = maps.flatten(1).mean(dim=1)  # [N] each map's spatial mean

    def group_mean(values: Tensor) -> float:
        groups = defaultdict(list)
        for p, v in zip(prompts, values.tolist()):
            groups[p].append(v)
        return statistics.fmean(statistics.fmean(v) for v in groups.values())

    return {"noise_factor": map_noise_factor(maps),
            "corr_map_scalar": float(torch.corrcoef(torch.stack([mean, scalar]))[0, 1]),
            "map_group_mean": group_mean(mean), "map_sd": float(mean.std(correction=0)),
            "atom_group_mean": group_mean(atom), "atom_sd": float(atom.std(correction=0)),
            "atom_scalar_flips": order_disagreement(*(v.view(len(set(prompts)), -1)
                                                      for v in (atom, scalar)))}


def run_figures(store: Store, run: str) -> dict[int, dict]:
    """{iteration: iteration_figures} of one run."""
    rows = store.read_table("advantage_maps", {"run_id": run}).to_pylist()
    if not rows:
        raise SystemExit(f"run {run!r} has no advantage_maps rows in {store.root}")
    by_it = defaultdict(list)
    for r in rows:
        by_it[r["iteration"]].append(r)
    out = {}
    for it, rs in sorted(by_it.items()):
        rs.sort(key=lambda r: (r["prompt_id"], r["sample_index"]))
        paths = {r["map_path"] for r in rs}
        if len(paths) != 1:
            raise SystemExit(f"run {run!r} iteration {it}: maps in {len(paths)} blobs; expected 1")
        blob = store.get_tensors(paths.pop())
        idx = torch.tensor([r["blob_index"] for r in rs])
        out[it] = iteration_figures(blob["maps"][idx], blob["atom"][idx], blob["scalar"][idx],
                                    [r["prompt_id"] for r in rs])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--json", default=None, help="write {run: {iteration: figures}} here")
    args = parser.parse_args()
    store, everything = Store(args.store), {}
    for run in args.runs:
        figures = everything[run] = run_figures(store, run)
        print(f"{run}: {len(figures)} iterations; median over iterations [min, max]")
        for name in next(iter(figures.values())):
            values = [f[name] for f in figures.values()]
            print(f"  {name:16s} {statistics.median(values):+.3f} "
                  f"[{min(values):+.3f}, {max(values):+.3f}]")
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1) + "\n")


if __name__ == "__main__":
    main()
