"""How much a shapes backbone listens to each kind of word: its loss under counterfactual prompts.

For scenes rendered from prompt records, with x0, the noise eps and the time t shared (a paired
comparison), the flow-matching loss

    L(p) = mean over scenes and pixels of ||v_hat(x_t, t; p) - (eps - x0)||^2,  x_t = (1 - t) x0 + t eps,

is taken for three prompts per scene: the true one, the true one with ONE word of a type swapped
(`swap_word`: the first shape word to the next kind, plural kept; the first colour to the next
palette colour; the first count word two -> three -> four -> two), and the empty prompt. Then

    swap gap  = L(swapped) / L(true) - 1    (what the model loses by reading a wrong word),
    text gain = L(empty) / L(true) - 1      (what the whole prompt is worth to it).

A model that ignores words of a type has a swap gap of exactly 0 for it, whatever its quality; a
model that draws what the word says has a clearly positive gap at the times where the word decides
the image (mid to high noise: at low noise x_t already shows the shape). The figures are relative,
so they can be compared across checkpoints and times.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cast_core.shapes.pretrain import Batch, FlowModel, flow_matching_loss
from cast_core.shapes.render import render, sample_scene
from cast_core.shapes.world import COLORS, SHAPES

WORD_TYPES: tuple[str, ...] = ("kind", "colour", "count")
_COUNTS = ("two", "three", "four")


def _cycle(words: tuple[str, ...]) -> dict[str, str]:
    return {w: words[(i + 1) % len(words)] for i, w in enumerate(words)}


_SWAPS: dict[str, dict[str, str]] = {
    "kind": {**_cycle(SHAPES), **{k + "s": v + "s" for k, v in _cycle(SHAPES).items()}},
    "colour": _cycle(COLORS),
    "count": _cycle(_COUNTS),
}


def swap_word(prompt: str, word_type: str) -> str | None:
    """The prompt with its first word of `word_type` swapped (see module doc); None if it has none.

    Words are whitespace-separated; "a"/"an" are never treated as counts (they are also articles).
    """
    if word_type not in _SWAPS:
        raise ValueError(f"word_type must be one of {WORD_TYPES}; got {word_type!r}")
    words = prompt.split()
    for i, word in enumerate(words):
        if word in _SWAPS[word_type]:
            return " ".join([*words[:i], _SWAPS[word_type][word], *words[i + 1:]])
    return None


@dataclass(frozen=True)
class SensitivityRow:
    """Paired losses of one word type at one t over `scenes` scenes (see module doc)."""

    word_type: str
    t: float
    scenes: int
    loss_true: float
    loss_swapped: float
    loss_empty: float

    @property
    def swap_gap(self) -> float:
        return self.loss_swapped / self.loss_true - 1.0

    @property
    def text_gain(self) -> float:
        return self.loss_empty / self.loss_true - 1.0


@torch.no_grad()
def word_sensitivity(backbone: FlowModel, records: list[dict],
                     ts: tuple[float, ...] = (0.9, 0.8, 0.7, 0.5, 0.3), scenes: int = 128,
                     seed: int = 0, word_types: tuple[str, ...] = WORD_TYPES,
                     ) -> list[SensitivityRow]:
    """One row per (word type, t): the losses of `scenes` scenes whose prompts have such a word.

    Scenes are drawn with replacement from the records that have a word of the type, one fresh
    render each; the same renders and noise serve every t of that type. Raises ValueError when no
    record has a word of a requested type.
    """
    rows = []
    for w, word_type in enumerate(word_types):
        pairs = [(r, s) for r in records if (s := swap_word(r["prompt"], word_type)) is not None]
        if not pairs:
            raise ValueError(f"no prompt has a {word_type} word to swap; give records that do")
        rng = np.random.default_rng([seed, w])
        picked = [pairs[int(i)] for i in rng.integers(len(pairs), size=scenes)]
        images = np.stack([render(sample_scene(r, rng)).image for r, _ in picked])
        x0 = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed * 7919 + w))
        prompts = {"true": [r["prompt"] for r, _ in picked], "swapped": [s for _, s in picked],
                   "empty": [""] * scenes}
        for t in ts:
            t_vec = torch.full((scenes,), float(t))
            loss = {k: float(flow_matching_loss(backbone, Batch(x0=x0, prompts=p), t_vec, eps))
                    for k, p in prompts.items()}
            rows.append(SensitivityRow(word_type, float(t), scenes, loss["true"], loss["swapped"],
                                       loss["empty"]))
    return rows
