"""Stage `build_csgs`: the recipe's train prompt set -> one CSG per prompt (`csgs`) and one row per
atom (`atoms`). Run-level (iteration -1): every iteration draws its prompts from these rows.

Cached on the prompt file's content hash and the builder id. The whole file is read and checked
before anything is written, so a malformed line raises PromptFileError (file and line) and leaves
the store untouched; so does a record the builder fails on (its error, with file and line).
"""

from __future__ import annotations

from cast_core.hub_snapshot import file_sha256 as file_hash
from cast_core.shapes.prompts import PromptFileError
from tasks.stages.guard import stage_task
from tasks.stages.models import builder_id, graph_builder
from tasks.stages.prompt_sets import prompt_lines
from tasks.stages.recipe import Recipe
from tasks.store.schemas import prompt_id
from tasks.store.stage import RUN_LEVEL, StageRef, make_key, run_stage
from tasks.store.store import Store

STAGE = "build_csgs"


def cache_key(store: Store, recipe: Recipe) -> str:
    return make_key(STAGE, {"builder": builder_id(recipe)},
                    {"prompts": file_hash(recipe.prompts.train)})


def build_csgs(store: Store, recipe: Recipe) -> StageRef:
    run_id = recipe.run.name

    def body():
        path = recipe.prompts.train
        lines = prompt_lines(recipe, path)
        build, builder = graph_builder(recipe), builder_id(recipe)
        csgs, atoms, seen = [], [], set()
        for line_no, record in lines:
            pid = prompt_id(record["prompt"])
            if pid in seen:
                continue
            seen.add(pid)
            try:
                graph = build(record)
            except (ValueError, RuntimeError) as err:
                raise PromptFileError(f"{path}, line {line_no}: the CSG builder failed: "
                                      f"{err}") from err
            graph_atoms = graph.atoms()
            csgs.append({"run_id": run_id, "prompt_id": pid, "prompt": graph.prompt,
                         "tag": record.get("tag"), "split": "train", "builder": builder,
                         "graph_json": graph.to_json(), "num_atoms": len(graph_atoms)})
            atoms += [{"run_id": run_id, "prompt_id": pid, "atom_id": a.id, "atom_index": i,
                       "type": a.type, "question": a.question, "answer": a.answer,
                       "parents": list(a.parents), "subject": a.subject, "object": a.object,
                       "value": a.value} for i, a in enumerate(graph_atoms)]
        part = f"{run_id}-run"
        return [store.write_table("csgs", csgs, part), store.write_table("atoms", atoms, part)]

    return run_stage(store, run_id, RUN_LEVEL, STAGE, cache_key(store, recipe), body)


build_csgs_task = stage_task(build_csgs, STAGE, cache_key)
