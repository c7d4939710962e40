"""benchmarks/policy_drift.py's figures on moves whose answers are known."""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from policy_drift import drift_figures


def test_a_straight_line_a_reversal_and_independent_moves():
    step = torch.tensor([3.0, 4.0])
    line = drift_figures([k * step for k in range(5)])
    assert line["rms"] == pytest.approx([k * 5 / math.sqrt(2) for k in range(5)])
    assert line["cos_prev"] == [None, None, pytest.approx(1.0), pytest.approx(1.0),
                                pytest.approx(1.0)]
    assert line["net_over_path"] == pytest.approx(1.0) and line["random_walk"] == 0.5
    back = drift_figures([torch.zeros(2), step, torch.zeros(2)])  # out and back
    assert back["cos_prev"][2] == pytest.approx(-1.0) and back["net_over_path"] == 0.0
    g = torch.Generator().manual_seed(0)
    walk = torch.cumsum(torch.randn(401, 10_000, generator=g), dim=0)  # 400 independent moves
    fig = drift_figures(list(walk))
    assert abs(sum(fig["cos_prev"][2:]) / 399) < 0.02
    assert fig["net_over_path"] == pytest.approx(fig["random_walk"], rel=0.1)
