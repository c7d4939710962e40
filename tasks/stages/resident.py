"""A policy kept in memory across stages and iterations: the backbone is loaded once, and only
the LoRA adapter's weights are swapped when the policy hash changes.

What the Ray executor's policy actors hold (`tasks.stages.ray_workers`); the local executor loads
the policy afresh in each stage (`policy_state.load_policy_of`). The two give the same weights:
the base is loaded by the same `models.load_policy` (its LoRA seeded from the run seed), and a
policy's adapter weights are those of its LoRA blob, or the fresh adapter's at iteration 0. After
a training on the held weights, `trained` names the new policy, so the next iteration's rollout
on the same actor reloads nothing; a training that failed leaves weights of no known policy
(`forget`), reloaded from the store on the next call. The window calibration runs the held
backbone with its adapter off (`base`): the base model, whichever policy the adapter holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from tasks.stages.models import load_policy, lora_tensors, set_lora
from tasks.stages.policy_state import PolicyState, base_policy
from tasks.stages.recipe import Recipe
from tasks.store.store import Store


@dataclass
class Loads:
    """How often the backbone was read from disk and the adapter weights swapped."""

    backbone: int = 0
    lora: int = 0


@dataclass
class ResidentPolicy:
    """The held backbone, its LoRA parameters and which policy they are (None: none known)."""

    backbone: object = None
    params: list[torch.Tensor] = field(default_factory=list)
    policy_hash: str | None = None
    loads: Loads = field(default_factory=Loads)
    _base_key: str | None = None
    _fresh_lora: dict[str, torch.Tensor] = field(default_factory=dict)

    def get(self, store: Store, recipe: Recipe, policy: PolicyState):
        """(backbone, LoRA parameters) of `policy`, loading only what differs from what is held."""
        self._load_base(recipe)
        if policy.policy_hash != self.policy_hash:
            lora = store.get_tensors(policy.lora_path) if policy.lora_path else self._fresh_lora
            set_lora(self.backbone, lora)
            self.policy_hash = policy.policy_hash
            self.loads.lora += 1
        for p in self.params:
            p.grad = None
        return self.backbone.eval(), self.params

    def base(self, recipe: Recipe):
        """The held backbone, whatever policy its adapter holds (loaded if none is held): run it
        inside `cast_core.lora.reference_mode` for the base model (`models.load_base`)."""
        self._load_base(recipe)
        return self.backbone.eval()

    def _load_base(self, recipe: Recipe) -> None:
        """Load the backbone with the fresh adapter (iteration 0's policy) unless held."""
        key = _base_key(recipe)
        if key != self._base_key:
            self.backbone, self.params = load_policy(recipe, None)
            self._fresh_lora = lora_tensors(self.backbone)
            self._base_key, self.policy_hash = key, base_policy(recipe).policy_hash
            self.loads.backbone += 1

    def trained(self, policy_hash: str) -> None:
        """The held weights are now those of `policy_hash` (a training finished on them)."""
        self.policy_hash = policy_hash

    def forget(self) -> None:
        """The held adapter is no known policy (a training on it failed part-way)."""
        self.policy_hash = None


def _base_key(recipe: Recipe) -> str:
    """What the loaded base and fresh adapter depend on: the backbone section, the adapter's
    shape and the run seed (its init)."""
    tr = recipe.train
    return json.dumps([recipe.backbone.model_dump(mode="json"), tr.lora_rank, tr.lora_alpha,
                       recipe.run.seed], sort_keys=True)
