"""Statistics of the methods benchmark (CAST vs Flow-GRPO), pure numpy.

Over training seeds: `t_interval` (mean +- t_{0.975, n-1} s / sqrt(n)), `ratio_bootstrap` (a ratio
of mean gains with a paired percentile bootstrap over seeds), `crossing_ratio` (samples for one
arm's mean probe curve to reach the baseline's final probe score, over the baseline's, with the
same bootstrap).

Over one evaluation's images (`PromptScores`, from the evaluate stage's per-image JSON): a
checkpoint's mean atom score and strict accuracy with a 95% percentile bootstrap over prompts
(prompts as clusters: each draw resamples whole prompts with all their images; the mean atom
score is a ratio of sums, as in the `evals` table: every atom of every image counts once), the
same for the gain of one checkpoint over another on the same prompts and noise (paired), and the
half-width that image noise alone gives (prompts held fixed; the part more images would shrink).
Bootstraps use a fixed generator seed, so a report is reproducible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DRAWS, LEVEL, Z95 = 10000, 0.95, 1.959963985


@dataclass(frozen=True)
class Interval:
    """mean of n values with a two-sided interval [low, high] (None when there is none)."""

    mean: float
    low: float | None
    high: float | None
    n: int


@dataclass(frozen=True)
class Ratio:
    """A ratio with its bootstrap interval; `note` says why a field is None."""

    value: float | None
    low: float | None
    high: float | None
    n: int
    note: str


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile for p in (0.5, 1): bisection on the CDF, 0.5 + the integral of the
    density from 0 (Simpson's rule, 4000 intervals); |error| < 1e-6 for df >= 1, p <= 0.999."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"need 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float) -> float:
        u = np.linspace(0.0, x, 4001)
        f = np.exp(log_c - (df + 1) / 2 * np.log1p(u * u / df))
        return 0.5 + (u[1] - u[0]) / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def t_interval(values: list[float], level: float = LEVEL) -> Interval:
    """mean +- t_{(1+level)/2, n-1} * s / sqrt(n) (s with n - 1); no interval for n < 2."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("t_interval needs at least one value")
    mean = float(x.mean())
    if x.size < 2:
        return Interval(mean, None, None, 1)
    half = t_quantile((1 + level) / 2, x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return Interval(mean, mean - half, mean + half, int(x.size))


def ratio_bootstrap(numerator: list[float], denominator: list[float], draws: int = DRAWS,
                    seed: int = 0, level: float = LEVEL, reference: str = "Flow-GRPO") -> Ratio:
    """mean(numerator) / mean(denominator) with a paired percentile bootstrap over the n seeds
    (one resample of seed indices for both lists); draws whose denominator mean is <= 0 count as
    +-infinity. No ratio when mean(denominator) <= 0 (the note names the `reference`); no
    interval with one seed or when more than the tail's share of draws have a denominator <= 0
    (the interval is unbounded)."""
    num, den = np.asarray(numerator, np.float64), np.asarray(denominator, np.float64)
    if num.shape != den.shape or num.ndim != 1 or num.size == 0:
        raise ValueError(f"need two equal, non-empty lists (paired by seed): got {num.shape}, "
                         f"{den.shape}")
    n, tail = int(num.size), (1 - level) / 2
    if den.mean() <= 0:
        return Ratio(None, None, None, n, f"{reference}'s mean improvement is <= 0: no ratio")
    value = float(num.mean() / den.mean())
    if n < 2:
        return Ratio(value, None, None, n, "one seed: no interval")
    idx = np.random.default_rng(seed).integers(0, n, size=(draws, n))  # [draws, n]
    d, m = den[idx].mean(axis=1), num[idx].mean(axis=1)
    if (d <= 0).mean() > tail:
        return Ratio(value, None, None, n, f"{(d <= 0).mean():.1%} of draws have a denominator "
                     f"<= 0: the interval is unbounded")
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(d > 0, m / d, np.copysign(np.inf, m))
    low, high = np.quantile(r, [tail, 1 - tail], method="inverted_cdf")
    return Ratio(value, float(low), float(high), n, "")


# ---- learning curves ----------------------------------------------------------------------


def samples_to_threshold(x: list[float], y: list[float], threshold: float) -> float | None:
    """The first x where the curve y(x) reaches `threshold`, linear between points; None when it
    never does. x increasing; y[0] >= threshold gives x[0]."""
    if y[0] >= threshold:
        return float(x[0])
    for k in range(1, len(y)):
        if y[k] >= threshold:
            return float(x[k - 1] + (threshold - y[k - 1]) / (y[k] - y[k - 1]) * (x[k] - x[k - 1]))
    return None


def _crossings(curves: np.ndarray, thresholds: np.ndarray, x: np.ndarray) -> np.ndarray:
    """`samples_to_threshold` of each row of curves [D, K] at its threshold [D] -> [D], +inf
    where a row never reaches it."""
    reached = curves >= thresholds[:, None]  # [D, K]
    k = reached.argmax(axis=1)  # [D] first index reached (0 when none: masked below)
    prev = np.maximum(k - 1, 0)
    rows = np.arange(curves.shape[0])
    y0, y1 = curves[rows, prev], curves[rows, k]
    with np.errstate(divide="ignore", invalid="ignore"):
        frac = np.where(k > 0, (thresholds - y0) / (y1 - y0), 0.0)
    out = x[prev] + frac * (x[k] - x[prev])
    return np.where(reached.any(axis=1), out, np.inf)


def crossing_ratio(arm: list[list[float]], baseline: list[list[float]], x: list[float],
                   draws: int = DRAWS, seed: int = 0, level: float = LEVEL) -> Ratio:
    """Samples for the arm's mean probe curve (over seeds) to reach the baseline's final probe
    score (mean over seeds), over the samples the baseline's mean curve needs; curves [seeds, K]
    at samples x [K] (x[0] = 0, the shared base). 95% percentile interval of a paired bootstrap
    over seeds (the threshold and both mean curves recomputed per draw; an arm that never
    reaches counts as +infinity). No ratio when the baseline's final score does not exceed the
    base's (no learning to match) or when the arm never reaches it."""
    a, b, xs = np.asarray(arm, np.float64), np.asarray(baseline, np.float64), np.asarray(x)
    if a.shape != b.shape or a.ndim != 2 or a.shape[1] != xs.size:
        raise ValueError(f"need two [seeds, K] curve arrays paired by seed and K samples: got "
                         f"{a.shape}, {b.shape}, {xs.shape}")
    n, tail = a.shape[0], (1 - level) / 2
    threshold = float(b[:, -1].mean())
    if not threshold > b[:, 0].mean():
        return Ratio(None, None, None, n, "Flow-GRPO's final probe score is not above the base's: "
                     "no threshold to reach")
    found = samples_to_threshold(list(xs), list(a.mean(axis=0)), threshold)
    if found is None:
        return Ratio(None, None, None, n, f"never reaches Flow-GRPO's final probe score "
                     f"{threshold:.3f} within {xs[-1]:.0f} samples")
    value = found / samples_to_threshold(list(xs), list(b.mean(axis=0)), threshold)
    if n < 2:
        return Ratio(value, None, None, n, "one seed: no interval")
    idx = np.random.default_rng(seed).integers(0, n, size=(draws, n))  # [draws, n]
    a_mean, b_mean = a[idx].mean(axis=1), b[idx].mean(axis=1)  # [draws, K]
    t = b_mean[:, -1]  # [draws]
    f, d = _crossings(a_mean, t, xs), _crossings(b_mean, t, xs)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where((t > b_mean[:, 0]) & (d > 0), f / d, np.inf)
    low, high = np.quantile(r, [tail, 1 - tail], method="inverted_cdf")
    return Ratio(value, float(low), float(high), n, "")


# ---- one evaluation's images --------------------------------------------------------------


@dataclass(frozen=True)
class PromptScores:
    """One split of one evaluation, per prompt p (P prompts, I images each): atom_sums [P] (sum
    of every atom score of its I images), atoms [P] (I x A_p), strict [P] (images whose every atom
    scores > 0.5), image_means [P, I] (each image's mean atom score)."""

    prompts: tuple[str, ...]
    atom_sums: np.ndarray
    atoms: np.ndarray
    strict: np.ndarray
    image_means: np.ndarray

    @classmethod
    def from_json(cls, split: dict) -> PromptScores:
        """From one split of the evaluate stage's per-image JSON (prompt-major images)."""
        i = split["images_per_prompt"]
        per_prompt = [split["scores"][p * i:(p + 1) * i] for p in range(len(split["prompts"]))]
        return cls(tuple(split["prompts"]),
                   np.array([sum(map(sum, imgs)) for imgs in per_prompt], np.float64),
                   np.array([sum(map(len, imgs)) for imgs in per_prompt], np.float64),
                   np.array([sum(min(s) > 0.5 for s in imgs) for imgs in per_prompt], np.float64),
                   np.array([[float(np.mean(s)) for s in imgs] for imgs in per_prompt]))

    @property
    def images(self) -> int:
        return int(self.image_means.size)


@dataclass(frozen=True)
class CheckpointFigures:
    """mean atom score and strict accuracy, each with its prompt-cluster bootstrap interval (n =
    prompts); noise_half_width: the mean score's 95% half-width from image noise alone."""

    mean_score: Interval
    strict_accuracy: Interval
    noise_half_width: float | None
    images: int


def _statistics(s: PromptScores) -> tuple[float, float]:
    return float(s.atom_sums.sum() / s.atoms.sum()), float(s.strict.sum() / s.image_means.size)


def _percentiles(draws: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1 - level) / 2
    low, high = np.quantile(draws, [tail, 1 - tail])
    return float(low), float(high)


def checkpoint_figures(s: PromptScores, draws: int = 2000, seed: int = 0,
                       level: float = LEVEL) -> CheckpointFigures:
    """The checkpoint's figures on one split with prompt-cluster bootstrap intervals."""
    p, per_prompt = len(s.prompts), s.image_means.shape[1]
    idx = np.random.default_rng(seed).integers(0, p, size=(draws, p))  # [draws, P]
    score = s.atom_sums[idx].sum(axis=1) / s.atoms[idx].sum(axis=1)
    strict = s.strict[idx].sum(axis=1) / (p * per_prompt)
    mean, acc = _statistics(s)
    return CheckpointFigures(Interval(mean, *_percentiles(score, level), p),
                             Interval(acc, *_percentiles(strict, level), p),
                             noise_half_width(s), s.images)


def noise_half_width(s: PromptScores, z: float = Z95) -> float | None:
    """z x the standard error of the mean atom score with the prompts fixed: image i of prompt p
    has mean m_pi over A_p atoms, the score is sum_p A_p sum_i m_pi / (I sum_p A_p), so its
    variance is sum_p A_p^2 I var_p / (I sum_p A_p)^2, var_p the within-prompt variance of m_pi
    (None with one image per prompt)."""
    per_prompt = s.image_means.shape[1]
    if per_prompt < 2:
        return None
    a = s.atoms / per_prompt  # [P] atoms of one image
    var = s.image_means.var(axis=1, ddof=1)  # [P]
    return float(z * math.sqrt((a**2 * per_prompt * var).sum()) / (per_prompt * a.sum()))


def paired_gain(new: PromptScores, old: PromptScores, draws: int = 2000, seed: int = 0,
                level: float = LEVEL) -> tuple[Interval, Interval]:
    """(mean atom score, strict accuracy) of `new` minus `old` on the same prompts and noise,
    each with a paired bootstrap over prompts (one resample of prompts for both)."""
    if new.prompts != old.prompts or new.image_means.shape != old.image_means.shape:
        raise ValueError("paired gains need the same prompts and images per prompt in both "
                         "evaluations")
    p, per_prompt = len(new.prompts), new.image_means.shape[1]
    idx = np.random.default_rng(seed).integers(0, p, size=(draws, p))  # [draws, P]
    atoms = new.atoms[idx].sum(axis=1)
    score = (new.atom_sums[idx].sum(axis=1) - old.atom_sums[idx].sum(axis=1)) / atoms
    strict = (new.strict[idx].sum(axis=1) - old.strict[idx].sum(axis=1)) / (p * per_prompt)
    (m1, a1), (m0, a0) = _statistics(new), _statistics(old)
    return (Interval(m1 - m0, *_percentiles(score, level), p),
            Interval(a1 - a0, *_percentiles(strict, level), p))
