"""The evaluation on the Ray executor's resident actors: images sampled by two policy actors in
shards of whole chunks and scored by two scorer actors give the evaluation one process writes
(the same rows and blobs), and a second evaluation on the same actors reloads no backbone, it
only swaps the LoRA. Slow: a local cluster starts and its actors load their models."""

import shutil

import pytest

from tasks.stages.evaluate import evaluate_checkpoint
from tasks.stages.ray_workers import chunk_shards, connect, init_ray
from tasks.store.store import Store
from tests.pipeline_helpers import RAY_TWO_CPUS, ci_recipe, reference

RAY = RAY_TWO_CPUS
CHUNK = {"sampling.chunk_size": 4}  # the CI eval's 8 images a split: two chunks, one an actor


def test_chunk_shards_are_runs_of_whole_chunks():
    assert chunk_shards(8, 4, 2) == [(0, 4), (4, 8)]
    assert chunk_shards(13, 4, 3) == [(0, 4), (4, 8), (8, 13)]
    assert chunk_shards(10, 4, 2) == [(0, 4), (4, 10)]  # 3 chunks: 1 + 2
    assert chunk_shards(8, 64, 2) == [(0, 8)]  # one chunk: one actor
    assert chunk_shards(0, 4, 2) == []


@pytest.mark.slow
def test_evaluation_on_the_actors_is_the_local_one(tmp_path, tmp_path_factory):
    ray = pytest.importorskip("ray")
    reference_store, _, prompts, _ = reference(tmp_path_factory)
    roots = {arm: tmp_path / arm for arm in ("local", "ray")}
    for root in roots.values():  # the reference run's checkpoint of iteration 0, in two copies
        shutil.copytree(reference_store.root, root)
    local, on_ray = ci_recipe(prompts, **CHUNK), ci_recipe(prompts, **RAY, **CHUNK)
    iterations = (-1, 0)  # the base model (the fresh LoRA), then the trained one
    want = {k: evaluate_checkpoint(Store(roots["local"]), local, k) for k in iterations}
    init_ray("", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        got = {k: evaluate_checkpoint(Store(roots["ray"]), on_ray, k) for k in iterations}
        workers = connect(on_ray)
        loads = workers.loads()
        workers.release()
    finally:
        ray.shutdown()
    for k in iterations:
        assert not got[k].skipped
        rows = [Store(roots[arm]).read_output(ref[k], "evals").to_pylist()
                for arm, ref in (("ray", got), ("local", want))]
        assert rows[0] == rows[1], k
        assert got[k].content_hash == want[k].content_hash, k  # grids, image scores, plot
    # each policy actor sampled a shard of both evaluations: one backbone read, one LoRA swap
    assert [(n.backbone, n.lora) for n in loads["policy"]] == [(1, 1), (1, 1)]
    assert loads["scorer"] == [1, 1]
