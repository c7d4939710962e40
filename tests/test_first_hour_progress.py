"""Issue 19, item 13: rollout and window calibration report progress, one callback per denoising
step, and `tasks.stages.progress` turns it into tqdm lines in the run's log."""

from __future__ import annotations

import logging

import pytest
import torch

from cast_core.backbones.shapes import ShapesBackbone, ShapesBackboneConfig
from cast_core.calibration import similarity_curves
from cast_core.rollout import RolloutSpec, rollout
from cast_core.shapes.embedder import LayoutEmbedder
from cast_core.window import SdeWindow
from tasks.stages.progress import LoggerStream, stage_progress

TINY = ShapesBackboneConfig(num_layers=1, num_heads=2, head_dim=8, text_width=16, text_layers=1)
PROMPTS = ["a photo of a red circle", "a photo of two blue squares", "a photo of a green triangle"]


@pytest.fixture(scope="module")
def tiny() -> ShapesBackbone:
    torch.manual_seed(0)
    return ShapesBackbone(TINY).eval()


def test_rollout_reports_every_step_of_every_chunk_and_is_unchanged_by_it(tiny):
    spec = RolloutSpec(num_steps=4, guidance_scale=2.0, noise_level=0.7, sde_kind="flow_sde",
                       window=SdeWindow(1, 3))
    calls: list[int] = []
    seen = rollout(tiny, PROMPTS, [1, 2, 3], spec, chunk_size=2, progress=calls.append)
    assert calls == [1] * (2 * 4)  # ceil(3 / 2) chunks x 4 steps
    quiet = rollout(tiny, PROMPTS, [1, 2, 3], spec, chunk_size=2)
    assert torch.equal(seen.x0, quiet.x0) and torch.equal(seen.log_probs, quiet.log_probs)


def test_calibration_reports_every_step_of_every_chunk(tiny):
    calls: list[int] = []
    similarity_curves(tiny, LayoutEmbedder(), PROMPTS, [0, 1, 2], 5, 1.0, chunk_size=1,
                      progress=calls.append)
    assert calls == [1] * (3 * 5)


def test_the_bar_goes_to_the_run_log_as_lines(caplog):
    logger = logging.getLogger("test-progress")
    bar = stage_progress(6, "rollout 0 (12 samples)", logger=logger)
    with caplog.at_level(logging.INFO, logger="test-progress"), bar as advance:
        for _ in range(6):
            advance(1)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("rollout 0 (12 samples):   0%")
    assert lines[-1].startswith("rollout 0 (12 samples): 100%") and "6/6" in lines[-1]
    assert all("\r" not in line and "\n" not in line for line in lines)


def test_logger_stream_drops_tqdms_carriage_returns_and_blank_writes(caplog):
    logger = logging.getLogger("test-stream")
    stream = LoggerStream(logger)
    with caplog.at_level(logging.INFO, logger="test-stream"):
        assert stream.write("\rbar 50%") == len("\rbar 50%")
        stream.write("\n")
        stream.write("\r")
    assert [r.getMessage() for r in caplog.records] == ["bar 50%"]
