"""ReCAST in the trainer: per-type, per-step weights on CAST's map (`recast.weighting`).

Closed forms: unit weights give CAST's map; a uniform kernel gives exactly the static weighting;
the training weights keep W's marginals (rows average to lambda_k / mean(lambda), columns sum to
the number of rewards) and put a reward's weight where it is informative. Stages: on a copy of the
reference store, static weighting at equal budgets trains the same LoRA as CAST, ReCAST runs its
gain stage, records its weights and trains a different LoRA, and re-estimates W only every
`recast.every` iterations (iteration 1 reuses iteration 0's gains). Under NFT: unit weights train
CAST's NFT LoRA, and ReCAST weights the schedule steps the forward-noise draws reach."""

import json
import shutil

import pytest
import torch
from pipeline_helpers import ci_recipe, reference, run_iteration

from cast_core.credit import mean_normalise, recast_weights
from cast_core.pixel_map import grouped_advantage_maps, pixel_advantage_map, step_weighted_maps
from cast_core.recast_gains import (
    ATOM_TYPES,
    RecastGains,
    restrict_to_window,
    static_weights,
    training_weights,
)
from tasks.stages.recast_gains import gains_for_training
from tasks.stages.recipe import RecipeError, load_recipe
from tasks.store.store import Store

SMALL_GAINS = {"recast.prompts": 8, "recast.samples_per_prompt": 2}


def _gains(gains: torch.Tensor, budgets: dict[str, float], tau: float = 1.0) -> RecastGains:
    """A RecastGains over S steps from raw gains [R, S] (divergence unused by the trainer)."""
    lam = torch.tensor(list(budgets.values()), dtype=torch.float64)
    plan = recast_weights(mean_normalise(gains), lam, tau)
    r, s = gains.shape
    return RecastGains(tuple(budgets), torch.linspace(1.0, 0.1, s, dtype=torch.float64), gains,
                       gains, mean_normalise(gains), plan.W, torch.full((r,), 8),
                       torch.full((r,), 8), lam, 0.5, tau)


def _random_maps(seed: int = 0, n: int = 3, a: int = 5, size: int = 8):
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(n, a, generator=g) * 2.0
    heat = torch.rand(n, a, size, size, generator=g) ** 4
    mask = torch.ones(n, a, dtype=torch.bool)
    mask[0, 3:] = False
    types = torch.randint(0, 4, (n, a), generator=g)
    return adv, heat, mask, types


@pytest.mark.parametrize("clip", [0.5, 100.0])
def test_unit_weights_give_the_cast_map_at_every_step(clip):
    adv, heat, mask, types = _random_maps()
    cast = pixel_advantage_map(adv, heat, mask, 1.0, clip).map  # [N, H, W]
    shares = grouped_advantage_maps(adv, heat, mask, types, 4, 1.0)  # [N, 4, H, W]
    maps = step_weighted_maps(shares, torch.ones(4, 3, dtype=torch.float64), clip)
    assert maps.shape == (3, 3, 8, 8)
    for k in range(3):
        torch.testing.assert_close(maps[:, k], cast, atol=1e-5, rtol=1e-5)


def test_each_step_takes_its_own_weighted_sum_of_the_shares():
    adv, heat, mask, types = _random_maps(1)
    shares = grouped_advantage_maps(adv, heat, mask, types, 4, 1.0)
    weights = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.5, 0.0], [0.0, 0.0]], dtype=torch.float64)
    maps = step_weighted_maps(shares, weights, clip=1e6)
    torch.testing.assert_close(maps[:, 0], shares[:, 0] + 0.5 * shares[:, 2])
    torch.testing.assert_close(maps[:, 1], 2.0 * shares[:, 1])
    with pytest.raises(ValueError, match=r"same T"):
        step_weighted_maps(shares, weights[:3], clip=1.0)
    with pytest.raises(ValueError, match="finite"):
        step_weighted_maps(shares, weights * float("nan"), clip=1.0)


def test_a_uniform_kernel_gives_exactly_the_static_weighting():
    budgets = {"object": 2.0, "count": 1.0, "relation": 1.0}
    flat = _gains(torch.full((3, 6), 0.7, dtype=torch.float64), budgets)
    window = restrict_to_window(flat, 2, 5)
    got = training_weights(window)
    want = static_weights(budgets, 3)
    assert got.shape == want.shape == (4, 3)
    torch.testing.assert_close(got, want, atol=1e-9, rtol=0)
    # lambda / mean(lambda): object 1.5, count 0.75, attribute (no budget) 0, relation 0.75
    torch.testing.assert_close(want[:, 0], torch.tensor([1.5, 0.75, 0.0, 0.75],
                                                        dtype=torch.float64))


