"""Soft-TIFA atom scores and attention grounding heatmaps from Qwen3-VL (transformers, eager).

Score (Soft-TIFA, as in GenEval 2): the VLM is asked each atom's question about the image; the
score is the probability, in the next-token distribution right after the chat template's assistant
prefix (thinking disabled), of the accepted forms of the expected answer's FIRST token:
- yes/no atoms: the yes forms ("Yes", "yes", "YES", with and without a leading space);
- count atoms (answer = digit string n): the digit and number-word forms of n ("3", "three",
  "Three", with and without a leading space).
The question is the atom's own text, written by `cast_core.csg.questions` with one form per atom
kind (object, count, colour/size/shape/state, material "made of", pattern, texture, relation), so
every kind is asked with the yes/no instruction except counts. Forms are configurable; token-id
sets are built once from the tokenizer and forms that are not a single token are skipped (Qwen's
tokenizer splits "10" into "1", "0": count 10 is then read from "ten"/"Ten" only; a count with no
single-token form at all is a construction error).
`normalize=True` divides by the mass of all answers of the atom's kind (yes + no forms; every
count's forms). Off by default, which is GenEval 2's raw probability: an instruction-tuned VLM
given the answer instruction puts nearly all its mass on the answer forms, so the two agree when
the model follows it; when it does not, the raw score counts the off-format mass as "not yes",
while normalising would blow tiny, noisy yes/no masses up to confident scores.

Batching: all atoms of an image go in one forward, one sequence per atom with the image repeated
(left-padded, so the last position predicts the answer; logits only there). Each row is exactly
the single-atom query, with M-RoPE positions computed by transformers per row, so batching cannot
change a score. A shared-prefix KV cache would save re-encoding the image per row (the vision
tower is a small part of an 8B forward) at the price of cache surgery and M-RoPE continuation
that move between transformers releases.

Heatmap: the text layers' eager attention weights from the answer-predicting position to the
image's merged tokens, averaged over the chosen layers (default middle-to-late: L//2 .. 3L//4) and
heads, normalised to sum 1, reshaped to the row-major merged-token grid (grid_thw[1:] / merge),
optionally made relative (divided by the map of a generic prompt on the same image plus eps,
renormalised: "MLLMs know where to look", Zhang et al. 2025), upsampled to the input H x W
(bilinear, align_corners=False, or nearest) and renormalised to sum 1 over pixels. Weights are read
by forward hooks on the chosen layers' attention modules, so only [B, heads, L] rows are kept;
attention needs `attn_implementation="eager"` (sdpa returns no weights).

Images are resized to the pixel budget by `Qwen2VLImageProcessorPil`; no torchvision anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from cast_core.csg.graph import Atom, SceneGraph
from cast_core.scorers.soft_tifa_inputs import (
    ImageInputs,
    count_forms,
    encode_prompts,
    preprocess_image,
    processor_chat_template,
    render_prompt,
    single_token_ids,
)

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten")
_PLACEHOLDERS = ("{digit}", "{word}", "{Word}")


@dataclass(frozen=True)
class SoftTifaConfig:
    """layers/heads: text-layer and head indices whose attention makes the heatmap (None: layers
    L//2 .. 3L//4, all heads; checked against the model when the scorer is built). count_forms
    are templates over {digit}, {word}, {Word}; number_words[n] is the word for count n.
    min/max_pixels: the image budget (None: the image processor's own)."""

    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    yes_forms: tuple[str, ...] = ("Yes", "yes", "YES", " Yes", " yes", " YES")
    no_forms: tuple[str, ...] = ("No", "no", "NO", " No", " no", " NO")
    count_forms: tuple[str, ...] = ("{digit}", "{word}", "{Word}", " {digit}", " {word}",
                                    " {Word}")
    number_words: tuple[str, ...] = NUMBER_WORDS
    normalize: bool = False
    yes_no_instruction: str = "Please answer yes or no."
    count_instruction: str = "Please answer with a number."
    relative_attention: bool = False
    generic_prompt: str = "Write a general description of the image."
    relative_eps: float = 1e-4
    upsample: Literal["bilinear", "nearest"] = "bilinear"
    min_pixels: int | None = None
    max_pixels: int | None = None

    def __post_init__(self):
        for name in ("layers", "heads"):
            idx = getattr(self, name)
            if idx is not None and (not idx or min(idx) < 0 or len(set(idx)) != len(idx)):
                raise ValueError(f"{name} must be distinct non-negative indices: got {idx}; "
                                 f"list each index once, or None for the default")
        for name in ("yes_forms", "no_forms", "count_forms", "number_words"):
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty; give at least one form")
        bad = [t for t in self.count_forms if not any(p in t for p in _PLACEHOLDERS)]
        if bad:
            raise ValueError(f"count_forms {bad} name no placeholder; use {_PLACEHOLDERS}")
        if self.upsample not in ("bilinear", "nearest"):
            raise ValueError(f"upsample must be 'bilinear' or 'nearest': got {self.upsample!r}")
        if not self.relative_eps > 0:
            raise ValueError(f"relative_eps must be > 0: got {self.relative_eps}")
        if self.relative_attention and not self.generic_prompt.strip():
            raise ValueError("relative_attention needs a generic_prompt; set one or turn it off")
        if self.min_pixels is not None and self.min_pixels < 1:
            raise ValueError(f"min_pixels must be >= 1: got {self.min_pixels}")
        if None not in (self.min_pixels, self.max_pixels) and self.max_pixels < self.min_pixels:
            raise ValueError(f"max_pixels ({self.max_pixels}) must be >= min_pixels "
                             f"({self.min_pixels}); raise max_pixels or lower min_pixels")


VERSION = "soft-tifa-v1"


def scorer_id(model: str, config: SoftTifaConfig) -> str:
    """What score caches key on: the version, the model's content identity
    (`cast_core.hub_snapshot.model_identity` of its folder or hub id) and the config."""
    return f"{VERSION}({model}, {config})"


class SoftTifaScores(NamedTuple):
    """One image: scores [A] float32 in [0, 1]; heatmaps [A, H, W] float32, each summing to 1."""

    scores: np.ndarray
    heatmaps: np.ndarray


@dataclass(frozen=True)
class AnswerIds:
    """Single-token ids of the accepted forms: yes, no, and counts[n] for n = 0 .. len - 1."""

    yes: tuple[int, ...]
    no: tuple[int, ...]
    counts: tuple[tuple[int, ...], ...]

    @classmethod
    def build(cls, tokenizer, config: SoftTifaConfig) -> AnswerIds:
        yes, no = (single_token_ids(tokenizer, f) for f in (config.yes_forms, config.no_forms))
        counts = tuple(single_token_ids(tokenizer, count_forms(config.count_forms, n, w))
                       for n, w in enumerate(config.number_words))
        empty = [str(n) for n, ids in enumerate(counts) if not ids]
        empty += [k for k, ids in (("yes", yes), ("no", no)) if not ids]
        if empty:
            raise ValueError(f"answers {empty} have no accepted form that is a single token of "
                             f"this tokenizer; add forms that are (config *_forms)")
        return cls(yes, no, counts)

    def accepted(self, atom: Atom) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(ids of the expected answer, ids of every answer of the atom's kind)."""
        if atom.answer in ("yes", "no"):
            return (self.yes if atom.answer == "yes" else self.no), self.yes + self.no
        if atom.answer.isdigit() and int(atom.answer) < len(self.counts):
            return self.counts[int(atom.answer)], tuple(i for c in self.counts for i in c)
        raise ValueError(f"atom {atom.id!r} expects {atom.answer!r}: answers must be 'yes', "
                         f"'no' or a count 0..{len(self.counts) - 1}; extend number_words")


def resolve_indices(given: tuple[int, ...] | None, default: range, size: int,
                    name: str) -> tuple[int, ...]:
    """Check layer/head indices against the model's `size`; None gives `default`."""
    indices = tuple(default) if given is None else given
    bad = [i for i in indices if i >= size]
    if bad:
        raise ValueError(f"{name} {bad} out of range: this model has {size} {name}, valid "
                         f"indices are 0..{size - 1}")
    return indices


def relative_map(maps: torch.Tensor, generic: torch.Tensor, eps: float) -> torch.Tensor:
    """maps [A, n], generic [n] (each summing to 1) -> maps / (generic + eps), renormalised."""
    ratio = maps / (generic + eps)  # [A, n]
    return ratio / ratio.sum(-1, keepdim=True)


def pixel_heatmaps(maps: torch.Tensor, token_grid: tuple[int, int], size: tuple[int, int],
                   mode: str) -> torch.Tensor:
    """maps [A, n] over the row-major token grid (n = rows * cols) -> [A, H, W] summing to 1."""
    grid = maps.reshape(len(maps), 1, *token_grid)  # [A, 1, rows, cols]
    kwargs = {"align_corners": False} if mode == "bilinear" else {}
    pixels = F.interpolate(grid, size=size, mode=mode, **kwargs)[:, 0].clamp_min(0)  # [A, H, W]
    return pixels / pixels.sum((-2, -1), keepdim=True)


class SoftTifaScorer:
    """score(images [N, 3, H, W] in [0, 1], graphs) -> [SoftTifaScores] (the scorer protocol)."""

    def __init__(self, model, tokenizer, image_processor, config: SoftTifaConfig):
        text = model.config.text_config
        if text._attn_implementation != "eager":
            raise ValueError(f"attention maps need eager attention, the model uses "
                             f"{text._attn_implementation!r}; load it with "
                             f"attn_implementation='eager'")
        n = text.num_hidden_layers
        self.layers = resolve_indices(config.layers, range(n // 2, 3 * n // 4 + 1), n, "layers")
        heads = text.num_attention_heads
        self.heads = resolve_indices(config.heads, range(heads), heads, "heads")
        self.model, self.tokenizer, self.image_processor = model.eval(), tokenizer, image_processor
        self.config = config
        self.answer_ids = AnswerIds.build(tokenizer, config)

    @classmethod
    def from_pretrained(cls, path: str, config: SoftTifaConfig = SoftTifaConfig(),
                        device: str | torch.device = "cpu",
                        torch_dtype: torch.dtype | str | None = None) -> SoftTifaScorer:
        """Qwen3-VL model, tokenizer (with its chat template) and image processor from one local
        path or hub id; torch_dtype None keeps the checkpoint's dtype."""
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        dtype = getattr(torch, torch_dtype) if isinstance(torch_dtype, str) else torch_dtype
        kwargs = {"dtype": dtype} if dtype is not None else {}
        model = Qwen3VLForConditionalGeneration.from_pretrained(
            path, attn_implementation="eager", device_map=device, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizer.chat_template = tokenizer.chat_template or processor_chat_template(path)
        if tokenizer.chat_template is None:
            raise ValueError(f"no chat template at {path!r} (tokenizer or chat_template.json); "
                             f"save the model's template with it")
        return cls(model, tokenizer, Qwen2VLImageProcessorPil.from_pretrained(path), config)

    def score(self, images: torch.Tensor, graphs: list[SceneGraph]) -> list[SoftTifaScores]:
        if len(images) != len(graphs):
            raise ValueError(f"one graph per image: got {len(images)} images, {len(graphs)} graphs")
        return [self.score_image(image, graph.atoms()) for image, graph in zip(images, graphs)]

    def prompts(self, atoms: tuple[Atom, ...]) -> list[str]:
        """Rendered chat prompts, one per atom (question + answer instruction), then the generic
        prompt when relative attention is on."""
        instruction = {"count": self.config.count_instruction}
        texts = [f"{a.question} {instruction.get(a.type, self.config.yes_no_instruction)}".strip()
                 for a in atoms]
        if self.config.relative_attention:
            texts.append(self.config.generic_prompt)
        return [render_prompt(self.tokenizer, t) for t in texts]

    @torch.no_grad()
    def score_image(self, image: torch.Tensor, atoms: tuple[Atom, ...]) -> SoftTifaScores:
        """image [3, H, W] in [0, 1], A atoms -> SoftTifaScores (scores [A], heatmaps [A, H, W])."""
        if not atoms:
            return SoftTifaScores(np.zeros(0, np.float32),
                                  np.zeros((0, *image.shape[-2:]), np.float32))
        inputs = preprocess_image(self.image_processor, image, self.config.min_pixels,
                                  self.config.max_pixels)
        probs, maps = self.forward(inputs, self.prompts(atoms))  # [B, V], [B, n]
        scores = self.answer_scores(probs[: len(atoms)], atoms)
        if self.config.relative_attention:
            maps = relative_map(maps[: len(atoms)], maps[-1], self.config.relative_eps)
        heatmaps = pixel_heatmaps(maps, inputs.token_grid, tuple(image.shape[-2:]),
                                  self.config.upsample)
        return SoftTifaScores(scores, heatmaps.cpu().numpy().astype(np.float32))

    def answer_scores(self, probs: torch.Tensor, atoms: tuple[Atom, ...]) -> np.ndarray:
        """probs [A, V] next-token probabilities -> scores [A] float32 in [0, 1]."""
        scores = []
        for p, atom in zip(probs, atoms):
            accepted, every = self.answer_ids.accepted(atom)
            mass = p[list(accepted)].sum()
            if self.config.normalize:
                mass = mass / p[list(every)].sum().clamp_min(1e-12)
            scores.append(float(mass.clamp(0.0, 1.0)))
        return np.asarray(scores, dtype=np.float32)

    def forward(self, inputs: ImageInputs, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of B prompts on one image -> (next-token probabilities [B, V] float32 at
        the last position, attention maps [B, n] over the image tokens, each summing to 1)."""
        batch = encode_prompts(self.tokenizer, prompts, inputs.n_tokens,
                               self.model.config.image_token_id)
        device, rows = self.model.device, len(prompts)
        captured: dict[int, torch.Tensor] = {}
        hooks = [self.model.model.language_model.layers[i].self_attn.register_forward_hook(
            _capture_last_row(captured, i)) for i in self.layers]
        try:
            out = self.model(
                input_ids=batch.input_ids.to(device),
                attention_mask=batch.attention_mask.to(device),
                mm_token_type_ids=batch.mm_token_type_ids.to(device),
                pixel_values=inputs.pixel_values.repeat(rows, 1).to(device),
                image_grid_thw=inputs.grid_thw[None].repeat(rows, 1).to(device),
                logits_to_keep=1, use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
        probs = out.logits[:, -1].float().softmax(-1)  # [B, V]
        attn = torch.stack([captured[i] for i in self.layers])  # [layers, B, heads, L]
        attn = attn[:, :, list(self.heads)].mean((0, 2))  # [B, L]
        maps = attn[batch.image_mask.to(device)].reshape(rows, inputs.n_tokens)  # [B, n]
        return probs, maps / maps.sum(-1, keepdim=True).clamp_min(1e-12)


def _capture_last_row(store: dict[int, torch.Tensor], layer: int):
    """Forward hook keeping the last query position's attention [B, heads, L] of one layer."""
    def hook(module, args, output):
        weights = output[1]
        if weights is None:
            raise RuntimeError("the attention module returned no weights; load the model with "
                               "attn_implementation='eager'")
        store[layer] = weights[:, :, -1, :].to(torch.float32, copy=True)  # [B, heads, L]
    return hook
