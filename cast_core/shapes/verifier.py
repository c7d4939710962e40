"""The shapes world's exact verifier: soft atom scores and grounding heatmaps from pixels.

Detection. A pixel is foreground when its RGB distance to the background colour exceeds
`fg_threshold`; instances are the 4-connected foreground components of at least `min_area` pixels
(renders keep a 2-px gap between shapes, so on renders component = instance). For each instance:
- colour probabilities: the mean over its pixels of softmax(-||rgb - palette_k||^2 / color_temp);
- kind probabilities over (circle, square, triangle, other) from four mask features, each compared
  with a per-kind prototype in units of its spread (a diagonal-Gaussian score): bounding-box fill
  ratio, top-corner and bottom-corner occupancy, and top-half / bottom-half mass. "other" has a flat
  score, so blobs unlike every prototype are no shape at all;
- two one-sided gates from the renderer's own limits: the bounding box's aspect (short side / long
  side; renders are >= 0.75, the 4-px triangle's 3 x 4 box) and its short side (renders are >= 4
  px for circles and squares, >= 3 px for triangles). Below a limit, the deficit in units of its
  spread joins every kind's score; at or above it, nothing changes (renders score exactly as
  without the gates).
  Without them a bar of 1 x 8 pixels, or a 2 x 2 speck, has the fill and corners of a perfect
  square: RL policies found that (rows of horizontal stripes and specks read as squares) and
  raised their scores by drawing them;
- its bounding-box centre.
Prototypes were read off exact renders of every extent the renderer draws (4-12 px).

Atoms (one node = noun with optional colour c; w_i = P(kind_i = noun) * P(colour_i = c)):
- object: 1 - prod_i (1 - P(kind_i = noun))                (colour is its own atom)
- count n: P(sum_i Bernoulli(w_i) = n), the Poisson-binomial probability (exactly n)
- attribute c: P(object) * sum_i P(kind_i) P(colour_i = c) / sum_i P(kind_i)
- relation S rel O: P(S) P(O) * mean over instance pairs, weighted w_i w_j, of
  sigmoid(signed centre offset along the relation's axis / rel_temp)
Heatmaps (the evidence region, max-normalised to 1): the masks of the matching instances weighted
by their match probability (kind for object and attribute atoms, w for count atoms, both nodes' for
relations); when nothing matches (a missing object) the closest candidates, i.e. weights divided by
their maximum; uniform when the image has no instance at all.

Exactness on renders (every true atom >= 0.99, every false atom <= 0.05) is tested over thousands
of random scenes; on generated images the features and colours drift and scores fall smoothly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from cast_core.csg.graph import Atom, SceneGraph
from cast_core.shapes.world import BACKGROUND_RGB, COLORS, PALETTE_RGB, SHAPES

KINDS = (*SHAPES, "other")
# prototype features (fill, top corners, bottom corners, top/bottom mass) and their spreads
_PROTOTYPES = np.array([
    [0.82, 0.10, 0.10, 1.00],   # circle
    [1.00, 1.00, 1.00, 1.00],   # square
    [0.56, 0.00, 0.85, 0.35],   # triangle
])
_SPREAD = np.array([0.07, 0.20, 0.20, 0.15])
_OTHER_SCORE = -8.0  # a blob 4 spreads from every prototype is equally likely "other"
# one-sided gates: (lower limit on renders, spread); the short side's limit is per kind (circles
# and squares are >= 4 px, the 4-px triangle's box is 3 x 4). A 3 x 3 speck is 6.7 spreads below
# a square's short-side limit (a 2-px one 6.7 below a triangle's, a 1-px bar 13 or more), a 2:1
# block like 6 x 12 6.25 spreads below the aspect limit: each alone puts a kind's score 11 nats or
# more under "other"'s flat one (-0.5 x 6.25^2 = -19.5 against -8), so even dozens of specks add
# up to no shape (the object atom's noisy-or)
_MIN_ASPECT, _ASPECT_SPREAD = 0.75, 0.04
_MIN_SIDE, _SIDE_SPREAD = np.array([4.0, 4.0, 3.0]), 0.15  # circle, square, triangle


@dataclass(frozen=True)
class Instances:
    """Instances of one image (n of them): masks bool [n, H, W], kind probs [n, 4] (KINDS order),
    colour probs [n, 5] (COLORS order), centres [n, 2] (x, y in pixels)."""

    masks: np.ndarray
    kind_probs: np.ndarray
    color_probs: np.ndarray
    centers: np.ndarray


@dataclass(frozen=True)
class AtomScores:
    """Scores of one image's A atoms: scores [A] in [0, 1], heatmaps [A, H, W] in [0, 1]."""

    scores: np.ndarray
    heatmaps: np.ndarray


