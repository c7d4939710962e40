"""Loading what a recipe names: the backbone (with its LoRA policy), the scorer, the CSG builder;
and the policy / optimizer state as tensors for safetensors blobs.

The pipeline sees one protocol per kind (DESIGN.md section 5); this module is the only place that
maps a recipe's `family` / `kind` strings to implementations, so adding a backbone or scorer is
one entry here. Policy state: the LoRA parameters by name (the trainable parameters after
`policy.add_lora`), and AdamW's moments per parameter index with its param groups as JSON
metadata. LoRA's random init (PEFT draws A from torch's global generator) is seeded from the run
seed, so iteration 0 of two runs with the same seed starts from the same adapter.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cast_core.csg import SceneGraph
from cast_core.csg_parser import graph_from_geneval
from cast_core.policy import add_lora
from tasks.recipe import Recipe
from tasks.stage import derive_seed, tree_hash


def set_threads(recipe: Recipe) -> None:
    if recipe.run.threads:
        torch.set_num_threads(recipe.run.threads)


def load_base(recipe: Recipe):
    """The recipe's backbone with its base weights, in eval mode."""
    if recipe.backbone.family == "shapes":
        from cast_core.backbones.shapes import ShapesBackbone

        return ShapesBackbone.from_pretrained(recipe.backbone.path).eval()
    raise ValueError(f"backbone.family {recipe.backbone.family!r} has no loader; known: 'shapes'")


def base_hash(recipe: Recipe) -> str:
    """Content hash of the base weights folder."""
    return tree_hash(recipe.backbone.path)


def load_policy(recipe: Recipe, lora: dict[str, torch.Tensor] | None):
    """Backbone + LoRA adapter (seeded init), with saved LoRA weights loaded when given.
    Returns (backbone, lora parameters in named_parameters order)."""
    backbone = load_base(recipe)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(recipe.run.seed, "lora-init") % (2**63))
        params = add_lora(backbone, recipe.train.lora_rank, recipe.train.lora_alpha)
    if lora is not None:
        named = {n: p for n, p in backbone.named_parameters() if p.requires_grad}
        if set(named) != set(lora):
            missing, extra = sorted(set(named) - set(lora)), sorted(set(lora) - set(named))
            raise ValueError(f"saved LoRA does not match the recipe's adapter (rank/targets?): "
                             f"missing {missing[:3]}..., unexpected {extra[:3]}...")
        with torch.no_grad():
            for name, p in named.items():
                p.copy_(lora[name])
    return backbone.eval(), params


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


def build_graph(recipe: Recipe, record: dict) -> SceneGraph:
    """One prompt record -> its CSG with the recipe's builder."""
    if recipe.builder.kind == "geneval-parser":
        return graph_from_geneval(record)
    raise ValueError(f"builder.kind {recipe.builder.kind!r} has no implementation")


def builder_id(recipe: Recipe) -> str:
    return f"{recipe.builder.kind}-v1"


Scorer = Callable[[torch.Tensor, list[SceneGraph]], list[tuple[np.ndarray, np.ndarray]]]


def scorer(recipe: Recipe) -> tuple[str, Scorer]:
    """(scorer id, score(images [N, 3, H, W] in [0, 1], graphs) -> [(scores [A], heatmaps
    [A, h, w])])."""
    if recipe.scorer.kind == "shapes-verifier":
        from cast_core.shapes.verifier import VerifierConfig, verify

        config = VerifierConfig()

        def score(images: torch.Tensor, graphs: list[SceneGraph]):
            return [(s.scores, s.heatmaps) for s in verify(images, graphs, config)]

        return f"shapes-verifier-v1({config})", score
    raise ValueError(f"scorer.kind {recipe.scorer.kind!r} has no implementation")
