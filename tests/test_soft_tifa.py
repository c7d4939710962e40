"""Soft-TIFA scorer on a tiny random Qwen3-VL (built from config, saved, loaded back).

Checks: image-token bookkeeping against smart-resize grids, left padding against single-atom
forwards, scores against an independent forward with the processor's token layout written out by
hand, planted attention landing in the right pixel block, config messages, and no torchvision.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import QWEN3_VL_TEMPLATE, save_qwen3_vl

from cast_core.csg.graph import Atom, ObjectNode, SceneGraph
from cast_core.scorers.soft_tifa import NUMBER_WORDS, SoftTifaConfig, SoftTifaScorer, relative_map
from cast_core.scorers.soft_tifa_inputs import (
    encode_prompts,
    preprocess_image,
    processor_chat_template,
    render_prompt,
)

TEMPLATE = QWEN3_VL_TEMPLATE
PIXELS = {"min_pixels": 32 * 32, "max_pixels": 256 * 256}
YES_FORMS = ("Yes", "yes", "YES", " Yes", " yes", " YES")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_qwen3_vl")
    return save_qwen3_vl(path)


@pytest.fixture(scope="module")
def scorer(model_dir) -> SoftTifaScorer:
    return SoftTifaScorer.from_pretrained(str(model_dir), SoftTifaConfig(**PIXELS))


def _graph() -> SceneGraph:
    atoms = (Atom("obj0", "object", "Is there a dog?", "yes", (), "obj0"),
             Atom("obj0/count", "count", "How many red dogs are there?", "3", ("obj0",), "obj0"),
             Atom("obj0/color", "attribute", "Are the dogs red?", "yes", ("obj0",), "obj0"))
    node = ObjectNode("obj0", "dog", 3, (("color", "red"),), atoms)
    return SceneGraph("three red dogs", (node,), ())


def _image(h: int, w: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(3, h, w, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("hw, grid", [((64, 96), (4, 6)), ((100, 50), (6, 4))])
def test_image_token_bookkeeping(scorer, hw, grid):
    # smart resize to multiples of 32: 64x96 stays, 100x50 -> 96x64; grids in 16-px patches
    inputs = preprocess_image(scorer.image_processor, _image(*hw), **PIXELS)
    assert inputs.grid_thw.tolist() == [1, *grid]
    assert inputs.pixel_values.shape == (grid[0] * grid[1], 3 * 2 * 16 * 16)
    assert inputs.token_grid == (grid[0] // 2, grid[1] // 2)
    batch = encode_prompts(scorer.tokenizer, scorer.prompts(_graph().atoms()), inputs.n_tokens,
                           scorer.model.config.image_token_id)
    n = grid[0] * grid[1] // 4
    assert batch.image_mask.sum(1).tolist() == [n] * 3
    for row, mask in zip(batch.input_ids, batch.image_mask):
        pos = mask.nonzero()[:, 0]
        assert (pos == torch.arange(pos[0], pos[0] + n)).all()  # one contiguous block
        assert row[pos[0] - 1] == scorer.model.config.vision_start_token_id
        assert row[pos[-1] + 1] == scorer.model.config.vision_end_token_id
    result = scorer.score(_image(*hw)[None], [_graph()])[0]
    assert result.heatmaps.shape == (3, *hw)


def test_left_padding_matches_single_atoms(scorer):
    atoms, image = _graph().atoms(), _image(64, 96, seed=1)
    batch = encode_prompts(scorer.tokenizer, scorer.prompts(atoms), 6,
                           scorer.model.config.image_token_id)
    lengths = batch.attention_mask.sum(1)
    assert len(set(lengths.tolist())) > 1  # the questions really differ in length
    assert (batch.attention_mask[:, -1] == 1).all() and (batch.attention_mask[:, 0] == 0).any()
    together = scorer.score_image(image, atoms)
    alone = [scorer.score_image(image, (a,)) for a in atoms]
    np.testing.assert_allclose(together.scores, [a.scores[0] for a in alone], rtol=1e-4,
                               atol=1e-7)
    np.testing.assert_allclose(together.heatmaps, np.stack([a.heatmaps[0] for a in alone]),
                               rtol=1e-4, atol=1e-8)


def _reference_probs(model_dir, scorer, question: str, image: torch.Tensor) -> torch.Tensor:
    """Next-token probabilities [V] from an unpadded forward with the prompt written by hand."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    array = (image.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
    pixels = processor(images=[array], size={"shortest_edge": PIXELS["min_pixels"],
                                             "longest_edge": PIXELS["max_pixels"]},
                       return_tensors="pt")
    n = int(pixels["image_grid_thw"].prod()) // 4
    text = (f"<|im_start|>user\n<|vision_start|>{'<|image_pad|>' * n}<|vision_end|>{question}"
            f"<|im_end|>\n<|im_start|>assistant\n")
    input_ids = torch.tensor([scorer.tokenizer(text)["input_ids"]])
    mm = (input_ids == scorer.model.config.image_token_id).long()
    with torch.no_grad():
        logits = scorer.model(input_ids=input_ids, mm_token_type_ids=mm, **pixels).logits
    return logits[0, -1].softmax(-1)


