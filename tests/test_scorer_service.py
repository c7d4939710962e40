"""The scorer service and its client over 127.0.0.1: bit-exact round trip against the local
verifier, clear errors (unreachable, wrong protocol, rejected requests), retries on 5xx only,
self_test against a stub scorer, request validation, and the CLI's start and Ctrl-C stop."""

import json
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from cast_core.csg.geneval import graph_from_geneval
from cast_core.scorers.registry import ScorerArgs, load_scorer
from cast_core.scorers.remote import RemoteScorer, RemoteScorerError, encode_request
from cast_core.shapes.prompts import TAGS, enumerate_prompts
from cast_core.shapes.render import render, sample_scene
from cast_core.shapes.verifier import verify
from flows.scorer_service import make_app, serve_in_thread

FAST = {"timeout_s": 5.0, "retries": 2, "backoff_s": 0.01}


def _scenes(n: int, seed: int):
    """n rendered scenes over all prompt tags: (images [n, 3, H, W] = uint8 / 255, graphs)."""
    prng, rng = random.Random(seed), np.random.default_rng(seed)
    records = [prng.choice(enumerate_prompts(TAGS[i % len(TAGS)])) for i in range(n)]
    pixels = np.stack([render(sample_scene(r, rng)).image for r in records])
    images = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255.0
    return images, [graph_from_geneval(r) for r in records]


@pytest.fixture(scope="module")
def scenes():
    return _scenes(6, 0)


@pytest.fixture(scope="module")
def verifier():
    return load_scorer("shapes-verifier")


@pytest.fixture(scope="module")
def verifier_url(verifier):
    with serve_in_thread(make_app(verifier.score, verifier.scorer_id)) as url:
        yield url


class _Counting:
    """ASGI wrapper: counts POST /score calls and answers the first `failures` with a 503."""

    def __init__(self, app, failures: int = 0):
        self.app, self.failures, self.calls = app, failures, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/score":
            self.calls += 1
            if self.calls <= self.failures:
                busy = JSONResponse({"error": "model still loading"}, status_code=503)
                return await busy(scope, receive, send)
        await self.app(scope, receive, send)


class _Constant:
    """A stub scorer: 0.5 for every atom, uniform heatmaps."""

    def score(self, images, graphs):
        h, w = images.shape[-2:]
        return [(np.full(len(g.atoms()), 0.5, np.float32), np.ones((len(g.atoms()), h, w)))
                for g in graphs]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_round_trip_equals_the_local_verifier_bit_for_bit(scenes, verifier, verifier_url):
    images, graphs = scenes
    noisy = (images + 0.01 * torch.randn(images.shape, generator=torch.Generator().manual_seed(0)))
    noisy = noisy.clamp(0, 1)
    # pipeline images travel as uint8 (lossless), any other float image as float32
    assert load_safetensors(encode_request(images, graphs))["images"].dtype == torch.uint8
    assert load_safetensors(encode_request(noisy, graphs))["images"].dtype == torch.float32
    with RemoteScorer(verifier_url, **FAST) as remote:
        assert remote.scorer_id == verifier.scorer_id
        for batch in (images, noisy):
            local = verify(batch, graphs)
            got = remote(batch, graphs)
            assert len(got) == len(graphs)
            for (scores, heatmaps), want, g in zip(got, local, graphs):
                assert scores.shape == (len(g.atoms()),)
                assert heatmaps.shape == (len(g.atoms()), *images.shape[-2:])
                assert np.array_equal(scores, want.scores)
                assert np.array_equal(heatmaps, want.heatmaps)
        assert max(s.max() for s, _ in remote(images, graphs)) > 0.99


def test_wrong_protocol_and_bad_health_are_named():
    def health(body):
        return lambda request: JSONResponse(body)

    wrong = Starlette(routes=[Route("/health", health({"status": "ok", "scorer_id": "x",
                                                       "protocol_version": 0}))])
    with serve_in_thread(wrong) as url, pytest.raises(RemoteScorerError) as info:
        RemoteScorer(url, **FAST)
    assert url in str(info.value) and "protocol 0" in str(info.value)

    text = Starlette(routes=[Route("/health", lambda request: PlainTextResponse("hello"))])
    with serve_in_thread(text) as url, pytest.raises(RemoteScorerError, match="not answer JSON"):
        RemoteScorer(url, **FAST)


def test_unreachable_service_fails_clearly_within_the_budget():
    url = f"http://127.0.0.1:{_free_port()}"
    start = time.monotonic()
    with pytest.raises(RemoteScorerError) as info:
        RemoteScorer(url, timeout_s=2.0, retries=2, backoff_s=0.05)
    assert time.monotonic() - start < 2.0
    assert url in str(info.value) and "3 attempts" in str(info.value)
    assert "unreachable" in str(info.value)
    with pytest.raises(ValueError, match="http://"):
        RemoteScorer("127.0.0.1:8765")


