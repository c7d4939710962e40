"""The CAST vs Flow-GRPO benchmark (benchmarks/bench_methods.py, the benchmarks/methods package):
its statistics against closed forms and known t quantiles, the protocol's recipes and eval passes,
the summary and figures.json on synthetic results, and (slow) the whole command at a tiny size."""

import ast
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_methods as cli
from methods import stats
from methods.arms import (
    BASELINE,
    CAST_RECIPE,
    FIXES,
    NFT,
    NFT_STEP,
    ONE_CHANGE,
    RECAST_PAIRS,
    SKEWED,
    Arm,
    arms,
    check_equal_budget,
    select_arms,
)
from methods.benchmark import run_benchmark
from methods.figures import figures, hacking_figures
from methods.protocols import (
    EVAL,
    FINAL_SPLITS,
    FULL,
    HARD,
    POOL,
    PROTOCOLS,
    QUICK,
    Size,
    check_paired_evals,
    eval_passes,
    pool_file,
    recipe_for,
    run_name,
    runs_as,
    with_eval,
)
from methods.report import what_was_tried
from methods.store_reads import Results
from methods.summary import ITERATION_STAGES, one_change, one_change_ratios, summarise
from methods.tables import (
    one_change_table,
    per_step_table,
    ratio_cell,
    type_gain_table,
    type_gains,
)

from tasks.stages.iteration import RUN_STAGES

# ---- statistics ---------------------------------------------------------------------------


@pytest.mark.parametrize(("df", "expected"), [(1, 12.706204736), (2, 4.302652730),
                                              (3, 3.182446305), (4, 2.776445105),
                                              (9, 2.262157163), (30, 2.042272456)])
def test_t_quantile_matches_tables(df, expected):
    assert stats.t_quantile(0.975, df) == pytest.approx(expected, abs=1e-6)


def test_t_quantile_df1_closed_form():
    # Cauchy: the p-quantile is tan(pi (p - 1/2))
    for p in (0.6, 0.9, 0.99):
        assert stats.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), abs=1e-6)


def test_t_interval_on_known_numbers():
    values = [1.0, 2.0, 3.0, 4.0]
    iv = stats.t_interval(values)
    half = 3.182446305 * statistics.stdev(values) / 2  # t_{0.975, 3} * s / sqrt(4)
    assert (iv.mean, iv.n) == (2.5, 4)
    assert iv.low == pytest.approx(2.5 - half, abs=1e-6)
    assert iv.high == pytest.approx(2.5 + half, abs=1e-6)
    assert stats.t_interval([0.3]) == stats.Interval(0.3, None, None, 1)
    constant = stats.t_interval([0.2, 0.2, 0.2])
    assert constant.low == pytest.approx(0.2) and constant.high == pytest.approx(0.2)


def test_ratio_bootstrap_is_deterministic_and_brackets_the_ratio():
    num, den = [0.10, 0.04, 0.07, 0.12], [0.05, 0.03, 0.06, 0.02]
    a, b = stats.ratio_bootstrap(num, den, seed=3), stats.ratio_bootstrap(num, den, seed=3)
    assert a == b
    assert a.value == pytest.approx(np.mean(num) / np.mean(den))
    assert a.low < a.value < a.high and a.note == ""
    other = stats.ratio_bootstrap(num, den, seed=4)  # another seed: the same interval, roughly
    assert other.low == pytest.approx(a.low, rel=0.2) and other.high == pytest.approx(a.high,
                                                                                      rel=0.2)
    per_seed = np.asarray(num) / np.asarray(den)
    assert per_seed.min() <= a.low and a.high <= per_seed.max()


def test_ratio_bootstrap_closed_forms_and_refusals():
    same = stats.ratio_bootstrap([0.2, 0.4, 0.6], [0.1, 0.2, 0.3])  # every paired draw gives 2
    assert (same.value, same.low, same.high) == pytest.approx((2.0, 2.0, 2.0))
    worse = stats.ratio_bootstrap([0.1, 0.2], [-0.1, 0.05])
    assert worse.value is None and "<= 0" in worse.note
    one = stats.ratio_bootstrap([0.1], [0.05])
    assert one.value == pytest.approx(2.0) and one.low is None and "one seed" in one.note
    shaky = stats.ratio_bootstrap([0.1, 0.1, 0.1], [0.3, -0.2, -0.05])
    assert shaky.value is not None and shaky.low is None and "unbounded" in shaky.note
    with pytest.raises(ValueError, match="paired"):
        stats.ratio_bootstrap([0.1, 0.2], [0.1])


def test_samples_to_threshold_interpolates_the_first_crossing():
    x = [0, 100, 200, 300]
    curves = [[0.5, 0.6, 0.8, 0.7], [0.5, 0.7, 0.6, 0.9], [0.8, 0.9, 0.9, 0.9],
              [0.5, 0.6, 0.65, 0.69]]
    want = [150.0, 100.0, 0.0, None]  # 0.0: the base is there already; None: never
    for y, w in zip(curves, want):
        assert stats.samples_to_threshold(x, y, 0.7) == (None if w is None else pytest.approx(w))
    vectorised = stats._crossings(np.array(curves), np.full(4, 0.7), np.array(x, float))
    assert vectorised.tolist() == pytest.approx([150.0, 100.0, 0.0, math.inf])


def test_crossing_ratio_closed_forms_and_refusals():
    x = [0, 100, 200, 300, 400]
    baseline = [[0.5, 0.55, 0.6, 0.65, 0.7]] * 3  # reaches its final 0.7 at 400
    fast = [[0.5, 0.6, 0.7, 0.7, 0.75]] * 3  # reaches 0.7 at 200
    r = stats.crossing_ratio(fast, baseline, x)
    assert (r.value, r.low, r.high) == pytest.approx((0.5, 0.5, 0.5))  # identical seeds
    slow = [[0.5, 0.5, 0.55, 0.6, 0.65]] * 3
    never = stats.crossing_ratio(slow, baseline, x)
    assert never.value is None and "never reaches" in never.note
    flat = stats.crossing_ratio(fast, [[0.5, 0.5, 0.5, 0.5, 0.5]] * 3, x)
    assert flat.value is None and "not above the base" in flat.note
    one = stats.crossing_ratio(fast[:1], baseline[:1], x)
    assert one.value == pytest.approx(0.5) and "one seed" in one.note
    noisy = stats.crossing_ratio([[0.5, 0.6, 0.7, 0.7, 0.8], [0.5, 0.55, 0.65, 0.72, 0.7]],
                                 [[0.5, 0.55, 0.6, 0.65, 0.72], [0.5, 0.52, 0.6, 0.66, 0.68]], x)
    assert noisy.low <= noisy.value <= noisy.high
    with pytest.raises(ValueError, match="paired by seed"):
        stats.crossing_ratio(fast, baseline[:2], x)


