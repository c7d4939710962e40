"""Atoms of a scene graph's nodes and edges, with the Soft-TIFA question each one asks.

Both builders (the offline parser and the LLM builder) make their atoms here, so a graph has one
way of writing questions, answers and parent links whoever built it. Question forms:

| atom | question |
|---|---|
| object | "Is there a chair?" |
| count (n >= 2) | "How many small wooden chairs are there?" (the node's attributes, no count) |
| color, size, shape, state | "Is the chair red?" / "Are the chairs red?" |
| material | "Is the chair made of wood?" ("wooden" -> "wood"; other values as written) |
| pattern | "Does the chair have a striped pattern?" |
| texture | "Does the chair look shiny?" |
| relation | "Is the small wooden chair next to the two red cats?" (one form for every relation) |
| "between" two | "Is the lamp between the bed and the desk?" (asked by each of its two edges) |

A node is named in count and relation questions by all its attributes, in English adjective order
(size, state, texture, shape, colour, pattern, material: "two small old shiny red striped wooden
chairs"); with colour as the only attribute these are the GenEval-era questions unchanged.
"""

from __future__ import annotations

from cast_core.csg.graph import Atom, ObjectNode, RelationEdge
from cast_core.csg.vocab import MATERIAL_SUBSTANCE, pluralize

NUMBER_NAMES: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five", "six", "seven",
                                 "eight", "nine", "ten")
DESCRIPTION_ORDER: tuple[str, ...] = ("size", "state", "texture", "shape", "color", "pattern",
                                      "material")


def noun_phrase(count: int, noun: str, color: str | None = None) -> str:
    """Prompt text of one NP: "a red circle", "an apple", "two red circles"."""
    words = [w for w in (color, noun if count == 1 else pluralize(noun)) if w]
    head = ("an" if words[0][0] in "aeiou" else "a") if count == 1 else NUMBER_NAMES[count]
    return " ".join([head, *words])


def attribute_question(noun: str, count: int, key: str, value: str) -> str:
    """The yes/no question of one attribute atom (see the table above)."""
    the = f"the {noun}" if count == 1 else f"the {pluralize(noun)}"
    be, do = ("Is", "Does") if count == 1 else ("Are", "Do")
    if key == "material":
        return f"{be} {the} made of {MATERIAL_SUBSTANCE.get(value, value)}?"
    if key == "pattern":
        return f"{do} {the} have a {value} pattern?"
    if key == "texture":
        return f"{do} {the} look {value}?"
    return f"{be} {the} {value}?"


def object_node(node_id: str, noun: str, count: int,
                attributes: tuple[tuple[str, str], ...]) -> ObjectNode:
    """Node with its object atom, a count atom when count >= 2, then one atom per attribute
    ("<node_id>/<key>") in the order given."""
    atoms = [Atom(node_id, "object", f"Is there {noun_phrase(1, noun)}?", "yes", (), node_id)]
    if count > 1:
        what = _described(pluralize(noun), attributes)
        atoms.append(Atom(f"{node_id}/count", "count", f"How many {what} are there?", str(count),
                          (node_id,), node_id, value=str(count)))
    for key, value in attributes:
        atoms.append(Atom(f"{node_id}/{key}", "attribute",
                          attribute_question(noun, count, key, value), "yes", (node_id,),
                          node_id, value=value))
    return ObjectNode(node_id, noun, count, attributes, tuple(atoms))


def relation_edge(edge_id: str, subject_node: ObjectNode, relation: str,
                  object_node: ObjectNode, pair: list[ObjectNode] = ()) -> RelationEdge:
    """Edge `subject_node` `relation` `object_node` with its one relation atom, whose parents are
    the two object atoms. `pair`: for one of the two edges of "X between A and B", A and B, which
    the question names both ("Is the lamp between the bed and the desk?"; the other edge asks the
    same)."""
    verb = "Is" if subject_node.count == 1 else "Are"
    named = " and ".join(f"the {node_description(n)}" for n in pair or [object_node])
    question = f"{verb} the {node_description(subject_node)} {relation} {named}?"
    ends = (subject_node.id, object_node.id)
    atom = Atom(edge_id, "relation", question, "yes", ends, *ends, relation)
    return RelationEdge(edge_id, subject_node.id, relation, object_node.id, (atom,))


def node_description(node: ObjectNode) -> str:
    """The node after "the" in a relation question: "red circle", "two small wooden chairs"."""
    noun = node.noun if node.count == 1 else pluralize(node.noun)
    described = _described(noun, node.attributes)
    return f"{NUMBER_NAMES[node.count]} {described}" if node.count > 1 else described


def _described(noun: str, attributes: tuple[tuple[str, str], ...]) -> str:
    """`noun` after its attribute values in English adjective order."""
    rank = {k: i for i, k in enumerate(DESCRIPTION_ORDER)}
    ordered = sorted(attributes, key=lambda kv: rank.get(kv[0], len(rank)))
    return " ".join([*(v for _, v in ordered), noun])
