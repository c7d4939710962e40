"""ReCAST gain estimation: identical distributions give zero gain, a reward informative at one step
gets its weight there, a flat kernel is the static weighting, and the stage on the real shapes
base model writes finite, balanced weights and a plot, and is cached."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cast_core.csg.geneval import graph_from_geneval
from cast_core.recast_gains import (
    ATOM_TYPES,
    StepStatistics,
    atom_type_statistics,
    policy_statistics,
    positive_statistics,
    recast_gains,
    restrict_to_window,
)
from cast_core.shapes.prompts import make_record
from cast_core.shapes.verifier import verify
from tasks.stages.models import load_policy, lora_tensors
from tasks.stages.plots import plot_recast_gains
from tasks.stages.recast_gains import (
    PositiveFolderError,
    RecastConfig,
    load_images,
    positive_images,
    read_positive_folder,
    read_recast_gains,
)
from tasks.stages.recast_gains import recast_gains as recast_stage
from tasks.stages.recipe import load_recipe
from tasks.store.schemas import prompt_id
from tasks.store.stage import derive_seed
from tasks.store.store import Store

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
S = 6
SIGMAS = torch.linspace(1.0, 0.0, S + 1, dtype=torch.float64)[:-1]
BUDGETS = {"object": 0.5, "count": 0.3, "attribute": 0.2}


def _stats(values: dict[str, torch.Tensor]) -> StepStatistics:
    return StepStatistics(sigmas=SIGMAS, values=values)


def _random_values(seed: int, n: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    values = {k: torch.rand(S, n, 1 + (k == "count"), generator=g, dtype=torch.float64)
              for k in BUDGETS}
    values["attribute"][:, :3] = float("nan")  # three samples without attribute atoms
    return values


def _assert_marginals(W: torch.Tensor, budgets: torch.Tensor) -> None:
    cols = W.shape[1]
    torch.testing.assert_close(W.sum(dim=1), budgets, rtol=0, atol=1e-6)
    torch.testing.assert_close(W.sum(dim=0), torch.full((cols,), float(budgets.sum()) / cols,
                                                        dtype=torch.float64), rtol=0, atol=1e-6)


# library: closed cases --------------------------------------------------------------------------

def test_the_same_sample_set_as_positives_and_policy_gives_zero_gain():
    stats = _stats(_random_values(0))
    out = recast_gains(stats, stats, BUDGETS)
    assert out.rewards == tuple(BUDGETS) and out.divergence.shape == (3, S)
    assert float(out.divergence.abs().max()) < 1e-9 and float(out.gains.abs().max()) < 1e-9
    assert out.n_positive.tolist() == out.n_policy.tolist() == [12, 12, 9]
    lam = torch.tensor(list(BUDGETS.values()), dtype=torch.float64)
    torch.testing.assert_close(out.W, (lam / S)[:, None].expand(3, S), rtol=0, atol=1e-12)


def test_a_reward_informative_at_one_step_gets_its_largest_weight_there():
    j = 3
    pos = _random_values(1)
    pol = {k: v.clone() for k, v in pos.items()}  # identical everywhere ...
    pol["count"][j] += 2.0  # ... except the count statistic at step j
    out = recast_gains(_stats(pos), _stats(pol), BUDGETS, tau=0.5)
    assert float(out.divergence[1, j]) > 1.0
    assert float(out.divergence.abs().sum() - out.divergence[1, j]) < 1e-9
    assert int(out.gains[1].argmax()) == j and int(out.W[1].argmax()) == j
    _assert_marginals(out.W, out.budgets)
    window = restrict_to_window(out, 2, 5)  # K = 3 steps, j inside
    assert window.W.shape == (3, 3) and int(window.W[1].argmax()) == j - 2
    torch.testing.assert_close(window.sigmas, SIGMAS[2:5])
    _assert_marginals(window.W, window.budgets)
    with pytest.raises(ValueError, match="window"):
        restrict_to_window(out, 4, 7)


def test_a_flat_kernel_gives_the_static_weighting():
    out = recast_gains(_stats(_random_values(2)), _stats(_random_values(3)), BUDGETS, tau=1e9)
    lam = out.budgets
    torch.testing.assert_close(out.W, (lam / S)[:, None].expand(3, S), rtol=0, atol=1e-6)
    # equal gains on every window step (D grows linearly): exactly budgets / K
    pos = {k: torch.zeros(S, 4, 1, dtype=torch.float64) + torch.tensor([0., 0., 1., 1.])[:, None]
           for k in BUDGETS}
    shift = torch.sqrt(torch.arange(S, dtype=torch.float64))[:, None, None]  # D ~ t
    pol = {k: v + shift for k, v in pos.items()}
    linear = recast_gains(_stats(pos), _stats(pol), BUDGETS)
    torch.testing.assert_close(linear.gains[:, 1:], linear.gains[:, 1:2].expand(3, S - 1))
    window = restrict_to_window(linear, 1, S)
    torch.testing.assert_close(window.W, (lam / (S - 1))[:, None].expand(3, S - 1), rtol=0,
                               atol=1e-12)


def test_invalid_inputs_raise_with_the_fix():
    stats = _stats(_random_values(4, n=12))
    few = _stats({**stats.values, "object": stats.values["object"][:, :1]})
    with pytest.raises(ValueError, match="2 needed"):
        recast_gains(few, stats, BUDGETS)
    with pytest.raises(ValueError, match="no statistics"):
        recast_gains(stats, stats, {"relation": 1.0})
    with pytest.raises(ValueError, match="alpha"):
        RecastConfig(alpha=1.5)
    with pytest.raises(ValueError, match="budgets"):
        RecastConfig(budgets={"colour": 1.0})


# library: collection on a backbone --------------------------------------------------------------

RECORDS = [  # every atom type; count atoms on the first two, a relation on the first only
    make_record("hard_counted_relation", [("circle", 2, "red"), ("square", 1, "blue")],
                "left of"),
    make_record("hard_counted_colors", [("triangle", 3, "green"), ("circle", 1, "red")]),
    make_record("single_object", [("square", 1, None)]),
]

class OracleBackbone:
    """Pixel-space backbone whose velocity is exact for one clean image per prompt:
    v = (x_t - x0*) / t, so the ODE runs the straight path and x0_hat = x0* at every step."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets

    def encode_prompts(self, prompts):
        return torch.stack([self.targets[p] for p in prompts])

    def velocity(self, x_t, t, cond, guidance_scale=1.0, uncond=None):
        return (x_t - cond) / t.reshape(-1, 1, 1, 1)

    def sigmas(self, num_steps):
        return torch.linspace(1.0, 0.0, num_steps + 1)

    def initial_noise(self, seeds):
        return torch.stack([torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(s))
                            for s in seeds])

    def decode(self, x):
        return ((x + 1) / 2).clamp(0, 1)


