"""Reading a recipe's prompt files: the shapes world's strict checker, or GenEval-style JSONL for the
real backbones.

Shapes recipes use `cast_core.shapes.prompts.load_prompt_file` (every clause checked against the
world's classes and colours, the prompt against its clauses). Real-model recipes read any JSONL
whose lines are objects with a string `prompt`, an optional string `tag` and, for the GenEval
parser, GenEval's `include` clauses (GenEval's own `evaluation_metadata.jsonl` works as it is);
free-form prompts without `include` need an LLM builder. Either way a bad line raises
`PromptFileError` naming the file and line before anything is written, and so does a file with no
prompts (empty, or only blank lines), which once gave a run of zero CSGs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cast_core.shapes.prompts import PromptFileError, load_prompt_file
from tasks.recipe import Recipe


def load_prompts(recipe: Recipe, path: str | Path) -> list[dict[str, Any]]:
    """The records of a prompt file, checked for the recipe's backbone family and builder; a file
    without prompts raises PromptFileError naming it."""
    records = (load_prompt_file(path) if recipe.backbone.family == "shapes"
               else _load_jsonl(path, needs_clauses=recipe.builder.kind == "geneval-parser"))
    if not records:
        raise PromptFileError(f"{path}: no prompts (the file is empty or has only blank lines); "
                              f"point the recipe at a JSONL file with one prompt per line")
    return records


def _load_jsonl(path: str | Path, needs_clauses: bool) -> list[dict[str, Any]]:
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(_check(json.loads(line), needs_clauses))
            except ValueError as err:
                raise PromptFileError(f"{path}, line {line_no}: {err}") from err
    return records


def _check(record: Any, needs_clauses: bool) -> dict[str, Any]:
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise ValueError("each line must be a JSON object with a string 'prompt'")  # noqa: TRY004
    if "tag" in record and not isinstance(record["tag"], str):
        raise ValueError(f"'tag' must be a string, got {record['tag']!r}")
    if needs_clauses and not isinstance(record.get("include"), list):
        raise ValueError(f"prompt {record['prompt']!r} has no GenEval 'include' clauses, which "
                         f"builder.kind = 'geneval-parser' needs; add them or use an LLM builder "
                         f"(builder.kind = 'llm-chat' or 'llm-local')")
    return record
