"""The CAST pipeline end to end on tiny random models of the real architectures.

Every real adapter runs in one full iteration here (CSGs, calibrated window, rollouts, atom scores,
advantages, training epoch, then the evaluation, the iteration report and the evaluation report),
called through the flow's stage functions with a temporary store and no Prefect server:
- FLUX.2-klein (true CFG) + Soft-TIFA on a local Qwen3-VL + CLIP calibration;
- Qwen-Image + Soft-TIFA behind the scorer service on 127.0.0.1 (`scorer.kind = "remote"`).
Prompts are GenEval records with real nouns; the CSG builder is the GenEval parser.

Checked: every table has rows and its declared schema; images at the recipe's size; window steps
and advantage maps on the backbone's token grid; heatmaps at image size; LoRA parameters changed
and base parameters did not; `evals` rows for the split; and a second call of every stage (model
identities recomputed from the folders) skips and writes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pipeline_helpers import ITERATION_TABLES, STAGES, assert_declared_schemas, run_iteration
from safetensors import safe_open
from tiny_models import (
    FLUX2_LAYERS,
    qwen_image_prefix,
    save_clip,
    save_flux2_pipeline,
    save_qwen3_vl,
    save_qwen_image_pipeline,
)

from cast_core import hub_snapshot
from cast_core.scorers.registry import ScorerArgs, load_scorer
from flows.scorer_service import make_app, serve_in_thread
from tasks.reporting.eval_report import write_report
from tasks.reporting.report import eval_report, iteration_report
from tasks.stages import models
from tasks.stages.evaluate import evaluate_checkpoint
from tasks.stages.models import load_base, load_policy, scorer
from tasks.stages.recipe import Recipe, parse_recipe
from tasks.store.store import Store

SIZES = {"flux2": (64, 64), "qwen_image": (64, 96)}  # (H, W); Qwen-Image's token grid is 8 x 12
RECORDS = [
    {"tag": "single_object", "include": [{"class": "dog", "count": 1}], "exclude": [],
     "prompt": "a photo of a dog"},
    {"tag": "counting", "include": [{"class": "cat", "count": 2}], "exclude": [],
     "prompt": "a photo of two cats"},
    {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "exclude": [],
     "prompt": "a photo of a red car"},
    {"tag": "two_object", "include": [{"class": "dog", "count": 1},
                                      {"class": "bicycle", "count": 1}], "exclude": [],
     "prompt": "a photo of a dog and a bicycle"},
    {"tag": "position", "include": [{"class": "bus", "count": 1, "color": "blue"},
                                    {"class": "car", "count": 1, "color": "red",
                                     "position": ["left of", 0]}], "exclude": [],
     "prompt": "a photo of a red car left of a blue bus"},
]
RUN_TABLES = ("stages", "csgs", "atoms", "calibration_curves", "windows")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """The tiny model folders and the GenEval prompt file, built once for the module."""
    root = tmp_path_factory.mktemp("tiny-real")
    prompts = [r["prompt"] for r in RECORDS]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return {"flux2": save_flux2_pipeline(root / "flux2-klein", "klein", prompts),
            "qwen_image": save_qwen_image_pipeline(root / "qwen-image", prompts),
            "vlm": save_qwen3_vl(root / "qwen3-vl"), "clip": save_clip(root / "clip"),
            "prompts": root / "prompts.jsonl", "root": root}


def _recipe(tiny: dict[str, Path], family: str, scorer_section: dict,
            images_per_prompt: int = 1) -> Recipe:
    height, width = SIZES[family]
    backbone = {"family": family, "path": str(tiny[family]), "height": height, "width": width,
                "dtype": "float32", "device": "cpu", "max_sequence_length": 48,
                "embedding_cache": str(tiny["root"] / f"embeddings-{family}")}
    if family == "flux2":
        backbone["text_encoder_out_layers"] = list(FLUX2_LAYERS)
    else:
        backbone["prompt_template_encode_start_idx"] = qwen_image_prefix(tiny[family])
    prompts = str(tiny["prompts"])
    return parse_recipe({
        "run": {"name": f"tiny-{family}", "seed": 0, "threads": 1},
        "backbone": backbone,
        "scorer": scorer_section,
        "builder": {"kind": "geneval-parser"},
        "prompts": {"train": prompts, "per_iteration": 2, "group_size": 2},
        "sampling": {"num_steps": 4, "guidance_scale": 2.0, "noise_level": 0.7},
        "window": {"mode": "calibrated", "size": 2, "calibration_prompts": 2,
                   "embedder": "clip", "embedder_path": str(tiny["clip"])},
        # a random VLM's scores differ between images by ~1e-5: a tiny floor keeps them signal
        "advantage": {"kind": "spatial", "std_floor": 1e-9},
        "train": {"lr": 1e-3, "lora_rank": 2, "lora_alpha": 2.0, "clip_range": 0.2,
                  "micro_batch": 2},
        "eval": {"splits": {"tiny": prompts}, "images_per_prompt": images_per_prompt,
                 "num_steps": 4, "guidance_scale": 2.0},
    }, f"<tiny {family} recipe>")


def _soft_tifa(tiny: dict[str, Path]) -> dict:
    return {"kind": "soft-tifa", "path": str(tiny["vlm"]), "max_pixels": 64 * 96}


def _run_all(store: Store, recipe: Recipe) -> dict:
    """One iteration's stages, the evaluation of its checkpoint, and both reports."""
    refs = run_iteration(store, recipe, 0)
    refs["evaluate"] = evaluate_checkpoint(store, recipe, 0)
    iteration_report(store, recipe, 0)
    eval_report(store, recipe, 0)
    write_report(store, recipe.run.name, store.root / "report")
    return refs


