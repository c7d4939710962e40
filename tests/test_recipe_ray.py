"""The executor choice: `run.executor` and the `[ray]` section are typed, checked with messages
that name the fix, printed among the derived quantities, and change no pinned field."""

from pathlib import Path

import pytest

from tasks.stages.recipe import RecipeError, load_recipe

CI = Path(__file__).resolve().parents[1] / "data" / "recipes" / "shapes-ci.toml"


def _error(overrides: dict) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(CI, overrides)
    return str(info.value)


def test_local_is_the_default():
    recipe = load_recipe(CI)
    assert recipe.run.executor == "local"
    assert recipe.derived()["executor"].startswith("local")


def test_ray_section_is_read_and_printed():
    recipe = load_recipe(CI, {"run.executor": "ray", "ray.rollout_workers": 3,
                              "ray.num_cpus": 2, "ray.address": "auto"})
    text = recipe.derived()["executor"]
    assert "the cluster at auto" in text
    assert "3 resident policy actor(s)" in text and "2 CPU" in text
    assert "2 prompt group(s) per rollout shard" in text  # 4 prompts over 3 actors
    assert "local cluster" in load_recipe(CI, {"run.executor": "ray"}).derived()["executor"]


def test_executor_and_ray_fields_are_not_pinned():
    local, ray = load_recipe(CI), load_recipe(CI, {"run.executor": "ray",
                                                   "ray.rollout_workers": 4})
    assert local.pinned_hash() == ray.pinned_hash()


@pytest.mark.parametrize("overrides, words", [
    ({"run.executor": "dask"}, ["run.executor", "'local' or 'ray'"]),
    ({"ray.rollout_workers": 0}, ["ray.rollout_workers", "greater than or equal to 1"]),
    ({"ray.num_cpus": 0}, ["ray.num_cpus", "greater than 0"]),
    ({"ray.workers": 2}, ["ray.workers", "unknown field"]),
    ({"ray.rollout_workers": 1, "ray.train_workers": 2},
     ["train_workers <= rollout_workers"]),
    ({"run.executor": "ray", "ray.train_workers": 2, "backbone.device": "cuda",
      "ray.num_gpus": 0.5}, ["NCCL needs a GPU of its own", "ray.num_gpus = 1"]),
    ({"run.executor": "ray", "backbone.device": "cuda"}, ["ray.num_gpus = 0", "set ray.num_gpus"]),
    ({"run.executor": "ray", "scorer.device": "cuda:0"}, ["ray.scorer_num_gpus = 1"]),
])
def test_bad_ray_settings_name_the_fix(overrides, words):
    message = _error(overrides)
    for word in words:
        assert word in message, message


def test_a_gpu_model_is_fine_locally_or_with_a_gpu_per_actor():
    load_recipe(CI, {"backbone.device": "cuda"})
    load_recipe(CI, {"run.executor": "ray", "backbone.device": "cuda", "ray.num_gpus": 0.5})


def test_data_parallel_training_is_accepted():
    recipe = load_recipe(CI, {"run.executor": "ray", "ray.train_workers": 2})
    assert "the first 2 train" in recipe.derived()["executor"]
    load_recipe(CI, {"run.executor": "ray", "ray.train_workers": 2, "backbone.device": "cuda",
                     "ray.num_gpus": 1})
    load_recipe(CI, {"run.executor": "ray", "ray.train_workers": 2, "train.objective": "nft"})
