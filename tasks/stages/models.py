"""Loading what a recipe names: the backbone (with its LoRA policy), the scorer, the CSG builder;
and the policy / optimizer state as tensors for safetensors blobs.

The pipeline sees one protocol per kind; this module is the only place that
maps a recipe's `family` / `kind` strings to implementations, so adding a backbone or scorer is
one entry here. Policy state: the LoRA parameters by name (the trainable parameters after
`cast_core.lora.add_lora`), and AdamW's moments per parameter index with its param groups as JSON
metadata. LoRA's random init (PEFT draws A from torch's global generator) is seeded from the run
seed, so iteration 0 of two runs with the same seed starts from the same adapter.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cast_core.csg.geneval import graph_from_geneval
from cast_core.csg.graph import SceneGraph
from cast_core.hub_snapshot import model_identity
from cast_core.lora import add_lora
from tasks.stages.recipe import Recipe
from tasks.store.stage import derive_seed


def set_threads(recipe: Recipe) -> None:
    if recipe.run.threads:
        torch.set_num_threads(recipe.run.threads)


def load_base(recipe: Recipe):
    """The recipe's backbone with its base weights, in eval mode, on the recipe's device."""
    b = recipe.backbone
    if b.family == "shapes":
        from cast_core.backbones.shapes import ShapesBackbone

        return ShapesBackbone.from_pretrained(b.path).eval()
    dtype = getattr(torch, b.dtype)
    if b.family == "flux2":
        from cast_core.backbones.flux2 import Flux2Backbone

        backbone = Flux2Backbone.from_pretrained(
            b.path, torch_dtype=dtype, embedding_cache_dir=b.embedding_cache, height=b.height,
            width=b.width, max_sequence_length=b.max_sequence_length,
            text_encoder_out_layers=b.text_encoder_out_layers)
    elif b.family == "qwen_image":
        from cast_core.backbones.qwen_image import QwenImageBackbone

        backbone = QwenImageBackbone.from_pretrained(
            b.path, torch_dtype=dtype, embedding_cache_dir=b.embedding_cache, height=b.height,
            width=b.width, max_sequence_length=b.max_sequence_length,
            prompt_template_encode_start_idx=b.prompt_template_encode_start_idx)
    else:
        raise ValueError(f"backbone.family {b.family!r} has no loader; known: 'shapes', 'flux2', "
                         f"'qwen_image'")
    if b.gradient_checkpointing:
        backbone.enable_gradient_checkpointing()
    return backbone.to(b.device).eval()


def base_hash(recipe: Recipe) -> str:
    """Identity of the base weights (see `model_identity`)."""
    return model_identity(recipe.backbone.path)


def load_policy(recipe: Recipe, lora: dict[str, torch.Tensor] | None):
    """Backbone + LoRA adapter (seeded init), with saved LoRA weights loaded when given.
    Returns (backbone, lora parameters in named_parameters order)."""
    backbone = load_base(recipe)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(recipe.run.seed, "lora-init") % (2**63))
        params = add_lora(backbone, recipe.train.lora_rank, recipe.train.lora_alpha)
    if lora is not None:
        set_lora(backbone, lora)
    return backbone.eval(), params


def set_lora(backbone, lora: dict[str, torch.Tensor]) -> None:
    """Copy saved LoRA weights (by parameter name) into the backbone's adapter, in place."""
    named = {n: p for n, p in backbone.named_parameters() if p.requires_grad}
    if set(named) != set(lora):
        missing, extra = sorted(set(named) - set(lora)), sorted(set(lora) - set(named))
        raise ValueError(f"saved LoRA does not match the recipe's adapter (rank/targets?): "
                         f"missing {missing[:3]}..., unexpected {extra[:3]}...")
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(lora[name])


def lora_tensors(backbone) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backbone.named_parameters() if p.requires_grad}


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], str]:
    """AdamW state -> ({'<param index>.<name>': tensor}, param_groups JSON)."""
    state = optimizer.state_dict()
    tensors = {f"{idx}.{name}": torch.as_tensor(value).clone()
               for idx, entry in state["state"].items() for name, value in entry.items()}
    return tensors, json.dumps(state["param_groups"])


def load_optimizer_state(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor],
                         groups_json: str) -> None:
    state: dict[int, dict[str, Any]] = defaultdict(dict)
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        state[int(idx)][name] = value
    optimizer.load_state_dict({"state": dict(state), "param_groups": json.loads(groups_json)})


