"""A place inside another noun phrase, read as a relation (twelfth round): "in the middle of",
"in the center (centre) of" and "in the corner of" are "on" a surface ("a bowl in the middle of a wooden
table": on the table) and "in" an area ("a fountain in the middle of a park", "a lamp in the
corner of a bedroom"), as lists 4, 5 and 8 to 12 write them (lists 6 and 7 wrote a relation of
its own on lines marked "refuse"). The object's head word decides, from two closed classes in the
vocabulary file (`place_surfaces`, `place_areas`); any other object ("in the middle of a crowd")
is refused by name, and so is a chain that goes on after a place ("a cat in the corner of a room
next to a plant": the cat or the room?; `cast_core.csg.clauses`). Other places inside a noun
phrase ("the bottom of", "the foot of", "the back of") stay refused (`cast_core.csg.refusals`)."""

from __future__ import annotations

from dataclasses import replace

from cast_core.csg.vocab import PLACE_AREAS, PLACE_SURFACES, singularize

PLACE_FORMS: tuple[str, ...] = ("in the middle of", "in the center of", "in the centre of",
                                "in the corner of")


def is_place(form: str) -> bool:
    """Whether a relation form is a place form (`PLACE_FORMS`), also after a posture verb."""
    return any(form == p or form.endswith(" " + p) for p in PLACE_FORMS)


def place_relation(form: str, span: list[str]) -> str | None:
    """The canonical relation of a relation form written before the object `span`: "on" or "in"
    for a place form (`PLACE_FORMS`, also after a posture verb: "standing in the middle of"), by
    the object's head word; None for any other form. ValueError for a place form whose object is
    neither a surface nor an area the vocabulary lists."""
    if not is_place(form) or not span:
        return None  # with no object, the clause reader names what is missing
    place = next(p for p in PLACE_FORMS if form.endswith(p))
    words = span[:span.index("of")] if "of" in span else span
    head = singularize(words[-1]) if words else ""
    if head in PLACE_SURFACES:
        return "on"
    if head in PLACE_AREAS:
        return "in"
    said = " ".join(span)
    raise ValueError(f"it has {place!r} ({place + ' ' + said!r}), a place inside another noun "
                     f"phrase: on a surface it reads 'on' ({sorted(PLACE_SURFACES)}), in an area "
                     f"'in' ({sorted(PLACE_AREAS)}), and {said!r} is neither; write the relation "
                     "itself ('in a field', 'on a table')")


def read_places(spans: list[list[str]], ops: list) -> list:
    """A clause's `ops` (separators and `cast_core.csg.clauses.Relation`s between its `spans`)
    with each place form ("in the middle of") read as "on" or "in" by its object."""
    placed = []
    for k, op in enumerate(ops):
        canonical = None if isinstance(op, str) else place_relation(op.form, spans[k + 1])
        placed.append(op if canonical is None else replace(op, canonical=canonical))
    return placed
