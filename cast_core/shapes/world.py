"""The shapes world's vocabulary: shape kinds, the colour palette, canvas size and relations.

One place for the constants that the renderer, the prompt grammar, the verifier and the tiny
backbone share. Colours are saturated and far apart in RGB so that a nearest-palette rule is exact
on renders; the background is dark so that foreground is found by brightness distance.
"""

from __future__ import annotations

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
COLORS: tuple[str, ...] = ("red", "green", "blue", "yellow", "purple")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
COUNT_WORDS: dict[int, str] = {1: "a", 2: "two", 3: "three", 4: "four"}
MAX_COUNT = 4

IMAGE_SIZE = 32
BACKGROUND_RGB: tuple[int, int, int] = (30, 30, 30)
PALETTE_RGB: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 200, 70),
    "blue": (50, 100, 255),
    "yellow": (245, 215, 40),
    "purple": (170, 60, 220),
}
