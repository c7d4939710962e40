"""The one stage order (tasks/stages/iteration.py), checked with stand-in stage callables that
record their calls: the flow, the benchmark and the tests all go through it."""

from types import SimpleNamespace

from tasks.stages.iteration import ITERATION_STAGES, RUN_STAGES, Stages, run_iteration, run_setup


def recording_stages(calls: list) -> Stages:
    def stage(name):
        def call(store, recipe, *args):
            calls.append((name, args))
            return SimpleNamespace(stage=name, iteration=args[-1] if args else -1)
        return call

    return Stages(*(stage(n) for n in (*RUN_STAGES, *ITERATION_STAGES)))


def test_stages_run_in_the_one_order_and_get_their_inputs():
    calls, started = [], []
    stages = recording_stages(calls)
    recipe = SimpleNamespace(recast=SimpleNamespace(weighting="none"))
    setup = run_setup(stages, "store", recipe, started.append)
    refs = run_iteration(stages, "store", recipe, setup, 3, started.append)
    assert [c[0] for c in calls] == started == [
        "build_csgs", "calibrate_window", "rollout", "score_atoms", "compute_advantages",
        "train_epoch"]
    csgs, window = setup["build_csgs"], setup["calibrate_window"]
    ro, sc, ad = refs["rollout"], refs["score_atoms"], refs["compute_advantages"]
    assert dict(calls)["rollout"] == (csgs, window, 3)
    assert dict(calls)["score_atoms"] == (csgs, ro, 3)
    assert dict(calls)["compute_advantages"] == (ro, sc, 3)
    assert dict(calls)["train_epoch"] == (csgs, ro, sc, ad, 3, None)
    assert list(refs) == ["rollout", "score_atoms", "compute_advantages", "train_epoch"]


def test_recast_gains_run_before_training_and_reach_it():
    calls = []
    stages = recording_stages(calls)
    recipe = SimpleNamespace(recast=SimpleNamespace(weighting="recast"))
    refs = run_iteration(stages, "store", recipe, run_setup(stages, "store", recipe), 0)
    assert [c[0] for c in calls][-2:] == ["recast_gains", "train_epoch"]
    assert calls[-1][1][-1] is refs["recast_gains"]
