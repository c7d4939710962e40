"""Tiny random models of the real architectures, written as the folders the adapters load.

Each builder makes the real classes at toy sizes from config (no download), saves them with
`save_pretrained` into a folder and returns the folder, so tests load them back through the same
`from_pretrained` paths a real checkpoint takes:
- `save_flux2_pipeline`: a `Flux2Pipeline` (dev: Mistral-3 text encoder, guidance-distilled) or
  `Flux2KleinPipeline` (Qwen3 text encoder, true CFG) folder; a plain fast BPE tokenizer with a
  chat template stands in for the real processor (`PixtralProcessor` needs torchvision), and the
  VAE's batch-norm statistics are randomised so the latent de-normalisation is exercised. VAE
  factor 2 and 2x2 patches: an H/4 x W/4 token grid of 16 channels; prompt embeddings stack the
  text layers `FLUX2_LAYERS`.
- `save_qwen_image_pipeline`: a `QwenImagePipeline` folder (Qwen2.5-VL text encoder, VAE factor 4,
  the Qwen-Image scheduler config): an H/8 x W/8 token grid of 16 channels. Its template prefix is
  not the real tokenizer's 34 tokens: read it with `qwen_image_prefix`.
- `save_qwen3_vl`: a Qwen3-VL folder (model, tokenizer with chat template, PIL image processor
  with 16-px patches merged 2x2) for `SoftTifaScorer.from_pretrained`; answer words ("Yes", "No",
  digits and number words) are single tokens of its tokenizer.
- `save_clip`: a `CLIPModel` folder with a PIL image processor for `ClipEmbedder.from_pretrained`.
- `save_causal_lm`: a 1-layer random Qwen2 causal LM folder with a ChatML template, for
  `LocalCausalLMClient` (the `llm-local` CSG builder).
Tokenizers are byte-level BPE trained in about a second on a small corpus (any text encodes).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

# FLUX.2 ------------------------------------------------------------------------------------------
FLUX2_LAYERS = (1, 2, 3)  # three tiny text layers of width 16 -> joint_attention_dim 48
FLUX2_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                  "[/SYSTEM_PROMPT]", "<|im_start|>", "<|im_end|>"]
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYSTEM_PROMPT]"
    "{{ m['content'][0]['text'] }}[/SYSTEM_PROMPT]{% else %}[INST]{{ m['content'][0]['text'] }}"
    "[/INST]{% endif %}{% endfor %}")
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
    "not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def flux2_tokenizer(template: str, prompts: Sequence[str]):
    """A fast byte-level BPE tokenizer (trained on the FLUX.2 system message and `prompts`) with
    the FLUX.2 special tokens and `template` as its chat template."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    corpus = [SYSTEM_MESSAGE, *prompts, "user assistant think", "Yes", "No"]
    core.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=500, special_tokens=FLUX2_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = template
    return tok


def _flux2_text_encoder(variant: str, tok) -> torch.nn.Module:
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    text = {"vocab_size": len(tok), "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 8, "max_position_embeddings": 64, "pad_token_id": tok.pad_token_id}
    if variant == "klein":
        return Qwen3ForCausalLM(Qwen3Config(**text))
    return Mistral3ForConditionalGeneration(Mistral3Config(
        text_config={"model_type": "mistral", "sliding_window": None,
                     "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, **text},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "intermediate_size": 32, "image_size": 16,
                       "patch_size": 8, "num_channels": 3},
        image_token_index=0, spatial_merge_size=1, vision_feature_layer=-1))


def save_flux2_pipeline(folder: str | Path, variant: str, prompts: Sequence[str],
                        num_single_layers: int = 2) -> Path:
    """A tiny FLUX.2 pipeline folder: variant "dev" (Flux2Pipeline) or "klein"
    (Flux2KleinPipeline); `prompts` join the tokenizer's training corpus."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Pipeline,
        Flux2Transformer2DModel,
    )

    if variant not in ("dev", "klein"):
        raise ValueError(f"variant must be 'dev' or 'klein'; got {variant!r}")
    torch.manual_seed(0)
    tok = flux2_tokenizer(MISTRAL_TEMPLATE if variant == "dev" else QWEN3_TEMPLATE, prompts)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=num_single_layers,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16 * len(FLUX2_LAYERS),
        timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4],
        guidance_embeds=variant == "dev")
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False,
        mid_block_add_attention=False)
    with torch.no_grad():
        vae.bn.running_mean.normal_()
        vae.bn.running_var.uniform_(0.5, 2.0)
    # the real FLUX.2 scheduler config: resolution-dependent exponential shift through mu
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0,
                                                time_shift_type="exponential")
    parts = {"scheduler": scheduler, "vae": vae, "text_encoder": _flux2_text_encoder(variant, tok),
             "tokenizer": tok, "transformer": transformer}
    pipe = Flux2Pipeline(**parts) if variant == "dev" else Flux2KleinPipeline(**parts)
    pipe.save_pretrained(folder)
    return Path(folder)


# Qwen-Image --------------------------------------------------------------------------------------
QWEN_IMAGE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen-Image's scheduler config: exponential dynamic shift and a terminal sigma
QWEN_IMAGE_SCHEDULER = {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 8192,
                        "max_shift": 0.9, "shift": 1.0, "shift_terminal": 0.02,
                        "time_shift_type": "exponential", "use_dynamic_shifting": True}


def qwen_image_tokenizer(prompts: Sequence[str]):
    """A Qwen2Tokenizer (byte-level BPE trained on the prompt template around `prompts`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    from cast_core.backbones.qwen_image_text import PROMPT_TEMPLATE

    corpus = [PROMPT_TEMPLATE.format(p) for p in prompts] + ["a blue sphere above a dog"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=330, special_tokens=QWEN_IMAGE_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(core.to_str())["model"]
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]])
    tok.add_special_tokens({"additional_special_tokens": QWEN_IMAGE_SPECIALS[1:]})
    return tok


