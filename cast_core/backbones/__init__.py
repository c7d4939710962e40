"""Backbone adapters: the protocol every family implements (`base.Backbone`) and the families
`shapes`, `flux2`, `qwen_image` with their text encoders, and where weights come from (`source`).

May import: torch, numpy, diffusers, transformers, tokenizers, peft, safetensors, huggingface_hub,
the top-level `cast_core` maths, `cast_core.csg`, and the world an adapter serves
(`shapes.py` -> `cast_core.shapes.world`). Never `cast_core.scorers`. No servers, command lines or
plots.
"""
