"""Scorers: Soft-TIFA on Qwen3-VL (`soft_tifa`, `soft_tifa_inputs`), the remote client and wire
format of the scorer service (`remote`), and the registry of scorers a service serves by name
(`registry`).

May import: torch, numpy, transformers, safetensors, httpx (the client), the top-level
`cast_core` maths, `cast_core.csg`, and, lazily in `registry` only, `cast_core.shapes.verifier`
(the shapes world's exact scorer). Never `cast_core.backbones`. No servers, command lines or plots:
the HTTP server and its command line are `flows.scorer_service`.
"""
