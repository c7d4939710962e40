"""Issue 19, item 10: the scorer service caps the images of one request (configurable, stated in
GET /health); a request over the cap gets a 413 that names the cap, before the model sees it; the
client splits its batches to the cap, so a run never meets the 413."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from cast_core.csg.geneval import graph_from_geneval
from cast_core.scorers.registry import load_scorer
from cast_core.scorers.remote import RemoteScorer, encode_request, request_image_count
from cast_core.shapes.prompts import enumerate_prompts
from flows.scorer_service import DEFAULT_MAX_IMAGES, make_app, serve_in_thread

FAST = {"timeout_s": 5.0, "retries": 0, "backoff_s": 0.01}


class Recording:
    """A scorer that records the batch size of every call it gets (0.5 per atom)."""

    def __init__(self):
        self.batches: list[int] = []

    def score(self, images, graphs):
        self.batches.append(len(graphs))
        h, w = images.shape[-2:]
        return [(np.full(len(g.atoms()), 0.5, np.float32),
                 np.ones((len(g.atoms()), h, w), np.float32)) for g in graphs]


@pytest.fixture(scope="module")
def batch():
    records = (enumerate_prompts("single_object") * 7)[:7]
    graphs = [graph_from_geneval(r) for r in records]
    return torch.zeros(len(graphs), 3, 8, 8), graphs


def test_over_the_cap_is_a_413_naming_the_cap_and_the_model_never_sees_it(batch):
    images, graphs = batch
    scorer = Recording()
    with serve_in_thread(make_app(scorer, "recording", max_images=4)) as url, \
            httpx.Client() as client:
        health = client.get(url + "/health").json()
        assert health["max_images_per_request"] == 4
        over = client.post(url + "/score", content=encode_request(images[:5], graphs[:5]))
        assert over.status_code == 413
        assert "5 images in one request" in over.json()["error"]
        assert "at most 4 per request" in over.json()["error"]
        at_cap = client.post(url + "/score", content=encode_request(images[:4], graphs[:4]))
        assert at_cap.status_code == 200
    assert scorer.batches == [4]


def test_the_client_splits_its_batches_to_the_stated_cap(batch):
    images, graphs = batch
    scorer = Recording()
    with serve_in_thread(make_app(scorer, "recording", max_images=3)) as url, \
            RemoteScorer(url, **FAST) as remote:
        assert remote.max_images == 3
        results = remote.score(images, graphs)
    assert scorer.batches == [3, 3, 1]
    assert [len(s) for s, _ in results] == [len(g.atoms()) for g in graphs]


def test_the_default_cap_is_stated_and_the_verifier_matches_through_it(batch):
    images, graphs = batch
    verifier = load_scorer("shapes-verifier")
    with serve_in_thread(make_app(verifier.score, verifier.scorer_id)) as url, \
            RemoteScorer(url, **FAST) as remote:
        assert remote.max_images == DEFAULT_MAX_IMAGES
        remote.max_images = 2  # several requests, the same answers as one local call
        remote_scores = [s for s, _ in remote.score(images, graphs)]
    local_scores = [s for s, _ in verifier.score(images, graphs)]
    assert all(np.array_equal(a, b) for a, b in zip(remote_scores, local_scores))


def test_image_count_comes_from_the_header_alone(batch):
    images, graphs = batch
    body = encode_request(images, graphs)
    assert request_image_count(body) == len(graphs)
    size = int.from_bytes(body[:8], "little")
    assert request_image_count(body[: 8 + size]) == len(graphs)  # no tensor bytes needed
    for bad in (b"", b"junk", (2).to_bytes(8, "little") + json.dumps({}).encode()):
        assert request_image_count(bad) is None  # decode_request names the problem


def test_the_cli_refuses_a_cap_below_one():
    done = subprocess.run([sys.executable, "-m", "flows.scorer_service", "--scorer",
                           "shapes-verifier", "--max-images", "0"], check=False,
                          cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert "--max-images must be 1 or more; got 0" in done.stderr