def graph_builder(recipe: Recipe) -> Callable[[dict], SceneGraph]:
    """The recipe's CSG builder as one callable record -> SceneGraph (built once per stage, so a
    local LLM loads once). The LLM builders cache accepted answers under `builder.cache_dir`."""
    b = recipe.builder
    if b.kind == "geneval-parser":
        return graph_from_geneval
    from cast_core.csg.llm import LlmCsgBuilder
    from cast_core.csg.llm_clients import ChatEndpointClient, LocalCausalLMClient
    from tasks.stages.csg_cache import CsgCache

    if b.kind == "llm-chat":
        api_key = None
        if b.api_key_env:
            if b.api_key_env not in os.environ:
                raise RuntimeError(f"builder.api_key_env names {b.api_key_env!r}, which is not "
                                   f"set; export it or remove api_key_env")
            api_key = os.environ[b.api_key_env]
        client = ChatEndpointClient(b.base_url, b.model, api_key, timeout_s=b.timeout_s,
                                    max_tokens=b.max_tokens)
    elif b.kind == "llm-local":
        client = LocalCausalLMClient(b.model, b.max_tokens, b.device)
    else:
        raise ValueError(f"builder.kind {b.kind!r} has no implementation")
    builder = LlmCsgBuilder(client, builder_id(recipe), b.max_tries, CsgCache(b.cache_dir))
    return lambda record: builder.build(record["prompt"], record.get("tag"))


def builder_id(recipe: Recipe) -> str:
    """The builder's identity in cache keys (model + template version for the LLM builders)."""
    b = recipe.builder
    if b.kind == "geneval-parser":
        return "geneval-parser-v1"
    from cast_core.csg.llm import TEMPLATE_VERSION

    model = b.model if b.kind == "llm-chat" else model_identity(b.model)
    return f"{b.kind}-{TEMPLATE_VERSION}({model})"


Scorer = Callable[[torch.Tensor, list[SceneGraph]], list[tuple[np.ndarray, np.ndarray]]]


def scorer(recipe: Recipe) -> tuple[str, Scorer]:
    """(scorer id, score(images [N, 3, H, W] in [0, 1], graphs) -> [(scores [A], heatmaps
    [A, h, w])]). Loads the model; use `scorer_id` for a cache key."""
    s = recipe.scorer
    if s.kind == "shapes-verifier":
        from cast_core.scorers.registry import load_scorer

        loaded = load_scorer("shapes-verifier")
        return loaded.scorer_id, loaded.score
    if s.kind == "soft-tifa":
        from cast_core.scorers.soft_tifa import SoftTifaScorer

        model = SoftTifaScorer.from_pretrained(s.path, _soft_tifa_config(recipe), device=s.device,
                                               torch_dtype=s.dtype)
        return scorer_id(recipe), model.score
    if s.kind == "remote":
        from cast_core.scorers.remote import RemoteScorer

        remote = RemoteScorer(s.url, timeout_s=s.timeout_s, retries=s.retries)
        return remote.scorer_id, remote.score
    raise ValueError(f"scorer.kind {s.kind!r} has no implementation")


def scorer_id(recipe: Recipe) -> str:
    """The scorer's identity without loading its model (a remote scorer is asked for its id)."""
    s = recipe.scorer
    if s.kind == "shapes-verifier":
        from cast_core.shapes.verifier import scorer_id as verifier_id

        return verifier_id()
    if s.kind == "soft-tifa":
        from cast_core.scorers.soft_tifa import scorer_id as soft_tifa_id

        return soft_tifa_id(model_identity(s.path), _soft_tifa_config(recipe))
    if s.kind == "remote":
        from cast_core.scorers.remote import RemoteScorer

        with RemoteScorer(s.url, timeout_s=s.timeout_s, retries=s.retries) as remote:
            return remote.scorer_id
    raise ValueError(f"scorer.kind {s.kind!r} has no implementation")


def _soft_tifa_config(recipe: Recipe):
    from cast_core.scorers.soft_tifa import SoftTifaConfig

    s = recipe.scorer
    return SoftTifaConfig(layers=s.layers, relative_attention=s.relative_attention,
                          max_pixels=s.max_pixels)