def _verifier(images, graphs):
    return [(r.scores, r.heatmaps) for r in verify(images, graphs)]


def test_a_policy_that_reproduces_the_positives_gives_zero_gain_and_scores_atom_types():
    graphs = [graph_from_geneval(r) for r in RECORDS]
    x0 = positive_images(RECORDS, [5, 6, 7]) * 2 - 1  # [3, 3, 32, 32]
    backbone = OracleBackbone({r["prompt"]: x for r, x in zip(RECORDS, x0)})
    prompts, seeds = [r["prompt"] for r in RECORDS], [11, 12, 13]
    statistics = atom_type_statistics(_verifier)
    pos = positive_statistics(backbone, x0, prompts, graphs, seeds, 4, 1.0, statistics, 2)
    pol = policy_statistics(backbone, prompts, graphs, seeds, 4, 1.0, statistics, 2)
    assert set(pos.values) == set(ATOM_TYPES) and pos.values["object"].shape == (4, 3, 1)
    # renders score ~1 on every atom they carry; NaN where the graph has none of that type
    assert bool((pos.values["object"] > 0.99).all())
    assert torch.isnan(pos.values["relation"][:, 1:]).all() and torch.isnan(
        pos.values["count"][:, 2]).all()
    for k in ATOM_TYPES:
        torch.testing.assert_close(pol.values[k], pos.values[k], rtol=0, atol=1e-5,
                                   equal_nan=True)
    out = recast_gains(pos, pol, {"object": 1.0, "count": 1.0, "attribute": 1.0})
    assert float(out.divergence.abs().max()) < 1e-9 and float(out.gains.max()) < 1e-9
    assert out.n_positive.tolist() == [3, 2, 2]


