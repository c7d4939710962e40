"""Stage `build_csgs`: the recipe's train prompt set -> one CSG per prompt (`csgs`) and one row per
atom (`atoms`). Run-level (iteration -1): every iteration draws its prompts from these rows.

Cached on the prompt file's content hash and the builder id. The whole file is read and checked
before anything is written, so a malformed line raises PromptFileError (file and line) and leaves
the store untouched; so does a record the builder fails on (its error, with file and line).

Where the graphs are built: in the flow's process, except a local LLM builder
(`builder.kind = "llm-local"`) under the Ray executor, which builds on the first policy actor
(`Workers.csg_rows`): the model then loads on the GPU the actor reserves for the backbone, not
in the flow's process. The GenEval parser needs no model and an `llm-chat` builder calls an
endpoint, so they stay here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cast_core.csg.graph import SceneGraph
from cast_core.hub_snapshot import file_sha256 as file_hash
from cast_core.shapes.prompts import PromptFileError
from tasks.stages.guard import stage_task
from tasks.stages.models import builder_id, graph_builder
from tasks.stages.prompt_sets import prompt_lines
from tasks.stages.recipe import Recipe
from tasks.store.schemas import prompt_id
from tasks.store.stage import RUN_LEVEL, StageRef, make_key, run_stage
from tasks.store.store import Store

if TYPE_CHECKING:
    from tasks.stages.ray_workers import Workers

STAGE = "build_csgs"


@dataclass(frozen=True)
class CsgRows:
    """The stage's rows: one `csgs` row per distinct prompt, one `atoms` row per atom."""

    csgs: list[dict]
    atoms: list[dict]


def cache_key(store: Store, recipe: Recipe) -> str:
    return make_key(STAGE, {"builder": builder_id(recipe)},
                    {"prompts": file_hash(recipe.prompts.train)})


def builds_on_actor(recipe: Recipe) -> bool:
    """Whether the Ray executor builds the graphs on a policy actor: the builder loads a model."""
    return recipe.builder.kind == "llm-local"


def csg_rows(recipe: Recipe, lines: list[tuple[int, dict]],
             build: Callable[[dict], SceneGraph]) -> CsgRows:
    """The rows of the prompt file's `lines` ((line number, record)), each distinct prompt's
    graph built by `build`; PromptFileError (file and line) for a record the builder fails on."""
    run_id, path, builder = recipe.run.name, recipe.prompts.train, builder_id(recipe)
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
    return CsgRows(csgs, atoms)


def build_csgs(store: Store, recipe: Recipe, workers: Workers | None = None) -> StageRef:
    """The stage; with `workers` (the Ray executor) and a local LLM builder the graphs are built
    on the first policy actor, and the rows are written here."""
    run_id = recipe.run.name

    def body():
        lines = prompt_lines(recipe, recipe.prompts.train)
        if workers is not None and builds_on_actor(recipe):
            rows = workers.csg_rows(recipe, lines)
        else:
            rows = csg_rows(recipe, lines, graph_builder(recipe))
        part = f"{run_id}-run"
        return [store.write_table("csgs", rows.csgs, part),
                store.write_table("atoms", rows.atoms, part)]

    return run_stage(store, run_id, RUN_LEVEL, STAGE, cache_key(store, recipe), body)


build_csgs_task = stage_task(build_csgs, STAGE, cache_key)
