"""The Qwen-Image backbone against diffusers' QwenImagePipeline, on a tiny random model in fp32.

The tiny pipeline (real classes: Qwen2.5-VL text encoder, QwenImageTransformer2DModel,
AutoencoderKLQwenImage, the Qwen-Image scheduler config with its dynamic shift) is built from
config, saved as a pipeline folder and loaded back both by the pipeline and by the backbone. The
tiny tokenizer's template prefix is not the real one's 34 tokens, so both are told its length.
The builder lives in `tiny_models.save_qwen_image_pipeline`.
"""

import re
from pathlib import Path

import pytest
import torch
from diffusers import QwenImageEditPipeline, QwenImagePipeline
from peft import get_peft_model_state_dict
from tiny_models import save_qwen_image_pipeline
from transformers import Qwen2Tokenizer

from cast_core.backbones.base import Backbone
from cast_core.backbones.qwen_image import QwenImageBackbone
from cast_core.backbones.qwen_image_text import (
    PROMPT_TEMPLATE,
    PromptEmbeds,
    template_prefix_length,
)
from cast_core.lora import add_lora
from cast_core.policy import PolicyConfig, policy_update
from cast_core.rollout import RolloutSpec, replay_log_probs, rollout
from cast_core.sampling import sample_ode
from cast_core.window import SdeWindow

H, W = 64, 96  # VAE factor 4, 2x2 patches: an 8 x 12 token grid
PROMPTS = ["a red cube left of a sleeping cat", "two dogs"]
SEEDS = [3, 11]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen") / "pipeline"
    return save_qwen_image_pipeline(path, PROMPTS)


@pytest.fixture(scope="module")
def prefix(folder) -> int:
    n = template_prefix_length(Qwen2Tokenizer.from_pretrained(folder / "tokenizer"))
    assert n != 34  # else the tests could not tell a wrong drop index from the right one
    return n


def _pipeline(folder: Path, prefix: int) -> QwenImagePipeline:
    pipe = QwenImagePipeline.from_pretrained(folder)
    pipe.prompt_template_encode_start_idx = prefix
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _backbone(folder: Path, prefix: int, **kwargs) -> QwenImageBackbone:
    kwargs = {"height": H, "width": W, "torch_dtype": torch.float32, **kwargs}
    return QwenImageBackbone.from_pretrained(
        folder, prompt_template_encode_start_idx=prefix, **kwargs)


def _run_pipeline(pipe, steps: int, cfg: float, output_type: str, height: int = H,
                  width: int = W) -> torch.Tensor:
    negative = [""] * len(PROMPTS) if cfg != 1.0 else None
    return pipe(PROMPTS, negative_prompt=negative, true_cfg_scale=cfg, height=height, width=width,
                num_inference_steps=steps, output_type=output_type,
                generator=[torch.Generator().manual_seed(s) for s in SEEDS]).images


def _packed(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(2).transpose(1, 2)  # [N, 4z, h, w] -> [N, h*w, 4z]


def test_geometry_template_and_wrong_drop_index(folder, prefix):
    backbone = _backbone(folder, prefix)
    assert isinstance(backbone, Backbone) and backbone.family == "qwen_image"
    assert backbone.token_grid == (8, 12) and backbone.latent_shape == (16, 8, 12)
    assert _pipeline(folder, prefix).prompt_template_encode == PROMPT_TEMPLATE
    with pytest.raises(ValueError, match=f"prompt_template_encode_start_idx={prefix}"):
        _backbone(folder, 34)
    with pytest.raises(ValueError, match="multiples of 8"):
        _backbone(folder, prefix, height=60)


def test_prompt_embeds_and_noise_equal_the_pipelines(folder, prefix):
    backbone, pipe = _backbone(folder, prefix), _pipeline(folder, prefix)
    cond = backbone.encode_prompts(PROMPTS)
    embeds, mask = pipe.encode_prompt(PROMPTS, max_sequence_length=512)
    torch.testing.assert_close(cond.embeds, embeds, rtol=0, atol=1e-6)
    assert torch.equal(cond.mask, mask) and not bool(mask.all())
    single = backbone.encode_prompts(PROMPTS[1:])
    assert torch.equal(cond[1].embeds, single.embeds) and cond[1].transformer_mask() is None
    joined = PromptEmbeds.cat([cond[0], cond[1]])
    assert torch.equal(joined.embeds, cond.embeds) and torch.equal(joined.mask, cond.mask)
    noise = pipe.prepare_latents(2, 4, H, W, torch.float32, "cpu",
                                 [torch.Generator().manual_seed(s) for s in SEEDS])
    assert torch.equal(_packed(backbone.initial_noise(SEEDS)), noise)
    assert torch.equal(backbone.initial_noise(SEEDS[1:]), backbone.initial_noise(SEEDS)[1:])


@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_ode_sampling_reproduces_the_pipeline(folder, prefix, cfg):
    backbone, pipe = _backbone(folder, prefix), _pipeline(folder, prefix)
    x0 = sample_ode(backbone, PROMPTS, SEEDS, num_steps=4, guidance_scale=cfg)
    torch.testing.assert_close(_packed(x0), _run_pipeline(pipe, 4, cfg, "latent"),
                               rtol=0, atol=1e-5)
    images = backbone.decode(x0)
    assert images.shape == (2, 3, H, W) and images.dtype == torch.float32
    torch.testing.assert_close(images, _run_pipeline(pipe, 4, cfg, "pt"), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("height", "width", "steps"), [(H, W, 4), (128, 160, 7)])
def test_sigmas_equal_the_pipeline_schedulers(folder, prefix, height, width, steps):
    pipe = _pipeline(folder, prefix)
    _run_pipeline(pipe, steps, 1.0, "latent", height=height, width=width)
    sigmas = _backbone(folder, prefix, height=height, width=width).sigmas(steps)
    assert sigmas.shape == (steps + 1,) and sigmas[-1] == 0 and sigmas[-2] == pytest.approx(0.02, abs=1e-6)
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas, rtol=0, atol=1e-7)


