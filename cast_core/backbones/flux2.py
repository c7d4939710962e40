"""FLUX.2 backbones (FLUX.2-dev and FLUX.2-klein) from the components of a diffusers pipeline folder.

Loads `Flux2Transformer2DModel`, `AutoencoderKLFlux2`, the scheduler config, the text encoder
(Mistral-3 for dev, Qwen3 for klein) and its tokenizer from the subfolders of a `Flux2Pipeline` /
`Flux2KleinPipeline` folder or hub id (`model_index.json` names the variant) and reproduces what
the pipelines' `__call__` does, reusing their static helpers:

- **Latents** are the pipeline's pre-packing latents: the VAE latent (z channels) patchified 2×2
  and batch-norm normalised, [N, C, h, w], C = 4 z = transformer in_channels, h = H / (2 · VAE
  factor) (128 × 64 × 64 at 1024² on the real models); one position is one token. `velocity` packs
  row-major to [N, h·w, C] with the 4-D (T, H, W, L) ids (`_pack_latents`, `_prepare_latent_ids`,
  `_prepare_text_ids`), passes the pipeline's `timestep / 1000` (rounded the same way), keeps the
  image tokens and unpacks (the row-major inverse of `_unpack_latents_with_ids`).
- **Time**: v = eps - x0 for x_t = (1 - t) x0 + t eps; `FlowMatchEulerDiscreteScheduler.step` is
  prev = x + (sigma_next - sigma) v, our Euler step. `sigmas` is the scheduler's schedule for the
  pipeline's inputs, resolution shift included (`flux2_sigmas`).
- **Guidance** (from the folder): "embedded" for FLUX.2-dev (guidance-distilled: the scale is the
  transformer's `guidance` input, `uncond` unused); "cfg" for non-distilled klein (true CFG with
  the empty prompt, v_u + s (v_c - v_u), only for s > 1 as in the pipeline); "none" for
  step-distilled klein (`is_distilled`: the scale is ignored).
- **Noise**: `initial_noise` is `prepare_latents` with a list of CPU generators (`randn_tensor`):
  one [1, C, h, w] draw per seed in the weights' dtype (bf16 draws are not rounded fp32 draws).
- **Decode**: undo the VAE batch-norm (running stats), unpatchify, `vae.decode`, [-1, 1] -> [0, 1].
- **Encode** (`encode_images`, decode's inverse path): [0, 1] -> [-1, 1], `vae.encode`, the
  latent distribution's mode, patchify 2×2, batch-norm normalise: `Flux2Pipeline._encode_vae_image`
  (how the pipeline encodes conditioning images) on the pipeline's preprocessed image 2 x - 1.

Departures (bf16 only; in fp32 sampling equals the pipeline to float rounding): the state x and
the step math stay float32 (the pipeline keeps latents in the weights' dtype), the CFG combination,
decode's de-normalisation and encode's normalisation are float32. Image conditioning and caption
upsampling are left out. Prompt encoding and its cache live in `flux2_text`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2Pipeline,
    Flux2Transformer2DModel,
)
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
from peft.utils import get_peft_model_state_dict
from transformers import AutoTokenizer, Mistral3ForConditionalGeneration, Qwen3ForCausalLM

from cast_core.backbones.base import check_image_size
from cast_core.backbones.flux2_text import (
    Flux2Variant,
    TextEncoding,
    cached_embeddings,
    encode_with_pipeline,
)
from cast_core.backbones.source import require_source

GuidanceKind = Literal["embedded", "cfg", "none"]
PIPELINE_VARIANTS: dict[str, Flux2Variant] = {"Flux2Pipeline": "dev", "Flux2KleinPipeline": "klein"}
DEFAULT_LAYERS: dict[Flux2Variant, tuple[int, ...]] = {"dev": (10, 20, 30), "klein": (9, 18, 27)}
TEXT_ENCODERS = {"dev": Mistral3ForConditionalGeneration, "klein": Qwen3ForCausalLM}


@dataclass(frozen=True)
class Flux2Config:
    """What the pipeline call would take besides the prompt: image size, text settings, guidance."""

    model_id: str
    variant: Flux2Variant
    guidance: GuidanceKind
    height: int = 1024
    width: int = 1024
    max_sequence_length: int = 512
    text_encoder_out_layers: tuple[int, ...] | None = None  # None: the variant's pipeline default
    text_batch_size: int = 8

    def __post_init__(self) -> None:
        if self.variant not in ("dev", "klein"):
            raise ValueError(f"Flux2Config.variant must be 'dev' or 'klein'; got {self.variant!r}")
        if self.guidance not in ("embedded", "cfg", "none"):
            raise ValueError(
                f"Flux2Config.guidance must be 'embedded', 'cfg' or 'none'; got {self.guidance!r}")
        for name in ("height", "width", "max_sequence_length", "text_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Flux2Config.{name} must be an int >= 1; got {value!r}")
        layers = self.text_encoder_out_layers
        if layers is None:
            layers = DEFAULT_LAYERS[self.variant]
        if not layers:
            raise ValueError("Flux2Config.text_encoder_out_layers is empty; name the hidden-state "
                             f"layers to stack, e.g. {DEFAULT_LAYERS[self.variant]}")
        object.__setattr__(self, "text_encoder_out_layers", tuple(layers))


@dataclass(frozen=True)
class Flux2Conditioning:
    """Prompt embeddings [N, L, D] (the text encoder's stacked hidden states)."""

    embeds: torch.Tensor

    def __getitem__(self, index) -> Flux2Conditioning:
        return Flux2Conditioning(self.embeds[index])

    def __len__(self) -> int:
        return self.embeds.shape[0]


def flux2_sigmas(scheduler_config: dict, num_steps: int, image_seq_len: int) -> torch.Tensor:
    """The pipelines' schedule [num_steps + 1] float32 for h·w = image_seq_len tokens.

    As `Flux2Pipeline.__call__` step 6: sigmas linspace(1, 1/num_steps, num_steps) (none when the
    scheduler uses flow sigmas), mu = `compute_empirical_mu(image_seq_len, num_steps)` (the
    resolution- and step-dependent shift), then a fresh `FlowMatchEulerDiscreteScheduler` from the
    folder's config runs `set_timesteps` (shift, terminal stretch, ... as configured; 0 appended).
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1; got {num_steps!r}")
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    mu = compute_empirical_mu(image_seq_len=image_seq_len, num_steps=num_steps)
    if scheduler.config.get("use_flow_sigmas", False):
        scheduler.set_timesteps(num_steps, mu=mu)
    else:
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    return scheduler.sigmas.detach().to("cpu", torch.float32)


def _check_scheduler(config: dict) -> None:
    if config.get("stochastic_sampling") or config.get("invert_sigmas"):
        raise ValueError("the scheduler config asks for stochastic_sampling or invert_sigmas; the "
                         "backbone's Euler step reproduces only the deterministic scheduler step. "
                         "Set both to false in scheduler/scheduler_config.json")


class Flux2Backbone(torch.nn.Module):
    """Transformer + VAE + text encoder of a FLUX.2 pipeline folder, with the backbone calls."""

    family = "flux2"

    def __init__(self, config: Flux2Config, transformer: Flux2Transformer2DModel,
                 vae: AutoencoderKLFlux2, text_encoder: torch.nn.Module, tokenizer,
                 scheduler_config: dict, embedding_cache_dir: str | Path | None = None) -> None:
        super().__init__()
        self.config = config
        self.transformer, self.vae, self.text_encoder = transformer, vae, text_encoder
        self.tokenizer = tokenizer
        self.scheduler_config = dict(scheduler_config)
        _check_scheduler(self.scheduler_config)
        self.cache_dir = Path(embedding_cache_dir) if embedding_cache_dir is not None else None
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self._check_geometry()
        if config.guidance == "embedded" and not transformer.config.guidance_embeds:
            raise ValueError("guidance 'embedded' needs a transformer with guidance_embeds=True; "
                             "this checkpoint has none: use guidance 'none' or 'cfg'")
        single = [f"single_transformer_blocks.{i}.attn.to_out"
                  for i in range(transformer.config.num_single_layers)]
        # Double-stream attention (image and text projections) and the single-stream blocks' fused
        # qkv+MLP input and output; the single blocks' `to_out` is a plain Linear whose suffix also
        # names the double blocks' ModuleList, so it is listed per block (as diffusers' scripts do).
        self.lora_target_modules: tuple[str, ...] = (
            "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
            "to_add_out", "to_qkv_mlp_proj", *single)

    def _check_geometry(self) -> None:
        multiple = 2 * self.vae_scale_factor
        for name in ("height", "width"):
            size = getattr(self.config, name)
            if size % multiple:
                raise ValueError(
                    f"{name} must be a multiple of {multiple} (VAE factor {self.vae_scale_factor} × "
                    f"2×2 patches); got {size}: use {size - size % multiple or multiple}")
        if self.transformer.config.in_channels != 4 * self.vae.config.latent_channels:
            raise ValueError(
                f"transformer in_channels ({self.transformer.config.in_channels}) must be 4 × the "
                f"VAE's latent_channels ({self.vae.config.latent_channels}); the folder mixes models")

    # loading ---------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path_or_hub_id: str | Path, *, torch_dtype: torch.dtype = torch.bfloat16,
                        embedding_cache_dir: str | Path | None = None, height: int = 1024,
                        width: int = 1024, max_sequence_length: int = 512,
                        text_encoder_out_layers: tuple[int, ...] | None = None,
                        text_batch_size: int = 8) -> Flux2Backbone:
        """Load the components of a Flux2Pipeline / Flux2KleinPipeline folder or hub id."""
        source = str(path_or_hub_id)
        require_source(source, "path_or_hub_id")
        index = Flux2Pipeline.load_config(source)
        variant = PIPELINE_VARIANTS.get(index.get("_class_name"))
        if variant is None:
            raise ValueError(f"{source} holds a {index.get('_class_name')!r}, not a FLUX.2 pipeline; "
                             f"expected one of {sorted(PIPELINE_VARIANTS)}")
        transformer = Flux2Transformer2DModel.from_pretrained(
            source, subfolder="transformer", torch_dtype=torch_dtype)
        if variant == "dev":
            guidance = "embedded" if transformer.config.guidance_embeds else "none"
        else:
            guidance = "none" if index.get("is_distilled", False) else "cfg"
        tokenizer = AutoTokenizer.from_pretrained(source, subfolder="tokenizer")
        if tokenizer.chat_template is None:
            raise ValueError(f"{source}/tokenizer has no chat template (chat_template.jinja); the "
                             "FLUX.2 prompt encoding renders prompts through it")
        config = Flux2Config(
            model_id=source, variant=variant, guidance=guidance, height=height, width=width,
            max_sequence_length=max_sequence_length,
            text_encoder_out_layers=text_encoder_out_layers,
            text_batch_size=text_batch_size)
        return cls(
            config, transformer,
            AutoencoderKLFlux2.from_pretrained(source, subfolder="vae", torch_dtype=torch_dtype),
            TEXT_ENCODERS[variant].from_pretrained(source, subfolder="text_encoder",
                                                   dtype=torch_dtype),
            tokenizer,
            FlowMatchEulerDiscreteScheduler.load_config(source, subfolder="scheduler"),
            embedding_cache_dir,
        ).eval()

    # geometry --------------------------------------------------------------------------------
    @property
    def token_grid(self) -> tuple[int, int]:
        """(h, w): pixels / (2 · vae_scale_factor)."""
        multiple = 2 * self.vae_scale_factor
        return (self.config.height // multiple, self.config.width // multiple)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, h, w) with C = transformer in_channels (4 × the VAE's latent channels)."""
        return (self.transformer.config.in_channels, *self.token_grid)

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    # calls -----------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Flux2Conditioning:
        """Prompts -> Flux2Conditioning(embeds [N, L, D]), through the cache when one is set."""
        c = self.config
        encoding = TextEncoding(model_id=c.model_id, variant=c.variant,
                                max_sequence_length=c.max_sequence_length,
                                layers=c.text_encoder_out_layers,
                                dtype=str(self.text_encoder.dtype))
        embeds = cached_embeddings(list(prompts), self._encode, encoding, self.cache_dir,
                                   c.text_batch_size, self.device)
        return Flux2Conditioning(embeds)

    def _encode(self, prompts: list[str]) -> torch.Tensor:
        c = self.config
        return encode_with_pipeline(c.variant, self.text_encoder, self.tokenizer, prompts,
                                    c.max_sequence_length, c.text_encoder_out_layers)

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, cond: Flux2Conditioning,
                 guidance_scale: float = 1.0,
                 uncond: Flux2Conditioning | None = None) -> torch.Tensor:
        """v(x_t, t) [N, C, h, w] float32 on x_t's device; t [N] (or a scalar) sigmas in [0, 1]."""
        n = x_t.shape[0]
        t = torch.as_tensor(t, device=self.device).to(torch.float32).expand(n)
        if self.config.guidance == "cfg" and guidance_scale > 1.0:
            if uncond is None:
                uncond = self.encode_prompts([""] * n)
            v_c = self._raw_velocity(x_t, t, cond.embeds, None)
            v_u = self._raw_velocity(x_t, t, uncond.embeds, None)
            return v_u + guidance_scale * (v_c - v_u)
        guidance = None
        if self.config.guidance == "embedded":
            guidance = torch.full((n,), float(guidance_scale), device=self.device)
        return self._raw_velocity(x_t, t, cond.embeds, guidance)

    def _raw_velocity(self, x_t: torch.Tensor, t: torch.Tensor, embeds: torch.Tensor,
                      guidance: torch.Tensor | None) -> torch.Tensor:
        n, c, h, w = x_t.shape
        x = x_t.to(self.device, self.dtype)
        embeds = embeds.to(self.device, self.dtype)
        out = self.transformer(
            hidden_states=Flux2Pipeline._pack_latents(x),  # [N, h·w, C]
            timestep=(t * 1000).to(self.dtype) / 1000,
            guidance=guidance,
            encoder_hidden_states=embeds,  # [N, L, D]
            txt_ids=Flux2Pipeline._prepare_text_ids(embeds).to(self.device),  # [N, L, 4]
            img_ids=Flux2Pipeline._prepare_latent_ids(x).to(self.device),  # [N, h·w, 4]
            return_dict=False,
        )[0][:, : h * w]
        return out.transpose(1, 2).reshape(n, c, h, w).to(x_t.device, torch.float32)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline's schedule [num_steps + 1] at this backbone's image size (see flux2_sigmas)."""
        h, w = self.token_grid
        return flux2_sigmas(self.scheduler_config, num_steps, image_seq_len=h * w)

    def initial_noise(self, seeds: list[int]) -> torch.Tensor:
        """[N, C, h, w] float32 on the model's device; sample i is what the pipeline draws for a
        `torch.Generator().manual_seed(seeds[i])` in its generator list."""
        shape = (1, *self.latent_shape)
        draws = [torch.randn(shape, generator=torch.Generator().manual_seed(int(s)), dtype=self.dtype)
                 for s in seeds]
        return torch.cat(draws).to(self.device, torch.float32)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents [N, C, h, w] -> images [N, 3, H, W] in [0, 1], float32."""
        bn = self.vae.bn
        z = x.to(bn.running_mean.device, torch.float32)
        mean = bn.running_mean.float().view(1, -1, 1, 1)
        std = torch.sqrt(bn.running_var.float().view(1, -1, 1, 1) + self.vae.config.batch_norm_eps)
        z = Flux2Pipeline._unpatchify_latents(z * std + mean).to(self.vae.dtype)  # [N, C/4, 2h, 2w]
        image = self.vae.decode(z, return_dict=False)[0]  # [N, 3, H, W] in [-1, 1]
        return (image.float() * 0.5 + 0.5).clamp(0.0, 1.0)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images [N, 3, H, W] in [0, 1] (H × W the configured size) -> latents [N, C, h, w]
        float32 on the model's device; `decode` maps them back up to the VAE's reconstruction
        error. The mode of the latent distribution, so deterministic."""
        check_image_size(images, self.config.height, self.config.width)
        bn = self.vae.bn
        pixels = (images.float() * 2.0 - 1.0).to(bn.running_mean.device, self.vae.dtype)
        z = self.vae.encode(pixels).latent_dist.mode()  # [N, C/4, 2h, 2w]
        z = Flux2Pipeline._patchify_latents(z.float())  # [N, C, h, w]
        mean = bn.running_mean.float().view(1, -1, 1, 1)
        std = torch.sqrt(bn.running_var.float().view(1, -1, 1, 1) + self.vae.config.batch_norm_eps)
        return ((z - mean) / std).to(self.device)

    # training helpers ------------------------------------------------------------------------
    def enable_gradient_checkpointing(self) -> None:
        self.transformer.enable_gradient_checkpointing()

    def save_lora_weights(self, directory: str | Path, adapter_name: str = "default") -> None:
        """Write the transformer's LoRA adapter in diffusers' FLUX.2 format, readable by
        `Flux2Pipeline.load_lora_weights` / `Flux2KleinPipeline.load_lora_weights`."""
        Flux2Pipeline.save_lora_weights(
            directory,
            transformer_lora_layers=get_peft_model_state_dict(self.transformer,
                                                              adapter_name=adapter_name),
            transformer_lora_adapter_metadata=self.transformer.peft_config[adapter_name].to_dict())