def _snapshot(store: Store) -> dict[str, int]:
    return {p.relative_to(store.root).as_posix(): p.stat().st_mtime_ns
            for p in store.root.rglob("*") if p.is_file() and "report" not in p.parts
            and p.name != "catalog.duckdb"}


def _rows(store: Store, table: str) -> list[dict]:
    return store.read_table(table).to_pylist()


def _check_tables(store: Store, recipe: Recipe, refs: dict) -> None:
    assert list(refs) == [*STAGES, "evaluate"]
    assert not any(r.skipped for r in refs.values())
    for table in (*RUN_TABLES, *ITERATION_TABLES, "evals"):
        assert store.read_table(table).num_rows > 0, table
    assert assert_declared_schemas(store.root) >= len(RUN_TABLES) + len(ITERATION_TABLES) + 1
    assert (store.root / "report" / "report.md").is_file()


def _check_grids(store: Store, recipe: Recipe, backbone) -> None:
    """Images at the recipe's size, window steps and advantage maps on the token grid, heatmaps
    at image size."""
    b, g = recipe.prompts.per_iteration, recipe.prompts.group_size
    n, (h, w), c = b * g, backbone.token_grid, backbone.latent_shape[0]
    size = (recipe.backbone.height, recipe.backbone.width)
    rollouts = _rows(store, "rollouts")
    assert len(rollouts) == n
    images = store.get_tensors(rollouts[0]["image_path"])["images"]
    assert images.dtype == torch.uint8 and tuple(images.shape) == (n, 3, *size)
    window = _rows(store, "windows")[0]
    k = window["window_end"] - window["window_start"]
    assert window["method"] in ("curvature", "threshold") and k == recipe.window.size
    curves = _rows(store, "calibration_curves")
    assert len(curves) == recipe.sampling.num_steps
    assert {r["embedder"].split("(")[0] for r in curves} == {"clip-image-v1"}
    with safe_open(str(store.resolve(rollouts[0]["latents_path"])), framework="pt") as f:
        assert f.get_slice("latents").get_shape() == [n, k, c, h, w]
        assert f.get_slice("log_probs").get_shape() == [n, k, h, w]
    maps = _rows(store, "advantage_maps")
    assert {(r["map_h"], r["map_w"]) for r in maps} == {(h, w)}
    blob = store.get_tensors(maps[0]["map_path"])
    assert tuple(blob["maps"].shape) == (n, h, w) and torch.isfinite(blob["maps"]).all()
    assert blob["maps"].abs().sum() > 0
    scores = _rows(store, "atom_scores")
    num_atoms = {r["prompt_id"]: r["num_atoms"] for r in _rows(store, "csgs")}
    assert len(scores) == sum(num_atoms[r["prompt_id"]] for r in rollouts)
    for r in scores:
        assert (r["heatmap_h"], r["heatmap_w"]) == size
        assert 0.0 <= r["score"] <= 1.0
        assert sum(r["heatmap"]) == pytest.approx(1.0, abs=1e-4)


