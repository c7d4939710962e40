"""The offline scene-graph parser, measured: parse rate and exactness on compositional prompts,
silently wrong graphs on every set, GenEval-format agreement, and parsing time.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_parser.py [--geneval FILE ...] [--repeats 5]
        [--refusals compositional_heldout3.jsonl]

Sets:
- held-out: tests/data/compositional_heldout.jsonl (356 prompts written before the first grammar
  round, whose refusals then guided the second) and tests/data/compositional_heldout2.jsonl (330
  prompts written before the second round, which guided the third) and
  tests/data/compositional_heldout3.jsonl (340 prompts written before the third round, which
  guided the fourth) and tests/data/compositional_heldout4.jsonl (346 prompts written before the
  fourth round, which guided the fifth) and tests/data/compositional_heldout5.jsonl (394 prompts
  written before the fifth round, which guided the sixth) and
  tests/data/compositional_heldout6.jsonl (331 prompts written before the sixth round, which guided
  the seventh) and tests/data/compositional_heldout7.jsonl (375 prompts written before the seventh
  round, which guided the eighth) and tests/data/compositional_heldout8.jsonl (332 prompts written
  before the eighth round, which guided the ninth) and tests/data/compositional_heldout9.jsonl
  (361 prompts written before the ninth round, which guided the tenth) and
  tests/data/compositional_heldout10.jsonl (352 prompts written before the tenth round, which
  also used its refusals: its figure after that round is not a held-out one) and
  tests/data/compositional_heldout11.jsonl (372 prompts written before the eleventh round, which
  also used its refusals) and tests/data/compositional_heldout12.jsonl (380 prompts written before
  the twelfth round, which also used its refusals) and tests/data/compositional_heldout13.jsonl
  (434 prompts written before the thirteenth round, which also used its refusals) and
  tests/data/compositional_heldout14.jsonl (415 prompts written before the fourteenth round), each
  with its intended graph; a line marked "refuse" is one its writer judged ambiguous or beyond
  the offline grammar, so a refusal of it is right (counted apart);
- table: tests/data/compositional_table.txt, the hand-written table of the unit tests;
- GenEval format: the committed shapes-world files (data/prompts/*.jsonl) and any `--geneval`
  JSONL files in GenEval's metadata format (GenEval's evaluation_metadata.jsonl, Flow-GRPO's
  test_metadata.jsonl files), each record parsed from its text twice, with its classes as the
  noun list and with none, and compared with the graph of its metadata.
"Exact" means the parsed graph equals the intended one; "silently wrong" means it parsed but is not
the intended graph; "refused" means it raised PromptParseError (and, for a list with lines marked
"refuse", how many of those were refused). Time: the median of `repeats` runs of
parsing the held-out prompts over and over to 10,000, and 10,000 GenEval-format prompts, as
wall-clock and as this process's CPU time (the steadier figure on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from test_csg_grammar import TABLE

from cast_core.csg.build import PromptParseError
from cast_core.csg.geneval import graph_from_geneval
from cast_core.csg.parser import parse_prompt
from cast_core.csg.vocab import ATTRIBUTE_KINDS


def shape(graph) -> tuple[list, list]:
    index = {n.id: i for i, n in enumerate(graph.nodes)}
    return ([(n.noun, n.count, n.attributes) for n in graph.nodes],
            [(index[e.subject], e.relation, index[e.object]) for e in graph.edges])


HELD_OUT = ("compositional_heldout.jsonl", "compositional_heldout2.jsonl",
            "compositional_heldout3.jsonl", "compositional_heldout4.jsonl",
            "compositional_heldout5.jsonl", "compositional_heldout6.jsonl",
            "compositional_heldout7.jsonl", "compositional_heldout8.jsonl",
            "compositional_heldout9.jsonl", "compositional_heldout10.jsonl",
            "compositional_heldout11.jsonl", "compositional_heldout12.jsonl",
            "compositional_heldout13.jsonl", "compositional_heldout14.jsonl")


def held_out(name: str) -> list[tuple[str, list, list]]:
    """(prompt, nodes, edges) of each line of a held-out file."""
    return [row[:3] for row in held_out_marked(name)]


def marked_refusals(name: str) -> set[str]:
    """Prompts of a held-out file whose writer marked them "refuse" (a refusal is right)."""
    return {prompt for prompt, _, _, refuse in held_out_marked(name) if refuse}


def held_out_marked(name: str) -> list[tuple[str, list, list, bool]]:
    """(prompt, nodes, edges, marked "refuse") of each line of a held-out file."""
    rows = []
    for line in (REPO / "tests/data" / name).read_text().splitlines():
        row = json.loads(line)
        nodes = [(n["noun"], n["count"], tuple(sorted(
            n["attributes"].items(), key=lambda kv: ATTRIBUTE_KINDS.index(kv[0]))))
            for n in row["nodes"]]
        rows.append((row["prompt"], nodes, [tuple(e) for e in row["edges"]],
                     bool(row.get("refuse"))))
    return rows


def score(rows: list[tuple[str, list, list]]) -> tuple[int, int, list[str]]:
    """(parsed, exact, prompts parsed silently wrong)."""
    parsed, exact, wrong = 0, 0, []
    for prompt, nodes, edges in rows:
        try:
            got = shape(parse_prompt(prompt))
        except PromptParseError:
            continue
        parsed += 1
        exact += got == (nodes, edges)
        if got != (nodes, edges):
            wrong.append(prompt)
    return parsed, exact, wrong


def report(name: str, rows: list, marked: frozenset[str] = frozenset()) -> None:
    parsed, exact, wrong = score(rows)
    n = len(rows)
    print(f"{name:<26} n={n:<5} parsed {parsed / n:6.1%}  exact {exact / n:6.1%}  "
          f"refused {(n - parsed) / n:6.1%}  silently wrong {len(wrong)}")
    if marked:
        refused = sum(1 for prompt in marked if not _parses(prompt))
        print(f"{'':<26} marked 'refuse' by the writer: {len(marked)}, refused {refused}")
    for prompt in wrong:
        print(f"    differs: {prompt!r}" + ("  (marked 'refuse')" if prompt in marked else ""))


def _parses(prompt: str) -> bool:
    try:
        parse_prompt(prompt)
    except PromptParseError:
        return False
    return True


def geneval(path: Path) -> tuple[int, int, int, int]:
    """(records, exact with noun list, exact without, silently wrong on either path)."""
    records = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    exact_listed = exact_free = wrong = 0
    for r in records:
        metadata = graph_from_geneval(r)
        for nouns in ({c["class"] for c in r["include"]}, None):
            try:
                same = parse_prompt(r["prompt"], r.get("tag"), nouns) == metadata
            except PromptParseError:
                continue
            wrong += not same
            exact_listed += same and nouns is not None
            exact_free += same and nouns is None
    return len(records), exact_listed, exact_free, wrong


def per_10k(prompts: list[str], repeats: int) -> tuple[list[float], list[float]]:
    """(wall-clock seconds, CPU seconds of this process) of each of `repeats` runs parsing the
    prompts over and over to 10,000; on a shared machine the CPU time is the steadier figure."""
    batch = (prompts * (10_000 // len(prompts) + 1))[:10_000]
    walls, cpus = [], []
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        for prompt in batch:
            try:
                parse_prompt(prompt)
            except PromptParseError:
                pass
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return walls, cpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geneval", type=Path, nargs="*", default=[])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--refusals", metavar="FILE", help="list a held-out file's refusals and "
                        "their reasons, then stop")
    args = parser.parse_args()
    if args.refusals:
        for prompt, _, _ in held_out(args.refusals):
            try:
                parse_prompt(prompt)
            except PromptParseError as error:
                print(f"{prompt!r}: {str(error).splitlines()[0]}")
        return
    rows = {name: held_out(name) for name in HELD_OUT}
    for name in HELD_OUT:
        report(f"held-out {name.removesuffix('.jsonl').removeprefix('compositional_')}", rows[name],
               frozenset(marked_refusals(name)))
    report("hand-written table", TABLE)
    files = sorted((REPO / "data/prompts").glob("*.jsonl")) + list(args.geneval)
    geneval_prompts = []
    for path in files:
        n, listed, free, wrong = geneval(path)
        print(f"GenEval format {path.name:<30} n={n:<5} exact with nouns {listed / n:6.1%}  "
              f"text only {free / n:6.1%}  silently wrong {wrong}")
        geneval_prompts += [json.loads(x)["prompt"] for x in path.read_text().splitlines()
                            if x.strip()]
    for name, prompts in (("held-out", [p for r in rows.values() for p, _, _ in r]), ("GenEval", geneval_prompts)):
        walls, cpus = per_10k(prompts, args.repeats)
        print(f"parse time per 10,000 {name} prompts: median {statistics.median(walls):.3f} s "
              f"(min {min(walls):.3f}, max {max(walls):.3f}, n={len(walls)}); CPU median "
              f"{statistics.median(cpus):.3f} s (min {min(cpus):.3f}, max {max(cpus):.3f})")


if __name__ == "__main__":
    main()
