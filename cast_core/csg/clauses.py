"""A prompt body's clause structure: statements, their noun-phrase spans, the separators and
relations between them, and which relation edges they make. The offline parser
(`cast_core.csg.parser`) reads each span.

Words are split on single spaces (a comma, ";" or "." ends a word). ";" and "." end a statement
(a final "." is dropped), and so does a separator before a predication, a span "the ... is|are"
("a cat next to a dog, the dog is brown"). Within a statement ", ", " and " and ", and " separate;
a relation form ("to the left of", "under", "next to", "on", ...) is matched longest first and
becomes its canonical relation; a posture verb right before a relation form ("sitting on",
"parked next to") is read as that relation (one that is also a state word, "parked", is the
noun phrase's state as well), and "and" between two colour words inside a noun
phrase is part of one colour ("a black and white cat"). The edge rules and the ambiguous shapes
that raise are those of the parser's docstring: a relation takes the list after it as objects;
"and" + relation keeps the subject; a phrase after the first object that is followed by a relation
starts a new clause; a list before the first relation gives each listed noun phrase the relation
("a cat and a dog on a sofa": both are on it); a chain ("A on B next to C") is read by
`cast_core.csg.chains`, places by `cast_core.csg.places`. "with" after a list ("a cat and a dog
with a collar": whose?), "between" followed by a list of more than two or by a relation after its
list ("a lamp between a bed and a desk on a rug"), a new clause after two or more objects, and the
chains the lists read both ways raise ValueError saying why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

from cast_core.csg.chains import chain_subjects
from cast_core.csg.places import read_places
from cast_core.csg.vocab import (
    ATTRIBUTE_KIND,
    POSTURE_VERBS,
    RELATION_FORMS,
    RELATION_PHRASES,
    STATES_BEFORE_NOUN_ONLY,
)

SEP = "sep"
# Relations that hold both ways, after which "and" may add a second object ("a pen beside a notebook
# and a pencil"): "X next to A and B rel C" may be a list after "next to" or a new clause.
PROXIMITY = frozenset({"next to", "close to"})
# Pronouns read as the object of a relation ("a table with a vase on it", "five students behind
# her"); the parser resolves them (`cast_core.csg.pronouns.object_pronoun`).
PRONOUNS = frozenset({"it", "them", "him", "her"})
STATEMENT_ENDS = (";", ".")
PREDICATE_VERBS = frozenset({"is", "are"})
# A pronoun and its verb (and a quantifier) opening a predication: "it is red", "they are both
# brown", "each of them empty"; the parser resolves the pronoun (`cast_core.csg.references`).
PRONOUN_SUBJECTS: dict[tuple[str, ...], tuple[str, str | None]] = {
    ("it", "is"): ("it", None), ("they", "are"): ("they", None),
    **{form: ("they", q) for q in ("both", "all")
       for form in (("they", "are", q), ("they", q, "are"), (q, "are"), (q, "of", "them"),
                    (q, "of", "them", "are"))},
    **{form: ("they", "each") for form in (("each", "of", "them"), ("each", "of", "them", "is"),
                                           ("each", "of", "them", "are"), ("each", "is"))},
}


@dataclass(frozen=True)
class Relation:
    """A relation between two spans: `form` as written, `canonical` as stored; `also` when it
    came right after "and" with no noun phrase between (it keeps the clause's subject)."""

    canonical: str
    form: str
    also: bool = False


class Separator(str):
    """A separator between two spans, equal to SEP; `comma` when it was written with a comma
    (", " or ", and"), which closes a list of two ("a cat next to a dog, and a bird on a branch")."""

    comma: bool

    def __new__(cls, comma: bool) -> Self:
        separator = super().__new__(cls, SEP)
        separator.comma = comma
        return separator


Statement = tuple[list[list[str]], list["str | Relation"]]


def split_statements(body: str) -> list[Statement]:
    """(spans, ops) of each statement, as `split_items` gives them; ValueError on an empty one."""
    tokens = _tokens(body)
    if tokens[-1:] == ["."]:
        tokens = tokens[:-1]
    pieces: list[list[str]] = [[]]
    for token in tokens:
        if token in STATEMENT_ENDS:
            pieces.append([])
        else:
            pieces[-1].append(token)
    statements: list[Statement] = []
    for piece in pieces:
        if not piece:
            raise ValueError("it has an empty statement (';' or '.' at the start or twice in a "
                             "row)")
        spans, ops = split_items(piece)
        statements += _cut_before_predications(spans, read_places(spans, ops))
    return statements


def is_predication(span: list[str]) -> bool:
    """Whether a span is "the ... is|are ...": a back-reference with something said about it."""
    return span[:1] == ["the"] and any(w in PREDICATE_VERBS for w in span)


_PRONOUN_FORMS = sorted(PRONOUN_SUBJECTS, key=len, reverse=True)


def pronoun_subject(span: list[str]) -> tuple[int, str, str | None] | None:
    """(words it takes, pronoun "it" or "they", quantifier "both", "all", "each" or None) of a span
    that opens with a pronoun predication ("they are both brown": 3, "they", "both"); None when
    it does not."""
    if span[:1] not in (["it"], ["they"], ["both"], ["all"], ["each"]):
        return None
    for form in _PRONOUN_FORMS:
        if tuple(span[:len(form)]) == form:
            return (len(form), *PRONOUN_SUBJECTS[form])
    return None


def _cut_before_predications(spans: list[list[str]],
                             ops: list[str | Relation]) -> list[Statement]:
    cuts = [k for k, op in enumerate(ops) if op == SEP and (is_predication(spans[k + 1])
                                                              or pronoun_subject(spans[k + 1])
                                                              or _said_with_is(spans, ops, k))]
    statements, start = [], 0
    for k in cuts:
        statements.append((spans[start:k + 1], ops[start:k]))
        start = k + 1
    return [*statements, (spans[start:], ops[start:])]


def _said_with_is(spans: list[list[str]], ops: list[str | Relation], k: int) -> bool:
    """Whether the span after separator k is a new statement "NP is REL ..." ("the sea is calm and
    a small boat is on the sea"): singular "is" after a predication or a relation before it in
    the statement, never after a bare list ("a cat and a dog are on a sofa": a list)."""
    said = spans[k + 1][-1:] == ["is"] and isinstance(ops[k + 1] if k + 1 < len(ops) else None,
                                                       Relation)
    before = [op for op in ops[:k] if op != SEP]
    return said and (is_predication(spans[0]) or bool(before))


# Adverbs of place that end a statement, read as their relation to "it" or to each other
# (thirteenth round): "a cake with a cherry on top" is "... on top of it", "a bottle with a ship
# inside" "... inside it", "a red car and a blue car side by side" "... next to each other". Before
# a comma ("a teapot with tea inside, next to two cups") they stay refused: the teapot's or the
# tea's next relation?
_ADVERBS: dict[tuple[str, ...], list[str]] = {
    ("inside",): ["inside", "it"], ("on", "top"): ["on", "top", "of", "it"],
    ("side", "by", "side"): ["next", "to", "each", "other"]}


def _read_adverbs(tokens: list[str]) -> list[str]:
    adverb = next((a for a in _ADVERBS if tuple(tokens[-len(a):]) == a), None)
    if adverb is None or len(tokens) == len(adverb):
        return tokens
    return [*tokens[:-len(adverb)], *_ADVERBS[adverb]]


def split_items(tokens: list[str]) -> tuple[list[list[str]], list[str | Relation]]:
    """(spans, ops) of one statement's tokens: len(spans) == len(ops) + 1 and ops[k] joins
    spans[k] and spans[k + 1]."""
    spans: list[list[str]] = [[]]
    ops: list[str | Relation] = []
    tokens = _read_adverbs(tokens)
    i = 0
    while i < len(tokens):
        form = _relation_at(tokens, i)
        posture = (tokens[i] in POSTURE_VERBS and spans[-1] and _relation_at(tokens, i + 1)
                   and _relation_at(tokens, i + 1) != ("with",)
                   and not (tokens[i] in ATTRIBUTE_KIND and spans[-1][0] == "the"))
        if posture:
            verb, form = tokens[i], _relation_at(tokens, i + 1)
            if verb in ATTRIBUTE_KIND and verb not in STATES_BEFORE_NOUN_ONLY:
                # a state word as well ("a red truck parked next to a house"): the truck's state;
                # before the first relation, of each listed noun phrase ("a red car and a blue car
                # parked next to a house": both are parked, both are next to it)
                first = not any(isinstance(op, Relation) for op in ops)
                for span in spans if first else spans[-1:]:
                    span.insert(1, verb)
            i += 1 + len(form)
            phrase = " ".join(form)
            ops.append(Relation(RELATION_PHRASES[phrase], f"{verb} {phrase}"))
            spans.append([])
        elif tokens[i] == "and" and _joins_colors(spans[-1], tokens[i + 1:i + 2]):
            spans[-1].append("and")
            i += 1
        elif tokens[i] in (",", "and"):
            ops.append(Separator(comma=tokens[i] == ","))
            i += 2 if tokens[i] == "," and tokens[i + 1:i + 2] == ["and"] else 1
            spans.append([])
        elif form:
            i += len(form)
            phrase = " ".join(form)
            if ops and ops[-1] == SEP and not spans[-1]:
                ops[-1] = Relation(RELATION_PHRASES[phrase], phrase, also=True)
            else:
                ops.append(Relation(RELATION_PHRASES[phrase], phrase))
                spans.append([])
        else:
            spans[-1].append(tokens[i])
            i += 1
    return spans, ops


def _joins_colors(span: list[str], after: list[str]) -> bool:
    """Whether "and" between colour words is one colour ("a black and white cat"): the span so
    far is a count, "the" or "the ... is|are" and words ending in a colour, and a colour word
    follows."""
    return (len(span) >= 2 and ATTRIBUTE_KIND.get(span[-1]) == "color"
            and bool(after) and ATTRIBUTE_KIND.get(after[0]) == "color")


def _tokens(body: str) -> list[str]:
    tokens = []
    for word in body.split(" "):
        if len(word) > 1 and word.endswith((",", *STATEMENT_ENDS)):
            tokens += [word[:-1], word[-1]]
        else:
            tokens.append(word)
    return tokens


# Relation forms by their first word, longest first.
_FORMS_BY_FIRST: dict[str, list[tuple[str, ...]]] = {}
for _form in RELATION_FORMS:
    _FORMS_BY_FIRST.setdefault(_form[0], []).append(_form)


def _relation_at(tokens: list[str], i: int) -> tuple[str, ...] | None:
    forms = _FORMS_BY_FIRST.get(tokens[i], ()) if i < len(tokens) else ()
    return next((f for f in forms if tuple(tokens[i:i + len(f)]) == f), None)


def clause_edges(spans: list[list[str]], ops: list[str | Relation],
                 setting: Callable[[list[str]], bool] = lambda span: False,
                 ) -> list[tuple[int, str, int]]:
    """Edges (subject span, canonical relation, object span) in order of appearance. `setting`
    says whether a span names a ground or scene ("a beach", "the water"): a chain through one ("a
    boat on the water next to a pier": the water's place, or the boat's?) and "on"/"in" one
    written with a/an or a count after a new clause's noun phrase ("a sandcastle next to a bucket and a shovel on a beach": a
    new clause, or a second object of "next to", and on the beach only the shovel or all?) raise
    ValueError, as ambiguous."""
    for k, op in enumerate(ops):
        if isinstance(op, Relation) and not spans[k + 1]:
            raise ValueError(f"relation {op.form!r} must be followed by a noun phrase")
        if isinstance(op, Relation) and not spans[k]:
            raise ValueError(f"relation {op.form!r} needs a noun phrase before it")
    edges: list[tuple[int, str, int]] = []
    subjects, relation, run = [0], None, [0]
    for k, op in enumerate(ops):
        if op == SEP:
            if relation is not None and relation.canonical == "between" and len(run) > 1:
                raise ValueError(f"{relation.form!r} is followed by a list of more than two noun "
                                 "phrases: 'between' takes one noun phrase of two or more ('a "
                                 "lamp between two chairs') or two ('a lamp between a bed and a "
                                 "desk')")
            run.append(k + 1)
            if relation is not None:
                edges += [(s, relation.canonical, k + 1) for s in subjects]
            continue
        if not op.also and relation is not None and relation.canonical == "between" \
                and len(run) > 1:
            raise ValueError(f"{op.form!r} follows 'between A and B': it may place the last noun "
                             "phrase or start a new clause; write it as its own statement ('...; "
                             f"the lamp is {op.form} ...')")
        if op.also and relation is None:
            raise ValueError(f"'and {op.form}' needs a relation before it to share its subject")
        if not op.also and relation is not None and k == run[0]:
            subjects = chain_subjects(spans, k, op, relation, subjects, edges, setting)
        elif not op.also:
            before = subjects
            subjects = _next_subjects(k, op, relation, run, ops)
            if relation is not None:
                if (op.canonical in ("on", "in") and spans[k + 1][:1] != ["the"]
                        and setting(spans[k + 1])):
                    raise ValueError(
                        f"{' '.join(spans[k])!r} after {relation.form!r} and 'and' is followed "
                        f"by {op.form + ' ' + ' '.join(spans[k + 1])!r}, a ground or scene: it "
                        f"may be a new clause or a second object of {relation.form!r}, and "
                        f"{op.form!r} may place it alone or every noun phrase before it; write "
                        "the place as its own statement ('...; the shovel is on the beach')")
                for s in before:
                    edges.remove((s, relation.canonical, k))
        relation, run = op, [k + 1]
        edges += [(s, op.canonical, k + 1) for s in subjects]
    return edges


def open_joins(spans: list[list[str]], ops: list[str | Relation]) -> list[int]:
    """Indices k of the relations in "X next to A and B rel C" (a relation that holds both ways,
    one object, a bare "and", a noun phrase B, then relation k with another relation than the
    first): B may be a second object of "next to" ("a pen beside a notebook and a pencil") or the
    subject of a new clause, and "rel C" may place B alone or all of them. The parser refuses
    those whose C is a noun phrase not written before ("a pen beside a notebook and a pencil on a
    desk"); a comma before "and", the same relation twice ("a man near a horse and a dog near a
    cow"), or a C written before ("a glass beside a plate and a cookie on the plate") reads as a
    new clause."""
    joins = []
    for k in range(2, len(ops)):
        first, separator, second = ops[k - 2], ops[k - 1], ops[k]
        if not (isinstance(first, Relation) and isinstance(second, Relation)):
            continue
        bare = isinstance(separator, Separator) and not separator.comma
        if (bare and first.canonical in PROXIMITY and not second.also
                and second.canonical != first.canonical):
            joins.append(k)
    return joins


def _next_subjects(k: int, op: Relation, previous: Relation | None, run: list[int],
                   ops: list[str | Relation]) -> list[int]:
    """The subjects of relation `op` written right after span k (see the module docstring): every
    noun phrase of a list before the first relation ("a cat and a dog on a sofa": both are on
    it), else the noun phrase before it, which starts a new clause; after a list of objects only
    where a comma follows the list's "and" ("a lamp next to a bed and a desk, a chair in front of
    the desk")."""
    if previous is None and len(run) > 1 and op.canonical == "with":
        raise ValueError("'with' follows a list of noun phrases ('a cat and a dog with a red "
                         "collar'): does each have it, or only the last? write one clause per "
                         "noun phrase")
    if previous is None:
        return list(run)
    closed = (isinstance(ops[k - 1], Separator) and ops[k - 1].comma
              and isinstance(ops[k - 2], Separator) and not ops[k - 2].comma)
    if len(run) > 2 and not closed:
        raise ValueError(f"the relation {op.form!r} follows a list of objects of "
                         f"{previous.form!r}, which is ambiguous (does it place only the last?)")
    return [k]
