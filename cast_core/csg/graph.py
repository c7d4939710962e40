"""Causal Scene Graph (CSG): object nodes, relation edges and the verifiable atoms they carry.

A prompt becomes a small graph. Each node is one kind of object (a noun, how many, its
attributes); each edge is one spatial relation between two nodes. Every node and edge carries
atoms: yes/no or counting questions a VLM can answer about an image (Soft-TIFA style), each with
its expected short answer. Atoms link to the atoms they depend on (`parents`), which is what
DSG-style gating uses: a count, attribute or relation atom is meaningless when its object is absent.

Conventions (ours; the CAST paper publishes no schema):
- Atom ids are stable strings: "obj0" (the object atom shares its node's id), "obj0/count",
  "obj0/color" (one per attribute key), "rel0" (the relation atom shares its edge's id).
- Counting: a node with count n >= 2 has a count atom meaning EXACTLY n instances of the noun (with
  its colour, if any); a node of count 1 has no count atom and means "at least one".
- Answers are "yes" for yes/no atoms and the digit string of the count for count atoms.
- Relations: GenEval's four (`RELATIONS`, the only ones its metadata and the LLM builder write)
  and the offline parser's others (`EXTRA_RELATIONS`: "in front of", "behind", "on top of",
  "next to", "close to" for "near", "with", "on", "in", "around", "against" and "between", whose
  object is one node of count two or more, or one of two nodes of one: "X between A and B" is an
  edge to each, both asking the one question). A graph has at most `MAX_ATOMS` atoms.

`atoms()` orders node atoms in node order, then edge atoms. `to_dict`/`from_dict` round-trip
exactly; `from_dict` only rebuilds, call `validate_graph` to check the result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, get_args

AtomType = Literal["object", "count", "attribute", "relation"]
ATOM_TYPES: tuple[str, ...] = get_args(AtomType)  # the one atom-type order of every table and map
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
EXTRA_RELATIONS: tuple[str, ...] = ("in front of", "behind", "on top of", "next to", "close to",
                                    "with", "on", "in", "around", "against", "between")
ALL_RELATIONS: tuple[str, ...] = RELATIONS + EXTRA_RELATIONS
MIN_COUNT = 1
MAX_COUNT = 10
MAX_ATOMS = 48


class CsgError(ValueError):
    """A scene graph (or its serialised form) breaks an invariant; the message lists each one."""


@dataclass(frozen=True)
class Atom:
    """One verifiable question about the image, with its expected short answer."""

    id: str
    type: AtomType
    question: str
    answer: str
    parents: tuple[str, ...]
    subject: str
    object: str | None = None
    value: str | None = None


@dataclass(frozen=True)
class ObjectNode:
    """One kind of object: `count` instances of `noun` (singular) with the given attributes."""

    id: str
    noun: str
    count: int
    attributes: tuple[tuple[str, str], ...]
    atoms: tuple[Atom, ...]

    @property
    def color(self) -> str | None:
        return dict(self.attributes).get("color")


@dataclass(frozen=True)
class RelationEdge:
    """`subject` node is `relation` of `object` node (e.g. obj0 "left of" obj1)."""

    id: str
    subject: str
    relation: str
    object: str
    atoms: tuple[Atom, ...]


@dataclass(frozen=True)
class SceneGraph:
    """The CSG of one prompt. A = len(atoms())."""

    prompt: str
    nodes: tuple[ObjectNode, ...]
    edges: tuple[RelationEdge, ...]
    tag: str | None = None

    def atoms(self) -> tuple[Atom, ...]:
        """All A atoms: node atoms in node order, then edge atoms in edge order."""
        node_atoms = tuple(a for n in self.nodes for a in n.atoms)
        return node_atoms + tuple(a for e in self.edges for a in e.atoms)

    def node(self, node_id: str) -> ObjectNode:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(f"no node {node_id!r} in the graph of {self.prompt!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "tag": self.tag,
            "nodes": [_node_to_dict(n) for n in self.nodes],
            "edges": [_edge_to_dict(e) for e in self.edges],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SceneGraph:
        try:
            nodes = tuple(_node_from_dict(n) for n in data["nodes"])
            edges = tuple(_edge_from_dict(e) for e in data["edges"])
            return cls(data["prompt"], nodes, edges, data.get("tag"))
        except (KeyError, TypeError) as err:
            raise CsgError(f"malformed scene-graph dict: missing or mistyped field {err}") from err

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> SceneGraph:
        return cls.from_dict(json.loads(text))


def _atom_to_dict(a: Atom) -> dict[str, Any]:
    return {"id": a.id, "type": a.type, "question": a.question, "answer": a.answer,
            "parents": list(a.parents), "subject": a.subject, "object": a.object,
            "value": a.value}


def _atom_from_dict(d: dict[str, Any]) -> Atom:
    return Atom(d["id"], d["type"], d["question"], d["answer"], tuple(d["parents"]),
                d["subject"], d.get("object"), d.get("value"))


def _node_to_dict(n: ObjectNode) -> dict[str, Any]:
    return {"id": n.id, "noun": n.noun, "count": n.count,
            "attributes": [list(kv) for kv in n.attributes],
            "atoms": [_atom_to_dict(a) for a in n.atoms]}


def _node_from_dict(d: dict[str, Any]) -> ObjectNode:
    attributes = tuple((str(k), str(v)) for k, v in d["attributes"])
    atoms = tuple(_atom_from_dict(a) for a in d["atoms"])
    return ObjectNode(d["id"], d["noun"], d["count"], attributes, atoms)


def _edge_to_dict(e: RelationEdge) -> dict[str, Any]:
    return {"id": e.id, "subject": e.subject, "relation": e.relation, "object": e.object,
            "atoms": [_atom_to_dict(a) for a in e.atoms]}


def _edge_from_dict(d: dict[str, Any]) -> RelationEdge:
    atoms = tuple(_atom_from_dict(a) for a in d["atoms"])
    return RelationEdge(d["id"], d["subject"], d["relation"], d["object"], atoms)


def validate_graph(graph: SceneGraph) -> None:
    """Raise CsgError listing every broken invariant of `graph`; return None when it is sound."""
    problems = _id_problems(graph) + _reference_problems(graph) + _cycle_problems(graph)
    if len(graph.atoms()) > MAX_ATOMS:
        problems.append(f"it has {len(graph.atoms())} atoms, more than the limit of {MAX_ATOMS} "
                        "per graph; split the prompt into smaller ones")
    problems += [p for n in graph.nodes for p in _node_problems(n)]
    problems += [p for e in graph.edges for p in _edge_problems(e)]
    if problems:
        raise CsgError(f"invalid scene graph for {graph.prompt!r}: " + "; ".join(problems))


def _duplicates(ids: list[str]) -> list[str]:
    return sorted({i for i in ids if ids.count(i) > 1})


def _id_problems(graph: SceneGraph) -> list[str]:
    node_ids = [n.id for n in graph.nodes]
    edge_ids = [e.id for e in graph.edges]
    groups = {"node": node_ids, "edge": edge_ids, "atom": [a.id for a in graph.atoms()],
              "node/edge": sorted(set(node_ids)) + sorted(set(edge_ids))}
    return [f"{kind} ids must be unique: {dup!r} repeats; rename it"
            for kind, ids in groups.items() for dup in _duplicates(ids)]


def _reference_problems(graph: SceneGraph) -> list[str]:
    node_ids = {n.id for n in graph.nodes}
    atom_ids = {a.id for a in graph.atoms()}
    problems = [f"edge {e.id!r} endpoint {end!r} is not a node; use one of {sorted(node_ids)}"
                for e in graph.edges for end in (e.subject, e.object) if end not in node_ids]
    for a in graph.atoms():
        problems += [f"atom {a.id!r} parent {p!r} is not an atom; drop it or add that atom"
                     for p in a.parents if p not in atom_ids]
        problems += [f"atom {a.id!r} refers to node {ref!r}, which does not exist"
                     for ref in (a.subject, a.object) if ref is not None and ref not in node_ids]
    return problems


def _cycle_problems(graph: SceneGraph) -> list[str]:
    parents = {a.id: a.parents for a in graph.atoms()}
    on_cycle = [a for a in parents if _reaches(a, a, parents)]
    if on_cycle:
        return [f"atom parent links must be acyclic: atoms {on_cycle} lie on a cycle"]
    return []


def _reaches(start: str, target: str, parents: dict[str, tuple[str, ...]]) -> bool:
    """True when following parent links from `start` (one step or more) reaches `target`."""
    stack, seen = list(parents.get(start, ())), set()
    while stack:
        current = stack.pop()
        if current == target:
            return True
        if current not in seen:
            seen.add(current)
            stack.extend(parents.get(current, ()))
    return False


def _node_problems(n: ObjectNode) -> list[str]:
    problems = []
    if not _is_count(n.count):
        problems.append(f"node {n.id!r} count must be an int in {MIN_COUNT}..{MAX_COUNT}, "
                        f"got {n.count!r}")
    if not any(a.type == "object" and a.id == n.id for a in n.atoms):
        problems.append(f"node {n.id!r} needs an object atom with id {n.id!r}")
    values = {v for _, v in n.attributes}
    for a in n.atoms:
        problems += _node_atom_problems(a, n, values)
    return problems


def _is_count(value: object) -> bool:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    return is_int and MIN_COUNT <= value <= MAX_COUNT


def _node_atom_problems(a: Atom, n: ObjectNode, values: set[str]) -> list[str]:
    where = f"atom {a.id!r} of node {n.id!r}"
    if a.subject != n.id:
        return [f"{where} must have subject {n.id!r}, got {a.subject!r}"]
    if a.type == "object" and (a.answer != "yes" or a.value is not None):
        return [f"{where}: object atoms answer 'yes' with value None"]
    if a.type == "count":
        if n.count == 1:
            return [f"{where}: count atoms need count >= 2 (count 1 means 'at least one')"]
        if a.answer != str(n.count) or a.value != str(n.count):
            return [f"{where}: count answer and value must be {str(n.count)!r}, got {a.answer!r}"]
    if a.type == "attribute" and (a.answer != "yes" or a.value not in values):
        return [f"{where}: attribute atoms answer 'yes' with a value from {sorted(values)}"]
    if a.type not in ("object", "count", "attribute"):
        return [f"{where} has type {a.type!r}; nodes carry object/count/attribute atoms only"]
    return []


def _edge_problems(e: RelationEdge) -> list[str]:
    problems = []
    if e.relation not in ALL_RELATIONS:
        problems.append(f"edge {e.id!r} relation {e.relation!r} is unknown; "
                        f"use one of {ALL_RELATIONS}")
    if e.subject == e.object:
        problems.append(f"edge {e.id!r} relates {e.subject!r} to itself; use two distinct nodes")
    for a in e.atoms:
        if a.type != "relation":
            problems.append(f"atom {a.id!r} of edge {e.id!r} has type {a.type!r}; use 'relation'")
        elif (a.subject, a.value, a.object, a.answer) != (e.subject, e.relation, e.object, "yes"):
            problems.append(f"atom {a.id!r} must restate edge {e.id!r} "
                            f"({e.subject} {e.relation} {e.object}) with answer 'yes'")
    return problems
