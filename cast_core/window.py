"""Structure-formation point from Tweedie similarity curves, and the SDE window around it.

Input: s_k = cos(e(x0_hat_k), e(x_final)) for denoising steps k = 0..S-1 (k = 0 is the first step,
from pure noise), one curve [S] or a batch [P, S] over P prompts, averaged over prompts first. The
curve rises from low values at noise towards 1 at the end.

Curvature rule (default): in coordinates x = k / (S - 1) in [0, 1] and y = s (the raw similarity,
not rescaled), the signed curvature is kappa = y'' / (1 + y'^2)^(3/2), with y' by second-order
finite differences (torch.gradient) and y'' by the three-point stencil, its two end values copied
from their neighbours. The structure-formation point is the upper knee, where the rising curve
bends into its plateau: the interior step with the most negative kappa. The ends are never knees.

Threshold rule (fallback, or on request): progress p_k = (s_k - s_0) / (s_{S-1} - s_0), the curve
rescaled by its own range so that p_0 = 0 and p_{S-1} = 1; the point is the first step with
p_k >= threshold (default 0.9).

The curvature rule falls back to the threshold rule, and says so in ``method_used``, when the curve
has no meaningful knee: it does not rise overall (s_{S-1} - s_0 <= range_tol) or its most negative
interior curvature is above -curvature_tol (a straight or convex curve). A curve that does not rise
carries no formation signal: its threshold point is step 0, i.e. structure counts as formed at the
first step, which places the window at the earliest steps (Flow-GRPO's usual placement).

Departures (the CAST paper's code is not public): no smoothing beyond the average over prompts;
the knee is the maximum curvature among concave points, not Kneedle's distance-to-chord.

Windows are half-open ranges [start, end) of step indices; the window ends at the formation step
(inclusive) and is shifted to fit within bounds.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

FormationMethod = Literal["curvature", "threshold"]


@dataclass(frozen=True)
class FormationPoint:
    """Structure-formation point of a similarity curve.

    step: the formation step index in [0, S).
    method_used: the rule that chose it ("threshold" when the curvature rule fell back).
    curve: [S] float64, the prompt-averaged similarity curve.
    curvature: [S] float64, its signed curvature in normalised coordinates.
    """

    step: int
    method_used: FormationMethod
    curve: Tensor
    curvature: Tensor


def _mean_curve(similarity: Tensor) -> Tensor:
    """[S] or [P, S] -> [S] float64, validated."""
    s = torch.as_tensor(similarity, dtype=torch.float64)
    if s.dim() not in (1, 2) or s.shape[-1] < 3 or s.numel() == 0:
        raise ValueError(
            "similarity must have shape [S] or [P, S] with S >= 3 steps and P >= 1 prompts; "
            f"got {tuple(s.shape)}"
        )
    if not bool(torch.isfinite(s).all()):
        raise ValueError("similarity must be finite; drop or recompute the non-finite entries")
    return s.mean(dim=0) if s.dim() == 2 else s


def signed_curvature(curve: Tensor) -> Tensor:
    """Signed curvature of y = curve over x = k / (S - 1). curve: [S], S >= 3 -> [S]."""
    h = 1.0 / (curve.shape[0] - 1)
    (dy,) = torch.gradient(curve, spacing=h, edge_order=2)  # [S]
    d2y = (curve[2:] - 2 * curve[1:-1] + curve[:-2]) / h**2  # [S - 2]
    d2y = torch.cat([d2y[:1], d2y, d2y[-1:]])  # [S]
    return d2y / (1 + dy**2) ** 1.5


def _knee_step(
    curve: Tensor, curvature: Tensor, curvature_tol: float, range_tol: float
) -> int | None:
    """The interior step of most negative curvature, or None when there is no meaningful knee."""
    if float(curve[-1] - curve[0]) <= range_tol:
        return None
    interior = curvature[1:-1]
    k = int(torch.argmin(interior))
    if float(interior[k]) > -curvature_tol:
        return None
    return k + 1


def _threshold_step(curve: Tensor, threshold: float, range_tol: float) -> int:
    """First step whose progress (s_k - s_0) / (s_final - s_0) reaches threshold; 0 if flat."""
    rise = float(curve[-1] - curve[0])
    if rise <= range_tol:
        return 0
    progress = (curve - curve[0]) / rise  # [S], progress[-1] = 1
    return int(torch.argmax((progress >= threshold).to(torch.int8)))


def structure_formation_step(
    similarity: Tensor,
    method: FormationMethod = "curvature",
    threshold: float = 0.9,
    curvature_tol: float = 0.1,
    range_tol: float = 1e-6,
) -> FormationPoint:
    """Structure-formation step of a similarity curve [S] or batch [P, S] (averaged over P).

    curvature_tol: a knee needs curvature below -curvature_tol (normalised coordinates).
    range_tol: a curve must rise by more than this from step 0 to the last step to have a knee.
    """
    if method not in ("curvature", "threshold"):
        raise ValueError(f"method must be 'curvature' or 'threshold'; got {method!r}")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(
            f"threshold is a fraction of the curve's rise, in (0, 1]; got {threshold!r}"
        )
    if curvature_tol < 0 or range_tol < 0:
        raise ValueError(
            f"curvature_tol and range_tol must be >= 0; got {curvature_tol!r}, {range_tol!r}"
        )
    curve = _mean_curve(similarity)
    curvature = signed_curvature(curve)
    if method == "curvature":
        knee = _knee_step(curve, curvature, curvature_tol, range_tol)
        if knee is not None:
            return FormationPoint(knee, "curvature", curve, curvature)
    step = _threshold_step(curve, threshold, range_tol)
    return FormationPoint(step, "threshold", curve, curvature)


def _as_index(value: object, name: str) -> int:
    """value as an int step index (anything with __index__ except bool), else ValueError."""
    try:
        index = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        index = None
    if index is None or isinstance(value, bool):
        raise ValueError(
            f"{name} must be an int step index; got {value!r} ({type(value).__name__})"
        )
    return index


@dataclass(frozen=True)
class SdeWindow:
    """Half-open range [start, end) of denoising-step indices that get SDE noise and gradient.

    Step 0 is the first step (from t = 1); steps outside the window use the ODE.
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", _as_index(self.start, "SdeWindow.start"))
        object.__setattr__(self, "end", _as_index(self.end, "SdeWindow.end"))
        if self.start < 0:
            raise ValueError(f"SdeWindow.start must be >= 0 (a step index); got {self.start}")
        if self.end <= self.start:
            raise ValueError(
                "SdeWindow needs start < end (half-open [start, end) with at least one step); "
                f"got start={self.start}, end={self.end}; set end = start + size"
            )

    @property
    def steps(self) -> range:
        return range(self.start, self.end)

    @property
    def size(self) -> int:
        return self.end - self.start

    def require_within(self, num_steps: int) -> None:
        """Raise ValueError unless the window lies within steps 0..num_steps-1."""
        if self.end > num_steps:
            raise ValueError(
                f"SdeWindow [{self.start}, {self.end}) exceeds the {num_steps} sampling steps; "
                f"lower end to <= {num_steps} or raise num_steps"
            )