def _spec(steps: int = 3) -> RolloutSpec:
    return RolloutSpec(num_steps=steps, guidance_scale=2.0, noise_level=0.7, sde_kind="flow_sde",
                       window=SdeWindow(0, steps))


def test_rollout_log_probs_are_finite_and_replay_gives_ratio_one(folder, prefix):
    backbone, spec = _backbone(folder, prefix), _spec()
    out = rollout(backbone, PROMPTS, SEEDS, spec)
    assert out.latents.shape == (2, 3, 16, 8, 12) and out.log_probs.shape == (2, 3, 8, 12)
    assert torch.isfinite(out.log_probs).all()
    replay = replay_log_probs(backbone, out, PROMPTS, spec, with_grad=False)
    ratio = torch.exp(replay.log_probs - out.log_probs)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-5)


def _dead_in_last_block(name: str) -> bool:
    """The last block's text stream feeds nothing: its text queries, text attention output and
    text MLP get no gradient signal (the transformer returns only image tokens)."""
    dead = ("attn.add_q_proj", "attn.to_add_out", "txt_mlp.")
    return name.startswith("transformer_blocks.1.") and any(d in name for d in dead)


def test_lora_update_trains_adapters_only_with_gradient_checkpointing(folder, prefix):
    backbone, spec = _backbone(folder, prefix), _spec()
    torch.manual_seed(0)
    params = add_lora(backbone, rank=4, alpha=4.0)
    backbone.enable_gradient_checkpointing()
    assert backbone.transformer.gradient_checkpointing
    modules = {n.rsplit(".lora_A", 1)[0] for n, _ in backbone.transformer.named_parameters()
               if ".lora_A." in n}
    for target in backbone.lora_target_modules:
        assert any(m.endswith(target) for m in modules), target
    before = {n: p.detach().clone() for n, p in backbone.named_parameters()}
    out = rollout(backbone, PROMPTS, SEEDS, spec)
    advantages = torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(0))
    records = policy_update(
        backbone, torch.optim.AdamW(params, lr=1e-2), PROMPTS, out, spec, advantages,
        PolicyConfig(advantage="spatial", clip_range=10.0, inner_epochs=2, micro_batch=2))
    assert records[0].first_ratio_ok and not any(r.skipped for r in records)
    named = dict(backbone.named_parameters())
    for name, p in named.items():
        changed = not torch.equal(p, before[name])
        if "lora_" not in name:
            assert not changed, name  # base weights bitwise unchanged
            continue
        module = name.split("transformer.", 1)[1]
        if _dead_in_last_block(module):  # grads None, or zeros when recomputed by checkpointing
            assert p.grad is None or not p.grad.any(), name
            assert "lora_B" not in name or not p.any(), name  # so its adapter stays a no-op
        else:  # the second epoch's grads: B moved off 0 in the first, so A has grads too
            assert changed and p.grad is not None and p.grad.abs().sum() > 0, name


def test_saved_lora_loads_into_the_pipeline_and_matches(folder, prefix, tmp_path):
    backbone = _backbone(folder, prefix)
    torch.manual_seed(0)
    params = add_lora(backbone, rank=4, alpha=8.0)  # scale alpha / rank = 2 travels as metadata
    with torch.no_grad():
        for p in params:
            p.normal_(0.0, 0.3)
    QwenImagePipeline.save_lora_weights(
        tmp_path / "lora", transformer_lora_layers=get_peft_model_state_dict(backbone.transformer),
        transformer_lora_adapter_metadata=backbone.transformer.peft_config["default"].to_dict())
    pipe = _pipeline(folder, prefix)
    base = _run_pipeline(pipe, 3, 2.0, "pt")
    pipe.load_lora_weights(tmp_path / "lora")
    ours = backbone.decode(sample_ode(backbone, PROMPTS, SEEDS, num_steps=3, guidance_scale=2.0))
    theirs = _run_pipeline(pipe, 3, 2.0, "pt")
    assert (theirs - base).abs().max() > 1e-2  # the adapter changes the images
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_embedding_cache_reads_from_disk(folder, prefix, tmp_path, monkeypatch):
    backbone = _backbone(folder, prefix, embedding_cache_dir=tmp_path / "emb")
    first = backbone.encode_prompts(PROMPTS)
    assert len(list((tmp_path / "emb").glob("*.safetensors"))) == 2

    def poisoned(*args, **kwargs):
        raise AssertionError("the text encoder ran although the embeddings are cached")

    monkeypatch.setattr(backbone.text_encoder, "forward", poisoned)
    second = backbone.encode_prompts(PROMPTS)
    assert torch.equal(first.embeds, second.embeds) and torch.equal(first.mask, second.mask)
    shorter = _backbone(folder, prefix, embedding_cache_dir=tmp_path / "emb", max_sequence_length=4)
    assert shorter.encode_prompts(PROMPTS).embeds.shape[1] == 4  # another key: encoded afresh
    assert len(list((tmp_path / "emb").glob("*.safetensors"))) == 4


