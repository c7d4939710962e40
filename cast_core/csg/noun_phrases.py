"""Reading one noun phrase of a statement: "(a|an|count) [attributes] noun [made of MATERIAL]", a
mass noun after a relation ("in tall grass"), a possessive determiner ("a dog with its red ball"),
an owner's part ("on a horse's back": on the horse), and "the [attributes] noun", which names one
noun phrase written before or, where `cast_core.csg.parser` places it, is a new one. Anything else
is a `PromptParseError` that says why: an attribute word the lists file under two kinds ("a bronze
statue"), an attribute + noun that is also a compound ("a blue whale"), a possessive whose owner
is unclear, words that are no part of a noun (`cast_core.csg.refusals`).
"""

from __future__ import annotations

from itertools import pairwise

from cast_core.csg.build import LLM_HINT, NounPhrase, fail
from cast_core.csg.clauses import Relation
from cast_core.csg.references import Reading, antecedent, unnamed
from cast_core.csg.refusals import (
    PICTURE_PLACES,
    count_reason,
    no_split_reason,
    unsupported_construct,
)
from cast_core.csg.vocab import (
    AMBIGUOUS_COMPOUND_NOUNS,
    AMBIGUOUS_KIND_WORDS,
    ATTRIBUTE_KIND,
    COMPOUND_NOUNS,
    MASS_NOUNS,
    PARTS,
    pluralize,
    singularize,
)
from cast_core.csg.words import (
    COUNT_WORDS,
    NOT_NOUN_WORDS,
    WORD,
    joins_colors,
    made_of,
    merge_attributes,
    of_at,
    split_noun,
)

_AMBIGUOUS_FIRST = frozenset(c.split(" ")[0] for c in AMBIGUOUS_COMPOUND_NOUNS)
# Possessive determiners, read as a/an (or before a count) as the lists write them: "a dog with its
# red ball" is a dog with a ball, "a girl and her dog" a girl and a dog.
POSSESSIVES = frozenset({"its", "his", "her", "their"})


def read_phrase(words: list[str], prompt: str, nouns: frozenset[str] | None, role: str,
                first: bool, placed: bool = False) -> NounPhrase:
    """The noun phrase of "(a|an|count|its|...) [attributes] noun", or, when `placed` (the object
    of a relation), of "[attributes] MASS-NOUN" ("in tall grass", "in shallow water": one)."""
    text = " ".join(words)
    counted = count_reason(words) if words else None
    if counted:
        raise fail(prompt, f"{counted} (in noun phrase {text!r}); {LLM_HINT}")
    if placed and "" not in words and words[-1] in MASS_NOUNS and words[0] not in COUNT_WORDS:
        words = ["a", *words]
    if len(words) < 2 or "" in words:
        raise fail(prompt, f"noun phrase {text!r}{role} must be '(a|an|number) [attributes] "
                           "noun'")
    if words[0] in POSSESSIVES:
        count, rest = _possessed(words, text, prompt)
    elif words[0] not in COUNT_WORDS:
        start = ("it must start with 'a photo of ' or with a noun phrase: a/an or a count "
                 "one..ten (or 1..10)" if first else
                 f"noun phrase {text!r}{role} must start with a/an or a count one..ten "
                 "(or 1..10)")
        raise fail(prompt, f"{start}, not {words[0]!r}")
    else:
        count, rest = COUNT_WORDS[words[0]], words[1:]
        # "a single red rose" is one red rose
        rest = rest[1:] if count == 1 and rest[:1] == ["single"] and len(rest) > 1 else rest
    made = made_of(rest) if rest[-3:-1] == ["made", "of"] else None
    rest = made[0] if made else rest
    _check_noun_words(rest, text, prompt, role)
    _check_ambiguous(rest, text, prompt, nouns)
    split = split_noun(rest, count, nouns)
    if split is None:
        raise fail(prompt, no_split_reason(rest, text, nouns, count))
    check_kind_words(split[1], text, prompt)
    attributes = merge_attributes(split[1], made[1]) if made else split[1]
    if attributes is None:
        raise fail(prompt, f"noun phrase {text!r} gives its material twice (before the noun and "
                           f"after 'made of'); one value per kind ({LLM_HINT})")
    return NounPhrase(split[0], count, attributes)