def test_5xx_is_retried_and_4xx_is_not(scenes, verifier):
    images, graphs = scenes
    flaky = _Counting(make_app(verifier.score, verifier.scorer_id), failures=1)
    with serve_in_thread(flaky) as url, RemoteScorer(url, **FAST) as remote:
        got = remote(images[:2], graphs[:2])
        assert flaky.calls == 2
        assert np.array_equal(got[0][0], verify(images[:1], graphs[:1])[0].scores)
        with pytest.raises(RemoteScorerError, match=r"HTTP 400.*\[0, 1\]"):
            remote(images[:2] * 2.0, graphs[:2])
        assert flaky.calls == 3

    def broken(images, graphs):
        raise RuntimeError("CUDA out of memory")

    counting = _Counting(make_app(broken, "broken-v1"))
    with serve_in_thread(counting) as url, RemoteScorer(url, **FAST) as remote:
        with pytest.raises(RemoteScorerError, match="3 attempts.*CUDA out of memory"):
            remote(images[:1], graphs[:1])
        assert counting.calls == 3


def test_self_test_catches_a_constant_scorer_and_passes_the_verifier(scenes, verifier_url):
    images, graphs = scenes
    with (serve_in_thread(make_app(_Constant(), "constant-v1")) as url,
          RemoteScorer(url, **FAST) as remote, pytest.raises(RemoteScorerError) as info):
        remote.self_test(images, graphs)
    assert "constant-v1" in str(info.value) and "same score 0.5" in str(info.value)
    with RemoteScorer(verifier_url, **FAST) as remote:
        report = remote.self_test(images, graphs)
    assert report.images == 2 * len(graphs) + 1
    assert report.score_max > 0.99 and report.score_min < 0.05
    assert report.matched_mean > 0.99 and report.mismatched_mean < 0.7


def _body(images, graphs, *, version="1", name="images"):
    meta = {"protocol_version": version}
    if graphs is not None:
        meta["graphs"] = json.dumps(graphs)
    return save_safetensors({name: images.contiguous()}, metadata=meta)


def test_malformed_requests_get_a_400_that_says_what_is_wrong(scenes, verifier):
    images, graphs = scenes
    x, dicts = images[:2].contiguous(), [g.to_dict() for g in graphs[:2]]
    broken_graph = json.loads(json.dumps(dicts[0]))
    broken_graph["nodes"][0]["atoms"][0]["parents"] = ["nowhere"]
    cases = {
        b"not safetensors": "not a safetensors blob",
        _body(x, dicts, version="7"): "protocol '7'",
        _body(x, dicts, name="pixels"): "exactly one tensor 'images'",
        _body(x[:, :1], dicts): "[N, 3, H, W]",
        _body((x * 255).int(), dicts): "dtype",
        _body(x * 3, dicts): "[0, 1]",
        _body(x, None): "no 'graphs'",
        _body(x, dicts[:1]): "2 images, 1 graphs",
        _body(x, [dicts[0], broken_graph]): "graphs[1]",
        _body(x, [dicts[0], {"prompt": "p"}]): "graphs[1]: malformed",
    }
    app = make_app(verifier.score, verifier.scorer_id, max_body_bytes=100_000)
    with serve_in_thread(app) as url, httpx.Client() as client:
        for body, phrase in cases.items():
            response = client.post(url + "/score", content=body)
            assert response.status_code == 400, (phrase, response.text)
            assert phrase in response.json()["error"], (phrase, response.json())
        big = client.post(url + "/score", content=_body(torch.zeros(40, 3, 32, 32), None))
        assert big.status_code == 413 and "limit of 100000 bytes" in big.json()["error"]
        assert client.get(url + "/health").json()["protocol_version"] == 1


def test_registry_names_what_it_knows():
    with pytest.raises(ValueError, match=r"unknown scorer 'nope'.*shapes-verifier"):
        load_scorer("nope")
    with pytest.raises(ValueError, match="no model"):
        load_scorer("shapes-verifier", ScorerArgs(model="some/path"))
    with pytest.raises(ValueError, match="needs --model"):
        load_scorer("soft-tifa")


def test_cli_prints_url_and_id_and_stops_on_ctrl_c(verifier):
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.scorer_service", "--scorer", "shapes-verifier",
         "--port", "0"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "the service printed nothing within 120 s"
        line = proc.stdout.readline()
        match = re.search(r"serving (.+) at (http://\S+) ", line)
        assert match and match.group(1) == verifier.scorer_id, line
        with RemoteScorer(match.group(2), **FAST) as remote:
            assert remote.scorer_id == verifier.scorer_id
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill() if proc.poll() is None else None
    assert proc.returncode == 0, out
    assert "scorer service stopped" in out
