"""Stage `evaluate`: a policy checkpoint on the recipe's eval splits -> `evals` rows per split for
the whole split ("overall"), each tag, each atom type and each atom count (the number of atoms of
the prompt), an image grid per split and a bar plot (PNG blobs).

Prompts: each split's file read for the recipe's family (`tasks.stages.prompt_sets.load_prompts`),
first `eval.max_prompts`; graphs from the recipe's CSG builder (built once). Images:
`eval.images_per_prompt` per prompt, ODE sampling at the eval section's steps and CFG in chunks of
`sampling.chunk_size` images, decoded per chunk and kept on the CPU as float32 in [0, 1] (what the
scorer protocol takes); image i of a prompt is seeded from the prompt text and index
`eval.seed_offset` + i (`content_seed`), so every checkpoint is judged on the same
starting noise, and two evaluations with disjoint index ranges on fresh noise. Strict accuracy:
every atom of the image scores > 0.5. Diversity: mean over prompts of the mean pairwise (1 - cosine)
between the unit embeddings of the prompt's images (how much a checkpoint's samples for one prompt
differ; a collapse shows as a drop), on the overall row only, None with one image per prompt. The
embedder is the shapes layout embedder for the shapes world, else the window calibration's image
embedder (CLIP), whose spec then joins the eval spec. hf_energy: the group's mean high-frequency
energy of the images (`cast_core.diagnostics.high_frequency_energy`; noise or stripes that hack the
reward raise it). Iteration -1 is the base model. Cached on the checkpoint's hash and the eval
spec's hash.

Where it computes: in the stage's process (`run.executor = "local"`), or with `"ray"` on the
run's resident actors (`tasks.stages.ray_workers`): the policy actors sample the images in shards
of whole chunks (each samples the batches one process would, so the rows are the same) and the
scorer actors score them; the diversity embedder and the rows stay here. The actors keep the
backbone loaded, so an evaluation between iterations only swaps the LoRA.

One checkpoint may be evaluated under several eval sections (a per-iteration probe and a final
evaluation, say): the `evals` part is named by run, iteration and the sorted split names, so
evaluations of different splits sit side by side, while a re-evaluation of the same splits
replaces the previous one. Beside the rows, a JSON blob keeps every image's atom scores (prompt
and image index; for intervals with prompts as clusters); `eval_outputs` finds it and each
split's grid.

`evaluate_records` is the same seeding without a store or recipe: a prompt list sampled by a
backbone and scored by the shapes verifier (the base evaluation, `flows/base_eval.py`). Seeds come
from the prompt text and the image index (`content_seed`, sha256), never from batch position, so
the same prompt gets the same starting noise in every evaluation, whatever the prompt file or
batch size."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from prefect import task
from tqdm.auto import tqdm

from cast_core.csg.geneval import graph_from_geneval
from cast_core.diagnostics import high_frequency_energy
from cast_core.hub_snapshot import file_sha256 as file_hash
from cast_core.metrics import ImageResult, image_groups, summarise, summarise_by_atom_type
from cast_core.sampling import sample_ode
from cast_core.shapes.verifier import verify
from tasks.stages.calibrate_window import image_embedder, image_embedder_spec
from tasks.stages.guard import stage_task
from tasks.stages.models import graph_builder, scorer, scorer_id, set_threads
from tasks.stages.plots import figure, png
from tasks.stages.policy_state import load_policy_of, policy_for
from tasks.stages.prompt_sets import load_prompts
from tasks.stages.ray_workers import executor
from tasks.stages.recipe import Recipe
from tasks.stages.rollout import contact_sheet
from tasks.stages.score_atoms import score_in_chunks
from tasks.store.stage import StageRef, make_key, run_stage
from tasks.store.store import Store

STAGE = "evaluate"


def content_seed(prompt: str, index: int, salt: str = "eval") -> int:
    """A 63-bit seed from (salt, prompt text, image index)."""
    digest = hashlib.sha256(f"{salt}|{prompt}|{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _diversity_embedder(recipe: Recipe):
    """The diversity metric's image embedder (module docstring); None with one image per prompt."""
    if recipe.eval.images_per_prompt < 2:
        return None
    if recipe.backbone.family == "shapes":
        from cast_core.shapes.embedder import LayoutEmbedder

        return LayoutEmbedder()
    return image_embedder(recipe)


