"""Evaluation metrics over atom scores: GenEval-style strict prompt accuracy and atom statistics.

An atom passes when its score exceeds `pass_threshold` (0.5: the verifier's and Soft-TIFA's scores
are probabilities of the expected answer). An image is correct when every atom of its prompt passes
(GenEval's strict rule); a prompt's accuracy is the mean over its images. Per-tag figures average
over images, so every image counts once.

Groups of images (`image_groups`): "overall" (one group "all"), "tag", "atom_count" (the number of
atoms of the image's prompt, named by the number, in ascending order) and "atom_type" (the images
with at least one atom of the type; an image belongs to several).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

import numpy as np

GroupKind = Literal["overall", "tag", "atom_count", "atom_type"]


@dataclass(frozen=True)
class ImageResult:
    """One scored image: its prompt's tag and per-atom scores [A] with atom types [A]."""

    tag: str
    scores: np.ndarray
    atom_types: tuple[str, ...]


@dataclass(frozen=True)
class GroupSummary:
    """Figures of one group of images (a tag, or all): strict accuracy, mean atom score, counts."""

    name: str
    images: int
    strict_accuracy: float
    atom_accuracy: float
    mean_atom_score: float


def image_correct(scores: np.ndarray, pass_threshold: float = 0.5) -> bool:
    """GenEval's strict rule: every atom of the image passes."""
    return bool(np.all(scores > pass_threshold))


def summarise(name: str, results: list[ImageResult], pass_threshold: float = 0.5) -> GroupSummary:
    if not results:
        raise ValueError(f"no images to summarise for {name!r}")
    atoms = np.concatenate([r.scores for r in results])
    return GroupSummary(
        name=name, images=len(results),
        strict_accuracy=float(np.mean([image_correct(r.scores, pass_threshold) for r in results])),
        atom_accuracy=float(np.mean(atoms > pass_threshold)),
        mean_atom_score=float(atoms.mean()))


def summarise_by_tag(results: list[ImageResult], pass_threshold: float = 0.5) -> list[GroupSummary]:
    """One summary per tag (sorted by name), then "all"."""
    by_tag: dict[str, list[ImageResult]] = defaultdict(list)
    for r in results:
        by_tag[r.tag].append(r)
    rows = [summarise(tag, by_tag[tag], pass_threshold) for tag in sorted(by_tag)]
    return rows + [summarise("all", results, pass_threshold)]


def summarise_by_atom_type(results: list[ImageResult],
                           pass_threshold: float = 0.5) -> dict[str, tuple[float, float]]:
    """{atom type: (atom accuracy, mean score)} over every atom of every image."""
    scores: dict[str, list[float]] = defaultdict(list)
    for r in results:
        for t, s in zip(r.atom_types, r.scores):
            scores[t].append(float(s))
    return {t: (float(np.mean(np.array(v) > pass_threshold)), float(np.mean(v)))
            for t, v in sorted(scores.items())}


def image_groups(results: list[ImageResult], kind: GroupKind) -> dict[str, list[int]]:
    """{group name: indices of its images in `results`}, groups in display order (see the module
    docstring)."""
    names = {"overall": lambda r: ["all"], "tag": lambda r: [r.tag],
             "atom_count": lambda r: [str(len(r.scores))],
             "atom_type": lambda r: sorted(set(r.atom_types))}
    if kind not in names:
        raise ValueError(f"group kind must be one of {sorted(names)}; got {kind!r}")
    groups: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(results):
        for name in names[kind](r):
            groups[name].append(i)
    order = (lambda n: (int(n), n)) if kind == "atom_count" else (lambda n: (0, n))
    return {name: groups[name] for name in sorted(groups, key=order)}
