"""The shapes world's image embedder for window calibration: soft per-colour occupancy maps.

Variant: a fixed, parameter-free layout embedding. For each pixel, the probabilities of the six
classes (the five palette colours in COLORS order, then the background) are
softmax_c(-||rgb - rgb_c||^2 / temp), the same soft colour assignment as the verifier's
(``color_temp``); the six probability maps are average-pooled to a grid×grid grid of cells and
flattened class-major into e [N, 6 * grid * grid], optionally L2-normalised.

Why it suits calibration: structure formation is the moment objects and layout stop changing, and
this embedding sees exactly that: which colour occupies which region of the canvas, i.e. the
objects' colours and positions that the verifier's atoms read. It is exact on renders (every
render pixel has a palette or background colour, so its class probabilities are near one-hot),
deterministic, and cheap. The background channel keeps every embedding non-zero (each cell's six values sum to 1),
so the cosine is always defined, and it makes an object missing from a region count as a change.
The price of that channel is range: two images that share a large background already have a high
cosine, so curves start well above 0 (the window's knee rule works on the raw curve and does not
need a zero start).

Departures: the real pipeline uses CLIP ViT-L/14 image features (semantic, not pixel-exact); this
embedder stands in for it only in the embedded world. Cells are adaptive average pools, so H and W
need not be multiples of ``grid``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from cast_core.shapes.world import BACKGROUND_RGB, COLORS, PALETTE_RGB

CLASSES: tuple[str, ...] = (*COLORS, "background")


def _class_rgb(device: torch.device) -> Tensor:
    """RGB of the six classes in [0, 1]: [6, 3] float32."""
    rgb = [PALETTE_RGB[c] for c in COLORS] + [BACKGROUND_RGB]
    return torch.tensor(rgb, dtype=torch.float32, device=device) / 255.0


@dataclass(frozen=True)
class LayoutEmbedder:
    """Soft colour-occupancy embedding of images (see the module docstring).

    grid: cells per side of the pooled maps; temp: softmax temperature on squared RGB distance;
    normalize: L2-normalise the embedding. D = len(CLASSES) * grid * grid.
    """

    name: ClassVar[str] = "shapes-layout-v1"
    grid: int = 8
    temp: float = 0.02
    normalize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.grid, bool) or not isinstance(self.grid, int) or self.grid < 1:
            raise ValueError(f"grid must be an int >= 1 (cells per side); got {self.grid!r}")
        if not self.temp > 0:
            raise ValueError(f"temp must be > 0 (a softmax temperature); got {self.temp!r}")

    @property
    def dim(self) -> int:
        """D, the embedding width."""
        return len(CLASSES) * self.grid * self.grid

    @property
    def spec(self) -> str:
        """Name plus settings: what a cache key needs to tell two embedders apart."""
        return f"{self.name}(grid={self.grid},temp={self.temp},normalize={self.normalize})"

    def occupancy(self, images: Tensor) -> Tensor:
        """Per-pixel class probabilities. images [N, 3, H, W] in [0, 1] -> [N, 6, H, W] float32."""
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(
                f"images must have shape [N, 3, H, W] (RGB in [0, 1]); got {tuple(images.shape)}"
            )
        rgb = images.float()
        class_rgb = _class_rgb(rgb.device)[None, :, :, None, None]  # [1, 6, 3, 1, 1]
        d2 = ((rgb[:, None] - class_rgb) ** 2).sum(dim=2)  # [N, 6, H, W]
        return torch.softmax(-d2 / self.temp, dim=1)

    def embed(self, images: Tensor) -> Tensor:
        """Embeddings e [N, D] float32 of images [N, 3, H, W] in [0, 1]."""
        cells = F.adaptive_avg_pool2d(self.occupancy(images), self.grid)  # [N, 6, g, g]
        e = cells.flatten(1)  # [N, D]
        return F.normalize(e, dim=1) if self.normalize else e