def _prompt_scores(per_prompt: list[list[list[float]]]) -> stats.PromptScores:
    """PromptScores from [prompt][image][atom] scores, through the evaluate stage's JSON."""
    flat = [img for prompt in per_prompt for img in prompt]
    return stats.PromptScores.from_json({"prompts": [f"p{i}" for i in range(len(per_prompt))],
                                         "images_per_prompt": len(per_prompt[0]), "scores": flat})


def test_checkpoint_figures_are_ratios_of_sums_with_prompt_clusters():
    s = _prompt_scores([[[1.0, 0.0], [1.0, 1.0]], [[0.2, 0.4, 0.6], [0.9, 0.9, 0.9]]])
    c = stats.checkpoint_figures(s)
    assert c.mean_score.mean == pytest.approx((1 + 0 + 1 + 1 + 0.2 + 0.4 + 0.6 + 2.7) / 10)
    assert c.strict_accuracy.mean == pytest.approx(2 / 4)  # [1, 1] and [0.9] x 3 pass
    assert c.images == 4 and c.mean_score.n == 2
    assert c.mean_score.low <= c.mean_score.mean <= c.mean_score.high
    # the bootstrap's extremes are the single-prompt means: 3 / 4 and 3.9 / 6
    assert c.mean_score.low >= 3.9 / 6 - 1e-12 and c.mean_score.high <= 0.75 + 1e-12
    # image noise only: A_p^2 I var_p summed, over (I sum A_p)^2
    var = [np.var([0.5, 1.0], ddof=1), np.var([0.4, 0.9], ddof=1)]
    want = 1.959963985 * math.sqrt(4 * 2 * var[0] + 9 * 2 * var[1]) / (2 * 5)
    assert c.noise_half_width == pytest.approx(want)
    same = _prompt_scores([[[0.5, 0.5]], [[0.5, 0.5]]])
    assert stats.checkpoint_figures(same).mean_score.low == pytest.approx(0.5)
    assert stats.checkpoint_figures(same).noise_half_width is None  # one image per prompt


def test_paired_gain_cancels_prompt_effects():
    old = _prompt_scores([[[0.2, 0.2], [0.4, 0.4]], [[0.8, 0.8], [0.6, 0.6]]])
    new = _prompt_scores([[[0.3, 0.3], [0.5, 0.5]], [[0.9, 0.9], [0.7, 0.7]]])
    score, strict = stats.paired_gain(new, old)
    assert (score.mean, score.low, score.high) == pytest.approx((0.1, 0.1, 0.1))
    assert strict.mean == pytest.approx(0.0)
    with pytest.raises(ValueError, match="same prompts"):
        stats.paired_gain(new, _prompt_scores([[[0.3, 0.3]]]))


# ---- protocol -----------------------------------------------------------------------------


def test_runs_as_renames_an_arms_runs_within_the_block_and_refuses_clashes():
    with runs_as({"cast": "cast-old", "cast-new": "cast"}, ["flowgrpo", "cast", "cast-new"]):
        assert run_name("bench", "cast", 2) == "bench-cast-old-s2"
        assert run_name("bench", "cast-new", 0) == "bench-cast-s0"
        assert run_name("bench", "flowgrpo", 1) == "bench-flowgrpo-s1"
    assert run_name("bench", "cast", 2) == "bench-cast-s2"  # restored after the block
    with pytest.raises(ValueError, match="two arms the run name"), \
            runs_as({"cast-new": "cast"}, ["cast", "cast-new"]):
        pass
    with pytest.raises(ValueError, match="not run"), runs_as({"nope": "x"}, ["cast"]):
        pass
    assert run_name("bench", "cast-new", 0) == "bench-cast-new-s0"


def test_sizes_and_samples_seen():
    assert FULL.samples()[:3] == [0, 128, 256]
    assert len(FULL.samples()) == FULL.iterations + 1
    assert (FULL.per_iteration, FULL.group_size, FULL.seeds) == (8, 16, 3)
    assert QUICK.seeds == 1
    with pytest.raises(ValueError, match=">= 1"):
        Size(iterations=0, seeds=1, per_iteration=1, group_size=2, probe_images=1,
             pool_images=1, hard_images=1, eval_images=1)
    with pytest.raises(ValueError, match="group_size >= 2"):
        Size(iterations=1, seeds=1, per_iteration=1, group_size=1, probe_images=1,
             pool_images=1, hard_images=1, eval_images=1)