def test_plot_is_a_png():
    out = recast_gains(_stats(_random_values(5)), _stats(_random_values(6)), BUDGETS)
    png = plot_recast_gains(out, "synthetic")
    assert png.startswith(PNG_MAGIC) and len(png) > 5000


# the stage on the real shapes base model -------------------------------------------------------

def _recipe(tmp_path: Path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return load_recipe(REPO / "data" / "recipes" / "shapes-ci.toml",
                       {"run.threads": 1, "prompts.train": str(prompts),
                        "backbone.path": str(REPO / "data" / "base" / "shapes-base")})


def _print_table(rows: list[dict]) -> None:
    print("\nreward     step sigma  divergence  gain    norm_gain  W       S*W")
    for r in rows:
        print(f"{r['reward']:<10} {r['step']:>4} {r['sigma']:.3f}  {r['divergence']:9.4f}  "
              f"{r['gain']:7.4f} {r['normalised_gain']:8.3f}  {r['weight']:.4f}  "
              f"{r['weight'] * S:.3f}")


def test_stage_on_the_real_base_writes_balanced_finite_weights_and_is_cached(tmp_path):
    recipe, store = _recipe(tmp_path), Store(tmp_path / "store")
    config = RecastConfig(prompts=3, samples_per_prompt=3)
    ref = recast_stage(store, recipe, 0, config)
    assert not ref.skipped and ref.rows == len(ATOM_TYPES) * S
    rows = sorted(store.read_table("recast_gains", {"run_id": recipe.run.name}).to_pylist(),
                  key=lambda r: (ATOM_TYPES.index(r["reward"]), r["step"]))
    _print_table(rows)
    assert {(r["reward"], r["step"]) for r in rows} == {(k, t) for k in ATOM_TYPES
                                                       for t in range(S)}
    numbers = ("sigma", "divergence", "gain", "normalised_gain", "weight")
    assert all(np.isfinite([r[c] for c in numbers]).all() for r in rows)
    assert all(r["divergence"] == 0.0 for r in rows if r["step"] == 0)
    result = read_recast_gains(store, ref)
    assert result.rewards == ATOM_TYPES and result.n_positive.tolist() == [9, 6, 6, 3]
    _assert_marginals(result.W, torch.full((4,), 0.25, dtype=torch.float64))
    png = store.resolve(rows[0]["plot_path"]).read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 5000
    assert recast_stage(store, recipe, 0, config).skipped
    # a zero-effect LoRA (fresh adapter) is another policy: not cached, same gains as the base
    lora = store.put_tensors(lora_tensors(load_policy(recipe, None)[0]))
    again = recast_stage(store, recipe, 0, config, policy_lora=lora.path)
    assert not again.skipped
    torch.testing.assert_close(read_recast_gains(store, again).divergence, result.divergence,
                               rtol=1e-4, atol=1e-6)


# positives from a folder (GenEval's output layout) ----------------------------------------------

def _write_folder(root: Path, records: list[dict], images: list[list[np.ndarray]]) -> Path:
    """<root>/<NNNNN>/metadata.jsonl + samples/<NNNN>.png, as GenEval's generation script writes."""
    for i, (record, imgs) in enumerate(zip(records, images, strict=True)):
        sub = root / f"{i:05d}"
        (sub / "samples").mkdir(parents=True)
        (sub / "metadata.jsonl").write_text(json.dumps(record) + "\n")
        for j, img in enumerate(imgs):
            Image.fromarray(img).save(sub / "samples" / f"{j:04d}.png")
    return root


def _renderer_scenes(recipe, m: int) -> list[list[np.ndarray]]:
    """The exact scenes the renderer source draws for RECORDS x m (same seeds), as uint8 HWC."""
    out = []
    for r in RECORDS:
        seeds = [derive_seed(recipe.run.seed, "recast-scene", prompt_id(r["prompt"]), j)
                 for j in range(m)]
        imgs = positive_images([r] * m, seeds)  # [m, 3, H, W] in [0, 1]
        out.append([(x.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8) for x in imgs])
    return out


def test_a_folder_holding_the_renderers_scenes_gives_the_renderers_gains(tmp_path):
    recipe, store = _recipe(tmp_path), Store(tmp_path / "store")
    config = RecastConfig(prompts=3, samples_per_prompt=2)
    from_renderer = read_recast_gains(store, recast_stage(store, recipe, 0, config))
    folder = _write_folder(tmp_path / "positives", RECORDS, _renderer_scenes(recipe, 2))
    ref = recast_stage(store, recipe, 0, replace(config, positives=str(folder)))
    assert not ref.skipped  # another source is another cache entry
    from_folder = read_recast_gains(store, ref)
    torch.testing.assert_close(from_folder.divergence, from_renderer.divergence, rtol=0, atol=0)
    torch.testing.assert_close(from_folder.W, from_renderer.W, rtol=0, atol=0)
    # an edited image is new data: the stage runs again and the gains move
    img = np.array(Image.open(folder / "00000" / "samples" / "0000.png"))
    Image.fromarray(255 - img).save(folder / "00000" / "samples" / "0000.png")
    edited = recast_stage(store, recipe, 0, replace(config, positives=str(folder)))
    assert not edited.skipped
    assert not torch.equal(read_recast_gains(store, edited).divergence, from_folder.divergence)


def test_a_folder_with_fewer_images_fits_what_it_has(tmp_path):
    recipe, store = _recipe(tmp_path), Store(tmp_path / "store")
    scenes = _renderer_scenes(recipe, 2)
    folder = _write_folder(tmp_path / "positives", RECORDS, [scenes[0], scenes[1], scenes[2][:1]])
    ref = recast_stage(store, recipe, 0, RecastConfig(prompts=3, samples_per_prompt=2,
                                                      positives=str(folder)))
    result = read_recast_gains(store, ref)
    # samples with the type: object all (2 + 2 + 1 positives, 3 x 2 policy samples); count and
    # attribute the first two prompts; relation the first
    assert result.n_positive.tolist() == [5, 4, 4, 2]
    assert result.n_policy.tolist() == [6, 4, 4, 2]
    _assert_marginals(result.W, torch.full((4,), 0.25, dtype=torch.float64))


def test_load_images_crops_to_the_aspect_and_resizes(tmp_path):
    wide = np.zeros((40, 80, 3), np.uint8)
    wide[:, 20:60] = (255, 0, 0)  # the centre square is red, the side bands black
    Image.fromarray(wide).save(tmp_path / "wide.png")
    out = load_images([tmp_path / "wide.png"], 32, 32)
    assert out.shape == (1, 3, 32, 32) and out.dtype == torch.float32
    assert out[0, 0].min() > 0.95 and out[0, 1:].max() < 0.05  # only the red centre is kept


@pytest.mark.parametrize(("breakage", "message"), [
    ("no-metadata", "no metadata.jsonl"),
    ("bad-json", "not valid JSON"),
    ("no-include", "'include' clauses"),
    ("no-images", "no images"),
    ("empty", "has no prompt folders"),
    ("missing", "is not a folder"),
])
def test_a_malformed_positives_folder_is_refused_naming_the_path(tmp_path, breakage, message):
    img = np.zeros((32, 32, 3), np.uint8)
    folder = _write_folder(tmp_path / "pos", RECORDS[:2], [[img], [img]])
    sub = folder / "00001"
    if breakage == "no-metadata":
        (sub / "metadata.jsonl").unlink()
    elif breakage == "bad-json":
        (sub / "metadata.jsonl").write_text("{not json\n")
    elif breakage == "no-include":
        (sub / "metadata.jsonl").write_text(json.dumps({"prompt": "a photo of a cat"}) + "\n")
    elif breakage == "no-images":
        (sub / "samples" / "0000.png").unlink()
    elif breakage == "empty":
        folder = tmp_path / "empty"
        folder.mkdir()
    else:
        folder = tmp_path / "nowhere"
    with pytest.raises(PositiveFolderError, match=message) as err:
        read_positive_folder(folder)
    assert str(folder) in str(err.value)


def test_recipe_needs_a_positives_folder_for_recast_on_real_families(tmp_path):
    base = REPO / "data" / "recipes" / "flux2-klein-cast.toml"
    with pytest.raises(ValueError, match="set recast.positives to a folder"):
        load_recipe(base, {"recast.weighting": "recast"})
    recipe = load_recipe(base, {"recast.weighting": "recast", "recast.positives": str(tmp_path)})
    assert recipe.recast.positives == str(tmp_path)
    assert str(tmp_path) in recipe.derived()["reward_step_weights"]
