"""Flow `pretrain-shapes`: train the embedded shapes backbone from scratch and save it under data/.

Reproduce the committed base model (see data/base/README.md for the figures of that run):

    .venv/bin/python -m flows.pretrain_shapes --steps 8000 --out data/base/shapes-base

It resumes from `--work-dir` if a previous run was interrupted. `--no-prefect` runs the same task
function without starting a Prefect API server. `--patch-size` and `--layers` change the
transformer (defaults: the committed model's, `ShapesBackboneConfig`); they apply to a run from
scratch (`--init-from` keeps the loaded model's architecture). `--tag-weights single_object=3
two_object=2` draws those tags 3 and 2 times as often as each other tag (default: uniform).
"""

from __future__ import annotations

import argparse

from prefect import flow

from cast_core.backbones.shapes import ShapesBackboneConfig
from cast_core.shapes.pretrain import PretrainConfig
from tasks.stages.pretrain_shapes import pretrain_shapes, pretrain_shapes_task


@flow(name="pretrain-shapes")
def pretrain_shapes_flow(train_file: str, out_dir: str, work_dir: str, steps: int,
                         batch_size: int, seed: int, threads: int | None = None,
                         stop_after: int | None = None, init_from: str | None = None,
                         lr: float = PretrainConfig.lr, warmup_steps: int = PretrainConfig.warmup_steps,
                         t_shift: float = PretrainConfig.t_shift,
                         snapshot_every: int | None = None, model: dict | None = None,
                         tag_weights: dict[str, float] | None = None) -> dict:
    config = PretrainConfig(steps=steps, batch_size=batch_size, seed=seed, lr=lr,
                            warmup_steps=warmup_steps, t_shift=t_shift,
                            tag_weights=tuple(sorted((tag_weights or {}).items())))
    return pretrain_shapes_task(train_file, out_dir, work_dir, config,
                                ShapesBackboneConfig(**(model or {})),
                                threads=threads, stop_after=stop_after, init_from=init_from,
                                snapshot_every=snapshot_every)


def parse_tag_weights(items: list[str]) -> dict[str, float]:
    """["single_object=3", "two_object=2"] -> {"single_object": 3.0, "two_object": 2.0}."""
    out = {}
    for item in items:
        tag, sep, weight = item.partition("=")
        try:
            out[tag] = float(weight)
        except ValueError:
            sep = ""
        if not sep or not tag:
            raise argparse.ArgumentTypeError(
                f"--tag-weights takes TAG=WEIGHT pairs such as single_object=3; got {item!r}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-file", default="data/prompts/train.jsonl")
    parser.add_argument("--out", default="data/base/shapes-base")
    parser.add_argument("--work-dir", default="runs/pretrain-shapes")
    parser.add_argument("--steps", type=int, default=PretrainConfig.steps)
    parser.add_argument("--batch-size", type=int, default=PretrainConfig.batch_size)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--stop-after", type=int, default=None,
                        help="save the training state after this step and stop (resume later)")
    parser.add_argument("--init-from", default=None,
                        help="continue training from a saved shapes backbone folder")
    parser.add_argument("--lr", type=float, default=PretrainConfig.lr)
    parser.add_argument("--warmup-steps", type=int, default=PretrainConfig.warmup_steps)
    parser.add_argument("--t-shift", type=float, default=PretrainConfig.t_shift,
                        help="SD3 time shift of the training t distribution (>1: more high noise)")
    parser.add_argument("--snapshot-every", type=int, default=None,
                        help="also save the EMA weights as work-dir/ema-<step> every N steps")
    parser.add_argument("--patch-size", type=int, default=ShapesBackboneConfig.patch_size,
                        help="transformer patch size in pixels (a divisor of the image size)")
    parser.add_argument("--layers", type=int, default=ShapesBackboneConfig.num_layers,
                        help="transformer joint blocks")
    parser.add_argument("--tag-weights", nargs="+", default=[], metavar="TAG=WEIGHT",
                        help="draw these tags this many times as often (others: 1)")
    parser.add_argument("--no-prefect", action="store_true")
    args = parser.parse_args(argv)
    try:
        tag_weights = parse_tag_weights(args.tag_weights)
    except argparse.ArgumentTypeError as err:
        parser.error(str(err))
    model = {"patch_size": args.patch_size, "num_layers": args.layers}
    if args.init_from and model != {"patch_size": ShapesBackboneConfig.patch_size,
                                    "num_layers": ShapesBackboneConfig.num_layers}:
        parser.error("--patch-size/--layers shape a model trained from scratch; --init-from "
                     "keeps the loaded model's architecture: drop one of them")
    if args.no_prefect:
        config = PretrainConfig(steps=args.steps, batch_size=args.batch_size, seed=args.seed,
                                lr=args.lr, warmup_steps=args.warmup_steps, t_shift=args.t_shift,
                                tag_weights=tuple(sorted(tag_weights.items())))
        result = pretrain_shapes(args.train_file, args.out, args.work_dir, config,
                                 ShapesBackboneConfig(**model), threads=args.threads,
                                 stop_after=args.stop_after, init_from=args.init_from,
                                 snapshot_every=args.snapshot_every)
    else:
        result = pretrain_shapes_flow(
            train_file=args.train_file, out_dir=args.out, work_dir=args.work_dir, steps=args.steps,
            batch_size=args.batch_size, seed=args.seed, threads=args.threads,
            stop_after=args.stop_after, init_from=args.init_from, lr=args.lr,
            warmup_steps=args.warmup_steps, t_shift=args.t_shift,
            snapshot_every=args.snapshot_every, model=model, tag_weights=tag_weights)
    print(result)


if __name__ == "__main__":
    main()
