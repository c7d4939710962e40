"""The scorers a service can serve, by name: `load_scorer(name, ScorerArgs(...))` -> LoadedScorer.

`SCORERS` maps a name to a factory, so adding a scorer is one entry there. Factories import their
model code lazily: loading one scorer does not import the heavy dependencies of the others. The
HTTP server that serves a loaded scorer, and its command line, are `flows.scorer_service`.

A scorer id is what score caches key on: `shapes-verifier` gives the verifier's own
(`cast_core.shapes.verifier.scorer_id`), `soft-tifa` gives
"soft-tifa-v1(<model folder name>, <SoftTifaConfig>)".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch


@dataclass(frozen=True)
class LoadedScorer:
    """A scorer ready to serve: its id (what score caches key on) and its score function."""

    scorer_id: str
    score: Callable


@dataclass(frozen=True)
class ScorerArgs:
    """What a factory may need: a local model folder, the device and dtype to load it with."""

    model: str | None = None
    device: str = "cpu"
    dtype: str | None = None


def _shapes_verifier(args: ScorerArgs) -> LoadedScorer:
    from cast_core.shapes.verifier import VerifierConfig, scorer_id, verify

    if args.model is not None:
        raise ValueError("shapes-verifier is exact and has no model; drop --model")
    config = VerifierConfig()

    def score(images: torch.Tensor, graphs):
        return [(s.scores, s.heatmaps) for s in verify(images, graphs, config)]

    return LoadedScorer(scorer_id(config), score)


def _soft_tifa(args: ScorerArgs) -> LoadedScorer:
    from cast_core.scorers.soft_tifa import SoftTifaConfig, SoftTifaScorer

    if args.model is None:
        raise ValueError("soft-tifa needs --model PATH (a Qwen3-VL folder saved with "
                         "save_pretrained)")
    config = SoftTifaConfig()
    scorer = SoftTifaScorer.from_pretrained(args.model, config, args.device, args.dtype)
    return LoadedScorer(f"soft-tifa-v1({Path(args.model).resolve().name}, {config})",
                        scorer.score)


SCORERS: MappingProxyType[str, Callable[[ScorerArgs], LoadedScorer]] = MappingProxyType({
    "shapes-verifier": _shapes_verifier,
    "soft-tifa": _soft_tifa,
})


def load_scorer(name: str, args: ScorerArgs = ScorerArgs()) -> LoadedScorer:
    """The scorer registered as `name`, built from `args`."""
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; known: {sorted(SCORERS)}")
    return SCORERS[name](args)
