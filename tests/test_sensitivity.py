"""The word-sensitivity probe: counterfactual prompts, and gaps that are exactly 0 for a deaf model."""

from __future__ import annotations

import pytest
import torch

from cast_core.backbones.shapes import ShapesBackbone, ShapesBackboneConfig
from cast_core.shapes.sensitivity import swap_word, word_sensitivity
from flows.base_eval import format_sensitivity

TINY = ShapesBackboneConfig(num_layers=1, num_heads=2, head_dim=8, text_width=16, text_layers=1)
RECORDS = [
    {"tag": "counting", "include": [{"class": "square", "count": 3}], "exclude": [],
     "prompt": "a photo of three squares"},
    {"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "purple"}],
     "exclude": [], "prompt": "a photo of a purple circle"},
]


@pytest.mark.parametrize(("prompt", "word_type", "expected"), [
    ("a photo of a circle", "kind", "a photo of a square"),
    ("a photo of two triangles", "kind", "a photo of two circles"),
    ("a photo of a square and a circle", "kind", "a photo of a triangle and a circle"),
    ("a photo of a red circle", "colour", "a photo of a green circle"),
    ("a photo of a purple square", "colour", "a photo of a red square"),
    ("a photo of four circles", "count", "a photo of two circles"),
    ("a photo of a circle", "count", None),
    ("a photo of a circle", "colour", None),
])
def test_swap_word_changes_the_first_word_of_its_type(prompt, word_type, expected):
    assert swap_word(prompt, word_type) == expected


def test_swap_word_rejects_an_unknown_type():
    with pytest.raises(ValueError, match="word_type must be one of"):
        swap_word("a photo of a circle", "size")


def test_a_model_that_ignores_text_has_no_gap():
    """With the text path zeroed every prompt gives the same velocity: gaps are exactly 0."""
    torch.manual_seed(0)
    model = ShapesBackbone(TINY).eval()
    with torch.no_grad():
        for p in (*model.transformer.context_embedder.parameters(),
                  *model.transformer.time_text_embed.text_embedder.parameters()):
            p.zero_()
    rows = word_sensitivity(model, RECORDS, ts=(0.8, 0.3), scenes=6)
    assert [(r.word_type, r.t) for r in rows] == [
        ("kind", 0.8), ("kind", 0.3), ("colour", 0.8), ("colour", 0.3), ("count", 0.8),
        ("count", 0.3)]
    for r in rows:
        assert r.loss_true > 0
        assert r.swap_gap == 0.0 and r.text_gain == 0.0


def test_a_model_that_reads_text_has_a_gap():
    torch.manual_seed(0)
    model = ShapesBackbone(TINY).eval()
    rows = word_sensitivity(model, RECORDS, ts=(0.5,), scenes=4, word_types=("colour",))
    (row,) = rows
    assert row.swap_gap != 0.0 and row.text_gain != 0.0
    assert "| colour | 0.50 | 4 |" in format_sensitivity(rows)


def test_no_word_of_a_type_is_a_clear_error():
    model = ShapesBackbone(TINY).eval()
    with pytest.raises(ValueError, match="no prompt has a count word"):
        word_sensitivity(model, RECORDS[1:], ts=(0.5,), scenes=2, word_types=("count",))


def test_base_eval_prints_the_sensitivity_table_for_chosen_tags(tmp_path, capsys):
    from flows.base_eval import main

    torch.manual_seed(0)
    ShapesBackbone(TINY).save_pretrained(tmp_path / "tiny")
    main(["--checkpoint", str(tmp_path / "tiny"), "--splits", "eval", "--tags", "single_object",
          "--sensitivity", "--scenes", "4", "--threads", "1"])
    out = capsys.readouterr().out
    assert "| kind | 0.90 | 4 |" in out
    assert "| colour |" not in out and "| count |" not in out  # single-object prompts have neither


def test_base_eval_names_the_tags_when_none_match(tmp_path):
    from flows.base_eval import main

    ShapesBackbone(TINY).save_pretrained(tmp_path / "tiny")
    with pytest.raises(SystemExit, match="this split's tags are"):
        main(["--checkpoint", str(tmp_path / "tiny"), "--splits", "hard", "--tags", "single_object",
              "--sensitivity"])
