"""Deterministic CSG builder for GenEval-grammar prompts, from prompt text or GenEval metadata.

Grammar (GenEval's six templates and the shapes world's harder forms are all instances):
    prompt  := "a photo of " NP ( (", " | " and " | ", and ") NP )*   |   "a photo of " NP REL NP
    NP      := (a | an | one..ten | 1..10) [COLOR] NOUN
    REL     := "left of" | "right of" | "above" | "below"     (the first NP is the subject)
NOUN is any run of plain lowercase words (multi-word nouns such as "fire hydrant" are fine); with
a count >= 2 its last word is singularised. A colour word is an attribute only when a noun
follows it ("an orange" is the fruit). Anything else raises PromptParseError: the parser never
guesses. An NP that agrees badly ("two circle") is read as meant, since invariant plurals
("two sheep") cannot be told apart from it without a dictionary.

Node order is the order of appearance in the prompt. GenEval's metadata lists a position prompt's
reference object first and the subject second (with "position": [rel, 0]); `graph_from_geneval`
puts the positioned clause first, so both paths give the same graph.

Plurals: rules plus a small irregular table. The table also undoes GenEval's own naive plural
(name + "es" after a final s, else + "s"), so "two computer mouses", "two skises" and
"two knifes" from GenEval's generator parse back to their class names.

Atoms are built by `object_node` and `relation_edge`, which are more general than this grammar
needs (any attribute keys, any edge id and endpoints) because the LLM builder
(`cast_core.csg_llm`) uses them too: both paths share one way of writing questions, answers and
parent links. Count and relation questions name an object by its colour only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from cast_core.csg import RELATIONS, Atom, ObjectNode, RelationEdge, SceneGraph, validate_graph

PREFIX = "a photo of "
COLOR_WORDS: tuple[str, ...] = ("red", "orange", "yellow", "green", "blue", "purple", "pink",
                                "brown", "black", "white", "gray", "grey")
NUMBER_NAMES: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five", "six", "seven",
                                 "eight", "nine", "ten")
COUNT_WORDS: dict[str, int] = {"a": 1, "an": 1, **{w: n for n, w in enumerate(NUMBER_NAMES)
                                                  if n > 0}, **{str(n): n for n in range(1, 11)}}
IRREGULAR_PLURALS: dict[str, str] = {
    "person": "people", "man": "men", "woman": "women", "child": "children", "mouse": "mice",
    "goose": "geese", "foot": "feet", "tooth": "teeth", "knife": "knives", "wife": "wives",
    "life": "lives", "leaf": "leaves", "loaf": "loaves", "wolf": "wolves", "shelf": "shelves",
    "half": "halves", "calf": "calves", "potato": "potatoes", "tomato": "tomatoes",
    "cookie": "cookies", "movie": "movies",
}
INVARIANT_NOUNS: frozenset[str] = frozenset({"sheep", "deer", "fish", "moose", "bison",
                                             "series", "species", "scissors"})
_SINGULAR_EXCEPTIONS: dict[str, str] = {
    **{p: s for s, p in IRREGULAR_PLURALS.items()},
    "mouses": "mouse", "houses": "house", "scissorses": "scissors",
}
_NOT_NOUN_WORDS = frozenset(COUNT_WORDS) | frozenset(NUMBER_NAMES) | frozenset({
    "the", "and", "or", "of", "on", "in", "at", "with", "to", "by", "for", "from", "near", "next",
    "behind", "under", "over", "beside", "front", "left", "right", "above", "below"})
_WORD = re.compile(r"[a-z][a-z'-]*")
_SEPARATOR = re.compile(r", and |, | and ")
_RELATION = re.compile(r" (" + "|".join(RELATIONS) + r") ")


class PromptParseError(ValueError):
    """The prompt (or GenEval record) does not fit the grammar; the message names it and why."""


@dataclass(frozen=True)
class NounPhrase:
    """`count` instances of `noun` (singular), optionally coloured."""

    noun: str
    count: int
    color: str | None = None

    @property
    def attributes(self) -> tuple[tuple[str, str], ...]:
        return (("color", self.color),) if self.color else ()


def singularize(noun: str) -> str:
    """Singular of a plural noun phrase: only its last word changes ("wine glasses")."""
    *head, last = noun.split(" ")
    return " ".join([*head, _singular_word(last)])


def _singular_word(word: str) -> str:
    if word in _SINGULAR_EXCEPTIONS:
        return _SINGULAR_EXCEPTIONS[word]
    if word in INVARIANT_NOUNS or not word.endswith("s") or word.endswith(("ss", "us")):
        return word
    if word.endswith("ies"):
        return word[:-3] + "y" if len(word) > 4 else word[:-1]
    if word.endswith(("xes", "ches", "shes")):
        return word[:-2]
    if word.endswith("ses") and word[:-2].endswith(("ss", "us", "is")):
        return word[:-2]
    return word[:-1]


def pluralize(noun: str) -> str:
    """Plural of a singular noun phrase, the inverse of `singularize` on its last word."""
    *head, last = noun.split(" ")
    return " ".join([*head, _plural_word(last)])


def _plural_word(word: str) -> str:
    if word in IRREGULAR_PLURALS:
        return IRREGULAR_PLURALS[word]
    if word in INVARIANT_NOUNS:
        return word
    if word.endswith(("s", "x", "ch", "sh")):
        return word + "es"
    if word.endswith("y") and len(word) > 1 and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    return word + "s"


def noun_phrase(count: int, noun: str, color: str | None = None) -> str:
    """Prompt text of one NP: "a red circle", "an apple", "two red circles"."""
    words = [w for w in (color, noun if count == 1 else pluralize(noun)) if w]
    head = ("an" if words[0][0] in "aeiou" else "a") if count == 1 else NUMBER_NAMES[count]
    return " ".join([head, *words])


def _fail(prompt: str, reason: str) -> PromptParseError:
    return PromptParseError(f"cannot parse prompt {prompt!r}: {reason}")


def parse_prompt(prompt: str, tag: str | None = None) -> SceneGraph:
    """Scene graph of a GenEval-grammar prompt; raises PromptParseError on anything else."""
    if not prompt.startswith(PREFIX):
        raise _fail(prompt, f"it must start with {PREFIX!r}")
    body = prompt[len(PREFIX):]
    relations = _RELATION.findall(body)
    if len(relations) > 1:
        raise _fail(prompt, f"it has {len(relations)} relation words {relations}; "
                            "one relation may join exactly two noun phrases")
    texts = _RELATION.split(body)[::2] if relations else _SEPARATOR.split(body)
    if relations and any(_SEPARATOR.search(t) for t in texts):
        raise _fail(prompt, f"the relation {relations[0]!r} must join exactly two noun phrases, "
                            "not a list")
    phrases = [_parse_phrase(text, prompt) for text in texts]
    return build_graph(prompt, phrases, relations[0] if relations else None, tag)


def _parse_phrase(text: str, prompt: str) -> NounPhrase:
    words = text.split(" ")
    if len(words) < 2 or "" in words:
        raise _fail(prompt, f"noun phrase {text!r} must be '(a|an|number) [color] noun'")
    if words[0] not in COUNT_WORDS:
        raise _fail(prompt, f"noun phrase {text!r} must start with a/an or a count one..ten "
                            f"(or 1..10), not {words[0]!r}")
    count, rest = COUNT_WORDS[words[0]], words[1:]
    color = rest[0] if len(rest) > 1 and rest[0] in COLOR_WORDS else None
    noun_words = rest[1:] if color else rest
    bad = [w for w in noun_words if not _WORD.fullmatch(w) or w in _NOT_NOUN_WORDS]
    bad += [w for w in noun_words[:-1] if w in COLOR_WORDS]
    if bad:
        raise _fail(prompt, f"noun {' '.join(noun_words)!r} in {text!r} has words that are not "
                            f"part of a noun: {bad}")
    noun = " ".join(noun_words)
    return NounPhrase(singularize(noun) if count > 1 else noun, count, color)


def graph_from_geneval(record: dict[str, Any]) -> SceneGraph:
    """Scene graph of a GenEval metadata record ({"tag", "include", "prompt", ...})."""
    prompt, include = record.get("prompt"), record.get("include")
    if not isinstance(prompt, str) or not isinstance(include, list) or not include:
        raise PromptParseError(f"GenEval record needs a str 'prompt' and a non-empty 'include' "
                               f"list, got {record!r}")
    order, relation = _clause_order(include, prompt)
    phrases = [_clause_phrase(include[i], prompt) for i in order]
    return build_graph(prompt, phrases, relation, record.get("tag"))


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
        raise _fail(prompt, f"metadata position must be one [relation, other index] joining "
                            f"exactly two clauses, relation in {RELATIONS}; got {include!r}")
    return [i, 1 - i], position[0]


def _clause_phrase(clause: Any, prompt: str) -> NounPhrase:
    ok = isinstance(clause, dict) and isinstance(clause.get("class"), str) and clause["class"]
    count = clause.get("count") if ok else None
    if not ok or isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 10:
        raise _fail(prompt, f"metadata clause {clause!r} needs a non-empty 'class' and an int "
                            "'count' in 1..10")
    color = clause.get("color")
    if color is not None and color not in COLOR_WORDS:
        raise _fail(prompt, f"metadata colour {color!r} is not one of {COLOR_WORDS}")
    return NounPhrase(clause["class"], count, color)


def build_graph(prompt: str, phrases: list[NounPhrase], relation: str | None = None,
                tag: str | None = None) -> SceneGraph:
    """Graph with node i for phrases[i]; `relation` (if any) says phrases[0] REL phrases[1]."""
    kinds = [(p.noun, p.color) for p in phrases]
    repeated = sorted({k for k in kinds if kinds.count(k) > 1}, key=str)
    if repeated:
        raise _fail(prompt, f"noun phrases {repeated} appear twice; state each kind once with "
                            "its total count")
    nodes = tuple(object_node(f"obj{i}", p.noun, p.count, p.attributes)
                  for i, p in enumerate(phrases))
    edges = (relation_edge("rel0", nodes[0], relation, nodes[1]),) if relation else ()
    graph = SceneGraph(prompt, nodes, edges, tag)
    validate_graph(graph)
    return graph


def object_node(node_id: str, noun: str, count: int,
                attributes: tuple[tuple[str, str], ...]) -> ObjectNode:
    """Node with its object atom, a count atom when count >= 2, then one atom per attribute
    ("<node_id>/<key>") in the order given."""
    atoms = [Atom(node_id, "object", f"Is there {noun_phrase(1, noun)}?", "yes", (), node_id)]
    color = dict(attributes).get("color")
    if count > 1:
        what = " ".join(w for w in (color, pluralize(noun)) if w)
        atoms.append(Atom(f"{node_id}/count", "count", f"How many {what} are there?", str(count),
                          (node_id,), node_id, value=str(count)))
    ask = f"Is the {noun}" if count == 1 else f"Are the {pluralize(noun)}"
    for key, value in attributes:
        atoms.append(Atom(f"{node_id}/{key}", "attribute", f"{ask} {value}?", "yes",
                          (node_id,), node_id, value=value))
    return ObjectNode(node_id, noun, count, attributes, tuple(atoms))


def relation_edge(edge_id: str, subject_node: ObjectNode, relation: str,
                  object_node: ObjectNode) -> RelationEdge:
    """Edge `subject_node` `relation` `object_node` with its one relation atom, whose parents are
    the two object atoms."""
    verb = "Is" if subject_node.count == 1 else "Are"
    question = (f"{verb} the {node_description(subject_node)} {relation} "
                f"the {node_description(object_node)}?")
    ends = (subject_node.id, object_node.id)
    atom = Atom(edge_id, "relation", question, "yes", ends, *ends, relation)
    return RelationEdge(edge_id, subject_node.id, relation, object_node.id, (atom,))


def node_description(node: ObjectNode) -> str:
    """The node after "the" in a relation question: "red circle", "two red circles"."""
    words = [NUMBER_NAMES[node.count] if node.count > 1 else None, node.color,
             node.noun if node.count == 1 else pluralize(node.noun)]
    return " ".join(w for w in words if w)
