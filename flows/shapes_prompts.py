"""The shapes world's prompt files: the train / eval / hard splits and the RL training pool.

    python -m flows.shapes_prompts --out data/prompts --seed 0
    python -m flows.shapes_prompts pool --out data/prompts/pool.jsonl

The grammar, the splits and the pool's rules are `cast_core.shapes.prompts` (`make_splits`,
`make_pool`); this command line only writes their records as JSONL, one record a line, and prints
the count per tag. The same seed gives byte-identical files (data/prompts/README.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from cast_core.shapes.prompts import (
    HARD_TAGS,
    POOL_SIZE,
    TAGS,
    load_prompt_file,
    make_pool,
    make_splits,
)


def pool_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m flows.shapes_prompts pool",
                                     description="Write the RL training pool (rules: "
                                     "cast_core.shapes.prompts.make_pool).")
    parser.add_argument("--out", type=Path, default=Path("data/prompts/pool.jsonl"))
    parser.add_argument("--train", type=Path, default=Path("data/prompts/train.jsonl"))
    parser.add_argument("--held-out", type=Path, nargs="+",
                        default=[Path("data/prompts/eval.jsonl"), Path("data/prompts/hard.jsonl")])
    parser.add_argument("--size", type=int, default=POOL_SIZE)
    args = parser.parse_args(argv)
    held_out = [r for path in args.held_out for r in load_prompt_file(path)]
    records = make_pool(load_prompt_file(args.train), held_out, args.size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    tags = Counter(r["tag"] for r in records)
    print(f"{args.out}: {len(records)} prompts; " + ", ".join(f"{t} {tags[t]}" for t in HARD_TAGS))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["pool"]:
        pool_main(argv[1:])
        return
    parser = argparse.ArgumentParser(description="Write the shapes-world prompt splits (or, with "
                                     "`pool` first, the training pool).")
    parser.add_argument("--out", type=Path, default=Path("data/prompts"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, records in make_splits(args.seed).items():
        lines = "".join(json.dumps(r) + "\n" for r in records)
        (args.out / f"{name}.jsonl").write_text(lines, encoding="utf-8")
        tags = Counter(r["tag"] for r in records)
        print(f"{name}: {len(records)} prompts; " + ", ".join(f"{t} {tags[t]}" for t in TAGS))


if __name__ == "__main__":
    main()
