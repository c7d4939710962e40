"""What the offline builders build with: the noun phrase they read (`NounPhrase`), the error that
refuses a prompt (`PromptParseError`, made by `fail`; `LLM_HINT` points to the LLM builder)
and the scene graph of noun phrases and edges (`build_graph`), shared by the prompt-text path
(`cast_core.csg.parser`) and the GenEval-metadata path (`cast_core.csg.geneval`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cast_core.csg.graph import SceneGraph, validate_graph
from cast_core.csg.questions import object_node, relation_edge

LLM_HINT = "use the LLM builder (builder.kind = 'llm-chat' or 'llm-local') for prompts like this"


class PromptParseError(ValueError):
    """The prompt (or GenEval record) does not fit the grammar; the message names it and why."""


@dataclass(frozen=True)
class NounPhrase:
    """`count` instances of `noun` (singular) with `attributes` ((kind, value), kind order)."""

    noun: str
    count: int
    attributes: tuple[tuple[str, str], ...] = ()

    @property
    def color(self) -> str | None:
        return dict(self.attributes).get("color")


def fail(prompt: str, reason: str) -> PromptParseError:
    """The error that refuses `prompt` for `reason`, for the caller to raise."""
    return PromptParseError(f"cannot parse prompt {prompt!r}: {reason}")


def _between_pair(edges: list[tuple[int, str, int]], i: int, j: int,
                  phrases: list[NounPhrase]) -> list[int]:
    """The two objects of "i between A and B" when edge (i, between, j) is one of its two edges
    (objects of one), in order of appearance; [] otherwise."""
    pair = [b for a, r, b in edges if (a, r) == (i, "between") and phrases[b].count == 1]
    return pair if j in pair and len(pair) == 2 else []


def build_graph(prompt: str, phrases: list[NounPhrase],
                edges: Iterable[tuple[int, str, int]] = (), tag: str | None = None) -> SceneGraph:
    """Graph with node i for phrases[i] and edge k for edges[k] = (subject i, relation, object j)."""
    kinds = [(p.noun, p.attributes) for p in phrases]
    repeated = sorted({k for k in kinds if kinds.count(k) > 1}, key=str)
    if repeated:
        shown = [(noun, dict(attributes).get("color")) if {k for k, _ in attributes} <= {"color"}
                 else (noun, dict(attributes)) for noun, attributes in repeated]
        raise fail(prompt, f"noun phrases {shown} appear twice; state each kind once with "
                           "its total count")
    nodes = tuple(object_node(f"obj{i}", p.noun, p.count, p.attributes)
                  for i, p in enumerate(phrases))
    edges = list(edges)
    graph_edges = tuple(relation_edge(f"rel{k}", nodes[i], relation, nodes[j],
                                      [nodes[b] for b in _between_pair(edges, i, j, phrases)])
                        for k, (i, relation, j) in enumerate(edges))
    graph = SceneGraph(prompt, nodes, graph_edges, tag)
    try:
        validate_graph(graph)
    except ValueError as err:
        raise fail(prompt, str(err)) from err
    return graph
