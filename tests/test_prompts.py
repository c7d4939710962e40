"""Shapes-world prompt grammar, splits and prompt-file validation."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from cast_core.shapes.prompts import (
    HARD_TAGS,
    SMALL_TAGS,
    TAGS,
    PromptFileError,
    atom_count,
    enumerate_prompts,
    load_prompt_file,
    make_record,
    make_splits,
    sample_prompts,
    scene_key,
)
from cast_core.shapes.world import COLORS, MAX_COUNT, RELATIONS, SHAPES

PROMPT_DIR = Path(__file__).resolve().parents[1] / "data" / "prompts"
S, C, N, R = len(SHAPES), len(COLORS), MAX_COUNT, len(RELATIONS)


@pytest.fixture(scope="module")
def splits():
    return make_splits(0)


def _texts(records, tags=TAGS):
    return {r["prompt"] for r in records if r["tag"] in tags}


@pytest.mark.parametrize("tag, size", [
    ("single_object", S), ("two_object", S * (S - 1)), ("counting", S * (N - 1)),
    ("colors", S * C), ("position", S * (S - 1) * R), ("color_attr", S * (S - 1) * C ** 2),
    ("hard_counted_colors", S * (S - 1) * C ** 2 * N ** 2),
])
def test_enumerate_sizes_and_uniqueness(tag, size):
    records = enumerate_prompts(tag)
    assert len(records) == size == len(_texts(records))


def test_make_record_follows_geneval_layout():
    record = make_record("hard_counted_relation", [("circle", 2, "red"), ("square", 1, "blue")],
                         "left of")
    assert record == {
        "tag": "hard_counted_relation",
        "include": [{"class": "square", "count": 1, "color": "blue"},
                    {"class": "circle", "count": 2, "color": "red", "position": ["left of", 0]}],
        "exclude": [{"class": "circle", "count": 3, "color": "red"}],
        "prompt": "a photo of two red circles left of a blue square",
    }
    assert atom_count(record) == 3 + 2 + 1


def test_scene_key_ignores_word_order_and_relation_direction():
    a, b = ("circle", 2, "red"), ("square", 1, "blue")
    assert scene_key(make_record("t", [a, b])) == scene_key(make_record("t", [b, a]))
    left = make_record("t", [a, b], "left of")
    assert scene_key(left) == scene_key(make_record("t", [b, a], "right of"))
    assert scene_key(left) != scene_key(make_record("t", [a, b], "right of"))


def test_sample_prompts_respects_filters():
    avoid = frozenset(scene_key(r) for r in enumerate_prompts("hard_counted_colors")[:500])
    picked = sample_prompts("hard_counted_colors", 100, random.Random(3), min_atoms=6,
                            avoid=avoid)
    assert len(picked) == 100 == len({scene_key(r) for r in picked})
    assert all(atom_count(r) >= 6 and scene_key(r) not in avoid for r in picked)
    with pytest.raises(ValueError, match="ask for fewer"):
        sample_prompts("colors", S * C + 1, random.Random(0))


def test_splits_deterministic(splits):
    assert make_splits(0) == splits
    assert make_splits(1)["hard"] != splits["hard"]


def test_split_sizes_and_tags(splits):
    assert (len(splits["train"]), len(splits["hard"])) == (5000, 200)
    hard_tags = [r["tag"] for r in splits["hard"]]
    assert sorted(hard_tags.count(t) for t in HARD_TAGS) == [66, 67, 67]
    eval_tags = [r["tag"] for r in splits["eval"]]
    expected = {"single_object": S, "two_object": S * (S - 1), "counting": S * (N - 1),
                "colors": S * C, "position": S * (S - 1) * R, "color_attr": 60,
                **{t: 30 for t in HARD_TAGS}}
    assert {t: eval_tags.count(t) for t in TAGS} == expected
    assert {r["tag"] for r in splits["train"]} == set(TAGS) - {"position"}


def test_hard_prompts_have_at_least_five_atoms(splits):
    assert all(atom_count(r) >= 5 for r in splits["hard"])
    assert all(atom_count(r) >= 5 for r in splits["eval"] if r["tag"] in HARD_TAGS)


def test_splits_disjoint(splits):
    train, held_out = _texts(splits["train"]), ("position", "color_attr", *HARD_TAGS)
    assert not train & _texts(splits["hard"])
    assert not train & _texts(splits["eval"], held_out)
    assert not _texts(splits["hard"]) & _texts(splits["eval"])
    assert _texts(splits["eval"], SMALL_TAGS[:4]) <= train
    scenes = {name: {scene_key(r) for r in recs if r["tag"] in HARD_TAGS}
              for name, recs in splits.items()}
    assert not (scenes["train"] & scenes["hard"] or scenes["train"] & scenes["eval"]
                or scenes["hard"] & scenes["eval"])


def test_committed_files_match_generator_and_load(splits):
    for name, records in splits.items():
        path = PROMPT_DIR / f"{name}.jsonl"
        assert path.read_text() == "".join(json.dumps(r) + "\n" for r in records)
        assert load_prompt_file(path) == records


GOOD = json.dumps(make_record("colors", [("circle", 1, "red")]))


@pytest.mark.parametrize("bad_line, needle", [
    ('{"tag": "colors", "include": [', "Expecting"),
    (GOOD.replace('"circle"', '"hexagon"'), "unknown class"),
    (GOOD.replace('"red"', '"teal"'), "unknown colour"),
    (GOOD.replace('"colors"', '"shapes"'), "tag 'shapes'"),
    (GOOD.replace('"count": 1', '"count": 5'), "count must be an int in 1..4"),
    (GOOD.replace('"prompt": "a photo of a red circle"', '"prompt": "a photo of a red square"'),
     "does not match"),
    (GOOD.replace(', "prompt": "a photo of a red circle"', ""), "'prompt'"),
    (json.dumps(make_record("position", [("circle", 1, None), ("square", 1, None)], "left of"))
     .replace("left of", "near"), "near"),
])
def test_load_prompt_file_names_file_and_line(tmp_path, bad_line, needle):
    path = tmp_path / "prompts.jsonl"
    path.write_text(f"{GOOD}\n{GOOD}\n{bad_line}\n{GOOD}\n")
    with pytest.raises(PromptFileError) as info:
        load_prompt_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}, line 3: ") and needle in message
