"""Reading the words after a noun phrase's count: its attribute words, one value per kind, in
`ATTRIBUTE_KINDS` order ("light blue", "black and white" and "red-and-white" are one colour), and
its noun (one plain word, a listed compound, "HEAD of NOUN" after a container or quantity, "pair
of", or one of a given noun list); "made of MATERIAL". Pure functions of the words: each returns
None where the words do not read, and `cast_core.csg.refusals` says why.
"""

from __future__ import annotations

import re

from cast_core.csg.questions import NUMBER_NAMES
from cast_core.csg.vocab import (
    ALSO_NOUNS,
    AMBIGUOUS_KIND_WORDS,
    ATTRIBUTE_KIND,
    ATTRIBUTE_KINDS,
    CLAUSE_WORDS,
    COLOR_MODIFIERS,
    COMPOUND_NOUNS,
    MATERIAL_SUBSTANCE,
    OF_HEADS,
    VERBS,
    singularize,
)

# What a noun phrase may start with, and the count each gives.
COUNT_WORDS: dict[str, int] = {"a": 1, "an": 1, **{w: n for n, w in enumerate(NUMBER_NAMES)
                                                  if n > 0}, **{str(n): n for n in range(1, 11)}}
# Words never part of a noun: counts, articles, conjunctions, prepositions, relation words.
NOT_NOUN_WORDS = frozenset(COUNT_WORDS) | frozenset(NUMBER_NAMES) | frozenset({
    "the", "and", "or", "of", "on", "in", "at", "with", "to", "by", "for", "from", "near", "next",
    "behind", "under", "over", "beside", "front", "left", "right", "above", "below"})
# What a word of a noun may look like.
WORD = re.compile(r"[a-z][a-z'-]*")
# What may follow "made of": a material word or the substance it names ("made of wood", "made of
# gold"); the value is kept as written.
_MATERIAL_WORDS = (frozenset(MATERIAL_SUBSTANCE) | frozenset(MATERIAL_SUBSTANCE.values())
                   | {w for w, kinds in AMBIGUOUS_KIND_WORDS.items() if "material" in kinds})


def split_noun(rest: list[str], count: int,
               nouns: frozenset[str] | None) -> tuple[str, tuple[tuple[str, str], ...]] | None:
    """(noun, attributes) of the words after the count: the longest noun whose words before are
    all attributes, one per kind; None when there is none."""
    at = of_at(rest)
    if at is not None:
        return _split_of(rest, at, count, nouns)
    for j in range(len(rest)):
        noun = singularize(" ".join(rest[j:])) if count > 1 else " ".join(rest[j:])
        attributes = read_attributes(rest[:j])
        if attributes is not None and _is_noun(rest[j:], noun, nouns):
            return noun, attributes
    return None


def of_at(rest: list[str]) -> int | None:
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
    attributes = read_attributes(rest[:at - 1])
    if head not in OF_HEADS | {"pair"} or attributes is None:
        return None
    return _split_inner(head, rest[at + 1:], attributes, nouns)


def _split_inner(head: str, inner: list[str], before: tuple[tuple[str, str], ...],
                 nouns: frozenset[str] | None) -> tuple[str, tuple[tuple[str, str], ...]] | None:
    """(noun, attributes) of "HEAD of [attributes] NOUN" given the attributes `before` the head:
    the longest noun after "of" whose words before are attributes ("a pair of red boots": pair of
    boots, colour red; "a cup of hot chocolate": cup of hot chocolate)."""
    for j in range(len(inner)):
        attributes = read_attributes(inner[:j])
        if attributes is not None and inner_noun(inner[j:]):
            merged = merge_attributes(before, attributes)
            noun = f"{head} of {' '.join(inner[j:])}"
            ok = merged is not None and (nouns is None or noun in nouns)
            return (noun, merged) if ok else None
    return None


def inner_noun(words: list[str]) -> bool:
    """Whether the words after "of" are one noun, as written ("tea", "cookies", "orange juice")."""
    if not words or any(not WORD.fullmatch(w) or w in NOT_NOUN_WORDS for w in words):
        return False
    return _is_noun(words, singularize(" ".join(words)), None) or " ".join(words) in COMPOUND_NOUNS


def joins_colors(words: list[str], i: int) -> bool:
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


def read_attributes(words: list[str]) -> tuple[tuple[str, str], ...] | None:
    """(kind, value) pairs of attribute words in kind order; None when a word is not one or a
    kind repeats. A colour modifier joins the colour after it ("light blue"), "and" joins two
    colours into one ("black and white"), "colored" after a colour is part of it ("a cream colored
    sofa"), and a listed two-word value is one ("cast iron", "polka dot")."""
    found: dict[str, str] = {}
    i = 0
    while i < len(words):
        word, after = words[i], words[i + 1] if i + 1 < len(words) else None
        if after is not None and f"{word} {after}" in ATTRIBUTE_KIND:
            kind, value, i = ATTRIBUTE_KIND[f"{word} {after}"], f"{word} {after}", i + 2
        elif word in COLOR_MODIFIERS and after is not None and ATTRIBUTE_KIND.get(after) == "color":
            kind, value, i = "color", f"{word} {after}", i + 2
        elif hyphenated_colors(word):
            kind, value, i = "color", word.replace("-", " "), i + 1
        elif word in ATTRIBUTE_KIND:
            kind, value, i = ATTRIBUTE_KIND[word], word, i + 1
        else:
            return None
        while kind == "color" and words[i:i + 1] == ["and"] and joins_colors(words, i):
            value, i = f"{value} and {words[i + 1]}", i + 2
        if kind == "color" and words[i:i + 1] in (["colored"], ["coloured"]):
            i += 1  # "a cream colored sofa": the colour cream
        if kind in found:
            return None
        found[kind] = value
    return tuple((k, found[k]) for k in ATTRIBUTE_KINDS if k in found)


def hyphenated_colors(word: str) -> bool:
    """Whether a word is two colours joined by "-and-" ("red-and-white"): one colour, as "red and
    white"."""
    parts = word.split("-and-")
    return len(parts) == 2 and all(ATTRIBUTE_KIND.get(p) == "color" for p in parts)


def merge_attributes(first: tuple[tuple[str, str], ...],
                     second: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...] | None:
    """Both attribute tuples in kind order; None when they share a kind."""
    found = dict(first)
    if any(kind in found for kind, _ in second):
        return None
    found.update(second)
    return tuple((k, found[k]) for k in ATTRIBUTE_KINDS if k in found)


def made_of(words: list[str]) -> tuple[list[str], tuple[tuple[str, str], ...]] | None:
    """The words without the "made of MATERIAL" among them, and that material attribute ("a vase
    made of glass", "the gate is made of iron"); None when there is none."""
    for i in range(len(words) - 2):
        if words[i:i + 2] == ["made", "of"] and words[i + 2] in _MATERIAL_WORDS:
            return words[:i] + words[i + 3:], (("material", words[i + 2]),)
    return None
