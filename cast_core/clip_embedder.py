"""CLIP image embedder for window calibration on the real backbones (ViT-L/14 by default).

Variant: the projected image features of a transformers CLIP checkpoint (``image_embeds``, the
vector CLIP compares with text), L2-normalised, so e [N, D] with D = ``projection_dim`` (768 for
openai/clip-vit-large-patch14). Same interface as ``cast_core.shapes.embedder.LayoutEmbedder``:
``name``, ``spec``, ``dim``, ``embed(images [N, 3, H, W] in [0, 1]) -> [N, D] float32``.

Model: ``CLIPVisionModelWithProjection`` loaded from a full ``CLIPModel`` checkpoint (or from a
vision-only one). Its forward is exactly ``CLIPModel.get_image_features`` (vision tower, pooled
class token, ``visual_projection``) without the text tower, which is never used here (123 M of
ViT-L/14's 428 M parameters). ``projection_dim`` is taken from the top-level ``CLIPConfig``,
because the nested vision config does not carry it reliably. Text-tower keys in the checkpoint are
expected and ignored; any missing vision or projection key raises instead of being initialised at
random. Because the vision model returns ``image_embeds`` directly, the transformers 5.x change
that makes ``get_image_features`` return an output object (features in ``.pooler_output``) does
not reach this module.

Preprocessing, done in torch on the given tensors (no PIL round trip, no torchvision), with the
settings read from the checkpoint's ``preprocessor_config.json``. The steps follow transformers'
``CLIPImageProcessorPil`` (``PilBackend._preprocess``): resize so the shorter side is
``shortest_edge``, with the longer side ``int(shortest_edge * long / short)``; bicubic; center crop
with top = (H - crop_h) // 2 and left = (W - crop_w) // 2; (x - mean) / std.
Departures from that PIL path:
- interpolation is ``F.interpolate(mode="bicubic", antialias=True)``, which uses PIL's kernel
  (a = -0.5, support widened by the scale factor when shrinking). PIL computes on uint8 with
  rounding and clamping after each of its two separable passes; here it is float32 with a single
  clamp to [0, 1] at the end, so pixels differ by a few 1/255 at most.
- inputs are floats in [0, 1] and stay floats: there is no quantisation to uint8 and no
  ``rescale_factor`` step (the PIL path divides uint8 by 255). Values outside [0, 1], which a
  decoder can overshoot to, are clamped first; the PIL processor would reject them.
- only the CLIP settings are supported (resize by shortest edge, bicubic, center crop no larger
  than the resized short side, normalise); any other preprocessor config raises.

Identity for ``spec`` (cache keys): a Hugging Face cache snapshot is named by its repo and commit;
any other folder by a sha256 over its config, preprocessor config and safetensors files (this
reads the weights once: about 1.7 GB for ViT-L/14). A hub id is resolved to its snapshot with
``huggingface_hub.snapshot_download`` (safetensors and configs only), as ``from_pretrained``
would; ``ClipEmbedder.spec_for`` gives the spec without loading the model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import CLIPConfig, CLIPVisionConfig, CLIPVisionModelWithProjection

from cast_core.hub_snapshot import local_folder, snapshot_identity

PREPROCESSOR_FILE = "preprocessor_config.json"
PIL_BICUBIC = 3
IDENTITY_FILES = ("config.json", PREPROCESSOR_FILE, "*.safetensors", "*.safetensors.index.json")
DEFAULT_MODEL = "openai/clip-vit-large-patch14"


@dataclass(frozen=True)
class ClipPreprocess:
    """CLIP's resize / center-crop / normalise in torch (see the module docstring).

    shortest_edge: the shorter side after resizing; crop_height, crop_width: the center crop, each
    <= shortest_edge so it always fits; mean, std: per-channel RGB normalisation.
    """

    shortest_edge: int
    crop_height: int
    crop_width: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    def __post_init__(self) -> None:
        sides = (self.shortest_edge, self.crop_height, self.crop_width)
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sides):
            raise ValueError(f"shortest_edge and crop sides must be ints >= 1; got {sides}")
        if max(self.crop_height, self.crop_width) > self.shortest_edge:
            raise ValueError(
                f"the crop ({self.crop_height}x{self.crop_width}) must fit in the resized image, "
                f"whose short side is {self.shortest_edge}; use a crop no larger than size")
        if len(self.mean) != 3 or len(self.std) != 3 or not all(s > 0 for s in self.std):
            raise ValueError(f"mean and std need 3 RGB values, std > 0; got {self.mean}, {self.std}")

    @classmethod
    def from_config(cls, config: dict) -> ClipPreprocess:
        """From a saved CLIP ``preprocessor_config.json`` (sizes as ints or as dicts)."""
        flags = {k: config.get(k, True) for k in ("do_resize", "do_center_crop", "do_normalize",
                                                   "do_rescale")}
        if not all(flags.values()) or config.get("resample", PIL_BICUBIC) != PIL_BICUBIC:
            raise ValueError(
                f"only CLIP's own preprocessing is supported (resize, bicubic resample=3, center "
                f"crop, rescale, normalise); got {flags}, resample={config.get('resample')}")
        if abs(config.get("rescale_factor", 1 / 255) - 1 / 255) > 1e-9:
            raise ValueError(f"rescale_factor must be 1/255 (uint8 -> [0, 1]); got "
                             f"{config['rescale_factor']}")
        size, crop = config.get("size"), config.get("crop_size")
        size = size.get("shortest_edge") if isinstance(size, dict) else size
        crop = (crop.get("height"), crop.get("width")) if isinstance(crop, dict) else (crop, crop)
        if not isinstance(size, int) or not all(isinstance(c, int) for c in crop):
            raise ValueError(
                f"size must be an int or {{'shortest_edge': n}} and crop_size an int or "
                f"{{'height', 'width'}}; got size={config.get('size')}, crop_size={crop}")
        return cls(size, crop[0], crop[1], tuple(config["image_mean"]), tuple(config["image_std"]))

    @property
    def spec(self) -> str:
        return (f"resize=torch-bicubic-aa:{self.shortest_edge},"
                f"crop={self.crop_height}x{self.crop_width},mean={self.mean},std={self.std}")

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(H', W') after the shortest-edge resize, rounded down as transformers does."""
        short, long = min(height, width), max(height, width)
        new_long = int(self.shortest_edge * long / short)
        if width <= height:
            return new_long, self.shortest_edge
        return self.shortest_edge, new_long

    def __call__(self, images: Tensor) -> Tensor:
        """pixel_values [N, 3, crop_height, crop_width] float32 of images [N, 3, H, W] in [0, 1]."""
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(
                f"images must have shape [N, 3, H, W] (RGB in [0, 1]); got {tuple(images.shape)}")
        x = images.float().clamp(0.0, 1.0)
        size = self.resized_size(*x.shape[-2:])
        if tuple(x.shape[-2:]) != size:
            x = F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False)
            x = x.clamp(0.0, 1.0)  # [N, 3, H', W']
        top, left = (size[0] - self.crop_height) // 2, (size[1] - self.crop_width) // 2
        x = x[..., top:top + self.crop_height, left:left + self.crop_width]  # [N, 3, ch, cw]
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
        return (x - mean) / std


