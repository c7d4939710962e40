"""Structure-formation point against the analytic knee of a logistic curve, the threshold
fallback, and window construction and validation."""

import math

import pytest
import torch

from cast_core.window import (
    SdeWindow,
    fixed_window,
    signed_curvature,
    structure_formation_step,
    window_from_formation,
)


def _logistic(x: torch.Tensor, low: float, high: float, beta: float, x_c: float) -> torch.Tensor:
    return low + (high - low) * torch.sigmoid(beta * (x - x_c))


def _analytic_upper_knee_step(num_steps, low, high, beta, x_c) -> int:
    """Most negative curvature of the logistic on a dense grid, mapped to the step grid."""
    x = torch.linspace(0.0, 1.0, 200001, dtype=torch.float64)
    sig = torch.sigmoid(beta * (x - x_c))
    dy = (high - low) * beta * sig * (1 - sig)
    d2y = (high - low) * beta**2 * sig * (1 - sig) * (1 - 2 * sig)
    kappa = d2y / (1 + dy**2) ** 1.5
    return round(float(x[torch.argmin(kappa)]) * (num_steps - 1))


def _steps_grid(num_steps: int) -> torch.Tensor:
    return torch.arange(num_steps, dtype=torch.float64) / (num_steps - 1)


@pytest.mark.parametrize(
    "num_steps, low, high, beta, x_c",
    [(40, 0.3, 1.0, 12.0, 0.4), (28, 0.55, 0.98, 9.0, 0.3), (50, 0.1, 0.95, 20.0, 0.6)],
)
def test_knee_of_a_logistic_curve_is_the_analytic_one(num_steps, low, high, beta, x_c):
    curve = _logistic(_steps_grid(num_steps), low, high, beta, x_c)
    point = structure_formation_step(curve)
    expected = _analytic_upper_knee_step(num_steps, low, high, beta, x_c)
    assert point.method_used == "curvature"
    assert abs(point.step - expected) <= 1
    assert point.curve.shape == point.curvature.shape == (num_steps,)


def test_signed_curvature_of_a_parabola_is_closed_form():
    x = _steps_grid(21)
    curve = 1 - (1 - x) ** 2  # y' = 2 (1 - x), y'' = -2
    expected = -2 / (1 + (2 * (1 - x)) ** 2) ** 1.5
    torch.testing.assert_close(signed_curvature(curve), expected, rtol=0, atol=1e-9)


def test_batch_is_averaged_over_prompts():
    base = _logistic(_steps_grid(30), 0.3, 1.0, 12.0, 0.4)
    wiggle = 0.05 * torch.sin(torch.arange(30, dtype=torch.float64))
    batch = torch.stack([base + wiggle, base - wiggle, base + 2 * wiggle, base - 2 * wiggle])
    point = structure_formation_step(batch)
    torch.testing.assert_close(point.curve, base)
    assert point.step == structure_formation_step(base).step


def test_linear_curve_falls_back_to_threshold():
    num_steps, threshold = 11, 0.85
    curve = 0.2 + 0.8 * _steps_grid(num_steps)
    point = structure_formation_step(curve, threshold=threshold)
    assert point.method_used == "threshold"
    assert point.step == math.ceil(threshold * (num_steps - 1))  # progress is k / (S - 1)


@pytest.mark.parametrize("curve", [torch.full((12,), 0.97), torch.linspace(0.9, 0.5, 12)])
def test_flat_or_falling_curve_falls_back_to_step_zero(curve):
    point = structure_formation_step(curve)
    assert point.method_used == "threshold"
    assert point.step == 0


def test_threshold_method_uses_progress_over_the_curves_own_range():
    num_steps, threshold = 40, 0.7
    curve = _logistic(_steps_grid(num_steps), 0.3, 1.0, 12.0, 0.4)
    progress = [(float(c) - float(curve[0])) / float(curve[-1] - curve[0]) for c in curve]
    expected = next(k for k, p in enumerate(progress) if p >= threshold)
    point = structure_formation_step(curve.float(), method="threshold", threshold=threshold)
    assert (point.step, point.method_used) == (expected, "threshold")


@pytest.mark.parametrize(
    "similarity, kwargs, match",
    [
        (torch.tensor([0.1, 0.9]), {}, "S >= 3"),
        (torch.zeros(2, 3, 4), {}, r"\[P, S\]"),
        (torch.tensor([0.1, float("nan"), 0.9]), {}, "finite"),
        (torch.linspace(0, 1, 5), {"threshold": 1.5}, "threshold"),
        (torch.linspace(0, 1, 5), {"method": "kneedle"}, "method"),
    ],
)
def test_invalid_curves_raise_with_a_reason(similarity, kwargs, match):
    with pytest.raises(ValueError, match=match):
        structure_formation_step(similarity, **kwargs)


def test_window_exposes_steps_and_size():
    window = SdeWindow(3, 7)
    assert window.steps == range(3, 7) and window.size == 4


@pytest.mark.parametrize(
    "start, end, match",
    [
        (-1, 3, "start must be >= 0"),
        (4, 4, "start < end"),
        (5, 2, "start < end"),
        (1.5, 3, "int step index"),
        (True, 3, "got True"),
    ],
)
def test_invalid_window_raises_with_a_reason(start, end, match):
    with pytest.raises(ValueError, match=match):
        SdeWindow(start, end)


@pytest.mark.parametrize(
    "formation, num_steps, size, bounds, expected",
    [
        (10, 20, 4, {}, (7, 11)),  # ends at the formation step, inclusive
        (1, 20, 4, {}, (0, 4)),  # shifted right to start at 0
        (18, 20, 4, {"max_end": 18}, (14, 18)),  # shifted left under max_end
        (2, 20, 4, {"min_start": 2}, (2, 6)),
        (19, 20, 20, {}, (0, 20)),
    ],
)
def test_window_from_formation(formation, num_steps, size, bounds, expected):
    window = window_from_formation(formation, num_steps, size, **bounds)
    assert (window.start, window.end) == expected


@pytest.mark.parametrize(
    "formation, num_steps, size, bounds, match",
    [
        (10, 20, 5, {"min_start": 2, "max_end": 6}, "does not fit"),
        (20, 20, 4, {}, "formation_step"),
        (5, 20, 0, {}, "size must be >= 1"),
        (5, 20, 4, {"max_end": 25}, "max_end <= num_steps"),
    ],
)
def test_window_from_formation_rejects_impossible_bounds(formation, num_steps, size, bounds, match):
    with pytest.raises(ValueError, match=match):
        window_from_formation(formation, num_steps, size, **bounds)


def test_fixed_window():
    assert fixed_window(0, 2, 10) == SdeWindow(0, 2)
    with pytest.raises(ValueError, match="exceeds the 10 sampling steps"):
        fixed_window(9, 2, 10)
