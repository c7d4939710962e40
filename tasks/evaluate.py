"""Stage helper: sample a prompt set with fixed content-derived seeds and score it with the verifier.

Seeds come from the prompt text and the image index (sha256), never from batch position, so the same
prompt gets the same starting noise in every evaluation, whatever the prompt file or batch size.
"""

from __future__ import annotations

import hashlib

from tqdm.auto import tqdm

from cast_core.csg.parser import graph_from_geneval
from cast_core.metrics import ImageResult
from cast_core.sampling import sample_ode
from cast_core.shapes.verifier import verify


def content_seed(prompt: str, index: int, salt: str = "eval") -> int:
    """A 63-bit seed from (salt, prompt text, image index)."""
    digest = hashlib.sha256(f"{salt}|{prompt}|{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def evaluate_records(backbone, records: list[dict], images_per_prompt: int = 4,
                     num_steps: int = 10, guidance_scale: float = 4.0,
                     chunk_prompts: int = 32) -> list[ImageResult]:
    """Sample `images_per_prompt` images per record and score all their atoms."""
    graphs = [graph_from_geneval(r) for r in records]
    results: list[ImageResult] = []
    for lo in tqdm(range(0, len(records), chunk_prompts), desc="evaluate", unit="chunk",
                   mininterval=2.0):
        chunk = list(range(lo, min(lo + chunk_prompts, len(records))))
        prompts = [records[i]["prompt"] for i in chunk for _ in range(images_per_prompt)]
        seeds = [content_seed(records[i]["prompt"], k) for i in chunk
                 for k in range(images_per_prompt)]
        x0 = sample_ode(backbone, prompts, seeds, num_steps, guidance_scale)
        chunk_graphs = [graphs[i] for i in chunk for _ in range(images_per_prompt)]
        scored = verify(backbone.decode(x0), chunk_graphs)
        for graph, s in zip(chunk_graphs, scored):
            results.append(ImageResult(tag=graph.tag or "untagged", scores=s.scores,
                                       atom_types=tuple(a.type for a in graph.atoms())))
    return results
