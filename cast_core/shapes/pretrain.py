"""Pre-training of the embedded backbone from scratch on rendered scenes (rectified flow).

Each step draws a batch of train-split prompt records (tag-balanced: a tag uniformly, or with the
relative `tag_weights` given, then a prompt of that tag), renders a fresh random scene for each,
and regresses the velocity v = eps - x0 at x_t = (1 - t) x0 + t eps, with t from a
logit-normal(0, 1) (SD3's choice) mixed with 20% uniform so the high-noise steps where layout forms
are trained too. 10% of prompts are replaced by the empty
prompt so classifier-free guidance works. AdamW with linear warm-up and cosine decay; an EMA of
the weights is what gets saved. Data and noise at step k depend only on (seed, k), so a resumed run
sees the same batches as an uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from cast_core.shapes.render import render, sample_scene


class FlowModel(Protocol):
    """What pre-training (and `cast_core.shapes.sensitivity`) needs of a model: the shapes
    backbone, `cast_core.backbones.shapes.ShapesBackbone`. Typed by its members, so that the shapes
    world does not import its backbone adapter (which imports the world)."""

    def encode_prompts(self, prompts: list[str]) -> Any: ...

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, cond: Any) -> torch.Tensor: ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...


@dataclass(frozen=True)
class PretrainConfig:
    steps: int = 8000
    batch_size: int = 64
    lr: float = 6e-4
    warmup_steps: int = 300
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    cfg_dropout: float = 0.1
    uniform_t_fraction: float = 0.2
    t_shift: float = 1.0
    ema_decay: float = 0.999
    seed: int = 0
    tag_weights: tuple[tuple[str, float], ...] = ()  # (tag, relative weight); unnamed tags get 1

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps and batch_size must be >= 1: got {self.steps}, {self.batch_size}")
        if not 0.0 <= self.cfg_dropout < 1.0:
            raise ValueError(f"cfg_dropout must be in [0, 1): got {self.cfg_dropout}")
        if not self.t_shift > 0:
            raise ValueError(f"t_shift must be > 0 (1 = no shift): got {self.t_shift}")
        if not 0.0 < self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1): got {self.ema_decay}")
        bad = [(tag, w) for tag, w in self.tag_weights if not (w >= 0 and math.isfinite(w))]
        if bad:
            raise ValueError(f"tag_weights must be finite and >= 0: got {bad}")

    def lr_at(self, step: int) -> float:
        """Learning rate at a step: linear warm-up, then cosine down to min_lr_ratio * lr."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)


@dataclass(frozen=True)
class Batch:
    """x0: images in [-1, 1] [B, 3, H, W]; prompts: B strings (empty for CFG dropout)."""

    x0: torch.Tensor
    prompts: list[str]


def tag_probabilities(tags: list[str], config: PretrainConfig) -> np.ndarray | None:
    """Probabilities [len(tags)] of drawing each tag, or None for uniform (no tag_weights).

    Raises ValueError when a weighted tag is not among `tags` (a typo would silently do nothing)
    or when every weight is 0."""
    if not config.tag_weights:
        return None
    weights = dict(config.tag_weights)
    unknown = sorted(set(weights) - set(tags))
    if unknown:
        raise ValueError(f"tag_weights name tags that the train file does not have: {unknown}; "
                         f"its tags are {sorted(tags)}")
    w = np.array([weights.get(tag, 1.0) for tag in tags], dtype=np.float64)
    if w.sum() <= 0:
        raise ValueError("tag_weights give every tag weight 0; at least one must be positive")
    return w / w.sum()


def make_batch(records_by_tag: dict[str, list[dict]], config: PretrainConfig, step: int) -> Batch:
    """The batch of step `step`: tag-balanced records, one fresh scene each (see module doc)."""
    rng = np.random.default_rng([config.seed, step])
    tags = sorted(records_by_tag)
    p = tag_probabilities(tags, config)
    images, prompts = [], []
    for _ in range(config.batch_size):
        tag = tags[int(rng.integers(len(tags)))] if p is None else tags[int(rng.choice(len(tags), p=p))]
        pool = records_by_tag[tag]
        record = pool[int(rng.integers(len(pool)))]
        images.append(render(sample_scene(record, rng)).image)
        prompts.append("" if rng.random() < config.cfg_dropout else record["prompt"])
    x0 = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    return Batch(x0=x0, prompts=prompts)


def sample_t(batch_size: int, uniform_fraction: float, generator: torch.Generator,
             shift: float = 1.0) -> torch.Tensor:
    """Training times [B] in (0, 1): logit-normal(0, 1) mixed with uniform, then the SD3 time
    shift t' = shift t / (1 + (shift - 1) t) (shift > 1 moves mass to high noise)."""
    logit_normal = torch.sigmoid(torch.randn(batch_size, generator=generator))
    uniform = torch.rand(batch_size, generator=generator)
    pick = torch.rand(batch_size, generator=generator) < uniform_fraction
    t = torch.where(pick, uniform, logit_normal)
    return (shift * t / (1 + (shift - 1) * t)).clamp(1e-4, 1 - 1e-4)


def flow_matching_loss(model: FlowModel, batch: Batch, t: torch.Tensor,
                       eps: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the predicted velocity against v = eps - x0 at x_t."""
    t4 = t.view(-1, 1, 1, 1)
    x_t = (1.0 - t4) * batch.x0 + t4 * eps
    v_hat = model.velocity(x_t, t, model.encode_prompts(batch.prompts))
    return torch.nn.functional.mse_loss(v_hat, eps - batch.x0)


def train_step(model: FlowModel, optimizer: torch.optim.Optimizer, batch: Batch,
               config: PretrainConfig, step: int) -> tuple[float, float]:
    """One optimisation step; returns (loss, grad norm)."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    t = sample_t(batch.x0.shape[0], config.uniform_t_fraction, generator, config.t_shift)
    eps = torch.randn(batch.x0.shape, generator=generator)
    for group in optimizer.param_groups:
        group["lr"] = config.lr_at(step)
    loss = flow_matching_loss(model, batch, t, eps)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    return float(loss.detach()), float(grad_norm)


@torch.no_grad()
def ema_update(ema: FlowModel, model: FlowModel, decay: float) -> None:
    for p_ema, p in zip(ema.parameters(), model.parameters(), strict=True):
        p_ema.lerp_(p.detach(), 1.0 - decay)


def make_optimizer(model: FlowModel, config: PretrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.99),
                             weight_decay=config.weight_decay)
