"""Checks a recipe and the paths it names before anything slow starts (issue 19, item 6).

A bad recipe used to cost ~25 s (Prefect's server, torch) and ~70 lines of traceback. Here it costs
under a second and one line per problem, naming the field and the fix: the recipe's own validation
(`tasks.stages.recipe.load_recipe`), then every file and folder the stages will open (prompt
files, model folders or hub ids, the ReCAST positives, the store). Imports stay light (no torch,
no Prefect): the flows' command lines call this first, and `scripts/main.sh` before it starts a
server.

    .venv/bin/python -m flows.preflight --recipe data/recipes/shapes-cast.toml [--store DIR]

prints the run id and exits 0, or prints the problems and exits 2.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path

from cast_core.backbones.source import source_problem
from tasks.stages.recipe import Recipe, RecipeError, load_recipe

# the file that marks a model folder of a family (`cast_core.backbones.shapes.BACKBONE_FILE`,
# repeated here so that this check does not import torch; a test keeps the two equal)
FAMILY_MARKERS = {"shapes": "cast_backbone.json"}


def one_line(error: RecipeError) -> str:
    """A recipe error on one line: 'file: invalid recipe: field: problem; field: problem'."""
    head, *fields = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{head}: {'; '.join(fields)}" if fields else head


def _file_problem(value: str, field: str) -> str | None:
    path = Path(value).expanduser()
    if path.is_file():
        return None
    if path.is_dir():
        return f"{field} = {value!r} is a folder; point {field} at a file"
    parent = path.parent if path.parent.is_dir() else None
    names = [p.name for p in parent.iterdir()] if parent else []
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.6)
    hint = f" (did you mean {os.path.relpath(parent / close[0])}?)" if close else ""
    return f"{field} = {value!r}: no such file {path.absolute()}{hint}; fix {field}"


def _store_problem(store: Path) -> str | None:
    if store.exists():
        return None if store.is_dir() else f"store {store} is a file; pass a folder as the store"
    parent = store.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        return f"store {store} does not exist and {parent} is not writable; choose another store"
    return None


def path_problems(recipe: Recipe, store: Path | None = None) -> list[str]:
    """One line per file or folder the recipe names that a stage could not open."""
    b, s, w = recipe.backbone, recipe.scorer, recipe.window
    problems = [source_problem(b.path, "backbone.path", FAMILY_MARKERS.get(b.family),
                               hub_allowed=b.family not in FAMILY_MARKERS),
                _file_problem(recipe.prompts.train, "prompts.train")]
    if w.mode == "calibrated" and w.calibration_file:
        problems.append(_file_problem(w.calibration_file, "window.calibration_file"))
    if w.embedder_path:
        problems.append(source_problem(w.embedder_path, "window.embedder_path"))
    if s.kind == "soft-tifa" and s.path:
        problems.append(source_problem(s.path, "scorer.path"))
    if recipe.builder.kind == "llm-local" and recipe.builder.model:
        problems.append(source_problem(recipe.builder.model, "builder.model"))
    problems += [_file_problem(path, f"eval.splits.{name}")
                 for name, path in recipe.eval.splits.items()]
    if recipe.recast.positives != "renderer" and not Path(recipe.recast.positives).is_dir():
        problems.append(f"recast.positives = {recipe.recast.positives!r}: no such folder; give "
                        f"a GenEval-layout folder of images or \"renderer\"")
    if store is not None:
        problems.append(_store_problem(store))
    return [p for p in problems if p]


def checked_recipe(path: str | Path, overrides: dict | None = None,
                   store: str | Path | None = None) -> Recipe:
    """The validated recipe whose paths all exist; else RecipeError, one line per problem."""
    try:
        recipe = load_recipe(path, overrides)
    except RecipeError as err:
        raise RecipeError(one_line(err)) from None
    problems = path_problems(recipe, Path(store) if store is not None else None)
    if problems:
        raise RecipeError("\n".join(f"{path}: {p}" for p in problems))
    return recipe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--overrides", default="", help="JSON of dotted recipe fields")
    parser.add_argument("--store", default=None)
    parser.add_argument("--tag", default="cast", help="prefix of error lines, e.g. main")
    args = parser.parse_args(argv)
    try:
        overrides = json.loads(args.overrides) if args.overrides else None
        if overrides is not None and not isinstance(overrides, dict):
            raise RecipeError(f"the overrides must be a JSON object of dotted fields, e.g. "
                              f"'{{\"run.threads\": 1}}'; got {args.overrides!r}")
        recipe = checked_recipe(args.recipe, overrides, args.store)
    except json.JSONDecodeError as err:
        print(f"[{args.tag}] the overrides are not JSON ({err}): {args.overrides!r}",
              file=sys.stderr)
        return 2
    except RecipeError as err:
        print("\n".join(f"[{args.tag}] {line}" for line in str(err).splitlines()), file=sys.stderr)
        return 2
    print(recipe.run.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
