"""The CAST vs Flow-GRPO benchmark (benchmarks/bench_methods.py): its statistics against closed
forms and known t quantiles, the equal-budget check, and (slow) the whole command at a tiny size."""

import importlib.util
import math
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("bench_methods",
                                                  REPO / "benchmarks" / "bench_methods.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


bm = _load()


@pytest.mark.parametrize(("df", "expected"), [(1, 12.706204736), (2, 4.302652730),
                                              (3, 3.182446305), (4, 2.776445105),
                                              (9, 2.262157163), (30, 2.042272456)])
def test_t_quantile_matches_tables(df, expected):
    assert bm.t_quantile(0.975, df) == pytest.approx(expected, abs=1e-6)


def test_t_quantile_df1_closed_form():
    # Cauchy: the p-quantile is tan(pi (p - 1/2))
    for p in (0.6, 0.9, 0.99):
        assert bm.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), abs=1e-6)


def test_t_interval_on_known_numbers():
    values = [1.0, 2.0, 3.0, 4.0]
    iv = bm.t_interval(values)
    half = 3.182446305 * statistics.stdev(values) / 2  # t_{0.975, 3} * s / sqrt(4)
    assert (iv.mean, iv.n) == (2.5, 4)
    assert iv.low == pytest.approx(2.5 - half, abs=1e-6)
    assert iv.high == pytest.approx(2.5 + half, abs=1e-6)
    assert bm.t_interval([0.3]) == bm.Interval(0.3, None, None, 1)
    constant = bm.t_interval([0.2, 0.2, 0.2])
    assert constant.low == pytest.approx(0.2) and constant.high == pytest.approx(0.2)


def test_ratio_bootstrap_is_deterministic_and_brackets_the_ratio():
    num, den = [0.10, 0.04, 0.07, 0.12], [0.05, 0.03, 0.06, 0.02]
    a, b = bm.ratio_bootstrap(num, den, seed=3), bm.ratio_bootstrap(num, den, seed=3)
    assert a == b
    assert a.value == pytest.approx(np.mean(num) / np.mean(den))
    assert a.low < a.value < a.high and a.note == ""
    other = bm.ratio_bootstrap(num, den, seed=4)  # another seed: the same interval, roughly
    assert other.low == pytest.approx(a.low, rel=0.2) and other.high == pytest.approx(a.high,
                                                                                      rel=0.2)
    # bounds are resample ratios: within the extremes a resample can reach
    per_seed = np.asarray(num) / np.asarray(den)
    assert per_seed.min() <= a.low and a.high <= per_seed.max()


def test_ratio_bootstrap_closed_forms_and_refusals():
    same = bm.ratio_bootstrap([0.2, 0.4, 0.6], [0.1, 0.2, 0.3])  # every paired draw gives 2
    assert (same.value, same.low, same.high) == pytest.approx((2.0, 2.0, 2.0))
    worse = bm.ratio_bootstrap([0.1, 0.2], [-0.1, 0.05])
    assert worse.value is None and "<= 0" in worse.note
    one = bm.ratio_bootstrap([0.1], [0.05])
    assert one.value == pytest.approx(2.0) and one.low is None and "one seed" in one.note
    shaky = bm.ratio_bootstrap([0.1, 0.1, 0.1], [0.3, -0.2, -0.05])
    assert shaky.value is not None and shaky.low is None and "unbounded" in shaky.note
    with pytest.raises(ValueError, match="paired"):
        bm.ratio_bootstrap([0.1, 0.2], [0.1])


def test_eval_iterations_and_sizes():
    assert bm.FULL.eval_at() == (3,)
    assert bm.QUICK.eval_at() == (0, 1)
    assert bm.Size(iterations=5, seeds=1, eval_prompts=1, images_per_prompt=1,
                   eval_every=10).eval_at() == (4,)
    with pytest.raises(ValueError, match=">= 1"):
        bm.Size(iterations=0, seeds=1, eval_prompts=1, images_per_prompt=1, eval_every=1)


