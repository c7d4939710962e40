"""The one stage order of a run: the run-level stages (CSGs, then the window), and each
iteration's rollout -> atom scores -> advantages -> [ReCAST gains] -> training epoch; and which
iteration is next (`next_iteration`).

The flow (`flows/cast.py`) passes the stages' Prefect tasks, the benchmark and the tests pass the
plain functions (`plain_stages()`); everything else about a stage (its inputs, cache key, resume)
lives in the stage's own module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ITERATION_STAGES = ("rollout", "score_atoms", "compute_advantages", "recast_gains",
                    "train_epoch")  # recast_gains only when the recipe weights steps by ReCAST
RUN_STAGES = ("build_csgs", "calibrate_window")


@dataclass(frozen=True)
class Stages:
    """The stage callables, each with its stage module's signature (store, recipe, ...)."""

    build_csgs: Callable[..., Any]
    calibrate_window: Callable[..., Any]
    rollout: Callable[..., Any]
    score_atoms: Callable[..., Any]
    compute_advantages: Callable[..., Any]
    recast_gains: Callable[..., Any]
    train_epoch: Callable[..., Any]


def plain_stages() -> Stages:
    """The stages as plain functions (no Prefect), imported on first use."""
    from tasks.stages.build_csgs import build_csgs
    from tasks.stages.calibrate_window import calibrate_window
    from tasks.stages.compute_advantages import compute_advantages
    from tasks.stages.recast_gains import gains_for_training
    from tasks.stages.rollout import rollout_groups
    from tasks.stages.score_atoms import score_atoms
    from tasks.stages.train_epoch import train_epoch

    return Stages(build_csgs, calibrate_window, rollout_groups, score_atoms, compute_advantages,
                  gains_for_training, train_epoch)


def next_iteration(store, recipe) -> int:
    """Last iteration whose training finished, plus one (0 for a new run)."""
    return store.last_finished_iteration(recipe.run.name, "train_epoch") + 1


def run_setup(stages: Stages, store, recipe,
              before: Callable[[str], None] | None = None,
              workers: Any = None) -> dict[str, Any]:
    """The run-level stages in order -> {"build_csgs": ref, "calibrate_window": ref}; `before`
    is called with each stage's name before it starts. `workers`: the Ray executor's actors,
    passed to both (the calibration measures its curves on a policy actor; a local LLM builder
    builds there); None computes them here."""
    before = before or _nothing
    on = {} if workers is None else {"workers": workers}
    before("build_csgs")
    csgs = stages.build_csgs(store, recipe, **on)
    before("calibrate_window")
    return {"build_csgs": csgs, "calibrate_window": stages.calibrate_window(store, recipe, **on)}


def run_iteration(stages: Stages, store, recipe, setup: dict[str, Any], k: int,
                  before: Callable[[str], None] | None = None,
                  workers: Any = None) -> dict[str, Any]:
    """Iteration k's stages in order -> {stage: ref} (the keys of `ITERATION_STAGES` that ran;
    "recast_gains" only with `recast.weighting = "recast"`, its ref naming the iteration the
    gains were estimated on); `before` is called with each stage's name before it starts.
    `workers`: the Ray executor's actors (`tasks.stages.ray_workers.executor`), passed to the
    rollout, scoring, ReCAST gains and training; None computes every stage here."""
    before = before or _nothing
    on = {} if workers is None else {"workers": workers}
    csgs, window = setup["build_csgs"], setup["calibrate_window"]
    before("rollout")
    ro = stages.rollout(store, recipe, csgs, window, k, **on)
    before("score_atoms")
    sc = stages.score_atoms(store, recipe, csgs, ro, k, **on)
    before("compute_advantages")
    ad = stages.compute_advantages(store, recipe, ro, sc, k)
    refs = {"rollout": ro, "score_atoms": sc, "compute_advantages": ad}
    gains = None
    if recipe.recast.weighting == "recast":
        before("recast_gains")
        refs["recast_gains"] = gains = stages.recast_gains(store, recipe, k, **on)
    before("train_epoch")
    refs["train_epoch"] = stages.train_epoch(store, recipe, csgs, ro, sc, ad, k, gains, **on)
    return refs


def _nothing(stage: str) -> None:
    return None
