"""FLUX.2 backbone against the diffusers pipelines, on tiny random models saved as pipeline folders.

Each folder is a full `Flux2Pipeline` (dev: Mistral-3 text encoder, guidance-distilled transformer)
or `Flux2KleinPipeline` (Qwen3 text encoder, true CFG) built from config, saved with
`save_pretrained` and loaded back by both the pipeline and `Flux2Backbone.from_pretrained`.
The tokenizer is a plain fast BPE tokenizer with a chat template (the real dev processor,
`PixtralProcessor`, needs torchvision). The VAE's batch-norm statistics are randomised so the
latent de-normalisation is exercised. The builder lives in `tiny_models.save_flux2_pipeline`.
"""

import json
import re
import shutil

import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from tiny_models import FLUX2_LAYERS, save_flux2_pipeline

from cast_core.backbones.base import Backbone
from cast_core.backbones.flux2 import Flux2Backbone, flux2_sigmas
from cast_core.backbones.flux2_text import TextEncoding
from cast_core.lora import add_lora, reference_mode
from cast_core.policy import PolicyConfig, policy_update
from cast_core.rollout import RolloutSpec, replay_log_probs, rollout
from cast_core.sampling import sample_ode
from cast_core.window import SdeWindow

PROMPTS = ["a photo of a red cat", "two blue dogs left of a tree"]
SEEDS = [11, 12]
LAYERS = FLUX2_LAYERS  # three tiny text layers of width 16 -> joint_attention_dim 48
TEXT_LEN = 48
SIZE = 32  # VAE factor 2 × 2×2 patches -> an 8×8 token grid of 16 channels


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2")
    for variant in ("dev", "klein"):
        save_flux2_pipeline(root / variant, variant, PROMPTS)
    return root


def _backbone(folder, **kwargs) -> Flux2Backbone:
    kwargs = {"height": SIZE, "width": SIZE, **kwargs}
    return Flux2Backbone.from_pretrained(folder, torch_dtype=torch.float32,
                                         max_sequence_length=TEXT_LEN,
                                         text_encoder_out_layers=LAYERS, **kwargs)


def _pipeline(folder, variant: str):
    cls = Flux2Pipeline if variant == "dev" else Flux2KleinPipeline
    pipe = cls.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pipeline_call(pipe, num_steps=3, guidance_scale=3.0, output_type="pt", size=SIZE, **kw):
    return pipe(prompt=PROMPTS, height=size, width=size, num_inference_steps=num_steps,
                guidance_scale=guidance_scale, output_type=output_type,
                generator=[torch.Generator().manual_seed(s) for s in SEEDS],
                max_sequence_length=TEXT_LEN, text_encoder_out_layers=LAYERS, **kw).images


