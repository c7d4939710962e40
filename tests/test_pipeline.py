"""The CAST stages end to end on the CI recipe (4 prompts x 4 samples, 6 steps, one thread), called
directly without Prefect: declared schemas, row counts, advantages, the LoRA update, resume by
skipping, a second iteration, the Flow-GRPO variant, the catalog, and the NaN guard."""

import dataclasses
import json
import math
import shutil
from collections import defaultdict

import pyarrow.parquet as pq
import pytest
import torch
from pipeline_helpers import (
    FLOW_GRPO,
    ITERATION_TABLES,
    STAGES,
    assert_declared_schemas,
    ci_recipe,
    reference,
    run_iteration,
    temp_files,
)
from safetensors import safe_open

from cast_core.hub_snapshot import file_sha256 as file_hash
from cast_core.lr_schedule import kl_step_weights, kl_targeted_lr
from tasks.stages.calibrate_window import calibrate_window, read_window
from tasks.stages.models import load_base, load_policy
from tasks.stages.policy_state import policy_for
from tasks.stages.train_epoch import train_epoch
from tasks.store.store import Store


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """(store, recipe, prompts, refs) of iteration 0 of the session's reference run."""
    return reference(tmp_path_factory)


@pytest.fixture(scope="module")
def second(ref):
    """StageRefs of iteration 1 in the reference store."""
    store, recipe, _, _ = ref
    return run_iteration(store, recipe, 1)


def _rows(store, table, iteration=0):
    return store.read_table(table, {"iteration": iteration}).to_pylist()


def _snapshot(store):
    return {p.relative_to(store.root).as_posix(): p.stat().st_mtime_ns
            for p in store.root.rglob("*") if p.is_file()}


def test_one_iteration_writes_every_stage(ref):
    store, recipe, _, refs = ref
    assert list(refs) == list(STAGES)
    for stage, r in refs.items():
        assert r.stage == stage and not r.skipped
        assert r.iteration == (-1 if stage in ("build_csgs", "calibrate_window") else 0)
        assert all(store.resolve(p).is_file() for p in r.paths)
        assert store.stage_done(recipe.run.name, r.iteration, stage, r.cache_key) is not None
    assert temp_files(store.root) == []


def test_parquet_files_have_the_declared_schema(ref, second):
    store = ref[0]
    written = {p.parent.name for p in store.root.glob("tables/*/*.parquet")}
    assert {"stages", "csgs", "atoms", "calibration_curves", "windows", *ITERATION_TABLES} \
        <= written
    assert assert_declared_schemas(store.root) >= len(written)


def test_rollouts_are_b_times_g_with_distinct_seeds(ref):
    store, recipe, _, refs = ref
    rows = _rows(store, "rollouts")
    b, g = recipe.prompts.per_iteration, recipe.prompts.group_size
    assert len(rows) == b * g == refs["rollout"].rows
    assert len({r["seed"] for r in rows}) == b * g
    assert len({r["prompt_id"] for r in rows}) == b
    assert sorted(r["blob_index"] for r in rows) == list(range(b * g))
    for pid in {r["prompt_id"] for r in rows}:
        assert sorted(r["sample_index"] for r in rows if r["prompt_id"] == pid) == list(range(g))
    window = store.read_table("windows").to_pylist()[0]
    assert {(r["window_start"], r["window_end"], r["num_steps"]) for r in rows} == {
        (window["window_start"], window["window_end"], recipe.sampling.num_steps)}
    images = store.get_tensors(rows[0]["image_path"])["images"]  # [N, 3, H, W] uint8
    assert images.dtype == torch.uint8 and images.shape[0] == b * g


