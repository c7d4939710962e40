"""Inputs of the Soft-TIFA scorer, built without `Qwen3VLProcessor` (it needs torchvision).

What `Qwen3VLProcessor.__call__` does for one image and one text, done here by hand:
- the image goes through `Qwen2VLImageProcessorPil` (smart resize to multiples of
  patch_size * merge_size inside the [min_pixels, max_pixels] budget, normalise, patchify) and
  gives `pixel_values` [P, D] with P = grid_h * grid_w and `image_grid_thw` = (1, grid_h, grid_w);
- the chat template renders one `<|vision_start|><|image_pad|><|vision_end|>` per image, and the
  single `<|image_pad|>` is expanded to prod(grid_thw) / merge_size**2 copies, one per merged
  token (`Qwen3VLProcessor.replace_image_token`). Merged tokens are the row-major
  (grid_h / merge, grid_w / merge) grid, each covering (patch * merge)**2 pixels of the resized
  image;
- `mm_token_type_ids` is 1 at image tokens and 0 elsewhere (transformers 5.x needs it for M-RoPE).
Departure: rows are padded on the LEFT, so the last position of every row is the one that
predicts the answer's first token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

IMAGE_TOKEN = "<|image_pad|>"
THINK_OPEN = "<think>\n"
THINK_CLOSED = "\n</think>\n\n"


@dataclass(frozen=True)
class ImageInputs:
    """One preprocessed image: pixel_values [P, D] (P patches), grid_thw [3] = (1, gh, gw) in
    patches, merge_size m; the LLM sees n_tokens = gh * gw / m**2 merged tokens."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    merge_size: int

    @property
    def token_grid(self) -> tuple[int, int]:
        """(gh / m, gw / m): the row-major grid of the image's merged tokens."""
        return int(self.grid_thw[1]) // self.merge_size, int(self.grid_thw[2]) // self.merge_size

    @property
    def n_tokens(self) -> int:
        rows, cols = self.token_grid
        return rows * cols


@dataclass(frozen=True)
class PromptBatch:
    """B left-padded chat prompts that each hold the same image: input_ids, attention_mask,
    mm_token_type_ids [B, L] and image_mask bool [B, L] (True at the image's merged tokens)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    mm_token_type_ids: torch.Tensor
    image_mask: torch.Tensor


def preprocess_image(processor, image: torch.Tensor, min_pixels: int | None,
                     max_pixels: int | None) -> ImageInputs:
    """image [3, H, W] float in [0, 1] -> ImageInputs. Quantised to uint8 first, as a saved PNG
    would be; the pixel budget defaults to the processor's own when None."""
    array = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    array = array.permute(1, 2, 0).cpu().numpy()  # [H, W, 3]
    size = {"shortest_edge": min_pixels or processor.size["shortest_edge"],
            "longest_edge": max_pixels or processor.size["longest_edge"]}
    out = processor(images=[array], size=size, input_data_format="channels_last",
                    return_tensors="pt")
    return ImageInputs(out["pixel_values"], out["image_grid_thw"][0], processor.merge_size)


def processor_chat_template(path: str) -> str | None:
    """The processor's chat template saved with a checkpoint (`chat_template.jinja`, or the
    "chat_template" key of `chat_template.json`), for tokenizers that carry none; None if absent."""
    from transformers.utils import cached_file

    for name in ("chat_template.jinja", "chat_template.json"):
        found = cached_file(path, name, _raise_exceptions_for_missing_entries=False)
        if found:
            text = Path(found).read_text()
            return json.loads(text)["chat_template"] if name.endswith(".json") else text
    return None


def render_prompt(tokenizer, text: str, chat_template: str | None = None) -> str:
    """One user turn (the image, then `text`) and the assistant prefix, as the chat template
    writes it, with one image placeholder. Thinking is disabled (`enable_thinking=False`); a
    template that still opens a `<think>` block gets it closed empty, so the next token is the
    answer."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                           add_generation_prompt=True, enable_thinking=False)
    if prompt.count(IMAGE_TOKEN) != 1:
        raise ValueError(f"the chat template must render one {IMAGE_TOKEN} for one image: got "
                         f"{prompt.count(IMAGE_TOKEN)} in {prompt!r}; use a Qwen-VL template")
    if prompt.endswith(THINK_OPEN):
        prompt += THINK_CLOSED
    return prompt


def encode_prompts(tokenizer, prompts: list[str], n_image_tokens: int,
                   image_token_id: int) -> PromptBatch:
    """Rendered prompts (one image placeholder each) -> a left-padded PromptBatch whose image
    placeholder is expanded to `n_image_tokens` tokens."""
    texts = [p.replace(IMAGE_TOKEN, IMAGE_TOKEN * n_image_tokens) for p in prompts]
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    length = max(len(r) for r in rows)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, length - len(row):] = torch.tensor(row)
        attention_mask[i, length - len(row):] = 1
    image_mask = (input_ids == image_token_id) & attention_mask.bool()
    counts = image_mask.sum(1)
    if not bool((counts == n_image_tokens).all()):
        raise ValueError(f"expected {n_image_tokens} image tokens per prompt, found "
                         f"{counts.tolist()}; the tokenizer must keep {IMAGE_TOKEN} special")
    return PromptBatch(input_ids, attention_mask, image_mask.long(), image_mask)


def single_token_ids(tokenizer, forms: tuple[str, ...]) -> tuple[int, ...]:
    """Token ids of the forms that the tokenizer encodes as exactly one token (others skipped),
    without repeats, in form order."""
    ids = [tokenizer.encode(f, add_special_tokens=False) for f in forms]
    return tuple(dict.fromkeys(i[0] for i in ids if len(i) == 1))


def count_forms(templates: tuple[str, ...], count: int, word: str) -> tuple[str, ...]:
    """Accepted surface forms of a count: each template with {digit}, {word} and {Word} filled."""
    filled = (t.format(digit=str(count), word=word, Word=word.capitalize()) for t in templates)
    return tuple(dict.fromkeys(filled))

