"""Qwen-Image prompt conditioning: the Qwen2.5-VL prompt encoding, its padded batch, a disk cache.

Adapted from `diffusers.QwenImagePipeline._get_qwen_prompt_embeds` and `encode_prompt`
(diffusers 0.42): the prompt is wrapped in the pipeline's chat template, tokenized with
`max_length = tokenizer_max_length + drop_idx` (truncating), run through the text encoder with
`output_hidden_states=True`, and the last hidden state's first `drop_idx` tokens (the template's
system prefix, `prompt_template_encode_start_idx`, 34 for the real tokenizer) are dropped; the rest
is cut to `max_sequence_length` tokens. Departure: each prompt is encoded on its own (no padding),
so a prompt's embedding never depends on the batch it was encoded with; a batch is then padded
with zeros to its longest prompt and a mask of 0 at the padding, which is what the pipeline's
batched encoding gives (right padding under a causal text encoder).

`PromptEmbeds` is the conditioning the backbone hands around: embeds [N, L, D] and mask [N, L]
(1 at real tokens). `cond[index]` selects samples and trims the padding to the selection's own
longest prompt, so a sub-batch equals that sub-batch encoded afresh; `PromptEmbeds.cat` joins
batches. The transformer gets the mask only when some token is padding, as the pipeline does.

Cache: with a directory, each prompt's embedding [L, D] is one safetensors file named by the
sha256 of (model id, prompt, template, drop_idx, tokenizer_max_length, max_sequence_length,
dtype). The model id is the path or hub id as given: a cache directory belongs to one set of
weights (put it under a weights hash when weights at a path can change).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity,"
    " text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
    "<|im_end|>\n<|im_start|>assistant\n"
)
PIPELINE_TEMPLATE_START_IDX = 34  # QwenImagePipeline.prompt_template_encode_start_idx
PIPELINE_TOKENIZER_MAX_LENGTH = 1024  # QwenImagePipeline.tokenizer_max_length


@dataclass(frozen=True)
class PromptEncoding:
    """How prompts become embeddings; every field enters the cache key."""

    model_id: str
    template: str = PROMPT_TEMPLATE
    drop_idx: int = PIPELINE_TEMPLATE_START_IDX
    tokenizer_max_length: int = PIPELINE_TOKENIZER_MAX_LENGTH
    max_sequence_length: int = 512

    def __post_init__(self) -> None:
        if self.template.count("{}") != 1:
            raise ValueError("the prompt template needs exactly one '{}' where the prompt goes")
        if self.drop_idx < 0:
            raise ValueError(f"prompt_template_encode_start_idx must be >= 0; got {self.drop_idx}")
        if not 1 <= self.max_sequence_length <= self.tokenizer_max_length:
            raise ValueError(
                f"max_sequence_length must lie in [1, {self.tokenizer_max_length}] (the pipeline "
                f"refuses more than 1024); got {self.max_sequence_length}")

    def cache_key(self, prompt: str, dtype: torch.dtype) -> str:
        fields = {**self.__dict__, "prompt": prompt, "dtype": str(dtype)}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class PromptEmbeds:
    """Conditioning of N prompts: embeds [N, L, D] (zeros at padding), mask [N, L] long."""

    embeds: Tensor
    mask: Tensor

    @classmethod
    def from_list(cls, rows: Sequence[Tensor]) -> PromptEmbeds:
        """Pad per-prompt embeddings [L_i, D] to the longest: PromptEmbeds with N = len(rows)."""
        length = max(r.shape[0] for r in rows)
        embeds = torch.stack([torch.cat([r, r.new_zeros(length - r.shape[0], r.shape[1])])
                              for r in rows])  # [N, L, D]
        mask = torch.stack([torch.arange(length, device=r.device) < r.shape[0] for r in rows])
        return cls(embeds=embeds, mask=mask.long())  # mask [N, L]

    @classmethod
    def cat(cls, parts: Sequence[PromptEmbeds]) -> PromptEmbeds:
        """Concatenate batches along N, padding to the longest prompt with mask 0."""
        return cls.from_list([row for part in parts for row in part.rows()])

    def rows(self) -> list[Tensor]:
        """The N unpadded embeddings [L_i, D]."""
        return [e[: int(m.sum())] for e, m in zip(self.embeds, self.mask, strict=True)]

    def __len__(self) -> int:
        return self.embeds.shape[0]

    def __getitem__(self, index) -> PromptEmbeds:
        """Samples at index (an int keeps the batch dim), padding trimmed to their longest."""
        if isinstance(index, int):
            index = [index]
        if isinstance(index, Tensor):
            index = index.to(self.embeds.device)
        embeds, mask = self.embeds[index], self.mask[index]
        length = int(mask.sum(1).max())
        return PromptEmbeds(embeds=embeds[:, :length], mask=mask[:, :length])

    def to(self, device: torch.device | str) -> PromptEmbeds:
        return PromptEmbeds(self.embeds.to(device), self.mask.to(device))

    def transformer_mask(self) -> Tensor | None:
        """The `encoder_hidden_states_mask` the pipeline passes: None when nothing is padding."""
        return None if bool(self.mask.all()) else self.mask


def encode_one(tokenizer, text_encoder, prompt: str, encoding: PromptEncoding) -> Tensor:
    """One prompt -> its embedding [L, D] in the text encoder's dtype (the pipeline's way)."""
    device = next(text_encoder.parameters()).device
    tokens = tokenizer([encoding.template.format(prompt)], return_tensors="pt", truncation=True,
                       max_length=encoding.tokenizer_max_length + encoding.drop_idx).to(device)
    out = text_encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                       output_hidden_states=True)
    hidden = out.hidden_states[-1][0]  # [T, D], no padding with one prompt
    return hidden[encoding.drop_idx:][: encoding.max_sequence_length]


def template_prefix_length(tokenizer, template: str = PROMPT_TEMPLATE) -> int:
    """Token count of the template's part before the prompt (what drop_idx must equal)."""
    return len(tokenizer(template.split("{}")[0]).input_ids)


class PromptCache:
    """Per-prompt embeddings [L, D] as safetensors files in one directory."""

    def __init__(self, directory: str | Path, encoding: PromptEncoding) -> None:
        self.directory = Path(directory)
        self.encoding = encoding

    def path(self, prompt: str, dtype: torch.dtype) -> Path:
        return self.directory / f"{self.encoding.cache_key(prompt, dtype)}.safetensors"

    def load(self, prompt: str, dtype: torch.dtype) -> Tensor | None:
        path = self.path(prompt, dtype)
        return load_file(path)["embeds"] if path.exists() else None

    def save(self, prompt: str, embeds: Tensor) -> None:
        """Write atomically (temporary file, then rename) so a reader never sees half a file."""
        path = self.path(prompt, embeds.dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({"embeds": embeds.detach().cpu().contiguous()}, tmp,
                  metadata={"prompt": prompt, "model_id": self.encoding.model_id})
        os.replace(tmp, path)