def qwen_image_components(prompts: Sequence[str]) -> dict:
    """The five components of a tiny QwenImagePipeline (seeded: the same weights every call)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = qwen_image_tokenizer(prompts)
    v = len(tok)
    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": v + 3,
                     "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default",
                                      "type": "default"},
                     "rope_theta": 1e6, "bos_token_id": None, "eos_token_id": 0},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": 16},
        hidden_size=16, vocab_size=v + 3, vision_start_token_id=v, vision_end_token_id=v + 1,
        vision_token_id=v + 2, image_token_id=v + 2, video_token_id=v + 2)).eval()
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=3, joint_attention_dim=16, axes_dims_rope=(8, 4, 4))
    vae = AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 1.0, 2.0])
    return {"scheduler": FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER), "vae": vae,
            "text_encoder": text_encoder, "tokenizer": tok, "transformer": transformer}


def save_qwen_image_pipeline(folder: str | Path, prompts: Sequence[str]) -> Path:
    """A tiny QwenImagePipeline folder; `prompts` join the tokenizer's training corpus."""
    from diffusers import QwenImagePipeline

    QwenImagePipeline(**qwen_image_components(prompts)).save_pretrained(folder)
    return Path(folder)


def qwen_image_prefix(folder: str | Path) -> int:
    """Token length of the prompt template's prefix with the folder's tokenizer (the backbone's
    and the pipeline's `prompt_template_encode_start_idx`)."""
    from transformers import Qwen2Tokenizer

    from cast_core.backbones.qwen_image_text import template_prefix_length

    return template_prefix_length(Qwen2Tokenizer.from_pretrained(Path(folder) / "tokenizer"))


# Qwen3-VL (Soft-TIFA) ----------------------------------------------------------------------------
QWEN3_VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                     "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN3_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}{% else %}"
    "{% for c in message.content %}{% if c.type == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c.type == 'text' %}{{ c.text }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _qwen3_vl_corpus() -> list[str]:
    from cast_core.scorers.soft_tifa import NUMBER_WORDS

    answers = ["Yes", "No", "yes", "no", *NUMBER_WORDS, *(w.capitalize() for w in NUMBER_WORDS)]
    spaced = [f"answer {w}" for w in answers]
    return ["Is there a dog? Please answer yes or no.", "How many red dogs are there?",
            "Please answer with a number.", "Are the dogs red?", "Describe the image.",
            *answers, *spaced] * 20


def save_qwen3_vl(folder: str | Path) -> Path:
    """A tiny Qwen3-VL folder (hidden 32, 2 text layers, vision depth 2, 16-px patches merged
    2x2: one image token per 32x32 pixels) with tokenizer, chat template and image processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(_qwen3_vl_corpus(), trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    bpe_model = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(vocab=bpe_model["vocab"],
                               merges=[tuple(m) for m in bpe_model["merges"]],
                               additional_special_tokens=QWEN3_VL_SPECIALS[1:],
                               chat_template=QWEN3_VL_TEMPLATE)
    tokenizer.save_pretrained(folder)
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in QWEN3_VL_SPECIALS}
    config = Qwen3VLConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                        "mrope_section": [2, 1, 1],
                                                        "mrope_interleaved": True}},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "out_hidden_size": 32, "num_position_embeddings": 64,
                       "deepstack_visual_indexes": [0]},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    Qwen3VLForConditionalGeneration(config).save_pretrained(folder)
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                             image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(folder)
    return Path(folder)


# CLIP --------------------------------------------------------------------------------------------
CLIP_SIZE, CLIP_CROP = 40, 32  # shortest edge after resize, then the center crop the tower takes
CLIP_PROCESSOR = {"size": {"shortest_edge": CLIP_SIZE},
                  "crop_size": {"height": CLIP_CROP, "width": CLIP_CROP}}


def tiny_clip(seed: int = 0, projection_dim: int = 16):
    """A random CLIPModel (vision: 32-px input, 8-px patches, 2 layers; text: 1 layer), eval mode."""
    from transformers import CLIPConfig, CLIPModel

    config = CLIPConfig(
        text_config={"vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "intermediate_size": 37,
                     "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 1,
                     "pad_token_id": 1},
        vision_config={"image_size": CLIP_CROP, "patch_size": 8, "hidden_size": 32,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 37},
        projection_dim=projection_dim,
    )
    torch.manual_seed(seed)
    return CLIPModel(config).eval()


def save_clip(folder: str | Path, model=None) -> Path:
    """A CLIP folder: `model` (default `tiny_clip()`) and a PIL CLIP image processor."""
    from transformers import CLIPImageProcessorPil

    (model if model is not None else tiny_clip()).save_pretrained(folder)
    CLIPImageProcessorPil(**CLIP_PROCESSOR).save_pretrained(folder)
    return Path(folder)


# causal LM ---------------------------------------------------------------------------------------
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_causal_lm(folder: str | Path, corpus: Sequence[str]) -> Path:
    """A 1-layer random Qwen2 causal LM folder with a byte-level BPE tokenizer trained on
    `corpus` and a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=8192, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return Path(folder)
