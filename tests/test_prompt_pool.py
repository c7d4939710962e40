"""The fixed RL training pool (data/prompts/pool.jsonl, `cast_core.shapes.prompts.make_pool`):
train lines of the three hard tags, balanced, >= 4 atoms, distinct scenes, disjoint from every
evaluation prompt by text and by scene, and exactly what its command writes."""

from collections import Counter
from pathlib import Path

import pytest

from cast_core.shapes.prompts import (
    HARD_TAGS,
    MIN_POOL_ATOMS,
    POOL_SIZE,
    atom_count,
    load_prompt_file,
    make_pool,
    scene_key,
)
from flows.shapes_prompts import main

PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts"


@pytest.fixture(scope="module")
def pool():
    return load_prompt_file(PROMPTS / "pool.jsonl")


def test_pool_is_balanced_hard_train_lines_with_enough_atoms(pool):
    assert len(pool) == POOL_SIZE == 32
    assert Counter(r["tag"] for r in pool) == {"hard_counted_relation": 11,
                                               "hard_three_objects": 11,
                                               "hard_counted_colors": 10}
    assert all(atom_count(r) >= MIN_POOL_ATOMS for r in pool)
    assert len({scene_key(r) for r in pool}) == len(pool)
    train_lines = set((PROMPTS / "train.jsonl").read_text().splitlines())
    assert set((PROMPTS / "pool.jsonl").read_text().splitlines()) <= train_lines  # as they are
    # tags interleaved: each run of three consecutive prompts (but the last two) has all three
    assert [r["tag"] for r in pool[:3]] == list(HARD_TAGS)
    assert all({r["tag"] for r in pool[i:i + 3]} == set(HARD_TAGS) for i in range(0, 30, 3))


def test_pool_is_disjoint_from_every_evaluation_prompt(pool):
    held = load_prompt_file(PROMPTS / "eval.jsonl") + load_prompt_file(PROMPTS / "hard.jsonl")
    assert not {r["prompt"] for r in pool} & {r["prompt"] for r in held}
    assert not {scene_key(r) for r in pool} & {scene_key(r) for r in held}


def test_the_command_rewrites_the_committed_pool(tmp_path, monkeypatch):
    monkeypatch.chdir(PROMPTS.parent.parent)
    out = tmp_path / "pool.jsonl"
    main(["pool", "--out", str(out)])
    assert out.read_bytes() == (PROMPTS / "pool.jsonl").read_bytes()


def test_make_pool_spaces_picks_evenly_and_refuses_a_too_small_train_set():
    train = [r for r in load_prompt_file(PROMPTS / "train.jsonl") if r["tag"] in HARD_TAGS]
    held = train[:1]  # the first train line, as if it were an evaluation prompt

    def candidates(tag):  # the tag's lines in file order, first of each scene, held line out
        seen, out = {scene_key(held[0])}, []
        for r in train:
            if r["tag"] == tag and scene_key(r) not in seen:
                out.append(r)
                seen.add(scene_key(r))
        return out

    small = make_pool(train, held, size=9)  # three per tag: candidates 0, n // 3, 2n // 3
    for j, tag in enumerate(HARD_TAGS):
        c = candidates(tag)
        assert small[j::3] == [c[0], c[len(c) // 3], c[2 * len(c) // 3]], tag
    assert held[0] not in small
    with pytest.raises(ValueError, match="hard_counted_relation train prompts"):
        make_pool([r for r in train if r["tag"] == "hard_counted_relation"][:2], [], size=9)
