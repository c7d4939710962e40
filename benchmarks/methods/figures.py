"""figures.json of the methods benchmark: one entry per target (`figures`) and per arm and
split for reward hacking (`hacking_figures`), each with its goal and whether it was met."""

from __future__ import annotations

import numpy as np

from methods.arms import BASELINE
from methods.protocols import run_name
from methods.stats import Ratio, t_interval
from methods.store_reads import Results
from methods.summary import Summary
from methods.tables import fmt
from tasks.reporting.markdown import table

# The targets the benchmark is judged against.
GOAL_POOL_GAIN, GOAL_HARD_GAIN, GOAL_RUN_MINUTES = 0.10, 0.03, 15.0
GOAL_HARD_RATIO, GOAL_SAMPLES_RATIO = 3.0, 0.5
GOAL_FULL_MINUTES, GOAL_QUICK_MINUTES = 90.0, 10.0
GOAL_NFT_SAMPLES, GOAL_NFT_WALL = 0.2, 1 / 3  # nft-cast against flowgrpo, to flowgrpo's final
# "No reward hacking unseen": the final images' high-frequency energy at most 1.25x the base's
# (bars, specks or noise that fool the verifier raise it; cleaner shapes than the base's lower it).
GOAL_HF_CHANGE = 0.25



def _entry(name: str, value: float | None, low: float | None, high: float | None, goal: str,
           met: bool | None, unit: str, about: str) -> dict:
    return {"name": name, "value": value, "low": low, "high": high, "goal": goal, "met": met,
            "unit": unit, "about": about}


def _gain_entry(sm: Summary, split: str, goal: float) -> dict:
    name, unit = f"flowgrpo {split} gain", "mean atom score, final - base"
    if BASELINE not in sm.arms:
        return _entry(name, None, None, None, f">= {goal:+.2f}, interval excludes 0", None, unit,
                      "flowgrpo was not run")
    iv = sm.gain[(BASELINE, split, "mean_score")]
    how = ("95% t-interval over seeds" if len(sm.seeds) > 1 else
           "one seed: 95% paired bootstrap over prompts (image noise and prompts, no seed noise)")
    met = None if iv.low is None else (iv.mean >= goal and iv.low > 0)
    return _entry(name, iv.mean, iv.low, iv.high, f">= {goal:+.2f}, interval excludes 0", met,
                  unit, f"mean over {len(sm.seeds)} seed(s), {how}")


def _ratio_entry(name: str, r: Ratio | None, goal: str, met, unit: str, about: str) -> dict:
    if r is None:
        return _entry(name, None, None, None, goal, None, unit, "cast was not run: " + about)
    if r.value is None:
        never = "never reaches" in r.note
        return _entry(name, None, None, None, goal, False if never else None, unit,
                      f"{r.note}; {about}")
    return _entry(name, r.value, r.low, r.high, goal, met(r.value), unit,
                  f"{about}{'; ' + r.note if r.note else ''}")


def _nft_figures(sm: Summary) -> list[dict]:
    """The forward-process targets, when the nft suite's arms ran: nft-cast's samples and wall
    time to Flow-GRPO's final probe score, and nft-cast against nft on the hard split."""
    if "nft-cast" not in sm.arms:
        return []
    crossing = sm.crossing.get("nft-cast")
    out = [_ratio_entry("nft-cast / flowgrpo samples to threshold", crossing,
                        f"<= {GOAL_NFT_SAMPLES:g}", lambda v: v <= GOAL_NFT_SAMPLES,
                        "ratio of samples", f"samples for the mean probe curve to reach "
                        f"flowgrpo's final probe mean score ({fmt(sm.threshold)}); 95% paired "
                        f"bootstrap over seeds")]
    cost = sm.time_ratio.get(("nft-cast", "iteration"))
    name, goal = "nft-cast / flowgrpo wall time to threshold", f"<= {GOAL_NFT_WALL:.3g}"
    about = (f"samples ratio x the median iteration time ratio ({fmt(cost)}): both arms take "
             "the same samples an iteration")
    if crossing is None or crossing.value is None or cost is None:
        out.append(_entry(name, None, None, None, goal, None, "ratio of minutes",
                          "no samples ratio: " + about))
    else:
        scaled = [None if v is None else v * cost for v in (crossing.low, crossing.high)]
        value = crossing.value * cost
        out.append(_entry(name, value, *scaled, goal, value <= GOAL_NFT_WALL,
                          "ratio of minutes", about))
    if "nft" in sm.arms:
        a, b = sm.gain[("nft-cast", "hard", "mean_score")], sm.gain[("nft", "hard", "mean_score")]
        apart = None if a.low is None or b.high is None else a.low > b.high
        out.append(_entry("nft-cast - nft hard gain", a.mean - b.mean, None, None,
                          "> 0 with the intervals apart", apart, "mean atom score",
                          f"nft-cast {a.mean:+.3f} [{fmt(a.low)}, {fmt(a.high)}], nft "
                          f"{b.mean:+.3f} [{fmt(b.low)}, {fmt(b.high)}] (gain intervals as in "
                          f"the gains table)"))
    return out


