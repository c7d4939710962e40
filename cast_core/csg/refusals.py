"""Why a noun phrase does not read, for the error that refuses it: the construct its words show that
the offline parser does not read (a verb, a nested clause, an "of" phrase after anything but a
container or quantity, a relation form it does not know), or what is wrong with its attributes
and noun. Messages only; the reading itself is `cast_core.csg.words`.
"""

from __future__ import annotations

from cast_core.csg.build import LLM_HINT
from cast_core.csg.vocab import (
    ATTRIBUTE_KIND,
    ATTRIBUTE_KINDS,
    CLAUSE_WORDS,
    COLOR_MODIFIERS,
    COMPOUND_NOUNS,
    OF_HEADS,
    RELATION_PHRASES,
    UNSUPPORTED_RELATIONS,
    VERBS,
    singularize,
)
from cast_core.csg.words import (
    NOT_NOUN_WORDS,
    hyphenated_colors,
    inner_noun,
    joins_colors,
    of_at,
    read_attributes,
)

_RELATION_PARTS = frozenset({"left", "right", "front", "top", "next", "close", "side"})
# "the edge of a lake", "the bottom of a hill": a place inside another noun phrase. Read only as
# "on the edge of", "at the top of" (on) and "in the middle/center/corner of" (on a surface, in an
# area: `cast_core.csg.places`); after any other relation ("near the corner of a room") refused.
_PLACES_IN = frozenset({"middle", "center", "centre", "corner", "edge", "end", "bottom", "back",
                        "foot", "side", "rim", "surface"})
# "on the left", "in the background": a place in the picture, not relative to a noun phrase.
PICTURE_PLACES = frozenset({"left", "right", "middle", "center", "centre", "foreground",
                             "background", "distance"})
_BIG_COUNTS = frozenset({"eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
                         "seventeen", "eighteen", "nineteen", "twenty", "thirty", "forty", "fifty",
                         "hundred", "hundreds", "thousand", "dozen", "dozens"})
_VAGUE_COUNTS = frozenset({"some", "several", "many", "few", "numerous", "multiple", "lots",
                           "countless", "various", "couple"})


def count_reason(words: list[str]) -> str | None:
    """Why a noun phrase's count does not read, when it is one the offline parser refuses by
    name: above ten ("twelve eggs", "a dozen eggs", "11 players") or no number ("several cats",
    "a few birds")."""
    first, second = words[0], words[1] if len(words) > 1 else ""
    if first in _BIG_COUNTS or second in _BIG_COUNTS and first in ("a", "an", "two", "three") \
            or first.isdigit() and int(first) > 10:
        said = " ".join(words[:2]) if second in _BIG_COUNTS else first
        return (f"it has a count above ten ({' '.join(words[:2])!r}); the offline parser reads "
                f"counts one..ten (or 1..10), as GenEval's counting template writes them, not "
                f"{said!r}")
    if first in _VAGUE_COUNTS or first == "a" and second in _VAGUE_COUNTS:
        said = " ".join(words[:2]) if first == "a" else first
        return (f"it has a count that names no number ({' '.join(words[:2])!r}); a noun phrase "
                f"starts with a/an or a count one..ten (or 1..10), not {said!r}")
    return None


def unsupported_construct(words: list[str]) -> str | None:
    """The unsupported construct the words after a count show, if one can be named."""
    if len(words) == 1 and words[0] in PICTURE_PLACES:
        return (f"'the {words[0]}' names a place in the picture ('a cat on the left'), not a "
                f"noun phrase; the offline parser reads a place only relative to another noun "
                f"phrase ('to the left of a dog')")
    for i, word in enumerate(words):
        later = i > 0
        if word == "of" and of_at(words) == i:
            continue
        if word in CLAUSE_WORDS:
            return f"it has a nested clause ({' '.join(words[i:])!r}), which the offline parser " \
                   f"does not read"
        if later and word in VERBS:
            return f"it has a verb ({word!r}), which the offline parser does not read"
        if later and word == "than":
            return (f"it has a comparison ({' '.join(words[i - 1:i + 1])!r}), which the offline "
                    "parser does not read")
        if later and word == "of" and words.count("of") > 1:
            return f"it has 'of' {words.count('of')} times ({' '.join(words)!r}), which the " \
                   f"offline parser does not read"
        if later and word == "of" and words[i - 1] == "full":
            return (f"it has 'full of' ({' '.join(words[max(0, i - 2):i + 2])!r}), which the held-out "
                    "lists write two ways (the container full, with what fills it in it; or one "
                    "noun, 'a basket of apples'); write 'a basket of apples'")
        if later and word == "of" and words[i - 1] in _PLACES_IN:
            said = " ".join(["the", *words[i - 1:i + 2]])
            return (f"it has 'the {words[i - 1]} of' ({said!r}), a place inside another noun "
                    "phrase, which the offline parser reads only as 'on the edge of', 'at the top "
                    "of' and 'in the middle/center/corner of' ('in the middle of a table': on it); "
                    "write the relation itself ('in a field', 'on a table')")
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
        joins = i + 1 < len(words) and (words[i + 1] in NOT_NOUN_WORDS
                                        or words[i + 1] in UNSUPPORTED_RELATIONS)
        if later and joins and word.endswith(("ing", "ed")) and word not in ATTRIBUTE_KIND:
            return f"it has a verb ({word!r}), which the offline parser does not read"
    return None


