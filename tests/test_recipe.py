"""Recipes: the committed ones load; every kind of bad input raises RecipeError naming the file,
the field and what is allowed; derived quantities and overrides."""

from pathlib import Path

import pydantic
import pytest

from tasks.stages.recipe import RecipeError, load_recipe, parse_recipe

RECIPES = Path(__file__).resolve().parents[1] / "data" / "recipes"
CI = RECIPES / "shapes-ci.toml"


def _variant(tmp_path: Path, old: str, new: str, name: str = "variant.toml") -> Path:
    """A copy of the CI recipe with one exact piece of text replaced."""
    text = CI.read_text()
    assert text.count(old) == 1, f"{old!r} must occur once in {CI}"
    path = tmp_path / name
    path.write_text(text.replace(old, new))
    return path


def _error(path: Path, overrides: dict | None = None) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    return str(info.value)


@pytest.mark.parametrize("name, kind, mode, b, g", [
    ("shapes-cast", "spatial", "calibrated", 8, 16),
    ("shapes-flowgrpo", "scalar", "fixed", 8, 16),
    ("shapes-ci", "spatial", "calibrated", 4, 4),
    ("shapes-recast", "spatial", "calibrated", 8, 16),
])
def test_committed_recipes_load(name, kind, mode, b, g):
    recipe = load_recipe(RECIPES / f"{name}.toml")
    assert recipe.run.name == name
    assert (recipe.advantage.kind, recipe.window.mode) == (kind, mode)
    assert (recipe.prompts.per_iteration, recipe.prompts.group_size) == (b, g)
    assert recipe.window.size <= recipe.sampling.num_steps
    assert Path(recipe.backbone.path).parts[-1] == "shapes-base"
    assert load_recipe(RECIPES / f"{name}.toml").content_hash() == recipe.content_hash()


def test_the_shapes_recipes_train_on_the_benchmarks_footing():
    """What learnt on the benchmark (reports/cfg1-pool8-40it-kl003, -rank32): CFG-free rollouts
    and evaluations, each iteration moving the policy 0.03 nats from lr 1e-3, 8 prompts x 16
    samples, a LoRA of rank 32; the three shapes recipes share every section but the method's
    own."""
    recipes = {n: load_recipe(RECIPES / f"shapes-{n}.toml") for n in ("cast", "flowgrpo",
                                                                      "recast")}
    for r in recipes.values():
        assert r.sampling.guidance_scale == r.eval.guidance_scale == 1.0
        assert (r.train.lr, r.train.kl_target_nats) == (1e-3, 0.03)
        assert (r.train.lora_rank, r.train.lora_alpha) == (32, 32.0)
        assert r.derived()["samples_per_iteration"] == 128
    cast, recast = (recipes[n].model_dump() for n in ("cast", "recast"))
    assert [k for k in cast if cast[k] != recast[k]] == ["run", "recast"]
    assert {k: v for k, v in cast["run"].items() if v != recast["run"][k]} == {
        "name": "shapes-cast"}


def test_committed_recipes_differ_and_are_frozen():
    recipes = [load_recipe(p) for p in sorted(RECIPES.glob("*.toml"))]
    assert len(recipes) == 7
    assert len({r.content_hash() for r in recipes}) == 7
    with pytest.raises(pydantic.ValidationError):
        recipes[0].prompts.group_size = 3


def test_wrong_value_names_field_and_allowed_values(tmp_path):
    path = _variant(tmp_path, 'kind = "spatial"', 'kind = "spacial"')
    message = _error(path)
    assert str(path) in message
    assert "advantage.kind" in message
    assert "'spatial'" in message and "'scalar'" in message
    assert "'spacial'" in message


def test_missing_field_is_named(tmp_path):
    path = _variant(tmp_path, "group_size = 4\n", "")
    message = _error(path)
    assert str(path) in message
    assert "prompts.group_size" in message and "missing" in message


def test_unknown_field_is_named(tmp_path):
    path = _variant(tmp_path, "kl_beta = 0.0\n", "kl_beta = 0.0\nlr_decay = 0.5\n")
    message = _error(path)
    assert "train.lr_decay" in message and "unknown field" in message


def test_unknown_section_is_named(tmp_path):
    path = _variant(tmp_path, "[scorer]", "[extras]\nx = 1\n\n[scorer]")
    assert "extras: unknown field" in _error(path)


def test_every_bad_field_is_listed(tmp_path):
    path = _variant(tmp_path, "group_size = 4\n", "group_size = 1\n")
    message = _error(path, {"sampling.sde_kind": "ode", "train.lr": -1.0})
    for field in ("prompts.group_size", "sampling.sde_kind", "train.lr"):
        assert field in message
    assert "'flow_sde'" in message and "'cps'" in message


