"""What a methods benchmark trains and judges on: its `Size`, the named `PROTOCOLS`, the eval
passes every checkpoint is judged with (`EvalPass`), the prompt files, and each arm's recipe at a
size and seed (`recipe_for`).

Every arm trains on data/prompts/pool.jsonl (32 hard-tag train prompts, disjoint from every
evaluation prompt; a protocol may keep its first N) with `prompts.selection = "cycle"`: iteration
k trains on pool positions (k B + j) mod 32, so every prompt comes back every 32 / B iterations and
all arms see the same prompts at the same iteration; run seed s gives every arm the same rollout
noise. Evaluations (the evaluate stage, one `evals` part per split; `eval_passes`):
- probe, after every iteration and for the base (iteration -1): the pool prompts x
  `probe_images`, seed offset 0 (the same noise at every checkpoint, so the curve shows a trend
  rather than a draw);
- final, after the last iteration and for the base: split "pool" (the training prompts with fresh
  noise, seed offset 1000) x `pool_images`, and the held-out splits "hard"
  (data/prompts/hard.jsonl) x `hard_images` and "eval" (data/prompts/eval.jsonl) x `eval_images`
  (seed offset 0; `held_out_prompts` keeps an evenly spaced subset of each for small runs). Every
  arm and the base use the same prompts and noise: the eval specs are checked equal
  (`check_paired_evals`), so every gain and every difference between arms is paired.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from methods.arms import Arm

POOL, HARD, EVAL = ("data/prompts/pool.jsonl", "data/prompts/hard.jsonl",
                    "data/prompts/eval.jsonl")
FINAL_SPLITS = ("pool", "hard", "eval")
METRICS = (("mean_score", "mean atom score"), ("strict_accuracy", "strict accuracy"))
PROBE_OFFSET, FINAL_OFFSET = 0, 1000


@dataclass(frozen=True)
class Size:
    """How big a benchmark is: seeds, iterations of B prompts x G samples, images a prompt of the
    probe and of the final evaluation's splits; `held_out_prompts` (None: every prompt of
    hard.jsonl and eval.jsonl) keeps an evenly spaced subset of each;
    `calibration_prompts` None keeps the recipe's."""

    iterations: int
    seeds: int
    per_iteration: int
    group_size: int
    probe_images: int
    pool_images: int
    hard_images: int
    eval_images: int
    held_out_prompts: int | None = None
    calibration_prompts: int | None = None

    def __post_init__(self) -> None:
        small = [f.name for f in fields(self) if isinstance(v := getattr(self, f.name), int)
                 and v < 1]
        if small or self.group_size < 2:
            raise ValueError(f"every size must be >= 1 (group_size >= 2); got {self}")

    def samples(self) -> list[int]:
        """Samples seen by the base (0) and by the checkpoint of each iteration."""
        return [k * self.per_iteration * self.group_size for k in range(self.iterations + 1)]


FULL = Size(iterations=16, seeds=3, per_iteration=8, group_size=16, probe_images=4,
            pool_images=32, hard_images=6, eval_images=4)
QUICK = Size(iterations=16, seeds=1, per_iteration=8, group_size=16, probe_images=8,
             pool_images=16, hard_images=2, eval_images=2, held_out_prompts=64)


@dataclass(frozen=True)
class Protocol:
    """What a benchmark trains and judges on: its Size, the CFG scale of every rollout and
    evaluation (None: the recipes'), the pool's first N prompts (None: all 32), one learning
    rate for every arm (None: the recipes'), and where its store and report go by default;
    `kl_target`: every arm's `train.kl_target_nats` (None: a constant lr, whatever the recipes
    set), so that each objective moves the policy the same distance an iteration. The command
    line's flags override each field."""

    size: Size
    guidance: float | None
    pool_prompts: int | None
    lr: float | None
    store: str
    report: str
    about: str
    kl_target: float | None = None


CFG1_POOL8 = Size(iterations=40, seeds=3, per_iteration=8, group_size=16, probe_images=8,
                  pool_images=16, hard_images=2, eval_images=2, held_out_prompts=64)