def _single_token_ids(tokenizer, forms):
    return sorted({ids[0] for f in forms if len(ids := tokenizer.encode(f)) == 1})


def test_scores_equal_reference_probability_mass(model_dir, scorer):
    image, atoms = _image(64, 96, seed=2), _graph().atoms()
    tok = scorer.tokenizer
    yes = _single_token_ids(tok, YES_FORMS)
    no = _single_token_ids(tok, [f.replace("Yes", "No").replace("yes", "no").replace("YES", "NO")
                                 for f in YES_FORMS])
    three = _single_token_ids(tok, ["3", "three", "Three", " 3", " three", " Three"])
    assert len(yes) >= 4 and len(three) >= 4  # the tiny tokenizer has most forms as one token
    questions = [f"{atoms[0].question} Please answer yes or no.",
                 f"{atoms[1].question} Please answer with a number."]
    p_obj, p_count = (_reference_probs(model_dir, scorer, q, image) for q in questions)
    expected = [p_obj[yes].sum(), p_count[three].sum()]
    scores = scorer.score_image(image, atoms[:2]).scores
    assert ((scores >= 0) & (scores <= 1)).all()
    np.testing.assert_allclose(scores, expected, rtol=1e-4)
    normalized = SoftTifaScorer(scorer.model, tok, scorer.image_processor,
                                SoftTifaConfig(normalize=True, **PIXELS))
    counts = sorted({i for n, w in enumerate(NUMBER_WORDS) for i in _single_token_ids(
        tok, [str(n), w, w.capitalize(), f" {n}", f" {w}", f" {w.capitalize()}"])})
    np.testing.assert_allclose(normalized.score_image(image, atoms[:2]).scores,
                               [p_obj[yes].sum() / (p_obj[yes].sum() + p_obj[no].sum()),
                                p_count[three].sum() / p_count[counts].sum()], rtol=1e-4)


def _plant(scorer, token: int, generic_prompt: str):
    """Hooks that replace every layer's attention weights: the last position of an atom row
    attends only to image token `token`; the generic prompt's row spreads it evenly."""
    seen = {}
    image_id = scorer.model.config.image_token_id

    def keep_ids(module, args, kwargs):
        seen["ids"] = kwargs["input_ids"]

    def plant(module, args, output):
        weights = torch.zeros_like(output[1])
        for b, row in enumerate(seen["ids"]):
            pos = (row == image_id).nonzero()[:, 0]
            if generic_prompt in scorer.tokenizer.decode(row):
                weights[b, :, -1, pos] = 1.0 / len(pos)
            else:
                weights[b, :, -1, pos[token]] = 1.0
        return output[0], weights

    hooks = [scorer.model.register_forward_pre_hook(keep_ids, with_kwargs=True)]
    hooks += [layer.self_attn.register_forward_hook(plant)
              for layer in scorer.model.model.language_model.layers]
    return hooks


@pytest.mark.parametrize("hw, rc, upsample", [((64, 96), (0, 1), "bilinear"),
                                              ((100, 50), (2, 0), "bilinear"),
                                              ((100, 50), (1, 1), "nearest")])
