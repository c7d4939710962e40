"""The arms of the methods benchmark: each a committed recipe plus overrides (`Arm`), grouped
in suites (`arms`), and the check that arms compare at equal budget (`check_equal_budget`).

Every arm starts from the committed base model. flowgrpo (data/recipes/shapes-flowgrpo.toml:
scalar reward = mean atom score, group z-score, hand-set window [0, 3), all-dims clip range) and
cast (data/recipes/shapes-cast.toml: calibrated window, atom z-scores projected through the
verifier's heatmaps, the map inside each sample's all-dims ratio with Flow-GRPO's clip range) form
suite `main`; suite `ablations` adds the one-change arms of `ONE_CHANGE` (window:
cast-fixed-window, flowgrpo-calibrated, the late- and mid-window arms of both methods, and the
split window cast-split-window, scalar on [0, 3) and maps on [3, 6), against flowgrpo-wide-window
and cast-wide-window, one credit on all of [0, 6); map:
cast-no-map, cast-no-map-fixed-window; per-atom vs scalar credit: cast-no-map-fixed-window -
flowgrpo, and the
`CREDIT_FIXES` against it, and cast-score-gate, the best of them with the maps; the ratio:
flowgrpo-per-position, cast-position-ratio; and the `FIXES`); suite `recast` adds the ReCAST pairs
(recast-equal against cast, recast-skewed against static-skewed at budgets `SKEWED`); suite `nft`
adds the forward-process arms nft (scalar reward) and nft-cast (CAST's map as a per-position
optimality), which sample with the ODE (`NFT`), at the protocol's lr and the recipe's beta, and the
same two at the step that overfits one prompt (nft-b01, nft-cast-b01: `NFT_STEP`). The train
settings other than the clip range and the step size are equal across arms, the step size among the
arms of one objective and NFT beta (`check_equal_budget`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

FLOWGRPO_RECIPE = "data/recipes/shapes-flowgrpo.toml"
CAST_RECIPE = "data/recipes/shapes-cast.toml"
BASELINE = "flowgrpo"
SAME_SECTIONS = ("backbone", "scorer", "builder", "prompts", "sampling")
SAME_TRAIN = ("lora_rank", "lora_alpha", "kl_beta", "inner_epochs", "steps_per_epoch",
              "micro_batch", "warmup_steps", "max_grad_norm", "weight_decay")
# The step size, equal among the arms of one objective (and, for NFT, one beta). A forward-process
# (NFT) arm cannot target a KL (its ODE rollouts have no likelihoods), so under a KL-targeted
# protocol it trains at the protocol's first lr, constant, while the SDE arms' lr follows their KL
# target; an arm's `fixed` step (`NFT_STEP`) replaces the protocol's.
STEP = ("lr", "kl_target_nats", "velocity_target", "kl_lr_factor", "kl_lr_floor", "kl_lr_ceiling",
        "lr_halflife")
SUITES = ("main", "ablations", "recast", "nft")
# The SDE's exploration settings, equal across the SDE arms; the forward-process arms (NFT) sample
# with the ODE from a fresh starting noise per sample instead.
SDE_SAMPLING = ("noise_level", "sde_kind", "shared_noise", "noise_block")
NFT = {"train.objective": "nft", "sampling.noise_level": 0.0, "sampling.shared_noise": False,
       "window.mode": "fixed"}
# The forward-process step that overfits one prompt (reports/nft-one-prompt: beta 0.1 at a
# constant lr 3e-3 raised it by +0.511 [+0.263, +0.759] over 5 seeds; beta 1, the recipe's
# default, learned it at no lr tried). The `-b01` arms take it whatever the protocol's lr.
NFT_STEP = {"train.nft_beta": 0.1, "train.lr": 3e-3}
# The skewed budgets: the two weakest atom types of the base (count, relation) count double.
SKEWED = {"object": 1.0, "count": 2.0, "attribute": 1.0, "relation": 2.0}
# Window ablation: the steps where the atom types become decidable on the base model (ReCAST's
# gains peak at sigma 0.4-0.2, i.e. steps 6-8 of 10), instead of the calibrated [0, 3) / [1, 4).
LATE_WINDOW = {"window.mode": "fixed", "window.start": 6, "window.size": 3}
# Window ablation between the two: at CFG 1 the window [3, 6) keeps the within-group reward
# spread of [0, 3) (std 0.146 against 0.141) where [6, 9) halves it (0.074), and its samples
# score above the ODE's (0.425 against 0.394); `benchmarks/reward_spread.py --guidance 1`.
MID_WINDOW = {"window.mode": "fixed", "window.start": 3, "window.size": 3}
# The design change that evidence suggested (issue 17): Flow-GRPO gains most on [0, 3), CAST's
# map beats the scalar on [3, 6) (reports/cfg1-pool8-rank32-mid-window), so one window [0, 6)
# with the scalar advantage on its first 3 steps and CAST's map on the last 3. Its references
# are Flow-GRPO on the same 6 steps and CAST's map on all 6 (the same rollouts' noise; twice the
# replayed steps per sample of the 3-step arms, at the same samples).
WIDE_WINDOW = {"window.mode": "fixed", "window.start": 0, "window.size": 6}
SPLIT_WINDOW = {**WIDE_WINDOW, "advantage.scalar_steps": 3}
# Fixes to try when CAST does not win (each one change to the cast arm).
FIXES = (("cast-atom-z", {"advantage.atom_norm": "atom"},
          "cast with per-atom z-scores (the paper's) instead of the pooled atom spread"),
         ("cast-half-map", {"advantage.spatial_mix": 0.5},
          "cast with half of each atom's credit through its heatmap, half uniform (mix 0.5)"),
         ("cast-std-floor", {"advantage.std_floor": 0.1},
          "cast with atom group std floored at 0.1 (near-tied atoms get small advantages)"),
         ("cast-tight-clip", {"train.clip_range": 0.01},
          "cast with per-position clip range 0.01 instead of 0.032"),
         ("cast-peak-norm", {"advantage.heatmap_norm": "peak"},
          "cast with heatmaps scaled to peak 1, not mean 1 (no A / area on small objects)"),
         ("cast-position-ratio", {"train.map_ratio": "position", "train.clip_range": 0.032},
          ("cast with a ratio per position (the paper's, clip 1e-3 x sqrt(32 x 32)) instead "
           "of its map inside each sample's all-dims ratio")),
         ("cast-own-heatmaps", {"advantage.heatmap_source": "own"},
          ("cast with each sample's credit through its own heatmaps (the paper's), which its "
           "own actions drew, instead of its group's other samples'")))
# Changes to CAST's atom credit alone (each one change to cast-no-map-fixed-window, whose credit
# is the only thing that differs from flowgrpo's).
CREDIT_FIXES = (("cast-no-map-no-gate", {"advantage.gate_by_parents": False},
                 ("atom credit without parent gating (pooled z-scores: Flow-GRPO's advantage "
                  "times std_g R / sigma_b per prompt)")),
                ("cast-no-map-group-norm", {"advantage.credit_norm": "group"},
                 ("gated atom credit group-normalised (each sample's mean credit a group "
                  "z-score, as Flow-GRPO's advantage)")),
                ("cast-no-map-score-gate", {"advantage.gate_on": "score"},
                 ("atom credit gated on the score (a missing parent's children score 0 before "
                  "the z-score, DSG's rule) instead of zeroing their credit")))
# ReCAST comparisons: (ReCAST arm, the static arm at the same budgets).
RECAST_PAIRS = (("recast-equal", "cast"), ("recast-skewed", "static-skewed"))
# One change at a time: (arm, reference arm, what the arm changes). Each row of the report's
# "One change at a time" table is the per-seed difference arm - reference (paired: same prompts
# and noise per seed); pairs whose arms were not run are left out.
ONE_CHANGE = (
    ("flowgrpo-calibrated", "flowgrpo", "window: calibrated, not hand-set (scalar reward)"),
    ("cast", "cast-fixed-window", "window: calibrated, not hand-set (atom maps)"),
    ("cast-late-window", "cast-fixed-window", "window: fixed [6, 9), not [0, 3) (atom maps)"),
    ("flowgrpo-late-window", "flowgrpo", "window: fixed [6, 9), not [0, 3) (scalar reward)"),
    ("cast-late-window", "flowgrpo-late-window",
     "all of CAST's credit (atom maps) against the scalar reward, both on the late window [6, 9)"),
    ("flowgrpo-mid-window", "flowgrpo", "window: fixed [3, 6), not [0, 3) (scalar reward)"),
    ("cast-mid-window", "flowgrpo-mid-window",
     "all of CAST's credit (atom maps) against the scalar reward, both on the window [3, 6)"),
    ("flowgrpo-wide-window", "flowgrpo", "window: fixed [0, 6), not [0, 3) (scalar reward)"),
    ("cast-split-window", "flowgrpo-wide-window",
     "credit on steps [3, 6): CAST's atom maps instead of the scalar (both scalar on [0, 3))"),
    ("cast-split-window", "cast-wide-window",
     "credit on steps [0, 3): the scalar instead of CAST's atom maps (both maps on [3, 6))"),
    ("cast-split-window", "flowgrpo",
     "the split window [0, 6) (scalar on [0, 3), CAST's maps on [3, 6)) against Flow-GRPO"),
    ("flowgrpo-per-position", "flowgrpo",
     "loss: per-position ratios (CAST's clip range) instead of the all-dims ratio (scalar reward)"),
    ("cast-no-map-fixed-window", "flowgrpo",
     ("advantage: CAST's atom credit (gated, pooled z-scores) as a constant map instead of the "
      "scalar reward (both inside the sample's all-dims ratio; hand-set window)")),
    ("cast-no-map", "flowgrpo-calibrated",
     "advantage: atom z-scores instead of the scalar reward (calibrated window)"),
    ("cast-fixed-window", "cast-no-map-fixed-window",
     "map: heatmap projection instead of a constant map (hand-set window)"),
    ("cast", "cast-no-map", ("map: heatmap projection instead of a constant map (calibrated "
     "window)")),
    *((name, "cast", about.removeprefix("cast ")) for name, _, about in FIXES),
    *((name, "cast-no-map-fixed-window", "credit: " + about) for name, _, about in CREDIT_FIXES),
    # Against Flow-GRPO each credit fix is one change too: the group norm without the gate is
    # Flow-GRPO's advantage exactly (`cast_core.advantage`, "Credit norm").
    ("cast-no-map-no-gate", "flowgrpo",
     "credit: Flow-GRPO's advantage reweighted per prompt by std_g R / sigma_b (pooled norm)"),
    ("cast-no-map-group-norm", "flowgrpo",
     "credit: parent gating alone (group-normalised, otherwise Flow-GRPO's advantage)"),
    ("cast", "flowgrpo", "all of CAST at once (the headline comparison)"),
    ("cast-score-gate", "cast", "credit: gated on the score (DSG's rule), with the atom maps"),
    ("cast-score-gate", "flowgrpo", "all of CAST at once, the credit gated on the score"),
)



@dataclass(frozen=True)
class Arm:
    """One method: a committed recipe plus overrides; `fixed` are settings the protocol's step
    (its lr, KL target) does not replace, e.g. an NFT arm's own lr and beta (`NFT_STEP`)."""

    name: str
    recipe: str
    overrides: dict
    about: str
    fixed: dict = field(default_factory=dict)