def test_arms_train_on_the_pool_at_equal_budget_and_differ_only_where_meant():
    recipes = {a.name: recipe_for(a, 1, QUICK, f"t-{a.name}", 1) for a in arms()}
    check_equal_budget(list(recipes.values()))
    for r in recipes.values():
        assert (r.prompts.train, r.prompts.selection) == (POOL, "cycle")
        assert (r.prompts.per_iteration, r.prompts.group_size) == (8, 16)
    assert (recipes["flowgrpo"].advantage.kind, recipes["flowgrpo"].window.mode) == (
        "scalar", "fixed")
    assert (recipes["cast"].advantage.kind, recipes["cast"].window.mode) == (
        "spatial", "calibrated")
    assert recipes["cast-fixed-window"].window == recipes["flowgrpo"].window
    assert recipes["cast-no-map"].advantage.kind == "atom"
    late = recipes["cast-late-window"]
    assert (late.window.mode, late.window.start, late.window.size) == ("fixed", 6, 3)
    split, wide = recipes["cast-split-window"], recipes["flowgrpo-wide-window"]
    assert split.window == wide.window == recipes["cast-wide-window"].window
    assert (wide.window.start, wide.window.size, split.advantage.scalar_steps) == (0, 6, 3)
    assert (split.advantage.kind, wide.advantage.kind) == ("spatial", "scalar")
    assert recipes["cast-wide-window"].advantage.scalar_steps == 0
    for name, overrides, _ in FIXES:  # one change each to the cast arm
        changed = {f"{sec}.{k}" for sec in ("advantage", "train")
                   for k, v in getattr(recipes[name], sec).model_dump().items()
                   if v != getattr(recipes["cast"], sec).model_dump()[k]}
        assert changed == set(overrides), name
    for name, weighting in (("recast-equal", "recast"), ("static-skewed", "static"),
                            ("recast-skewed", "recast")):
        assert recipes[name].recast.weighting == weighting
    assert recipes["static-skewed"].recast.budget_map() == SKEWED
    other = recipe_for(arms()[1], 2, QUICK, "t-other", 1)
    with pytest.raises(ValueError, match="seed"):
        check_equal_budget([recipes["cast"], other])
    assert recipe_for(arms()[1], 1, QUICK, "t-lr", 1, lr=1e-2).train.lr == 1e-2
    free = recipe_for(arms()[1], 1, QUICK, "t-cfg", 1, guidance=1.0)
    assert free.sampling.guidance_scale == free.eval.guidance_scale == 1.0
    assert recipes[arms()[1].name].sampling.guidance_scale == 1.0  # the recipes' (CFG-free)
    guided = recipe_for(arms()[1], 1, QUICK, "t-cfg4", 1, guidance=4.0)
    assert guided.sampling.guidance_scale == guided.eval.guidance_scale == 4.0



def test_set_puts_one_lever_on_every_arm_after_its_overrides():
    settings = cli.parse_settings(["train.lora_rank=32", "train.lora_alpha=32.0",
                                   "window.size=4", "sampling.sde_kind=cps"])
    assert settings == {"train.lora_rank": 32, "train.lora_alpha": 32.0, "window.size": 4,
                        "sampling.sde_kind": "cps"}
    recipes = [recipe_for(a, 0, QUICK, f"t-{a.name}", 1, settings=settings)
               for a in arms("main")]
    for r in recipes:
        assert (r.train.lora_rank, r.train.lora_alpha, r.window.size) == (32, 32.0, 4)
    check_equal_budget(recipes)  # the same lever on every arm keeps them at equal budget
    late = next(a for a in arms() if a.name == "cast-late-window")
    assert recipe_for(late, 0, QUICK, "t-late", 1,
                      settings={"window.start": 2}).window.start == 2  # --set wins
    for bad in (["lora_rank=32"], ["train.lora_rank"], ["=3"]):
        with pytest.raises(ValueError, match="SECTION.FIELD=VALUE"):
            cli.parse_settings(bad)
    with pytest.raises(Exception, match="lora_rank"):  # the recipe loader checks the value
        recipe_for(arms()[0], 0, QUICK, "t-bad", 1, settings={"train.lora_rank": 0})

def test_suites_and_arm_selection():
    assert [a.name for a in arms("main")] == ["flowgrpo", "cast"]
    ablations = {a.name for a in arms("ablations")}
    for arm, reference, _ in ONE_CHANGE:  # every pair names two arms of the ablations suite
        assert {arm, reference} <= ablations, (arm, reference)
    recast = {a.name for a in arms("recast")}
    assert {a for pair in RECAST_PAIRS for a in pair} | {"flowgrpo"} == recast
    assert all(a.name in {b.name for b in arms()} for a in arms("ablations"))
    with pytest.raises(ValueError, match="suite"):
        arms("all")
    picked = select_arms("main", ["recast-equal", "flowgrpo"])  # any suite's arms
    assert [a.name for a in picked] == ["flowgrpo", "recast-equal"]
    for bad in (["cast"], ["flowgrpo", "nope"]):
        with pytest.raises(ValueError, match="must name known arms"):
            select_arms("main", bad)


def test_eval_passes_are_paired_across_arms_with_fresh_final_pool_noise():
    size = QUICK
    passes = eval_passes(size, {"hard": HARD, "eval": EVAL})
    assert (passes["probe"].splits, passes["probe"].seed_offset) == ({"probe": POOL}, 0)
    assert (passes["pool"].splits, passes["pool"].seed_offset) == ({"pool": POOL}, 1000)
    assert (passes["hard"].splits, passes["eval"].splits) == ({"hard": HARD},
                                                              {"eval": EVAL})
    assert (passes["hard"].seed_offset, passes["eval"].images) == (0, size.eval_images)
    assert passes["pool"].images == size.pool_images
    recipes = [recipe_for(a, 0, size, f"t-{a.name}", 1) for a in arms("main")]
    base = recipe_for(arms()[0], 0, size, "t-base", 1)
    check_paired_evals([base, *recipes], passes)
    probe = with_eval(recipes[1], passes["probe"])
    assert (probe.eval.images_per_prompt, probe.eval.max_prompts) == (size.probe_images, None)
    odd = recipes[1].model_copy(update={"eval": recipes[1].eval.model_copy(
        update={"num_steps": 6})})
    with pytest.raises(ValueError, match="not be paired"):
        check_paired_evals([base, odd], passes)


# ---- summary and figures on synthetic results ----------------------------------------------


