"""The one backbone protocol the pipeline talks to.

Every family (`shapes`, `flux2`, `qwen_image`) implements it; `cast_core.sampling`,
`cast_core.rollout`, `cast_core.policy` and the calibration only use these members, so a pixel map
can be pooled onto any backbone's grid and one trainer serves all of them.

Conventions shared by every family:
- **Latents** are the sampled state x as a 4-D grid tensor [N, C, h, w] whose (h, w) is the
  transformer's token grid (`token_grid`): for latent-diffusion families this is the VAE latent
  after the family's patchification (e.g. FLUX.2: 2×2 patches of 32 channels -> C = 128), so one
  latent position is one transformer token and per-position log-probs live on the token grid.
  Packing into the token sequence the transformer eats happens inside `velocity`.
- **Time**: sigma t in [0, 1], t = 1 is pure noise, x_t = (1 - t) x0 + t eps, the model predicts
  v = eps - x0. `sigmas(num_steps)` is the schedule [num_steps + 1] from the first sigma down to 0,
  exactly as the family's diffusers pipeline computes it for that step count and image size.
- **CFG**: `velocity(..., guidance_scale, uncond)` combines as the family's pipeline does (true
  CFG with an empty/negative prompt; guidance-distilled models take the scale as an input instead).
- **Dtypes**: weights may be bf16; step math (sde/ode steps, log-probs) is fp32, so `velocity`
  returns float32.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Backbone(Protocol):
    """What the pipeline needs from a text-to-image flow-matching model."""

    family: str
    lora_target_modules: tuple[str, ...]
    transformer: torch.nn.Module  # the denoiser that LoRA attaches to (peft `add_adapter`)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, h, w) of one sample's latent grid."""

    @property
    def token_grid(self) -> tuple[int, int]:
        """(h, w) of the transformer's token grid (equals latent_shape[1:])."""

    def encode_prompts(self, prompts: list[str]) -> Any:
        """Prompt conditioning for N prompts; indexable by sample (`cond[index]`)."""

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, cond: Any,
                 guidance_scale: float = 1.0, uncond: Any | None = None) -> torch.Tensor:
        """v(x_t, t) [N, C, h, w] float32; t [N] sigmas in [0, 1]."""

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """Sampling schedule [num_steps + 1], decreasing, ending at 0."""

    def initial_noise(self, seeds: list[int]) -> torch.Tensor:
        """One standard-normal latent per seed, independent of batch position. [N, C, h, w]."""

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents [N, C, h, w] -> images [N, 3, H, W] in [0, 1], float32."""

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images [N, 3, H, W] in [0, 1] -> latents [N, C, h, w] float32, deterministic; `decode`
        maps them back (exactly in pixel space, up to the VAE's reconstruction error otherwise)."""


def check_image_size(images: torch.Tensor, height: int, width: int) -> None:
    """Raise unless images are [N, 3, height, width] (what `encode_images` takes)."""
    if images.ndim != 4 or tuple(images.shape[1:]) != (3, height, width):
        raise ValueError(f"encode_images takes images [N, 3, {height}, {width}] (the backbone's "
                         f"height × width); got {tuple(images.shape)}: resize them to "
                         f"{height}×{width} or build the backbone for their size")