def test_equal_budgets_at_a_uniform_kernel_weight_every_type_one():
    flat = _gains(torch.ones(4, 5, dtype=torch.float64), dict.fromkeys(ATOM_TYPES, 0.25))
    torch.testing.assert_close(training_weights(flat), torch.ones(4, 5, dtype=torch.float64),
                               atol=1e-9, rtol=0)


def test_training_weights_keep_the_marginals_and_follow_the_informative_step():
    budgets = {"object": 1.0, "count": 3.0, "attribute": 2.0, "relation": 2.0}
    gains = torch.zeros(4, 6, dtype=torch.float64)
    gains[1, 4] = 3.0  # count is informative only at step 4
    gains[3, 1] = 3.0  # relation only at step 1
    weights = training_weights(_gains(gains, budgets, tau=0.5))  # [4, 6]
    lam = torch.tensor(list(budgets.values()), dtype=torch.float64)
    torch.testing.assert_close(weights.mean(dim=1), lam / lam.mean(), atol=1e-6, rtol=0)
    torch.testing.assert_close(weights.sum(dim=0), torch.full((6,), 4.0, dtype=torch.float64),
                               atol=1e-6, rtol=0)
    assert int(weights[1].argmax()) == 4 and int(weights[3].argmax()) == 1
    assert weights[1, 4] > 2 * weights[1].median()


def test_recipe_validates_the_recast_section(tmp_path):
    base = "data/recipes/shapes-cast.toml"
    r = load_recipe(base, {"recast.weighting": "recast", "recast.budgets": {"count": 2.0,
                                                                           "object": 1.0}})
    assert r.recast.budget_map() == {"object": 1.0, "count": 2.0}
    assert "ReCAST" in r.derived()["reward_step_weights"]
    assert load_recipe(base).recast.weighting == "none"
    with pytest.raises(RecipeError, match="advantage.kind = 'spatial'"):
        load_recipe(base, {"recast.weighting": "static", "advantage.kind": "scalar"})
    with pytest.raises(RecipeError, match="set recast.positives to a folder"):
        load_recipe("data/recipes/flux2-klein-cast.toml", {"recast.weighting": "recast"})
    with pytest.raises(RecipeError, match="finite value > 0"):
        load_recipe(base, {"recast.weighting": "static", "recast.budgets": {"count": -1.0}})
    with pytest.raises(RecipeError, match="finite value > 0"):
        load_recipe(base, {"recast.budgets": {}})
    with pytest.raises(RecipeError, match=r"recast\.budgets\.colour"):
        load_recipe(base, {"recast.budgets": {"colour": 1.0}})
    with pytest.raises(RecipeError, match=r"recast\.alpha"):
        load_recipe(base, {"recast.alpha": 1.5})


# ---- stages on a copy of the reference store ------------------------------------------------


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return reference(tmp_path_factory)


def _copy(ref, tmp_path) -> Store:
    shutil.copytree(ref[0].root, tmp_path / "store")
    return Store(tmp_path / "store")


def _rows(store, table, **where):
    return store.read_table(table, where).to_pylist()


def _lora(store: Store) -> dict[str, torch.Tensor]:
    """Iteration 0's trained LoRA tensors."""
    return store.get_tensors(_rows(store, "checkpoints", iteration=0)[0]["lora_path"])


def _assert_same_lora(store: Store, src: Store) -> None:
    trained, cast = _lora(store), _lora(src)
    assert trained.keys() == cast.keys()
    for name in cast:
        torch.testing.assert_close(trained[name], cast[name], atol=1e-5, rtol=1e-4)


def test_static_equal_budgets_train_the_same_lora_as_cast(ref, tmp_path):
    store = _copy(ref, tmp_path)
    src, _, prompts, _ = ref
    recipe = ci_recipe(prompts, **{"recast.weighting": "static"})
    again = run_iteration(store, recipe, 0)
    assert again["compute_advantages"].skipped and not again["train_epoch"].skipped
    steps = _rows(store, "train_steps", iteration=0)
    k = len(steps[0]["ratio_mean_per_step"])
    assert json.loads(steps[0]["reward_step_weights_json"]) == {t: [1.0] * k for t in ATOM_TYPES}
    _assert_same_lora(store, src)


