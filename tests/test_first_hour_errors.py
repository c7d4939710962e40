"""Issue 19, items 6 and 7: a bad recipe or a missing model folder fails fast, in one line that names
the field and the fix, before torch or Prefect is imported; a missing folder is reported as a
missing folder, not as Hugging Face's repo-id error."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from cast_core.backbones.source import ModelSourceError, could_be_hub_id, source_problem
from flows.preflight import FAMILY_MARKERS, checked_recipe, path_problems
from tasks.stages.recipe import RecipeError, load_recipe

REPO = Path(__file__).resolve().parent.parent
CI_RECIPE = REPO / "data/recipes/shapes-ci.toml"

# runs `python -m flows.cast ARGS` in this interpreter and reports which heavy modules it imported
RUN_AND_REPORT = """
import runpy, sys
sys.argv = ["flows.cast", *sys.argv[1:]]
try:
    runpy.run_module("flows.cast", run_name="__main__")
except SystemExit as done:
    code = done.code
heavy = sorted(m for m in ("torch", "prefect", "diffusers") if m in sys.modules)
print(f"exit={code} heavy={heavy}")
"""


def bad_recipe(tmp_path: Path, old: str, new: str) -> Path:
    text = CI_RECIPE.read_text()
    assert old in text
    path = tmp_path / "bad.toml"
    path.write_text(text.replace(old, new))
    return path


def run_cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", RUN_AND_REPORT, *args], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - started


@pytest.mark.parametrize(("old", "new", "field"), [
    ("per_iteration = 4", "per_iteration = 0", "prompts.per_iteration"),
    ('path = "data/base/shapes-base"', 'path = "data/base/shapes-basee"', "backbone.path"),
    ('train = "data/prompts/train.jsonl"', 'train = "data/prompts/trian.jsonl"', "prompts.train"),
])
def test_a_bad_recipe_fails_in_one_line_before_the_slow_imports(tmp_path, old, new, field):
    done, seconds = run_cli("--recipe", str(bad_recipe(tmp_path, old, new)),
                            "--store", str(tmp_path / "store"))
    assert done.stdout.strip() == "exit=2 heavy=[]", done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert field in lines[0] and "bad.toml" in lines[0]
    assert seconds < 10, f"{seconds:.1f} s (measured ~0.4 s; the issue asks for ~3 s)"


def test_errors_say_the_fix(tmp_path):
    with pytest.raises(RecipeError) as caught:
        checked_recipe(bad_recipe(tmp_path, 'path = "data/base/shapes-base"',
                                  'path = "data/base/shapes-basee"'))
    assert "did you mean data/base/shapes-base?" in str(caught.value)
    with pytest.raises(RecipeError) as caught:
        checked_recipe(bad_recipe(tmp_path, 'train = "data/prompts/train.jsonl"',
                                  'train = "data/prompts/trian.jsonl"'))
    assert "did you mean data/prompts/train.jsonl?" in str(caught.value)
    with pytest.raises(RecipeError, match="is a file; pass a folder as the store"):
        checked_recipe(CI_RECIPE, store=CI_RECIPE)
    with pytest.raises(RecipeError, match="per_iteration.*greater than or equal to 1"):
        checked_recipe(CI_RECIPE, {"prompts.per_iteration": 0})


def test_the_committed_recipes_pass_the_checks(monkeypatch):
    monkeypatch.chdir(REPO)
    for name in ("shapes-ci", "shapes-cast", "shapes-flowgrpo", "shapes-recast"):
        assert path_problems(load_recipe(REPO / f"data/recipes/{name}.toml")) == []


def test_the_shapes_marker_is_the_backbones_own():
    from cast_core.backbones.shapes import BACKBONE_FILE

    assert FAMILY_MARKERS["shapes"] == BACKBONE_FILE


def test_a_missing_folder_is_named_as_a_folder_and_hub_ids_are_told_apart(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "base").mkdir(parents=True)
    missing = source_problem("models/bsae", "backbone.path")
    assert "no such folder" in missing and "did you mean models/base?" in missing
    assert "a local folder models/ exists, so it reads as a path" in missing
    deep = source_problem("models/base/x/y", "backbone.path")
    assert "no such folder" in deep and "not a Hugging Face hub id either" in deep
    assert could_be_hub_id("black-forest-labs/FLUX.2-klein-4B") and could_be_hub_id("gpt2")
    assert not could_be_hub_id("./models/base") and not could_be_hub_id("/abs/x")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert source_problem("org-x/model-y", "backbone.path") is None  # the hub decides
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    offline = source_problem("org-x/model-y", "backbone.path")
    assert "not in the local cache while HF_HUB_OFFLINE=1" in offline
    snapshot = tmp_path / "hub" / "models--org-x--model-y" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    assert source_problem("org-x/model-y", "backbone.path") is None


def test_loaders_raise_the_folder_error_not_the_hub_error(tmp_path, monkeypatch):
    from cast_core.backbones.flux2 import Flux2Backbone
    from cast_core.backbones.qwen_image import QwenImageBackbone
    from cast_core.backbones.shapes import ShapesBackbone

    monkeypatch.chdir(REPO)
    with pytest.raises(ModelSourceError, match="did you mean data/base/shapes-base"):
        ShapesBackbone.from_pretrained("data/base/shapes-basee")
    with pytest.raises(ModelSourceError, match="has no cast_backbone.json"):
        ShapesBackbone.from_pretrained("data/base")
    for loader in (Flux2Backbone, QwenImageBackbone):
        with pytest.raises(ModelSourceError, match="no such folder") as caught:
            loader.from_pretrained("data/base/flux-missing")
        assert "Repo id" not in str(caught.value)


def test_base_eval_names_a_missing_checkpoint_folder(monkeypatch):
    from flows.base_eval import main

    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit, match="did you mean data/base/shapes-base"):
        main(["--checkpoint", "data/base/shapes-bas", "--splits", "eval"])
