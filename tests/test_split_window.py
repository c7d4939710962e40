"""`advantage.scalar_steps` in the trainer: the window's first steps take Flow-GRPO's scalar
advantage, the rest CAST's map (`cast_core.pixel_map.split_step_maps`). On a copy of the reference
store: with every window step scalar, the trained LoRA is the scalar kind's (inside each sample's
all-dims ratio a constant map is exactly Flow-GRPO's loss); with one scalar step it is neither
the scalar kind's nor CAST's."""

import shutil

import pytest
import torch
from pipeline_helpers import ci_recipe, reference, run_iteration

from tasks.store.store import Store

SAMPLE_RATIO = {"train.map_ratio": "sample", "train.clip_range": 1e-3}


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return reference(tmp_path_factory)


def _lora(ref, tmp_path, name: str, **overrides) -> dict[str, torch.Tensor]:
    """The LoRA that iteration 0 trains on a copy of the reference store's rollouts."""
    store = Store(tmp_path / name)
    shutil.copytree(ref[0].root, store.root)
    refs = run_iteration(store, ci_recipe(ref[2], **SAMPLE_RATIO, **overrides), 0)
    assert refs["rollout"].skipped and not refs["train_epoch"].skipped  # same rollouts
    row = store.read_table("checkpoints", {"iteration": 0}).to_pylist()[0]
    return store.get_tensors(row["lora_path"])


def test_scalar_steps_train_the_first_window_steps_as_flow_grpo(ref, tmp_path):
    k = ref[1].window.size
    scalar = _lora(ref, tmp_path, "scalar", **{"advantage.kind": "scalar"})
    every = _lora(ref, tmp_path, "every", **{"advantage.scalar_steps": k})
    for name in scalar:
        torch.testing.assert_close(every[name], scalar[name], atol=1e-6, rtol=1e-5)
    cast = _lora(ref, tmp_path, "cast")
    split = _lora(ref, tmp_path, "split", **{"advantage.scalar_steps": 1})
    for other in (scalar, cast):
        gap = max(float((split[n] - other[n]).abs().max()) for n in other)
        assert gap > 1e-4, gap