def arms(suite: str | None = None) -> tuple[Arm, ...]:
    """The suite's arms (None: every arm of every suite), flowgrpo first; the fixed-window arms
    take the flowgrpo recipe's window section."""
    from tasks.stages.recipe import load_recipe

    if suite is not None and suite not in SUITES:
        raise ValueError(f"suite must be one of {SUITES}; got {suite!r}")
    w = load_recipe(FLOWGRPO_RECIPE).window
    fixed = {"window.mode": w.mode, "window.start": w.start, "window.size": w.size}
    cast_clip = load_recipe(CAST_RECIPE).train.clip_range
    main = (Arm("flowgrpo", FLOWGRPO_RECIPE, {}, "scalar reward, hand-set window"),
            Arm("cast", CAST_RECIPE, {}, "atom maps, calibrated window (= static weighting at "
                "equal budgets)"))
    ablations = (
        Arm("cast-fixed-window", CAST_RECIPE, fixed, "atom maps, Flow-GRPO's window"),
        Arm("cast-no-map", CAST_RECIPE, {"advantage.kind": "atom"},
            "atom advantages, constant map, calibrated window"),
        Arm("cast-late-window", CAST_RECIPE, LATE_WINDOW,
            "atom maps, fixed late window (sigma 0.4-0.2, where ReCAST's gains peak)"),
        *(Arm(name, CAST_RECIPE, overrides, about) for name, overrides, about in FIXES),
        Arm("flowgrpo-late-window", FLOWGRPO_RECIPE, LATE_WINDOW,
            "scalar reward, fixed late window (sigma 0.4-0.2, cast-late-window's)"),
        Arm("flowgrpo-mid-window", FLOWGRPO_RECIPE, MID_WINDOW,
            "scalar reward, fixed window [3, 6) (the reward spread of [0, 3), samples nearer "
            "the ODE's)"),
        Arm("cast-mid-window", CAST_RECIPE, MID_WINDOW,
            "atom maps, fixed window [3, 6) (flowgrpo-mid-window's)"),
        Arm("flowgrpo-wide-window", FLOWGRPO_RECIPE, WIDE_WINDOW,
            "scalar reward, fixed window [0, 6) (cast-split-window's)"),
        Arm("cast-wide-window", CAST_RECIPE, WIDE_WINDOW,
            "atom maps, fixed window [0, 6) (cast-split-window's)"),
        Arm("cast-split-window", CAST_RECIPE, SPLIT_WINDOW,
            "fixed window [0, 6): the scalar reward on [0, 3), CAST's atom maps on [3, 6)"),
        Arm("flowgrpo-calibrated", FLOWGRPO_RECIPE, {"window.mode": "calibrated"},
            "scalar reward, calibrated window (CAST's window on Flow-GRPO)"),
        Arm("cast-no-map-fixed-window", CAST_RECIPE, {"advantage.kind": "atom", **fixed},
            "atom advantages, constant map, Flow-GRPO's window"),
        *(Arm(name, CAST_RECIPE, {"advantage.kind": "atom", **fixed, **overrides}, about)
          for name, overrides, about in CREDIT_FIXES),
        Arm("cast-score-gate", CAST_RECIPE, {"advantage.gate_on": "score"},
            "cast (atom maps, calibrated window) with the credit gated on the score (DSG's rule)"),
        Arm("flowgrpo-per-position", FLOWGRPO_RECIPE,
            {"advantage.kind": "scalar_map", "train.clip_range": cast_clip},
            "scalar reward as a constant map through CAST's per-position ratios and clip"))
    recast = (
        Arm("recast-equal", CAST_RECIPE, {"recast.weighting": "recast"},
            "cast + ReCAST step weights, equal budgets"),
        Arm("static-skewed", CAST_RECIPE, {"recast.weighting": "static", "recast.budgets": SKEWED},
            "cast + static type weights, budgets " + _budgets_text(SKEWED)),
        Arm("recast-skewed", CAST_RECIPE, {"recast.weighting": "recast", "recast.budgets": SKEWED},
            "cast + ReCAST step weights, budgets " + _budgets_text(SKEWED)))
    nft = (
        Arm("nft", FLOWGRPO_RECIPE, NFT,
            "forward-process (NFT) loss, scalar reward, ODE samples (cast_core.nft_update)"),
        Arm("nft-cast", CAST_RECIPE, {**NFT, "window.start": w.start},
            "forward-process (NFT) loss with CAST's atom-pixel map as optimality, ODE samples"),
        Arm("nft-b01", FLOWGRPO_RECIPE, NFT, "nft at beta 0.1, constant lr 3e-3 (the step "
            "that overfits one prompt, reports/nft-one-prompt)", fixed=NFT_STEP),
        Arm("nft-cast-b01", CAST_RECIPE, {**NFT, "window.start": w.start},
            "nft-cast at beta 0.1, constant lr 3e-3 (nft-b01's step)", fixed=NFT_STEP))
    by_suite = {"main": main, "ablations": (*main, *ablations), "recast": (*main, *recast),
                "nft": (*main, *nft)}
    return by_suite[suite] if suite is not None else (*main, *ablations, *recast, *nft)


