"""Pronouns (sixth round on): what "it" and "them" name as the object of a relation ("a table
with a vase on it", `object_pronoun`), and what "it", "they", "both", "all of them", "each of
them" name as the subject of a predication ("five cookies on a plate; it is white",
`pronoun_targets`). A pronoun names the one noun phrase (or list) of its number written before;
since the twelfth round "they" also the only two noun phrases of one, and since the thirteenth
"them" the only two of one other than the relation's subjects ("a black car next to a white car
and a gray car behind them") and "it" among several the subject of the first statement when it is
one clause (`clause_subject`: "a vase on a shelf; it is blue"), as every list writes them.
Anything else that could name several noun phrases, or none, is refused, naming them.
"""

from __future__ import annotations

from cast_core.csg.build import LLM_HINT, NounPhrase, fail
from cast_core.csg.clauses import Relation
from cast_core.csg.references import shown_phrase
from cast_core.csg.vocab import PERSONS


def object_pronoun(word: str, subjects: set[int], phrases: list[NounPhrase], prompt: str,
                   relation: Relation) -> tuple[int, ...]:
    """Indices of what "it" (one) or "them" (two or more) names as the object of `relation`: the
    one noun phrase of that number written before, other than the relation's subjects ("three
    puppies in a basket and a kitten next to it": the basket); "them", where there is none, the
    only two noun phrases other than the subjects, each of one and neither an "of" noun ("a black
    car next to a white car and a gray car behind them": both; thirteenth round, as the lists
    write it); "him" and "her" the one person of one (`persons`: "a teacher in front of a blackboard
    and five students behind her"). Several or none is an error naming them."""
    plural = word == "them"
    found = [i for i, p in enumerate(phrases) if i not in subjects and (p.count > 1) == plural
             and (word in ("it", "them") or is_person(p))]
    others = [i for i in range(len(phrases)) if i not in subjects]
    if len(found) == 1:
        return (found[0],)
    if plural and not found and len(others) == 2 and not any(" of " in phrases[i].noun
                                                               for i in others):
        return tuple(others)
    number = {"them": "two or more (or the only two of one)", "it": "one"}.get(word, "one person")
    shown = [shown_phrase(phrases[i]) for i in found]
    said = f"{relation.form} {word}"
    if not found:
        raise fail(prompt, f"{said!r} names no noun phrase of {number} written before it; "
                           f"name the object ('{relation.form} the ...') or {LLM_HINT}")
    raise fail(prompt, f"{said!r} could name any of {shown}; name the object ('{relation.form} "
                       f"the ...') or {LLM_HINT}")


def pronoun_targets(pronoun: str, quantifier: str | None, phrases: list[NounPhrase],
                    groups: list[tuple[int, ...]], lead: int | None = None) -> tuple[int, ...]:
    """Indices in `phrases` of what a predication's pronoun names: "it" the one noun phrase of one
    written before ("five cookies on a plate; it is white"); "they" (also "both", "all of them",
    "each of them") the one noun phrase of two or more or the one list of noun phrases in
    `groups` ("three eggs in a bowl; they are brown", "a dog and a cat; they are both brown"),
    "both" of two in all; with neither, the only two noun phrases, each of one and neither an
    "of" noun ("a pair of boots"), written before ("a dog next to a cat; they are both
    sleeping"). "all" ("they are all", "all of them") among several names the one that
    holds every other ("three red balls and two blue cubes; they are all small": the list).
    "it" among several names `lead`, the subject of the clause right before it
    (`clause_subject`: "a vase on a shelf; it is blue": the vase). ValueError naming them when
    there are none or several."""
    if pronoun == "it":
        found = [(i,) for i, p in enumerate(phrases) if p.count == 1]
        found = [(lead,)] if len(found) > 1 and (lead,) in found and quantifier is None else found
    else:
        found = sorted({(i,) for i, p in enumerate(phrases) if p.count > 1} | set(groups))
        if not found and len(phrases) == 2 and not any(" of " in p.noun for p in phrases):
            found = [(0, 1)]  # not beside "a pair of boots", which "they" may name alone
    whole = [g for g in found if all(set(other) <= set(g) for other in found)]
    found = whole if quantifier == "all" and len(found) > 1 and whole else found
    shown = [" and ".join(shown_phrase(phrases[i]) for i in group) for group in found]
    said = pronoun if quantifier is None else f"{pronoun} ({quantifier})"
    if len(found) > 1:
        raise ValueError(f"{said!r} could name any of {shown}; name it ('the ... is|are ...')")
    number = "one" if pronoun == "it" else ("two or more, or a list of noun phrases (or the "
                                            "only two noun phrases, each of one)")
    if not found:
        raise ValueError(f"{said!r} names no noun phrase of {number} written before it; name it "
                         "('the ... is|are ...')")
    if quantifier == "both" and sum(phrases[i].count for i in found[0]) != 2:
        raise ValueError(f"'both' names {shown[0]!r}, which is not two; name it ('the ... are "
                         "...')")
    return found[0]


def clause_subject(edges: list[tuple[int, str, int]], opens: bool,
                   phrases: list[NounPhrase]) -> int | None:
    """The noun phrase "it" names in a predication right after a prompt's first statement when
    several of one were written (thirteenth round): that statement's subject, where it is one
    clause (`edges`, in order) that `opens` with a relation after one noun phrase of one, not a
    person (`persons`: "it" is never one) and not followed by "with" ("a cat with a ball; it is
    red": the ball?). "a vase on a shelf; it is blue" is the vase, as every list writes it (the
    subject of the clause before, as English reads a pronoun). A list before the relation ("a cat
    and a dog on a rug; it is brown") or a second clause ("a cat on a chair and a dog on a rug")
    gives None: "it" stays refused there."""
    if not opens or not edges or edges[0][1] == "with":
        return None
    subject = edges[0][0]
    placed = {subject}
    for i, _, j in edges:
        if i not in placed:
            return None  # a new clause's subject
        placed.add(j)
    return subject if phrases[subject].count == 1 and not is_person(phrases[subject]) else None


def is_person(phrase: NounPhrase) -> bool:
    """Whether a noun phrase names people (`persons`, by its noun or its last word: "police
    officer")."""
    return phrase.noun in PERSONS or phrase.noun.split(" ")[-1] in PERSONS