def _results(size: Size, curves: dict, finals: dict, prefix: str = "t") -> Results:
    """Results with probe mean scores curves[arm][seed] ([K + 1], index 0 the base), final
    evaluation gains finals[arm][seed] on every split (each image's atoms all shifted), one
    second per stage and 2 s per evaluation."""
    splits, evals, scores, seconds = FINAL_SPLITS, {}, {}, {}
    base_atoms = [[[0.5, 0.4], [0.6, 0.5]], [[0.3, 0.7], [0.5, 0.5]]]  # [prompt][image][atom]

    def add(run, k, split, shift):
        s = _prompt_scores([[[a + shift for a in img] for img in p] for p in base_atoms])
        scores[(run, k, split)] = s
        c = stats.checkpoint_figures(s)
        evals[(run, k, split)] = {"mean_score": c.mean_score.mean,
                                  "strict_accuracy": c.strict_accuracy.mean, "hf_energy": 0.1}

    base_run = f"{prefix}-base"
    for split in splits:
        add(base_run, -1, split, 0.0)
    first = next(iter(curves.values()))[0][0]
    evals[(base_run, -1, "probe")] = {"mean_score": first, "strict_accuracy": 0.0,
                                      "hf_energy": 0.1}
    for arm, per_seed in curves.items():
        for x, curve in enumerate(per_seed):
            run = run_name(prefix, arm, x)
            for k in range(size.iterations):
                evals[(run, k, "probe")] = {"mean_score": curve[k + 1], "strict_accuracy": 0.0,
                                            "hf_energy": 0.1}
                seconds |= {(run, k, st): 1.0 for st in ITERATION_STAGES}
                seconds[(run, k, "eval:probe")] = 2.0
            seconds |= {(run, -1, st): 1.0 for st in RUN_STAGES}
            seconds |= {(run, size.iterations - 1, f"eval:{p}"): 2.0 for p in FINAL_SPLITS}
            for split in splits:
                add(run, size.iterations - 1, split, finals[arm][x])
    return Results(evals, seconds, scores, {}, {}, {}, {}, {}, {})


SMALL = Size(iterations=4, seeds=3, per_iteration=8, group_size=16, probe_images=4,
             pool_images=2, hard_images=2, eval_images=2)


def test_summary_curves_gains_efficiency_and_times():
    curves = {"flowgrpo": [[0.5, 0.55, 0.6, 0.65, 0.7]] * 3,
              "cast": [[0.5, 0.6, 0.7, 0.72, 0.75], [0.5, 0.6, 0.7, 0.7, 0.7],
                       [0.5, 0.6, 0.7, 0.74, 0.8]]}
    finals = {"flowgrpo": [0.02, 0.03, 0.04], "cast": [0.08, 0.09, 0.10]}
    res = _results(SMALL, curves, finals)
    sm = summarise(res, ["flowgrpo", "cast"], [0, 1, 2], "t", SMALL)
    assert sm.samples == [0, 128, 256, 384, 512]
    assert sm.curve[("cast", "mean_score")][2] == curves["cast"][2]
    assert sm.threshold == pytest.approx(0.7)
    assert sm.to_threshold[("cast", 0)] == pytest.approx(256.0)
    assert sm.to_threshold[("flowgrpo", 1)] == pytest.approx(512.0)
    assert sm.crossing["cast"].value == pytest.approx(0.5)
    assert sm.gains[("cast", "hard", "mean_score")] == pytest.approx(finals["cast"])
    assert sm.gain[("cast", "pool", "mean_score")].mean == pytest.approx(0.09)
    assert sm.diff[("cast", "eval", "mean_score")].mean == pytest.approx(0.06)
    assert sm.ratio[("cast", "hard", "mean_score")].value == pytest.approx(3.0)
    assert sm.seed_gain[("cast", 2, "pool", "mean_score")].mean == pytest.approx(0.10)
    assert sm.wall["cast"][0] == pytest.approx([2 / 60, 6 / 60, 10 / 60, 14 / 60, 18 / 60])
    # every stage of the run: 2 run-level + 4 x (4 stages + 2 s probe) + 3 x 2 s final
    assert sm.minutes[("cast", 1)] == pytest.approx((2 + 4 * 6 + 6) / 60)
    assert sm.stage_median[("cast", "iteration")] == 4.0
    assert sm.time_ratio[("cast", "iteration")] == 1.0
    one = summarise(_results(replace_seeds(SMALL, 1), {a: c[:1] for a, c in curves.items()},
                             finals), ["flowgrpo", "cast"], [0], "t", replace_seeds(SMALL, 1))
    assert one.gain[("flowgrpo", "pool", "mean_score")].low == pytest.approx(0.02)  # prompt CI


def replace_seeds(size: Size, seeds: int) -> Size:
    from dataclasses import replace

    return replace(size, seeds=seeds)


def _setup(quick=False, skipped=0, wall_s=600.0):
    return {"quick": quick, "skipped": skipped, "wall_s": wall_s}


def test_type_gains_are_paired_per_seed_and_skip_missing_types():
    curves = {"flowgrpo": [[0.5, 0.55, 0.6, 0.65, 0.7]] * 2}
    res = _results(SMALL, curves, {"flowgrpo": [0.1, 0.1]})
    sm = summarise(res, ["flowgrpo"], [0, 1], "t", SMALL)
    last = SMALL.iterations - 1
    types = {("t-base", -1, "hard", "count"): 0.4, ("t-base", -1, "hard", "object"): 0.8}
    types |= {(run_name("t", "flowgrpo", x), last, "hard", "count"): 0.4 - 0.1 * (x + 1)
              for x in (0, 1)}
    types |= {(run_name("t", "flowgrpo", x), last, "hard", "object"): 0.9 for x in (0, 1)}
    res = replace(res, type_evals=types)
    found = type_gains(res, sm, "t", last)
    assert set(found) == {("flowgrpo", "hard", "count"), ("flowgrpo", "hard", "object")}
    base, gain = found[("flowgrpo", "hard", "count")]
    assert base == pytest.approx(0.4) and gain.mean == pytest.approx(-0.15)
    assert gain.low < -0.15 < gain.high
    assert found[("flowgrpo", "hard", "object")][1].mean == pytest.approx(0.1)
    text = type_gain_table(res, sm, "t", last)
    assert "count: base, gain" in text and "attribute" not in text
    assert "-0.150" in text


def test_type_curves_follow_the_probe_per_type_and_skip_types_a_probe_lacks():
    from methods.plots import plot_type_curves

    curves = {"flowgrpo": [[0.5, 0.55, 0.6, 0.65, 0.7]] * 2}
    res = _results(SMALL, curves, {"flowgrpo": [0.1, 0.1]})
    assert summarise(res, ["flowgrpo"], [0, 1], "t", SMALL).type_curve == {}
    assert plot_type_curves(summarise(res, ["flowgrpo"], [0, 1], "t", SMALL)) is None
    types = {("t-base", -1, "probe", "count"): 0.1, ("t-base", -1, "probe", "object"): 0.6}
    for x in (0, 1):
        run = run_name("t", "flowgrpo", x)
        types |= {(run, k, "probe", "count"): 0.1 + 0.01 * k * x for k in range(4)}
        types |= {(run, k, "probe", "object"): 0.7 for k in range(3)}  # the last probe lacks it
    sm = summarise(replace(res, type_evals=types), ["flowgrpo"], [0, 1], "t", SMALL)
    assert set(sm.type_curve) == {("flowgrpo", "count")}
    assert sm.type_curve[("flowgrpo", "count")] == [[0.1] * 5,
                                                   pytest.approx([0.1, 0.1, 0.11, 0.12, 0.13])]
    assert plot_type_curves(sm)[:4] == b"\x89PNG"