def test_window_larger_than_the_schedule(tmp_path):
    message = _error(CI, {"window.size": 10})
    assert "window.size (10) exceeds sampling.num_steps (6)" in message
    assert "at most 6 steps" in message


def test_fixed_window_past_the_end():
    message = _error(CI, {"window.mode": "fixed", "window.start": 4, "window.size": 3})
    assert "does not fit in sampling.num_steps=6" in message
    assert "window.start" in message
    ok = load_recipe(CI, {"window.mode": "fixed", "window.start": 3, "window.size": 3})
    assert (ok.window.start, ok.window.size) == (3, 3)


def test_not_valid_toml_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('[run]\nname = "x"\n[prompts\nper_iteration = 4\n')
    message = _error(path)
    assert str(path) in message and "not valid TOML" in message


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "nope.toml"
    message = _error(path)
    assert str(path) in message and "no such recipe file" in message


def test_derived_values():
    cast = load_recipe(RECIPES / "shapes-cast.toml").derived()
    b, g, micro = 16, 8, 16
    assert cast["samples_per_iteration"] == b * g
    assert cast["optimizer_steps_per_iteration"] == 4  # steps_per_epoch 2 x inner_epochs 2
    assert cast["samples_per_optimizer_step"] == b * g // 2
    assert cast["micro_batches_per_optimizer_step"] == b * g // 2 // micro
    assert cast["lr_warmup"] == "linear over the run's first 4 optimizer steps"
    assert cast["lora_scale"] == 8.0 / 8
    assert cast["run_id"] == "shapes-cast"
    assert cast["algorithm"].startswith("CAST")
    assert cast["window"].startswith("calibrated: 3 steps")
    grpo = load_recipe(RECIPES / "shapes-flowgrpo.toml")
    derived = grpo.derived()
    assert derived["algorithm"] == "Flow-GRPO (scalar mean reward)"
    assert derived["window"] == "fixed: steps [0, 3)"
    assert derived["recipe_hash"] == grpo.content_hash()[:16]


def test_derived_optimizer_steps_samples_and_micro_batches():
    recipe = load_recipe(CI, {"train.micro_batch": 2, "train.inner_epochs": 3,
                              "train.steps_per_epoch": 3, "train.warmup_steps": 5,
                              "train.lora_alpha": 4.0})
    derived = recipe.derived()
    assert derived["samples_per_iteration"] == 16
    assert derived["optimizer_steps_per_iteration"] == 3 * 3
    assert derived["samples_per_optimizer_step"] == "5 or 6"  # 16 split into 6 + 5 + 5
    assert derived["micro_batches_per_optimizer_step"] == 3  # ceil(6 / 2)
    assert derived["lr_warmup"].startswith("linear over the run's first 5 optimizer steps")
    assert derived["lora_scale"] == 4.0 / 8
    even = load_recipe(CI, {"train.steps_per_epoch": 4}).derived()
    assert even["samples_per_optimizer_step"] == 4 and even["micro_batches_per_optimizer_step"] == 1


def test_train_step_fields_are_checked():
    assert load_recipe(CI).train.steps_per_epoch == 1 and load_recipe(CI).train.warmup_steps == 0
    for field, value in (("steps_per_epoch", 0), ("warmup_steps", -1)):
        with pytest.raises(RecipeError, match=f"train.{field}"):
            load_recipe(CI, {f"train.{field}": value})
    with pytest.raises(RecipeError, match=r"steps_per_epoch \(17\) exceeds the 16 samples"):
        load_recipe(CI, {"train.steps_per_epoch": 17})