def no_split_reason(rest: list[str], text: str, nouns: frozenset[str] | None,
                    count: int = 1) -> str:
    construct = unsupported_construct(rest)
    if construct:
        return f"{construct} (in noun phrase {text!r}); {LLM_HINT}"
    at = of_at(rest)
    if at is not None:
        return _of_reason(rest, at, text, nouns, count)
    head_at = _head_start(rest, nouns)
    if head_at is None:
        return (f"noun phrase {text!r} names none of the listed nouns {sorted(nouns or ())}; "
                "check the prompt against its metadata")
    before, head = rest[:head_at], " ".join(rest[head_at:])
    if head in ATTRIBUTE_KIND and (not before or read_attributes(rest) is not None):
        return (f"{head!r} in {text!r} is an attribute ({ATTRIBUTE_KIND[head]}), not a noun; "
                f"name the object after it")
    kinds, unknown, extra = {}, [], []
    afters = [*before[1:], head]
    pairs = [i for i in range(len(before) - 1) if f"{before[i]} {before[i + 1]}" in ATTRIBUTE_KIND]
    for i, (word, after) in enumerate(zip(before, afters)):
        if word == "and" and joins_colors(rest, i) or i - 1 in pairs:
            continue  # "black and white"; the second word of a two-word value ("curly haired")
        colored = (word in COLOR_MODIFIERS and ATTRIBUTE_KIND.get(after) == "color"
                   or hyphenated_colors(word))
        word = f"{word} {after}" if i in pairs else word
        kind = ATTRIBUTE_KIND.get(word, "color" if colored else None)
        if kind is None:
            unknown.append(word)
        elif kind in kinds and word not in COLOR_MODIFIERS:
            extra.append(word)
        kinds.setdefault(kind, word)
    if unknown:
        return (f"{unknown} before the noun {head!r} in {text!r} is not an attribute word the "
                f"offline parser knows ({', '.join(ATTRIBUTE_KINDS)}) nor part of a known noun; "
                f"add it to cast_core/csg/vocabulary.json, give the parser a noun list, or "
                f"{LLM_HINT}")
    if extra:
        return (f"noun phrase {text!r} gives an attribute kind twice: {extra} repeats a kind "
                f"already given; one value per kind ({LLM_HINT})")
    return f"noun phrase {text!r} does not read as attributes and a noun; {LLM_HINT}"


def _of_reason(rest: list[str], at: int, text: str, nouns: frozenset[str] | None,
               count: int) -> str:
    head, inner = rest[at - 1], rest[at + 1:]
    single = singularize(head) if count > 1 else head
    if single == "pair" or head == "pair":
        return (f"{text!r} has 'pair of', which the offline parser reads only as '[attributes] "
                f"pair of [attributes] NOUNS' with one noun after the attributes ('a pair of red "
                f"boots'), each attribute kind once; {LLM_HINT}")
    if single not in OF_HEADS:
        return (f"{head!r} in {text!r} does not agree with its count {count} before 'of'; "
                f"{LLM_HINT}")
    if read_attributes(rest[:at - 1]) is None:
        return no_split_reason(rest[:at], text, None, count)
    split = next((j for j in range(len(inner)) if read_attributes(inner[:j]) is not None
                  and inner_noun(inner[j:])), None)
    if split is None:
        return (f"{' '.join(inner)!r} after {head + ' of'!r} in {text!r} is not attribute words "
                f"and one noun the offline parser reads; {LLM_HINT}")
    if split > 0 and nouns is None:
        return (f"noun phrase {text!r} gives an attribute kind twice, before and after 'of'; "
                f"one value per kind ({LLM_HINT})")
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
