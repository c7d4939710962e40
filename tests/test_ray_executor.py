"""The Ray executor on a local cluster of two CPUs: sharded rollouts and scores give the same
rows and blobs as one process, the training the same LoRA (data-parallel over two actors, each
reading only its own samples' window steps, for the SDE and the NFT objective), and the resident
actors load the backbone once across stages and iterations, swapping only the LoRA when the
policy changes.

Slow: starting the cluster and its actors' processes costs tens of seconds on two cores."""

import os
import signal
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from tasks.stages.iteration import plain_stages, run_iteration, run_setup
from tasks.stages.ray_workers import executor, init_ray, shards
from tasks.store.store import Store
from tests.pipeline_helpers import RAY_TWO_CPUS, ci_recipe, reference, table_rows

ray = pytest.importorskip("ray")

RAY = RAY_TWO_CPUS


def test_shards_are_contiguous_and_near_equal():
    assert shards(list(range(5)), 2) == [[0, 1], [2, 3, 4]]
    assert shards(list(range(2)), 3) == [[0], [1]]
    assert [i for part in shards(list(range(17)), 4) for i in part] == list(range(17))


@pytest.fixture(scope="module")
def cluster():
    init_ray("", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_run(cluster, tmp_path_factory):
    """Iterations 0 and 1 of the CI run on the actors -> (store, recipe, refs of 0, loads after
    0, loads after 1)."""
    _, _, prompts, _ = reference(tmp_path_factory)
    recipe = ci_recipe(prompts, **RAY)
    store = Store(tmp_path_factory.mktemp("ray") / "store")
    stages = plain_stages()
    with executor(recipe) as workers:
        setup = run_setup(stages, store, recipe)
        refs = run_iteration(stages, store, recipe, setup, 0, workers=workers)
        first = workers.loads()
        run_iteration(stages, store, recipe, setup, 1, workers=workers)
        second = workers.loads()
        workers.release()
    return store, recipe, refs, first, second


def _rows(store: Store, ref, table: str) -> list[dict]:
    return store.read_output(ref, table).to_pylist()


@pytest.mark.slow
def test_sharded_stages_write_the_single_process_outputs(ray_run, tmp_path_factory):
    local_store, _, _, local = reference(tmp_path_factory)
    store, _, refs, _, _ = ray_run
    for stage, table in (("rollout", "rollouts"), ("score_atoms", "atom_scores"),
                         ("compute_advantages", "advantages")):
        assert _rows(store, refs[stage], table) == _rows(local_store, local[stage], table), stage
        assert refs[stage].content_hash == local[stage].content_hash, stage  # blobs too
    assert (_rows(store, refs["train_epoch"], "checkpoints")
            == _rows(local_store, local["train_epoch"], "checkpoints"))
    steps = [_rows(s, r["train_epoch"], "train_steps") for s, r in ((store, refs),
                                                                    (local_store, local))]
    for row in steps[0] + steps[1]:
        del row["stage_seconds_json"]  # wall times
    assert steps[0] == steps[1]
    lora = store.get_tensors(_rows(store, refs["train_epoch"], "checkpoints")[0]["lora_path"])
    want = local_store.get_tensors(
        _rows(local_store, local["train_epoch"], "checkpoints")[0]["lora_path"])
    assert all(torch.equal(lora[k], want[k]) for k in want)


@pytest.mark.slow
def test_shard_blobs_are_gathered_and_removed(ray_run):
    store, _, refs, _, _ = ray_run
    recorded = {p for record in store.stage_records() for p in record.paths}
    stored = {p.relative_to(store.root).as_posix() for p in (store.root / "blobs").rglob("*.*")}
    assert stored == {p for p in recorded if p.startswith("blobs/")}  # no shard blob left
    assert set(refs["rollout"].paths) <= recorded


@pytest.mark.slow
def test_no_reload_between_stages_or_iterations(ray_run):
    _, _, _, first, second = ray_run
    # iteration 0: each policy actor reads the backbone once; the trainer (actor 0) trains the
    # policy it rolled out with, so nothing is reloaded between the rollout and the training
    assert [(n.backbone, n.lora) for n in first["policy"]] == [(1, 0), (1, 0)]
    # iteration 1: actor 0 holds the trained policy already; actor 1 swaps in its LoRA only
    assert [(n.backbone, n.lora) for n in second["policy"]] == [(1, 0), (1, 1)]
    assert first["scorer"] == second["scorer"] == [1, 1]


def _killed_once(tally, marker: str):
    """A rollout shard's progress callback: counts with `tally`, and at the first step it is
    called for, SIGKILLs the process it runs in (a policy actor's, mid-shard) unless `marker`
    exists, which it creates first: the shard Ray retries on the restarted actor runs through."""

    def progress(n: int) -> None:
        tally(n)
        if not os.path.exists(marker):
            open(marker, "x").close()
            os.kill(os.getpid(), signal.SIGKILL)

    return progress


def _dies_mid_shard(actor, marker: str) -> SimpleNamespace:
    """`actor` as `Workers.rollout` calls it, its shard's progress callback (the last argument)
    made `_killed_once`."""

    def remote(*args):
        *head, tally = args
        return actor.rollout_shard.remote(*head, _killed_once(tally, marker))

    return SimpleNamespace(rollout_shard=SimpleNamespace(remote=remote))


@pytest.mark.slow
def test_a_killed_actors_shard_is_redone(ray_run, tmp_path_factory):
    """SIGKILL a policy actor mid-shard: Ray restarts it and retries the shard on the new
    process, and the stage writes the single-process rows and blobs, with no shard blob left
    over. The actor's process kills itself at its shard's first ODE step, however slow the
    machine: a kill timed from outside (a sleep) can land before the shard starts or after it
    returned (no retry to test), or while the shard's blob is written (SIGKILL leaves
    `atomic_write`'s temp file in blobs/, which the last check counts)."""
    local_store, _, _, local = reference(tmp_path_factory)
    _, recipe, _, _, _ = ray_run
    base = tmp_path_factory.mktemp("ray-fault")
    store, marker = Store(base / "store"), base / "killed"
    stages = plain_stages()
    setup = run_setup(stages, store, recipe)
    with executor(recipe) as workers:
        victim = workers.policy[1]
        pid = ray.get(victim.__ray_call__.remote(lambda self: os.getpid()))
        dying = replace(workers, policy=(workers.policy[0], _dies_mid_shard(victim, str(marker))))
        ref = stages.rollout(store, recipe, setup["build_csgs"], setup["calibrate_window"], 0,
                             workers=dying)
        restarted = ray.get(victim.__ray_call__.remote(lambda self: os.getpid()))
        loads = ray.get(victim.loads.remote())
        workers.release()
    assert marker.exists() and restarted != pid
    assert (loads.backbone, loads.lora) == (1, 0)  # the new process sampled the shard again
    assert _rows(store, ref, "rollouts") == _rows(local_store, local["rollout"], "rollouts")
    assert ref.content_hash == local["rollout"].content_hash
    recorded = {p for record in store.stage_records() for p in record.paths}
    stored = {p.relative_to(store.root).as_posix() for p in (store.root / "blobs").rglob("*.*")}
    assert stored == {p for p in recorded if p.startswith("blobs/")}


# one optimizer step over all 16 samples: at a second step Adam divides gradients that are
# float32 noise (the LoRA A factors' ~1e-10, far below its eps) by eps, which turns their
# rounding differences into ~1e-6 weight differences however the sum is split
ONE_STEP = {"train.steps_per_epoch": 1}


def _data_parallel(tmp_path_factory, **extra) -> tuple:
    """Iteration 0 of the CI run (with `extra`) in one optimizer step, on one process and with
    two training actors -> (local store and refs, Ray store and refs, each policy actor's held
    policy hash, the samples each read the window steps of, the Ray run's recipe and setup)."""
    from tests.pipeline_helpers import run_iteration as run_local

    _, _, prompts, _ = reference(tmp_path_factory)
    base = tmp_path_factory.mktemp("ray-ddp")
    local_store = Store(base / "local")
    local = run_local(local_store, ci_recipe(prompts, **ONE_STEP, **extra), 0)
    recipe = ci_recipe(prompts, **RAY, **ONE_STEP, **extra, **{"ray.train_workers": 2})
    store = Store(base / "ray")
    stages = plain_stages()
    with executor(recipe) as workers:
        setup = run_setup(stages, store, recipe)
        refs = run_iteration(stages, store, recipe, setup, 0, workers=workers)
        held = ray.get([a.__ray_call__.remote(lambda self: self.resident.policy_hash)
                        for a in workers.policy])
        read = ray.get([a.__ray_call__.remote(lambda self: self.samples_read)
                        for a in workers.policy])
        workers.release()
    return local_store, local, store, {**setup, **refs}, held, read, recipe


def _solo_update_kl(store: Store, recipe, refs: dict) -> float:
    """`update_kl_nats` of the policy the ranks trained, on the stored rollout, computed by one
    process: what the ranks computed together, each replaying its own samples."""
    from cast_core.update_kl import update_kl_nats
    from tasks.stages.policy_state import load_policy_of, policy_for
    from tasks.stages.score_atoms import load_rollout_rows
    from tasks.stages.train_epoch import read_batch

    backbone, _ = load_policy_of(store, recipe, policy_for(store, recipe, 1))
    batch = read_batch(store, recipe, load_rollout_rows(store, refs["rollout"]),
                       refs["build_csgs"], refs["compute_advantages"], None, torch.device("cpu"))
    return update_kl_nats(backbone, batch.prompts, batch.rollout, batch.spec,
                          micro_batch=recipe.train.micro_batch).nats


@pytest.fixture(scope="module")
def data_parallel_run(cluster, tmp_path_factory):
    return _data_parallel(tmp_path_factory)


@pytest.fixture(scope="module")
def nft_data_parallel_run(cluster, tmp_path_factory):
    return _data_parallel(tmp_path_factory, **{"train.objective": "nft"})


def _close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_two_training_actors_take_the_single_process_step(data_parallel_run):
    """gloo data parallelism over two actors: the LoRA and AdamW state of the single-process
    step over all samples (to 1e-6), the same step row, one writer, and both actors holding the
    trained policy."""
    local_store, local, store, refs, held, read, recipe = data_parallel_run
    got = _rows(store, refs["train_epoch"], "checkpoints")[0]
    want = _rows(local_store, local["train_epoch"], "checkpoints")[0]
    for path in ("lora_path", "optimizer_path"):
        _close(store.get_tensors(got[path]), local_store.get_tensors(want[path]))
    assert held == [got["policy_hash"]] * 2
    steps = [_rows(s, r["train_epoch"], "train_steps") for s, r in ((store, refs),
                                                                    (local_store, local))]
    assert [r["samples"] for r in steps[0]] == [r["samples"] for r in steps[1]] == [16]
    for row, row0 in zip(*steps, strict=True):
        for field in ("loss", "grad_norm", "ratio_mean", "clip_fraction", "policy_kl_nats"):
            assert row[field] == pytest.approx(row0[field], rel=1e-5, abs=1e-7), field
    assert got["update_kl_nats"] == pytest.approx(_solo_update_kl(store, recipe, refs),
                                                  rel=1e-6)
    assert len(store.read_table("checkpoints")) == 1
    _read_own_shard(read, 16)


def _read_own_shard(read: list[tuple[int, ...]], n: int) -> None:
    """Each training rank read the window steps of its own samples only: the two ranks' reads
    are disjoint halves of the n samples (one optimizer step: parts of n / 2)."""
    assert [len(r) for r in read] == [n // 2, n // 2]
    assert sorted(read[0] + read[1]) == list(range(n))


@pytest.mark.slow
def test_two_training_actors_take_the_single_process_nft_step(nft_data_parallel_run):
    """The forward-process (NFT) objective over two gloo actors: the LoRA and AdamW state of
    the single-process step over all samples (to 1e-6), the same step row, one writer, each
    rank reading only its own samples."""
    local_store, local, store, refs, held, read, recipe = nft_data_parallel_run
    got = _rows(store, refs["train_epoch"], "checkpoints")[0]
    want = _rows(local_store, local["train_epoch"], "checkpoints")[0]
    for path in ("lora_path", "optimizer_path"):
        _close(store.get_tensors(got[path]), local_store.get_tensors(want[path]))
    assert got["param_change_norm"] > 1e-4  # the step moved the LoRA well beyond the tolerance
    assert held == [got["policy_hash"]] * 2
    steps = [_rows(s, r["train_epoch"], "train_steps") for s, r in ((store, refs),
                                                                    (local_store, local))]
    assert [r["objective"] for r in steps[0]] == [r["objective"] for r in steps[1]] == ["nft"]
    assert [r["samples"] for r in steps[0]] == [r["samples"] for r in steps[1]] == [16]
    for row, row0 in zip(*steps, strict=True):
        for field in ("loss", "grad_norm", "positive_share"):
            assert row[field] == pytest.approx(row0[field], rel=1e-5, abs=1e-7), field
    assert got["update_kl_nats"] == pytest.approx(_solo_update_kl(store, recipe, refs),
                                                  rel=1e-6)
    assert len(store.read_table("checkpoints")) == 1
    _read_own_shard(read, 16)


RECAST = {"recast.weighting": "recast", "recast.prompts": 8, "recast.samples_per_prompt": 2}


@pytest.mark.slow
def test_recast_gains_run_on_the_actors(cluster, tmp_path_factory, monkeypatch):
    """`recast.weighting = "recast"`: iterations 0 and 1 on the actors estimate ReCAST's gains on
    the resident policy actor (the base model, then the trained policy it holds) with the images
    scored on the scorer actors, and write the single process's gains rows; no actor reads the
    backbone twice."""
    from tests.pipeline_helpers import run_iteration as run_local

    _, _, prompts, _ = reference(tmp_path_factory)
    base = tmp_path_factory.mktemp("ray-recast")
    local_store = Store(base / "local")
    for k in (0, 1):
        run_local(local_store, ci_recipe(prompts, **RECAST), k)
    recipe = ci_recipe(prompts, **RAY, **RECAST)
    store = Store(base / "ray")
    stages = plain_stages()

    def no_load(*args, **kwargs):
        raise AssertionError("the flow's process loaded a backbone for recast_gains")

    for name in ("load_base", "load_policy"):  # the actors are other processes
        monkeypatch.setattr(f"tasks.stages.recast_gains.{name}", no_load)
    with executor(recipe) as workers:
        setup = run_setup(stages, store, recipe)
        refs = [run_iteration(stages, store, recipe, setup, k, workers=workers) for k in (0, 1)]
        loads = workers.loads()
        workers.release()
    assert all(not r["recast_gains"].skipped for r in refs)
    run = recipe.run.name
    for table in ("recast_gains", "checkpoints"):
        assert (table_rows(store, table, run) == table_rows(local_store, table, run)), table
    assert [n.backbone for n in loads["policy"]] == [1, 1]
    assert loads["scorer"] == [1, 1]
