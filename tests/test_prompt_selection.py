"""`prompts.selection = "cycle"` (tasks/stages/rollout.select_prompts): iteration k trains on the
prompts at file positions (k B + j) mod P, so a fixed pool is visited evenly; B > P is refused."""

import json
import math
from pathlib import Path

import pytest
from pipeline_helpers import ci_recipe

from tasks.stages.build_csgs import build_csgs
from tasks.stages.rollout import cycle_positions, select_prompts
from tasks.store.store import Store

POOL = Path(__file__).resolve().parents[1] / "data" / "prompts" / "pool.jsonl"


def test_cycle_positions_closed_form():
    assert cycle_positions(0, 8, 32) == list(range(8))
    assert cycle_positions(3, 8, 32) == list(range(24, 32))
    assert cycle_positions(4, 8, 32) == list(range(8))  # back to the start
    assert cycle_positions(2, 3, 5) == [1, 2, 3]  # (6 + j) mod 5
    assert cycle_positions(7, 5, 5) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="per_iteration = 6 exceeds the 5 prompts"):
        cycle_positions(0, 6, 5)


@pytest.mark.parametrize("b", [8, 5])
def test_cycle_visits_the_pool_in_file_order(tmp_path, b):
    store, recipe = Store(tmp_path / "store"), ci_recipe(POOL, **{
        "prompts.selection": "cycle", "prompts.per_iteration": b})
    csgs = build_csgs(store, recipe)
    texts = [json.loads(line)["prompt"] for line in POOL.read_text().splitlines()]
    p = len(texts)
    picked = [[r["prompt"] for r in select_prompts(store, recipe, csgs, k)] for k in range(9)]
    for k, prompts in enumerate(picked):
        assert prompts == [texts[(k * b + j) % p] for j in range(b)]
    period = math.ceil(p / b)
    seen = [t for prompts in picked[:period] for t in prompts]
    assert set(seen) == set(texts)  # every prompt once every ceil(P / B) iterations
    other_seed = recipe.model_copy(update={"run": recipe.run.model_copy(update={"seed": 3})})
    assert [r["prompt"] for r in select_prompts(store, other_seed, csgs, 2)] == picked[2]


def test_cycle_refuses_more_prompts_than_the_file_holds(tmp_path):
    store = Store(tmp_path / "store")
    recipe = ci_recipe(POOL, **{"prompts.selection": "cycle", "prompts.per_iteration": 33})
    csgs = build_csgs(store, recipe)
    with pytest.raises(ValueError, match=r"per_iteration = 33 exceeds the 32 prompts of .*pool"):
        select_prompts(store, recipe, csgs, 0)