def test_per_step_table_averages_iterations_then_seeds_and_shows_the_last_weights():
    curves = {"flowgrpo": [[0.5, 0.55, 0.6, 0.65, 0.7]] * 3,
              "cast": [[0.5, 0.6, 0.7, 0.72, 0.75]] * 3}
    finals = {"flowgrpo": [0.11, 0.12, 0.13], "cast": [0.36, 0.37, 0.38]}
    res = _results(SMALL, curves, finals)
    sm = summarise(res, ["flowgrpo", "cast"], [0, 1, 2], "t", SMALL)
    assert per_step_table(res, sm, "t") is None  # no run records per-step KLs
    # flowgrpo, 2 window steps: per seed the iterations' KLs [[0.01, 0.1], [0.03, 0.3]] -> mean
    # (0.02, 0.2) for every seed, velocities likewise (0.002, 0.004); its weights at the last
    # iteration (1.5, 0.5); cast unweighted, from checkpoints without velocities
    per_step = {f"t-flowgrpo-s{x}": ([[0.01, 0.1], [0.03, 0.3]], [[1.0, 1.0], [1.5, 0.5]],
                                     [[0.001, 0.003], [0.003, 0.005]]) for x in range(3)}
    per_step["t-cast-s0"] = ([[0.04, 0.04]], None, None)
    res = replace(res, per_step=per_step, windows={"t-flowgrpo-s0": ("fixed", 0, 2)})
    lines = per_step_table(res, sm, "t").splitlines()
    assert lines[2].split(" | ")[1:] == ["[0, 2)", "0.02 / 0.2", "10.0", "0.002 / 0.004",
                                         "1.50 / 0.50 |"]
    assert lines[3].split(" | ")[1:] == ["–", "0.04 / 0.04", "1.0", "–", "1 |"]


def test_figures_json_entries_and_met_logic():
    curves = {"flowgrpo": [[0.5, 0.55, 0.6, 0.65, 0.7]] * 3,
              "cast": [[0.5, 0.6, 0.7, 0.72, 0.75]] * 3}
    finals = {"flowgrpo": [0.11, 0.12, 0.13], "cast": [0.36, 0.37, 0.38]}
    sm = summarise(_results(SMALL, curves, finals), ["flowgrpo", "cast"], [0, 1, 2], "t",
                   SMALL)
    entries = {e["name"]: e for e in figures(sm, _setup())}
    assert set(entries) == {"flowgrpo pool gain", "flowgrpo hard gain", "minutes per arm and seed",
                            "cast / flowgrpo hard gain ratio",
                            "cast / flowgrpo samples to threshold", "full benchmark wall minutes"}
    for e in entries.values():
        assert set(e) == {"name", "value", "low", "high", "goal", "met", "unit", "about"}
    assert entries["flowgrpo pool gain"]["met"] is True  # 0.12 >= 0.10, interval above 0
    assert entries["flowgrpo hard gain"]["met"] is True  # >= 0.03
    assert entries["cast / flowgrpo hard gain ratio"]["value"] == pytest.approx(0.37 / 0.12)
    assert entries["cast / flowgrpo hard gain ratio"]["met"] is True
    assert entries["cast / flowgrpo samples to threshold"]["value"] == pytest.approx(0.5)
    assert entries["cast / flowgrpo samples to threshold"]["met"] is True
    assert entries["minutes per arm and seed"]["met"] is True
    assert entries["full benchmark wall minutes"]["value"] == pytest.approx(10.0)
    assert entries["full benchmark wall minutes"]["met"] is True
    json.dumps(list(entries.values()))  # serialisable

    # not met: small gains, slower cast; undecidable: flowgrpo does not gain, a resumed run
    finals = {"flowgrpo": [0.05, 0.06, 0.04], "cast": [0.05, 0.06, 0.07]}
    curves["cast"] = [[0.5, 0.52, 0.55, 0.6, 0.62]] * 3
    sm = summarise(_results(SMALL, curves, finals), ["flowgrpo", "cast"], [0, 1, 2], "t",
                   SMALL)
    entries = {e["name"]: e for e in figures(sm, _setup(quick=True, skipped=3,
                                                        wall_s=1200))}
    assert entries["flowgrpo pool gain"]["met"] is False
    assert entries["cast / flowgrpo hard gain ratio"]["met"] is False  # 1.2 < 3
    crossing = entries["cast / flowgrpo samples to threshold"]
    assert crossing["value"] is None and crossing["met"] is False
    assert "never reaches" in crossing["about"]
    wall = entries["quick benchmark wall minutes"]
    assert wall["met"] is None and "resumed" in wall["about"] and wall["goal"] == "<= 10"
    finals["flowgrpo"] = [-0.01, -0.02, 0.0]
    sm = summarise(_results(SMALL, curves, finals), ["flowgrpo", "cast"], [0, 1, 2], "t",
                   SMALL)
    ratio = {e["name"]: e for e in figures(sm, _setup())}["cast / flowgrpo hard gain ratio"]
    assert ratio["value"] is None and ratio["met"] is None and "<= 0" in ratio["about"]
    only = summarise(_results(SMALL, {"flowgrpo": curves["flowgrpo"]},
                              {"flowgrpo": finals["flowgrpo"]}), ["flowgrpo"], [0, 1, 2], "t",
                     SMALL)
    entries = {e["name"]: e for e in figures(only, _setup())}
    assert entries["cast / flowgrpo hard gain ratio"]["met"] is None
    assert "cast was not run" in entries["cast / flowgrpo hard gain ratio"]["about"]


