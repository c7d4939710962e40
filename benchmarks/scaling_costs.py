"""The measured inputs of docs/scaling.md's cost model: model sizes, per-sample costs on the shapes
world, and the store's bytes per sample.

    .venv/bin/python benchmarks/scaling_costs.py [--recipe data/recipes/shapes-ci.toml]
        [--repeats 3] [--json figures.json]

Run it from the repository root. It prints (and with --json writes):
- sizes: the parameter count of FLUX.2-dev's and Qwen-Image's transformers (diffusers' classes
  at their default configs, which are the released models'; built on the meta device, so no
  weights and no download) and of their LoRA at rank 32 on the backbones' target modules
  (r (d_in + d_out) per adapted Linear); the shapes backbone's transformer likewise, with its
  tokens per forward.
- per_sample: `repeats` iterations 0 of the stages on fresh stores (bench_iteration's stages arm;
  the median of the repeats): each stage's seconds per sample, and per transformer forward
  (rollout: num_steps x (1 + CFG) forwards a sample; training: window size x (1 + CFG) forwards
  and backwards a sample and inner epoch).
- store: one iteration's store growth per sample: each table's Parquet parts and each blob kind
  (window steps, images, contact sheet, advantage maps, LoRA, AdamW), in bytes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's packages, before any installed copy
FLUX2_SINGLE = "single_transformer_blocks.{i}.attn.to_out"  # the backbone lists these per block


def lora_params(model: torch.nn.Module, suffixes: tuple[str, ...], rank: int) -> int:
    """Parameters of a rank-`rank` LoRA on every Linear whose name ends with a suffix."""
    return sum(rank * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.endswith(suffixes))


def sizes(rank: int = 32) -> dict:
    """{model: {params, lora_params}} from the real architectures on the meta device."""
    from diffusers import Flux2Transformer2DModel, QwenImageTransformer2DModel

    from cast_core.backbones.qwen_image import QwenImageBackbone

    double = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
              "to_add_out", "to_qkv_mlp_proj")
    out = {}
    with torch.device("meta"):
        flux = Flux2Transformer2DModel()
        qwen = QwenImageTransformer2DModel()
    single = tuple(FLUX2_SINGLE.format(i=i) for i in range(flux.config.num_single_layers))
    for name, model, suffixes in (("flux2-dev", flux, double + single),
                                  ("qwen-image", qwen, QwenImageBackbone.lora_target_modules)):
        out[name] = {"params": sum(p.numel() for p in model.parameters()),
                     "lora_params": lora_params(model, suffixes, rank)}
    return out


def shapes_size(recipe) -> dict:
    """The shapes backbone's transformer parameters and image tokens per forward."""
    from tasks.stages.models import load_policy

    backbone, lora = load_policy(recipe, None)
    c = backbone.config
    base = sum(p.numel() for n, p in backbone.transformer.named_parameters() if "lora_" not in n)
    return {"params": base, "lora_params": sum(p.numel() for p in lora),
            "image_tokens": (c.image_size // c.patch_size) ** 2, "text_tokens": c.max_tokens}


def forwards(recipe) -> dict:
    """Transformer forwards per sample: rollout, and training per inner epoch (each also has a
    backward), counting CFG's unconditional branch."""
    s, tr = recipe.sampling, recipe.train
    cfg = 1 + (s.guidance_scale != 1.0)
    return {"rollout": s.num_steps * cfg, "train": recipe.window.size * cfg * tr.inner_epochs}


def store_bytes(root: Path) -> dict[str, int]:
    """Bytes of one iteration's store by table (Parquet parts) and blob kind."""
    from tasks.store.store import Store

    st = Store(root)
    kinds: dict[str, int] = {}
    for table_dir in sorted((root / "tables").iterdir()):
        kinds[f"table {table_dir.name}"] = sum(p.stat().st_size for p in table_dir.rglob("*")
                                               if p.is_file())
    for record in st.stage_records():
        for i, path in enumerate(p for p in record.paths if p.startswith("blobs/")):
            key = f"blob {record.stage} #{i} ({Path(path).suffix[1:]})"
            kinds[key] = kinds.get(key, 0) + st.resolve(path).stat().st_size
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="data/recipes/shapes-ci.toml")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from benchmarks.bench_iteration import stage_iteration
    from tasks.stages.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    n = recipe.prompts.per_iteration * recipe.prompts.group_size
    work = Path(tempfile.mkdtemp(prefix="scaling-"))
    runs = [stage_iteration(recipe, work / f"stages-{i}") for i in range(args.repeats)]
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    count = forwards(recipe)
    fig = {"recipe": args.recipe, "repeats": args.repeats, "samples": n,
           "sizes": {**sizes(), "shapes": shapes_size(recipe)}, "forwards_per_sample": count,
           "seconds_per_sample": {k: median[k] / n for k in
                                  ("rollout", "score_atoms", "compute_advantages",
                                   "train_epoch")},
           "seconds_per_forward": {"rollout": median["rollout"] / n / count["rollout"],
                                   "train": median["train_epoch"] / n / count["train"]},
           "store_bytes_per_sample": {k: v / n for k, v in store_bytes(work / "stages-0").items()}}
    print(json.dumps(fig, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1))


if __name__ == "__main__":
    main()
