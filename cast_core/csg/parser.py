"""Deterministic CSG builder for compositional prompts, from prompt text (from GenEval metadata:
`cast_core.csg.geneval`).

Grammar (GenEval's six templates and the shapes world's forms are all instances):
    prompt    := [PREFIX] ["there is " | "there are " | "there's "] statement ( (";" | ".")
                 statement )* ["."]                                 PREFIX: "a photo of ", ...
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
(`garments` in the vocabulary: "a girl in a yellow raincoat next to a tree": the girl) or "in"/"on"
the scene (`scene_grounds` with "the" or bare: "a fox in the snow next to a tree", "a deer in tall
grass": the subject; in a later clause refused); after "in" a container (`containers`: "a cat in a
basket on a sofa") it places the container; after a ground (`settings`), "under" the sky, sun,
moon or stars places the subject ("a cow on a hill under a gray sky"). "in the middle of", "in the
center of", "in the corner of" read as "on" a surface ("a bowl in the middle of a table") and "in"
an area ("a statue in the middle of a garden") (`cast_core.csg.places`); a chain after one is
refused. "with" later in
a chain belongs to the noun phrase before it only in "A with B rel C with D". "between" takes one noun
phrase of two or more ("a lamp between two chairs") or two of one ("a lamp between a bed and a
desk": a "between" edge to each, both asking "Is the lamp between the bed and the desk?"). A
possessive subject of a predication, "the X's Y is ..." ("a black cat; the cat's collar is red"),
is X with Y, Y a new noun phrase of one unless X is already with one. A separator before "the
... is|are" also starts a statement ("a cat next to a dog, the dog is brown"). "the" + a singular noun that no earlier noun
phrase has is a new noun phrase of one after a relation ("a cat under the bed") and as the subject
of a predication before any a/an or count noun phrase ("the cat is black"). "A and B next to each
other" (near, close to) is one edge from A to B; one more relation after it places both ("a dog
and a cat near each other on a rug"). A predication on a pronoun ("it is red", "they are
both brown", "each of them empty") names the one noun phrase of that number, or the one list,
written before ("they are all" among several: the one that holds every other), or "they" the only
two noun phrases of one ("a dog next to a cat; they are both sleeping"), or "it" among several the
subject of a first statement of one clause ("a vase on a shelf; it is blue"); "them" as an
object may name the only two noun phrases of one ("a gray car behind them")
(`cast_core.csg.pronouns`); "its", "his", "her", "their" read as
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

Node order is the order of appearance; edge k is "rel{k}" in order of appearance. Atoms and their
questions: `cast_core.csg.questions` (shared with the LLM builder).

Here: prompts, statements and clauses. Clause structure: `cast_core.csg.clauses` (chains:
`chains`; places: `places`); one noun phrase: `cast_core.csg.noun_phrases` (its words: `words`;
why they do not read: `refusals`); predications: `cast_core.csg.predicates`; pronouns:
`pronouns`; the noun phrase type, the error and the graph they make: `cast_core.csg.build`.
"""

from __future__ import annotations

from collections.abc import Iterable

from cast_core.csg.build import LLM_HINT, NounPhrase, build_graph, fail
from cast_core.csg.clauses import (
    PRONOUNS,
    SEP,
    Relation,
    clause_edges,
    is_predication,
    open_joins,
    pronoun_subject,
    split_statements,
)
from cast_core.csg.graph import SceneGraph
from cast_core.csg.noun_phrases import (
    check_possessives,
    owner_span,
    read_phrase,
    read_reference,
)
from cast_core.csg.predicates import apply_predicate, apply_pronoun_predicate
from cast_core.csg.pronouns import clause_subject, object_pronoun
from cast_core.csg.refusals import unsupported_construct
from cast_core.csg.vocab import (
    ATTRIBUTE_KIND,
    SETTINGS,
    singularize,
)