def test_hacking_figures_are_relative_hf_changes_over_seeds():
    curves = {"flowgrpo": [[0.5, 0.55, 0.6, 0.65, 0.7]] * 3,
              "cast": [[0.5, 0.6, 0.7, 0.72, 0.75]] * 3}
    res = _results(SMALL, curves, {"flowgrpo": [0.1] * 3, "cast": [0.1] * 3})
    sm = summarise(res, ["flowgrpo", "cast"], [0, 1, 2], "t", SMALL)
    last = SMALL.iterations - 1
    busier = [0.2, 0.19, 0.21]  # base 0.1: +100%, +90%, +110% (bars read as shapes)
    for x, hf in enumerate(busier):
        res.evals[(run_name("t", "flowgrpo", x), last, "pool")]["hf_energy"] = hf
    entries = {e["name"]: e for e in hacking_figures(sm, res, "t", last)}
    assert set(entries) == {f"{a} {s} hf energy change" for a in ("flowgrpo", "cast")
                            for s in ("pool", "hard")}
    hacked = entries["flowgrpo pool hf energy change"]
    assert hacked["value"] == pytest.approx(1.0) and hacked["met"] is False
    assert hacked["low"] < 1.0 < hacked["high"]
    clean = entries["cast hard hf energy change"]
    assert clean["value"] == pytest.approx(0.0) and clean["met"] is True
    del res.evals[("t-base", -1, "hard")]
    missing = {e["name"]: e for e in hacking_figures(sm, res, "t", last)}
    assert missing["cast hard hf energy change"]["met"] is None


def test_one_change_is_the_paired_seed_difference():
    curves = {a: [[0.5, 0.6, 0.6, 0.6, 0.6]] * 3 for a in ("flowgrpo", "flowgrpo-calibrated",
                                                             "cast")}
    finals = {"flowgrpo": [0.10, 0.00, 0.05], "flowgrpo-calibrated": [0.13, 0.01, 0.09],
              "cast": [0.02, 0.04, 0.03]}
    sm = summarise(_results(SMALL, curves, finals), list(finals), [0, 1, 2], "t", SMALL)
    diffs = one_change(sm, list(finals))
    assert {(a, r) for a, r, _, _ in diffs} == {("flowgrpo-calibrated", "flowgrpo"),
                                               ("cast", "flowgrpo")}
    d = diffs[("flowgrpo-calibrated", "flowgrpo", "hard", "mean_score")]
    # differences 0.03, 0.01, 0.04: mean 0.08 / 3, t_{0.975, 2} = 4.3027
    half = 4.302653 * statistics.stdev([0.03, 0.01, 0.04]) / math.sqrt(3)
    assert d.mean == pytest.approx(0.08 / 3)
    assert (d.low, d.high) == (pytest.approx(0.08 / 3 - half, rel=1e-4),
                               pytest.approx(0.08 / 3 + half, rel=1e-4))
    ratio = one_change_ratios(sm, list(finals))[("flowgrpo-calibrated", "flowgrpo", "hard")]
    gains = sm.gains[("flowgrpo-calibrated", "hard", "mean_score")]
    reference = sm.gains[("flowgrpo", "hard", "mean_score")]
    assert ratio.value == pytest.approx(sum(gains) / sum(reference))
    assert ratio == stats.ratio_bootstrap(gains, reference)  # the same paired bootstrap
    text = one_change_table(sm)
    assert ratio_cell(ratio) in text and ratio_cell(ratio).startswith(f"{ratio.value:.2f}")
    assert "flowgrpo-calibrated - flowgrpo" in text and "cast - flowgrpo" in text
    assert "cast - cast-no-map" not in text  # cast-no-map was not run


# ---- the command ---------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_benchmark_writes_a_report_and_figures_from_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    monkeypatch.chdir(REPO)
    size = Size(iterations=2, seeds=2, per_iteration=4, group_size=2, probe_images=1,
                pool_images=2, hard_images=2, eval_images=2, held_out_prompts=3,
                calibration_prompts=2)
    names = ["flowgrpo", "cast", "cast-no-map", "recast-equal", "static-skewed", "recast-skewed"]
    out = run_benchmark(size, tmp_path / "store", tmp_path / "report", "tiny", threads=1,
                        only=names)
    report = (tmp_path / "report" / "report.md").read_text()
    for name in ("gains.png", "learning_curves.png", "stage_times.png", "grid-base-pool.png",
                 "grid-cast-hard.png", "gains-recast-equal-it0.png", "type_curves.png"):
        assert (tmp_path / "report" / name).stat().st_size > 500, name
        assert f"]({name})" in report
    for section in ("## Against the targets", "## Learning curves", "## Sample efficiency",
                    "## Reward hacking", "## Training diagnostics", "## One change at a time",
                    "## ReCAST", "## Checkpoints"):
        assert section in report
    entries = json.loads((tmp_path / "report" / "figures.json").read_text())
    assert len(entries) == 6 + 2 * len(names)  # the targets, then hf energy per arm and split
    assert entries[5]["name"] == "full benchmark wall minutes"
    assert entries[-1]["name"] == "recast-skewed hard hf energy change"
    from tasks.store.store import Store

    con = Store(tmp_path / "store").connect_readonly()
    try:
        rows = con.execute(
            "SELECT run_id, iteration, split, mean_score FROM evals WHERE group_kind = 'overall'"
            " AND starts_with(run_id, 'tiny-')").fetchall()
        prompts = con.execute("SELECT DISTINCT iteration, prompt_id FROM rollouts WHERE run_id = "
                              "'tiny-cast-s0' ORDER BY ALL").fetchall()
    finally:
        con.close()
    value = {(r, k, s): v for r, k, s, v in rows}
    sm = out["summary"]
    assert sm.curve[("cast", "mean_score")][1] == pytest.approx(
        [value[("tiny-base", -1, "probe")], value[("tiny-cast-s1", 0, "probe")],
         value[("tiny-cast-s1", 1, "probe")]])
    assert sm.gains[("cast", "hard", "mean_score")][0] == pytest.approx(
        value[("tiny-cast-s0", 1, "hard")] - value[("tiny-base", -1, "hard")])
    assert {s for (r, _, s) in value if r == "tiny-base"} == {"probe", "pool", "hard", "eval"}
    assert len(prompts) == 8 and len({p for _, p in prompts}) == 8  # the pool's first 8, cycled
    assert sm.time_ratio[("flowgrpo", "iteration")] == pytest.approx(1.0)
    rs = out["recast"]
    weights = rs.weights["static-skewed"]
    assert weights["count"][0] == pytest.approx(2 * weights["object"][0])
    # the same run names with another recipe are refused before any stage runs
    from tasks.store.run_pin import RecipeMismatch

    before = sorted(p.name for p in (tmp_path / "store").rglob("*.parquet"))
    with pytest.raises(RecipeMismatch, match="train.lr"):
        run_benchmark(size, tmp_path / "store", tmp_path / "report2", "tiny", threads=1,
                      only=["flowgrpo"], lr=3e-4)
    assert sorted(p.name for p in (tmp_path / "store").rglob("*.parquet")) == before
    # after a code change every cache key differs, so the calls would run again; --report-only
    # writes the same figures from what the store holds, and runs nothing
    import tasks.store.stage

    monkeypatch.setattr(tasks.store.stage, "code_version", lambda: "another code version")
    again = run_benchmark(size, tmp_path / "store", tmp_path / "report3", "tiny", threads=1,
                          only=names, report_only=True)
    assert sorted(p.name for p in (tmp_path / "store").rglob("*.parquet")) == before
    assert again["summary"].gains == sm.gains and again["summary"].curve == sm.curve
    assert (tmp_path / "report3" / "figures.json").exists()
    # --reuse-finished: the finished runs are read as they are, only a new arm trains
    grown = run_benchmark(size, tmp_path / "store", tmp_path / "report4", "tiny", threads=1,
                          only=[*names, "cast-atom-z"], reuse_finished=True)
    new_parts = [p for p in (tmp_path / "store" / "tables").rglob("*.parquet")
                 if p.name not in before and p.parent.name not in ("stages", "runs")]
    assert new_parts and all("cast-atom-z" in p.name for p in new_parts), sorted(new_parts)
    assert grown["summary"].gains[("cast", "hard", "mean_score")] == sm.gains[
        ("cast", "hard", "mean_score")]