@dataclass(frozen=True)
class VerifierConfig:
    fg_threshold: float = 0.25
    min_area: int = 4
    color_temp: float = 0.02
    rel_temp: float = 1.0


# the scorer's name in cache keys and `atom_scores` rows; bumped whenever the same image and
# config score differently (v2: the aspect and short-side gates)
VERSION = "shapes-verifier-v2"


def scorer_id(config: VerifierConfig = VerifierConfig()) -> str:
    """The verifier's identity for a cache key: VERSION with its config."""
    return f"{VERSION}({config})"


def _components(fg: torch.Tensor) -> torch.Tensor:
    """4-connected component labels by max-label propagation. fg bool [N, H, W] -> int [N, H, W]."""
    n, h, w = fg.shape
    labels = torch.arange(1, n * h * w + 1, dtype=torch.int64).view(n, h, w) * fg
    while True:
        padded = F.pad(labels, (1, 1, 1, 1))
        neighbours = torch.stack([padded[:, 1:-1, :-2], padded[:, 1:-1, 2:],
                                  padded[:, :-2, 1:-1], padded[:, 2:, 1:-1]]).amax(0)
        updated = torch.maximum(labels, neighbours) * fg
        if torch.equal(updated, labels):
            return labels
        labels = updated


def _shape_features(mask: np.ndarray) -> tuple[np.ndarray, tuple[float, float]]:
    """Features (fill, top corners, bottom corners, top/bottom mass, aspect = short / long side,
    short side in px) and bbox centre of a mask."""
    ys, xs = np.nonzero(mask)
    y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    box = mask[y0:y1, x0:x1].astype(np.float64)
    h, w = box.shape
    c = max(1, min(h, w) // 4)
    top = (box[:c, :c].mean() + box[:c, -c:].mean()) / 2
    bottom = (box[-c:, :c].mean() + box[-c:, -c:].mean()) / 2
    half = h // 2
    ratio = box[:half].sum() / max(box[h - half:].sum(), 1.0) if half else 1.0
    return (np.array([box.mean(), top, bottom, ratio, min(h, w) / max(h, w), min(h, w)]),
            ((x0 + x1) / 2.0, (y0 + y1) / 2.0))


def _kind_probs(features: np.ndarray) -> np.ndarray:
    """[n, 6] features -> [n, 4] probabilities over KINDS."""
    z = (features[:, None, :4] - _PROTOTYPES[None]) / _SPREAD  # [n, 3, 4]
    gate = ((np.maximum(0.0, _MIN_ASPECT - features[:, 4]) / _ASPECT_SPREAD) ** 2)[:, None] + (
        np.maximum(0.0, _MIN_SIDE[None] - features[:, 5:6]) / _SIDE_SPREAD) ** 2  # [n, 3]
    logits = np.concatenate([-0.5 * ((z ** 2).sum(-1) + gate),
                             np.full((len(features), 1), _OTHER_SCORE)], axis=1)
    logits -= logits.max(1, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(1, keepdims=True)


def detect(images: torch.Tensor, config: VerifierConfig = VerifierConfig()) -> list[Instances]:
    """Instances of N images in [0, 1], [N, 3, H, W]."""
    rgb = images.float().permute(0, 2, 3, 1)  # [N, H, W, 3]
    background = torch.tensor(BACKGROUND_RGB, dtype=torch.float32) / 255.0
    fg = (rgb - background).norm(dim=-1) > config.fg_threshold
    labels = _components(fg)
    palette = torch.tensor([PALETTE_RGB[c] for c in COLORS], dtype=torch.float32) / 255.0
    d2 = ((rgb[..., None, :] - palette) ** 2).sum(-1)  # [N, H, W, 5]
    pixel_colors = torch.softmax(-d2 / config.color_temp, dim=-1).numpy()
    labels_np = labels.numpy()
    out = []
    for i in range(len(images)):
        ids, counts = np.unique(labels_np[i], return_counts=True)
        ids = ids[(ids != 0) & (counts >= config.min_area)]
        masks = labels_np[i][None] == ids[:, None, None]  # [n, H, W]
        feats, centers = zip(*(_shape_features(m) for m in masks)) if len(ids) else ((), ())
        colors = [pixel_colors[i][m].mean(0) for m in masks]
        out.append(Instances(
            masks=masks,
            kind_probs=_kind_probs(np.array(feats).reshape(-1, 6)),
            color_probs=np.array(colors, dtype=np.float64).reshape(-1, len(COLORS)),
            centers=np.array(centers, dtype=np.float64).reshape(-1, 2)))
    return out


def _poisson_binomial(p: np.ndarray, n: int) -> float:
    """P(sum of independent Bernoulli(p_i) = n)."""
    dist = np.zeros(len(p) + 2)
    dist[0] = 1.0
    for q in p:
        dist[1:] = dist[1:] * (1 - q) + dist[:-1] * q
        dist[0] *= 1 - q
    return float(dist[n]) if n < len(dist) else 0.0


def _node_weights(inst: Instances, noun: str, color: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(kind probs [n], kind-and-colour probs [n]) of each instance for a node."""
    k = inst.kind_probs[:, KINDS.index(noun)] if noun in KINDS else np.zeros(len(inst.masks))
    c = inst.color_probs[:, COLORS.index(color)] if color in COLORS else (
        np.ones(len(k)) if color is None else np.zeros(len(k)))
    return k, k * c


def _evidence(inst: Instances, weights: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Max-normalised weighted union of instance masks; closest candidates or uniform fallback."""
    if len(weights) == 0 or weights.max() <= 0:
        return np.ones(shape, dtype=np.float32)
    heat = (weights[:, None, None] / weights.max() * inst.masks).max(0)
    return heat.astype(np.float32)


def _relation_prob(inst: Instances, ws: np.ndarray, wo: np.ndarray, relation: str,
                   temp: float) -> float:
    axis, sign = {"left of": (0, 1), "right of": (0, -1), "above": (1, 1), "below": (1, -1)}[relation]
    offset = sign * (inst.centers[None, :, axis] - inst.centers[:, None, axis])  # [n_s, n_o]
    pair_w = ws[:, None] * wo[None, :]
    if pair_w.sum() <= 0:
        return 0.0
    return float((pair_w / pair_w.sum() * (1 / (1 + np.exp(-offset / temp)))).sum())


def score_atom(inst: Instances, graph: SceneGraph, atom: Atom, shape: tuple[int, int],
               config: VerifierConfig = VerifierConfig()) -> tuple[float, np.ndarray]:
    """(score in [0, 1], heatmap [H, W]) of one atom on one image's instances."""
    node = graph.node(atom.subject)
    k, w = _node_weights(inst, node.noun, node.color)
    exists = 1.0 - float(np.prod(1.0 - k))
    if atom.type == "object":
        return exists, _evidence(inst, k, shape)
    if atom.type == "count":
        return _poisson_binomial(w, int(atom.value)), _evidence(inst, w, shape)
    if atom.type == "attribute":
        _, kc = _node_weights(inst, node.noun, atom.value)
        share = float(kc.sum() / k.sum()) if k.sum() > 0 else 0.0
        return exists * share, _evidence(inst, k, shape)
    if atom.type == "relation":
        other = graph.node(atom.object)
        _, wo = _node_weights(inst, other.noun, other.color)
        p_s, p_o = 1.0 - float(np.prod(1.0 - w)), 1.0 - float(np.prod(1.0 - wo))
        rel = _relation_prob(inst, w, wo, atom.value, config.rel_temp)
        heat = np.maximum(_evidence(inst, w, shape), _evidence(inst, wo, shape))
        return p_s * p_o * rel, heat
    raise ValueError(f"unknown atom type {atom.type!r} in {graph.prompt!r}")


def verify(images: torch.Tensor, graphs: list[SceneGraph],
           config: VerifierConfig = VerifierConfig()) -> list[AtomScores]:
    """Score every atom of graphs[i] on images[i]. images [N, 3, H, W] in [0, 1]."""
    if len(images) != len(graphs):
        raise ValueError(f"one graph per image: got {len(images)} images, {len(graphs)} graphs")
    shape = tuple(images.shape[-2:])
    results = []
    for inst, graph in zip(detect(images, config), graphs):
        pairs = [score_atom(inst, graph, a, shape, config) for a in graph.atoms()]
        results.append(AtomScores(scores=np.array([p[0] for p in pairs], dtype=np.float32),
                                  heatmaps=np.stack([p[1] for p in pairs]).astype(np.float32)))
    return results