@dataclass(frozen=True)
class ClipCheckpoint:
    """A local checkpoint folder and its identity (``repo@commit`` or ``sha256:<16 hex>``)."""

    path: Path
    identity: str


def resolve_checkpoint(path_or_hub_id: str | Path) -> ClipCheckpoint:
    """The folder holding the checkpoint (a hub id is fetched/found in the HF cache) + identity."""
    path = local_folder(path_or_hub_id, IDENTITY_FILES)
    identity = snapshot_identity(path)
    if identity:
        return ClipCheckpoint(path, identity)
    return ClipCheckpoint(path, f"sha256:{_content_hash(path)[:16]}")


def _content_hash(folder: Path) -> str:
    """sha256 over (name, sha256 of bytes) of the folder's config, preprocessor and weight files."""
    files = sorted({p for pattern in IDENTITY_FILES for p in folder.glob(pattern) if p.is_file()})
    if not any(p.suffix == ".safetensors" for p in files):
        raise FileNotFoundError(f"{folder} holds no .safetensors weights; save with safetensors")
    lines = []
    for p in files:
        digest = hashlib.sha256()
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        lines.append(f"{p.name}\t{digest.hexdigest()}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _read_preprocess(folder: Path) -> ClipPreprocess:
    if not (folder / PREPROCESSOR_FILE).exists():
        raise FileNotFoundError(f"{folder} has no {PREPROCESSOR_FILE}; save the CLIP image "
                                "processor next to the model")
    return ClipPreprocess.from_config(json.loads((folder / PREPROCESSOR_FILE).read_text()))


def _vision_config(folder: Path) -> CLIPVisionConfig:
    """The vision config with the projection width of the checkpoint (CLIPModel or vision-only)."""
    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    if model_type == "clip":
        full = CLIPConfig.from_pretrained(folder)
        vision = full.vision_config
        vision.projection_dim = full.projection_dim
        return vision
    if model_type == "clip_vision_model":
        return CLIPVisionConfig.from_pretrained(folder)
    raise ValueError(f"{folder} is not a CLIP checkpoint: model_type {model_type!r}; expected "
                     "'clip' or 'clip_vision_model'")


class _VisionTower(CLIPVisionModelWithProjection):
    """CLIPVisionModelWithProjection that expects a full CLIPModel checkpoint's text keys."""

    _keys_to_ignore_on_load_unexpected: ClassVar[list[str]] = [
        r"^text_model\.", r"^text_projection\.", r"^logit_scale$"]


def _spec(identity: str, dtype: torch.dtype, preprocess: ClipPreprocess) -> str:
    dtype_name = str(dtype).removeprefix("torch.")
    return f"{ClipEmbedder.name}(model={identity},dtype={dtype_name},{preprocess.spec})"


@dataclass(frozen=True, eq=False)
class ClipEmbedder:
    """CLIP image embeddings e [N, D] (see the module docstring). Build with ``from_pretrained``.

    model: the vision tower with projection, in eval mode; preprocess: the torch preprocessing;
    identity: the checkpoint's identity for ``spec``; batch_size: images per forward pass.
    """

    name: ClassVar[str] = "clip-image-v1"
    model: CLIPVisionModelWithProjection
    preprocess: ClipPreprocess
    identity: str
    batch_size: int = 32

    def __post_init__(self) -> None:
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) \
                or self.batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1; got {self.batch_size!r}")

    @classmethod
    def from_pretrained(cls, path_or_hub_id: str | Path = DEFAULT_MODEL, device: str = "cpu",
                        torch_dtype: torch.dtype = torch.float32,
                        batch_size: int = 32) -> ClipEmbedder:
        """Load the vision tower + preprocessing settings of a CLIP checkpoint (safetensors only)."""
        checkpoint = resolve_checkpoint(path_or_hub_id)
        preprocess = _read_preprocess(checkpoint.path)
        model, info = _VisionTower.from_pretrained(
            checkpoint.path, config=_vision_config(checkpoint.path), dtype=torch_dtype,
            use_safetensors=True, output_loading_info=True)
        if info["missing_keys"] or info["mismatched_keys"]:
            raise ValueError(f"{checkpoint.path} lacks CLIP vision weights: missing "
                             f"{sorted(info['missing_keys'])[:5]}, mismatched "
                             f"{sorted(info['mismatched_keys'])[:5]}")
        model = model.to(device).eval().requires_grad_(False)
        return cls(model, preprocess, checkpoint.identity, batch_size)

    @staticmethod
    def spec_for(path_or_hub_id: str | Path = DEFAULT_MODEL,
                 torch_dtype: torch.dtype = torch.float32) -> str:
        """The ``spec`` that ``from_pretrained(path_or_hub_id, torch_dtype=...)`` would give,
        without loading the weights (for cache keys)."""
        checkpoint = resolve_checkpoint(path_or_hub_id)
        return _spec(checkpoint.identity, torch_dtype, _read_preprocess(checkpoint.path))

    @property
    def dim(self) -> int:
        """D, the projection width."""
        return int(self.model.config.projection_dim)

    @property
    def spec(self) -> str:
        """Name, checkpoint identity, dtype and preprocessing: what tells two embedders apart.
        Device and batch size are left out: they change results only by float rounding."""
        return _spec(self.identity, self.model.dtype, self.preprocess)

    @torch.no_grad()
    def embed(self, images: Tensor) -> Tensor:
        """Embeddings e [N, D] float32, unit L2 norm, of images [N, 3, H, W] in [0, 1], on the
        images' device; run in batches of ``batch_size``."""
        if len(images) == 0:
            return torch.zeros(0, self.dim, device=images.device)
        device, dtype = self.model.device, self.model.dtype
        out = [self.model(pixel_values=self.preprocess(chunk.to(device)).to(dtype)).image_embeds
               for chunk in images.split(self.batch_size)]  # each [n, D]
        return F.normalize(torch.cat(out).float(), dim=1).to(images.device)