PROTOCOLS = {
    # the default, the recipes' footing (why each protocol: reports/bench-methods-history.md);
    # with the recipes' LoRA rank 8 it gave reports/cfg1-pool8-40it-kl003, rank 32 (theirs since
    # 2026-12-06) reports/cfg1-pool8-40it-rank32
    "cfg1-pool8": Protocol(CFG1_POOL8, 1.0, 8, 1e-3, "runs/bench-cfg1-pool8/store",
                           "reports/cfg1-pool8-40it-rank32",
                           "CFG 1, the pool's first 8 prompts, KL-targeted lr (0.03 nats an "
                           "iteration from 1e-3), 40 iterations", kl_target=0.03),
    # the same at a constant lr 4e-4
    "cfg1-pool8-lr4e-4": Protocol(CFG1_POOL8, 1.0, 8, 4e-4, "runs/bench-cfg1-pool8-lr4e-4/store",
                                  "reports/cfg1-pool8-40it-lr4e-4",
                                  "CFG 1, the pool's first 8 prompts, a constant lr 4e-4, "
                                  "40 iterations"),
    # CFG 4, all 32 pool prompts, a constant lr 1e-3
    "cfg4-pool32": Protocol(FULL, 4.0, None, 1e-3, "runs/bench-methods",
                            "reports/cast-vs-flowgrpo",
                            "CFG 4, the 32-prompt pool, a constant lr 1e-3, 16 iterations"),
    # --quick: the default's footing for Flow-GRPO alone, one seed and 2,048 samples
    "quick": Protocol(QUICK, 1.0, 8, 1e-3, "runs/bench-methods-quick/store",
                      "runs/bench-methods-quick/report",
                      "quick: CFG 1, the pool's first 8 prompts, KL-targeted lr (0.03 nats an "
                      "iteration from 1e-3), Flow-GRPO, 1 seed x 16 iterations", kl_target=0.03),
}
DEFAULT_PROTOCOL = "cfg1-pool8"


@dataclass(frozen=True)
class EvalPass:
    """One evaluation section: its splits {name: prompt file}, images a prompt, seed offset."""

    name: str
    splits: dict
    images: int
    seed_offset: int


def eval_passes(size: Size, held_out: dict[str, str], pool: str = POOL) -> dict[str, EvalPass]:
    """probe (every checkpoint) and the final evaluation's pool, hard and eval (one split each,
    named as the pass); `held_out` {"hard": file, "eval": file}."""
    return {"probe": EvalPass("probe", {"probe": pool}, size.probe_images, PROBE_OFFSET),
            "pool": EvalPass("pool", {"pool": pool}, size.pool_images, FINAL_OFFSET),
            "hard": EvalPass("hard", {"hard": held_out["hard"]}, size.hard_images, PROBE_OFFSET),
            "eval": EvalPass("eval", {"eval": held_out["eval"]}, size.eval_images, PROBE_OFFSET)}


def with_eval(recipe, p: EvalPass):
    """The recipe with its eval section replaced by the pass's (validated)."""
    from tasks.stages.recipe_sections import EvalSection

    ev = recipe.eval
    section = EvalSection(splits=p.splits, images_per_prompt=p.images, num_steps=ev.num_steps,
                          guidance_scale=ev.guidance_scale, max_prompts=None,
                          seed_offset=p.seed_offset)
    return recipe.model_copy(update={"eval": section})



# The store's name for an arm's runs where it differs from the arm's own (`runs_as`): the runs of
# an arm whose definition was renamed after they were trained are read under the name they were
# trained with. The run pin (tasks.store.run_pin) refuses an alias whose runs were trained with
# another recipe, so an alias cannot pass one method's runs off as another's.
_RUNS_AS: dict[str, str] = {}


def run_name(prefix: str, arm: str, seed: int) -> str:
    return f"{prefix}-{_RUNS_AS.get(arm, arm)}-s{seed}"


@contextmanager
def runs_as(aliases: dict[str, str], arms: list[str]):
    """Within the block, arm a's runs are `{prefix}-{aliases[a]}-s{seed}`; every aliased arm must
    be among `arms`, and no two arms may end up with one run name."""
    unknown = sorted(set(aliases) - set(arms))
    if unknown:
        raise ValueError(f"--runs-as names arms that are not run: {unknown}; arms are {arms}")
    stored = [aliases.get(a, a) for a in arms]
    clash = sorted({s for s in stored if stored.count(s) > 1})
    if clash:
        raise ValueError(f"--runs-as gives two arms the run name(s) {clash}: alias the arm that "
                         f"holds the name too (e.g. cast=cast-old,cast-new=cast)")
    previous = dict(_RUNS_AS)
    _RUNS_AS.clear()
    _RUNS_AS.update(aliases)
    try:
        yield
    finally:
        _RUNS_AS.clear()
        _RUNS_AS.update(previous)