__all__ = ["MAX_PROMPT_CHARS", "PREFIX", "PREFIXES", "parse_prompt"]

PREFIX = "a photo of "
# A picture of the whole scene, dropped ("a close-up of a ladybug on a leaf": since the thirteenth
# round, as every list writes them); "a painting of" stays an object ("a painting of a ship above
# a fireplace" hangs there).
PREFIXES: tuple[str, ...] = (PREFIX, "an image of ", "a picture of ", "a photograph of ",
                             "an illustration of ", "a close-up of ", "a close up of ")
# Said before the first noun phrase and dropped: "there is a cat on a mat" is "a cat on a mat".
THERE_PREFIXES: tuple[str, ...] = ("there is ", "there are ", "there's ")
MAX_PROMPT_CHARS = 400
# Relations that hold both ways, so "A and B next to each other" is one edge from A to B.
_BOTH_WAYS = frozenset({"next to", "close to"})


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
        raise fail(prompt[:80] + "...", f"it is {len(prompt)} characters long, more than the "
                                        f"limit of {MAX_PROMPT_CHARS}; shorten it or {LLM_HINT}")
    listed = None if nouns is None else frozenset(nouns)
    # Capitals say nothing the graph keeps ("A red car", "Three white swans.", "THREE RED BALLS"):
    # the words are read in lower case and the graph keeps the prompt as written.
    text = prompt.lower()
    body = next((text[len(p):] for p in PREFIXES if text.startswith(p)), text)
    body = next((body[len(p):] for p in THERE_PREFIXES if body.startswith(p)), body)
    try:
        statements = split_statements(body)
    except ValueError as err:
        raise fail(prompt, f"{err}; {LLM_HINT}") from err
    phrases: list[NounPhrase] = []
    edges: list[tuple[int, str, int]] = []
    groups: list[tuple[int, ...]] = []  # lists of noun phrases, which "they" may name
    opening = True  # no noun phrase written with a/an or a count yet
    lead = None  # the first statement's subject, which "it" names in the second (`clause_subject`)
    for n, (spans, ops) in enumerate(statements):
        if pronoun_subject(spans[0]) is not None:
            apply_pronoun_predicate(spans, ops, phrases, groups, prompt, lead if n == 1 else None)
            continue
        relates = spans[0][-1:] in (["is"], ["are"]) and ops and isinstance(ops[0], Relation)
        if is_predication(spans[0]) and not relates:
            edges += apply_predicate(spans, ops, phrases, edges, prompt, listed, opening)
            continue
        spans = [spans[0][:-1], *spans[1:]] if relates else spans
        sides = _picture_sides(spans, ops)
        if sides is not None:
            start = len(phrases)
            _clause([spans[0], spans[2]], [ops[1]], phrases, prompt, listed, n == 0 and body == text,
                    False, groups)
            left = start if sides == "left" else start + 1
            edges.append((left, "left of", start + 1 if sides == "left" else start))
            opening = False
            continue
        found = _clause(spans, ops, phrases, prompt, listed, n == 0 and body == text,
                        opening and bool(relates), groups)
        lead = clause_subject(found, bool(ops) and isinstance(ops[0], Relation), phrases)
        edges += found
        opening = opening and all(span[:1] in (["the"], ["each"]) for span in spans)
    repeated = sorted({e for e in edges if edges.count(e) > 1})
    if repeated:
        raise fail(prompt, f"it states relation {repeated[0][1]!r} between the same two noun "
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
        construct = next(filter(None, (unsupported_construct(span) for span in spans)), None)
        raise fail(prompt, (f"{construct}; " if construct else "") + f"{err}; {LLM_HINT}") from err
    each_other = _each_other(spans, ops, prompt)
    if each_other:
        local, spans, ops = each_other
    roles, index = _roles(ops), []
    also: dict[int, tuple[int, ...]] = {}  # "them" naming two noun phrases: the second's index
    spans = [owner_span(span, prompt) for span in spans]
    check_possessives(spans, ops, prompt)
    for i, span in enumerate(spans):
        if len(span) == 1 and span[0] in PRONOUNS and i > 0 and isinstance(ops[i - 1], Relation):
            subjects = {index[s] for s, _, j in local if j == i and s < i}
            head = index[0] if len(spans) == 3 and i == 2 and ops[0] == SEP else None
            named = object_pronoun(span[0], subjects - {head}, phrases, prompt, ops[i - 1])
            index.append(named[0])
            also.update({i: named[1:]} if len(named) > 1 else {})
            if index[-1] == head:
                # "a large bowl and three oranges in it": the oranges are in the bowl
                local = [e for e in local if e[0] != 0]
                _unpose(spans[0], ops[1], phrases, head, prompt, nouns)
        elif span[:1] == ["the"]:
            placed = isinstance(ops[i - 1], Relation) if i > 0 else opening
            index.append(read_reference(span, phrases, prompt, nouns, roles[i], placed))
        else:
            placed = i > 0 and isinstance(ops[i - 1], Relation)
            phrases.append(read_phrase(span, prompt, nouns, roles[i], first and i == 0, placed))
            index.append(len(phrases) - 1)
    _check_open_joins(spans, ops, index, prompt)
    if not local and all(span[:1] == ["the"] for span in spans):
        raise fail(prompt, f"statement {' '.join(' '.join(span) for span in spans)!r} only names "
                           "noun phrases written before it and says nothing about them")
    _check_edges(local, spans, index, phrases, prompt, also)
    edges = [(index[i], relation, k) for i, relation, j in local
             for k in (index[j], *also.get(j, ()))]
    if groups is not None:
        # "A and B near each other [on C]": A and B are a list, as the subjects of "on" are
        found = _lists(edges[1:] if each_other else edges, index)
        groups += sorted({tuple(index[:2]), *found}) if each_other else found
    return edges


def _picture_sides(spans: list[list[str]], ops: list[str | Relation]) -> str | None:
    """The side of the first noun phrase in "A on the left and B on the right" (or right, then
    left; "," for "and"), one edge from the one on the left to the other, as every list writes it;
    None for any other statement. Each side is a noun phrase written with a/an or a count."""
    if len(spans) != 4 or [getattr(op, "form", op) for op in ops] != ["on", SEP, "on"]:
        return None
    first, second = spans[1], spans[3]
    if {tuple(first), tuple(second)} != {("the", "left"), ("the", "right")}:
        return None
    if spans[0][:1] == ["the"] or spans[2][:1] == ["the"]:
        return None
    return first[1]


def _unpose(span: list[str], relation: Relation, phrases: list[NounPhrase], at: int, prompt: str,
            nouns: frozenset[str] | None) -> None:
    """Read the first of "A and B sleeping next to it" again without the state its posture verb
    gave every listed noun phrase: "it" is A, so only B is sleeping."""
    verb = relation.form.split(" ")[0]
    if verb in ATTRIBUTE_KIND and span[1:2] == [verb] and span[0] != "the":
        phrases[at] = read_phrase([span[0], *span[2:]], prompt, nouns, "", False)


def _check_edges(local: list[tuple[int, str, int]], spans: list[list[str]], index: list[int],
                 phrases: list[NounPhrase], prompt: str,
                 also: dict[int, tuple[int, ...]]) -> None:
    """Refuse a relation of a noun phrase to itself, "in a row", and "between" other than one
    noun phrase of two or more or two of one (`also`: the second noun phrase "them" names, by
    span)."""
    for i, relation, j in local:
        if index[i] == index[j]:
            raise fail(prompt, f"it relates {' '.join(spans[i])!r} to "
                               f"{' '.join(spans[j])!r}, the same noun phrase")
        if relation == "in" and phrases[index[j]].noun == "row":
            raise fail(prompt, f"'in {' '.join(spans[j])}' reads as an arrangement ('parked in a "
                               f"row'), not an object; {LLM_HINT}")
        pair = [b for a, r, b in local if (a, r) == (i, "between")]
        named = [k for b in pair for k in (index[b], *also.get(b, ()))]
        if relation == "between" and phrases[index[j]].count < 2 and (
                len(named) != 2 or any(phrases[k].count != 1 for k in named)):
            raise fail(prompt, f"'between' needs one noun phrase of two or more after it ('a "
                               f"lamp between two chairs') or two of one ('a lamp between a bed "
                               f"and a desk'), not {' or '.join(' '.join(spans[b]) for b in pair)!r}"
                               f"; {LLM_HINT}")


def _lists(edges: list[tuple[int, str, int]], index: list[int]) -> list[tuple[int, ...]]:
    """The lists of two or more noun phrases a statement writes, which "they" may name: a bare
    list ("a dog and a cat"), the subjects of one relation ("a dog and a cat on a rug"), the
    objects of one ("a cat next to a dog and a bird")."""
    if not edges:
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
        raise fail(prompt, f"{b!r} after {first.form!r} and 'and' may be a second object of "
                           f"{first.form!r} or the subject of a new clause, and "
                           f"'{second.form} {c}' may place it alone or every noun phrase before "
                           f"it (a list or a new clause?); write a comma before 'and' for a new "
                           f"clause ('..., and {b} {second.form} {c}'), or {LLM_HINT}")


def _is_setting(span: list[str]) -> bool:
    """Whether a noun phrase names a ground or scene ("a sandy beach", "the water", "a field of
    wheat"): its last word, or its head before "of", singular, is one of the vocabulary's
    `settings`."""
    words = span[:span.index("of")] if "of" in span else span
    return bool(words) and singularize(words[-1]) in SETTINGS


EachOther = tuple[list[tuple[int, str, int]], list[list[str]], list[str | Relation]]


def _each_other(spans: list[list[str]], ops: list[str | Relation],
                prompt: str) -> EachOther | None:
    """(edges, spans, ops) of "A and B next to each other" (or "near", "close to": relations that
    hold both ways), one edge from A to B, and of what may follow it: one more relation and its
    list, which places both ("a dog and a cat near each other on a rug": each is on the rug); the
    spans and ops are the statement's without "each other" and its relation. None when "each
    other" is not written. Any other "each other" is an error: after more than two noun phrases
    or another relation it is not one edge."""
    if not any(span[:2] == ["each", "other"] for span in spans):
        return None
    relation = ops[1] if len(ops) > 1 else None
    after = ops[2:]
    fits = (len(spans) > 2 and spans[2] == ["each", "other"] and ops[0] == SEP
            and isinstance(relation, Relation) and relation.canonical in _BOTH_WAYS
            and ["each", "other"] not in spans[3:]
            and (not after or isinstance(after[0], Relation) and not after[0].also
                 and after[0].canonical != "with"
                 and not any(isinstance(op, Relation) for op in after[1:])))
    if not fits:
        raise fail(prompt, "'each other' is read only as 'A and B next to each other' (or "
                           "'near', 'close to' each other): two noun phrases and a relation that "
                           "holds both ways, then at most one more relation that places both ('a "
                           f"dog and a cat near each other on a rug'); {LLM_HINT}")
    rest = [[(s, after[0].canonical, k) for s in (0, 1)] for k in range(2, len(spans) - 1)]
    edges = [(0, relation.canonical, 1), *(e for pair in rest for e in pair)]
    return edges, [*spans[:2], *spans[3:]], [ops[0], *after]


def _roles(ops: list[str | Relation]) -> list[str]:
    """For error messages: 'the object of 'next to'' for a noun phrase after a relation."""
    roles = [""]
    for op in ops:
        roles.append(f" (the object of {op.form!r})" if isinstance(op, Relation) else "")
    return roles
