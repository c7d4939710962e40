"""FLUX.2 prompt embeddings: the pipelines' own encoders, with an optional on-disk cache.

Encoding is the installed diffusers pipelines' static helpers, called on our text encoder and
tokenizer, so the embeddings are the pipeline's by construction:
- FLUX.2-dev (`Flux2Pipeline._get_mistral_3_small_prompt_embeds`): Mistral-3 chat template with
  the FLUX.2 system message, padded to `max_sequence_length`, hidden states of
  `text_encoder_out_layers` (default (10, 20, 30)) stacked per token -> [N, L, layers * D].
- FLUX.2-klein (`Flux2KleinPipeline._get_qwen3_prompt_embeds`): Qwen3 chat template with thinking
  off, padded to `max_sequence_length`, layers (9, 18, 27) stacked the same way.
These are private helpers of the pipelines; the golden test against the pipeline guards an upgrade.

Cache: one safetensors file per prompt, `<sha256>.safetensors` holding `embeds` [L, D] in the
encoder's dtype. The key hashes the model id/path as given, the variant, the prompt, the sequence
length, the layers and the dtype, so changing any of them never reads a stale entry; a different
text encoder saved at the same path is not detected (clear the directory). Files are written to a
temporary name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from safetensors.torch import load_file, save_file

Flux2Variant = Literal["dev", "klein"]
CACHE_FORMAT = 1


@dataclass(frozen=True)
class TextEncoding:
    """What determines a prompt's embedding besides the prompt itself (the cache key's fields)."""

    model_id: str
    variant: Flux2Variant
    max_sequence_length: int
    layers: tuple[int, ...]
    dtype: str

    def key(self, prompt: str) -> str:
        fields = {"format": CACHE_FORMAT, "prompt": prompt, **self.__dict__}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def encode_with_pipeline(variant: Flux2Variant, text_encoder, tokenizer, prompts: list[str],
                         max_sequence_length: int, layers: tuple[int, ...]) -> torch.Tensor:
    """Prompt embeddings [N, L, len(layers) * D] exactly as the variant's pipeline computes them."""
    if variant == "dev":
        return Flux2Pipeline._get_mistral_3_small_prompt_embeds(
            text_encoder=text_encoder, tokenizer=tokenizer, prompt=prompts,
            max_sequence_length=max_sequence_length, system_message=SYSTEM_MESSAGE,
            hidden_states_layers=layers)
    if variant == "klein":
        return Flux2KleinPipeline._get_qwen3_prompt_embeds(
            text_encoder=text_encoder, tokenizer=tokenizer, prompt=prompts,
            max_sequence_length=max_sequence_length, hidden_states_layers=layers)
    raise ValueError(f"unknown FLUX.2 variant {variant!r}; expected 'dev' or 'klein'")


def _read(path: Path) -> torch.Tensor | None:
    return load_file(path)["embeds"] if path.exists() else None


def _write(path: Path, embeds: torch.Tensor, prompt: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    save_file({"embeds": embeds.detach().contiguous().cpu()}, tmp, metadata={"prompt": prompt})
    os.replace(tmp, path)


def cached_embeddings(prompts: list[str], encode: Callable[[list[str]], torch.Tensor],
                      encoding: TextEncoding, cache_dir: Path | None, batch_size: int,
                      device: torch.device) -> torch.Tensor:
    """Embeddings [N, L, D] for N prompts: each distinct prompt is read from `cache_dir` when
    present, otherwise encoded (in batches of `batch_size`) and written there; the result is on
    `device`. Without a cache directory every distinct prompt is encoded once."""
    unique = list(dict.fromkeys(prompts))
    found: dict[str, torch.Tensor] = {}
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        for p in unique:
            hit = _read(cache_dir / f"{encoding.key(p)}.safetensors")
            if hit is not None:
                found[p] = hit
    missing = [p for p in unique if p not in found]
    for lo in range(0, len(missing), batch_size):
        chunk = missing[lo:lo + batch_size]
        embeds = encode(chunk)  # [n, L, D]
        for p, e in zip(chunk, embeds):
            found[p] = e
            if cache_dir is not None:
                _write(cache_dir / f"{encoding.key(p)}.safetensors", e, p)
    return torch.stack([found[p].to(device) for p in prompts])  # [N, L, D]
