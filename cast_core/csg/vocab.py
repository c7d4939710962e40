"""The offline parser's words: attribute classes, relation phrases, multi-word nouns, plurals.

The closed classes live in `vocabulary.json` next to this file (its `_source` says where they
come from); this module loads them once into read-only constants and checks that no word belongs
to two attribute kinds. A word is an attribute only when that file lists it, and a noun may be more
than one word only when it is listed there as a compound noun (or given to the parser as a noun
list): anything else in attribute position is an error, never part of the noun. A few compounds
start with an attribute word ("golden retriever", "rubber duck", "chocolate cake"); the file lists
them apart (`ATTRIBUTE_COMPOUND_NOUNS`) so that they read as one noun, never as attribute + noun.

Relation phrases map the forms people write to one canonical relation each ("under" and
"beneath" are "below", "over" is "above", "beside" and "by" are "next to", "near" is "close
to", "to the left of" and "on the left side of" are "left of", "inside" is "in"); "around",
"against" and "between" (of one noun phrase of two or more, "between two armchairs", or of two
of one, "between a bed and a desk") are relations of their own. Posture verbs
("sitting", "parked", ...) are read only right before a relation form, which they leave as it is
("a cat sitting on a chair": on); "of" heads are the containers and quantities that make an "of"
phrase one noun ("a cup of tea", "two loaves of bread"). Plurals: rules plus a small irregular
table, which also undoes GenEval's own naive plural (name + "es" after a final s, else + "s"), so
"two computer mouses", "two skises" and "two knifes" from GenEval's generator parse back to their
class names.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType

_DATA = json.loads((Path(__file__).with_name("vocabulary.json")).read_text(encoding="utf-8"))

ATTRIBUTE_KINDS: tuple[str, ...] = tuple(_DATA["attribute_kinds"])
MATERIAL_SUBSTANCE = MappingProxyType(dict(_DATA["attributes"]["material"]))
COLOR_MODIFIERS: frozenset[str] = frozenset(_DATA["color_modifiers"])
ALSO_NOUNS: frozenset[str] = frozenset(_DATA["also_nouns"])
ATTRIBUTE_COMPOUND_NOUNS: frozenset[str] = frozenset(_DATA["attribute_compound_nouns"])
COMPOUND_NOUNS: frozenset[str] = frozenset(_DATA["compound_nouns"]) | ATTRIBUTE_COMPOUND_NOUNS
# Attribute word + noun that writers read both ways ("a blue whale": the species, or a whale
# coloured blue; the held-out lists label it each way): refused by name, never read either way.
AMBIGUOUS_COMPOUND_NOUNS: frozenset[str] = frozenset(_DATA["ambiguous_compound_nouns"])
# Attribute words the lists file under two kinds ("a bronze statue": colour or material?): refused
# before a noun by name, never filed under either.
AMBIGUOUS_KIND_WORDS = MappingProxyType({w: tuple(k) for w, k in _DATA["ambiguous_kind_words"].items()})
# Grounds and scenes ("a beach", "the water", "the grass"): a relation to one after a list ("a
# sandcastle next to a bucket and a shovel on a beach") may place every noun phrase or only the
# last, and one in the middle of a chain ("a boat on the water next to a pier") may be where the
# subject is rather than what the later relation places; both are refused.
SETTINGS: frozenset[str] = frozenset(_DATA["settings"])
# Settings written as the scene around the subject: "the snow", "the grass", or the bare mass noun
# ("in tall grass"). A chain through one places the subject, as the lists write it ("a fox in the
# snow next to a pine tree": the fox is next to it); "the mud" and "the floor" (which the lists
# write both ways) and a setting with a/an ("a field") stay refused.
SCENE_GROUNDS: frozenset[str] = frozenset(_DATA["scene_grounds"])
# After "in" in a chain: a garment means wearing ("a girl in a yellow raincoat next to a tree": the
# girl is next to it), a container containment ("a cat in a basket on a sofa": the basket is on it).
GARMENTS: frozenset[str] = frozenset(_DATA["garments"])
# "in the middle of", "in the corner of" (twelfth round): on a surface ("a bowl in the middle of a
# table": on it), in an area ("a fountain in the middle of a park": in it), as lists 4, 5 and 8 to
# 12 write them; any other object is refused (`cast_core.csg.places`).
PLACE_SURFACES: frozenset[str] = frozenset(_DATA["place_surfaces"])
PLACE_AREAS: frozenset[str] = frozenset(_DATA["place_areas"])
# "under a gray sky" after a ground in a chain places the subject (`sky_objects`: twelfth round).
SKY_OBJECTS: frozenset[str] = frozenset(_DATA["sky_objects"])
CONTAINERS: frozenset[str] = frozenset(_DATA["containers"])
# Mass nouns, which a relation may take without an article ("a tiger lying in tall grass"): one.
MASS_NOUNS: frozenset[str] = frozenset(_DATA["mass_nouns"])
# Parts of a thing or a body: "on a horse's back" is on the horse; "on its roof" (whose?) is refused.
PARTS: frozenset[str] = frozenset(_DATA["parts"])
UNSUPPORTED_RELATIONS: frozenset[str] = frozenset(_DATA["unsupported_relations"])
POSTURE_VERBS: frozenset[str] = frozenset(_DATA["posture_verbs"])
VERBS: frozenset[str] = frozenset(_DATA["verbs"]) | POSTURE_VERBS
# Posture verbs that are states only before the noun, as the lists write them ("a floating piece of
# ice": its state; "a frog floating on a lily pad": no state, on the lily pad).
STATES_BEFORE_NOUN_ONLY: frozenset[str] = frozenset(_DATA["states_before_noun_only"])
OF_HEADS: frozenset[str] = frozenset(_DATA["of_heads"])
CLAUSE_WORDS: frozenset[str] = frozenset(_DATA["clause_words"])
# People, whom "it" never names ("a boy next to a kite; it is red": the kite), so "it" after a
# clause whose subject is one is not read as that subject (thirteenth round).
PERSONS: frozenset[str] = frozenset(_DATA["persons"])


def _attribute_kinds() -> dict[str, str]:
    kind_of: dict[str, str] = {}
    for kind in ATTRIBUTE_KINDS:
        for word in _DATA["attributes"][kind]:
            if word in kind_of:
                raise ValueError(f"vocabulary.json lists {word!r} as both {kind_of[word]!r} "
                                 f"and {kind!r}; keep it in one kind")
            kind_of[word] = kind
    return kind_of


ATTRIBUTE_KIND = MappingProxyType(_attribute_kinds())

RELATION_PHRASES = MappingProxyType({
    "left of": "left of", "to the left of": "left of", "on the left of": "left of",
    "on the left side of": "left of", "to the left side of": "left of",
    "right of": "right of", "to the right of": "right of", "on the right of": "right of",
    "on the right side of": "right of", "to the right side of": "right of",
    "above": "above", "over": "above",
    "below": "below", "under": "below", "underneath": "below", "beneath": "below",
    "in front of": "in front of", "behind": "behind",
    "on top of": "on top of", "atop": "on top of",
    "next to": "next to", "beside": "next to", "by": "next to",
    "near": "close to", "close to": "close to",
    "with": "with", "on": "on", "in": "in", "inside": "in", "around": "around",
    "between": "between", "in between": "between", "against": "against",
    # a place on the object's surface is on it, as every list writes it ("a glass on the edge of
    # a table", "a bench at the top of a hill")
    "on the edge of": "on", "at the top of": "on",
    # since the twelfth round "in" or "on" by the object (`cast_core.csg.places`): "in" here
    "in the middle of": "in", "in the center of": "in", "in the centre of": "in",
    "in the corner of": "in",
})
RELATION_FORMS: tuple[tuple[str, ...], ...] = tuple(sorted(
    (tuple(p.split(" ")) for p in RELATION_PHRASES), key=len, reverse=True))

IRREGULAR_PLURALS: dict[str, str] = {
    "person": "people", "man": "men", "woman": "women", "child": "children", "mouse": "mice",
    "goose": "geese", "foot": "feet", "tooth": "teeth", "knife": "knives", "wife": "wives",
    "life": "lives", "leaf": "leaves", "loaf": "loaves", "wolf": "wolves", "shelf": "shelves",
    "half": "halves", "calf": "calves", "potato": "potatoes", "tomato": "tomatoes",
    "cookie": "cookies", "movie": "movies",
}
INVARIANT_NOUNS: frozenset[str] = frozenset({"sheep", "deer", "fish", "moose", "bison",
                                             "series", "species", "scissors"})
# Plurals read back to their singular, but never written by `pluralize` (so the question text of
# a graph built before they were added does not change).
_READ_ONLY_PLURALS: dict[str, str] = {
    "cacti": "cactus", "fungi": "fungus", "oxen": "ox", "scarves": "scarf", "elves": "elf",
    "hooves": "hoof", "thieves": "thief", "dwarves": "dwarf", "heroes": "hero",
    "volcanoes": "volcano", "mangoes": "mango", "dominoes": "domino", "echoes": "echo",
    "dice": "die", "octopi": "octopus",
}
_SINGULAR_EXCEPTIONS: dict[str, str] = {
    **{p: s for s, p in IRREGULAR_PLURALS.items()}, **_READ_ONLY_PLURALS,
    "mouses": "mouse", "houses": "house", "scissorses": "scissors",
}


def singularize(noun: str) -> str:
    """Singular of a plural noun phrase: only its last word changes ("wine glasses"), or in an
    "of" phrase the word before "of" ("loaves of bread" -> "loaf of bread")."""
    if " of " in noun:
        head, rest = noun.split(" of ", 1)
        return f"{singularize(head)} of {rest}"
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
    """Plural of a singular noun phrase, the inverse of `singularize` on its last word (on the
    word before "of" in an "of" phrase: "cup of tea" -> "cups of tea")."""
    if " of " in noun:
        head, rest = noun.split(" of ", 1)
        return f"{pluralize(head)} of {rest}"
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