def pool_file(store, prompts: int | None) -> str:
    """The training pool: POOL, or with `prompts` its first that many records, stored as a blob
    (a pool small enough to visit every prompt every iteration)."""
    if prompts is None:
        return POOL
    lines = _records(POOL)
    if not 1 <= prompts <= len(lines):
        raise ValueError(f"--pool-prompts must be in [1, {len(lines)}] ({POOL}); got {prompts}")
    return _subset_blob(store, lines, range(prompts))


def _records(path: str) -> list[str]:
    """The non-empty lines of a JSONL prompt file."""
    return [x for x in Path(path).read_text().splitlines() if x.strip()]


def _subset_blob(store, lines: list[str], keep) -> str:
    """The lines at indices `keep` stored as a JSONL blob; its resolved path."""
    blob = store.put_blob("".join(lines[i] + "\n" for i in keep).encode(), "jsonl")
    return str(store.resolve(blob.path))


def held_out_files(store, size: Size) -> dict[str, str]:
    """{"hard": file, "eval": file}: the files themselves, or with `held_out_prompts` an evenly
    spaced subset of each (the files are grouped by tag), stored as blobs."""
    files = {"hard": HARD, "eval": EVAL}
    if size.held_out_prompts is None:
        return files
    out = {}
    for split, path in files.items():
        lines = _records(path)
        keep = np.unique(np.linspace(0, len(lines) - 1, min(size.held_out_prompts, len(lines)))
                         .round().astype(int))
        out[split] = _subset_blob(store, lines, keep)
    return out


def recipe_for(arm: Arm, seed: int, size: Size, name: str, threads: int | None,
               lr: float | None = None, guidance: float | None = None, pool: str = POOL,
               kl_target: float | None = None, settings: dict | None = None):
    """The arm's training recipe at this size and seed, run `name`, on the pool with "cycle"
    (`lr`, when given, replaces the learning rate; `guidance` the CFG scale of the rollouts and
    of every evaluation; `pool` another training pool file; `kl_target` sets
    `train.kl_target_nats`, None a constant lr even where the recipe targets a KL; the arm's
    `fixed` settings (its own step) then replace these; `settings`
    {dotted key: value} are set on every arm after its own overrides, as `--set` does; a
    `train.velocity_target` among them replaces the KL target, and a forward-process arm, which
    has no SDE window to measure a move on, drops it)."""
    from tasks.stages.recipe import load_recipe

    sized = {"prompts.per_iteration": size.per_iteration, "prompts.group_size": size.group_size,
             "window.calibration_prompts": size.calibration_prompts, "run.threads": threads,
             "train.lr": lr, "sampling.guidance_scale": guidance, "eval.guidance_scale": guidance}
    settings = settings or {}
    nft = arm.overrides.get("train.objective") == "nft"
    by_velocity = settings.get("train.velocity_target") is not None
    return load_recipe(arm.recipe, {
        **arm.overrides, **{k: v for k, v in sized.items() if v is not None},
        # None: a constant lr, whatever the recipe's; a forward-process arm has no likelihoods
        # to measure a KL with, so it trains at the constant lr (`arms.STEP`)
        "train.kl_target_nats": None if nft or by_velocity else kl_target,
        **arm.fixed, **settings, **({"train.velocity_target": None} if nft else {}),
        "run.name": name, "run.seed": seed, "prompts.train": pool, "prompts.selection": "cycle"})



def check_paired_evals(recipes: list, passes: dict[str, EvalPass]) -> None:
    """Raise unless every recipe (arms and base) has the same eval spec under each pass."""
    from tasks.stages.evaluate import eval_spec_hash

    for p in passes.values():
        if len({eval_spec_hash(with_eval(r, p)) for r in recipes}) != 1:
            raise ValueError(f"the eval specs of pass {p.name!r} differ between arms: the final "
                             f"evaluations would not be paired")
