"""The scorers a service can serve, by name: `load_scorer(name, ScorerArgs(...))` -> LoadedScorer.

`SCORERS` maps a name to a factory, so adding a scorer is one entry there. Factories import their
model code lazily: loading one scorer does not import the heavy dependencies of the others. The
HTTP server that serves a loaded scorer, and its command line, are `flows.scorer_service`.

A scorer id is what score caches key on, built by the scorer's own module:
`cast_core.shapes.verifier.scorer_id` and `cast_core.scorers.soft_tifa.scorer_id` (the model's
content identity and the config), the same functions a local run's `tasks.stages.models.scorer_id`
calls, so a served scorer and the same scorer loaded in-process have one id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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
    from cast_core.hub_snapshot import model_identity
    from cast_core.scorers.soft_tifa import SoftTifaConfig, SoftTifaScorer, scorer_id

    if args.model is None:
        raise ValueError("soft-tifa needs --model PATH (a Qwen3-VL folder saved with "
                         "save_pretrained)")
    config = SoftTifaConfig()
    scorer = SoftTifaScorer.from_pretrained(args.model, config, args.device, args.dtype)
    return LoadedScorer(scorer_id(model_identity(args.model), config), scorer.score)


SCORERS: MappingProxyType[str, Callable[[ScorerArgs], LoadedScorer]] = MappingProxyType({
    "shapes-verifier": _shapes_verifier,
    "soft-tifa": _soft_tifa,
})


def load_scorer(name: str, args: ScorerArgs = ScorerArgs()) -> LoadedScorer:
    """The scorer registered as `name`, built from `args`."""
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; known: {sorted(SCORERS)}")
    return SCORERS[name](args)
