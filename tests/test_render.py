"""Renderer: determinism, exact masks and colours, counts, and unambiguous relations."""

import numpy as np
import pytest

from cast_core.shapes.prompts import TAGS, enumerate_prompts
from cast_core.shapes.render import render, sample_scene, shape_mask
from cast_core.shapes.world import BACKGROUND_RGB, PALETTE_RGB

RELATION_RECORD = {
    "prompt": "a photo of four red circles left of four blue squares",
    "include": [{"class": "square", "count": 4, "color": "blue"},
                {"class": "circle", "count": 4, "color": "red", "position": ["left of", 0]}],
}


def _records(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    pools = [enumerate_prompts(t) for t in TAGS]
    return [pools[i % len(pools)][int(rng.integers(len(pools[i % len(pools)])))] for i in range(n)]


def test_same_seed_same_scene_and_pixels():
    for record in _records(20, 0):
        a = sample_scene(record, np.random.default_rng(7))
        b = sample_scene(record, np.random.default_rng(7))
        assert a == b
        assert np.array_equal(render(a).image, render(b).image)
    c = sample_scene(RELATION_RECORD, np.random.default_rng(8))
    assert c != sample_scene(RELATION_RECORD, np.random.default_rng(7))


def test_masks_are_exact_disjoint_and_coloured():
    for record in _records(200, 1):
        scene = sample_scene(record, np.random.default_rng(3))
        out = render(scene)
        assert out.masks.shape == (len(scene), 32, 32)
        assert out.masks.sum(0).max() <= 1, "instances overlap"
        for shape, mask in zip(scene, out.masks):
            assert mask.sum() >= 4
            assert (out.image[mask] == PALETTE_RGB[shape.color]).all()
        background = ~out.masks.any(0)
        assert (out.image[background] == BACKGROUND_RGB).all()


def test_counts_and_colours_follow_the_record():
    for record in _records(300, 2):
        scene = sample_scene(record, np.random.default_rng(4))
        for g, clause in enumerate(record["include"]):
            group = [s for s in scene if s.group == g]
            assert len(group) == clause["count"]
            assert all(s.kind == clause["class"] for s in group)
            if "color" in clause:
                assert all(s.color == clause["color"] for s in group)


@pytest.mark.parametrize("relation", ["left of", "right of", "above", "below"])
def test_relations_separate_groups_with_a_gap(relation):
    record = {**RELATION_RECORD, "include": [RELATION_RECORD["include"][0],
                                             {**RELATION_RECORD["include"][1],
                                              "position": [relation, 0]}]}
    axis = 0 if relation in ("left of", "right of") else 1
    for seed in range(50):
        scene = sample_scene(record, np.random.default_rng(seed))
        subject = [s for s in scene if s.group == 1]
        reference = [s for s in scene if s.group == 0]
        lo = lambda s: (s.x0, s.y0)[axis]
        hi = lambda s: (s.x0, s.y0)[axis] + s.extent
        if relation in ("left of", "above"):
            assert max(map(hi, subject)) + 2 <= min(map(lo, reference))
        else:
            assert max(map(hi, reference)) + 2 <= min(map(lo, subject))


def test_shape_masks_have_their_closed_form_areas():
    extent = 12
    assert shape_mask("square", 4, 4, extent).sum() == extent * extent
    circle = shape_mask("circle", 4, 4, extent).sum()
    assert abs(circle - np.pi * (extent / 2) ** 2) < 0.1 * extent ** 2
    triangle = shape_mask("triangle", 4, 4, extent).sum()
    assert abs(triangle - extent ** 2 / 2) < 0.1 * extent ** 2
    with pytest.raises(ValueError, match="unknown shape kind"):
        shape_mask("hexagon", 0, 0, 5)
