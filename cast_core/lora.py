"""The LoRA adapter the policy update trains, and the base model its KL is measured against.

``add_lora`` adds one adapter through diffusers' PEFT integration (``add_adapter``) with PEFT's
default init (B = 0, so the adapted model starts equal to the base) and freezes every other
parameter of the backbone, text encoder included. ``reference_mode`` disables the adapters, which
gives the base model exactly: it is the KL reference, so no second copy of the model is kept.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from peft import LoraConfig


def add_lora(
    backbone, rank: int, alpha: float, target_modules: Sequence[str] | None = None
) -> list[torch.nn.Parameter]:
    """Add a LoRA adapter to backbone.transformer; return its parameters (the only trainable ones)
    in named_parameters order. target_modules defaults to backbone.lora_target_modules."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be an int >= 1; got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"LoRA alpha must be > 0 (scale = alpha / rank); got {alpha!r}")
    targets = list(target_modules or backbone.lora_target_modules)
    backbone.requires_grad_(False)
    backbone.transformer.add_adapter(
        LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=True)
    )
    lora = []
    for name, p in backbone.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_" in name:
            lora.append(p)
    return lora


@contextmanager
def reference_mode(backbone) -> Iterator[None]:
    """Run the base model (adapters disabled) inside the block; adapters are re-enabled after."""
    backbone.transformer.disable_adapters()
    try:
        yield
    finally:
        backbone.transformer.enable_adapters()