def test_bf16_weights_keep_float32_step_math(folder, prefix):
    backbone = _backbone(folder, prefix, torch_dtype=torch.bfloat16)
    assert backbone.transformer.dtype == backbone.text_encoder.dtype == torch.bfloat16
    x0 = sample_ode(backbone, PROMPTS, SEEDS, num_steps=3, guidance_scale=2.0)
    assert x0.dtype == torch.float32 and backbone.decode(x0).dtype == torch.float32
    reference = sample_ode(_backbone(folder, prefix), PROMPTS, SEEDS, num_steps=3, guidance_scale=2.0)
    torch.testing.assert_close(x0, reference, rtol=0, atol=0.1)  # bf16 rounding only


def _images(n: int = 3) -> torch.Tensor:
    """Random images [n, 3, H, W] in [0, 1]."""
    return torch.rand(n, 3, H, W, generator=torch.Generator().manual_seed(7))


def test_encode_images_equals_the_edit_pipelines_image_encoding(folder, prefix):
    backbone, images = _backbone(folder, prefix, vae_batch=2), _images()  # two VAE chunks
    x = backbone.encode_images(images)
    assert x.shape == (3, 16, 8, 12) and x.dtype == torch.float32
    parts = QwenImagePipeline.from_pretrained(folder).components
    edit = QwenImageEditPipeline(**parts, processor=None)
    with torch.no_grad():  # the pipeline preprocesses to [-1, 1] and adds the frame axis
        want = edit._encode_vae_image((images * 2 - 1).unsqueeze(2), generator=None)
    assert want.shape == (3, 4, 1, 16, 24)
    torch.testing.assert_close(_packed(x), edit._pack_latents(want, 3, 4, 16, 24),
                               rtol=1e-5, atol=1e-5)


def test_decode_inverts_encode_images_up_to_the_vae(folder, prefix):
    """Normalise + patchify undo decode's unpatchify + de-normalise: the round trip is the VAE's
    own encode-decode of the image."""
    backbone, images = _backbone(folder, prefix), _images()
    vae = backbone.vae
    with torch.no_grad():
        z = vae.encode((images * 2 - 1).unsqueeze(2)).latent_dist.mode()  # [3, 4, 1, 16, 24]
        want = (vae.decode(z).sample[:, :, 0] * 0.5 + 0.5).clamp(0, 1)
    assert ((want > 0) & (want < 1)).float().mean() > 0.9
    torch.testing.assert_close(backbone.decode(backbone.encode_images(images)), want,
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(2, 3, W, H), (2, 1, H, W), (3, H, W)])
def test_encode_images_refuses_other_sizes(folder, prefix, shape):
    message = rf"\[N, 3, {H}, {W}\].*got {re.escape(str(shape))}"
    with pytest.raises(ValueError, match=message):
        _backbone(folder, prefix).encode_images(torch.rand(shape))


def test_an_nft_step_in_bf16_weights_trains_the_adapter_only(folder, prefix):
    """The forward-process update on Qwen-Image with bf16 weights: finite loss in fp32 maths,
    the LoRA moves, the base weights stay bitwise."""
    from cast_core.nft_update import NftConfig, nft_update

    backbone = _backbone(folder, prefix, torch_dtype=torch.bfloat16)
    torch.manual_seed(0)
    params = add_lora(backbone, rank=4, alpha=4.0)
    before = {n: p.detach().clone() for n, p in backbone.named_parameters()}
    x0 = sample_ode(backbone, PROMPTS, SEEDS, num_steps=2, guidance_scale=2.0)
    steps = nft_update(backbone, torch.optim.AdamW(params, lr=1e-2), PROMPTS, x0,
                       torch.tensor([1.0, -1.0]), NftConfig(centre=False, micro_batch=2),
                       2.0, seed=0)
    assert all(not s.skipped and s.loss is not None and s.loss > 0 for s in steps)
    named = dict(backbone.named_parameters())
    moved = [n for n, p in named.items() if not torch.equal(p, before[n])]
    assert moved and all("lora_" in n for n in moved)