def test_arms_are_at_equal_budget_and_differ_only_where_meant(tmp_path):
    splits = {"eval": "data/prompts/eval.jsonl"}
    recipes = {a.name: bm.recipe_for(a, 1, bm.QUICK, splits, f"t-{a.name}", 1)
               for a in bm.arms()}
    bm.check_equal_budget(list(recipes.values()))
    assert (recipes["flowgrpo"].advantage.kind, recipes["flowgrpo"].window.mode) == (
        "scalar", "fixed")
    assert recipes["cast"].advantage.kind == "spatial"
    assert recipes["cast"].window.mode == "calibrated"
    assert recipes["cast-fixed-window"].window == recipes["flowgrpo"].window
    assert recipes["cast-fixed-window"].advantage == recipes["cast"].advantage
    assert recipes["cast-no-map"].advantage.kind == "atom"
    assert recipes["cast-no-map"].window == recipes["cast"].window
    assert {r.run.seed for r in recipes.values()} == {1}
    assert recipes["cast"].recast.weighting == "none"
    for name, weighting in (("recast-equal", "recast"), ("static-skewed", "static"),
                            ("recast-skewed", "recast")):
        r = recipes[name]
        assert r.recast.weighting == weighting, name
        assert (r.advantage, r.window, r.train) == (recipes["cast"].advantage,
                                                    recipes["cast"].window, recipes["cast"].train)
    assert recipes["recast-equal"].recast.budget_map() == dict.fromkeys(bm.ATOM_TYPES, 1.0)
    assert recipes["static-skewed"].recast.budget_map() == bm.SKEWED
    assert recipes["recast-skewed"].recast == recipes["static-skewed"].recast.model_copy(
        update={"weighting": "recast"})
    assert [a.name for a in bm.arms("methods")] == [a.name for a in bm.arms()][:5]
    late = recipes["cast-late-window"]
    assert (late.window.mode, late.window.start, late.window.size) == ("fixed", 6, 3)
    assert late.advantage == recipes["cast"].advantage
    calibrated = recipes["flowgrpo-calibrated"]
    assert calibrated.window == recipes["cast"].window
    assert (calibrated.advantage, calibrated.train) == (recipes["flowgrpo"].advantage,
                                                        recipes["flowgrpo"].train)
    atom_fixed = recipes["cast-no-map-fixed-window"]
    assert atom_fixed.window == recipes["flowgrpo"].window
    assert (atom_fixed.advantage, atom_fixed.train) == (recipes["cast-no-map"].advantage,
                                                        recipes["cast"].train)
    names = {a.name for a in bm.arms()}
    for arm, reference, _ in bm.ONE_CHANGE:  # every pair names two arms of the full suite
        assert {arm, reference} <= names, (arm, reference)
    for name, overrides, _ in bm.FIXES:  # one change each to the cast arm
        fixed = recipes[name]
        assert fixed.window == recipes["cast"].window
        changed = {f"{sec}.{k}" for sec in ("advantage", "train")
                   for k, v in getattr(fixed, sec).model_dump().items()
                   if v != getattr(recipes["cast"], sec).model_dump()[k]}
        assert changed == set(overrides), name
    with pytest.raises(ValueError, match="suite"):
        bm.arms("recast")
    assert [a.name for a in bm.select_arms("all", ["cast", "flowgrpo"])] == ["flowgrpo", "cast"]
    for bad in (["cast"], ["flowgrpo", "nope"]):
        with pytest.raises(ValueError, match="must name arms"):
            bm.select_arms("all", bad)
    probe = bm.recipe_for(bm.arms()[1], 1, bm.QUICK, splits, "t-probe", 1, lr=1e-2)
    assert probe.train.lr == 1e-2 and recipes["cast"].train.lr != 1e-2
    assert recipes["cast"].prompts.per_iteration == bm.QUICK.per_iteration
    other = bm.recipe_for(bm.arms()[1], 2, bm.QUICK, splits, "t-other", 1)
    with pytest.raises(ValueError, match="seed"):
        bm.check_equal_budget([recipes["cast"], other])


def test_one_change_is_the_paired_seed_difference():
    keys = [(s, m) for s in bm.SPLITS for m, _ in bm.METRICS]
    per_arm = {"flowgrpo": [0.10, 0.00, 0.05], "flowgrpo-calibrated": [0.13, 0.01, 0.09],
               "cast": [0.02, 0.04, 0.03]}
    improvement = {(a, s, m): v for a, v in per_arm.items() for s, m in keys}
    sm = bm.Summary(improvement, {}, {}, {}, {}, {}, {}, {})
    diffs = bm.one_change(sm, list(per_arm))
    assert {(a, r) for a, r, _, _ in diffs} == {("flowgrpo-calibrated", "flowgrpo"),
                                               ("cast", "flowgrpo")}
    d = diffs[("flowgrpo-calibrated", "flowgrpo", "hard", "mean_score")]
    # differences 0.03, 0.01, 0.04: mean 0.08 / 3, s = sqrt(0.00023333), t_{0.975, 2} = 4.3027
    half = 4.302653 * math.sqrt(((0.03 - 0.08 / 3) ** 2 + (0.01 - 0.08 / 3) ** 2
                                 + (0.04 - 0.08 / 3) ** 2) / 2) / math.sqrt(3)
    assert d.mean == pytest.approx(0.08 / 3)
    assert (d.low, d.high) == (pytest.approx(0.08 / 3 - half, rel=1e-5),
                               pytest.approx(0.08 / 3 + half, rel=1e-5))
    assert diffs[("cast", "flowgrpo", "eval", "strict_accuracy")].mean == pytest.approx(
        (-0.08 + 0.04 - 0.02) / 3)
    text = bm.one_change_table(sm, list(per_arm))
    assert "flowgrpo-calibrated - flowgrpo" in text and "cast - flowgrpo" in text
    assert "cast - cast-no-map" not in text  # cast-no-map was not run


