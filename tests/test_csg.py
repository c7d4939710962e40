"""Scene-graph types, validation, JSON round-trip and the GenEval-grammar parser."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cast_core.csg.build import PromptParseError
from cast_core.csg.geneval import graph_from_geneval
from cast_core.csg.graph import CsgError, SceneGraph, validate_graph
from cast_core.csg.parser import parse_prompt
from cast_core.csg.vocab import pluralize, singularize

PROMPT_DIR = Path(__file__).resolve().parents[1] / "data" / "prompts"


def _nodes(graph: SceneGraph) -> list[tuple[str, int, str | None]]:
    return [(n.noun, n.count, n.color) for n in graph.nodes]


def _edges(graph: SceneGraph) -> list[tuple[str, str, str]]:
    return [(e.subject, e.relation, e.object) for e in graph.edges]


def test_worked_example_atoms():
    graph = parse_prompt("a photo of two red circles left of a blue square")
    rows = [(a.id, a.type, a.answer, a.parents, a.subject, a.object, a.value)
            for a in graph.atoms()]
    assert rows == [
        ("obj0", "object", "yes", (), "obj0", None, None),
        ("obj0/count", "count", "2", ("obj0",), "obj0", None, "2"),
        ("obj0/color", "attribute", "yes", ("obj0",), "obj0", None, "red"),
        ("obj1", "object", "yes", (), "obj1", None, None),
        ("obj1/color", "attribute", "yes", ("obj1",), "obj1", None, "blue"),
        ("rel0", "relation", "yes", ("obj0", "obj1"), "obj0", "obj1", "left of"),
    ]
    questions = [a.question for a in graph.atoms()]
    assert questions == [
        "Is there a circle?", "How many red circles are there?", "Are the circles red?",
        "Is there a square?", "Is the square blue?",
        "Are the two red circles left of the blue square?",
    ]


@pytest.mark.parametrize("prompt, nodes, edges", [
    ("a photo of a fire hydrant", [("fire hydrant", 1, None)], []),
    ("a photo of an umbrella", [("umbrella", 1, None)], []),
    ("a photo of an orange", [("orange", 1, None)], []),
    ("a photo of a teddy bear and a wine glass",
     [("teddy bear", 1, None), ("wine glass", 1, None)], []),
    ("a photo of three buses", [("bus", 3, None)], []),
    ("a photo of four boxes", [("box", 4, None)], []),
    ("a photo of two benches", [("bench", 2, None)], []),
    ("a photo of two dishes", [("dish", 2, None)], []),
    ("a photo of two knives", [("knife", 2, None)], []),
    ("a photo of three wine glasses", [("wine glass", 3, None)], []),
    ("a photo of two people", [("person", 2, None)], []),
    ("a photo of ten sheep", [("sheep", 10, None)], []),
    ("a photo of two mice", [("mouse", 2, None)], []),
    ("a photo of three ponies", [("pony", 3, None)], []),
    ("a photo of two skis", [("ski", 2, None)], []),
    ("a photo of 2 hair driers", [("hair drier", 2, None)], []),
    ("a photo of an orange cat", [("cat", 1, "orange")], []),
    ("a photo of a grey teddy bear", [("teddy bear", 1, "grey")], []),
    ("a photo of a fire hydrant right of an orange",
     [("fire hydrant", 1, None), ("orange", 1, None)], [("obj0", "right of", "obj1")]),
    ("a photo of a red fire hydrant and a blue bus",
     [("fire hydrant", 1, "red"), ("bus", 1, "blue")], []),
    ("a photo of two red circles left of three blue squares",
     [("circle", 2, "red"), ("square", 3, "blue")], [("obj0", "left of", "obj1")]),
    ("a photo of a green triangle above four yellow circles",
     [("triangle", 1, "green"), ("circle", 4, "yellow")], [("obj0", "above", "obj1")]),
    ("a photo of a red circle, two blue squares and a green triangle",
     [("circle", 1, "red"), ("square", 2, "blue"), ("triangle", 1, "green")], []),
    ("a photo of two red circles and three blue squares",
     [("circle", 2, "red"), ("square", 3, "blue")], []),
])
def test_parse_templates(prompt, nodes, edges):
    graph = parse_prompt(prompt, tag="t")
    assert (_nodes(graph), _edges(graph), graph.prompt, graph.tag) == (nodes, edges, prompt, "t")


@pytest.mark.parametrize("plural, singular", [
    ("skises", "skis"), ("knifes", "knife"), ("computer mouses", "computer mouse"),
    ("persons", "person"), ("sheeps", "sheep"), ("horses", "horse"), ("vases", "vase"),
    ("glasses", "glass"), ("ties", "tie"), ("toothbrushes", "toothbrush"),
])
def test_singularize_undoes_geneval_plural(plural, singular):
    assert singularize(plural) == singular


@pytest.mark.parametrize("noun", ["bus", "box", "bench", "dish", "knife", "person", "sheep",
                                  "mouse", "wine glass", "pony", "tie", "fire hydrant", "circle",
                                  "hair drier", "glass", "horse", "toy", "potato"])
def test_pluralize_is_inverse_of_singularize(noun):
    assert singularize(pluralize(noun)) == noun


def test_count_one_has_no_count_atom_and_questions_agree_in_number():
    one = parse_prompt("a photo of a red circle")
    assert [a.type for a in one.atoms()] == ["object", "attribute"]
    assert one.atoms()[1].question == "Is the circle red?"
    many = parse_prompt("a photo of a dog right of three fire hydrants")
    assert many.edges[0].atoms[0].question == "Is the dog right of the three fire hydrants?"
    assert many.node("obj1").atoms[1].question == "How many fire hydrants are there?"


def test_parse_equals_geneval_on_every_committed_record():
    records = [json.loads(line) for name in ("train", "eval", "hard")
               for line in (PROMPT_DIR / f"{name}.jsonl").read_text().splitlines()]
    assert len(records) == 5000 + 207 + 200
    for record in records:
        assert parse_prompt(record["prompt"], record["tag"]) == graph_from_geneval(record)


def test_geneval_position_layout_puts_subject_first():
    record = {"tag": "position", "prompt": "a photo of a dog left of a fire hydrant",
              "include": [{"class": "fire hydrant", "count": 1},
                          {"class": "dog", "count": 1, "position": ["left of", 0]}]}
    graph = graph_from_geneval(record)
    assert graph == parse_prompt(record["prompt"], "position")
    assert (_nodes(graph)[0], _edges(graph)) == (("dog", 1, None), [("obj0", "left of", "obj1")])


@pytest.mark.parametrize("prompt, reason", [
    ("photo of a cat", "must start with"),
    ("Photo of a cat", "must start with"),
    ("a photo of several circles", "'several'"),
    ("a photo of red circles", "'red'"),
    ("a photo of eleven circles", "'eleven'"),
    ("a photo of 11 circles", "'11'"),
    ("a photo of 0 circles", "'0'"),
    ("a photo of a", "noun phrase 'a'"),
    ("a photo of a circle and ", "noun phrase ''"),
    ("a photo of a circle left of a square, a triangle and a circle above a square",
     "follows a list of objects"),
    ("a photo of a circle and a square left of", "must be followed by a noun phrase"),
    ("a photo of a red circle on the tables", "'the tables' names no noun phrase"),
    ("a photo of a circle..", "['circle.']"),
    ("a photo of a red blue circle", "['blue']"),
    ("a photo of a circle and a circle", "appear twice"),
])
def test_malformed_prompts_raise_naming_prompt(prompt, reason):
    with pytest.raises(PromptParseError) as info:
        parse_prompt(prompt)
    assert repr(prompt) in str(info.value) and reason in str(info.value)


@pytest.mark.parametrize("include", [
    [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["near", 0]}],
    [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["above", 1]}],
    [{"class": "cat", "count": 1, "color": "teal"}],
    [{"class": "cat", "count": 11}],
    [{"class": "", "count": 1}],
])
def test_bad_geneval_metadata_raises(include):
    with pytest.raises(PromptParseError):
        graph_from_geneval({"tag": "x", "include": include, "prompt": "a photo of a cat"})


def _graph() -> SceneGraph:
    return parse_prompt("a photo of two red circles left of a blue square")


def _with_node(graph: SceneGraph, index: int, **changes) -> SceneGraph:
    nodes = list(graph.nodes)
    nodes[index] = dataclasses.replace(nodes[index], **changes)
    return dataclasses.replace(graph, nodes=tuple(nodes))


def _with_atom(graph: SceneGraph, node: int, atom: int, **changes) -> SceneGraph:
    atoms = list(graph.nodes[node].atoms)
    atoms[atom] = dataclasses.replace(atoms[atom], **changes)
    return _with_node(graph, node, atoms=tuple(atoms))


def _with_edge(graph: SceneGraph, **changes) -> SceneGraph:
    return dataclasses.replace(graph, edges=(dataclasses.replace(graph.edges[0], **changes),))


def _with_relation_word(graph: SceneGraph, word: str) -> SceneGraph:
    atom = dataclasses.replace(graph.edges[0].atoms[0], value=word)
    return _with_edge(graph, relation=word, atoms=(atom,))


@pytest.mark.parametrize("broken, needle", [
    (_with_atom(_graph(), 0, 1, parents=("obj9",)), "parent 'obj9' is not an atom"),
    (_with_atom(_graph(), 0, 0, parents=("obj0/count",)), "cycle"),
    (_with_node(_graph(), 1, count=0), "count must be an int in 1..10, got 0"),
    (_with_node(_graph(), 1, count=11), "count must be an int in 1..10, got 11"),
    (_with_relation_word(_graph(), "near"), "relation 'near' is unknown"),
    (_with_edge(_graph(), object="obj7"), "endpoint 'obj7' is not a node"),
    (_with_atom(_graph(), 0, 1, answer="3"), "count answer and value must be '2'"),
    (_with_node(_graph(), 0, count=1), "count atoms need count >= 2"),
    (_with_atom(_graph(), 1, 0, id="obj0"), "atom ids must be unique"),
])
def test_validate_graph_catches(broken, needle):
    with pytest.raises(CsgError, match="invalid scene graph") as info:
        validate_graph(broken)
    assert needle in str(info.value)


def test_validate_graph_lists_every_problem():
    broken = _with_edge(_with_node(_graph(), 1, count=0), object="obj7")
    with pytest.raises(CsgError) as info:
        validate_graph(broken)
    assert "got 0" in str(info.value) and "'obj7'" in str(info.value)


def test_validate_graph_accepts_parsed_graph():
    assert validate_graph(_graph()) is None


@pytest.mark.parametrize("prompt", [
    "a photo of two red circles left of a blue square",
    "a photo of a red circle, two blue squares and a green triangle",
    "a photo of an orange",
])
def test_json_round_trip(prompt):
    graph = parse_prompt(prompt, tag="colors")
    assert SceneGraph.from_json(graph.to_json()) == graph
    assert SceneGraph.from_dict(json.loads(json.dumps(graph.to_dict()))) == graph


def test_from_dict_missing_field_raises():
    data = _graph().to_dict()
    del data["nodes"][0]["count"]
    with pytest.raises(CsgError, match="count"):
        SceneGraph.from_dict(data)


def test_capitals_are_read_in_lower_case_and_the_prompt_is_kept():
    graph = parse_prompt("A photo of a Cat", tag="t")
    assert graph.prompt == "A photo of a Cat"
    assert graph == dataclasses.replace(parse_prompt("a photo of a cat", tag="t"),
                                        prompt="A photo of a Cat")
