"""CAST's library: pure computation, no orchestration. Its layers, and what each may import:

- `cast_core/*.py` (top level): the maths and the training loop pieces: SDE steps, advantages,
  losses, windows and their calibration, ReCAST (`credit`, `recast_gains`), NFT, rollouts, the LoRA
  policy update (`policy`, its adapter `lora`, its lr schedules `lr_schedule`, how far it moved
  the sampler `update_kl`), diagnostics. May import torch, numpy, peft (`lora`),
  `cast_core.csg`, and one another; `clip_embedder` (with `hub_snapshot`) also loads CLIP through
  transformers and huggingface_hub. Backbones and scorers are passed in as objects (duck-typed
  against `cast_core.backbones.base.Backbone` and the scorer call), never imported.
- `cast_core/csg/`: Causal Scene Graphs and their builders; imports no other layer.
- `cast_core/shapes/`: the embedded shapes world; may import the top level and `csg`.
- `cast_core/backbones/`: adapters of the model families; may import the top level, `csg`, and
  the world it adapts (`backbones/shapes.py` -> `shapes/world.py`); never the other way round.
- `cast_core/scorers/`: scorer adapters and the remote client; may import the top level, `csg`,
  and (lazily, in the registry) the shapes world's verifier.

Nothing under `cast_core/` imports `tasks/`, `flows/` or `benchmarks/`, runs a server, reads a
command line (argparse) or draws a plot (matplotlib): those are `flows/` (the scorer service,
the shapes prompts command) and `tasks/` (`tasks/stages/plots.py`, the reports).
"""