def test_planted_attention_lands_in_its_pixel_block(scorer, hw, rc, upsample):
    h, w = hw
    rows, cols = {(64, 96): (2, 3), (100, 50): (3, 2)}[hw]
    generic = "Describe the image."
    results = {}
    for relative in (False, True):
        config = SoftTifaConfig(relative_attention=relative, generic_prompt=generic,
                                upsample=upsample, **PIXELS)
        planted = SoftTifaScorer(scorer.model, scorer.tokenizer, scorer.image_processor, config)
        hooks = _plant(scorer, rc[0] * cols + rc[1], generic)
        try:
            results[relative] = planted.score_image(_image(h, w, seed=3), _graph().atoms())
        finally:
            for hook in hooks:
                hook.remove()
    maps = results[False].heatmaps
    np.testing.assert_allclose(maps.sum((1, 2)), 1.0, rtol=1e-5)
    for heatmap in maps:
        y, x = np.unravel_index(heatmap.argmax(), heatmap.shape)
        assert rc[0] * h / rows <= y < (rc[0] + 1) * h / rows
        assert rc[1] * w / cols <= x < (rc[1] + 1) * w / cols
    np.testing.assert_allclose(results[True].heatmaps, maps, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(results[True].scores, results[False].scores, rtol=1e-6)


def test_relative_map_closed_form():
    maps = torch.tensor([[0.5, 0.5], [0.9, 0.1]])
    generic = torch.tensor([0.75, 0.25])
    expected = torch.tensor([[1 / 3 / (4 / 3), 1 / (4 / 3)], [1.2 / 1.6, 0.4 / 1.6]])
    torch.testing.assert_close(relative_map(maps, generic, eps=1e-12), expected)


def test_processor_chat_template_fallback(tmp_path):
    assert processor_chat_template(str(tmp_path)) is None
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert processor_chat_template(str(tmp_path)) == TEMPLATE


def test_thinking_prefix_is_closed(scorer):
    thinking = TEMPLATE.replace("assistant\n", "assistant\n<think>\n")
    prompt = render_prompt(scorer.tokenizer, "Is there a dog?", chat_template=thinking)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("kwargs, message", [
    ({"layers": (1, 1)}, "distinct non-negative"),
    ({"heads": (-1,)}, "distinct non-negative"),
    ({"count_forms": ("{digit}", "3")}, "placeholder"),
    ({"yes_forms": ()}, "yes_forms must not be empty"),
    ({"upsample": "bicubic"}, "'bilinear' or 'nearest'"),
    ({"relative_eps": 0.0}, "relative_eps must be > 0"),
    ({"min_pixels": 4096, "max_pixels": 1024}, "must be >= min_pixels"),
])
def test_config_messages(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SoftTifaConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"layers": (0, 5)}, r"layers \[5\] out of range: .* 2 layers, valid indices are 0\.\.1"),
    ({"heads": (4,)}, r"valid indices are 0\.\.3"),
    ({"yes_forms": ("Yes indeed",)}, r"answers \['yes'\] have no accepted form that is a single"),
    ({"number_words": ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
                       "nine", "ten", "eleven"),
      "count_forms": ("{digit}", "{word}")}, r"answers \['11'\] have no"),
])
def test_model_dependent_messages(scorer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SoftTifaScorer(scorer.model, scorer.tokenizer, scorer.image_processor,
                       SoftTifaConfig(**kwargs))


def test_unknown_answer_and_sdpa_are_refused(model_dir, scorer):
    from transformers import Qwen3VLForConditionalGeneration

    odd = Atom("obj0/shape", "attribute", "What shape is it?", "round", (), "obj0")
    with pytest.raises(ValueError, match="answers must be 'yes', 'no' or a count 0..10"):
        scorer.score_image(_image(64, 64), (odd,))
    sdpa = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        SoftTifaScorer(sdpa, scorer.tokenizer, scorer.image_processor, SoftTifaConfig())


def test_runs_without_torchvision(model_dir):
    code = f"""
import sys
import torch
from cast_core.csg.graph import Atom, ObjectNode, SceneGraph
from cast_core.scorers.soft_tifa import SoftTifaConfig, SoftTifaScorer
atoms = (Atom("obj0", "object", "Is there a dog?", "yes", (), "obj0"),)
graph = SceneGraph("a dog", (ObjectNode("obj0", "dog", 1, (), atoms),), ())
scorer = SoftTifaScorer.from_pretrained({str(model_dir)!r}, SoftTifaConfig(), torch_dtype="float32")
(result,) = scorer.score(torch.rand(1, 3, 48, 80), [graph])
assert result.scores.shape == (1,) and result.heatmaps.shape == (1, 48, 80)
assert "torchvision" not in sys.modules, "torchvision was imported"
"""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
