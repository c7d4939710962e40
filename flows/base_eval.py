"""Base evaluation of a shapes backbone: per-tag strict accuracy and mean atom score.

    .venv/bin/python -m flows.base_eval --checkpoint data/base/shapes-base

Samples the eval and hard splits (4 images a prompt, seeds derived from the prompt text), scores
every atom with the exact verifier and prints one table per split (markdown).

    .venv/bin/python -m flows.base_eval --sensitivity [--splits eval]

prints instead, per split, how much the model listens to each kind of word: its flow-matching
loss at fixed noise levels with the true prompt, with one shape / colour / count word swapped, and
with the empty prompt (`cast_core.shapes.sensitivity`; no sampling, a minute on CPU).
"""

from __future__ import annotations

import argparse
import time

import torch

from cast_core.backbones.shapes import BACKBONE_FILE, ShapesBackbone
from cast_core.backbones.source import source_problem
from cast_core.metrics import summarise_by_atom_type, summarise_by_tag
from cast_core.shapes.prompts import load_prompt_file
from cast_core.shapes.sensitivity import (
    WORD_TYPES,
    SensitivityRow,
    swap_word,
    word_sensitivity,
)
from tasks.reporting.markdown import table
from tasks.stages.evaluate import evaluate_records


def format_table(title: str, results) -> str:
    """Markdown: the title, then per tag and per atom type the accuracies and mean atom score."""
    tags = table(["tag", "images", "strict acc", "atom acc", "mean atom score"],
                 [[row.name, row.images, f"{row.strict_accuracy:.3f}", f"{row.atom_accuracy:.3f}",
                   f"{row.mean_atom_score:.3f}"] for row in summarise_by_tag(results)],
                 align="lrrrr")
    types = table(["atom type", "atom acc", "mean score"],
                  [[kind, f"{acc:.3f}", f"{mean:.3f}"]
                   for kind, (acc, mean) in summarise_by_atom_type(results).items()],
                  align="lrr")
    return "\n".join([f"### {title}", "", tags, "", types])


def format_sensitivity(rows: list[SensitivityRow]) -> str:
    """A markdown table of the word-sensitivity rows (`cast_core.shapes.sensitivity`)."""
    return table(["word", "t", "scenes", "loss, true prompt", "one word swapped", "empty prompt",
                  "swap gap", "text gain"],
                 [[r.word_type, f"{r.t:.2f}", r.scenes, f"{r.loss_true:.4f}",
                   f"{r.loss_swapped:.4f}", f"{r.loss_empty:.4f}", f"{r.swap_gap:+.1%}",
                   f"{r.text_gain:+.1%}"] for r in rows], align="lrrrrrrr")


def select_tags(records: list[dict], tags: list[str] | None) -> list[dict]:
    """The records of the given tags (all when tags is None); a clear error when none match."""
    if tags is None:
        return records
    chosen = [r for r in records if r.get("tag") in tags]
    if not chosen:
        known = sorted({r.get("tag") for r in records})
        raise SystemExit(f"no prompt has a tag in {tags}; this split's tags are {known}")
    return chosen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="data/base/shapes-base")
    parser.add_argument("--splits", nargs="+", default=["eval", "hard"])
    parser.add_argument("--images-per-prompt", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tags", nargs="+", default=None,
                        help="only the prompts of these tags (e.g. single_object)")
    parser.add_argument("--sensitivity", action="store_true",
                        help="print the word-sensitivity table instead of sampling")
    parser.add_argument("--scenes", type=int, default=128,
                        help="scenes per word type for --sensitivity")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    problem = source_problem(args.checkpoint, "--checkpoint", BACKBONE_FILE, hub_allowed=False)
    if problem:
        raise SystemExit(f"base_eval: {problem}")
    backbone = ShapesBackbone.from_pretrained(args.checkpoint).eval()
    if args.sensitivity:
        for split in args.splits:
            records = select_tags(load_prompt_file(f"data/prompts/{split}.jsonl"), args.tags)
            types = tuple(w for w in WORD_TYPES if any(swap_word(r["prompt"], w) for r in records))
            rows = word_sensitivity(backbone, records, scenes=args.scenes, word_types=types)
            print(f"### {split} split: word sensitivity of {args.checkpoint}\n")
            print(format_sensitivity(rows))
            print()
        return
    for split in args.splits:
        started = time.time()
        records = select_tags(load_prompt_file(f"data/prompts/{split}.jsonl"), args.tags)
        results = evaluate_records(backbone, records, images_per_prompt=args.images_per_prompt,
                                   num_steps=args.steps, guidance_scale=args.guidance)
        print(format_table(f"{split} split ({args.steps} Euler steps, CFG {args.guidance}, "
                           f"{time.time() - started:.0f} s)", results))
        print()


if __name__ == "__main__":
    main()
