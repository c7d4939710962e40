"""Back-references in a prompt: "the cup" names a noun phrase written before it ("a plate and a
cup; the cup is red", "a cat next to a dog and a bird above the dog").

A reference "the [attributes] noun" matches an earlier noun phrase with that noun (or whose
noun it is the head of: "the board" for "a cutting board", "the cup" for "a cup of tea"), every
attribute it names, and the same number: "the dog" one dog, "the dogs" two or more ("the sheep", an invariant
plural, either). It must match exactly one: none ("the water", with no water before it) and two
("the book" after a red and a blue book) are errors that say so, never a guess. A predication "the
cup is red [and shiny]" adds attributes to the one it names; one that contradicts an attribute
already written ("a blue cup; the cup is red") is an error.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from cast_core.csg.vocab import pluralize

if TYPE_CHECKING:
    from cast_core.csg.build import NounPhrase

Reading = tuple[str, tuple[tuple[str, str], ...], bool]


def antecedent(text: str, readings: list[Reading], phrases: list[NounPhrase]) -> int:
    """Index in `phrases` of the one phrase that reference `text` names; `readings` are its
    (noun, attributes, plural) readings. ValueError when none or several match."""
    found = sorted({i for i, p in enumerate(phrases) for r in readings if _names(r, p)})
    if len(found) == 1:
        return found[0]
    if not found:
        same = [shown_phrase(p) for p in phrases if any(_same_noun(r[0], p.noun) for r in readings)]
        hint = f" (before it: {same})" if same else ""
        raise ValueError(f"{text!r} names no noun phrase written before it{hint}; introduce each "
                         f"object with a/an or a count, then refer to it as 'the ...'")
    raise ValueError(f"{text!r} could name any of {[shown_phrase(phrases[i]) for i in found]}; name it "
                     f"by an attribute that tells them apart")


def unnamed(readings: list[Reading], phrases: list[NounPhrase]) -> bool:
    """Whether no noun phrase in `phrases` has the noun (or head word) of any reading: a "the
    ..." that cannot be meant as a reference to one of them."""
    return not any(_same_noun(r[0], p.noun) for p in phrases for r in readings)


def _names(reading: Reading, phrase: NounPhrase) -> bool:
    noun, attributes, plural = reading
    number_agrees = plural == (phrase.count > 1) or pluralize(noun) == noun
    return (_same_noun(noun, phrase.noun) and set(attributes) <= set(phrase.attributes)
            and number_agrees)


def _same_noun(said: str, written: str) -> bool:
    """Whether "the <said>" can name a noun phrase of noun `written`: the same noun, or its head
    word ("the board" for "a cutting board", "the glass" for "a glass of water")."""
    return (said == written or written.endswith(" " + said) and " of " not in written
            or written.startswith(said + " of "))


def shown_phrase(phrase: NounPhrase) -> str:
    """A noun phrase as error messages show it: "1 red cup"."""
    words = [v for _, v in phrase.attributes] + [phrase.noun]
    return " ".join([str(phrase.count), *words])


def with_attributes(phrase: NounPhrase, attributes: tuple[tuple[str, str], ...], text: str,
                    kinds: tuple[str, ...]) -> NounPhrase:
    """`phrase` with the attributes a predication on `text` gives it (kept in `kinds` order);
    ValueError when one contradicts an attribute the phrase already has."""
    found = dict(phrase.attributes)
    clashes = [(k, found[k], v) for k, v in attributes if k in found and found[k] != v]
    if clashes:
        kind, was, now = clashes[0]
        raise ValueError(f"{text!r} is said to be {now!r}, but its {kind} was written as {was!r}")
    found.update(attributes)
    return replace(phrase, attributes=tuple((k, found[k]) for k in kinds if k in found))
