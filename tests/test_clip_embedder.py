"""CLIP image embedder: a tiny random CLIPModel saved with save_pretrained, loaded back through
ClipEmbedder.from_pretrained, checked against transformers' own processor + get_image_features,
and used as the embedder of the window calibration."""

import dataclasses
import shutil

import numpy as np
import pytest
import torch
from tiny_models import CLIP_CROP, CLIP_PROCESSOR, CLIP_SIZE, save_clip, tiny_clip
from transformers import CLIPImageProcessorPil, CLIPModel, CLIPVisionConfig, CLIPVisionModel
from transformers.image_transforms import get_resize_output_image_size

from cast_core.calibration import cosine_similarity, similarity_curves
from cast_core.clip_embedder import ClipEmbedder, ClipPreprocess, resolve_checkpoint

SIZE, CROP = CLIP_SIZE, CLIP_CROP  # shortest edge after resize, then the center crop
PROCESSOR = CLIP_PROCESSOR
OPENAI_STYLE = {  # openai/clip-vit-large-patch14's preprocessor_config.json: sizes as ints
    "crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True,
    "feature_extractor_type": "CLIPFeatureExtractor", "resample": 3, "size": 224,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder, the CLIPModel saved there)."""
    folder = tmp_path_factory.mktemp("clip") / "a"
    model = tiny_clip(seed=0)
    save_clip(folder, model)
    return folder, model


@pytest.fixture(scope="module")
def embedder(saved) -> ClipEmbedder:
    return ClipEmbedder.from_pretrained(saved[0], batch_size=5)


def _uint8_images(seed: int, n: int, height: int, width: int) -> np.ndarray:
    """n random RGB images [n, H, W, 3] uint8: smooth blobs (noise upsampled 4x) plus pixel noise."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n, 3, height // 4 + 1, width // 4 + 1, generator=g)
    smooth = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bilinear")
    noisy = 0.8 * smooth + 0.2 * torch.rand(n, 3, height, width, generator=g)
    return (noisy * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def _as_tensor(images: np.ndarray) -> torch.Tensor:
    """[n, H, W, 3] uint8 -> [n, 3, H, W] float32 in [0, 1]."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0


def _image_features(model: CLIPModel, pixel_values: torch.Tensor) -> torch.Tensor:
    """Projected features [n, D]: transformers 5.x returns an output object (.pooler_output),
    4.x the tensor itself."""
    with torch.no_grad():
        out = model.get_image_features(pixel_values=pixel_values)
    return out if isinstance(out, torch.Tensor) else out.pooler_output


# interface ---------------------------------------------------------------------------------------

def test_shapes_unit_norm_determinism_and_batch_size_invariance(embedder):
    images = _as_tensor(_uint8_images(0, 5, 44, 52))
    e = embedder.embed(images)
    assert e.shape == (5, 16) == (5, embedder.dim) and e.dtype == torch.float32
    torch.testing.assert_close(e.norm(dim=1), torch.ones(5), rtol=0, atol=1e-6)
    assert torch.equal(embedder.embed(images), e)
    one_at_a_time = dataclasses.replace(embedder, batch_size=1).embed(images)
    torch.testing.assert_close(one_at_a_time, e, rtol=0, atol=1e-5)
    two_and_three = dataclasses.replace(embedder, batch_size=3).embed(images)
    torch.testing.assert_close(two_and_three, e, rtol=0, atol=1e-5)
    assert embedder.embed(images[:0]).shape == (0, 16)
    with pytest.raises(ValueError, match=r"\[N, 3, H, W\]"):
        embedder.embed(torch.zeros(2, 4, 40, 40))
    with pytest.raises(ValueError, match="batch_size"):
        dataclasses.replace(embedder, batch_size=0)


def test_identical_images_have_cosine_exactly_one_and_different_ones_less(embedder):
    images = _as_tensor(_uint8_images(1, 2, 36, 36))
    e = embedder.embed(torch.cat([images, images]))
    assert torch.equal(cosine_similarity(e[:2], e[2:]), torch.ones(2, dtype=torch.float64))
    assert float(cosine_similarity(e[:1], e[1:2])) < 1.0 - 1e-4


# against transformers' processor and model -------------------------------------------------------

@pytest.mark.parametrize("height, width", [(48, 64), (72, 44), (20, 28), (40, 40)])
def test_matches_the_transformers_processor_and_get_image_features(saved, embedder, height, width):
    """Shrink (landscape, portrait), enlarge, and no resize at all."""
    folder, model = saved
    images = _uint8_images(2, 3, height, width)
    reference = CLIPImageProcessorPil.from_pretrained(folder)
    pixel_values = reference(images=list(images), return_tensors="pt").pixel_values
    ours = embedder.preprocess(_as_tensor(images))
    assert ours.shape == pixel_values.shape == (3, 3, CROP, CROP)
    # PIL rounds to uint8 after each bicubic pass: one uint8 step is 1/255/std ~ 0.015 here.
    # Measured: max 0.015, mean 0.005; torch bicubic without antialias or bilinear with it give
    # max 0.10-0.22, a crop shifted by one pixel > 1.
    step = 1 / 255 / min(OPENAI_STYLE["image_std"])
    assert float((ours - pixel_values).abs().max()) < 2 * step
    assert float((ours - pixel_values).abs().mean()) < 0.5 * step
    expected = torch.nn.functional.normalize(_image_features(model, pixel_values), dim=1)
    e = embedder.embed(_as_tensor(images))
    # a random tiny CLIP is insensitive (those wrong variants still give ~0.9998): pixels above
    # are the sharp check, this one ties ours to get_image_features end to end
    assert float(cosine_similarity(e, expected).min()) > 0.9999


def test_vision_tower_equals_get_image_features_on_the_same_pixels(saved, embedder):
    _, model = saved
    pixel_values = torch.randn(4, 3, CROP, CROP, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = embedder.model(pixel_values=pixel_values).image_embeds
    torch.testing.assert_close(ours, _image_features(model, pixel_values), rtol=0, atol=1e-6)


def test_a_checkpoint_without_the_projection_is_rejected(tmp_path):
    vision = CLIPVisionModel(CLIPVisionConfig(image_size=CROP, patch_size=8, hidden_size=32,
                                              num_hidden_layers=1, num_attention_heads=2,
                                              intermediate_size=37))
    vision.save_pretrained(tmp_path)
    CLIPImageProcessorPil(**PROCESSOR).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="visual_projection"):
        ClipEmbedder.from_pretrained(tmp_path)


# preprocessing settings --------------------------------------------------------------------------

def test_preprocess_reads_both_config_forms_and_rejects_other_settings():
    openai = ClipPreprocess.from_config(OPENAI_STYLE)
    assert (openai.shortest_edge, openai.crop_height, openai.crop_width) == (224, 224, 224)
    assert openai.mean == tuple(OPENAI_STYLE["image_mean"])
    dict_form = ClipPreprocess.from_config(CLIPImageProcessorPil(**PROCESSOR).to_dict())
    assert (dict_form.shortest_edge, dict_form.crop_height, dict_form.crop_width) == (40, 32, 32)
    for key, value in [("resample", 2), ("do_center_crop", False), ("do_normalize", False),
                       ("rescale_factor", 1.0), ("size", {"height": 224, "width": 224})]:
        with pytest.raises(ValueError):
            ClipPreprocess.from_config(OPENAI_STYLE | {key: value})
    with pytest.raises(ValueError, match="crop"):
        ClipPreprocess.from_config(OPENAI_STYLE | {"crop_size": 256})


@pytest.mark.parametrize("height, width", [(48, 64), (72, 44), (20, 28), (41, 97), (97, 41)])
def test_resized_size_rounds_like_transformers(height, width):
    preprocess = ClipPreprocess.from_config(OPENAI_STYLE | {"size": 33, "crop_size": 33})
    expected = get_resize_output_image_size(np.zeros((3, height, width)), size=33,
                                            default_to_square=False, input_data_format="channels_first")
    assert preprocess.resized_size(height, width) == tuple(expected)


# identity ----------------------------------------------------------------------------------------

def test_spec_tells_checkpoints_apart_and_not_copies(saved, embedder, tmp_path):
    folder, _ = saved
    assert embedder.spec == ClipEmbedder.spec_for(folder)
    assert embedder.spec.startswith("clip-image-v1(model=sha256:")
    assert "dtype=float32" in embedder.spec and "crop=32x32" in embedder.spec
    shutil.copytree(folder, tmp_path / "copy")
    assert ClipEmbedder.spec_for(tmp_path / "copy") == embedder.spec
    save_clip(tmp_path / "other-seed", tiny_clip(seed=1))
    save_clip(tmp_path / "other-width", tiny_clip(seed=0, projection_dim=8))
    specs = {embedder.spec, ClipEmbedder.spec_for(tmp_path / "other-seed"),
             ClipEmbedder.spec_for(tmp_path / "other-width")}
    assert len(specs) == 3
    assert ClipEmbedder.from_pretrained(tmp_path / "other-width").dim == 8
    assert ClipEmbedder.spec_for(folder, torch.bfloat16) != embedder.spec


def test_a_hub_cache_snapshot_is_named_by_repo_and_commit(saved, tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "models--openai--clip-vit-tiny" / "snapshots" / commit
    shutil.copytree(saved[0], snapshot)
    assert resolve_checkpoint(snapshot).identity == f"openai/clip-vit-tiny@{commit}"
    assert f"model=openai/clip-vit-tiny@{commit}," in ClipEmbedder.spec_for(snapshot)


# as the calibration's embedder -------------------------------------------------------------------

class BlendFake:
    """Backbone whose Tweedie estimate moves from image a (t = 1) to image b (t = 0):
    v = (x_t - target(t)) / t with target(t) = t a + (1 - t) b; latents are the images."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a.double(), b.double()

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        return torch.zeros(len(prompts))

    def sigmas(self, num_steps: int) -> torch.Tensor:
        return torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)

    def initial_noise(self, seeds: list[int]) -> torch.Tensor:
        return torch.stack([torch.randn(self.a.shape, dtype=torch.float64,
                                        generator=torch.Generator().manual_seed(s)) for s in seeds])

    def velocity(self, x_t, t, cond, guidance_scale=1.0, uncond=None) -> torch.Tensor:
        t = t.to(x_t.dtype).view(-1, 1, 1, 1)
        return (x_t - (t * self.a + (1 - t) * self.b)) / t

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().clamp(0.0, 1.0)


def test_works_as_the_calibration_embedder(embedder):
    a, b = _as_tensor(_uint8_images(4, 2, 36, 44))
    out = similarity_curves(BlendFake(a, b), embedder, ["p", "q"], [0, 1], 6, 1.0)
    assert out.curves.shape == (2, 6) and out.curves.dtype == torch.float64
    assert bool(torch.isfinite(out.curves).all())
    assert torch.equal(out.curves[:, -1], torch.ones(2, dtype=torch.float64))
    # the estimate nears b step by step, so the similarity to the final (b) rises
    assert bool((out.curves[:, 0] < out.curves[:, -2]).all())
    assert bool((out.curves[:, -2] < 1.0 - 1e-4).all())