def test_kl_targeted_lr_fields_are_checked_and_printed():
    base = load_recipe(CI)
    assert base.train.kl_target_nats is None
    assert base.derived()["lr_schedule"] == f"constant {base.train.lr:g}"
    recipe = load_recipe(CI, {"train.kl_target_nats": 0.03, "train.kl_lr_floor": 0.5,
                              "train.kl_lr_ceiling": 4.0})
    lr = recipe.train.lr
    assert recipe.derived()["lr_schedule"] == (
        f"KL-targeted: {lr:g} at iteration 0, then x sqrt(0.03 nats / the last update's KL) "
        f"within x[1/2, 2] an iteration and [{0.5 * lr:g}, {4 * lr:g}]")
    # a new field left at its default keeps every cached stage's key; set, it changes the train key
    assert recipe.section_hash("train") != base.section_hash("train")
    assert "train.kl_target_nats" in _error(CI, {"train.kl_target_nats": 0.0})
    assert "train.kl_lr_factor" in _error(CI, {"train.kl_lr_factor": 1.0})
    assert "train.kl_lr_floor" in _error(CI, {"train.kl_lr_floor": 2.0})
    assert "train.kl_lr_ceiling" in _error(CI, {"train.kl_lr_ceiling": 0.5})
    nft = {"train.objective": "nft", "sampling.noise_level": 0.0, "sampling.shared_noise": False,
           "window.mode": "fixed"}
    assert "needs the SDE's likelihoods" in _error(CI, {**nft, "train.kl_target_nats": 0.03})
    per_step = load_recipe(CI, {"train.kl_target_nats": 0.03, "train.kl_target_per_step": True})
    assert per_step.derived()["lr_schedule"].endswith(
        "each window step's loss weighted towards the same KL (floor 0.05)")
    assert per_step.section_hash("train") != load_recipe(
        CI, {"train.kl_target_nats": 0.03}).section_hash("train")
    assert "needs train.kl_target_nats" in _error(CI, {"train.kl_target_per_step": True})
    assert "train.kl_step_weight_floor" in _error(CI, {"train.kl_step_weight_floor": 0.0})
    velocity = load_recipe(CI, {"train.velocity_target": 0.02})
    assert velocity.derived()["lr_schedule"] == (
        f"velocity-targeted: {lr:g} at iteration 0, then x 0.02 / the last update's velocity "
        f"change (RMS per latent dim) within x[1/2, 2] an iteration and [{0.1 * lr:g}, "
        f"{10 * lr:g}]")
    assert velocity.section_hash("train") != base.section_hash("train")
    assert "keep one" in _error(CI, {"train.velocity_target": 0.02,
                                     "train.kl_target_nats": 0.03})
    assert "ODE rollouts" in _error(CI, {**nft, "train.velocity_target": 0.02})
    assert "train.velocity_target" in _error(CI, {"train.velocity_target": 0.0})
    decayed = load_recipe(CI, {"train.kl_target_nats": 0.03, "train.lr_halflife": 20})
    assert decayed.derived()["lr_schedule"].endswith(
        "; the lr aimed at halves every 20 iterations (target and bounds with it)")
    assert load_recipe(CI, {"train.lr_halflife": 20}).derived()["lr_schedule"] == (
        f"constant {lr:g}; the lr aimed at halves every 20 iterations (target and bounds with it)")
    assert decayed.section_hash("train") != load_recipe(
        CI, {"train.kl_target_nats": 0.03}).section_hash("train")
    assert "train.lr_halflife" in _error(CI, {"train.lr_halflife": 0})


def test_overrides_apply_before_validation():
    base = load_recipe(CI)
    recipe = load_recipe(CI, {"run.threads": 1, "prompts.per_iteration": 2,
                              "advantage.kind": "scalar", "run.name": "ci-small"})
    assert (recipe.run.threads, recipe.prompts.per_iteration) == (1, 2)
    assert recipe.advantage.kind == "scalar" and recipe.run.name == "ci-small"
    assert recipe.prompts.group_size == base.prompts.group_size
    assert recipe.content_hash() != base.content_hash()
    assert recipe.section_hash("train") == base.section_hash("train")
    assert recipe.section_hash("advantage") != base.section_hash("advantage")
    assert recipe.derived()["samples_per_iteration"] == 2 * 4


def test_bad_overrides_are_named():
    assert "advantage.kind" in _error(CI, {"advantage.kind": "spacial"})
    assert "train.bogus: unknown field" in _error(CI, {"train.bogus": 1})
    assert "'name' is not a section" in _error(CI, {"run.name.first": "x"})
    assert "window.size" in _error(CI, {"window.size": 0})


def test_parse_recipe_names_its_source():
    with pytest.raises(RecipeError) as info:
        parse_recipe({"run": {"name": "x"}}, "inline-recipe")
    message = str(info.value)
    assert message.startswith("inline-recipe: invalid recipe")
    for section in ("backbone", "scorer", "prompts", "sampling", "window", "train"):
        assert f"{section}: missing" in message


def test_command_line_overrides_are_json_values_with_clear_errors():
    from tasks.stages.recipe import parse_overrides

    assert parse_overrides(["prompts.per_iteration=4", 'run.name="x"', "train.lr=1e-4"]) == {
        "prompts.per_iteration": 4, "run.name": "x", "train.lr": 1e-4}
    with pytest.raises(RecipeError, match="FIELD=VALUE"):
        parse_overrides(["prompts.per_iteration"])
    with pytest.raises(RecipeError, match="not JSON"):
        parse_overrides(["run.name=x y"])


