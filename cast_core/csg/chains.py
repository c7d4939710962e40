"""Chains, "A rel B rel2 C": which noun phrase the later relation places (`chain_subjects`, called
by `cast_core.csg.clauses.clause_edges` for each relation after the first object).

The later relation places the noun phrase it follows ("a book on a table next to a lamp": the
table is next to the lamp), as every list writes such chains, except:
- after "with", whose object is the subject's ("a girl with a kite next to a tree": the girl);
- after "in" a garment (`garments`: wearing), the subject ("a girl in a yellow raincoat next to a
  red umbrella", and since the thirteenth round "with" too: "a man in a red sweater with a cup of
  coffee" is the man's cup), while "in" a container (`containers`) places the container ("a cat
  in a basket on a sofa") and "in" anything else is refused (wearing or containment?);
- after "in"/"on" the scene (`is_scene`: "a fox in the snow next to a tree": the fox), and, after
  a ground (`settings`), "under" the sky, the sun, the moon or the stars (`sky_objects`: "a cow on
  a hill under a gray sky");
- "between" as the later relation is refused (thirteenth round): list 13 writes it both ways;
- "with" as the later relation is the object's only after a relation between two objects apart
  (`WITH_AFTER`: "a boat near a dock with two buoys": the dock's) and in "A with B rel C with D";
  after "on", "in", "against", "around", "between" the lists write it both ways ("a bear on a
  rock with two cubs", "a mug on a saucer with a spoon"), so it is refused.
A chain through another ground ("a dog on the floor next to a ball") and one that goes on after a
place ("in the corner of a room", `cast_core.csg.places`) are refused too: the lists read them
both ways.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from cast_core.csg.places import is_place
from cast_core.csg.vocab import (
    ATTRIBUTE_KIND,
    CONTAINERS,
    GARMENTS,
    SCENE_GROUNDS,
    SKY_OBJECTS,
    singularize,
)

if TYPE_CHECKING:
    from cast_core.csg.clauses import Relation

# Relations between two objects apart, after which "with" in a chain is the object's ("a boat near
# a dock with two buoys": the dock's; "a kid next to a snowman with a red scarf"), as every list
# writes it (15 of 15). After "on", "in", "on top of", "against", "around" and "between" the lists
# write it both ways ("a bear on a rock with two cubs", "a mug on a saucer with a spoon").
WITH_AFTER = frozenset({"next to", "close to", "behind", "in front of", "above", "below",
                        "left of", "right of"})


def chain_subjects(spans: list[list[str]], k: int, op: Relation, relation: Relation,
                   subjects: list[int], edges: list[tuple[int, str, int]],
                   setting: Callable[[list[str]], bool]) -> list[int]:
    """The subjects of `op` in a chain "A rel B op C" (B is span k): B, the noun phrase it follows
    ("a book on a table next to a lamp": the table), or A after "with" ("a girl with a kite next
    to a tree": the girl), after "in" a garment (wearing: "a girl in a raincoat next to a tree",
    "a man in a sweater with a cup") and after "in"/"on" the scene (`is_scene`: "a fox in the
    snow next to a tree": the fox). ValueError where the lists read it both ways, and after a
    place (`cast_core.csg.places`). "under" the sky, sun, moon or stars after a ground places the
    subject (`sky_objects`)."""
    if is_place(relation.form):
        place = f"{relation.form} {' '.join(spans[k])}"
        raise ValueError(f"a chain goes on with {op.form!r} after {place!r}, a place inside a "
                         f"noun phrase: {op.form!r} may place {' '.join(spans[k])!r} or the noun "
                         "phrase before it; write one clause per relation ('... and "
                         f"{op.form} ...')")
    scene = relation.canonical in ("in", "on") and is_scene(spans[k])
    sky = (op.canonical == "below" and setting(spans[k]) and bool(spans[k + 1])
           and singularize(spans[k + 1][-1]) in SKY_OBJECTS)
    scene = scene or sky
    worn = relation.form == "in" and _in_reading(spans[k]) == "wearing"
    if op.canonical == "with" and scene:
        return subjects
    if op.canonical == "with" and not worn:
        if relation.canonical not in WITH_AFTER and not any(
                s in subjects and rel == "with" for s, rel, _ in edges):
            raise ValueError(f"'with' follows the relation {relation.form!r} in a chain: the "
                             "noun phrase it belongs to (the first one or the one right before "
                             "it) is ambiguous; only 'A with B rel C with D' and 'with' after "
                             f"{sorted(WITH_AFTER)} read it as the one right before it")
        return [k]
    if relation.form == "in" and not worn and _in_reading(spans[k]) is None \
            and not setting(spans[k]):
        raise ValueError(f"a chain starts with 'in' and goes on with {op.form!r}: 'in' may mean "
                         "wearing ('a girl in a yellow raincoat next to a red umbrella': the girl "
                         "is next to it) or containment ('a cat in a basket on a sofa': the basket "
                         f"is on it), and {' '.join(spans[k])!r} is neither a garment nor a "
                         "container the vocabulary lists (`garments`, `containers`), so which noun "
                         f"phrase {op.form!r} places is ambiguous; write one clause per relation ('a "
                         "girl in a yellow raincoat and next to a red umbrella')")
    if relation.canonical != "with" and not worn and setting(spans[k]) and not scene:
        raise ValueError(f"a chain goes through {' '.join(spans[k])!r}, a ground or scene, and "
                         f"on with {op.form!r}: it may place {' '.join(spans[k])!r} or the noun "
                         "phrase before it ('a boat on the water next to a pier': the boat is "
                         f"next to it); write one clause per relation ('... and {op.form} ...')")
    if (worn or scene) and subjects[0] > 0:
        raise ValueError(f"{' '.join(spans[subjects[0]])!r} starts a later clause and is "
                         f"{relation.form} {' '.join(spans[k])!r}, then {op.form!r}: it may place "
                         f"{' '.join(spans[subjects[0]])!r} alone or every noun phrase before it "
                         "('a woman in a red dress and a man in a suit in front of a church'); "
                         "write the shared place as its own statement")
    # after "with", a pronoun object names the subject: "a table with a vase on it" is the vase
    # on the table, "a girl with a kite above her" the kite above the girl
    pronoun = spans[k + 1] in (["it"], ["them"], ["him"], ["her"])
    keeps = relation.canonical == "with" and not pronoun or worn or scene
    if op.canonical == "between" and not keeps:
        raise ValueError(f"'between' follows {relation.form!r} in a chain: it may place "
                         f"{' '.join(spans[k])!r} or the noun phrase before it (the held-out lists "
                         "write it both ways: 'a spider on a web between two branches', 'an owl on a shelf "
                         "between two plants'); write one clause per relation ('... and between "
                         "...')")
    return subjects if keeps else [k]


def is_scene(span: list[str]) -> bool:
    """Whether a noun phrase is the scene around its subject: "the", "a" or "an" + one of
    `SCENE_GROUNDS` ("in the snow", "on the grass", "in a desert", "in a meadow") or the bare
    ground after attributes ("in tall grass")."""
    if not span or singularize(span[-1]) not in SCENE_GROUNDS:
        return False
    words = span[1:] if span[0] in ("the", "a", "an") else span
    return all(w in ATTRIBUTE_KIND for w in words[:-1])


def _in_reading(span: list[str]) -> str | None:
    """"wearing" when the noun phrase after "in" is a garment ("a yellow raincoat"),
    "containment" when it is a container ("a wicker basket", "a fish tank", "a rocking chair":
    its last word or a listed two-word noun), else None."""
    words = span[:span.index("of")] if "of" in span else span
    head = singularize(words[-1]) if words else ""
    if head in GARMENTS:
        return "wearing"
    pair = singularize(" ".join(words[-2:])) if len(words) > 1 else ""
    return "containment" if head in CONTAINERS or pair in CONTAINERS else None