def _check_training(store: Store, recipe: Recipe, base) -> None:
    """LoRA parameters changed in training, base parameters did not."""
    (ckpt,) = _rows(store, "checkpoints")
    trained = store.get_tensors(ckpt["lora_path"])
    init, _ = load_policy(recipe, None)
    init_lora = {n: p.detach() for n, p in init.named_parameters() if p.requires_grad}
    assert set(trained) == set(init_lora) and all("lora" in n for n in trained)
    assert any(not torch.equal(trained[n], init_lora[n]) for n in trained)
    policy, _ = load_policy(recipe, trained)
    frozen = {n: p for n, p in policy.named_parameters() if not p.requires_grad}
    reference = dict(base.named_parameters())
    assert frozen and all(torch.equal(p, reference[n.replace(".base_layer", "")])
                          for n, p in frozen.items())
    steps = _rows(store, "train_steps")
    assert len(steps) == recipe.derived()["optimizer_steps_per_iteration"]
    assert not any(s["skipped"] for s in steps)
    assert abs(steps[0]["ratio_mean"] - 1.0) <= 1e-3


def _check_evals(store: Store, recipe: Recipe) -> None:
    rows = _rows(store, "evals")
    overall = [r for r in rows if r["group_kind"] == "overall"]
    assert [(r["split"], r["images"]) for r in overall] == [
        ("tiny", len(RECORDS) * recipe.eval.images_per_prompt)]
    assert {r["group_name"] for r in rows if r["group_kind"] == "tag"} == {
        r["tag"] for r in RECORDS}
    diversity = overall[0]["diversity"]
    if recipe.eval.images_per_prompt == 1:
        assert diversity is None
    else:
        assert diversity is not None and 0.0 < diversity <= 2.0


def _check_second_run_skips(store: Store, recipe: Recipe, first: dict) -> None:
    """Every stage skips with the same key and writes nothing; the model identities are
    recomputed from the folders (the per-process memo is cleared)."""
    hub_snapshot._folder_sha256_memo.cache_clear()
    before = _snapshot(store)
    again = run_iteration(store, recipe, 0)
    again["evaluate"] = evaluate_checkpoint(store, recipe, 0)
    assert _snapshot(store) == before
    for stage, ref in again.items():
        assert ref.skipped, stage
        assert (ref.cache_key, ref.content_hash) == (first[stage].cache_key,
                                                     first[stage].content_hash), stage


def _check_all(store: Store, recipe: Recipe, refs: dict, rerun: Recipe | None = None) -> None:
    """Every check above; the second run uses `rerun` (default: the same recipe)."""
    base = load_base(recipe)
    _check_tables(store, recipe, refs)
    _check_grids(store, recipe, base)
    _check_training(store, recipe, base)
    _check_evals(store, recipe)
    _check_second_run_skips(store, rerun or recipe, refs)


def test_flux2_klein_with_soft_tifa_runs_a_full_iteration(tiny, tmp_path):
    recipe = _recipe(tiny, "flux2", _soft_tifa(tiny))
    store = Store(tmp_path / "store")
    _check_all(store, recipe, _run_all(store, recipe))