@pytest.mark.parametrize("name, family, steps", [
    ("flux2-klein-cast", "flux2", 10),
    ("flux2-dev-cast", "flux2", 6),
    ("qwen-image-2512-cast", "qwen_image", 10),
])
def test_real_model_recipes_load(name, family, steps):
    recipe = load_recipe(RECIPES / f"{name}.toml")
    assert (recipe.run.name, recipe.backbone.family, recipe.sampling.num_steps) == (
        name, family, steps)
    assert recipe.backbone.dtype == "bfloat16" and recipe.backbone.device == "cuda"
    assert (recipe.backbone.height, recipe.backbone.width) == (512, 512)
    assert recipe.scorer.kind == "soft-tifa" and recipe.window.embedder == "clip"
    assert recipe.advantage.kind == "spatial" and recipe.window.mode == "calibrated"


@pytest.mark.parametrize("overrides, field, hint", [
    ({"backbone.family": "flux2"}, "backbone", "backbone.height and backbone.width"),
    ({"backbone.height": 512}, "backbone", "takes its size and dtype from its folder"),
    ({"scorer.kind": "soft-tifa"}, "scorer", "scorer.path"),
    ({"scorer.kind": "remote"}, "scorer", "scorer.url"),
    ({"builder.kind": "llm-chat"}, "builder", "builder.base_url and builder.model"),
    ({"builder.kind": "llm-local"}, "builder", "builder.model"),
    ({"window.embedder": "dino"}, "window.embedder", "'clip'"),
])
def test_real_model_fields_say_what_is_missing(overrides, field, hint):
    message = _error(CI, overrides)
    assert field in message and hint in message


def test_real_model_fields_accepted_when_complete():
    recipe = load_recipe(CI, {"backbone.family": "qwen_image", "backbone.height": 256,
                              "backbone.width": 384, "backbone.dtype": "bfloat16",
                              "scorer.kind": "remote", "scorer.url": "http://127.0.0.1:8765",
                              "builder.kind": "llm-chat", "builder.base_url": "http://x/v1",
                              "builder.model": "qwen", "window.embedder": "clip"})
    assert recipe.backbone.width == 384 and recipe.scorer.url.endswith("8765")
    assert recipe.builder.max_tries == 3 and recipe.builder.cache_dir == "runs/cache/csg_llm"


def test_a_later_field_at_its_default_leaves_the_stage_keys_unchanged():
    """Fields added after stores existed (`hash_if_set`) enter `section_hash` only when set, so
    cached stages stay valid; set away from the default, they change the key."""
    import hashlib
    import json

    defaults = {"advantage.atom_norm": "atom", "advantage.spatial_mix": 1.0,
                "advantage.heatmap_source": "own"}
    recipe = load_recipe(RECIPES / "shapes-cast.toml", defaults)
    dump = recipe.model_dump(mode="json")["advantage"]
    assert dump["heatmap_norm"] == "mass"
    for field in type(recipe.advantage).hash_if_set:  # heatmap_norm and the later ones
        dump.pop(field)
    before = hashlib.sha256(json.dumps({"advantage": dump}, sort_keys=True,
                                       separators=(",", ":")).encode()).hexdigest()
    assert recipe.section_hash("advantage") == before
    peak = load_recipe(RECIPES / "shapes-cast.toml", {**defaults, "advantage.heatmap_norm": "peak"})
    assert peak.section_hash("advantage") != before


def test_map_inside_the_sample_ratio_needs_the_all_dims_clip_range():
    cast = load_recipe(RECIPES / "shapes-cast.toml")
    assert (cast.train.map_ratio, cast.train.clip_range) == ("sample", 1e-3)
    position = load_recipe(RECIPES / "shapes-cast.toml",
                           {"train.map_ratio": "position", "train.clip_range": 0.032})
    assert position.train.map_ratio == "position"
    with pytest.raises(RecipeError, match="never clip"):
        load_recipe(RECIPES / "shapes-cast.toml", {"train.clip_range": 0.032})


def test_scalar_steps_split_the_window_and_are_checked():
    split = load_recipe(CI, {"window.mode": "fixed", "window.start": 0, "window.size": 4,
                             "advantage.scalar_steps": 2})
    assert split.derived()["algorithm"] == ("Flow-GRPO's scalar mean reward on the window's "
                                            "first 2 step(s), CAST's atom maps on the other 2")
    assert load_recipe(CI).advantage.scalar_steps == 0  # unset: not in older runs' pins
    assert "scalar_steps" not in load_recipe(CI).pinned()["advantage"]
    assert split.pinned()["advantage"]["scalar_steps"] == 2
    for overrides, match in (
            ({"advantage.scalar_steps": 5}, r"scalar_steps \(5\) exceeds window.size \(3\)"),
            ({"advantage.scalar_steps": 1, "advantage.kind": "scalar"}, "has no map"),
            ({"advantage.scalar_steps": 1, "recast.weighting": "static"}, "not implemented"),
            ({"advantage.scalar_steps": -1}, "advantage.scalar_steps")):
        with pytest.raises(RecipeError, match=match):
            load_recipe(CI, overrides)
