"""Invalid values and invalid output are refused, never recorded (issue 19, items 1 and 5): every
float field of a recipe must be finite; training that leaves non-finite weights saves nothing and
says why; an empty prompt file is refused at the loader; no stage records empty output."""

import json
import shutil
import typing

import pyarrow.parquet as pq
import pytest
from pipeline_helpers import CI_RECIPE, reference, run_iteration, write_small_prompts

from cast_core.shapes.prompts import PromptFileError
from tasks.stages.build_csgs import build_csgs
from tasks.stages.prompt_sets import load_prompts
from tasks.stages.recipe import Recipe, RecipeError, load_recipe
from tasks.stages.train_update import NonFiniteWeights
from tasks.store.stage import StageRefused, run_stage
from tasks.store.store import Store


def _float_fields() -> list[str]:
    """Every `section.field` of the recipe whose type is a float (or an optional float)."""
    out = []
    for name, field in Recipe.model_fields.items():
        for sub, f in field.annotation.model_fields.items():
            if float in (f.annotation, *typing.get_args(f.annotation)):
                out.append(f"{name}.{sub}")
    return out


def test_the_float_fields_are_found():
    fields = _float_fields()
    assert {"train.lr", "sampling.noise_level", "advantage.clip", "recast.tau"} <= set(fields)
    assert len(fields) >= 15


@pytest.mark.parametrize("field", _float_fields())
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")],
                         ids=["inf", "-inf", "nan"])
def test_every_float_field_must_be_finite(field, value):
    with pytest.raises(RecipeError, match=rf"{field}: must be a finite number") as info:
        load_recipe(CI_RECIPE, {field: value})
    assert "inf and nan are not allowed" in str(info.value)


def test_a_json_infinity_override_is_refused_too():
    from tasks.stages.recipe import parse_overrides

    with pytest.raises(RecipeError, match="train.lr: must be a finite number"):
        load_recipe(CI_RECIPE, parse_overrides(["train.lr=Infinity"]))


def _with_lr(recipe: Recipe, lr: float) -> Recipe:
    """The recipe with another lr, bypassing validation (as a recipe from before this check)."""
    return recipe.model_copy(update={"train": recipe.train.model_copy(update={"lr": lr})})


def test_training_to_non_finite_weights_saves_nothing_and_says_why(tmp_path_factory, tmp_path):
    ref_store, recipe, _, _ = reference(tmp_path_factory)
    store = Store(shutil.copytree(ref_store.root, tmp_path / "store"))
    checkpoint_0 = store.root / "tables" / "checkpoints" / f"{recipe.run.name}-00000.parquet"
    before = checkpoint_0.read_bytes()
    blobs_before = set((store.root / "blobs").rglob("*.safetensors"))
    bad = _with_lr(recipe, float("inf"))
    with pytest.raises(NonFiniteWeights, match=r"iteration 1: .*nothing was saved and the policy "
                                                r"stays at the checkpoint of iteration 0") as info:
        run_iteration(store, bad, 1)
    assert "Lower train.lr (now inf)" in str(info.value)
    # The previous checkpoint stays the run's latest; no row, blob or completion for iteration 1.
    assert checkpoint_0.read_bytes() == before
    assert store.read_table("checkpoints")["iteration"].to_pylist() == [0]
    assert store.read_table("train_steps", {"iteration": 1}).num_rows == 0
    assert store.last_finished_iteration(recipe.run.name, "train_epoch") == 0
    stages = store.read_table("stages", {"iteration": 1})["stage"].to_pylist()
    assert "train_epoch" not in stages and "rollout" in stages
    new_blobs = set((store.root / "blobs").rglob("*.safetensors")) - blobs_before
    assert len(new_blobs) == 3  # the rollout's images and window steps, the advantage maps
    # Why, with the figures.
    (failure,) = store.read_table("stage_failures").to_pylist()
    assert (failure["run_id"], failure["iteration"], failure["stage"]) == (
        recipe.run.name, 1, "train_epoch")
    assert failure["reason"] == str(info.value)
    details = json.loads(failure["details_json"])
    assert details["lrs"] and all(lr == float("inf") for lr in details["lrs"])
    assert details["tensors"] and len(details["losses"]) == recipe.train.steps_per_epoch


@pytest.mark.parametrize("text", ["", "\n\n  \n"], ids=["empty", "blank-lines"])
def test_an_empty_prompt_file_is_refused_naming_it(tmp_path, text):
    empty = tmp_path / "prompts.jsonl"
    empty.write_text(text)
    for overrides in ({}, {"backbone.family": "flux2", "backbone.height": 64,
                           "backbone.width": 64}):
        recipe = load_recipe(CI_RECIPE, {"prompts.train": str(empty), **overrides})
        with pytest.raises(PromptFileError, match=rf"{empty}"):
            load_prompts(recipe, empty)
    if text == "":
        recipe = load_recipe(CI_RECIPE, {"prompts.train": str(empty)})
        store = Store(tmp_path / "store")
        with pytest.raises(PromptFileError, match=rf"{empty}: no prompts"):
            build_csgs(store, recipe)
        assert store.read_table("stages").num_rows == 0 and store.parts("csgs") == []


def test_no_stage_records_completion_for_an_empty_table_part(tmp_path):
    store = Store(tmp_path)
    prompts = write_small_prompts(tmp_path / "p.jsonl")
    recipe = load_recipe(CI_RECIPE, {"prompts.train": str(prompts)})

    def body():
        return [store.write_table("csgs", [], part="r-run"), store.put_blob(b"x", "bin")]

    with pytest.raises(StageRefused, match=r"stage 'build_csgs' .*wrote no rows to "
                                           r"\['tables/csgs/r-run.parquet'\]"):
        run_stage(store, recipe.run.name, -1, "build_csgs", "key", body)
    assert store.stage_done(recipe.run.name, -1, "build_csgs", "key") is None
    assert store.read_table("stages").num_rows == 0
    (failure,) = pq.read_table(store.parts("stage_failures")[0]).to_pylist()
    assert failure["stage"] == "build_csgs" and "no rows" in failure["reason"]
    assert json.loads(failure["details_json"]) == {"empty_parts": ["tables/csgs/r-run.parquet"]}