def test_atom_scores_cover_every_atom_with_full_heatmaps(ref):
    store = ref[0]
    num_atoms = {r["prompt_id"]: r["num_atoms"] for r in store.read_table("csgs").to_pylist()}
    samples = _rows(store, "rollouts")
    scores = _rows(store, "atom_scores")
    assert len(scores) == sum(num_atoms[s["prompt_id"]] for s in samples)
    atoms = {(r["prompt_id"], r["atom_id"]): r["type"]
             for r in store.read_table("atoms").to_pylist()}
    for r in scores:
        assert len(r["heatmap"]) == r["heatmap_h"] * r["heatmap_w"] > 0
        assert all(math.isfinite(v) for v in r["heatmap"])
        assert 0.0 <= r["score"] <= 1.0
        assert atoms[(r["prompt_id"], r["atom_id"])] == r["atom_type"]
    keys = {(r["prompt_id"], r["sample_index"], r["atom_id"]) for r in scores}
    assert len(keys) == len(scores)


def test_advantages_are_group_z_scores(ref):
    store, recipe, _, _ = ref
    score = {(r["prompt_id"], r["sample_index"], r["atom_id"]): r["score"]
             for r in _rows(store, "atom_scores")}
    groups = defaultdict(list)
    for r in _rows(store, "advantages"):
        groups[(r["prompt_id"], r["atom_id"])].append(r)
    assert len(score) == sum(len(rows) for rows in groups.values())
    g, floor, live = recipe.prompts.group_size, recipe.advantage.std_floor, 0
    for (pid, atom), rows in groups.items():
        assert len(rows) == g
        s = torch.tensor([score[(pid, r["sample_index"], atom)] for r in rows], dtype=torch.float64)
        assert rows[0]["group_mean"] == pytest.approx(float(s.mean()), abs=1e-9)
        assert rows[0]["group_std"] == pytest.approx(float(s.std(correction=0)), abs=1e-9)
        if rows[0]["zero_variance"]:
            assert all(r["advantage"] == 0.0 for r in rows)
            continue
        live += 1
        z = (s - s.mean()) / max(float(s.std(correction=0)), floor)
        assert float(z.mean()) == pytest.approx(0.0, abs=1e-9)
        for r, z_i in zip(rows, z.tolist()):
            assert r["advantage"] == pytest.approx(0.0 if r["gated"] else z_i, abs=1e-9)
        if not any(r["gated"] for r in rows):
            assert sum(r["advantage"] for r in rows) / g == pytest.approx(0.0, abs=1e-9)
    assert live > 0, "every atom group had zero variance: the check above tested nothing"


def test_advantage_maps_match_the_log_prob_grid(ref):
    store, recipe, _, _ = ref
    samples = _rows(store, "rollouts")
    with safe_open(str(store.resolve(samples[0]["latents_path"])), framework="pt") as f:
        n, k, h, w = f.get_slice("log_probs").get_shape()
    window = samples[0]["window_end"] - samples[0]["window_start"]
    assert (n, k) == (len(samples), window)
    rows = _rows(store, "advantage_maps")
    assert len(rows) == n
    assert {(r["map_h"], r["map_w"]) for r in rows} == {(h, w)}
    blob = store.get_tensors(rows[0]["map_path"])
    assert tuple(blob["maps"].shape) == (n, h, w)
    assert tuple(blob["scalar"].shape) == (n,)
    assert torch.isfinite(blob["maps"]).all()
    by_prompt = defaultdict(list)
    for r in rows:
        assert blob["scalar"][r["blob_index"]].item() == pytest.approx(r["scalar_advantage"])
        by_prompt[r["prompt_id"]].append(r["scalar_advantage"])
    for values in by_prompt.values():
        assert len(values) == recipe.prompts.group_size
        assert sum(values) / len(values) == pytest.approx(0.0, abs=1e-5)


