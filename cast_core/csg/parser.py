"""Deterministic CSG builder for compositional prompts, from prompt text or GenEval metadata.

Grammar (GenEval's six templates and the shapes world's forms are all instances):
    prompt    := [PREFIX] ["there is " | "there are "] statement ( (";" | ".") statement )* ["."]
                                                                    PREFIX: "a photo of ", ...
    statement := clause ( SEP clause )*  |  the-NP (is|are) ATTRIBUTE ( SEP ATTRIBUTE )*
               | the-NP (is|are) REL NP ( SEP NP )*
    clause    := NP  |  NP REL NP ( SEP NP )* ( (SEP | "") REL NP ( SEP NP )* )*
    NP        := (a | an | one..ten | 1..10) ATTRIBUTE* NOUN ["made of" MATERIAL]  |  the-NP
    the-NP    := "the" ATTRIBUTE* NOUN       (names one noun phrase written before it)
    NOUN      := WORD | COMPOUND | HEAD "of" (WORD | COMPOUND)   HEAD: a container or quantity
               | "pair of" ATTRIBUTE* (WORD | COMPOUND)
    REL       := [POSTURE] RELATION-FORM                        POSTURE: "sitting", "parked", ...
    SEP       := ", " | " and " | ", and "
REL is one of the forms in `cast_core.csg.vocab.RELATION_PHRASES` ("left of", "to the left of",
"under", "behind", "in front of", "on top of", "next to", "beside", "near", "with", "on", "in",
...), each read as its canonical relation. A relation followed by a list relates its subject to
each listed noun phrase ("a cat next to two dogs and a red chair": two edges). "and" before a
second relation keeps the subject ("a cat left of a dog and above a box"); a noun phrase after the
first object that is itself followed by a relation starts a new clause ("a cat left of a dog and a
bird above a tree": the bird is above the tree). A list before the first relation gives each
listed noun phrase the relation ("a cat and a dog on a sofa": both are on it). In a chain ("a book on a table next to a lamp")
the later relation places the noun phrase it follows (the table), except after "with", whose object
belongs to the subject ("a girl with a kite next to a tree": the girl), and after "in" a garment
(`garments` in the vocabulary: "a girl in a yellow raincoat next to a tree": the girl); after "in"
a container (`containers`: "a cat in a basket on a sofa") it places the container. "with" later in
a chain belongs to the noun phrase before it only in "A with B rel C with D". "between" takes one noun
phrase of two or more ("a lamp between two chairs") or two of one ("a lamp between a bed and a
desk": a "between" edge to each, both asking "Is the lamp between the bed and the desk?"). A
possessive subject of a predication, "the X's Y is ..." ("a black cat; the cat's collar is red"),
is X with Y, Y a new noun phrase of one unless X is already with one. A separator before "the
... is|are" also starts a statement ("a cat next to a dog, the dog is brown"). "the" + a singular noun that no earlier noun
phrase has is a new noun phrase of one after a relation ("a cat under the bed") and as the subject
of a predication before any a/an or count noun phrase ("the cat is black"). "A and B next to each
other" (near, close to) is one edge from A to B. A predication on a pronoun ("it is red", "they are
both brown", "each of them empty") names the one noun phrase of that number, or the one list,
written before (`cast_core.csg.references.pronoun_targets`); "its", "his", "her", "their" read as
a/an ("a dog with its red ball"), "a horse's back" (a part) as its owner, and a mass noun after a
relation needs no article ("a tiger lying in tall grass"). Back-references and predications:
`cast_core.csg.references` (a reference must name exactly one earlier noun phrase; a predication
adds attributes to it, or relates it).

Refused as ambiguous, each with its reason: "with" later in a chain ("a girl on a bench with a
dog": the girl's or the bench's?), a chain whose first relation is "in" something neither a
garment nor a container ("a squirrel in a tree next to a house"), "between" followed by a list
of more than two or by a relation after its list ("a lamp between a bed and a desk on a rug"), a
new clause after two or more objects, and "X next to A and B rel C" with C not written before
("a pen beside a notebook and a pencil on a desk": is the pencil a second object of "beside"?
a comma before "and", "X next to A, and B rel C", or the same relation twice makes it a new
clause). ATTRIBUTE words come from the vocabulary file (colour, size, material, pattern, texture, shape, state; "light",
"dark", "navy"... + colour is one colour, and so are two colours joined by "and", "black and
white"); a node's attributes are kept in `ATTRIBUTE_KINDS`
order. NOUN is one plain word, or a listed compound noun ("fire hydrant", and the few that start
with an attribute word, such as "golden retriever", read whole), or, when a noun list is given,
one of its nouns; with a count >= 2 its last word is singularised. An "of" phrase after a
container or quantity (`OF_HEADS`: "a cup of tea", "two loaves of bread", "a stack of books") is
one noun whose head takes the number; the words after "of" are kept as written. "pair of" is one
too ("two pairs of red socks": pair of socks x2, colour red: an attribute after "of" is the
pair's). "made of" + a material word after the noun, or in a predication ("the gate is made of
iron"), is the material attribute, as written. A vocabulary word is the noun
only when nothing follows it and it can be one ("an orange", "a glass"). Any other word is an
error naming it and, where it can tell, the construct (a verb such as "chasing", a nested clause,
an unsupported relation such as "across", an "of" phrase after anything but a container or
quantity), pointing to the LLM builder: the
parser never guesses. An NP that agrees badly ("two circle") is read as meant, since invariant
plurals ("two sheep") cannot be told apart from it.

Node order is the order of appearance; edge k is "rel{k}" in order of appearance. GenEval's
metadata lists a position prompt's reference object first and the subject second (with
"position": [rel, 0]); `graph_from_geneval` puts the positioned clause first, so both paths give
the same graph. Atoms and their questions: `cast_core.csg.questions` (shared with the LLM builder).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from cast_core.csg.clauses import (
    PREDICATE_VERBS,
    PRONOUNS,
    SEP,
    Relation,
    clause_edges,
    is_predication,
    open_joins,
    pronoun_subject,
    split_statements,
)
from cast_core.csg.graph import RELATIONS, SceneGraph, validate_graph
from cast_core.csg.questions import (
    NUMBER_NAMES,
    node_description,
    noun_phrase,
    object_node,
    relation_edge,
)
from cast_core.csg.references import (
    Reading,
    antecedent,
    pronoun_targets,
    unnamed,
    with_attributes,
)
from cast_core.csg.vocab import (
    ALSO_NOUNS,
    AMBIGUOUS_COMPOUND_NOUNS,
    AMBIGUOUS_KIND_WORDS,
    ATTRIBUTE_KIND,
    ATTRIBUTE_KINDS,
    CLAUSE_WORDS,
    COLOR_MODIFIERS,
    COMPOUND_NOUNS,
    MASS_NOUNS,
    MATERIAL_SUBSTANCE,
    OF_HEADS,
    PARTS,
    RELATION_PHRASES,
    SETTINGS,
    UNSUPPORTED_RELATIONS,
    VERBS,
    pluralize,
    singularize,
)

__all__ = [
    "COLOR_WORDS",
    "COUNT_WORDS",
    "MAX_PROMPT_CHARS",
    "NUMBER_NAMES",
    "PREFIX",
    "PREFIXES",
    "NounPhrase",
    "PromptParseError",
    "build_graph",
    "graph_from_geneval",
    "node_description",
    "noun_phrase",
    "object_node",
    "parse_prompt",
    "pluralize",
    "relation_edge",
    "singularize",
]

PREFIX = "a photo of "
PREFIXES: tuple[str, ...] = (PREFIX, "an image of ", "a picture of ")
# Said before the first noun phrase and dropped: "there is a cat on a mat" is "a cat on a mat".
THERE_PREFIXES: tuple[str, ...] = ("there is ", "there are ")
MAX_PROMPT_CHARS = 400
COLOR_WORDS: tuple[str, ...] = ("red", "orange", "yellow", "green", "blue", "purple", "pink",
                                "brown", "black", "white", "gray", "grey")
COUNT_WORDS: dict[str, int] = {"a": 1, "an": 1, **{w: n for n, w in enumerate(NUMBER_NAMES)
                                                  if n > 0}, **{str(n): n for n in range(1, 11)}}
_NOT_NOUN_WORDS = frozenset(COUNT_WORDS) | frozenset(NUMBER_NAMES) | frozenset({
    "the", "and", "or", "of", "on", "in", "at", "with", "to", "by", "for", "from", "near", "next",
    "behind", "under", "over", "beside", "front", "left", "right", "above", "below"})
_AMBIGUOUS_FIRST = frozenset(c.split(" ")[0] for c in AMBIGUOUS_COMPOUND_NOUNS)
# Relations that hold both ways, so "A and B next to each other" is one edge from A to B.
_BOTH_WAYS = frozenset({"next to", "close to"})
_RELATION_PARTS = frozenset({"left", "right", "front", "top", "next", "close", "side"})
_WORD = re.compile(r"[a-z][a-z'-]*")
# What may follow "made of": a material word or the substance it names ("made of wood", "made of
# gold"); the value is kept as written.
_MATERIAL_WORDS = (frozenset(MATERIAL_SUBSTANCE) | frozenset(MATERIAL_SUBSTANCE.values())
                   | {w for w, kinds in AMBIGUOUS_KIND_WORDS.items() if "material" in kinds})
# Possessive determiners, read as a/an (or before a count) as the lists write them: "a dog with its
# red ball" is a dog with a ball, "a girl and her dog" a girl and a dog.
POSSESSIVES = frozenset({"its", "his", "her", "their"})
_LLM = "use the LLM builder (builder.kind = 'llm-chat' or 'llm-local') for prompts like this"


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


def _fail(prompt: str, reason: str) -> PromptParseError:
    return PromptParseError(f"cannot parse prompt {prompt!r}: {reason}")


def parse_prompt(prompt: str, tag: str | None = None,
                 nouns: Iterable[str] | None = None) -> SceneGraph:
    """Scene graph of a prompt in the grammar above; raises PromptParseError on anything else.
    `nouns` (singular nouns, e.g. a GenEval record's classes): when given, every noun must be one
    of them, and they are the only multi-word nouns read."""
    if not isinstance(prompt, str):
        raise TypeError(f"parse_prompt expects the prompt as a str, got {type(prompt).__name__}"
                        + ("; decode the bytes (UTF-8) first" if isinstance(prompt, bytes) else ""))
    if tag is not None and not isinstance(tag, str):
        raise TypeError(f"parse_prompt expects tag as a str or None, got {type(tag).__name__}")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise _fail(prompt[:80] + "...", f"it is {len(prompt)} characters long, more than the "
                                         f"limit of {MAX_PROMPT_CHARS}; shorten it or {_LLM}")
    listed = None if nouns is None else frozenset(nouns)
    # Capitals say nothing the graph keeps ("A red car", "Three white swans.", "THREE RED BALLS"):
    # the words are read in lower case and the graph keeps the prompt as written.
    text = prompt.lower()
    body = next((text[len(p):] for p in PREFIXES if text.startswith(p)), text)
    body = next((body[len(p):] for p in THERE_PREFIXES if body.startswith(p)), body)
    try:
        statements = split_statements(body)
    except ValueError as err:
        raise _fail(prompt, f"{err}; {_LLM}") from err
    phrases: list[NounPhrase] = []
    edges: list[tuple[int, str, int]] = []
    groups: list[tuple[int, ...]] = []  # lists of noun phrases, which "they" may name
    opening = True  # no noun phrase written with a/an or a count yet
    for n, (spans, ops) in enumerate(statements):
        if pronoun_subject(spans[0]) is not None:
            _pronoun_predicate(spans, ops, phrases, groups, prompt)
            continue
        relates = spans[0][-1:] in (["is"], ["are"]) and ops and isinstance(ops[0], Relation)
        if is_predication(spans[0]) and not relates:
            edges += _predicate(spans, ops, phrases, edges, prompt, listed, opening)
            continue
        spans = [spans[0][:-1], *spans[1:]] if relates else spans
        edges += _clause(spans, ops, phrases, prompt, listed, n == 0 and body == text,
                         opening and bool(relates), groups)
        opening = opening and all(span[:1] in (["the"], ["each"]) for span in spans)
    repeated = sorted({e for e in edges if edges.count(e) > 1})
    if repeated:
        raise _fail(prompt, f"it states relation {repeated[0][1]!r} between the same two noun "
                            "phrases twice")
    return build_graph(prompt, phrases, edges, tag)


def _clause(spans: list[list[str]], ops: list[str | Relation], phrases: list[NounPhrase],
            prompt: str, nouns: frozenset[str] | None, first: bool,
            opening: bool = False,
            groups: list[tuple[int, ...]] | None = None) -> list[tuple[int, str, int]]:
    """Edges of one statement between indices of `phrases`, to which its new noun phrases are
    appended (a span "the ..." is a reference to one already there, or a new noun phrase of one
    after a relation, and as the subject of an `opening` predication, when none has its noun).
    Its lists of noun phrases are appended to `groups`."""
    try:
        local = clause_edges(spans, ops, _is_setting)
    except ValueError as err:
        construct = next(filter(None, (_construct(span) for span in spans)), None)
        raise _fail(prompt, (f"{construct}; " if construct else "") + f"{err}; {_LLM}") from err
    each_other = _each_other(spans, ops, prompt)
    local = each_other or local
    spans = spans[:-1] if each_other else spans
    roles, index = _roles(ops), []
    spans = [_owner(span, prompt) for span in spans]
    _check_possessives(spans, ops, prompt)
    for i, span in enumerate(spans):
        if len(span) == 1 and span[0] in PRONOUNS and i > 0 and isinstance(ops[i - 1], Relation):
            subjects = {index[s] for s, _, j in local if j == i and s < i}
            head = index[0] if len(spans) == 3 and i == 2 and ops[0] == SEP else None
            index.append(_pronoun(span[0], subjects - {head}, phrases, prompt, ops[i - 1]))
            if index[-1] == head:
                # "a large bowl and three oranges in it": the oranges are in the bowl
                local = [e for e in local if e[0] != 0]
                _unpose(spans[0], ops[1], phrases, head, prompt, nouns)
        elif span[:1] == ["the"]:
            placed = isinstance(ops[i - 1], Relation) if i > 0 else opening
            index.append(_reference(span, phrases, prompt, nouns, roles[i], placed))
        else:
            placed = i > 0 and isinstance(ops[i - 1], Relation)
            phrases.append(_parse_phrase(span, prompt, nouns, roles[i], first and i == 0, placed))
            index.append(len(phrases) - 1)
    _check_open_joins(spans, ops, index, prompt)
    if not local and all(span[:1] == ["the"] for span in spans):
        raise _fail(prompt, f"statement {' '.join(' '.join(span) for span in spans)!r} only names "
                            "noun phrases written before it and says nothing about them")
    _check_edges(local, spans, index, phrases, prompt)
    edges = [(index[i], relation, index[j]) for i, relation, j in local]
    if groups is not None:
        groups += _lists(edges, index, bool(each_other))
    return edges


def _unpose(span: list[str], relation: Relation, phrases: list[NounPhrase], at: int, prompt: str,
            nouns: frozenset[str] | None) -> None:
    """Read the first of "A and B sleeping next to it" again without the state its posture verb
    gave every listed noun phrase: "it" is A, so only B is sleeping."""
    verb = relation.form.split(" ")[0]
    if verb in ATTRIBUTE_KIND and span[1:2] == [verb] and span[0] != "the":
        phrases[at] = _parse_phrase([span[0], *span[2:]], prompt, nouns, "", False)


def _check_edges(local: list[tuple[int, str, int]], spans: list[list[str]], index: list[int],
                 phrases: list[NounPhrase], prompt: str) -> None:
    for i, relation, j in local:
        if index[i] == index[j]:
            raise _fail(prompt, f"it relates {' '.join(spans[i])!r} to "
                                f"{' '.join(spans[j])!r}, the same noun phrase")
        if relation == "in" and phrases[index[j]].noun == "row":
            raise _fail(prompt, f"'in {' '.join(spans[j])}' reads as an arrangement ('parked in a "
                                f"row'), not an object; {_LLM}")
        pair = [b for a, r, b in local if (a, r) == (i, "between")]
        if relation == "between" and phrases[index[j]].count < 2 and (
                len(pair) != 2 or any(phrases[index[b]].count != 1 for b in pair)):
            raise _fail(prompt, f"'between' needs one noun phrase of two or more after it ('a "
                                f"lamp between two chairs') or two of one ('a lamp between a bed "
                                f"and a desk'), not {' or '.join(' '.join(spans[b]) for b in pair)!r}"
                                f"; {_LLM}")


def _lists(edges: list[tuple[int, str, int]], index: list[int],
           each_other: bool) -> list[tuple[int, ...]]:
    """The lists of two or more noun phrases a statement writes, which "they" may name: a bare
    list ("a dog and a cat"), the subjects of one relation ("a dog and a cat on a rug"), the
    objects of one ("a cat next to a dog and a bird"), and "A and B next to each other"."""
    if not edges or each_other:
        return [tuple(dict.fromkeys(index))] if len(set(index)) > 1 else []
    objects: dict[tuple[int, str], set[int]] = {}
    subjects: dict[tuple[str, int], set[int]] = {}
    for i, relation, j in edges:
        objects.setdefault((i, relation), set()).add(j)
        subjects.setdefault((relation, j), set()).add(i)
    found = {tuple(sorted(g)) for g in [*objects.values(), *subjects.values()] if len(g) > 1}
    return sorted(found)


def _check_open_joins(spans: list[list[str]], ops: list[str | Relation], index: list[int],
                      prompt: str) -> None:
    """Refuse "X next to A and B rel C" whose C is not written before ("a pen beside a notebook
    and a pencil on a desk": is the pencil a second object of "beside", and is only the pencil on
    the desk?); see `open_joins`."""
    for k in open_joins(spans, ops):
        if index[k + 1] in index[:k + 1]:
            continue
        first, second = ops[k - 2], ops[k]
        b, c = " ".join(spans[k]), " ".join(spans[k + 1])
        raise _fail(prompt, f"{b!r} after {first.form!r} and 'and' may be a second object of "
                            f"{first.form!r} or the subject of a new clause, and "
                            f"'{second.form} {c}' may place it alone or every noun phrase before "
                            f"it (a list or a new clause?); write a comma before 'and' for a new "
                            f"clause ('..., and {b} {second.form} {c}'), or {_LLM}")


def _pronoun(word: str, subjects: set[int], phrases: list[NounPhrase], prompt: str,
             relation: Relation) -> int:
    """Index of the one noun phrase written before that "it" (one) or "them" (two or more) names
    as the object of `relation`: the only one of that number other than the relation's subjects
    ("three puppies in a basket and a kitten next to it": the basket). Several or none is an
    error naming them."""
    plural = word == "them"
    found = [i for i, p in enumerate(phrases) if i not in subjects and (p.count > 1) == plural]
    if len(found) == 1:
        return found[0]
    number = "two or more" if plural else "one"
    shown = [" ".join([str(phrases[i].count), *(v for _, v in phrases[i].attributes),
                       phrases[i].noun]) for i in found]
    said = f"{relation.form} {word}"
    if not found:
        raise _fail(prompt, f"{said!r} names no noun phrase of {number} written before it; "
                            f"name the object ('{relation.form} the ...') or {_LLM}")
    raise _fail(prompt, f"{said!r} could name any of {shown}; name the object ('{relation.form} "
                        f"the ...') or {_LLM}")


def _is_setting(span: list[str]) -> bool:
    """Whether a noun phrase names a ground or scene ("a sandy beach", "the water", "a field of
    wheat"): its last word, or its head before "of", singular, is one of the vocabulary's
    `settings`."""
    words = span[:span.index("of")] if "of" in span else span
    return bool(words) and singularize(words[-1]) in SETTINGS


def _each_other(spans: list[list[str]], ops: list[str | Relation],
                prompt: str) -> list[tuple[int, str, int]] | None:
    """The one edge of "A and B next to each other" (or "near", "close to": relations that hold
    both ways), from A to B; None when "each other" is not written. Any other "each other" is an
    error: after more than two noun phrases or another relation it is not one edge."""
    if not any(span[:2] == ["each", "other"] for span in spans):
        return None
    relation = ops[-1] if ops else None
    fits = (spans[-1] == ["each", "other"] and len(spans) == 3 and ops[0] == SEP
            and isinstance(relation, Relation) and relation.canonical in _BOTH_WAYS)
    if not fits:
        raise _fail(prompt, "'each other' is read only as 'A and B next to each other' (or "
                            "'near', 'close to' each other): two noun phrases and a relation that "
                            f"holds both ways; {_LLM}")
    return [(0, relation.canonical, 1)]


def _predicate(spans: list[list[str]], ops: list[str | Relation], phrases: list[NounPhrase],
               edges: list[tuple[int, str, int]], prompt: str, nouns: frozenset[str] | None,
               opening: bool = False) -> list[tuple[int, str, int]]:
    """Apply "the cup is red [and shiny]" to the phrase it names, in place. When `opening` (no
    noun phrase has been written with a/an or a count) a subject no earlier noun phrase has the
    noun of is a new noun phrase of one ("the cat is black"). "the cat's collar is red" names the
    cat's collar (`_possessed_subject`); the edges it adds are returned."""
    at = next(i for i, w in enumerate(spans[0]) if w in PREDICATE_VERBS)
    subject, verb = spans[0][:at], spans[0][at]
    added: list[tuple[int, str, int]] = []
    if any(w.endswith("'s") for w in subject):
        i, added = _possessed_subject(subject, phrases, edges, prompt, nouns, opening)
    else:
        i = _reference(subject, phrases, prompt, nouns, "", opening)
    said = f"{' '.join(subject)} {verb}"
    if any(isinstance(op, Relation) for op in ops) or not all(spans[1:]):
        raise _fail(prompt, f"after {said!r} comes either attribute words ('the cup is red and "
                            f"shiny') or one relation ('the cup is next to a plate'); {_LLM}")
    words = spans[0][at + 1:] + [w for span in spans[1:] for w in span]
    attributes = _predicate_attributes(words, verb, said, prompt)
    try:
        phrases[i] = with_attributes(phrases[i], attributes, " ".join(subject), ATTRIBUTE_KINDS)
    except ValueError as err:
        raise _fail(prompt, str(err)) from err
    return added


def _possessed_subject(subject: list[str], phrases: list[NounPhrase],
                       edges: list[tuple[int, str, int]], prompt: str,
                       nouns: frozenset[str] | None,
                       opening: bool) -> tuple[int, list[tuple[int, str, int]]]:
    """(index, new edges) of "the X's Y" opening a predication ("a black cat; the cat's collar is
    red"): X names a noun phrase as "the X" does, and Y is the one Y that X is "with" already, or
    a new noun phrase of one with a "with" edge from X, as the lists write it. A part ("the cat's
    tail is black": the tail's colour or the cat's?), a plural ("the cat's kittens": how many?)
    and a Y written before that is no one's ("a cat and a collar; the cat's collar is red": that
    collar or another?) are refused."""
    at = next(k for k, w in enumerate(subject) if w.endswith("'s"))
    said, owned = " ".join(subject), subject[at + 1:]
    if subject[0] != "the" or not owned or any(w.endswith("'s") for w in owned):
        raise _fail(prompt, f"possessive {said!r}: the offline parser reads a possessive subject "
                            f"only as 'the X's Y is ...' ('the cat's collar is red'); {_LLM}")
    owner = _reference([*subject[:at], subject[at][:-2]], phrases, prompt, nouns, "", opening)
    phrase = _parse_phrase(["a", *owned], prompt, nouns, "", False)
    if phrase.noun in PARTS or singularize(owned[-1]) != owned[-1]:
        what = "a part" if phrase.noun in PARTS else "a plural, with no count"
        raise _fail(prompt, f"{said!r} names {what} ({owned[-1]!r}), which the offline parser "
                            f"does not place; {_LLM}")
    held = [j for a, r, j in edges if (a, r) == (owner, "with") and phrases[j].noun == phrase.noun]
    if held:
        return held[0], []
    owned_by_others = {j for _, r, j in edges if r == "with"}
    if any(p.noun == phrase.noun and j not in owned_by_others for j, p in enumerate(phrases)):
        raise _fail(prompt, f"{said!r}: a {phrase.noun} was written before, not with the "
                            f"{phrases[owner].noun}; is it that one or another? {_LLM}")
    phrases.append(phrase)
    return len(phrases) - 1, [(owner, "with", len(phrases) - 1)]


def _pronoun_predicate(spans: list[list[str]], ops: list[str | Relation],
                       phrases: list[NounPhrase], groups: list[tuple[int, ...]],
                       prompt: str) -> None:
    """Apply "it is red", "they are both brown", "each of them empty" to the noun phrases the
    pronoun names (`cast_core.csg.references.pronoun_targets`), in place."""
    at, pronoun, quantifier = pronoun_subject(spans[0])
    said = " ".join(spans[0][:at])
    if any(isinstance(op, Relation) for op in ops) or not all(spans[1:]):
        raise _fail(prompt, f"after {said!r} come only attribute words ('they are red and "
                            f"shiny'); for a relation name the noun phrase ('the cups are on a "
                            f"tray') or {_LLM}")
    words = spans[0][at:] + [w for span in spans[1:] for w in span]
    attributes = _predicate_attributes(words, spans[0][at - 1], said, prompt)
    try:
        targets = pronoun_targets(pronoun, quantifier, phrases, groups)
        for i in targets:
            phrases[i] = with_attributes(phrases[i], attributes, said, ATTRIBUTE_KINDS)
    except ValueError as err:
        raise _fail(prompt, f"{err}; {_LLM}") from err


def _predicate_attributes(words: list[str], verb: str, said: str,
                          prompt: str) -> tuple[tuple[str, str], ...]:
    """The attributes a predication gives ("red and shiny", "made of wood"), or an error naming
    the words that are not."""
    made = _made_of(words)
    if made is not None:
        rest = _attributes(made[0]) if made[0] else ()
        attributes = None if rest is None else _merge(rest, made[1])
        _check_kind_words(rest or (), said, prompt)
    else:
        attributes = _attributes(words) if words else None
    if attributes is None:
        construct = _construct([verb, *words])
        unknown = [w for w in words if w not in ATTRIBUTE_KIND and w not in COLOR_MODIFIERS]
        reason = construct or (f"{unknown} after {said!r} is not an attribute word the offline "
                               f"parser knows" if unknown else f"{words} after {said!r} gives an "
                               "attribute kind twice or nothing")
        raise _fail(prompt, f"{reason}; {_LLM}")
    if made is None:
        _check_kind_words(attributes, said, prompt)
    return attributes


def _reference(words: list[str], phrases: list[NounPhrase], prompt: str,
               nouns: frozenset[str] | None, role: str, placed: bool = False) -> int:
    """Index in `phrases` of the one that "the [attributes] noun" names. When `placed` (the
    object of a relation: "a cat under the bed", or the subject of an opening predication: "the
    cat is black") and no earlier noun phrase has its noun, it is a new noun phrase of one,
    appended: "the bed" is one bed. A plural or invariant noun ("the
    dogs", "the sheep") says no count and stays an error."""
    text, rest = " ".join(words), words[1:]
    _check_noun_words(rest, text, prompt, role)
    _check_ambiguous(rest, text, prompt, nouns)
    plural = singularize(" ".join(rest)) != " ".join(rest)
    readings: list[Reading] = []
    for count in (1, 2) if plural else (1,):
        split = _split(rest, count, nouns)
        if split is not None:
            readings.append((split[0], split[1], count > 1))
    if not readings:
        raise _fail(prompt, _no_split_reason(rest, text, nouns, 2 if plural else 1))
    _check_kind_words(readings[0][1], text, prompt)
    if placed and not plural and pluralize(readings[0][0]) != readings[0][0] \
            and unnamed(readings, phrases):
        phrases.append(NounPhrase(readings[0][0], 1, readings[0][1]))
        return len(phrases) - 1
    try:
        return antecedent(text, readings, phrases)
    except ValueError as err:
        raise _fail(prompt, f"{err}{role}") from err


def _roles(ops: list[str | Relation]) -> list[str]:
    """For error messages: 'the object of 'next to'' for a noun phrase after a relation."""
    roles = [""]
    for op in ops:
        roles.append(f" (the object of {op.form!r})" if isinstance(op, Relation) else "")
    return roles


def _parse_phrase(words: list[str], prompt: str, nouns: frozenset[str] | None, role: str,
                  first: bool, placed: bool = False) -> NounPhrase:
    """The noun phrase of "(a|an|count|its|...) [attributes] noun", or, when `placed` (the object
    of a relation), of "[attributes] MASS-NOUN" ("in tall grass", "in shallow water": one)."""
    text = " ".join(words)
    if placed and "" not in words and words[-1] in MASS_NOUNS and words[0] not in COUNT_WORDS:
        words = ["a", *words]
    if len(words) < 2 or "" in words:
        raise _fail(prompt, f"noun phrase {text!r}{role} must be '(a|an|number) [attributes] "
                            "noun'")
    if words[0] in POSSESSIVES:
        count, rest = _possessed(words, text, prompt)
    elif words[0] not in COUNT_WORDS:
        start = ("it must start with 'a photo of ' or with a noun phrase: a/an or a count "
                 "one..ten (or 1..10)" if first else
                 f"noun phrase {text!r}{role} must start with a/an or a count one..ten "
                 "(or 1..10)")
        raise _fail(prompt, f"{start}, not {words[0]!r}")
    else:
        count, rest = COUNT_WORDS[words[0]], words[1:]
        # "a single red rose" is one red rose
        rest = rest[1:] if count == 1 and rest[:1] == ["single"] and len(rest) > 1 else rest
    made = _made_of(rest) if rest[-3:-1] == ["made", "of"] else None
    rest = made[0] if made else rest
    _check_noun_words(rest, text, prompt, role)
    _check_ambiguous(rest, text, prompt, nouns)
    split = _split(rest, count, nouns)
    if split is None:
        raise _fail(prompt, _no_split_reason(rest, text, nouns, count))
    _check_kind_words(split[1], text, prompt)
    attributes = _merge(split[1], made[1]) if made else split[1]
    if attributes is None:
        raise _fail(prompt, f"noun phrase {text!r} gives its material twice (before the noun and "
                            f"after 'made of'); one value per kind ({_LLM})")
    return NounPhrase(split[0], count, attributes)


def _check_possessives(spans: list[list[str]], ops: list[str | Relation], prompt: str) -> None:
    """Refuse "its|his|her|their ..." anywhere but among the objects of a clause's first relation
    after one noun phrase, its owner ("a dog with its ball", "a boy beside his mother and a dog"):
    after a later relation the owner is unclear ("a cat with a bell on its collar": the cat's, and
    is the bell on it?), and in a list ("a man and his dog") the lists write the owner's "with"
    both ways."""
    first = next((k for k, op in enumerate(ops) if isinstance(op, Relation)), None)
    objects = set()
    if first == 0:
        later = next((k for k in range(1, len(ops)) if isinstance(ops[k], Relation)), len(ops))
        objects = set(range(1, later + 1))
    for i, span in enumerate(spans):
        if span[:1] and span[0] in POSSESSIVES and i not in objects:
            raise _fail(prompt, f"{' '.join(span)!r}: the offline parser reads 'its', 'his', "
                                f"'her', 'their' only after the first relation of a noun phrase "
                                f"that owns it ('a dog with its ball'); here whose it is, or "
                                f"whether the owner has it ('with'), is ambiguous; {_LLM}")


def _possessed(words: list[str], text: str, prompt: str) -> tuple[int, list[str]]:
    """(count, words after it) of "its|his|her|their [count] ...": one, or the count written
    ("their two puppies"). A part ("its roof": of which noun phrase?) and a plural without a
    count ("her dogs") are refused."""
    if words[1] in COUNT_WORDS and words[1] not in ("a", "an"):
        count, rest = COUNT_WORDS[words[1]], words[2:]
    else:
        count, rest = 1, words[1:]
    last = rest[-1] if rest else ""
    if singularize(last) in PARTS:
        raise _fail(prompt, f"{text!r} names a part ({last!r}) of a noun phrase written before, "
                            f"which the offline parser does not place; {_LLM}")
    if count == 1 and singularize(last) != last:
        raise _fail(prompt, f"{text!r} says no count for a plural noun; write one ('her two "
                            f"dogs') or {_LLM}")
    return count, rest


def _owner(span: list[str], prompt: str) -> list[str]:
    """A noun phrase "a horse's back" names its owner, "a horse" ("a bird on a horse's back" is
    on the horse, as the lists write it); any other "X's Y" ("a horse's saddle": is the horse in
    the picture?) is refused."""
    at = next((i for i, w in enumerate(span) if w.endswith("'s")), None)
    if at is None:
        return span
    after = span[at + 1:]
    if len(after) == 1 and singularize(after[0]) in PARTS:
        return [*span[:at], span[at][:-2]]
    raise _fail(prompt, f"possessive {' '.join(span[at:])!r} in {' '.join(span)!r}: the offline "
                        f"parser reads 'X's' only before a part ('on a horse's back': on the "
                        f"horse), not whether the owner is in the picture; {_LLM}")


def _made_of(words: list[str]) -> tuple[list[str], tuple[tuple[str, str], ...]] | None:
    """The words without the "made of MATERIAL" among them, and that material attribute ("a vase
    made of glass", "the gate is made of iron"); None when there is none."""
    for i in range(len(words) - 2):
        if words[i:i + 2] == ["made", "of"] and words[i + 2] in _MATERIAL_WORDS:
            return words[:i] + words[i + 3:], (("material", words[i + 2]),)
    return None


def _check_kind_words(attributes: tuple[tuple[str, str], ...], text: str, prompt: str) -> None:
    """Refuse an attribute word the lists file under two kinds ("a bronze statue": its colour or
    its material?), naming it."""
    for kind, value in attributes:
        if value in AMBIGUOUS_KIND_WORDS:
            kinds = " or its ".join(AMBIGUOUS_KIND_WORDS[value])
            hint = ("name the colour with another colour word ('brown', 'gold')"
                    if "color" in AMBIGUOUS_KIND_WORDS[value] else "use another word")
            raise _fail(prompt, f"{value!r} in {text!r} may be its {kinds} (the held-out lists "
                                f"write it both ways); {hint} or {_LLM}")


def _merge(first: tuple[tuple[str, str], ...],
           second: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...] | None:
    """Both attribute tuples in kind order; None when they share a kind."""
    found = dict(first)
    if any(kind in found for kind, _ in second):
        return None
    found.update(second)
    return tuple((k, found[k]) for k in ATTRIBUTE_KINDS if k in found)


def _check_noun_words(rest: list[str], text: str, prompt: str, role: str) -> None:
    allowed = {i for i, w in enumerate(rest) if w == "and" and _joins_colors(rest, i)}
    allowed |= {_of_at(rest)}
    if any(w in _NOT_NOUN_WORDS for w in rest):
        allowed |= _compound_ending(rest)
    bad = [w for i, w in enumerate(rest)
           if i not in allowed and (not _WORD.fullmatch(w) or w in _NOT_NOUN_WORDS)]
    if not rest:
        raise _fail(prompt, f"noun phrase {text!r}{role} must be '(a|an|number|the) "
                            "[attributes] noun'")
    if bad:
        construct = _construct(rest)
        raise _fail(prompt, (f"{construct}; " if construct else "")
                    + f"noun {' '.join(rest)!r} in {text!r} has words that are not part of a "
                      f"noun: {bad}; {_LLM}")


def _compound_ending(rest: list[str]) -> set[int]:
    """Indices of the words of a listed compound noun that ends the noun phrase ("front door",
    whose "front" is otherwise part of "in front of")."""
    for j in range(len(rest) - 1):
        if singularize(" ".join(rest[j:])) in COMPOUND_NOUNS:
            return set(range(j, len(rest)))
    return set()


def _check_ambiguous(rest: list[str], text: str, prompt: str,
                     nouns: frozenset[str] | None) -> None:
    """Refuse an attribute word + noun that is also a compound ("a blue whale": the species, or a
    whale coloured blue?), unless a noun list decides."""
    if nouns is not None:
        return
    for first, second in pairwise(rest):
        if first not in _AMBIGUOUS_FIRST:
            continue
        pair = f"{first} {singularize(second)}"
        if pair in AMBIGUOUS_COMPOUND_NOUNS:
            kind = {"color": "colour"}.get(ATTRIBUTE_KIND[first], ATTRIBUTE_KIND[first])
            raise _fail(prompt, f"{pair!r} in {text!r} may be one noun (a kind of "
                                f"{singularize(second)}) or a {singularize(second)} whose {kind} "
                                f"is {first}; give the parser a noun list or {_LLM}")


def _split(rest: list[str], count: int,
           nouns: frozenset[str] | None) -> tuple[str, tuple[tuple[str, str], ...]] | None:
    """(noun, attributes) of the words after the count: the longest noun whose words before are
    all attributes, one per kind; None when there is none."""
    at = _of_at(rest)
    if at is not None:
        return _split_of(rest, at, count, nouns)
    for j in range(len(rest)):
        noun = singularize(" ".join(rest[j:])) if count > 1 else " ".join(rest[j:])
        attributes = _attributes(rest[:j])
        if attributes is not None and _is_noun(rest[j:], noun, nouns):
            return noun, attributes
    return None


def _of_at(rest: list[str]) -> int | None:
    """Index of the one "of" after a container or quantity word ("cup of", "loaves of", "pair
    of"), where an "of" phrase may start; None when there is none."""
    if rest.count("of") != 1 or rest.index("of") in (0, len(rest) - 1):
        return None
    at = rest.index("of")
    return at if {rest[at - 1], singularize(rest[at - 1])} & (OF_HEADS | {"pair"}) else None


def _split_of(rest: list[str], at: int, count: int,
              nouns: frozenset[str] | None) -> tuple[str, tuple[tuple[str, str], ...]] | None:
    """(noun, attributes) of "[attributes] HEAD of [attributes] NOUN": one noun "cup of tea" whose
    head takes the number ("two loaves of bread": loaf of bread x2); an attribute on either side
    of "of" is the node's ("a steaming cup of tea", "a bowl of red apples": bowl of apples, colour
    red), as the held-out lists write it. None when the head is no container or quantity, the
    words after "of" are not attributes and one noun, or a kind is given twice."""
    head = singularize(rest[at - 1]) if count > 1 else rest[at - 1]
    attributes = _attributes(rest[:at - 1])
    if head not in OF_HEADS | {"pair"} or attributes is None:
        return None
    return _split_inner(head, rest[at + 1:], attributes, nouns)


def _split_inner(head: str, inner: list[str], before: tuple[tuple[str, str], ...],
                 nouns: frozenset[str] | None) -> tuple[str, tuple[tuple[str, str], ...]] | None:
    """(noun, attributes) of "HEAD of [attributes] NOUN" given the attributes `before` the head:
    the longest noun after "of" whose words before are attributes ("a pair of red boots": pair of
    boots, colour red; "a cup of hot chocolate": cup of hot chocolate)."""
    for j in range(len(inner)):
        attributes = _attributes(inner[:j])
        if attributes is not None and _inner_noun(inner[j:]):
            merged = _merge(before, attributes)
            noun = f"{head} of {' '.join(inner[j:])}"
            ok = merged is not None and (nouns is None or noun in nouns)
            return (noun, merged) if ok else None
    return None


def _inner_noun(words: list[str]) -> bool:
    """Whether the words after "of" are one noun, as written ("tea", "cookies", "orange juice")."""
    if not words or any(not _WORD.fullmatch(w) or w in _NOT_NOUN_WORDS for w in words):
        return False
    return _is_noun(words, singularize(" ".join(words)), None) or " ".join(words) in COMPOUND_NOUNS


def _joins_colors(words: list[str], i: int) -> bool:
    """Whether words[i] ("and") joins two colour words into one colour ("black and white")."""
    return (0 < i < len(words) - 1 and ATTRIBUTE_KIND.get(words[i - 1]) == "color"
            and ATTRIBUTE_KIND.get(words[i + 1]) == "color")


def _is_noun(words: list[str], noun: str, nouns: frozenset[str] | None) -> bool:
    if nouns is not None:
        return noun in nouns
    if len(words) > 1:
        return noun in COMPOUND_NOUNS
    word = words[0]
    plain = word not in VERBS and word not in CLAUSE_WORDS and (word not in COLOR_MODIFIERS
                                                                or word in ALSO_NOUNS)
    return plain and (word not in ATTRIBUTE_KIND or word in ALSO_NOUNS or noun in ALSO_NOUNS)


def _attributes(words: list[str]) -> tuple[tuple[str, str], ...] | None:
    """(kind, value) pairs of attribute words in kind order; None when a word is not one or a
    kind repeats. A colour modifier joins the colour after it ("light blue"), and "and" joins
    two colours into one ("black and white")."""
    found: dict[str, str] = {}
    i = 0
    while i < len(words):
        word, after = words[i], words[i + 1] if i + 1 < len(words) else None
        if word in COLOR_MODIFIERS and after is not None and ATTRIBUTE_KIND.get(after) == "color":
            kind, value, i = "color", f"{word} {after}", i + 2
        elif _hyphenated_colors(word):
            kind, value, i = "color", word.replace("-", " "), i + 1
        elif word in ATTRIBUTE_KIND:
            kind, value, i = ATTRIBUTE_KIND[word], word, i + 1
        else:
            return None
        while kind == "color" and words[i:i + 1] == ["and"] and _joins_colors(words, i):
            value, i = f"{value} and {words[i + 1]}", i + 2
        if kind in found:
            return None
        found[kind] = value
    return tuple((k, found[k]) for k in ATTRIBUTE_KINDS if k in found)


def _hyphenated_colors(word: str) -> bool:
    """Whether a word is two colours joined by "-and-" ("red-and-white"): one colour, as "red and
    white"."""
    parts = word.split("-and-")
    return len(parts) == 2 and all(ATTRIBUTE_KIND.get(p) == "color" for p in parts)


def _construct(words: list[str]) -> str | None:
    """The unsupported construct the words after a count show, if one can be named."""
    for i, word in enumerate(words):
        later = i > 0
        if word == "of" and _of_at(words) == i:
            continue
        if word in CLAUSE_WORDS:
            return f"it has a nested clause ({' '.join(words[i:])!r}), which the offline parser " \
                   f"does not read"
        if later and word in VERBS:
            return f"it has a verb ({word!r}), which the offline parser does not read"
        if later and word == "of" and words.count("of") > 1:
            return f"it has 'of' {words.count('of')} times ({' '.join(words)!r}), which the " \
                   f"offline parser does not read"
        if later and word == "of":
            return (f"it has an 'of' phrase ({' '.join(words[i - 1:i + 2])!r}); the offline parser "
                    f"reads 'of' only after a container or quantity ('a cup of tea', 'two loaves "
                    f"of bread'; {sorted(OF_HEADS)})")
        if later and word in _RELATION_PARTS:
            return (f"relation form {' '.join(words[max(0, i - 2):i + 2])!r} is not one the "
                    f"offline parser reads; its forms are {sorted(RELATION_PHRASES)}")
        if later and word in UNSUPPORTED_RELATIONS:
            return (f"relation {word!r} is not one the offline parser reads; its forms are "
                    f"{sorted(RELATION_PHRASES)}")
        joins = i + 1 < len(words) and (words[i + 1] in _NOT_NOUN_WORDS
                                        or words[i + 1] in UNSUPPORTED_RELATIONS)
        if later and joins and word.endswith(("ing", "ed")) and word not in ATTRIBUTE_KIND:
            return f"it has a verb ({word!r}), which the offline parser does not read"
    return None


def _no_split_reason(rest: list[str], text: str, nouns: frozenset[str] | None,
                     count: int = 1) -> str:
    construct = _construct(rest)
    if construct:
        return f"{construct} (in noun phrase {text!r}); {_LLM}"
    at = _of_at(rest)
    if at is not None:
        return _of_reason(rest, at, text, nouns, count)
    head_at = _head_start(rest, nouns)
    if head_at is None:
        return (f"noun phrase {text!r} names none of the listed nouns {sorted(nouns or ())}; "
                "check the prompt against its metadata")
    before, head = rest[:head_at], " ".join(rest[head_at:])
    if head in ATTRIBUTE_KIND and (not before or _attributes(rest) is not None):
        return (f"{head!r} in {text!r} is an attribute ({ATTRIBUTE_KIND[head]}), not a noun; "
                f"name the object after it")
    kinds, unknown, extra = {}, [], []
    for i, (word, after) in enumerate(zip(before, [*before[1:], head])):
        if word == "and" and _joins_colors(rest, i):
            continue
        colored = (word in COLOR_MODIFIERS and ATTRIBUTE_KIND.get(after) == "color"
                   or _hyphenated_colors(word))
        kind = ATTRIBUTE_KIND.get(word, "color" if colored else None)
        if kind is None:
            unknown.append(word)
        elif kind in kinds and word not in COLOR_MODIFIERS:
            extra.append(word)
        kinds.setdefault(kind, word)
    if unknown:
        return (f"{unknown} before the noun {head!r} in {text!r} is not an attribute word the "
                f"offline parser knows ({', '.join(ATTRIBUTE_KINDS)}) nor part of a known noun; "
                f"add it to cast_core/csg/vocabulary.json, give the parser a noun list, or {_LLM}")
    if extra:
        return (f"noun phrase {text!r} gives an attribute kind twice: {extra} repeats a kind "
                f"already given; one value per kind ({_LLM})")
    return f"noun phrase {text!r} does not read as attributes and a noun; {_LLM}"


def _of_reason(rest: list[str], at: int, text: str, nouns: frozenset[str] | None,
               count: int) -> str:
    head, inner = rest[at - 1], rest[at + 1:]
    single = singularize(head) if count > 1 else head
    if single == "pair" or head == "pair":
        return (f"{text!r} has 'pair of', which the offline parser reads only as '[attributes] "
                f"pair of [attributes] NOUNS' with one noun after the attributes ('a pair of red "
                f"boots'), each attribute kind once; {_LLM}")
    if single not in OF_HEADS:
        return (f"{head!r} in {text!r} does not agree with its count {count} before 'of'; "
                f"{_LLM}")
    if _attributes(rest[:at - 1]) is None:
        return _no_split_reason(rest[:at], text, None, count)
    split = next((j for j in range(len(inner)) if _attributes(inner[:j]) is not None
                  and _inner_noun(inner[j:])), None)
    if split is None:
        return (f"{' '.join(inner)!r} after {head + ' of'!r} in {text!r} is not attribute words "
                f"and one noun the offline parser reads; {_LLM}")
    if split > 0 and nouns is None:
        return (f"noun phrase {text!r} gives an attribute kind twice, before and after 'of'; "
                f"one value per kind ({_LLM})")
    return (f"noun phrase {text!r} names none of the listed nouns {sorted(nouns or ())}; "
            "check the prompt against its metadata")


def _head_start(rest: list[str], nouns: frozenset[str] | None) -> int | None:
    """Where the noun starts for an error message: the longest listed noun ending the words, else
    the last word; None when a noun list is given and no ending is in it."""
    for j in range(len(rest)):
        words = rest[j:]
        if nouns is not None and (" ".join(words) in nouns
                                  or singularize(" ".join(words)) in nouns):
            return j
        if nouns is None and len(words) > 1 and singularize(" ".join(words)) in COMPOUND_NOUNS:
            return j
    return None if nouns is not None else len(rest) - 1


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
    return NounPhrase(clause["class"], count, (("color", color),) if color else ())


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
        raise _fail(prompt, f"noun phrases {shown} appear twice; state each kind once with "
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
        raise _fail(prompt, str(err)) from err
    return graph
