"""The embedded backbone: a tiny SD3 flow-matching transformer in pixel space with a tiny BERT encoder.

Real classes, tiny sizes: `diffusers.SD3Transformer2DModel` (patch 4 on a 32×32×3 image, so an 8×8
token grid) conditioned on a `transformers.BertModel` (2 layers, width 128) over a word-level
tokenizer of the shapes grammar. The text encoder's last hidden states are the joint-attention
context; their masked mean is the pooled projection input. Both are trained from scratch
(`cast_core.shapes.pretrain`), saved with `save_pretrained` (safetensors + config) and loaded with
`from_pretrained`, so LoRA via peft, save/load and the velocity call follow the real backbones' path.

Conventions: pixels in [-1, 1] are the "latents" (C = 3, h×w = 32×32); sigma t in [0, 1], t = 1 is
noise; the transformer predicts the flow-matching velocity v = eps - x0 and takes `timestep = 1000 t`
as diffusers' SD3 pipeline does. CFG follows the SD3 pipeline: v = v_u + s (v_c - v_u), with the
empty prompt as the unconditional input. The sigma schedule is linear in t with an optional SD3
time shift t' = shift t / (1 + (shift - 1) t) (shift 1 = plain linear).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import SD3Transformer2DModel
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

from cast_core.backbones.source import require_source
from cast_core.shapes.world import COLORS, COUNT_WORDS, IMAGE_SIZE, SHAPES

BACKBONE_FILE = "cast_backbone.json"
GRAMMAR_WORDS = (
    "a", "an", "photo", "of", "and", ",", "one", *COUNT_WORDS.values(), "left", "right", "above",
    "below", *SHAPES, *(s + "s" for s in SHAPES), *COLORS,
)


@dataclass(frozen=True)
class ShapesBackboneConfig:
    """Sizes of the tiny model; defaults are the committed base model's."""

    image_size: int = IMAGE_SIZE
    patch_size: int = 4
    num_layers: int = 6
    num_heads: int = 4
    head_dim: int = 32
    text_width: int = 128
    text_layers: int = 2
    max_tokens: int = 16
    shift: float = 1.0

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size must be a multiple of patch_size: got {self.image_size} and "
                f"{self.patch_size}; pick a patch size that divides the image size")


@dataclass(frozen=True)
class Conditioning:
    """Text conditioning for N prompts: tokens [N, L, D], pooled [N, D]."""

    tokens: torch.Tensor
    pooled: torch.Tensor

    def __getitem__(self, index) -> Conditioning:
        return Conditioning(self.tokens[index], self.pooled[index])


