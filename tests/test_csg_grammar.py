"""The offline parser on compositional prompts: a hand-written table of exact graphs, a negative
table of refusals (tests/test_csg_negative.py), question forms per atom kind, noun lists, input types
and limits, and no silently wrong graph on the held-out list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cast_core.csg.build import PromptParseError
from cast_core.csg.geneval import graph_from_geneval
from cast_core.csg.graph import MAX_ATOMS, SceneGraph
from cast_core.csg.parser import MAX_PROMPT_CHARS, parse_prompt
from cast_core.csg.vocab import (
    ATTRIBUTE_COMPOUND_NOUNS,
    ATTRIBUTE_KIND,
    ATTRIBUTE_KINDS,
    COMPOUND_NOUNS,
    pluralize,
)

DATA = Path(__file__).resolve().parent / "data"


def _expected(nodes_text: str, edges_text: str) -> tuple[list, list]:
    nodes = []
    for node in filter(None, (n.strip() for n in nodes_text.split(";"))):
        words = node.split(" ")
        at = next(i for i, w in enumerate(words) if w.isdigit())
        pairs = [w.split("=") for w in words[at + 1:]]
        attributes = sorted(((k, v.replace("_", " ")) for k, v in pairs),
                            key=lambda kv: ATTRIBUTE_KINDS.index(kv[0]))
        nodes.append((" ".join(words[:at]), int(words[at]), tuple(attributes)))
    edges = []
    for edge in filter(None, (e.strip() for e in edges_text.split(";"))):
        words = edge.split(" ")
        edges.append((int(words[0]), " ".join(words[1:-1]), int(words[-1])))
    return nodes, edges


def _table() -> list[tuple[str, list, list]]:
    rows = []
    for line in (DATA / "compositional_table.txt").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            prompt, nodes, edges = (part.strip() for part in line.split("||"))
            rows.append((prompt, *_expected(nodes, edges)))
    return rows


def _shape(graph: SceneGraph) -> tuple[list, list]:
    index = {n.id: i for i, n in enumerate(graph.nodes)}
    nodes = [(n.noun, n.count, n.attributes) for n in graph.nodes]
    edges = [(index[e.subject], e.relation, index[e.object]) for e in graph.edges]
    return nodes, edges


TABLE = _table()


def test_table_is_large_and_covers_every_kind():
    kinds = {k for _, nodes, _ in TABLE for _, _, attributes in nodes for k, _ in attributes}
    relations = {r for _, _, edges in TABLE for _, r, _ in edges}
    assert len(TABLE) >= 200
    assert kinds == set(ATTRIBUTE_KINDS)
    assert relations == {"left of", "right of", "above", "below", "in front of", "behind",
                         "on top of", "next to", "close to", "with", "on", "in", "around",
                         "against", "between"}


@pytest.mark.parametrize("prompt, nodes, edges", TABLE, ids=[row[0] for row in TABLE])
def test_table_parses_exactly(prompt, nodes, edges):
    graph = parse_prompt(prompt, tag="t")
    assert _shape(graph) == (nodes, edges)
    assert (graph.prompt, graph.tag) == (prompt, "t")
    assert [e.id for e in graph.edges] == [f"rel{k}" for k in range(len(edges))]


@pytest.mark.parametrize("prompt, questions", [
    ("three checkered mushrooms to the left of a wooden chair", [
        "Is there a mushroom?", "How many checkered mushrooms are there?",
        "Do the mushrooms have a checkered pattern?", "Is there a chair?",
        "Is the chair made of wood?",
        "Are the three checkered mushrooms left of the wooden chair?"]),
    ("a sparkling truck behind two tiny glass sheep", [
        "Is there a truck?", "Does the truck look sparkling?", "Is there a sheep?",
        "How many tiny glass sheep are there?", "Are the sheep tiny?",
        "Are the sheep made of glass?",
        "Is the sparkling truck behind the two tiny glass sheep?"]),
    ("three red apples in a wooden bowl; the bowl is on a table", [
        "Is there an apple?", "How many red apples are there?", "Are the apples red?",
        "Is there a bowl?", "Is the bowl made of wood?", "Is there a table?",
        "Are the three red apples in the wooden bowl?", "Is the wooden bowl on the table?"]),
    ("a cat next to a dog, the dog is brown and fluffy", [
        "Is there a cat?", "Is there a dog?", "Is the dog brown?", "Does the dog look fluffy?",
        "Is the cat next to the fluffy brown dog?"]),
    ("a round broken mirror with a teal frame", [
        "Is there a mirror?", "Is the mirror round?", "Is the mirror broken?", "Is there a frame?",
        "Is the frame teal?", "Is the broken round mirror with the teal frame?"]),
    ("two big shiny red striped metal boxes near a light blue cat", [
        "Is there a box?", "How many big shiny red striped metal boxes are there?",
        "Are the boxes red?", "Are the boxes big?", "Are the boxes made of metal?",
        "Do the boxes have a striped pattern?", "Do the boxes look shiny?", "Is there a cat?",
        "Is the cat light blue?",
        "Are the two big shiny red striped metal boxes close to the light blue cat?"]),
    ("two cups of tea around a black and white teapot", [
        "Is there a cup of tea?", "How many cups of tea are there?", "Is there a teapot?",
        "Is the teapot black and white?",
        "Are the two cups of tea around the black and white teapot?"]),
    ("a lamp between two red armchairs and against a wall", [
        "Is there a lamp?", "Is there an armchair?", "How many red armchairs are there?",
        "Are the armchairs red?", "Is there a wall?",
        "Is the lamp between the two red armchairs?", "Is the lamp against the wall?"]),
    ("a lamp between a bed and a red desk", [
        "Is there a lamp?", "Is there a bed?", "Is there a desk?", "Is the desk red?",
        "Is the lamp between the bed and the red desk?",
        "Is the lamp between the bed and the red desk?"]),
    ("a black cat; the cat's collar is red", [
        "Is there a cat?", "Is the cat black?", "Is there a collar?", "Is the collar red?",
        "Is the black cat with the red collar?"]),
    ("a pair of red boots beside a vase made of glass", [
        "Is there a pair of boots?", "Is the pair of boots red?", "Is there a vase?",
        "Is the vase made of glass?", "Is the red pair of boots next to the glass vase?"]),
    ("a steaming bowl of soup next to two loaves of bread", [
        "Is there a bowl of soup?", "Is the bowl of soup steaming?", "Is there a loaf of bread?",
        "How many loaves of bread are there?",
        "Is the steaming bowl of soup next to the two loaves of bread?"]),
])
def test_question_forms_per_kind(prompt, questions):
    assert [a.question for a in parse_prompt(prompt).atoms()] == questions


def test_atoms_keep_kind_order_and_parents():
    graph = parse_prompt("a small red wooden chair on top of a striped rug")
    rows = [(a.id, a.type, a.value, a.parents) for a in graph.atoms()]
    assert rows == [("obj0", "object", None, ()), ("obj0/color", "attribute", "red", ("obj0",)),
                    ("obj0/size", "attribute", "small", ("obj0",)),
                    ("obj0/material", "attribute", "wooden", ("obj0",)),
                    ("obj1", "object", None, ()), ("obj1/pattern", "attribute", "striped", ("obj1",)),
                    ("rel0", "relation", "on top of", ("obj0", "obj1"))]


def test_unknown_attribute_word_is_never_part_of_the_noun():
    for word in ("teal", "sparkling", "checkered", "glass"):
        assert word in ATTRIBUTE_KIND
    for prompt in ("a photo of a zesty car", "a groggy cat next to a dog", "two zesty cars"):
        with pytest.raises(PromptParseError, match="not an attribute word"):
            parse_prompt(prompt)


def test_only_listed_compound_nouns_start_with_an_attribute_word():
    starts = {n for n in COMPOUND_NOUNS if n.split(" ")[0] in ATTRIBUTE_KIND}
    assert starts == ATTRIBUTE_COMPOUND_NOUNS


@pytest.mark.parametrize("noun", sorted(ATTRIBUTE_COMPOUND_NOUNS))
def test_compound_nouns_with_an_attribute_word_are_never_split(noun):
    article = "an" if noun[0] in "aeiou" else "a"
    assert _shape(parse_prompt(f"{article} {noun}"))[0] == [(noun, 1, ())]
    assert _shape(parse_prompt(f"two small {pluralize(noun)}"))[0] == [
        (noun, 2, (("size", "small"),))]


def test_noun_list_decides_multi_word_nouns_and_checks_every_noun():
    graph = parse_prompt("two red hot air balloons above a dog", nouns={"hot air balloon", "dog"})
    assert _shape(graph)[0] == [("hot air balloon", 2, (("color", "red"),)), ("dog", 1, ())]
    listed = parse_prompt("a photo of a brown garden gnome", nouns={"garden gnome"})
    assert listed.nodes[0].noun == "garden gnome"
    with pytest.raises(PromptParseError, match="names none of the listed nouns"):
        parse_prompt("a photo of a brown garden gnome", nouns={"gnome hat"})
    with pytest.raises(PromptParseError, match=r"\['zesty'\] before the noun 'car'"):
        parse_prompt("a photo of a zesty car", nouns={"car"})
    with pytest.raises(PromptParseError, match="names none of the listed nouns"):
        parse_prompt("a photo of a cat and a dog", nouns={"cat"})


def test_geneval_records_with_multi_word_classes_agree_through_their_nouns():
    record = {"tag": "color_attr", "prompt": "a photo of a purple garden gnome and a red bench",
              "include": [{"class": "garden gnome", "count": 1, "color": "purple"},
                          {"class": "bench", "count": 1, "color": "red"}]}
    nouns = {c["class"] for c in record["include"]}
    assert parse_prompt(record["prompt"], "color_attr", nouns) == graph_from_geneval(record)


@pytest.mark.parametrize("value, expected", [(None, "got NoneType"), (b"a cat", "got bytes"),
                                             (3, "got int"), (["a cat"], "got list")])
def test_non_str_prompt_is_a_type_error(value, expected):
    with pytest.raises(TypeError, match=f"expects the prompt as a str, {expected}"):
        parse_prompt(value)


def test_bytes_prompt_says_to_decode():
    with pytest.raises(TypeError, match="decode the bytes"):
        parse_prompt(b"a photo of a cat")


def test_prompt_length_and_atom_limits():
    with pytest.raises(PromptParseError, match=f"more than the limit of {MAX_PROMPT_CHARS}"):
        parse_prompt("a cat" + " and a dog" * 60)
    colours = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black",
               "white", "teal", "navy"]
    many = ", ".join(f"two {c} striped {n}s" for c in colours[:7] for n in ("cat", "dog"))
    assert len(many) <= MAX_PROMPT_CHARS
    with pytest.raises(PromptParseError, match=f"it has 56 atoms, more than the limit of "
                                               f"{MAX_ATOMS} per graph"):
        parse_prompt(many)


# Held-out prompts whose graph differs from the one written down, pinned so that any other change
# shows; each keeps every object, attribute word and relation, and differs in a label the lists
# themselves do not write one way (see docs/csg_grammar.md). The first list reads "rubber
# ducks" as ducks made of rubber here but as the compound "rubber duck" elsewhere, drops
# "chocolate" from "a chocolate cake", names "inside" a relation of its own (the parser's "in"),
# drops "of milk" from "a tall glass of milk" but keeps "a glass of water" whole, writes "a pair
# of skis" as two skis (the later lists, and the parser: one "pair of skis"), and gives a relation
# after a list only to the last listed noun phrase (the second and fourth lists, and the parser:
# to each).
# The second list files "glowing" under state; the vocabulary (and the other lists) under texture.
# It also writes "a vase of red roses" as roses in a vase; the seventh list (and, since the eighth
# round, the parser, as after the other containers) as one noun "vase of roses", colour red.
# The third list reads "paper bag" and "paper lantern" as compounds (the first and second lists,
# and the parser: paper as a material; "paper bag" is refused since the eighth round, as the
# eighth list writes it as a compound too), writes one
# posture verb into its relation ("sitting on"; elsewhere it writes the relation alone, as the
# parser reads it), drops the state of a posture verb that is also a state word ("parked" after a
# list, "a red car and a blue car parked next to a house"; "a cat sleeping on a wooden
# windowsill", where the first, fourth, fifth and sixth lists keep "sleeping"), and reads one chain the other way from the 13 chains of the
# first two lists ("a pink piggy bank on a shelf beside three gold coins": the parser places the
# shelf beside the coins).
# The fourth list's one, "a blue whale" (the animal) read as a whale coloured blue, is refused
# since the fifth round: the second list labels the same words a whale coloured blue.
# The fourth list writes "X with Y rel it" as the one edge Y rel X; the fifth (and the sixth) also
# the "with" edge, as the parser keeps every relation written ("a wooden table with four chairs
# around it": table with chairs, chairs around table).
# The sixth list's one: a label typo made while rewriting a duplicate ("a cracked egg to the left
# of a whole egg" is labelled "next to"). Its four "X next to A and B rel C" that the writer
# labelled as a list after "next to" are refused since the seventh round (a list or a new clause?).
# The seventh list's four, after the round that it measured, were refused (see docs/csg_grammar.md):
# "its collar" after a later relation in a chain (whose?), "a man and his dog" (the sixth list
# writes no "with" for the owner, the seventh writes one), and "wrinkled" (the second list files it
# under texture, the seventh under state).
# The fifth list's three were readings (all three are refused since the sixth round): it places the boat, not the water, next to the pier (the
# chain rule places the noun phrase the later relation follows), files "bronze" under material
# (the vocabulary: colour), and reads "a sandcastle next to a red bucket and a yellow shovel on a
# beach" as a list after "next to" with the shovel on the beach (the parser, as since the first
# round: a noun phrase followed by a relation after the first object starts a new clause, so the
# sandcastle is next to the bucket only).
# The tenth list writes "a dark forest" as the forest's state; the sixth and eighth lists and the
# table write "dark" alone as a colour ("a dark lake", "a dark forest"), as the parser reads it.
# The eleventh list writes "a dusty piano" as the piano's state; nine lines of lists 2 to 10 write
# "dusty" as texture, as the vocabulary does.
# Since the twelfth round "in the middle of", "in the corner of" read as "on" a surface and "in"
# an area, as lists 4, 5 and 8 to 12 write them (21 lines); the sixth and seventh lists write them
# as relations of their own on three lines marked "refuse" ("in the middle of", "in the corner
# of"), as the first list names "inside" a relation of its own.
# Since the thirteenth round "it" after a first statement of one clause names its subject, as every
# list writes it (about 30 lines); the tenth list's "a red ball in front of a blue box; it is
# shiny" (marked "refuse") gives neither noun phrase the texture shiny, a slip no reading matches.
# The thirteenth list writes "a paper plate" as a compound, where lists 3, 5 and 6 (three lines)
# write a plate made of paper, and "a potted plant" as a plant whose state is potted, where lists 3
# to 12 and the vocabulary write the compound (nine lines): its writer's slips from the earlier
# lists' conventions, pinned as the first list's are. Its "a paper boat", a compound, where the
# table writes a boat made of paper, is refused since the fourteenth round.
LABEL_DIFFERENCES = {
    "compositional_heldout.jsonl": ["six yellow rubber ducks in front of a bathtub",
                                    "a pair of skis",
                                    "eight striped candles on top of a chocolate cake",
                                    "a leather bag beside a pair of shoes",
                                    "a tall glass of milk next to two cookies",
                                    "three knives and two forks next to a white plate",
                                    "two red apples and a yellow banana on top of a wooden table",
                                    "two potatoes and three tomatoes on top of a wooden board",
                                    "a red cup inside a glass box"],
    "compositional_heldout2.jsonl": ["a vase of red roses on a wooden table",
                                     "a glowing lantern above a sleeping dog and a wooden boat"],
    "compositional_heldout3.jsonl": ["two paper lanterns above a koi pond",
                                     "a cat sleeping on a wooden windowsill",
                                     "an old man sitting on a bench beside a lake",
                                     "a red car and a blue car parked next to a house",
                                     "a pink piggy bank on a shelf beside three gold coins"],
    "compositional_heldout4.jsonl": ["a black piano with a red rose on top of it",
                                     "a chessboard with two chess pieces on it",
                                     "a wooden table with four wooden chairs around it"],
    "compositional_heldout5.jsonl": [],
    "compositional_heldout6.jsonl": ["a cracked egg to the left of a whole egg",
                                     "a tree in the middle of a field"],
    "compositional_heldout7.jsonl": ["a tree in the middle of a lake",
                                     "a lamp in the corner of a room"],
    "compositional_heldout8.jsonl": [],
    "compositional_heldout9.jsonl": [],
    "compositional_heldout10.jsonl": ["an orange fox in front of a dark forest",
                                      "a red ball in front of a blue box; it is shiny"],
    "compositional_heldout11.jsonl": ["a torn poster above a dusty piano"],
    "compositional_heldout12.jsonl": [],
    "compositional_heldout13.jsonl": ["a triangular slice of pizza on a paper plate",
                                      "a goldfish in a glass tank next to a potted plant"],
}


@pytest.mark.parametrize("name", sorted(LABEL_DIFFERENCES))
def test_held_out_lists_differ_only_in_the_pinned_prompts(name):
    wrong = []
    for line in (DATA / name).read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        try:
            graph = parse_prompt(row["prompt"])
        except PromptParseError:
            continue
        nodes = [(n["noun"], n["count"], tuple(sorted(n["attributes"].items(),
                                                      key=lambda kv: ATTRIBUTE_KINDS.index(kv[0]))))
                 for n in row["nodes"]]
        if _shape(graph) != (nodes, [tuple(e) for e in row["edges"]]):
            wrong.append(row["prompt"])
    assert wrong == LABEL_DIFFERENCES[name]