def _budgets_text(budgets: dict[str, float]) -> str:
    return "/".join(f"{k} {v:g}" for k, v in budgets.items())


def select_arms(suite: str, only: list[str] | None) -> tuple[Arm, ...]:
    """The suite's arms, or those named in `only` (any suite's; the baseline among them)."""
    if only is None:
        return arms(suite)
    every = arms()
    unknown = sorted(set(only) - {a.name for a in every})
    if unknown or BASELINE not in only:
        raise ValueError(f"--arms must name known arms and include {BASELINE!r} (the gains are "
                         f"compared with it); unknown: {unknown}; known: "
                         f"{[a.name for a in every]}")
    return tuple(a for a in every if a.name in only)


def check_equal_budget(recipes: list) -> None:
    """Raise unless the recipes share seed, prompts, sampler, models and the train settings
    other than the clip range, and the arms of one objective (and, for NFT, one beta) their step
    size (`STEP`): equal samples. The window's size may differ (`WIDE_WINDOW`): it sets how many
    steps of a sample explore and are replayed in training, not how many samples an arm sees."""
    def budget(r) -> dict:
        dump = r.model_dump(mode="json")
        for name in SDE_SAMPLING:  # the forward-process arms sample with the ODE
            dump["sampling"].pop(name)
        return {"seed": r.run.seed,
                **{s: dump[s] for s in SAME_SECTIONS},
                **{f"train.{f}": dump["train"].get(f) for f in SAME_TRAIN}}

    def exploration(r) -> dict:
        return {f"sampling.{f}": getattr(r.sampling, f) for f in SDE_SAMPLING}

    def step(r) -> dict:
        return {f"train.{f}": getattr(r.train, f) for f in STEP}

    def objective(r) -> tuple:  # the arms that must share a step: one objective, one NFT beta
        return r.train.objective, r.train.nft_beta if r.train.objective == "nft" else None

    first = budget(recipes[0])
    sde = [r for r in recipes if r.train.objective == "sde"]
    for r in recipes[1:]:
        diff = [k for k, v in budget(r).items() if v != first[k]]
        if r in sde and sde[0] is not r:
            diff += [k for k, v in exploration(r).items() if v != exploration(sde[0])[k]]
        same_objective = next(q for q in recipes if objective(q) == objective(r))
        diff += [k for k, v in step(r).items() if v != step(same_objective)[k]]
        if diff:
            raise ValueError(f"arms {recipes[0].run.name} and {r.run.name} differ in {diff}: "
                             f"the comparison would not be at equal budget")
