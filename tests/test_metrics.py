"""Strict (GenEval) accuracy and atom summaries; evaluation seeds come from the prompt text."""

import numpy as np

from cast_core.metrics import ImageResult, image_correct, summarise_by_atom_type, summarise_by_tag
from tasks.stages.evaluate import content_seed


def test_strict_rule_needs_every_atom():
    assert image_correct(np.array([0.9, 0.6]))
    assert not image_correct(np.array([0.9, 0.4]))
    assert not image_correct(np.array([0.5]))  # the threshold is strict


def test_summaries_by_tag_and_type():
    results = [
        ImageResult("a", np.array([0.9, 0.8]), ("object", "count")),
        ImageResult("a", np.array([0.9, 0.1]), ("object", "count")),
        ImageResult("b", np.array([0.2]), ("object",)),
    ]
    rows = {r.name: r for r in summarise_by_tag(results)}
    assert rows["a"].strict_accuracy == 0.5 and rows["a"].images == 2
    assert rows["b"].strict_accuracy == 0.0
    assert np.isclose(rows["all"].strict_accuracy, 1 / 3)
    assert np.isclose(rows["all"].atom_accuracy, 3 / 5)
    assert np.isclose(rows["all"].mean_atom_score, (0.9 + 0.8 + 0.9 + 0.1 + 0.2) / 5)
    types = summarise_by_atom_type(results)
    assert np.isclose(types["object"][0], 2 / 3) and np.isclose(types["count"][1], 0.45)


def test_content_seeds_are_stable_and_distinct():
    assert content_seed("a photo of a circle", 0) == content_seed("a photo of a circle", 0)
    seeds = {content_seed(p, k) for p in ("a", "b") for k in range(4)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
