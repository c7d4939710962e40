"""The Ray executor's run-level stages on a local cluster of two CPUs: the window calibration
measures its curves on the first policy actor, with the backbone that actor then keeps for the
whole run, and a local LLM CSG builder builds its graphs there; the rows equal the local
executor's, and the flow's process reads no backbone from disk for the whole run. The actor's
calibration, and the policy actors' rollout shards, move the stage's progress bar in the flow's
process (`tasks.stages.ray_progress`). Fast tests call a policy actor's calibration and rollout
shard in this process (no Ray), and the bar's arithmetic.

Slow (the Ray tests): starting the cluster and its actors' processes costs tens of seconds on two
cores."""

import json
import time
from contextlib import contextmanager

import pytest
import torch

from cast_core.backbones.shapes import ShapesBackbone
from cast_core.csg.llm import DEFAULT_TEMPLATE
from cast_core.csg.llm_schema import parse_spec
from tasks.stages.build_csgs import build_csgs
from tasks.stages.calibrate_window import calibrate_window, calibration_bar
from tasks.stages.iteration import plain_stages, run_iteration, run_setup
from tasks.stages.models import builder_id
from tasks.stages.policy_state import base_policy
from tasks.stages.ray_actors import PolicyWorker
from tasks.stages.ray_progress import RemoteProgress, Tally, remote_progress, start_counter
from tasks.stages.ray_workers import _runtime_env, executor, init_ray, shards
from tasks.stages.rollout import rollout_bar
from tasks.store.store import Store
from tests.pipeline_helpers import ci_recipe, reference, write_small_prompts
from tests.test_ray_executor import RAY

ray = pytest.importorskip("ray")

RUN_TABLES = {"build_csgs": ("csgs", "atoms"),
              "calibrate_window": ("calibration_curves", "windows")}