def fixed_window(start: int, size: int, num_steps: int) -> SdeWindow:
    """Hand-set window [start, start + size) (Flow-GRPO-Fast style), checked against num_steps."""
    size = _as_index(size, "size")
    if size < 1:
        raise ValueError(f"window size must be >= 1; got {size}")
    window = SdeWindow(start, start + size)
    window.require_within(num_steps)
    return window


def window_from_formation(
    formation_step: int,
    num_steps: int,
    size: int,
    min_start: int = 0,
    max_end: int | None = None,
) -> SdeWindow:
    """The ``size`` steps ending at formation_step (inclusive), shifted into [min_start, max_end).

    max_end defaults to num_steps. Raises ValueError when the bounds cannot hold ``size`` steps.
    """
    num_steps, size = _as_index(num_steps, "num_steps"), _as_index(size, "size")
    formation_step = _as_index(formation_step, "formation_step")
    max_end = num_steps if max_end is None else _as_index(max_end, "max_end")
    min_start = _as_index(min_start, "min_start")
    if not 0 <= formation_step < num_steps:
        raise ValueError(
            f"formation_step must lie in [0, num_steps) = [0, {num_steps}); got {formation_step}"
        )
    if size < 1:
        raise ValueError(f"window size must be >= 1; got {size}")
    if not 0 <= min_start < max_end <= num_steps:
        raise ValueError(
            "window bounds must satisfy 0 <= min_start < max_end <= num_steps; "
            f"got min_start={min_start}, max_end={max_end}, num_steps={num_steps}"
        )
    if max_end - min_start < size:
        raise ValueError(
            f"a window of size {size} does not fit in the bounds [{min_start}, {max_end}) "
            f"({max_end - min_start} steps); reduce size or widen min_start/max_end"
        )
    end = formation_step + 1
    start = min(max(end - size, min_start), max_end - size)
    return SdeWindow(start, start + size)