def test_recast_weighting_estimates_gains_records_weights_and_trains(ref, tmp_path):
    store = _copy(ref, tmp_path)
    src, _, prompts, _ = ref
    recipe = ci_recipe(prompts, **{"recast.weighting": "recast", "recast.every": 2,
                                   **SMALL_GAINS})
    first = run_iteration(store, recipe, 0)
    assert not first["recast_gains"].skipped and not first["train_epoch"].skipped
    gains = _rows(store, "recast_gains")
    assert {r["iteration"] for r in gains} == {0}
    window = _rows(store, "rollouts", iteration=0)[0]
    k = window["window_end"] - window["window_start"]
    weights = json.loads(_rows(store, "train_steps", iteration=0)[0]["reward_step_weights_json"])
    w = torch.tensor([weights[t] for t in ATOM_TYPES], dtype=torch.float64)  # [4, K]
    assert w.shape == (4, k) and bool((w > 0).all())
    torch.testing.assert_close(w.mean(dim=1), torch.ones(4, dtype=torch.float64), atol=1e-4,
                               rtol=0)
    torch.testing.assert_close(w.sum(dim=0), torch.full((k,), 4.0, dtype=torch.float64),
                               atol=1e-4, rtol=0)
    trained, cast = _lora(store), _lora(src)
    assert any(not torch.equal(trained[n], cast[n]) for n in cast)
    assert all(v.isfinite().all() for v in trained.values())
    assert all(run_iteration(store, recipe, 0)[s].skipped for s in first)
    # every = 2: iteration 1 reuses iteration 0's gains (estimated on the base policy)
    second = gains_for_training(store, recipe, 1)
    assert second.skipped and second.content_hash == first["recast_gains"].content_hash
    assert {r["iteration"] for r in _rows(store, "recast_gains")} == {0}


NFT_CAST = {"train.objective": "nft", "sampling.noise_level": 0.0, "window.mode": "fixed",
            "advantage.kind": "spatial"}


@pytest.fixture(scope="module")
def nft_ref(ref, tmp_path_factory):
    """An NFT iteration with CAST's map (no step weights) on the reference prompts."""
    store = Store(tmp_path_factory.mktemp("nft-ref") / "store")
    run_iteration(store, ci_recipe(ref[2], **NFT_CAST), 0)
    return store, ref[2]


def test_nft_static_equal_budgets_train_the_same_lora_as_nft_cast(nft_ref, tmp_path):
    """Under NFT the step maps at unit weights are CAST's map at every step, whatever step each
    draw's t is nearest: the same LoRA; the weights are recorded with the steps' times."""
    src, prompts = nft_ref
    shutil.copytree(src.root, tmp_path / "store")
    store = Store(tmp_path / "store")
    again = run_iteration(store, ci_recipe(prompts, **NFT_CAST, **{"recast.weighting": "static"}),
                          0)
    assert again["compute_advantages"].skipped and not again["train_epoch"].skipped
    weights = json.loads(_rows(store, "train_steps", iteration=0)[0]["reward_step_weights_json"])
    k = len(weights["step_times"])
    assert k >= 2 and {t: weights[t] for t in ATOM_TYPES} == {t: [1.0] * k for t in ATOM_TYPES}
    _assert_same_lora(store, src)


def test_nft_recast_weighting_weights_the_steps_its_draws_reach(nft_ref, tmp_path):
    """ReCAST under NFT: W is solved over the schedule steps that a t in [t_min, t_max] is
    nearest to (`nft.covered_steps`), recorded with their times; it trains another LoRA."""
    from cast_core.nft import covered_steps
    from tasks.stages.models import load_policy

    src, prompts = nft_ref
    shutil.copytree(src.root, tmp_path / "store")
    store = Store(tmp_path / "store")
    recipe = ci_recipe(prompts, **NFT_CAST, **{"recast.weighting": "recast", **SMALL_GAINS})
    first = run_iteration(store, recipe, 0)
    assert not first["recast_gains"].skipped and not first["train_epoch"].skipped
    schedule = load_policy(recipe, None)[0].sigmas(recipe.sampling.num_steps)[:-1].double()
    start, end = covered_steps(schedule, recipe.train.nft_t_min, recipe.train.nft_t_max)
    weights = json.loads(_rows(store, "train_steps", iteration=0)[0]["reward_step_weights_json"])
    assert weights["step_times"] == [round(float(x), 6) for x in schedule[start:end]]
    w = torch.tensor([weights[t] for t in ATOM_TYPES], dtype=torch.float64)  # [4, K]
    assert w.shape == (4, end - start) and bool((w > 0).all())
    torch.testing.assert_close(w.sum(dim=0), torch.full((end - start,), 4.0,
                                                        dtype=torch.float64), atol=1e-4, rtol=0)
    trained, cast = _lora(store), _lora(src)
    assert any(not torch.equal(trained[n], cast[n]) for n in cast)
    assert all(v.isfinite().all() for v in trained.values())
