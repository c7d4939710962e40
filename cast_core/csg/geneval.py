"""Scene graph of a GenEval metadata record (`graph_from_geneval`): one noun phrase per clause of
its "include" list (class, count, colour) and, for a position prompt, one edge. GenEval's metadata
lists a position prompt's reference object first and the subject second (with "position": [rel,
0]); the positioned clause comes first here, so the graph is the one that
`cast_core.csg.parser.parse_prompt` gives for the prompt text.
"""

from __future__ import annotations

from typing import Any

from cast_core.csg.build import NounPhrase, PromptParseError, build_graph, fail
from cast_core.csg.graph import RELATIONS, SceneGraph

COLOR_WORDS: tuple[str, ...] = ("red", "orange", "yellow", "green", "blue", "purple", "pink",
                                "brown", "black", "white", "gray", "grey")


def graph_from_geneval(record: dict[str, Any]) -> SceneGraph:
    """Scene graph of a GenEval metadata record ({"tag", "include", "prompt", ...})."""
    prompt, include = record.get("prompt"), record.get("include")
    if not isinstance(prompt, str) or not isinstance(include, list) or not include:
        raise PromptParseError(f"GenEval record needs a str 'prompt' and a non-empty 'include' "
                               f"list, got {record!r}")
    order, relation = _clause_order(include, prompt)
    phrases = [_clause_phrase(include[i], prompt) for i in order]
    return build_graph(prompt, phrases, [(0, relation, 1)] if relation else [], record.get("tag"))


def _clause_order(include: list[Any], prompt: str) -> tuple[list[int], str | None]:
    """Clause indices in prompt order (a positioned clause, the subject, comes first)."""
    positioned = [i for i, c in enumerate(include) if isinstance(c, dict) and "position" in c]
    if not positioned:
        return list(range(len(include))), None
    i = positioned[0]
    position = include[i]["position"]
    valid = (len(include) == 2 and len(positioned) == 1 and isinstance(position, (list, tuple))
             and len(position) == 2 and position[0] in RELATIONS and position[1] == 1 - i)
    if not valid:
        raise fail(prompt, f"metadata position must be one [relation, other index] joining "
                           f"exactly two clauses, relation in {RELATIONS}; got {include!r}")
    return [i, 1 - i], position[0]


def _clause_phrase(clause: Any, prompt: str) -> NounPhrase:
    ok = isinstance(clause, dict) and isinstance(clause.get("class"), str) and clause["class"]
    count = clause.get("count") if ok else None
    if not ok or isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 10:
        raise fail(prompt, f"metadata clause {clause!r} needs a non-empty 'class' and an int "
                           "'count' in 1..10")
    color = clause.get("color")
    if color is not None and color not in COLOR_WORDS:
        raise fail(prompt, f"metadata colour {color!r} is not one of {COLOR_WORDS}")
    return NounPhrase(clause["class"], count, (("color", color),) if color else ())