def build_tokenizer(max_tokens: int) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the shapes grammar; unknown words map to [UNK]."""
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[BOS]", *dict.fromkeys(GRAMMAR_WORDS)])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", vocab["[BOS]"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
        model_max_length=max_tokens)


class ShapesBackbone(torch.nn.Module):
    """Tokenizer + text encoder + transformer of the embedded world, with the backbone calls."""

    family = "shapes"
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                           "add_v_proj", "to_add_out")

    def __init__(self, config: ShapesBackboneConfig, tokenizer=None, text_encoder=None,
                 transformer=None) -> None:
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer or build_tokenizer(config.max_tokens)
        self.text_encoder = text_encoder or BertModel(BertConfig(
            vocab_size=len(self.tokenizer), hidden_size=config.text_width,
            num_hidden_layers=config.text_layers, num_attention_heads=4,
            intermediate_size=2 * config.text_width, max_position_embeddings=config.max_tokens,
            type_vocab_size=1, pad_token_id=self.tokenizer.pad_token_id, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0), add_pooling_layer=False)
        grid = config.image_size // config.patch_size
        self.transformer = transformer or SD3Transformer2DModel(
            sample_size=config.image_size, patch_size=config.patch_size, in_channels=3,
            out_channels=3, num_layers=config.num_layers, attention_head_dim=config.head_dim,
            num_attention_heads=config.num_heads, joint_attention_dim=config.text_width,
            caption_projection_dim=config.num_heads * config.head_dim,
            pooled_projection_dim=config.text_width, pos_embed_max_size=grid)

    # geometry -----------------------------------------------------------------------------
    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, h, w) of the sampled tensor: pixel space, so (3, H, W)."""
        return (3, self.config.image_size, self.config.image_size)

    @property
    def token_grid(self) -> tuple[int, int]:
        """(h, w) of the transformer's token grid (image_size / patch_size)."""
        side = self.config.image_size // self.config.patch_size
        return (side, side)

    # calls ----------------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """Prompts -> Conditioning(tokens [N, L, D], pooled [N, D])."""
        device = next(self.text_encoder.parameters()).device
        batch = self.tokenizer(prompts, padding="max_length", truncation=True,
                               max_length=self.config.max_tokens, return_tensors="pt").to(device)
        hidden = self.text_encoder(input_ids=batch.input_ids,
                                   attention_mask=batch.attention_mask).last_hidden_state
        mask = batch.attention_mask.unsqueeze(-1).to(hidden.dtype)  # [N, L, 1]
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        return Conditioning(tokens=hidden, pooled=pooled)

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning,
                 guidance_scale: float = 1.0, uncond: Conditioning | None = None) -> torch.Tensor:
        """Velocity v(x_t, t) [N, 3, H, W]; with guidance_scale != 1 the SD3-style CFG combination."""
        t = torch.as_tensor(t, dtype=x_t.dtype, device=x_t.device).expand(x_t.shape[0])
        if guidance_scale == 1.0:
            return self._raw_velocity(x_t, t, cond)
        if uncond is None:
            uncond = self.encode_prompts([""] * x_t.shape[0])
        both = Conditioning(torch.cat([uncond.tokens, cond.tokens]),
                            torch.cat([uncond.pooled, cond.pooled]))
        v_u, v_c = self._raw_velocity(torch.cat([x_t, x_t]), torch.cat([t, t]), both).chunk(2)
        return v_u + guidance_scale * (v_c - v_u)

    def _raw_velocity(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        return self.transformer(hidden_states=x_t, encoder_hidden_states=cond.tokens,
                                pooled_projections=cond.pooled, timestep=1000.0 * t).sample

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The sampling schedule [num_steps + 1] from 1 to 0 (SD3 time shift applied)."""
        t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
        s = self.config.shift
        return (s * t / (1 + (s - 1) * t)).float()

    def initial_noise(self, seeds: list[int]) -> torch.Tensor:
        """One standard-normal sample per seed, independent of batch position. [N, 3, H, W]."""
        shape = self.latent_shape
        return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(int(s)))
                            for s in seeds])

    @staticmethod
    def decode(x: torch.Tensor) -> torch.Tensor:
        """Pixel-space latents [-1, 1] -> images in [0, 1], [N, 3, H, W]."""
        return ((x.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    @staticmethod
    def encode_images(images: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] [N, 3, H, W] -> latents in [-1, 1]."""
        return images.float() * 2.0 - 1.0

    # persistence ----------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(path / "tokenizer")
        self.text_encoder.save_pretrained(path / "text_encoder", safe_serialization=True)
        self.transformer.save_pretrained(path / "transformer", safe_serialization=True)
        (path / BACKBONE_FILE).write_text(json.dumps(
            {"family": self.family, **self.config.__dict__}, indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ShapesBackbone:
        require_source(str(path), "path", marker=BACKBONE_FILE, hub_allowed=False)
        path = Path(path)
        meta = json.loads((path / BACKBONE_FILE).read_text())
        if meta.pop("family") != cls.family:
            raise ValueError(f"{path} holds a different backbone family; expected {cls.family!r}")
        return cls(
            ShapesBackboneConfig(**meta),
            tokenizer=PreTrainedTokenizerFast.from_pretrained(path / "tokenizer"),
            text_encoder=BertModel.from_pretrained(path / "text_encoder", add_pooling_layer=False),
            transformer=SD3Transformer2DModel.from_pretrained(path / "transformer"),
        )