def _diversity(embedder, images: torch.Tensor, per_prompt: int) -> float | None:
    """Mean pairwise (1 - cos) within each prompt's images [P * I, 3, H, W] (I = per_prompt)."""
    if embedder is None:
        return None
    e = embedder.embed(images).view(-1, per_prompt, embedder.dim)  # [P, I, D]
    cos = e @ e.transpose(1, 2)  # [P, I, I]
    off = ~torch.eye(per_prompt, dtype=torch.bool)
    return float((1 - cos[:, off]).mean())


def sample_images(backbone, prompts: list[str], seeds: list[int], recipe: Recipe) -> torch.Tensor:
    """ODE samples, decoded chunk by chunk -> images [N, 3, H, W] float32 in [0, 1] on the CPU."""
    ev, size = recipe.eval, recipe.sampling.chunk_size
    images = []
    with torch.no_grad():
        for lo in range(0, len(prompts), size):
            x0 = sample_ode(backbone, prompts[lo:lo + size], seeds[lo:lo + size], ev.num_steps,
                            ev.guidance_scale, chunk_size=size)
            images.append(backbone.decode(x0).float().cpu())
    return torch.cat(images)


def _plot(rows: list[dict], title: str) -> bytes:
    tags = [r for r in rows if r["group_kind"] in ("overall", "tag")]
    fig = figure(8, 3.5, dpi=100)
    ax = fig.add_subplot()
    labels = [f"{r['split']}/{r['group_name']}" for r in tags]
    ax.bar(range(len(tags)), [r["strict_accuracy"] for r in tags], color="tab:blue")
    ax.set_xticks(range(len(tags)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylim(0, 1)
    ax.set_ylabel("strict accuracy")
    ax.set_title(title)
    return png(fig)


def _group_rows(base: dict, results: list[ImageResult], hf: torch.Tensor,
                diversity: float | None) -> list[dict]:
    """`evals` rows of one split: overall, per tag, per atom count, per atom type."""
    rows = []
    for kind in ("overall", "tag", "atom_count"):
        for name, index in image_groups(results, kind).items():
            t = summarise(name, [results[i] for i in index])
            rows.append({**base, "group_kind": kind, "group_name": name, "images": t.images,
                         "strict_accuracy": t.strict_accuracy, "atom_accuracy": t.atom_accuracy,
                         "mean_score": t.mean_atom_score,
                         "diversity": diversity if kind == "overall" else None,
                         "hf_energy": float(hf[index].mean())})
    by_type = image_groups(results, "atom_type")
    rows += [{**base, "group_kind": "atom_type", "group_name": kind,
              "images": len(by_type[kind]), "strict_accuracy": acc, "atom_accuracy": acc,
              "mean_score": mean, "diversity": None,
              "hf_energy": float(hf[by_type[kind]].mean())}
             for kind, (acc, mean) in summarise_by_atom_type(results).items()]
    return rows


def eval_seeds(prompts: list[str], images_per_prompt: int, seed_offset: int = 0) -> list[int]:
    """Noise seeds of the images, prompt-major: image i of prompt p gets
    content_seed(p, seed_offset + i)."""
    return [content_seed(p, seed_offset + k) for p in prompts for k in range(images_per_prompt)]


def evals_part(run_id: str, iteration: int, splits: list[str]) -> str:
    """The `evals` part of one evaluation: run, iteration and the sorted split names (a hash of
    them when a name is not a plain word)."""
    names = "+".join(sorted(splits))
    if not re.fullmatch(r"[A-Za-z0-9_+-]{1,80}", names):
        names = "s" + hashlib.sha256(names.encode()).hexdigest()[:16]
    return f"{run_id}-{iteration:05d}-{names}"


def eval_spec_hash(recipe: Recipe) -> str:
    """The eval section, builder, scorer, split files' hashes and (real families) the diversity
    embedder. A model scorer enters by its id (model identity; a remote one's as its service
    reports it), not by its recipe fields: a service moved to another URL is the same scorer, and
    another model behind the same URL is not."""
    inputs = {name: file_hash(path) for name, path in sorted(recipe.eval.splits.items())}
    if recipe.scorer.kind == "shapes-verifier":
        config = {"eval": recipe.section_hash("eval", "scorer", "builder")}
    else:
        config = {"eval": recipe.section_hash("eval", "builder"), "scorer": scorer_id(recipe)}
    if recipe.backbone.family != "shapes" and recipe.eval.images_per_prompt >= 2:
        # the shapes layout embedder is fixed code (in the code version); CLIP is a checkpoint
        inputs["diversity_embedder"] = image_embedder_spec(recipe)
    return make_key("eval_spec", config, inputs)


def cache_key(store: Store, recipe: Recipe, iteration: int) -> str:
    policy = policy_for(store, recipe, iteration + 1)
    return make_key(STAGE, {"iteration": iteration},
                    {"checkpoint": policy.policy_hash, "spec": eval_spec_hash(recipe)})


@dataclass(frozen=True)
class Compute:
    """Where an evaluation samples and scores: `sample(prompts, seeds)` -> images [N, 3, H, W]
    float32 in [0, 1] on the CPU; `score(images, graphs)` -> each image's (scores [A],
    heatmaps [A, h, w])."""

    sample: Callable[[list[str], list[int]], torch.Tensor]
    score: Callable[[torch.Tensor, list], list]


def _in_process(store: Store, recipe: Recipe, policy) -> Compute:
    backbone, _ = load_policy_of(store, recipe, policy)
    _, score = scorer(recipe)
    chunk = recipe.sampling.chunk_size
    return Compute(lambda prompts, seeds: sample_images(backbone, prompts, seeds, recipe),
                   lambda images, graphs: score_in_chunks(score, images, graphs, chunk))


def _on_actors(workers, store: Store, recipe: Recipe, policy) -> Compute:
    return Compute(lambda prompts, seeds: workers.sample_eval(store, recipe, policy, prompts,
                                                              seeds),
                   lambda images, graphs: workers.score_images(recipe, images, graphs))


def _evaluate_split(recipe: Recipe, compute: Compute, build, embedder, base: dict,
                    path: str) -> tuple[list[dict], bytes, dict]:
    """One split -> its `evals` rows, its image grid (PNG bytes) and its per-image scores."""
    ev = recipe.eval
    records = load_prompts(recipe, path)[:ev.max_prompts]
    graphs = [build(r) for r in records]
    texts = [r["prompt"] for r in records]
    prompts = [t for t in texts for _ in range(ev.images_per_prompt)]
    seeds = eval_seeds(texts, ev.images_per_prompt, ev.seed_offset)
    images = compute.sample(prompts, seeds)  # [N, 3, H, W] CPU
    flat = [g for g in graphs for _ in range(ev.images_per_prompt)]
    scored = compute.score(images, flat)
    results = [ImageResult(g.tag or "untagged", s, tuple(a.type for a in g.atoms()))
               for g, (s, _) in zip(flat, scored)]
    hf = high_frequency_energy(images)  # [N]
    rows = _group_rows(base, results, hf, _diversity(embedder, images, ev.images_per_prompt))
    grid = contact_sheet((images[:64] * 255).round().to(torch.uint8), ev.images_per_prompt)
    per_image = {"prompts": texts, "images_per_prompt": ev.images_per_prompt,
                 "seed_offset": ev.seed_offset,
                 "scores": [[round(float(x), 6) for x in r.scores] for r in results]}
    return rows, grid, per_image


def evaluate_checkpoint(store: Store, recipe: Recipe, iteration: int) -> StageRef:
    """Evaluate the policy after `iteration`'s training (-1: the base model)."""
    run_id, ev = recipe.run.name, recipe.eval

    def body():
        set_threads(recipe)
        policy = policy_for(store, recipe, iteration + 1)
        spec, rows, refs, per_image = eval_spec_hash(recipe), [], [], {}
        with executor(recipe) as workers:
            compute = (_in_process(store, recipe, policy) if workers is None
                       else _on_actors(workers, store, recipe, policy))
            build, embedder = graph_builder(recipe), _diversity_embedder(recipe)
            for split, path in sorted(ev.splits.items()):
                base = {"run_id": run_id, "iteration": iteration,
                        "checkpoint_hash": policy.policy_hash, "eval_spec_hash": spec,
                        "split": split}
                split_rows, grid, per_image[split] = _evaluate_split(recipe, compute, build,
                                                                     embedder, base, path)
                rows += split_rows
                refs.append(store.put_blob(grid, "png"))
        refs.append(store.put_blob(json.dumps(per_image, sort_keys=True).encode(), "json"))
        refs.append(store.put_blob(_plot(rows, f"{run_id}: iteration {iteration}"), "png"))
        part = evals_part(run_id, iteration, list(ev.splits))
        refs.append(store.write_table("evals", rows, part))
        return refs

    return run_stage(store, run_id, iteration, STAGE, cache_key(store, recipe, iteration), body)


evaluate_task = stage_task(evaluate_checkpoint, STAGE, cache_key)


@dataclass(frozen=True)
class EvalOutputs:
    """Where one evaluation's blobs are: grids {split: PNG path} (the first 64 images, one row
    per prompt) and image_scores (JSON path: {split: {"prompts": [text], "images_per_prompt",
    "seed_offset", "scores": [[atom score] per image, prompt-major]}})."""

    grids: dict[str, str]
    image_scores: str


def eval_outputs(store: Store, recipe: Recipe, iteration: int) -> EvalOutputs:
    """The blobs of this recipe's finished evaluation of the checkpoint (the stage's outputs are
    the grids in sorted split order, the per-image scores, the plot, then the evals part)."""
    done = store.stage_done(recipe.run.name, iteration, STAGE, cache_key(store, recipe, iteration))
    if done is None:
        raise FileNotFoundError(f"run {recipe.run.name!r}: iteration {iteration} has no finished "
                                f"evaluation under this eval section in {store.root}")
    return outputs_of(done.paths, list(recipe.eval.splits))


def outputs_of(paths: tuple[str, ...], splits: list[str]) -> EvalOutputs:
    """The EvalOutputs of a finished evaluation of `splits` from its record's (or ref's) paths."""
    pngs = [p for p in paths if p.endswith(".png")]
    (scores,) = [p for p in paths if p.endswith(".json")]
    return EvalOutputs(dict(zip(sorted(splits), pngs[:-1], strict=True)), scores)


def read_image_scores(store: Store, outputs: EvalOutputs) -> dict:
    """The per-image scores JSON of an evaluation (EvalOutputs.image_scores), parsed."""
    return json.loads(store.resolve(outputs.image_scores).read_text())


def latest_checkpoint(store: Store, recipe: Recipe) -> int:
    """The last iteration whose training finished (-1 = none yet: evaluate the base model)."""
    return store.last_finished_iteration(recipe.run.name, "train_epoch")


latest_checkpoint_task = task(latest_checkpoint, name="latest_checkpoint")


def evaluate_records(backbone, records: list[dict], images_per_prompt: int = 4,
                     num_steps: int = 10, guidance_scale: float = 4.0,
                     chunk_prompts: int = 32) -> list[ImageResult]:
    """Sample `images_per_prompt` images per GenEval-style record (seeds `content_seed`) and score
    all their atoms with the shapes verifier; no store, no recipe."""
    graphs = [graph_from_geneval(r) for r in records]
    results: list[ImageResult] = []
    for lo in tqdm(range(0, len(records), chunk_prompts), desc="evaluate", unit="chunk",
                   mininterval=2.0):
        chunk = list(range(lo, min(lo + chunk_prompts, len(records))))
        prompts = [records[i]["prompt"] for i in chunk for _ in range(images_per_prompt)]
        seeds = [content_seed(records[i]["prompt"], k) for i in chunk
                 for k in range(images_per_prompt)]
        x0 = sample_ode(backbone, prompts, seeds, num_steps, guidance_scale)
        chunk_graphs = [graphs[i] for i in chunk for _ in range(images_per_prompt)]
        scored = verify(backbone.decode(x0), chunk_graphs)
        for graph, s in zip(chunk_graphs, scored):
            results.append(ImageResult(tag=graph.tag or "untagged", scores=s.scores,
                                       atom_types=tuple(a.type for a in graph.atoms())))
    return results