def test_report_only_names_what_an_unfinished_store_lacks(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    size = Size(iterations=2, seeds=1, per_iteration=4, group_size=2, probe_images=1,
                pool_images=2, hard_images=2, eval_images=2, held_out_prompts=3)
    with pytest.raises(FileNotFoundError, match=r"tiny-base has no finished .*eval:probe.*"
                                                r"without --report-only"):
        run_benchmark(size, tmp_path / "store", tmp_path / "report", "tiny", threads=1,
                      only=["flowgrpo"], report_only=True)
    assert not list((tmp_path / "store").rglob("*.parquet"))  # nothing ran


def test_nft_suite_is_at_equal_budget_and_samples_with_the_ode():
    """The forward-process arms share everything with the SDE arms but the SDE's exploration
    settings; the SDE arms must still agree on those among themselves."""
    nft_arms = arms("nft")[:4]
    assert [a.name for a in arms("nft")] == ["flowgrpo", "cast", "nft", "nft-cast", "nft-b01",
                                              "nft-cast-b01"]
    recipes = [recipe_for(a, 0, QUICK, f"t-{a.name}", 1) for a in nft_arms]
    check_equal_budget(recipes)
    nft, nft_cast = recipes[2:]
    assert (nft.train.objective, nft.sampling.noise_level, nft.advantage.kind) == ("nft", 0.0,
                                                                                  "scalar")
    assert (nft_cast.advantage.kind, nft_cast.sampling.shared_noise) == ("spatial", False)
    louder = recipe_for(Arm("loud", CAST_RECIPE, {"sampling.noise_level": 0.9}, ""),
                        0, QUICK, "t-loud", 1)
    with pytest.raises(ValueError, match="noise_level"):
        check_equal_budget([recipes[0], louder])
    # on a KL-targeted protocol the SDE arms target the KL, the NFT arms keep the first lr
    targeted = [recipe_for(a, 0, QUICK, f"t-{a.name}", 1, lr=1e-3, kl_target=0.03)
                for a in nft_arms]
    check_equal_budget(targeted)
    assert [r.train.kl_target_nats for r in targeted] == [0.03, 0.03, None, None]
    assert {r.train.lr for r in targeted} == {1e-3}
    slower = recipe_for(nft_arms[1], 0, QUICK, "t-slow", 1, lr=3e-4, kl_target=0.03)
    with pytest.raises(ValueError, match="train.lr"):
        check_equal_budget([targeted[0], slower])  # SDE arms share their step
    with pytest.raises(ValueError, match="train.lr"):
        check_equal_budget([*targeted[:3], recipe_for(nft_arms[3], 0, QUICK, "t-n", 1, lr=3e-4)])
    # a velocity target replaces the KL target on the SDE arms; the NFT arms drop it
    by_velocity = [recipe_for(a, 0, QUICK, f"t-{a.name}", 1, lr=1e-3, kl_target=0.03,
                              settings={"train.velocity_target": 0.02}) for a in nft_arms]
    check_equal_budget(by_velocity)
    assert [(r.train.kl_target_nats, r.train.velocity_target) for r in by_velocity] == \
        [(None, 0.02)] * 2 + [(None, None)] * 2
    with pytest.raises(ValueError, match="train.velocity_target"):
        check_equal_budget([targeted[0], by_velocity[1]])  # one arm by KL, one by velocity


def test_nft_arms_with_their_own_step_keep_it_under_any_protocol_and_share_it():
    """nft-b01 and nft-cast-b01 train at NFT_STEP whatever the protocol's lr or KL target; the
    step is compared among the arms of one objective and one NFT beta."""
    every = arms("nft")
    targeted = [recipe_for(a, 0, QUICK, f"t-{a.name}", 1, lr=1e-3, kl_target=0.03) for a in every]
    check_equal_budget(targeted)  # nft/nft-cast at 1e-3 and beta 1, the -b01 pair at NFT_STEP
    b01 = targeted[4:]
    assert [(r.train.lr, r.train.nft_beta, r.train.kl_target_nats) for r in b01] == \
        [(NFT_STEP["train.lr"], NFT_STEP["train.nft_beta"], None)] * 2
    assert targeted[2].train.lr == 1e-3 and targeted[2].train.nft_beta == 1.0
    other = recipe_for(Arm("x", CAST_RECIPE, {**NFT, "window.start": 0}, "",
                           fixed={**NFT_STEP, "train.lr": 1e-2}), 0, QUICK, "t-x", 1, lr=1e-3)
    with pytest.raises(ValueError, match="train.lr"):
        check_equal_budget([*targeted, other])  # one beta, two step sizes


def test_pool_file_takes_the_pools_first_prompts(tmp_path):
    from tasks.store.store import Store

    store = Store(tmp_path / "store")
    assert pool_file(store, None) == POOL
    lines = [x for x in Path(POOL).read_text().splitlines() if x.strip()]
    small = pool_file(store, 3)
    assert Path(small).read_text().splitlines() == lines[:3]
    recipe = recipe_for(arms()[0], 0, QUICK, "t-small", 1, pool=small)
    assert recipe.prompts.train == small
    for bad in (0, len(lines) + 1):
        with pytest.raises(ValueError, match="--pool-prompts"):
            pool_file(store, bad)


def test_protocols_resolve_defaults_quick_and_overrides(monkeypatch, tmp_path):
    """The default protocol is the recipes' footing that reports/cfg1-pool8-40it-rank32 ran (CFG 1,
    8 prompts, KL-targeted lr from 1e-3); --quick is its footing for Flow-GRPO alone at QUICK's
    size; the constant-lr protocols keep their reports' settings; every flag overrides its
    field."""
    seen = {}

    def fake_run(size, store, report, prefix, threads, command, suite, lr, only, **kw):
        seen.update(size=size, store=str(store), report=str(report), lr=lr, only=only, **kw)
        return {}

    monkeypatch.setattr(cli, "run_benchmark", fake_run)
    monkeypatch.chdir(tmp_path)  # main() makes the store's Prefect home under runs/
    cli.main([])
    p = PROTOCOLS["cfg1-pool8"]
    assert seen["size"] == p.size and seen["size"].iterations == 40
    assert (seen["guidance"], seen["pool_prompts"], seen["lr"], seen["kl_target"]) == (
        1.0, 8, 1e-3, 0.03)
    assert seen["report"] == "reports/cfg1-pool8-40it-rank32" and seen["jobs"] == 1
    assert seen["settings"] == {}
    cli.main(["--quick"])
    assert seen["size"] == QUICK and seen["only"] == [BASELINE]
    assert (seen["guidance"], seen["pool_prompts"], seen["lr"], seen["kl_target"]) == (
        1.0, 8, 1e-3, 0.03)
    assert seen["store"] == "runs/bench-methods-quick/store" and seen["quick"]
    cli.main(["--protocol", "cfg4-pool32"])
    assert seen["size"] == FULL and seen["report"] == "reports/cast-vs-flowgrpo"
    assert (seen["guidance"], seen["lr"], seen["kl_target"]) == (4.0, 1e-3, None)
    cli.main(["--protocol", "cfg1-pool8-lr4e-4", "--lr", "1e-3", "--guidance", "2",
              "--iterations", "5", "--jobs", "2", "--set", "train.lora_rank=16"])
    assert (seen["lr"], seen["guidance"], seen["pool_prompts"]) == (1e-3, 2.0, 8)
    assert seen["size"].iterations == 5 and seen["size"].pool_images == 16 and seen["jobs"] == 2
    assert seen["kl_target"] is None and seen["settings"] == {"train.lora_rank": 16}
    cli.main(["--protocol", "cfg1-pool8-lr4e-4", "--kl-target", "0.05"])
    assert seen["kl_target"] == 0.05 and seen["lr"] == 4e-4
    cli.main(["--velocity-target", "0.021"])
    assert seen["settings"] == {"train.velocity_target": 0.021}
    for bad in (["--protocol", "nope"], ["--kl-target", "0"], ["--set", "lora_rank=3"],
                ["--velocity-target", "0"], ["--velocity-target", "0.02", "--kl-target", "0.03"]):
        with pytest.raises(SystemExit):
            cli.main(bad)
    monkeypatch.chdir(REPO)  # recipes are repo-relative
    recipe = recipe_for(arms()[0], 1, p.size, "kl", 1, 1e-3, 1.0, kl_target=0.03)
    assert (recipe.train.kl_target_nats, recipe.train.lr) == (0.03, 1e-3)
    constant = recipe_for(arms()[0], 1, p.size, "const", 1, 4e-4, 1.0)
    assert constant.train.kl_target_nats is None  # even though the recipe targets 0.03 nats


def test_report_copies_the_what_was_tried_section_of_the_history(tmp_path):
    text = what_was_tried()  # reports/bench-methods-history.md
    assert text.startswith("## What was tried (earlier runs, earlier protocol)\n\n")
    assert text.endswith(".\n") and "\n## " not in text  # one section, one final newline
    history = tmp_path / "history.md"
    history.write_text("# t\n\n## What was tried (x)\n\nbody\n\n## Later\n\nmore\n")
    assert what_was_tried(history) == "## What was tried (x)\n\nbody\n"
    history.write_text("# t\n\n## Sizing\n")
    with pytest.raises(ValueError, match="What was tried"):
        what_was_tried(history)


# the package's modules in import order: each may import only those before it
PACKAGE_ORDER = ("arms", "stats", "protocols", "run", "store_reads", "summary", "tables", "plots",
                 "figures", "report", "benchmark")


def test_the_package_is_small_documented_modules_importing_one_way():
    package = REPO / "benchmarks" / "methods"
    assert {p.stem for p in package.glob("*.py")} == {"__init__", *PACKAGE_ORDER}
    for path in [*package.glob("*.py"), REPO / "benchmarks" / "bench_methods.py"]:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        assert len(text.splitlines()) <= 400, f"{path.name}: {len(text.splitlines())} lines"
        assert ast.get_docstring(tree), f"{path.name} says in a docstring what it is"
        if path.stem not in PACKAGE_ORDER:
            continue
        before = PACKAGE_ORDER[:PACKAGE_ORDER.index(path.stem)]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("methods."):
                assert node.module.split(".")[1] in before, f"{path.stem} imports {node.module}"
