"""Stage `evaluate`: a policy checkpoint on the recipe's eval splits -> `evals` rows per split for
the whole split ("overall"), each tag, each atom type and each atom count (the number of atoms of
the prompt), an image grid per split and a bar plot (PNG blobs).

Images: `eval.images_per_prompt` per prompt, ODE sampling at the eval section's steps and CFG,
seeds from the prompt text and image index (`tasks.evaluate.content_seed`), so every checkpoint
is judged on the same starting noise. Strict accuracy: every atom of the image scores > 0.5.
Diversity: mean over prompts of the mean pairwise (1 - cosine) between the layout embeddings of the
prompt's images (how much a checkpoint's samples for one prompt differ; a collapse shows as a drop),
on the overall row only. hf_energy: the group's mean high-frequency energy of the images
(`cast_core.diagnostics.high_frequency_energy`; noise or stripes that hack the reward raise it).
Iteration -1 is the base model. Cached on the checkpoint's hash and the eval spec's hash.
"""

from __future__ import annotations

import io

import torch
from prefect import task

from cast_core.diagnostics import high_frequency_energy
from cast_core.metrics import ImageResult, image_groups, summarise, summarise_by_atom_type
from cast_core.sampling import sample_ode
from cast_core.shapes.prompts import load_prompt_file
from tasks.evaluate import content_seed
from tasks.models import build_graph, load_policy, scorer, set_threads
from tasks.policy_state import policy_for
from tasks.recipe import Recipe
from tasks.rollout_groups import contact_sheet
from tasks.stage import StageRef, file_hash, make_key, run_stage, stage_task
from tasks.store import Store

STAGE = "evaluate"


def _diversity(images: torch.Tensor, per_prompt: int) -> float | None:
    from cast_core.shapes.embedder import LayoutEmbedder

    if per_prompt < 2:
        return None
    e = LayoutEmbedder().embed(images).view(-1, per_prompt, LayoutEmbedder().dim)  # [P, I, D]
    cos = e @ e.transpose(1, 2)  # [P, I, I]
    off = ~torch.eye(per_prompt, dtype=torch.bool)
    return float((1 - cos[:, off]).mean())


def _plot(rows: list[dict], title: str) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tags = [r for r in rows if r["group_kind"] in ("overall", "tag")]
    fig = Figure(figsize=(8, 3.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    labels = [f"{r['split']}/{r['group_name']}" for r in tags]
    ax.bar(range(len(tags)), [r["strict_accuracy"] for r in tags], color="tab:blue")
    ax.set_xticks(range(len(tags)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylim(0, 1)
    ax.set_ylabel("strict accuracy")
    ax.set_title(title)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


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


def eval_spec_hash(recipe: Recipe) -> str:
    files = {name: file_hash(path) for name, path in sorted(recipe.eval.splits.items())}
    return make_key("eval_spec", {"eval": recipe.section_hash("eval", "scorer", "builder")},
                    files)


def cache_key(store: Store, recipe: Recipe, iteration: int) -> str:
    policy = policy_for(store, recipe, iteration + 1)
    return make_key(STAGE, {"iteration": iteration},
                    {"checkpoint": policy.policy_hash, "spec": eval_spec_hash(recipe)})


def evaluate_checkpoint(store: Store, recipe: Recipe, iteration: int) -> StageRef:
    """Evaluate the policy after `iteration`'s training (-1: the base model)."""
    run_id, ev = recipe.run.name, recipe.eval

    def body():
        set_threads(recipe)
        policy = policy_for(store, recipe, iteration + 1)
        lora = store.get_tensors(policy.lora_path) if policy.lora_path else None
        backbone, _ = load_policy(recipe, lora)
        _, score = scorer(recipe)
        rows, refs = [], []
        for split, path in sorted(ev.splits.items()):
            records = load_prompt_file(path)[:ev.max_prompts]
            graphs = [build_graph(recipe, r) for r in records]
            prompts = [r["prompt"] for r in records for _ in range(ev.images_per_prompt)]
            seeds = [content_seed(r["prompt"], k) for r in records
                     for k in range(ev.images_per_prompt)]
            with torch.no_grad():
                x0 = sample_ode(backbone, prompts, seeds, ev.num_steps, ev.guidance_scale)
            images = backbone.decode(x0)
            flat = [g for g in graphs for _ in range(ev.images_per_prompt)]
            results = [ImageResult(g.tag or "untagged", s, tuple(a.type for a in g.atoms()))
                       for g, (s, _) in zip(flat, score(images, flat))]
            base = {"run_id": run_id, "iteration": iteration,
                    "checkpoint_hash": policy.policy_hash, "eval_spec_hash": eval_spec_hash(recipe),
                    "split": split}
            hf = high_frequency_energy(images)  # [N]
            rows += _group_rows(base, results, hf, _diversity(images, ev.images_per_prompt))
            grid = (images[:64] * 255).round().to(torch.uint8)
            refs.append(store.put_blob(contact_sheet(grid, ev.images_per_prompt), "png"))
        refs.append(store.put_blob(_plot(rows, f"{run_id}: iteration {iteration}"), "png"))
        refs.append(store.write_table("evals", rows, f"{run_id}-{iteration:05d}"))
        return refs

    return run_stage(store, run_id, iteration, STAGE, cache_key(store, recipe, iteration), body)


evaluate_task = stage_task(evaluate_checkpoint, STAGE, cache_key)


def latest_checkpoint(store: Store, recipe: Recipe) -> int:
    """The last iteration whose training finished (-1 = none yet: evaluate the base model)."""
    return store.last_finished_iteration(recipe.run.name, "train_epoch")


def eval_report(store: Store, recipe: Recipe, iteration: int) -> dict:
    """Refresh the catalog and print this checkpoint's table per group (and the history)."""
    from tasks.report import format_rows

    store.refresh_catalog()
    con = store.connect_readonly()
    try:
        cursor = con.execute(
            "SELECT split, group_kind, group_name, images, round(strict_accuracy, 3)::DOUBLE AS "
            "strict, round(mean_score, 3)::DOUBLE AS mean_score, round(diversity, 4)::DOUBLE AS "
            "diversity, round(hf_energy, 4)::DOUBLE AS hf_energy FROM evals WHERE run_id = $run "
            "AND iteration = $k ORDER BY split, group_kind DESC, TRY_CAST(group_name AS INTEGER), "
            "group_name",
            {"run": recipe.run.name, "k": iteration})
        columns, rows = [d[0] for d in cursor.description], cursor.fetchall()
        history = con.execute(
            "SELECT iteration, split, round(strict_accuracy, 3)::DOUBLE FROM evals WHERE run_id = "
            "$run AND group_kind = 'overall' ORDER BY iteration, split",
            {"run": recipe.run.name}).fetchall()
    finally:
        con.close()
    print(f"run {recipe.run.name!r}, checkpoint of iteration {iteration} (-1 = base):\n"
          f"{format_rows(columns, rows)}\n\nstrict accuracy (overall) by iteration:\n"
          f"{format_rows(['iteration', 'split', 'strict'], history)}")
    return {"run_id": recipe.run.name, "iteration": iteration,
            "rows": [dict(zip(columns, r)) for r in rows]}


latest_checkpoint_task = task(latest_checkpoint, name="latest_checkpoint")
eval_report_task = task(eval_report, name="eval_report")
