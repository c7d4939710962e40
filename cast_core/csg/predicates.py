"""Predications, which add attributes to noun phrases written before, in place: "the cup is red [and
shiny]", "the gate is made of iron", a possessive subject ("a black cat; the cat's collar is red":
the cat with a collar, which is red), and a pronoun subject ("it is red", "they are both brown",
"each of them empty": `cast_core.csg.pronouns.pronoun_targets`). A relation after the verb ("the
cup is next to a plate") is a clause, read by `cast_core.csg.parser`.
"""

from __future__ import annotations

from cast_core.csg.build import LLM_HINT, NounPhrase, fail
from cast_core.csg.clauses import PREDICATE_VERBS, Relation, pronoun_subject
from cast_core.csg.noun_phrases import check_kind_words, read_phrase, read_reference
from cast_core.csg.pronouns import pronoun_targets
from cast_core.csg.references import with_attributes
from cast_core.csg.refusals import unsupported_construct
from cast_core.csg.vocab import (
    ATTRIBUTE_KIND,
    ATTRIBUTE_KINDS,
    COLOR_MODIFIERS,
    singularize,
)
from cast_core.csg.words import made_of, merge_attributes, read_attributes


def apply_predicate(spans: list[list[str]], ops: list[str | Relation], phrases: list[NounPhrase],
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
        i = read_reference(subject, phrases, prompt, nouns, "", opening)
    said = f"{' '.join(subject)} {verb}"
    if any(isinstance(op, Relation) for op in ops) or not all(spans[1:]):
        raise fail(prompt, f"after {said!r} comes either attribute words ('the cup is red and "
                           f"shiny') or one relation ('the cup is next to a plate'); {LLM_HINT}")
    words = spans[0][at + 1:] + [w for span in spans[1:] for w in span]
    attributes = _predicate_attributes(words, verb, said, prompt)
    try:
        phrases[i] = with_attributes(phrases[i], attributes, " ".join(subject), ATTRIBUTE_KINDS)
    except ValueError as err:
        raise fail(prompt, str(err)) from err
    return added


def _possessed_subject(subject: list[str], phrases: list[NounPhrase],
                       edges: list[tuple[int, str, int]], prompt: str,
                       nouns: frozenset[str] | None,
                       opening: bool) -> tuple[int, list[tuple[int, str, int]]]:
    """(index, new edges) of "the X's Y" opening a predication ("a black cat; the cat's collar is
    red"): X names a noun phrase as "the X" does, and Y is the one Y that X is "with" already, or
    a new noun phrase of one with a "with" edge from X, as the lists write it; since the eleventh
    round a part too ("a black piano; the piano's lid is open", "the cat's tail is striped": the
    cat with a tail, striped, as every list writes it). A plural ("the cat's kittens": how many?)
    and a Y written before that is no one's ("a cat and a collar; the cat's collar is red": that
    collar or another?) are refused."""
    at = next(k for k, w in enumerate(subject) if w.endswith("'s"))
    said, owned = " ".join(subject), subject[at + 1:]
    if subject[0] != "the" or not owned or any(w.endswith("'s") for w in owned):
        raise fail(prompt, f"possessive {said!r}: the offline parser reads a possessive subject "
                           f"only as 'the X's Y is ...' ('the cat's collar is red'); {LLM_HINT}")
    owner = read_reference([*subject[:at], subject[at][:-2]], phrases, prompt, nouns, "", opening)
    phrase = read_phrase(["a", *owned], prompt, nouns, "", False)
    if singularize(owned[-1]) != owned[-1]:
        raise fail(prompt, f"{said!r} names a plural, with no count ({owned[-1]!r}), which the "
                           f"offline parser does not place; {LLM_HINT}")
    held = [j for a, r, j in edges if (a, r) == (owner, "with") and phrases[j].noun == phrase.noun]
    if held:
        return held[0], []
    owned_by_others = {j for _, r, j in edges if r == "with"}
    if any(p.noun == phrase.noun and j not in owned_by_others for j, p in enumerate(phrases)):
        raise fail(prompt, f"{said!r}: a {phrase.noun} was written before, not with the "
                           f"{phrases[owner].noun}; is it that one or another? {LLM_HINT}")
    phrases.append(phrase)
    return len(phrases) - 1, [(owner, "with", len(phrases) - 1)]


def apply_pronoun_predicate(spans: list[list[str]], ops: list[str | Relation],
                            phrases: list[NounPhrase], groups: list[tuple[int, ...]],
                            prompt: str, lead: int | None = None) -> None:
    """Apply "it is red", "they are both brown", "each of them empty" to the noun phrases the
    pronoun names (`cast_core.csg.pronouns.pronoun_targets`; `lead`: the subject of the clause
    before it, which "it" names among several), in place."""
    at, pronoun, quantifier = pronoun_subject(spans[0])
    said = " ".join(spans[0][:at])
    if any(isinstance(op, Relation) for op in ops) or not all(spans[1:]):
        raise fail(prompt, f"after {said!r} come only attribute words ('they are red and "
                           f"shiny'); for a relation name the noun phrase ('the cups are on a "
                           f"tray') or {LLM_HINT}")
    words = spans[0][at:] + [w for span in spans[1:] for w in span]
    attributes = _predicate_attributes(words, spans[0][at - 1], said, prompt)
    try:
        targets = pronoun_targets(pronoun, quantifier, phrases, groups, lead)
        for i in targets:
            phrases[i] = with_attributes(phrases[i], attributes, said, ATTRIBUTE_KINDS)
    except ValueError as err:
        raise fail(prompt, f"{err}; {LLM_HINT}") from err


def _predicate_attributes(words: list[str], verb: str, said: str,
                          prompt: str) -> tuple[tuple[str, str], ...]:
    """The attributes a predication gives ("red and shiny", "made of wood"), or an error naming
    the words that are not."""
    made = made_of(words)
    if made is not None:
        rest = read_attributes(made[0]) if made[0] else ()
        attributes = None if rest is None else merge_attributes(rest, made[1])
        check_kind_words(rest or (), said, prompt)
    else:
        attributes = read_attributes(words) if words else None
    if attributes is None:
        construct = unsupported_construct([verb, *words])
        unknown = [w for w in words if w not in ATTRIBUTE_KIND and w not in COLOR_MODIFIERS]
        reason = construct or (f"{unknown} after {said!r} is not an attribute word the offline "
                               f"parser knows" if unknown else f"{words} after {said!r} gives an "
                               "attribute kind twice or nothing")
        raise fail(prompt, f"{reason}; {LLM_HINT}")
    if made is None:
        check_kind_words(attributes, said, prompt)
    return attributes
