"""Each method learns on a set small enough to overfit: one prompt, the real stages, the committed
base model (issue 17: before comparing methods, show that each learns).

The committed recipes are run as they are, except: one prompt ("a photo of a blue square", 0.67
mean atom score on the base's 32 evaluation images), 16 samples an iteration in one optimizer step
a pass (two passes), lr 3e-3 (the recipes' 1e-3 and 2 steps of 64 samples a pass are sized for a
32-prompt pool; with steps of 8 samples at 3e-3 each step moved the policy 1-4 nats a sample and
the score fell, 0.668 -> 0.583). Both methods must raise the prompt's mean atom
score, on 32 images with noise none of the rollouts used, by at least 0.2 within `ITERATIONS`
iterations. Checked by hand with every advantage's sign flipped in the training stage: Flow-GRPO
then went 0.668 -> 0.106, so the test measures the update's direction, not drift.

Measured (one thread): Flow-GRPO 0.668 -> 0.884 (+0.215). The process is oscillatory at this lr:
the rollouts' mean object score went 0.81, 0.49, 0.48, 0.80, 0.18, ... 0.94, 0.93 while each
iteration moved the policy 1-11 nats a sample and window step (`checkpoints.update_kl_nats`), so
the margin is not robust; CAST (pooled atoms, half the credit through the heatmaps) moved it
0.3-3.6 nats an iteration and reached +0.052, the gap issue 17 keeps open (expected failure).
With the group's other samples' heatmaps and the full map (the recipe since issue 17's fix of
CAST's fall on the pool) it went 0.668 -> 0.648: still an expected failure.

Both outcomes are single draws of a process whose spread over seeds is about +-0.3
(reports/learning-probes, section 2: the same prompt in memory, window [0, 3), G 16, lr 3e-3,
192 samples, seeds 0-2: Flow-GRPO +0.214 / -0.123 / -0.268, CAST's map +0.131 / +0.238 / +0.120),
because a 128-sample policy gradient has no measurable direction there (section 1). So this test
pins the update's direction on one seed (the sign-flip check above); it does not rank the methods.
"""

import json
from pathlib import Path

import pytest

from tasks.stages.recipe import load_recipe
from tasks.store.store import Store

RECIPES = Path(__file__).resolve().parents[1] / "data" / "recipes"
RECORD = {"tag": "colors", "include": [{"class": "square", "count": 1, "color": "blue"}],
          "exclude": [], "prompt": "a photo of a blue square"}
ITERATIONS = 12
GAIN = 0.2


def overfit_recipe(tmp_path: Path, recipe_file: str, extra: dict | None = None):
    """The committed recipe on the one prompt, with the test's overrides and then `extra`."""
    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps(RECORD) + "\n")
    return load_recipe(RECIPES / recipe_file, {
        "run.name": "overfit", "run.threads": 1, "prompts.train": str(prompts),
        "prompts.per_iteration": 1, "prompts.group_size": 16, "prompts.selection": "cycle",
        "window.calibration_prompts": 1, "train.lr": 3e-3, "train.steps_per_epoch": 1,
        # the footing this test was measured on (CFG 4, a constant lr); at the recipes' CFG 1 with
        # KL-targeted steps the prompt starts at 0.17 and, 3 seeds, Flow-GRPO gained +0.008 /
        # -0.085 (0.03 nats an iteration) and +0.24 / +0.10 / +0.05 (0.3 nats), CAST +0.13 /
        # +0.09 / +0.11 (0.3 nats): not a margin of 0.2 (2026-12-06)
        "sampling.guidance_scale": 4.0, "eval.guidance_scale": 4.0, "train.kl_target_nats": None,
        "train.lora_rank": 8, "train.lora_alpha": 8.0,
        "eval.splits": {"one": str(prompts)}, "eval.images_per_prompt": 32,
        "eval.max_prompts": None, "eval.seed_offset": 1000, **(extra or {})})


def mean_score(store: Store, recipe, iteration: int) -> float:
    rows = store.read_table("evals", {"run_id": recipe.run.name, "iteration": iteration,
                                      "group_kind": "overall"}).to_pylist()
    assert len(rows) == 1, rows
    return rows[0]["mean_score"]


def train_and_evaluate(store: Store, recipe, iterations: int) -> tuple[float, float]:
    """(base mean atom score, mean atom score after `iterations` iterations)."""
    from tasks.stages.build_csgs import build_csgs
    from tasks.stages.calibrate_window import calibrate_window
    from tasks.stages.compute_advantages import compute_advantages
    from tasks.stages.evaluate import evaluate_checkpoint
    from tasks.stages.rollout import rollout_groups
    from tasks.stages.score_atoms import score_atoms
    from tasks.stages.train_epoch import train_epoch

    evaluate_checkpoint(store, recipe, -1)
    csgs, window = build_csgs(store, recipe), calibrate_window(store, recipe)
    for k in range(iterations):
        ro = rollout_groups(store, recipe, csgs, window, k)
        sc = score_atoms(store, recipe, csgs, ro, k)
        ad = compute_advantages(store, recipe, ro, sc, k)
        train_epoch(store, recipe, csgs, ro, sc, ad, k)
    evaluate_checkpoint(store, recipe, iterations - 1)
    return mean_score(store, recipe, -1), mean_score(store, recipe, iterations - 1)


CAST_GAP = ("measured on 2026-12-03: 0.668 -> 0.721 (+0.052) with own heatmaps and spatial_mix 0.5; "
            "0.668 -> 0.648 (-0.020) with the recipe's group_others heatmaps and the full map: "
            "CAST does not yet overfit one prompt in 12 iterations (issue 17, open)")


@pytest.mark.slow
@pytest.mark.parametrize("recipe_file", [
    "shapes-flowgrpo.toml",
    pytest.param("shapes-cast.toml", marks=pytest.mark.xfail(reason=CAST_GAP, strict=False)),
])
def test_each_method_overfits_one_prompt(tmp_path, recipe_file):
    recipe = overfit_recipe(tmp_path, recipe_file)
    base, final = train_and_evaluate(Store(tmp_path / "store"), recipe, ITERATIONS)
    assert final - base >= GAIN, f"{recipe_file}: mean atom score {base:.3f} -> {final:.3f}"
