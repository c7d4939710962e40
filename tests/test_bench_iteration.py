"""benchmarks/bench_iteration.py's bare arm does exactly the stages' work: same LoRA, bitwise."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_iteration import bare_iteration, stage_iteration, stored_lora

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