@pytest.fixture(scope="module")
def cluster():
    init_ray("", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def _rows(store: Store, ref, table: str) -> list[dict]:
    return store.read_output(ref, table).to_pylist()


class InProcess:
    """The `Workers` call of the calibration, answered by a policy actor's object in this
    process (no Ray)."""

    def __init__(self, actor: PolicyWorker) -> None:
        self.actor = actor

    def calibration_curves(self, recipe, prompts: list[str], seeds: list[int]):
        return self.actor.calibration_curves(recipe, prompts, seeds)


def test_a_held_backbone_calibrates_as_the_base_model(tmp_path_factory):
    """A policy actor's calibration on the backbone it holds, its adapter off, writes the local
    stage's rows, whichever policy the adapter holds (here one with nonzero weights); a fresh
    actor loads the backbone once, holding iteration 0's policy, so its first rollout swaps
    nothing."""
    local_store, _, prompts, local = reference(tmp_path_factory)
    recipe = ci_recipe(prompts)
    trained = PolicyWorker()
    trained.resident.get(local_store, recipe, base_policy(recipe))
    with torch.no_grad():
        for p in trained.resident.params:
            p.add_(0.1)  # B was zero: the adapter now changes the velocity
    trained.resident.trained("some-trained-policy")
    fresh = PolicyWorker()
    for name, actor in (("trained", trained), ("fresh", fresh)):
        store = Store(tmp_path_factory.mktemp(f"held-{name}") / "store")
        ref = calibrate_window(store, recipe, workers=InProcess(actor))
        for table in RUN_TABLES["calibrate_window"]:
            assert _rows(store, ref, table) == _rows(local_store, local["calibrate_window"],
                                                     table), (name, table)
        assert ref.content_hash == local["calibrate_window"].content_hash, name
    assert trained.resident.policy_hash == "some-trained-policy"
    assert fresh.resident.policy_hash == base_policy(recipe).policy_hash
    fresh.resident.get(local_store, recipe, base_policy(recipe))
    assert (fresh.resident.loads.backbone, fresh.resident.loads.lora) == (1, 0)


@pytest.mark.slow
def test_the_whole_run_loads_the_backbone_on_the_actors_only(cluster, tmp_path_factory,
                                                            monkeypatch):
    """Setup and iterations 0 and 1 on the actors: the calibration's rows (windows and curves,
    their plot blob too) and the CSG rows equal the local run's, and iteration 0's rollout is
    the local one on that window; the flow's process never loads the backbone nor samples the
    calibration's curves, and each policy actor loads the backbone once (actor 0 calibrates
    with it, then rolls out with it without swapping the adapter)."""
    local_store, _, prompts, local = reference(tmp_path_factory)  # before the counting below
    recipe = ci_recipe(prompts, **RAY)
    assert recipe.window.mode == "calibrated"
    store = Store(tmp_path_factory.mktemp("ray-run-stages") / "store")
    flow_loads = []
    load = ShapesBackbone.from_pretrained

    def counted(*args, **kwargs):
        flow_loads.append(args)
        return load(*args, **kwargs)

    def no_curves(*args, **kwargs):
        raise AssertionError("the flow's process sampled the calibration's curves")

    monkeypatch.setattr(ShapesBackbone, "from_pretrained", counted)
    monkeypatch.setattr("tasks.stages.calibrate_window.similarity_curves", no_curves)
    stages = plain_stages()
    with executor(recipe) as workers:
        setup = run_setup(stages, store, recipe, workers=workers)
        after_setup = workers.loads()
        refs = [run_iteration(stages, store, recipe, setup, k, workers=workers) for k in (0, 1)]
        loads = workers.loads()
        workers.release()
    for stage, tables in RUN_TABLES.items():
        assert not setup[stage].skipped, stage
        for table in tables:
            assert _rows(store, setup[stage], table) == _rows(local_store, local[stage], table)
        assert setup[stage].content_hash == local[stage].content_hash, stage
    assert refs[0]["rollout"].content_hash == local["rollout"].content_hash
    assert flow_loads == []
    assert [(n.backbone, n.lora) for n in after_setup["policy"]] == [(1, 0), (0, 0)]
    assert [(n.backbone, n.lora) for n in loads["policy"]] == [(1, 0), (1, 1)]
    assert loads["scorer"] == [1, 1]


class Bar:
    """A stand-in for `progress.stage_progress` that records the bars opened and their moves."""

    def __init__(self) -> None:
        self.opened: list[tuple[int, str]] = []
        self.moves: list[int] = []

    @contextmanager
    def __call__(self, total: int, desc: str, *args, **kwargs):
        self.opened.append((total, desc))
        yield self.moves.append


def test_the_relayed_bar_stops_at_its_total():
    bar = Bar()
    progress = RemoteProgress(Tally(None), bar.moves.append, 5)
    assert [progress._show(n, shown) for n, shown in ((3, 0), (0, 3), (4, 3), (1, 5))] == [
        3, 0, 2, 0]
    assert bar.moves == [3, 2]  # a retried call's counts do not push the bar past 5


@pytest.mark.slow
def test_the_actors_calibration_moves_the_bar_in_the_flows_process(cluster, tmp_path_factory,
                                                                    monkeypatch):
    """The calibration on the first policy actor opens the local stage's bar (its total and
    description) in the flow's process and fills it; the flow's process opens no other."""
    _, _, prompts, local = reference(tmp_path_factory)
    recipe = ci_recipe(prompts, **RAY)
    bar = Bar()
    monkeypatch.setattr("tasks.stages.ray_progress.stage_progress", bar)
    monkeypatch.setattr("tasks.stages.calibrate_window.stage_progress", bar)
    with executor(recipe) as workers:
        store = Store(tmp_path_factory.mktemp("ray-calibration-bar") / "store")
        ref = calibrate_window(store, recipe, workers=workers)
        workers.release()
    assert ref.content_hash == local["calibrate_window"].content_hash
    total, desc = calibration_bar(recipe.window.calibration_prompts, recipe.sampling)
    assert bar.opened == [(total, desc)]
    assert sum(bar.moves) == total


def test_a_policy_actors_rollout_shard_counts_each_step_of_each_chunk(tmp_path):
    """A policy actor's rollout shard calls its progress callback once after each ODE step of
    each of its chunks: the units of the rollout's bar for its samples (the shard is called in
    this process, no Ray); the bar of a sharded rollout counts each shard's chunks."""
    recipe = ci_recipe(write_small_prompts(tmp_path / "prompts.jsonl"),
                       **{"sampling.chunk_size": 3})
    picks = [{"prompt_id": "p0", "prompt": "a photo of a red circle"},
             {"prompt_id": "p1", "prompt": "a photo of two blue squares"}]
    calls: list[int] = []
    PolicyWorker().rollout_shard(str(tmp_path / "store"), recipe, base_policy(recipe),
                                 {"window_start": 1, "window_end": 4}, picks, 0, calls.append)
    assert calls == [1] * (3 * 6)  # ceil(8 samples / 3) chunks x 6 steps
    assert rollout_bar([8], recipe.sampling, 0) == (3 * 6, "rollout 0 (8 samples)")
    assert rollout_bar([8, 8], recipe.sampling, 0) == (2 * 3 * 6, "rollout 0 (16 samples)")


@pytest.mark.slow
def test_the_actors_rollout_moves_the_bar_in_the_flows_process(cluster, tmp_path_factory,
                                                                monkeypatch):
    """A rollout in shards on the policy actors opens the local stage's bar in the flow's
    process (its description; its total counts each shard's chunks) and fills it, the steps
    the actors counted moving it; the rollout is the local one."""
    _, _, prompts, local = reference(tmp_path_factory)
    recipe = ci_recipe(prompts, **RAY)
    store = Store(tmp_path_factory.mktemp("ray-rollout-bar") / "store")
    stages = plain_stages()
    setup = run_setup(stages, store, recipe)  # in this process, before the bar is watched
    bar, relayed = Bar(), []
    show = RemoteProgress._show

    def taken(progress: RemoteProgress, n: int, shown: int) -> int:
        relayed.append(n)  # what the counter handed over; the last call fills the bar
        return show(progress, n, shown)

    monkeypatch.setattr("tasks.stages.ray_progress.stage_progress", bar)
    monkeypatch.setattr("tasks.stages.rollout.stage_progress", bar)
    monkeypatch.setattr(RemoteProgress, "_show", taken)
    with executor(recipe) as workers:
        ref = stages.rollout(store, recipe, setup["build_csgs"], setup["calibrate_window"], 0,
                             workers=workers)
        workers.release()
    assert ref.content_hash == local["rollout"].content_hash
    g, b = recipe.prompts.group_size, recipe.prompts.per_iteration
    total, desc = rollout_bar([len(p) * g for p in shards(range(b), recipe.ray.rollout_workers)],
                              recipe.sampling, 0)
    assert bar.opened == [(total, desc)]
    assert sum(bar.moves) == total
    # the counter handed the actors' counts over (every `_show` but the last, which fills the
    # bar once the calls have returned: counts still in flight then are filled in, so that
    # some arrive is certain, not how many)
    assert sum(relayed[:-1]) > 0, relayed


@pytest.mark.slow
def test_an_actors_counts_reach_the_bar_while_its_call_runs(cluster, monkeypatch):
    """Units an actor's call counts with its `Tally` move the bar in this process before the
    call returns (several moves, not one at the end), and they add up to the total."""
    bar = Bar()
    monkeypatch.setattr("tasks.stages.ray_progress.stage_progress", bar)

    def ticking(tally: Tally, n: int) -> int:
        ray.get(tally.counter.add.remote(0))  # the counter actor is up
        for _ in range(n):
            tally(1)
            time.sleep(1.0)
        return n

    counter = start_counter(runtime_env=_runtime_env())
    with remote_progress(4, "ticks", counter) as progress:
        call = ray.remote(num_cpus=0)(ticking).remote(progress.tally, 4)
        assert progress.get([call]) == [4]
    ray.kill(counter)
    assert bar.opened == [(4, "ticks")]
    assert sum(bar.moves) == 4 and len(bar.moves) >= 2, bar.moves


PROMPT = "a photo of two red circles left of a blue square"
RECORD = {"tag": "position", "prompt": PROMPT,
          "include": [{"class": "square", "count": 1, "color": "blue"},
                      {"class": "circle", "count": 2, "color": "red", "position": ["left of", 0]}]}
ANSWER = {"objects": [{"id": "circles", "noun": "circle", "count": 2,
                       "attributes": {"color": "red"}},
                      {"id": "sq", "noun": "square", "count": 1, "attributes": {"color": "blue"}}],
          "relations": [{"subject": "circles", "relation": "left of", "object": "sq"}]}


def _llm_recipe(lm, prompts, cache: str):
    return ci_recipe(prompts, **RAY, **{"builder.kind": "llm-local", "builder.model": str(lm),
                                        "builder.max_tokens": 16, "builder.cache_dir": cache})


@pytest.mark.slow
def test_a_local_llm_builder_builds_on_the_first_policy_actor(cluster, tmp_path_factory,
                                                              monkeypatch):
    """`builder.kind = "llm-local"` with the Ray executor: the graphs are built on the first
    policy actor (the flow's process loads no builder) into the local executor's rows, the
    tiny random model's answer for the one prompt read from the builder's cache; without that
    answer the model fails, and the stage raises the local stage's PromptFileError, naming the
    file and line."""
    from cast_core.shapes.prompts import PromptFileError
    from tasks.stages.csg_cache import CsgCache
    from tests.tiny_models import save_causal_lm

    base = tmp_path_factory.mktemp("ray-llm")
    lm = save_causal_lm(base / "lm", [m["content"] for m in DEFAULT_TEMPLATE.messages(PROMPT)])
    prompts = base / "prompts.jsonl"
    prompts.write_text(json.dumps(RECORD) + "\n")
    recipe = _llm_recipe(lm, prompts, str(base / "cache"))
    CsgCache(recipe.builder.cache_dir).put(PROMPT, builder_id(recipe), DEFAULT_TEMPLATE.version,
                                           parse_spec(ANSWER).to_dict())
    local_store = Store(base / "local")
    local = build_csgs(local_store, recipe)

    def no_builder(*args, **kwargs):
        raise AssertionError("the flow's process loaded the CSG builder")

    monkeypatch.setattr("tasks.stages.build_csgs.graph_builder", no_builder)
    with executor(recipe) as workers:
        store = Store(base / "ray")
        got = build_csgs(store, recipe, workers=workers)
        uncached = _llm_recipe(lm, prompts, str(base / "empty-cache"))
        with pytest.raises(PromptFileError, match="line 1: the CSG builder failed"):
            build_csgs(Store(base / "ray-fails"), uncached, workers=workers)
        workers.release()
    for table in RUN_TABLES["build_csgs"]:
        assert _rows(store, got, table) == _rows(local_store, local, table)
    assert got.content_hash == local.content_hash
