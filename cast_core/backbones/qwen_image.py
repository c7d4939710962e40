"""Qwen-Image and Qwen-Image-2512 (`diffusers.QwenImagePipeline` components) as a CAST backbone.

Components load with `from_pretrained` from the subfolders of a QwenImagePipeline folder or hub id:
`QwenImageTransformer2DModel` (transformer), `AutoencoderKLQwenImage` (vae), the scheduler's config
(scheduler), `Qwen2_5_VLForConditionalGeneration` (text_encoder) and `Qwen2Tokenizer` (tokenizer).
Prompt encoding and its cache live in `qwen_image_text`. What follows is adapted from
`QwenImagePipeline.__call__`, `prepare_latents`, `_pack_latents` and `_unpack_latents` (0.42):

- **Latents**: the VAE latent [N, z, H/f, W/f] (f = 2 ** len(vae.temperal_downsample), the frame
  axis dropped) cut into 2×2 patches is our grid [N, 4z, h, w] with h = H / 2f: channel
  c * 4 + 2 dy + dx holds latent channel c at offset (dy, dx), which is `pixel_unshuffle(., 2)`
  and the pipeline's token layout, so `velocity` packs by flattening (h, w) into the sequence.
- **Noise**: `initial_noise` draws [1, 1, z, H/f, W/f] in float32 from a CPU generator seeded with
  the seed, as `prepare_latents` does for one generator of a per-sample list (the pipeline draws in
  the model dtype: in bf16 its noise is ours rounded).
- **Time**: sigmas come from the folder's `FlowMatchEulerDiscreteScheduler` (a fresh copy per call)
  fed the pipeline's `linspace(1, 1 / n, n)` and the resolution shift
  `mu = calculate_shift(h * w, base/max_image_seq_len, base/max_shift)` of the scheduler config;
  the transformer gets `timestep = (1000 t).to(dtype) / 1000` as the pipeline passes it. The model
  output is v = eps - x0, and `FlowMatchEulerDiscreteScheduler.step` is x + (t_next - t) v, which
  is `cast_core.sde.ode_step`; a scheduler config with stochastic sampling or inverted sigmas is
  refused.
- **CFG**: true CFG with the negative prompt's embedding as `uncond` (the empty prompt by default),
  v = v_u + s (v_c - v_u), then rescaled per token to the conditional norm,
  v * |v_c| / |v| (norm over the 4z channels), as the pipeline does; two transformer calls.
- **Decode**: unpatchify, de-normalise x * latents_std + latents_mean, add the frame axis,
  `vae.decode`, take frame 0, map [-1, 1] to [0, 1].
- **Encode** (`encode_images`, decode's inverse path): [0, 1] -> [-1, 1], add the frame axis,
  `vae.encode`, the latent distribution's mode, normalise (z - latents_mean) / latents_std, drop
  the frame axis, patchify: `QwenImageEditPipeline._encode_vae_image` (argmax mode; the img2img
  pipeline's helper samples instead) on the pipeline's preprocessed image 2 x - 1.

Precision departures: weights may be bf16, but latents, the CFG combination and the
(de-)normalisation stay float32 (the pipeline keeps latents in the model dtype); the transformer
sees its input cast to its dtype and `velocity` returns float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageTransformer2DModel,
)
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
from torch import Tensor
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from cast_core.backbones.base import check_image_size
from cast_core.backbones.qwen_image_text import (
    PIPELINE_TEMPLATE_START_IDX,
    PromptCache,
    PromptEmbeds,
    PromptEncoding,
    encode_one,
    template_prefix_length,
)
from cast_core.backbones.source import require_source


@dataclass(frozen=True)
class QwenImageConfig:
    """Image size in pixels (the pipeline's default is 1024²) and VAE decode batch."""

    height: int = 1024
    width: int = 1024
    vae_batch: int = 4

    def __post_init__(self) -> None:
        for name in ("height", "width", "vae_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"QwenImageConfig.{name} must be >= 1; got {getattr(self, name)}")


class QwenImageBackbone(torch.nn.Module):
    """Tokenizer, text encoder, transformer and VAE of a QwenImagePipeline, with the backbone calls."""

    family = "qwen_image"
    lora_target_modules = (
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
        "to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
    )

    def __init__(self, config: QwenImageConfig, encoding: PromptEncoding, transformer, vae,
                 text_encoder, tokenizer, scheduler_config: dict,
                 embedding_cache_dir: str | Path | None = None) -> None:
        super().__init__()
        self.config, self.encoding = config, encoding
        self.transformer, self.vae, self.text_encoder = transformer, vae, text_encoder
        self.tokenizer = tokenizer
        self.scheduler_config = dict(scheduler_config)
        self.cache = (PromptCache(embedding_cache_dir, encoding)
                      if embedding_cache_dir is not None else None)
        self._check()

    def _check(self) -> None:
        t, z = self.transformer.config, self.vae.config.z_dim
        if t.patch_size != 2 or t.in_channels != 4 * z:
            raise ValueError(f"the transformer must take 2x2 patches of the VAE's {z} channels "
                             f"(patch_size 2, in_channels {4 * z}); got {t.patch_size}, "
                             f"{t.in_channels}: transformer and vae come from different models")
        if t.guidance_embeds or t.use_additional_t_cond:
            raise ValueError("guidance-distilled or extra-conditioned Qwen-Image variants are not "
                             "supported: this adapter implements the plain text-to-image call")
        step = 2 * self.vae_scale_factor
        if self.config.height % step or self.config.width % step:
            raise ValueError(f"height and width must be multiples of {step} (VAE factor x 2x2 "
                             f"patches); got {self.config.height}x{self.config.width}")
        s = self.scheduler_config
        if s.get("stochastic_sampling") or s.get("invert_sigmas"):
            raise ValueError("the scheduler config uses stochastic sampling or inverted sigmas; "
                             "the backbone's Euler step assumes neither: use the model's own config")
        prefix = template_prefix_length(self.tokenizer, self.encoding.template)
        if prefix != self.encoding.drop_idx:
            raise ValueError(f"the prompt template's prefix is {prefix} tokens with this tokenizer "
                             f"but prompt_template_encode_start_idx is {self.encoding.drop_idx}; "
                             f"pass prompt_template_encode_start_idx={prefix}")

    @classmethod
    def from_pretrained(cls, path_or_hub_id: str | Path, *, torch_dtype: torch.dtype = torch.bfloat16,
                        embedding_cache_dir: str | Path | None = None, height: int = 1024,
                        width: int = 1024, max_sequence_length: int = 512,
                        prompt_template_encode_start_idx: int = PIPELINE_TEMPLATE_START_IDX,
                        vae_batch: int = 4) -> QwenImageBackbone:
        """Load a QwenImagePipeline folder or hub id (weights in torch_dtype), in eval mode."""
        src = str(path_or_hub_id)
        require_source(src, "path_or_hub_id")
        text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            src, subfolder="text_encoder", dtype=torch_dtype)
        vae = AutoencoderKLQwenImage.from_pretrained(src, subfolder="vae", torch_dtype=torch_dtype)
        backbone = cls(
            QwenImageConfig(height=height, width=width, vae_batch=vae_batch),
            PromptEncoding(model_id=src, drop_idx=prompt_template_encode_start_idx,
                           max_sequence_length=max_sequence_length),
            transformer=QwenImageTransformer2DModel.from_pretrained(
                src, subfolder="transformer", torch_dtype=torch_dtype),
            vae=vae.requires_grad_(False),
            text_encoder=text_encoder.requires_grad_(False),
            tokenizer=Qwen2Tokenizer.from_pretrained(src, subfolder="tokenizer"),
            scheduler_config=FlowMatchEulerDiscreteScheduler.from_pretrained(
                src, subfolder="scheduler").config,
            embedding_cache_dir=embedding_cache_dir,
        )
        return backbone.eval()

    # geometry -----------------------------------------------------------------------------
    @property
    def vae_scale_factor(self) -> int:
        """Pixels per VAE latent position (the pipeline's `vae_scale_factor`)."""
        return 2 ** len(self.vae.temperal_downsample)

    @property
    def token_grid(self) -> tuple[int, int]:
        """(h, w) = (H, W) / (2 vae_scale_factor): one transformer token per position."""
        step = 2 * self.vae_scale_factor
        return (self.config.height // step, self.config.width // step)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(4 z, h, w): 2x2 patches of the VAE's z channels on the token grid."""
        return (self.transformer.config.in_channels, *self.token_grid)

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def enable_gradient_checkpointing(self) -> None:
        self.transformer.enable_gradient_checkpointing()

    # calls ----------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Prompts -> PromptEmbeds (embeds [N, L, D], mask [N, L]), read from the cache if any."""
        dtype = self.text_encoder.dtype
        rows = []
        for prompt in prompts:
            row = self.cache.load(prompt, dtype) if self.cache is not None else None
            if row is None:
                row = encode_one(self.tokenizer, self.text_encoder, prompt, self.encoding)
                if self.cache is not None:
                    self.cache.save(prompt, row)
            rows.append(row.to(self.device))
        return PromptEmbeds.from_list(rows)

    def velocity(self, x_t: Tensor, t: Tensor, cond: PromptEmbeds, guidance_scale: float = 1.0,
                 uncond: PromptEmbeds | None = None) -> Tensor:
        """v(x_t, t) [N, 4z, h, w] float32 for t [N]; true CFG with the pipeline's rescale when
        guidance_scale != 1 (uncond defaults to the empty prompt)."""
        t = torch.as_tensor(t, dtype=torch.float32, device=x_t.device).expand(x_t.shape[0])
        v_c = self._transformer_velocity(x_t, t, cond)
        if guidance_scale == 1.0:
            return v_c
        if uncond is None:
            uncond = self.encode_prompts([""] * x_t.shape[0])
        v_u = self._transformer_velocity(x_t, t, uncond)
        v = v_u + guidance_scale * (v_c - v_u)  # [N, 4z, h, w]
        return v * (v_c.norm(dim=1, keepdim=True) / v.norm(dim=1, keepdim=True))

    def _transformer_velocity(self, x_t: Tensor, t: Tensor, cond: PromptEmbeds) -> Tensor:
        n, c, h, w = x_t.shape
        dtype, cond = self.transformer.dtype, cond.to(self.device)
        tokens = x_t.to(self.device, dtype).flatten(2).transpose(1, 2)  # [N, h*w, 4z]
        out = self.transformer(
            hidden_states=tokens,
            timestep=(1000.0 * t.to(self.device)).to(dtype) / 1000.0,
            encoder_hidden_states=cond.embeds.to(dtype),
            encoder_hidden_states_mask=cond.transformer_mask(),
            img_shapes=[[(1, h, w)]] * n,
            return_dict=False,
        )[0]  # [N, h*w, 4z]
        return out.transpose(1, 2).reshape(n, c, h, w).float()

    def sigmas(self, num_steps: int) -> Tensor:
        """The pipeline's schedule [num_steps + 1] for this image size, ending at 0 (float32)."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1; got {num_steps}")
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        s, (h, w) = scheduler.config, self.token_grid
        mu = calculate_shift(h * w, s.get("base_image_seq_len", 256),
                             s.get("max_image_seq_len", 4096), s.get("base_shift", 0.5),
                             s.get("max_shift", 1.15))
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
        return scheduler.sigmas.float()

    def initial_noise(self, seeds: list[int]) -> Tensor:
        """One standard-normal latent per seed, independent of batch position: [N, 4z, h, w]."""
        z = self.transformer.config.in_channels // 4
        h, w = self.token_grid
        draws = [torch.randn((1, 1, z, 2 * h, 2 * w), generator=torch.Generator().manual_seed(int(s)))
                 for s in seeds]
        return F.pixel_unshuffle(torch.cat(draws)[:, 0], 2).to(self.device)  # [N, 4z, h, w]

    @torch.no_grad()
    def decode(self, x: Tensor) -> Tensor:
        """Latents [N, 4z, h, w] -> images [N, 3, H, W] in [0, 1], float32."""
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean, device=x.device).view(1, cfg.z_dim, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, device=x.device).view(1, cfg.z_dim, 1, 1, 1)
        vae_device = next(self.vae.parameters()).device
        images = []
        for chunk in x.float().split(self.config.vae_batch):
            z = F.pixel_shuffle(chunk, 2).unsqueeze(2) * std + mean  # [n, z, 1, H/f, W/f]
            frames = self.vae.decode(z.to(vae_device, self.vae.dtype), return_dict=False)[0]
            images.append((frames[:, :, 0].float() * 0.5 + 0.5).clamp(0.0, 1.0))  # [n, 3, H, W]
        return torch.cat(images).to(x.device)

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        """Images [N, 3, H, W] in [0, 1] (H × W the configured size) -> latents [N, 4z, h, w]
        float32 on the model's device; `decode` maps them back up to the VAE's reconstruction
        error. The mode of the latent distribution, so deterministic."""
        check_image_size(images, self.config.height, self.config.width)
        cfg = self.vae.config
        vae_device = next(self.vae.parameters()).device
        mean = torch.tensor(cfg.latents_mean, device=vae_device).view(1, cfg.z_dim, 1, 1, 1)
        std = torch.tensor(cfg.latents_std, device=vae_device).view(1, cfg.z_dim, 1, 1, 1)
        latents = []
        for chunk in images.float().split(self.config.vae_batch):
            pixels = (chunk * 2.0 - 1.0).unsqueeze(2)  # [n, 3, 1, H, W] in [-1, 1]
            pixels = pixels.to(vae_device, self.vae.dtype)
            z = self.vae.encode(pixels).latent_dist.mode().float()  # [n, z, 1, H/f, W/f]
            latents.append(F.pixel_unshuffle(((z - mean) / std)[:, :, 0], 2))  # [n, 4z, h, w]
        return torch.cat(latents).to(self.device)