def test_qwen_image_with_a_remote_soft_tifa_runs_a_full_iteration(tiny, tmp_path):
    local = _recipe(tiny, "qwen_image", _soft_tifa(tiny), images_per_prompt=2)
    scorer_id, score = scorer(local)
    with serve_in_thread(make_app(score, scorer_id)) as url:
        recipe, moved = (_recipe(tiny, "qwen_image", {"kind": "remote", "url": u,
                                                      "timeout_s": 60.0}, images_per_prompt=2)
                         for u in (url, url + "/"))
        assert models.scorer_id(recipe) == models.scorer_id(local) == scorer_id
        store = Store(tmp_path / "store")
        # the same service under another spelling of its URL is the same scorer: cache hits
        _check_all(store, recipe, _run_all(store, recipe), rerun=moved)
        assert {r["scorer_id"] for r in _rows(store, "atom_scores")} == {scorer_id}


def test_a_served_soft_tifa_has_the_id_of_the_same_scorer_in_process(tiny):
    """One scorer id for one model and config: the service's registry and a run's recipe both
    name the model by its content identity (before, the registry used the folder's name)."""
    recipe = _recipe(tiny, "flux2", {**_soft_tifa(tiny), "max_pixels": None})  # the defaults
    served = load_scorer("soft-tifa", ScorerArgs(model=str(tiny["vlm"])))
    assert served.scorer_id == models.scorer_id(recipe)
    assert hub_snapshot.model_identity(tiny["vlm"]) in served.scorer_id
    other = _recipe(tiny, "flux2", _soft_tifa(tiny))  # another max_pixels: another scorer
    assert models.scorer_id(other) != served.scorer_id


def test_flux2_klein_trains_with_recast_weights_from_a_positives_folder(tiny, tmp_path):
    """ReCAST on a real family: positives from a GenEval-layout folder (images of another size,
    cropped and resized to the recipe's), encoded with the VAE; the gains stage runs before the
    epoch and the epoch records step weights with W's marginals. Plumbing only: the random VLM's
    scores barely differ between images, so the tiny floor keeps its ~1e-5 spreads as signal."""
    import numpy as np
    from PIL import Image

    from tasks.stages.recast_gains import read_recast_gains

    folder = tmp_path / "positives"
    rng = np.random.default_rng(0)
    for i, record in enumerate(RECORDS):  # every atom type is carried by >= 2 samples
        (folder / f"{i:05d}" / "samples").mkdir(parents=True)
        (folder / f"{i:05d}" / "metadata.jsonl").write_text(json.dumps(record) + "\n")
        for j in range(2):
            Image.fromarray(rng.integers(0, 256, (80, 96, 3), dtype=np.uint8)).save(
                folder / f"{i:05d}" / "samples" / f"{j:04d}.png")
    base = _recipe(tiny, "flux2", _soft_tifa(tiny))
    dump = base.model_dump(mode="json")
    dump["recast"] = {"weighting": "recast", "positives": str(folder), "prompts": 5,
                      "samples_per_prompt": 2, "variance_floor": 1e-12}
    recipe = parse_recipe(dump, "<tiny flux2 recast recipe>")
    store = Store(tmp_path / "store")
    refs = run_iteration(store, recipe, 0)
    gains = read_recast_gains(store, refs["recast_gains"])
    # every sample (5 prompts x 2) carries objects; only the last prompt a relation
    assert gains.n_positive.tolist() == gains.n_policy.tolist()
    assert gains.n_positive[0] == 10 and gains.n_positive[-1] == 2
    assert torch.isfinite(gains.W).all()
    torch.testing.assert_close(gains.W.sum(dim=1), gains.budgets, rtol=0, atol=1e-6)
    steps = _rows(store, "train_steps")
    weights = [json.loads(r["reward_step_weights_json"]) for r in steps]
    assert weights and all(w == weights[0] for w in weights)
    k = recipe.window.size
    for t in weights[0]:  # each type's weights over the window average lambda_k / mean = 1
        assert len(weights[0][t]) == k and abs(sum(weights[0][t]) / k - 1.0) < 1e-6
    assert run_iteration(store, recipe, 0)["recast_gains"].skipped