def read_reference(words: list[str], phrases: list[NounPhrase], prompt: str,
                   nouns: frozenset[str] | None, role: str, placed: bool = False) -> int:
    """Index in `phrases` of the one that "the [attributes] noun" names. When `placed` (the
    object of a relation: "a cat under the bed", or the subject of an opening predication: "the
    cat is black") and no earlier noun phrase has its noun, it is a new noun phrase of one,
    appended: "the bed" is one bed. A plural or invariant noun ("the
    dogs", "the sheep") says no count and stays an error."""
    text, rest = " ".join(words), words[1:]
    if len(rest) == 1 and rest[0] in PICTURE_PLACES:
        raise fail(prompt, f"{unsupported_construct(rest)}; {LLM_HINT}")
    _check_noun_words(rest, text, prompt, role)
    _check_ambiguous(rest, text, prompt, nouns)
    plural = singularize(" ".join(rest)) != " ".join(rest)
    readings: list[Reading] = []
    for count in (1, 2) if plural else (1,):
        split = split_noun(rest, count, nouns)
        if split is not None:
            readings.append((split[0], split[1], count > 1))
    if not readings:
        raise fail(prompt, no_split_reason(rest, text, nouns, 2 if plural else 1))
    check_kind_words(readings[0][1], text, prompt)
    if placed and not plural and pluralize(readings[0][0]) != readings[0][0] \
            and unnamed(readings, phrases):
        phrases.append(NounPhrase(readings[0][0], 1, readings[0][1]))
        return len(phrases) - 1
    try:
        return antecedent(text, readings, phrases)
    except ValueError as err:
        raise fail(prompt, f"{err}{role}") from err


def check_possessives(spans: list[list[str]], ops: list[str | Relation], prompt: str) -> None:
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
        if len(span) > 1 and span[0] in POSSESSIVES and i not in objects:
            raise fail(prompt, f"{' '.join(span)!r}: the offline parser reads 'its', 'his', "
                               f"'her', 'their' only after the first relation of a noun phrase "
                               f"that owns it ('a dog with its ball'); here whose it is, or "
                               f"whether the owner has it ('with'), is ambiguous; {LLM_HINT}")


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
        raise fail(prompt, f"{text!r} names a part ({last!r}) of a noun phrase written before, "
                           f"which the offline parser does not place; {LLM_HINT}")
    if count == 1 and singularize(last) != last:
        raise fail(prompt, f"{text!r} says no count for a plural noun; write one ('her two "
                           f"dogs') or {LLM_HINT}")
    return count, rest


def owner_span(span: list[str], prompt: str) -> list[str]:
    """A noun phrase "a horse's back" names its owner, "a horse" ("a bird on a horse's back" is
    on the horse, as the lists write it); any other "X's Y" ("a horse's saddle": is the horse in
    the picture?) is refused."""
    at = next((i for i, w in enumerate(span) if w.endswith("'s")), None)
    if at is None:
        return span
    after = span[at + 1:]
    if len(after) == 1 and singularize(after[0]) in PARTS:
        return [*span[:at], span[at][:-2]]
    raise fail(prompt, f"possessive {' '.join(span[at:])!r} in {' '.join(span)!r}: the offline "
                       f"parser reads 'X's' only before a part ('on a horse's back': on the "
                       f"horse), not whether the owner is in the picture; {LLM_HINT}")


def check_kind_words(attributes: tuple[tuple[str, str], ...], text: str, prompt: str) -> None:
    """Refuse an attribute word the lists file under two kinds ("a bronze statue": its colour or
    its material?), naming it."""
    for kind, value in attributes:
        if value in AMBIGUOUS_KIND_WORDS:
            kinds = " or its ".join(AMBIGUOUS_KIND_WORDS[value])
            hint = ("name the colour with another colour word ('brown', 'gold')"
                    if "color" in AMBIGUOUS_KIND_WORDS[value] else "use another word")
            raise fail(prompt, f"{value!r} in {text!r} may be its {kinds} (the held-out lists "
                               f"write it both ways); {hint} or {LLM_HINT}")


def _check_noun_words(rest: list[str], text: str, prompt: str, role: str) -> None:
    allowed = {i for i, w in enumerate(rest) if w == "and" and joins_colors(rest, i)}
    allowed |= {of_at(rest)}
    if any(w in NOT_NOUN_WORDS for w in rest):
        allowed |= _compound_ending(rest)
    bad = [w for i, w in enumerate(rest)
           if i not in allowed and (not WORD.fullmatch(w) or w in NOT_NOUN_WORDS)]
    if not rest:
        raise fail(prompt, f"noun phrase {text!r}{role} must be '(a|an|number|the) "
                           "[attributes] noun'")
    if bad:
        construct = unsupported_construct(rest)
        raise fail(prompt, (f"{construct}; " if construct else "")
                   + f"noun {' '.join(rest)!r} in {text!r} has words that are not part of a "
                     f"noun: {bad}; {LLM_HINT}")


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
            raise fail(prompt, f"{pair!r} in {text!r} may be one noun (a kind of "
                               f"{singularize(second)}) or a {singularize(second)} whose {kind} "
                               f"is {first}; give the parser a noun list or {LLM_HINT}")
