"""benchmarks/bench_iteration.py's arms do the same work: the bare arm ends on the stages' LoRA,
bitwise, and the executor arms' Ray iterations write the local executor's outputs."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_iteration import bare_iteration, line, stage_iteration, stored_lora
from ray_arm import executor_arms, executor_lines, executor_recipes

from tasks.stages.build_csgs import build_csgs
from tasks.stages.calibrate_window import calibrate_window, read_window
from tasks.stages.recipe import load_recipe
from tasks.stages.rollout import select_prompts
from tasks.store.store import Store


@pytest.mark.parametrize("recipe_name", ["shapes-cast", "shapes-flowgrpo"])
def test_bare_arm_ends_on_the_stages_lora(tmp_path, recipe_name):
    recipe = load_recipe(ROOT / "data" / "recipes" / f"{recipe_name}.toml",
                         {"prompts.per_iteration": 2, "prompts.group_size": 4, "run.threads": 1,
                          "window.calibration_prompts": 2, "train.micro_batch": 4})
    template = Store(tmp_path / "template")
    csgs, window = build_csgs(template, recipe), calibrate_window(template, recipe)
    picks = select_prompts(template, recipe, csgs, 0)
    stage_iteration(recipe, tmp_path / "stages")
    _, lora = bare_iteration(recipe, picks, read_window(template, window))
    stored = stored_lora(tmp_path / "stages", recipe.run.name)
    assert stored.keys() == lora.keys()
    assert max(float((stored[n] - t).abs().max()) for n, t in lora.items()) == 0.0
    assert max(float(t.abs().max()) for t in lora.values()) > 0  # the update moved the LoRA


TINY = {"prompts.per_iteration": 2, "prompts.group_size": 4, "run.threads": 1,
        "window.calibration_prompts": 2, "train.micro_batch": 4}
CI = str(ROOT / "data" / "recipes" / "shapes-ci.toml")


def test_executor_arms_run_the_same_pinned_recipe():
    recipes = executor_recipes(CI, {**TINY, "ray.scorer_workers": 2})
    assert (recipes["local"].run.executor, recipes["ray"].run.executor) == ("local", "ray")
    assert recipes["local"].pinned_hash() == recipes["ray"].pinned_hash()
    assert recipes["ray"].ray.scorer_workers == 2  # --set wins over the arm's defaults


@pytest.mark.slow
def test_ray_arm_writes_the_local_arms_outputs(tmp_path):
    """One repeat of each executor on a local cluster: the same stage outputs (content hashes
    and checkpoint row), the policy actor loaded the backbone once over both Ray iterations, and
    the report lines."""
    pytest.importorskip("ray")
    recipe = executor_recipes(CI, TINY)["local"]
    template = Store(tmp_path / "template")
    build_csgs(template, recipe), calibrate_window(template, recipe)
    arms = executor_arms(CI, TINY, 1, template.root, tmp_path)
    assert arms["same_outputs"] is True
    assert arms["backbone_loads"] == [1] and arms["scorer_loads"] == [1]
    assert len(arms["local"]) == len(arms["ray"]) == 1 and min(arms["ray"]) > 0
    text = "\n".join(executor_lines(arms, line))
    assert "ray / local = " in text
    assert "same outputs, local vs ray (stage hashes, checkpoint): True" in text
