"""Issue 19, item 14: the iteration report draws the labelled rollout contact sheet (the prompt
above each row, each sample's mean atom score under its image) and copies the window calibration
plot into `<store>/reports/<run>/`; outside a Prefect run it publishes no artifact."""

from __future__ import annotations

import io
import math
import shutil

import numpy as np
import pytest
from PIL import Image
from pipeline_helpers import reference

from tasks.reporting.contact_sheet import GAP, SCALE, TEXT_H, SheetRow, labelled_sheet
from tasks.reporting.report import iteration_report, publish_images, report_paths
from tasks.store.store import Store


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def ink(region: np.ndarray) -> int:
    """Non-white pixels in a region."""
    return int((region != 255).any(axis=-1).sum())


def tile(sheet: np.ndarray, row: int, column: int, h: int, w: int, row_h: int) -> np.ndarray:
    top = GAP + TEXT_H + GAP + row * row_h + TEXT_H
    left = GAP + column * (w * SCALE + GAP)
    return sheet[top:top + h * SCALE, left:left + w * SCALE]


def label(sheet: np.ndarray, row: int, column: int, h: int, w: int, row_h: int) -> np.ndarray:
    top = GAP + TEXT_H + GAP + row * row_h + TEXT_H + h * SCALE
    left = GAP + column * (w * SCALE + GAP)
    return sheet[top:top + TEXT_H, left:left + w * SCALE]


def test_each_image_sits_in_its_cell_with_its_score_under_it():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, size=(2, 3, 3, 8, 8), dtype=np.uint8)  # [rows, G, 3, H, W]
    rows = [SheetRow("a photo of a red circle", images[0], [0.25, 1.0, math.nan]),
            SheetRow("a photo of two blue squares", images[1], [0.5, 0.5, 0.75])]
    sheet = pixels(labelled_sheet(rows, "title"))
    row_h = TEXT_H + 8 * SCALE + TEXT_H + GAP
    for r in range(2):
        for j in range(3):
            expected = images[r, j].transpose(1, 2, 0).repeat(SCALE, 0).repeat(SCALE, 1)
            assert np.array_equal(tile(sheet, r, j, 8, 8, row_h), expected), (r, j)
            assert ink(label(sheet, r, j, 8, 8, row_h)) > 0, f"no score under ({r}, {j})"
    # equal scores draw equal labels, different scores different ones
    assert np.array_equal(label(sheet, 1, 0, 8, 8, row_h), label(sheet, 1, 1, 8, 8, row_h))
    assert not np.array_equal(label(sheet, 1, 1, 8, 8, row_h), label(sheet, 1, 2, 8, 8, row_h))
    assert not np.array_equal(label(sheet, 0, 0, 8, 8, row_h), label(sheet, 0, 2, 8, 8, row_h))
    # the prompt line of each row has text, and differs between the rows
    prompt = [sheet[GAP + TEXT_H + GAP + r * row_h:][:TEXT_H] for r in range(2)]
    assert ink(prompt[0]) > 0 and not np.array_equal(prompt[0], prompt[1])


def test_an_empty_sheet_is_refused():
    with pytest.raises(ValueError, match="at least one row"):
        labelled_sheet([], "title")


def test_the_report_writes_the_labelled_sheet_and_the_calibration_plot(tmp_path_factory,
                                                                        tmp_path):
    store, recipe, _, _ = reference(tmp_path_factory)
    copy = Store(shutil.copytree(store.root, tmp_path / "store"))
    result = iteration_report(copy, recipe, 0)
    paths = report_paths(copy, recipe.run.name, 0)
    assert result["pictures"] == {"rollouts": str(paths.rollout_sheet),
                                  "window-calibration": str(paths.calibration_plot)}
    window = copy.read_table("windows").to_pylist()[0]
    assert paths.calibration_plot.read_bytes() == copy.resolve(window["plot_path"]).read_bytes()
    sheet = pixels(paths.rollout_sheet.read_bytes())
    rollouts = sorted(copy.read_table("rollouts", {"iteration": 0}).to_pylist(),
                      key=lambda r: r["blob_index"])
    images = copy.get_tensors(rollouts[0]["image_path"])["images"].numpy()  # [N, 3, H, W]
    g, (_, h, w) = recipe.prompts.group_size, images.shape[1:]
    row_h = TEXT_H + h * SCALE + TEXT_H + GAP
    for i, r in enumerate(rollouts):  # rows in rollout order, G samples each
        expected = images[r["blob_index"]].transpose(1, 2, 0).repeat(SCALE, 0).repeat(SCALE, 1)
        assert np.array_equal(tile(sheet, i // g, i % g, h, w, row_h), expected), i
    assert sheet.shape[0] == GAP + TEXT_H + GAP + recipe.prompts.per_iteration * row_h


def test_no_artifact_outside_a_prefect_run():
    assert publish_images("run", 0, {"rollouts": b"png"}) is False
