"""The labelled rollout contact sheet of an iteration (issue 19, item 14): one row per prompt, the
prompt's text above its G samples and each sample's mean atom score under it.

The rollout stage stores an unlabelled sheet before any score exists; this one is drawn by the
report, from the stored images and the `atom_scores` of the iteration, and saved next to the
run's evaluation report (`<store>/reports/<run>/`).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFont

SCALE = 2          # pixels per image pixel (32 px shapes images -> 64 px)
GAP = 4            # pixels between images and around the sheet
TEXT_H = 14        # height of a text line
BACKGROUND = (255, 255, 255)
INK = (20, 20, 20)
MIN_WIDTH = 420    # room for a prompt line when G is small


@dataclass(frozen=True)
class SheetRow:
    """One prompt: its text, its G images uint8 [G, 3, H, W] and their mean atom scores [G]
    (NaN where a sample has no score)."""

    prompt: str
    images: np.ndarray
    scores: Sequence[float]


def _fit(draw: ImageDraw.ImageDraw, text: str, font, width: int) -> str:
    """`text`, cut with an ellipsis to fit in `width` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "...", font=font) > width:
        text = text[:-1]
    return text + "..."


def labelled_sheet(rows: Sequence[SheetRow], title: str) -> bytes:
    """PNG bytes of the sheet: `title` on top, then per row the prompt and its scored images."""
    if not rows:
        raise ValueError("a contact sheet needs at least one row")
    g = max(len(r.images) for r in rows)
    _, _, h, w = rows[0].images.shape
    cell_w, cell_h = w * SCALE, h * SCALE
    width = max(MIN_WIDTH, GAP + g * (cell_w + GAP))
    row_h = TEXT_H + cell_h + TEXT_H + GAP
    sheet = Image.new("RGB", (width, GAP + TEXT_H + GAP + len(rows) * row_h), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default(size=11)
    draw.text((GAP, GAP), _fit(draw, title, font, width - 2 * GAP), fill=INK, font=font)
    top = GAP + TEXT_H + GAP
    for row in rows:
        draw.text((GAP, top), _fit(draw, row.prompt, font, width - 2 * GAP), fill=INK, font=font)
        for j, (image, score) in enumerate(zip(row.images, row.scores)):
            left = GAP + j * (cell_w + GAP)
            tile = Image.fromarray(np.ascontiguousarray(image.transpose(1, 2, 0)))  # [H, W, 3]
            sheet.paste(tile.resize((cell_w, cell_h), Image.NEAREST), (left, top + TEXT_H))
            label = "-" if np.isnan(score) else f"{score:.2f}"
            offset = (cell_w - draw.textlength(label, font=font)) / 2
            draw.text((left + offset, top + TEXT_H + cell_h + 1), label, fill=INK, font=font)
        top += row_h
    buffer = io.BytesIO()
    sheet.save(buffer, format="png")
    return buffer.getvalue()