def test_train_epoch_updates_lora_only(ref):
    store, recipe, _, refs = ref
    checkpoints = _rows(store, "checkpoints")
    assert len(checkpoints) == 1
    ckpt = checkpoints[0]
    assert ckpt["lora_path"] in refs["train_epoch"].paths
    assert ckpt["lora_path"].endswith(f"/{ckpt['policy_hash']}.safetensors")
    trained = store.get_tensors(ckpt["lora_path"])
    init, _ = load_policy(recipe, None)
    init_lora = {n: p.detach() for n, p in init.named_parameters() if p.requires_grad}
    assert set(trained) == set(init_lora) and all("lora" in n for n in trained)
    changed = [n for n in trained if not torch.equal(trained[n], init_lora[n])]
    assert changed, "no LoRA parameter changed in training"
    policy, _ = load_policy(recipe, trained)
    base = dict(load_base(recipe).named_parameters())
    frozen = {n: p for n, p in policy.named_parameters() if not p.requires_grad}
    assert frozen
    for name, p in frozen.items():
        base_name = name.replace(".base_layer", "")
        assert torch.equal(p, base[base_name]), name
    steps = sorted(_rows(store, "train_steps"), key=lambda r: r["step"])
    n = recipe.prompts.per_iteration * recipe.prompts.group_size
    assert len(steps) == recipe.derived()["optimizer_steps_per_iteration"] == 2
    assert [s["samples"] for s in steps] == [n // 2] * 2
    assert [s["lr"] for s in steps] == [recipe.train.lr] * 2  # no warm-up
    assert abs(steps[0]["ratio_mean"] - 1.0) <= 1e-3
    assert 0.0 <= steps[0]["policy_kl_nats"] < 1e-4  # same weights as the rollout
    assert steps[1]["policy_kl_nats"] > steps[0]["policy_kl_nats"]
    assert steps[0]["ref_kl_nats"] is None and steps[0]["ref_kl_mean_dim"] is None  # kl_beta 0
    assert not any(s["skipped"] for s in steps)
    assert ckpt["optimizer_steps"] == len(steps)


def test_second_iteration_starts_from_the_first_checkpoint(ref, second):
    store, recipe, _, _ = ref
    assert not any(r.skipped for s, r in second.items() if s not in ("build_csgs",
                                                                       "calibrate_window"))
    assert second["build_csgs"].skipped and second["calibrate_window"].skipped
    ckpt0 = _rows(store, "checkpoints", 0)[0]
    rollouts1 = _rows(store, "rollouts", 1)
    assert {r["policy_hash"] for r in rollouts1} == {ckpt0["policy_hash"]}
    assert {r["policy_hash"] for r in _rows(store, "rollouts", 0)} != {ckpt0["policy_hash"]}
    assert policy_for(store, recipe, 1).lora_path == ckpt0["lora_path"]
    seeds0 = {r["seed"] for r in _rows(store, "rollouts", 0)}
    assert not seeds0 & {r["seed"] for r in rollouts1}
    ckpt1 = _rows(store, "checkpoints", 1)[0]
    steps = _rows(store, "train_steps", 0) + _rows(store, "train_steps", 1)
    assert ckpt1["optimizer_steps"] == len(steps)
    assert sorted(s["step"] for s in steps) == list(range(len(steps)))


def _two_iterations(prompts, tmp_path, **overrides):
    """Iterations 0 and 1 of the CI recipe with `overrides` in a fresh store: (recipe, store,
    checkpoints rows in iteration order)."""
    recipe = ci_recipe(prompts, **overrides)
    store = Store(tmp_path / "store")
    for k in (0, 1):
        run_iteration(store, recipe, k)
    return recipe, store, sorted(store.read_table("checkpoints").to_pylist(),
                                 key=lambda r: r["iteration"])


@pytest.mark.parametrize("per_step", [False, True])
def test_kl_targeted_lr_sets_each_iteration_from_the_last_move(ref, tmp_path, per_step):
    """With train.kl_target_nats, iteration k trains at kl_targeted_lr(lr of k - 1, its
    update_kl_nats): recorded in checkpoints.lr and every train_steps.lr, and part of the train
    key. The target is a tenth of the move the constant lr makes, so the lr must fall and the
    next move come closer to the target. With train.kl_target_per_step as well, iteration 0
    trains every window step at weight 1 (so exactly as without it) and iteration 1 at
    kl_step_weights of iteration 0's per-step KLs, recorded in checkpoints.step_weights."""
    _, base_recipe, prompts, _ = ref
    store0 = ref[0]
    moved0 = _rows(store0, "checkpoints", 0)[0]["update_kl_nats"]
    target = moved0 / 10
    recipe, store, ckpts = _two_iterations(prompts, tmp_path, **{
        "run.name": "kl-target", "train.kl_target_nats": target,
        "train.kl_target_per_step": per_step})
    tr = recipe.train
    assert ckpts[0]["lr"] == tr.lr == base_recipe.train.lr
    assert ckpts[0]["update_kl_nats"] == pytest.approx(moved0, rel=1e-6)  # same as the reference
    want = kl_targeted_lr(tr.lr, ckpts[0]["update_kl_nats"], target, max_factor=tr.kl_lr_factor,
                          lr_min=tr.kl_lr_floor * tr.lr, lr_max=tr.kl_lr_ceiling * tr.lr)
    assert ckpts[1]["lr"] == pytest.approx(want) == pytest.approx(tr.lr / tr.kl_lr_factor)
    for k, c in enumerate(ckpts):
        assert {s["lr"] for s in store.read_table("train_steps", {"iteration": k}).to_pylist()} \
            == {c["lr"]}  # no warm-up in the CI recipe
    assert abs(math.log(ckpts[1]["update_kl_nats"] / target)) < abs(math.log(moved0 / target))
    size = recipe.window.size
    for c in ckpts:  # the window's mean KL is the mean of its steps'
        assert len(c["update_kl_per_step"]) == size
        assert sum(c["update_kl_per_step"]) / size == pytest.approx(c["update_kl_nats"])
    if not per_step:
        assert [c["step_weights"] for c in ckpts] == [None, None]
        return
    assert ckpts[0]["step_weights"] == [1.0] * size
    want = kl_step_weights((1.0,) * size, tuple(ckpts[0]["update_kl_per_step"]),
                           max_factor=tr.kl_lr_factor, floor=tr.kl_step_weight_floor)
    assert ckpts[1]["step_weights"] == pytest.approx(list(want))
    assert len(set(want)) > 1  # the steps moved different KLs, so their weights differ


def test_velocity_targeted_lr_sets_each_iteration_from_the_last_velocity_change(ref, tmp_path):
    """With train.velocity_target, iteration k trains at kl_targeted_lr of the squared velocity
    change (linear in the lr, as the KL is quadratic) against the squared target. The target is a
    tenth of the change the constant lr makes, so the lr must fall by the clamp and the next
    change come closer to the target."""
    _, base_recipe, prompts, _ = ref
    moved0 = _rows(ref[0], "checkpoints", 0)[0]["update_velocity_rms"]
    target = moved0 / 10
    recipe, _, ckpts = _two_iterations(prompts, tmp_path, **{
        "run.name": "velocity-target", "train.velocity_target": target})
    tr = recipe.train
    assert ckpts[0]["lr"] == tr.lr == base_recipe.train.lr
    assert ckpts[0]["update_velocity_rms"] == pytest.approx(moved0, rel=1e-6)
    want = kl_targeted_lr(tr.lr, moved0**2, target**2, max_factor=tr.kl_lr_factor,
                          lr_min=tr.kl_lr_floor * tr.lr, lr_max=tr.kl_lr_ceiling * tr.lr)
    assert ckpts[1]["lr"] == pytest.approx(want) == pytest.approx(tr.lr / tr.kl_lr_factor)
    assert abs(math.log(ckpts[1]["update_velocity_rms"] / target)) < abs(math.log(10))


def test_rerunning_finished_stages_skips_and_writes_nothing(ref, second):
    store, recipe, _, refs = ref
    before = _snapshot(store)
    again = {0: run_iteration(store, recipe, 0), 1: run_iteration(store, recipe, 1)}
    assert _snapshot(store) == before
    for k, first in ((0, refs), (1, second)):
        for stage, r in again[k].items():
            assert r.skipped, (k, stage)
            assert (r.cache_key, r.content_hash, r.paths) == (
                first[stage].cache_key, first[stage].content_hash, first[stage].paths)


def test_catalog_joins_scores_to_atoms_and_rollouts(ref, second):
    store, recipe, _, _ = ref
    store.refresh_catalog()
    con = store.connect_readonly()
    try:
        joined = con.execute("""
            SELECT s.iteration, count(*), count(DISTINCT r.seed),
                   count(*) FILTER (WHERE s.atom_type <> a.type)
            FROM atom_scores s
            JOIN atoms a ON a.run_id = s.run_id AND a.prompt_id = s.prompt_id
                        AND a.atom_id = s.atom_id
            JOIN rollouts r ON r.run_id = s.run_id AND r.iteration = s.iteration
                           AND r.prompt_id = s.prompt_id AND r.sample_index = s.sample_index
            WHERE s.run_id = $run GROUP BY s.iteration ORDER BY s.iteration""",
                             {"run": recipe.run.name}).fetchall()
    finally:
        con.close()
    n = recipe.prompts.per_iteration * recipe.prompts.group_size
    expected = [(k, len(_rows(store, "atom_scores", k)), n, 0) for k in (0, 1)]
    assert joined == expected


def test_flow_grpo_variant_runs_one_iteration(ref, tmp_path):
    prompts = ref[2]
    recipe = ci_recipe(prompts, **FLOW_GRPO)
    store = Store(tmp_path / "store")
    refs = run_iteration(store, recipe, 0)
    assert not any(r.skipped for r in refs.values())
    window = store.read_table("windows").to_pylist()[0]
    assert (window["method"], window["window_start"], window["window_end"]) == ("fixed", 0, 3)
    assert store.read_table("calibration_curves").num_rows == 0
    assert {(r["window_start"], r["window_end"]) for r in _rows(store, "rollouts")} == {(0, 3)}
    steps = sorted(_rows(store, "train_steps"), key=lambda r: r["step"])
    assert abs(steps[0]["ratio_mean"] - 1.0) <= 1e-3
    assert not any(s["skipped"] for s in steps)
    assert len(_rows(store, "checkpoints")) == 1
    assert_declared_schemas(store.root)
    init, _ = load_policy(recipe, None)
    trained = store.get_tensors(_rows(store, "checkpoints")[0]["lora_path"])
    assert any(not torch.equal(trained[n], p) for n, p in init.named_parameters()
               if p.requires_grad)


def test_nan_advantage_skips_only_its_optimizer_step(ref, tmp_path):
    """The NaN guard through the real train_epoch: one sample's advantage map is NaN; the
    optimizer step holding it is skipped (loss null, reason recorded), the other one steps."""
    src, recipe, _, refs = ref
    shutil.copytree(src.root, tmp_path / "store")
    store = Store(tmp_path / "store")
    ad = refs["compute_advantages"]
    rows = pq.read_table(store.resolve(ad.path_with("/advantage_maps/"))).to_pylist()
    blob = store.get_tensors(rows[0]["map_path"])
    blob["maps"][5] = float("nan")
    poisoned = store.put_tensors(blob)
    for r in rows:
        r |= {"map_path": poisoned.path, "map_hash": poisoned.sha256}
    table = store.write_table("advantage_maps", rows, "poisoned-00000")
    bad = dataclasses.replace(ad, content_hash="poisoned", paths=(
        poisoned.path, ad.path_with("/advantages/"), table.path))
    result = train_epoch(store, recipe, refs["build_csgs"], refs["rollout"], refs["score_atoms"],
                         bad, 0)
    assert not result.skipped
    steps = sorted(store.read_table("train_steps", {"iteration": 0}).to_pylist(),
                   key=lambda r: r["step"])
    assert [s["skipped"] for s in steps].count(True) == 1
    skipped = next(s for s in steps if s["skipped"])
    kept = next(s for s in steps if not s["skipped"])
    assert skipped["skip_reason"] == "non-finite loss"
    assert skipped["loss"] is None and skipped["ratio_mean"] is None
    assert math.isfinite(kept["loss"]) and kept["skip_reason"] is None
    ckpt = store.read_table("checkpoints", {"iteration": 0}).to_pylist()[0]
    assert ckpt["optimizer_steps"] == 1
    trained = store.get_tensors(ckpt["lora_path"])
    assert all(torch.isfinite(t).all() for t in trained.values())


def test_skipped_stage_reads_its_own_outputs_after_a_config_change(ref, tmp_path):
    src, recipe, prompts, refs = ref
    shutil.copytree(src.root, tmp_path / "store")
    store = Store(tmp_path / "store")
    calibrated = read_window(store, refs["calibrate_window"])
    calibrate_window(store, ci_recipe(prompts, **{"window.mode": "fixed", "window.start": 1}))
    again = calibrate_window(store, recipe)  # the original recipe: its record still exists
    assert read_window(store, again) == calibrated
    record = store.stage_done(recipe.run.name, again.iteration, again.stage, again.cache_key)
    assert record is not None and record.content_hash == again.content_hash
    windows = store.resolve(again.path_with("/windows/"))
    assert file_hash(windows) == file_hash(src.resolve(refs["calibrate_window"]
                                                       .path_with("/windows/")))


def test_advantage_blob_holds_type_maps_and_the_no_map_credit(ref):
    """type_maps [N, 4, h, w] (object, count, attribute, relation) are each type's share of the
    unclamped pixel map, so on the shapes world (log-prob grid = heatmap grid: pooling is the
    identity) clamp(sum over types) is the stored map; a type a prompt lacks has a zero map; the
    `atom` credit is the clamped mean of the sample's stored (gated) atom advantages."""
    store, recipe, _, _ = ref
    rows = _rows(store, "advantage_maps")
    blob = store.get_tensors(rows[0]["map_path"])
    n, h, w = blob["maps"].shape
    assert tuple(blob["type_maps"].shape) == (n, 4, h, w)
    assert tuple(blob["atom"].shape) == (n,)
    scores = _rows(store, "atom_scores")
    assert {(r["heatmap_h"], r["heatmap_w"]) for r in scores} == {(h, w)}
    clip = recipe.advantage.clip
    torch.testing.assert_close(blob["type_maps"].sum(dim=1).clamp(-clip, clip), blob["maps"],
                               atol=1e-5, rtol=1e-5)
    order = ("object", "count", "attribute", "relation")
    types = defaultdict(set)
    for r in scores:
        types[r["prompt_id"]].add(r["atom_type"])
    advantages = defaultdict(list)
    for r in _rows(store, "advantages"):
        advantages[(r["prompt_id"], r["sample_index"])].append(r["advantage"])
    live = set()
    for r in rows:
        i, present = r["blob_index"], types[r["prompt_id"]]
        for t, name in enumerate(order):
            if name not in present:
                assert torch.equal(blob["type_maps"][i, t], torch.zeros(h, w)), (i, name)
            elif blob["type_maps"][i, t].abs().max() > 0:
                live.add(name)
        values = advantages[(r["prompt_id"], r["sample_index"])]
        expected = max(-clip, min(clip, sum(values) / len(values)))
        assert blob["atom"][i].item() == pytest.approx(expected, abs=1e-5)
    assert len(live) >= 2, f"only {live} have non-zero type maps: the sum check is too weak"
    assert blob["atom"].abs().max() > 0


def test_atom_kind_trains_on_the_constant_map(ref, tmp_path):
    """advantage.kind = "atom" on a copy of the reference store: the rollouts and scores are
    reused (their keys do not read the advantage section), the advantages and the training rerun,
    the update is finite and moves the LoRA, and differently from CAST's map."""
    src, _, prompts, refs = ref
    shutil.copytree(src.root, tmp_path / "store")
    store = Store(tmp_path / "store")
    recipe = ci_recipe(prompts, **{"advantage.kind": "atom"})
    again = run_iteration(store, recipe, 0)
    assert all(again[s].skipped for s in ("build_csgs", "calibrate_window", "rollout",
                                          "score_atoms"))
    assert not again["compute_advantages"].skipped and not again["train_epoch"].skipped
    steps = sorted(_rows(store, "train_steps"), key=lambda r: r["step"])
    assert abs(steps[0]["ratio_mean"] - 1.0) <= 1e-3
    assert not any(s["skipped"] for s in steps)
    rows = _rows(store, "advantage_maps")
    blob = store.get_tensors(rows[0]["map_path"])
    credit = blob["atom"][[r["blob_index"] for r in rows]]
    assert torch.isfinite(credit).all() and credit.abs().max() > 0
    ckpt = _rows(store, "checkpoints")[0]
    trained = store.get_tensors(ckpt["lora_path"])
    cast = src.get_tensors(_rows(src, "checkpoints")[0]["lora_path"])
    init, _ = load_policy(recipe, None)
    before = {n: p.detach() for n, p in init.named_parameters() if p.requires_grad}
    assert any(not torch.equal(trained[n], before[n]) for n in before)
    assert any(not torch.equal(trained[n], cast[n]) for n in before)
    assert ckpt["policy_hash"] != _rows(src, "checkpoints")[0]["policy_hash"]
    assert again["rollout"].content_hash == refs["rollout"].content_hash


def test_lr_warm_up_sets_and_records_each_optimizer_steps_lr(ref, tmp_path):
    """train.warmup_steps = 4 on a fresh optimizer: the two steps run at lr / 4 and 2 lr / 4."""
    src, recipe, prompts, refs = ref
    shutil.copytree(src.root, tmp_path / "store")
    store = Store(tmp_path / "store")
    warm = ci_recipe(prompts, **{"train.warmup_steps": 4})
    assert warm.run.name == recipe.run.name and warm.train.warmup_steps == 4
    result = train_epoch(store, warm, refs["build_csgs"], refs["rollout"], refs["score_atoms"],
                         refs["compute_advantages"], 0)
    assert not result.skipped
    steps = sorted(store.read_table("train_steps", {"iteration": 0}).to_pylist(),
                   key=lambda r: r["step"])
    assert [s["lr"] for s in steps] == pytest.approx([warm.train.lr / 4, warm.train.lr / 2])


def test_group_others_heatmaps_build_each_map_from_the_other_samples(ref, tmp_path):
    """advantage.heatmap_source = "group_others" on a copy of the reference store: only the
    advantages and the training rerun; each stored map is the pixel map of the sample's stored
    (gated) atom advantages through the mean of its group's *other* samples' heatmaps, which
    differs from the map through its own."""
    from cast_core.pixel_map import group_heatmaps, pixel_advantage_map

    src, _, prompts, _ = ref
    shutil.copytree(src.root, tmp_path / "store")
    store = Store(tmp_path / "store")
    recipe = ci_recipe(prompts, **{"advantage.heatmap_source": "group_others"})
    again = run_iteration(store, recipe, 0)
    assert all(again[s].skipped for s in ("rollout", "score_atoms"))
    assert not again["compute_advantages"].skipped and not again["train_epoch"].skipped
    g, cfg = recipe.prompts.group_size, recipe.advantage
    heat, adv = defaultdict(dict), defaultdict(dict)
    for r in _rows(store, "atom_scores"):
        heat[r["prompt_id"]][(r["sample_index"], r["atom_id"])] = torch.tensor(
            r["heatmap"], dtype=torch.float32).view(r["heatmap_h"], r["heatmap_w"])
    for r in _rows(store, "advantages"):
        adv[r["prompt_id"]][(r["sample_index"], r["atom_id"])] = r["advantage"]
    rows = _rows(store, "advantage_maps")
    maps = store.get_tensors(rows[0]["map_path"])["maps"]
    own_maps = src.get_tensors(_rows(src, "advantage_maps")[0]["map_path"])["maps"]
    for pid in {r["prompt_id"] for r in rows}:
        atoms = sorted({a for _, a in heat[pid]})
        h = torch.stack([torch.stack([heat[pid][(s, a)] for a in atoms]) for s in range(g)])
        a = torch.tensor([[adv[pid][(s, at)] for at in atoms] for s in range(g)])
        mask = torch.ones(g, len(atoms), dtype=torch.bool)
        expected = pixel_advantage_map(a, group_heatmaps(h[None], "group_others")[0], mask,
                                       cfg.global_weight, cfg.clip, cfg.heatmap_norm,
                                       cfg.spatial_mix).map
        index = [next(r["blob_index"] for r in rows if r["prompt_id"] == pid
                      and r["sample_index"] == s) for s in range(g)]
        torch.testing.assert_close(maps[index], expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(maps, own_maps, atol=1e-4)


def test_block_noise_runs_an_iteration_on_the_tile_grid(ref, tmp_path):
    """sampling.noise_block = 4 (pinned, so a run of its own): the rollout's log-probs and the
    advantage maps live on the 8 x 8 tile grid, the first step's ratio is 1, nothing is
    skipped."""
    store = Store(tmp_path / "store")
    recipe = ci_recipe(ref[2], **{"sampling.noise_block": 4})
    run_iteration(store, recipe, 0)
    sample = _rows(store, "rollouts")[0]
    with safe_open(str(store.resolve(sample["latents_path"])), framework="pt") as f:
        assert f.get_slice("log_probs").get_shape()[-2:] == [8, 8]
        assert f.get_slice("latents").get_shape()[-2:] == [32, 32]
    blob = store.get_tensors(_rows(store, "advantage_maps")[0]["map_path"])
    assert blob["maps"].shape[-2:] == (8, 8)
    steps = sorted(_rows(store, "train_steps"), key=lambda r: r["step"])
    assert abs(steps[0]["ratio_mean"] - 1.0) <= 1e-3 and not any(s["skipped"] for s in steps)
    assert recipe.pinned()["sampling"]["noise_block"] == 4


NFT = {"train.objective": "nft", "sampling.noise_level": 0.0, "window.mode": "fixed"}


@pytest.mark.parametrize("kind", ["scalar", "spatial"])
def test_nft_objective_trains_on_ode_samples(ref, tmp_path, kind):
    """train.objective = "nft" with the ODE sampler: every stage runs, the train_steps rows carry
    the NFT diagnostics and no ratio columns, the LoRA moves, a re-run skips every stage."""
    recipe = ci_recipe(ref[2], **NFT, **{"advantage.kind": kind})
    store = Store(tmp_path / "store")
    refs = run_iteration(store, recipe, 0)
    assert not any(r.skipped for r in refs.values())
    steps = sorted(_rows(store, "train_steps"), key=lambda r: r["step"])
    assert len(steps) == recipe.train.inner_epochs * recipe.train.steps_per_epoch
    for s in steps:
        assert s["objective"] == "nft" and not s["skipped"] and s["ratio_mean"] is None
        assert 0.0 <= s["positive_share"] <= 1.0 and math.isfinite(s["loss"])
        by_t = json.loads(s["nft_loss_by_t_json"])
        assert len(by_t["t_bins"]) == len(by_t["loss"]) == 4
    ckpt = _rows(store, "checkpoints")[0]
    assert ckpt["update_kl_nats"] is None and ckpt["param_change_norm"] > 0
    assert_declared_schemas(store.root)
    again = run_iteration(store, recipe, 0)
    assert all(r.skipped for r in again.values())


def test_nft_trains_the_conditional_velocity_by_default(ref):
    """`train.nft_guidance` defaults to "none": the NFT loss trains the conditional velocity
    (scale 1), whatever the sampler's CFG; "sampler" trains the guided one at its scale."""
    from tasks.stages.train_update import nft_training_guidance

    recipe = ci_recipe(ref[2], **NFT)
    assert recipe.train.nft_guidance == "none" and recipe.sampling.guidance_scale != 1.0
    assert nft_training_guidance(recipe) == 1.0
    guided = ci_recipe(ref[2], **NFT, **{"train.nft_guidance": "sampler"})
    assert nft_training_guidance(guided) == guided.sampling.guidance_scale


def test_nft_recipe_refuses_what_it_cannot_do(ref):
    from tasks.stages.recipe import RecipeError

    with pytest.raises((RecipeError, ValueError), match="noise_level = 0"):
        ci_recipe(ref[2], **{"sampling.noise_level": 0.0, "window.mode": "fixed"})
    with pytest.raises((RecipeError, ValueError), match="shared_noise"):
        ci_recipe(ref[2], **NFT, **{"sampling.shared_noise": True})
    with pytest.raises((RecipeError, ValueError), match="window.mode = 'fixed'"):
        ci_recipe(ref[2], **{**NFT, "window.mode": "calibrated"})
