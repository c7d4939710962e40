"""The embedded shapes world: its constants (`world`), renderer, prompt grammar and splits, exact
verifier, layout embedder, backbone pre-training and the word-sensitivity probe.

May import: torch, numpy, the top-level `cast_core` maths and `cast_core.csg`. Never
`cast_core.backbones` (its adapter, `backbones/shapes.py`, imports this world; pre-training and the
probe type the model structurally, `pretrain.FlowModel`) nor `cast_core.scorers`. No servers,
command lines or plots: the prompt files are written by `flows.shapes_prompts`.
"""
