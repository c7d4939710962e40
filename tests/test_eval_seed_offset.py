"""`eval.seed_offset` (tasks/stages/recipe_sections.py EvalSection, tasks/stages/evaluate.py): image i of a
prompt is seeded by (prompt, seed_offset + i); the offset enters the eval spec only when set; two
evaluations of one checkpoint under different splits keep both `evals` parts and grids."""

import hashlib
import io
import json
from pathlib import Path

import numpy as np
from PIL import Image
from pipeline_helpers import ci_recipe

from tasks.stages.evaluate import (
    content_seed,
    eval_outputs,
    eval_seeds,
    eval_spec_hash,
    evaluate_checkpoint,
    read_image_scores,
)
from tasks.store.store import Store

PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts"


def test_image_i_is_seeded_by_offset_plus_i():
    assert eval_seeds(["a", "b"], 2) == [content_seed("a", 0), content_seed("a", 1),
                                          content_seed("b", 0), content_seed("b", 1)]
    assert eval_seeds(["a", "b"], 2, 1000) == [content_seed("a", 1000), content_seed("a", 1001),
                                                content_seed("b", 1000), content_seed("b", 1001)]
    assert eval_seeds(["a"], 3, 1)[:2] == eval_seeds(["a"], 3)[1:]


def test_seed_offset_enters_the_eval_spec_only_when_set():
    recipe = ci_recipe(PROMPTS / "pool.jsonl")
    dump = recipe.model_dump(mode="json")
    assert dump["eval"].pop("seed_offset") == 0
    assert dump["builder"].pop("allow_metadata_only") is False  # also hashed only when set
    before = hashlib.sha256(json.dumps({k: dump[k] for k in ("eval", "scorer", "builder")},
                                       sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert recipe.section_hash("eval", "scorer", "builder") == before
    moved = ci_recipe(PROMPTS / "pool.jsonl", **{"eval.seed_offset": 1000})
    assert moved.section_hash("eval", "scorer", "builder") != before
    assert eval_spec_hash(moved) != eval_spec_hash(recipe)


def _grid_image(store: Store, path: str, column: int, size: int = 32) -> np.ndarray:
    """Image `column` of a grid's first row (contact_sheet: 1-px gaps, scaled 2x)."""
    sheet = np.asarray(Image.open(io.BytesIO(store.resolve(path).read_bytes())))
    left = 2 * column * (size + 1)
    return sheet[:2 * size, left:left + 2 * size]


def test_an_offset_evaluation_reuses_the_noise_of_the_matching_index(tmp_path):
    prompt_file = tmp_path / "one.jsonl"
    prompt_file.write_text((PROMPTS / "pool.jsonl").read_text().splitlines()[0] + "\n")
    store = Store(tmp_path / "store")
    first = ci_recipe(prompt_file, **{"eval.splits": {"a": str(prompt_file)},
                                      "eval.images_per_prompt": 2})
    second = ci_recipe(prompt_file, **{"eval.splits": {"b": str(prompt_file)},
                                       "eval.images_per_prompt": 1, "eval.seed_offset": 1})
    evaluate_checkpoint(store, first, -1)
    evaluate_checkpoint(store, second, -1)
    out_a, out_b = eval_outputs(store, first, -1), eval_outputs(store, second, -1)
    a, b = out_a.grids["a"], out_b.grids["b"]
    assert np.array_equal(_grid_image(store, a, 1), _grid_image(store, b, 0))  # index 1 in both
    assert not np.array_equal(_grid_image(store, a, 0), _grid_image(store, b, 0))
    scores_a, scores_b = read_image_scores(store, out_a)["a"], read_image_scores(store, out_b)["b"]
    assert scores_a["scores"][1] == scores_b["scores"][0]  # the same image, scored alike
    assert (scores_a["seed_offset"], scores_b["seed_offset"]) == (0, 1)
    assert scores_a["prompts"] == scores_b["prompts"] and len(scores_a["scores"]) == 2
    rows = store.read_table("evals", {"run_id": first.run.name, "group_kind": "overall"})
    assert sorted(rows.column("split").to_pylist()) == ["a", "b"]  # both parts kept
    assert evaluate_checkpoint(store, first, -1).skipped  # the first is still cached