def _randomise_lora_b(backbone, scale: float) -> None:
    """PEFT starts B at 0 (so A gets no gradient and the adapter does nothing); move it away."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in backbone.named_parameters():
            if "lora_B" in name:
                p.copy_(scale * torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("variant,guidance", [("dev", "embedded"), ("klein", "cfg")])
def test_ode_sampling_reproduces_the_pipeline(folders, variant, guidance):
    backbone = _backbone(folders / variant)
    assert isinstance(backbone, Backbone) and backbone.config.guidance == guidance
    assert backbone.latent_shape == (16, 8, 8) and backbone.token_grid == (8, 8)
    pipe = _pipeline(folders / variant, variant)
    steps = {}

    def record(pipe, i, t, tensors):
        steps[i] = tensors
        return {}

    want = _pipeline_call(pipe, callback_on_step_end=record)
    x0 = sample_ode(backbone, PROMPTS, SEEDS, num_steps=3, guidance_scale=3.0)  # [2, 16, 8, 8]
    packed = x0.flatten(2).transpose(1, 2)  # the pipeline's token sequence [2, 64, 16]
    torch.testing.assert_close(packed, steps[2]["latents"], atol=1e-4, rtol=1e-4)
    image = backbone.decode(x0)
    assert image.shape == (2, 3, SIZE, SIZE) and image.dtype == torch.float32
    torch.testing.assert_close(image, want, atol=1e-4, rtol=1e-4)
    embeds, _ = pipe.encode_prompt(PROMPTS, max_sequence_length=TEXT_LEN,
                                   text_encoder_out_layers=LAYERS)
    torch.testing.assert_close(backbone.encode_prompts(PROMPTS).embeds, embeds, atol=0, rtol=0)


def test_bf16_weights_sample_near_the_bf16_pipeline(folders):
    """bf16 departs only by our fp32 state and step math: images within a few bf16 steps."""
    backbone = Flux2Backbone.from_pretrained(
        folders / "dev", torch_dtype=torch.bfloat16, height=SIZE, width=SIZE,
        max_sequence_length=TEXT_LEN, text_encoder_out_layers=LAYERS)
    x0 = sample_ode(backbone, PROMPTS, SEEDS, num_steps=3, guidance_scale=3.0)
    image = backbone.decode(x0)
    assert x0.dtype == torch.float32 and image.dtype == torch.float32
    pipe = Flux2Pipeline.from_pretrained(folders / "dev", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    torch.testing.assert_close(image, _pipeline_call(pipe).float(), atol=3e-2, rtol=0)


def test_initial_noise_is_per_seed_and_the_pipelines(folders):
    backbone = _backbone(folders / "dev")
    noise = backbone.initial_noise([5, 6, 5])
    torch.testing.assert_close(noise[0], noise[2], atol=0, rtol=0)
    assert not torch.equal(noise[0], noise[1])
    pipe = _pipeline(folders / "dev", "dev")
    tokens, _ = pipe.prepare_latents(3, 4, SIZE, SIZE, torch.float32, "cpu",
                                     [torch.Generator().manual_seed(s) for s in (5, 6, 5)])
    torch.testing.assert_close(noise.flatten(2).transpose(1, 2), tokens, atol=0, rtol=0)


def test_distilled_klein_ignores_the_guidance_scale(folders, tmp_path):
    shutil.copytree(folders / "klein", tmp_path / "klein")
    index = json.loads((tmp_path / "klein" / "model_index.json").read_text())
    (tmp_path / "klein" / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    backbone = _backbone(tmp_path / "klein")
    assert backbone.config.guidance == "none"
    x, cond = backbone.initial_noise([1]), backbone.encode_prompts(PROMPTS[:1])
    with torch.no_grad():
        torch.testing.assert_close(backbone.velocity(x, torch.tensor([0.5]), cond, 4.0),
                                   backbone.velocity(x, torch.tensor([0.5]), cond, 1.0))


@pytest.mark.parametrize("size,num_steps", [(32, 4), (64, 4), (64, 7)])
def test_sigmas_equal_the_pipeline_schedulers(folders, size, num_steps):
    backbone = _backbone(folders / "dev", height=size, width=size)
    pipe = _pipeline(folders / "dev", "dev")
    _pipeline_call(pipe, num_steps=num_steps, output_type="latent", size=size)
    sigmas = backbone.sigmas(num_steps)
    assert sigmas.shape == (num_steps + 1,) and sigmas[-1] == 0
    torch.testing.assert_close(sigmas, pipe.scheduler.sigmas, atol=0, rtol=0)


def test_the_shift_depends_on_resolution_and_step_count(folders):
    config = json.loads((folders / "dev" / "scheduler" / "scheduler_config.json").read_text())
    base = flux2_sigmas(config, 4, image_seq_len=64)
    assert not torch.allclose(base, flux2_sigmas(config, 4, image_seq_len=4096))
    assert not torch.allclose(base[:2], flux2_sigmas(config, 8, image_seq_len=64)[:2])


def test_size_must_fit_the_token_grid(folders):
    with pytest.raises(ValueError, match="multiple of 4"):
        _backbone(folders / "dev", height=30)


@pytest.mark.parametrize("sde_kind", ["flow_sde", "cps"])
def test_sde_rollout_log_probs_are_finite_and_replay_to_ratio_one(folders, sde_kind):
    backbone = _backbone(folders / "klein")
    spec = RolloutSpec(num_steps=3, guidance_scale=3.0, noise_level=0.7, sde_kind=sde_kind,
                       window=SdeWindow(0, 3))
    out = rollout(backbone, PROMPTS, SEEDS, spec)
    assert out.latents.shape == (2, 3, 16, 8, 8) and out.log_probs.shape == (2, 3, 8, 8)
    assert out.log_probs.dtype == torch.float32 and torch.isfinite(out.log_probs).all()
    replay = replay_log_probs(backbone, out, PROMPTS, spec, with_grad=False)
    ratio = torch.exp(replay.log_probs - out.log_probs)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-4, rtol=0)


def test_a_lora_step_changes_only_the_adapter(folders):
    backbone = _backbone(folders / "dev")
    params = add_lora(backbone, rank=2, alpha=2.0)
    _randomise_lora_b(backbone, 0.02)
    lora = {n: p.detach().clone() for n, p in backbone.named_parameters() if p.requires_grad}
    base = {n: t.clone() for n, t in backbone.state_dict().items() if "lora_" not in n}
    targeted = {n.split(".lora_")[0].removeprefix("transformer.") for n in lora}
    attn = "transformer_blocks.0.attn."
    assert targeted == {
        *(attn + m for m in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                             "add_v_proj", "to_add_out")),
        *(f"single_transformer_blocks.{i}.attn.{m}" for i in (0, 1)
          for m in ("to_qkv_mlp_proj", "to_out"))}
    spec = RolloutSpec(num_steps=3, guidance_scale=3.0, noise_level=0.7, sde_kind="flow_sde",
                       window=SdeWindow(0, 2))
    out = rollout(backbone, PROMPTS, SEEDS, spec)
    advantages = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    (step,) = policy_update(backbone, optimizer, PROMPTS, out, spec, advantages,
                            PolicyConfig(advantage="spatial", clip_range=0.2, micro_batch=2))
    assert not step.skipped and step.first_ratio_ok
    named = dict(backbone.named_parameters())
    for name, before in lora.items():
        assert named[name].grad is not None and named[name].grad.abs().sum() > 0, name
        assert not torch.equal(named[name].detach(), before), name
    for name, value in backbone.state_dict().items():
        if "lora_" not in name:
            assert torch.equal(value, base[name]), name


def test_saved_lora_loads_into_the_pipeline_with_the_same_output(folders, tmp_path):
    backbone = _backbone(folders / "dev")
    add_lora(backbone, rank=2, alpha=4.0)
    _randomise_lora_b(backbone, 0.3)
    ours = backbone.decode(sample_ode(backbone, PROMPTS, SEEDS, num_steps=3, guidance_scale=3.0))
    with reference_mode(backbone):
        base = backbone.decode(sample_ode(backbone, PROMPTS, SEEDS, num_steps=3,
                                          guidance_scale=3.0))
    assert (ours - base).abs().max() > 1e-2
    backbone.save_lora_weights(tmp_path / "lora")
    pipe = _pipeline(folders / "dev", "dev")
    pipe.load_lora_weights(tmp_path / "lora")
    torch.testing.assert_close(_pipeline_call(pipe), ours, atol=1e-4, rtol=1e-4)


def test_embedding_cache_reads_from_disk(folders, tmp_path, monkeypatch):
    backbone = _backbone(folders / "dev", embedding_cache_dir=tmp_path / "cache")
    first = backbone.encode_prompts([PROMPTS[0], PROMPTS[1], PROMPTS[0]]).embeds
    assert first.shape == (3, TEXT_LEN, 48) and len(list((tmp_path / "cache").iterdir())) == 2

    def poisoned(*args, **kwargs):
        raise AssertionError("the text encoder ran although the prompt is cached")

    monkeypatch.setattr(backbone.text_encoder, "forward", poisoned)
    again = backbone.encode_prompts([PROMPTS[1], PROMPTS[0]])
    torch.testing.assert_close(again.embeds, first[[1, 0]], atol=0, rtol=0)
    torch.testing.assert_close(again[1].embeds, first[0], atol=0, rtol=0)
    with pytest.raises(AssertionError, match="text encoder ran"):
        backbone.encode_prompts(["an uncached prompt"])
    encoding = TextEncoding("m", "dev", TEXT_LEN, LAYERS, "torch.float32")
    other = TextEncoding("m", "dev", TEXT_LEN + 1, LAYERS, "torch.float32")
    assert encoding.key("p") != other.key("p") and encoding.key("p") != encoding.key("q")


def test_gradient_checkpointing_passes_through(folders):
    backbone = _backbone(folders / "dev")
    backbone.enable_gradient_checkpointing()
    assert backbone.transformer.gradient_checkpointing


def _images(n: int = 2) -> torch.Tensor:
    """Random images [n, 3, SIZE, SIZE] in [0, 1]."""
    return torch.rand(n, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(7))


def test_encode_images_equals_the_pipelines_image_encoding(folders):
    backbone, images = _backbone(folders / "dev"), _images()
    x = backbone.encode_images(images)
    assert x.shape == (2, 16, 8, 8) and x.dtype == torch.float32
    with torch.no_grad():  # the pipeline preprocesses to [-1, 1] before its helper
        want = _pipeline(folders / "dev", "dev")._encode_vae_image(images * 2 - 1, generator=None)
    torch.testing.assert_close(x, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(backbone.encode_images(images[1:]), x[1:], atol=1e-6, rtol=0)


def test_decode_inverts_encode_images_up_to_the_vae(folders):
    """Normalise + patchify undo decode's de-normalise + unpatchify: the round trip is the VAE's
    own encode-decode of the image."""
    backbone, images = _backbone(folders / "dev"), _images()
    vae = backbone.vae
    with torch.no_grad():
        z = vae.encode(images * 2 - 1).latent_dist.mode()  # [2, 4, 16, 16]
        want = (vae.decode(z).sample * 0.5 + 0.5).clamp(0, 1)
    assert 0.0 < want.mean() < 1.0 and ((want > 0) & (want < 1)).float().mean() > 0.9
    torch.testing.assert_close(backbone.decode(backbone.encode_images(images)), want,
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", [(2, 3, SIZE, 2 * SIZE), (2, 4, SIZE, SIZE), (3, SIZE, SIZE)])
def test_encode_images_refuses_other_sizes(folders, shape):
    message = rf"\[N, 3, {SIZE}, {SIZE}\].*got {re.escape(str(shape))}"
    with pytest.raises(ValueError, match=message):
        _backbone(folders / "dev").encode_images(torch.rand(shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_nft_step_changes_only_the_adapter(folders, dtype):
    """The forward-process update through the same adapter: finite loss (bf16 weights, fp32
    loss maths), LoRA moved, base weights bitwise unchanged; a map on the token grid."""
    from cast_core.nft_update import NftConfig, nft_update

    backbone = Flux2Backbone.from_pretrained(
        folders / "dev", torch_dtype=dtype, height=SIZE, width=SIZE,
        max_sequence_length=TEXT_LEN, text_encoder_out_layers=LAYERS)
    params = add_lora(backbone, rank=2, alpha=2.0)
    _randomise_lora_b(backbone, 0.02)
    lora = {n: p.detach().clone() for n, p in backbone.named_parameters() if p.requires_grad}
    base = {n: t.clone() for n, t in backbone.state_dict().items() if "lora_" not in n}
    x0 = sample_ode(backbone, PROMPTS, SEEDS, num_steps=2, guidance_scale=3.0)
    config = NftConfig(centre=False, micro_batch=2, inner_epochs=2)
    steps = nft_update(backbone, torch.optim.AdamW(params, lr=1e-3), PROMPTS, x0,
                       torch.tensor([[1.0], [-1.0]]).expand(2, 64).reshape(2, 8, 8), config,
                       3.0, seed=0)
    assert all(not s.skipped and s.loss is not None and s.loss > 0 for s in steps)
    named = dict(backbone.named_parameters())
    assert all(not torch.equal(named[n].detach(), before) for n, before in lora.items())
    for name, value in backbone.state_dict().items():
        if "lora_" not in name:
            assert torch.equal(value, base[name]), name
