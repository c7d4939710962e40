"""Reading a recipe's prompt files: the shapes world's strict checker, or GenEval-style JSONL for the
real backbones.

Shapes recipes use `cast_core.shapes.prompts.load_prompt_file` (every clause checked against the
world's classes and colours, the prompt against its clauses). Real-model recipes read any JSONL
whose lines are objects with a string `prompt`, an optional string `tag` and, for the GenEval
parser, GenEval's `include` clauses (GenEval's own `evaluation_metadata.jsonl` works as it is);
free-form prompts without `include` need an LLM builder. Every file is checked whole before
anything is written, and each problem raises `PromptFileError` naming the file and line:
- bytes that are not UTF-8, a line that is not a JSON object with a string prompt, a prompt over
  `MAX_PROMPT_CHARS` characters, a file with no prompts (which once gave a run of zero CSGs);
- for the GenEval parser, a record whose `include` contradicts its prompt text, with both
  versions shown: the text is parsed with the record's classes as its noun list and must give the
  metadata's graph exactly. A text the parser cannot read is an error too, unless
  `allow_metadata_only` lets such records be built from their metadata alone;
- two records with the same prompt and different metadata (which one would a run use?).
`prompt_lines` keeps each record's line number, so the CSG stage can name it when the builder
fails on a record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cast_core.csg.build import PromptParseError
from cast_core.csg.geneval import graph_from_geneval
from cast_core.csg.graph import SceneGraph
from cast_core.csg.parser import MAX_PROMPT_CHARS, parse_prompt
from cast_core.csg.questions import node_description
from cast_core.shapes.prompts import PromptFileError, load_prompt_file, utf8_lines
from tasks.stages.recipe import Recipe


def load_prompts(recipe: Recipe, path: str | Path, *,
                 allow_metadata_only: bool = False) -> list[dict[str, Any]]:
    """The records of a prompt file, checked for the recipe's backbone family and builder (see
    the module docstring)."""
    return [record for _, record in prompt_lines(recipe, path,
                                                 allow_metadata_only=allow_metadata_only)]


def prompt_lines(recipe: Recipe, path: str | Path, *,
                 allow_metadata_only: bool = False) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) of each prompt in the file, checked as `load_prompts` does;
    metadata-only records are allowed when the argument or the recipe's
    `builder.allow_metadata_only` says so."""
    if recipe.backbone.family == "shapes":
        lines = list(enumerate(load_prompt_file(path), start=1))
    else:
        allowed = allow_metadata_only or recipe.builder.allow_metadata_only
        lines = _load_jsonl(path, recipe.builder.kind == "geneval-parser", allowed)
    if not lines:
        raise PromptFileError(f"{path}: no prompts (the file is empty or has only blank lines); "
                              f"point the recipe at a JSONL file with one prompt per line")
    _check_repeats(path, lines)
    return lines


def _load_jsonl(path: str | Path, needs_clauses: bool,
                allow_metadata_only: bool) -> list[tuple[int, dict[str, Any]]]:
    lines = []
    for line_no, line in utf8_lines(path):
        if not line.strip():
            continue
        try:
            lines.append((line_no, _check(json.loads(line), needs_clauses, allow_metadata_only)))
        except ValueError as err:
            raise PromptFileError(f"{path}, line {line_no}: {err}") from err
    return lines


def _check(record: Any, needs_clauses: bool, allow_metadata_only: bool) -> dict[str, Any]:
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise ValueError("each line must be a JSON object with a string 'prompt'")  # noqa: TRY004
    if "tag" in record and not isinstance(record["tag"], str):
        raise ValueError(f"'tag' must be a string, got {record['tag']!r}")
    if len(record["prompt"]) > MAX_PROMPT_CHARS:
        raise ValueError(f"the prompt is {len(record['prompt'])} characters long, more than the "
                         f"limit of {MAX_PROMPT_CHARS}; shorten it")
    if needs_clauses and not isinstance(record.get("include"), list):
        raise ValueError(f"prompt {record['prompt']!r} has no GenEval 'include' clauses, which "
                         f"builder.kind = 'geneval-parser' needs; add them or use an LLM builder "
                         f"(builder.kind = 'llm-chat' or 'llm-local')")
    if needs_clauses:
        _check_text_agrees(record, allow_metadata_only)
    return record


def _check_text_agrees(record: dict[str, Any], allow_metadata_only: bool) -> None:
    """The record's metadata graph must equal its text's graph (see the module docstring)."""
    metadata = graph_from_geneval(record)
    nouns = {c["class"] for c in record["include"]}
    try:
        text = parse_prompt(record["prompt"], record.get("tag"), nouns)
    except PromptParseError as err:
        if allow_metadata_only:
            return
        raise ValueError(f"{err}; so its 'include' metadata ({describe(metadata)}) cannot be "
                         f"checked against the text: fix the prompt, or allow metadata-only "
                         f"records (allow_metadata_only) to build it from the metadata alone"
                         ) from err
    if text != metadata:
        raise ValueError(f"prompt {record['prompt']!r}: its 'include' metadata contradicts its "
                         f"text; the text says {describe(text)}, the metadata says "
                         f"{describe(metadata)}; make them agree")


def describe(graph: SceneGraph) -> str:
    """A graph in words: "[a red circle, two blue squares; circle 0 left of square 1]"."""
    names = [node_description(n) if n.count > 1 else _article(node_description(n))
             for n in graph.nodes]
    index = {n.id: i for i, n in enumerate(graph.nodes)}
    edges = [f"{graph.node(e.subject).noun} {index[e.subject]} {e.relation} "
             f"{graph.node(e.object).noun} {index[e.object]}" for e in graph.edges]
    return "[" + ", ".join(names) + ("; " + ", ".join(edges) if edges else "") + "]"


def _article(words: str) -> str:
    return f"{'an' if words[0] in 'aeiou' else 'a'} {words}"


def _check_repeats(path: str | Path, lines: list[tuple[int, dict[str, Any]]]) -> None:
    first: dict[str, tuple[int, dict[str, Any]]] = {}
    for line_no, record in lines:
        metadata = {k: v for k, v in record.items() if k != "prompt"}
        seen = first.setdefault(record["prompt"], (line_no, metadata))
        if seen[1] != metadata:
            raise PromptFileError(
                f"{path}, lines {seen[0]} and {line_no}: the prompt {record['prompt']!r} appears "
                f"twice with different metadata ({json.dumps(seen[1], sort_keys=True)} and "
                f"{json.dumps(metadata, sort_keys=True)}); keep one record per prompt")