def figures(sm: Summary, setup: dict) -> list[dict]:
    """One entry per target: {name, value, low, high, goal, met, unit, about}; `met` is None
    when the value cannot be computed (or decided), `about` says why."""
    minutes = list(sm.minutes.values())
    quick = setup["quick"]
    wall, goal_wall = setup["wall_s"] / 60, GOAL_QUICK_MINUTES if quick else GOAL_FULL_MINUTES
    resumed = setup["skipped"] > 0
    hard = sm.ratio.get(("cast", "hard", "mean_score"))
    crossing = sm.crossing.get("cast")
    return [
        _gain_entry(sm, "pool", GOAL_POOL_GAIN),
        _gain_entry(sm, "hard", GOAL_HARD_GAIN),
        _entry("minutes per arm and seed", float(np.mean(minutes)), float(min(minutes)),
               float(max(minutes)), f"<= {GOAL_RUN_MINUTES:g} (every run)",
               max(minutes) <= GOAL_RUN_MINUTES, "minutes",
               "mean [min, max] over arms x seeds of each run's recorded stage seconds: CSGs, "
               "calibration, every iteration, its probes and the final evaluation (not the "
               "shared base evaluation)"),
        _ratio_entry("cast / flowgrpo hard gain ratio", hard, f">= {GOAL_HARD_RATIO:g}",
                     lambda v: v >= GOAL_HARD_RATIO, "ratio of mean gains",
                     "held-out hard split, mean atom score, same iterations and samples; 95% "
                     "paired bootstrap over seeds"),
        _ratio_entry("cast / flowgrpo samples to threshold", crossing,
                     f"<= {GOAL_SAMPLES_RATIO:g}", lambda v: v <= GOAL_SAMPLES_RATIO,
                     "ratio of samples",
                     f"samples for the mean probe curve to reach flowgrpo's final probe mean "
                     f"score ({fmt(sm.threshold)}), linear between checkpoints; 95% paired "
                     f"bootstrap over seeds"),
        _entry(f"{'quick' if quick else 'full'} benchmark wall minutes", wall, None, None,
               f"<= {goal_wall:g}", None if resumed else wall <= goal_wall, "minutes",
               (f"resumed: {setup['skipped']} stages were already done, so this invocation's "
                f"{wall:.1f} min is not the benchmark's wall time" if resumed else
                "this invocation, start to report")),
        *_nft_figures(sm),
    ]


def hacking_figures(sm: Summary, res: Results, prefix: str, last: int) -> list[dict]:
    """One entry per arm and split (pool, hard): the relative change of the final images' mean
    high-frequency energy over the base's, final / base - 1 per seed (same prompts and noise),
    mean with a 95% t-interval over seeds; met when the mean is <= GOAL_HF_CHANGE."""
    out = []
    for a in sm.arms:
        for split in ("pool", "hard"):
            base = res.evals.get((f"{prefix}-base", -1, split))
            finals = [res.evals.get((run_name(prefix, a, x), last, split)) for x in sm.seeds]
            name = f"{a} {split} hf energy change"
            goal = f"<= +{GOAL_HF_CHANGE:g} (final / base - 1)"
            if base is None or any(f is None for f in finals) or not base["hf_energy"] > 0:
                out.append(_entry(name, None, None, None, goal, None, "relative change",
                                  "no final or base evaluation of this split"))
                continue
            iv = t_interval([f["hf_energy"] / base["hf_energy"] - 1.0 for f in finals])
            out.append(_entry(name, iv.mean, iv.low, iv.high, goal, iv.mean <= GOAL_HF_CHANGE,
                              "relative change",
                              f"mean high-frequency energy of the final images over the base's "
                              f"({base['hf_energy']:.4f}), same prompts and noise; mean over "
                              f"{len(sm.seeds)} seed(s), 95% t-interval over seeds (bars, specks "
                              f"or noise that fool the verifier raise it)"))
    return out


def figures_text(entries: list[dict]) -> str:
    def cell(e: dict) -> str:
        if e["value"] is None:
            return "–"
        ci = "" if e["low"] is None else f" [{e['low']:.3g}, {e['high']:.3g}]"
        return f"{e['value']:.3g}{ci}"

    verdict = {True: "met", False: "NOT met", None: "–"}
    return table(["target", "value [interval]", "goal", "met", "unit", "how"],
                 [[e["name"], cell(e), e["goal"], verdict[e["met"]], e["unit"], e["about"]]
                  for e in entries])