def test_targets_are_read_off_the_summary():
    keys = [(s, m) for s in bm.SPLITS for m, _ in bm.METRICS]
    per_arm = {"flowgrpo": [0.01, 0.02, 0.03], "cast": [0.05, 0.07, 0.06]}
    improvement = {(a, s, m): v for a, v in per_arm.items() for s, m in keys}
    interval = {k: bm.t_interval(v) for k, v in improvement.items()}
    ratio = {("cast", s, m): bm.ratio_bootstrap(per_arm["cast"], per_arm["flowgrpo"])
             for s, m in keys}
    fast = {("cast", "iteration"): 1.10}
    text = bm.targets_text(bm.Summary(improvement, interval, ratio, {}, {}, {}, fast, {}),
                           list(per_arm))
    assert "ratio 3.00" in text and "target >= 3x met" in text  # 0.06 / 0.02
    assert "outside the seed interval" in text  # differences 0.04, 0.05, 0.03
    assert "<= 1.15 met" in text
    per_arm["cast"] = [0.03, 0.01, 0.05]  # ratio 1.5, differences 0.02, -0.01, 0.02
    improvement = {(a, s, m): v for a, v in per_arm.items() for s, m in keys}
    ratio = {("cast", s, m): bm.ratio_bootstrap(per_arm["cast"], per_arm["flowgrpo"])
             for s, m in keys}
    slow = {("cast", "iteration"): 1.2}
    text = bm.targets_text(bm.Summary(improvement, interval, ratio, {}, {}, {}, slow, {}),
                           list(per_arm))
    assert "target >= 3x NOT met" in text and "inside the seed interval" in text
    assert "<= 1.15 NOT met" in text
    assert "no verdict" in bm.targets_text(bm.Summary({}, {}, {}, {}, {}, {}, {}, {}),
                                           ["flowgrpo"])


@pytest.mark.slow
def test_quick_command_at_a_tiny_size_writes_a_report_from_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    monkeypatch.chdir(REPO)
    size = bm.Size(iterations=1, seeds=2, eval_prompts=2, images_per_prompt=2, eval_every=1,
                   per_iteration=2, group_size=2, calibration_prompts=2)
    out = bm.run_benchmark(size, tmp_path / "store", tmp_path / "report", "tiny", threads=1)
    report = (tmp_path / "report" / "report.md").read_text()
    for name in ("improvements.png", "accuracy_by_iteration.png", "stage_times.png"):
        assert (tmp_path / "report" / name).stat().st_size > 1000
        assert f"]({name})" in report
    arms = ("flowgrpo", "cast", "cast-fixed-window", "cast-no-map", "cast-late-window",
            *(name for name, _, _ in bm.FIXES), "flowgrpo-calibrated", "cast-no-map-fixed-window",
            "recast-equal", "static-skewed", "recast-skewed")
    for arm in arms:
        assert f"| {arm} |" in report
    assert "## ReCAST" in report and "## Training diagnostics" in report
    assert "## What was tried" in report and "## One change at a time" in report
    assert "## Against the issue's targets" in report
    assert "| window: calibrated, not hand-set (scalar reward) | flowgrpo-calibrated - flowgrpo |" \
        in report
    for arm in ("recast-equal", "recast-skewed"):
        assert (tmp_path / "report" / f"gains-{arm}-it0.png").stat().st_size > 1000
    from tasks.store import Store

    con = Store(tmp_path / "store").connect_readonly()
    try:
        base, final = (con.execute(
            "SELECT mean_score FROM evals WHERE run_id = $run AND iteration = $k AND "
            "split = 'hard' AND group_kind = 'overall'", {"run": run, "k": k}).fetchone()[0]
            for run, k in (("tiny-base", -1), ("tiny-cast-s1", 0)))
        runs = {r[0] for r in con.execute("SELECT DISTINCT run_id FROM train_steps").fetchall()}
    finally:
        con.close()
    sm = out["summary"]
    assert sm.base[("hard", "mean_score")] == pytest.approx(base)
    assert sm.improvement[("cast", "hard", "mean_score")][1] == pytest.approx(final - base)
    assert runs == {f"tiny-{a}-s{x}" for a in arms for x in (0, 1)}
    assert sm.time_ratio[("flowgrpo", "iteration")] == pytest.approx(1.0)
    rs, imp = out["recast"], sm.improvement
    assert rs.paired[("recast-skewed", "hard", "mean_score")].mean == pytest.approx(
        np.mean(imp[("recast-skewed", "hard", "mean_score")])
        - np.mean(imp[("static-skewed", "hard", "mean_score")]))
    weights = rs.weights["static-skewed"]
    assert weights["count"][0] == pytest.approx(2 * weights["object"][0])
