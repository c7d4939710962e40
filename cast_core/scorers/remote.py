"""A scorer served elsewhere: the HTTP client, and the wire format it shares with the service.

`RemoteScorer(url)` has the scorer protocol's call signature, `score(images, graphs) -> [(scores
[A], heatmaps [A, h, w])]`, and forwards each call to a `flows.scorer_service` process (one
model on its own GPUs, many pipeline workers). At construction it asks the service's `/health`
for its scorer id, protocol version and cap on images per request, and refuses a service that is
unreachable or speaks another protocol; `score` splits a batch larger than the cap into requests
of at most the cap (a service that states no cap gets the whole batch). `self_test` catches a
broken or stub scorer before a run trusts it.

Wire format (protocol 1; no pickle anywhere). Both bodies are one safetensors blob:
- POST /score request: tensor "images" [N, 3, H, W], uint8 (value * 255) when that is lossless
  (images decoded from uint8, as the pipeline's are) and float32 otherwise; metadata
  "protocol_version" and "graphs", a JSON list of N `SceneGraph.to_dict()`.
- 200 response: tensors "scores.{i}" float32 [A_i] and "heatmaps.{i}" float32 [A_i, h, w] for
  each image i, atoms in `graph.atoms()` order; metadata "protocol_version", "scorer_id", "count".
- GET /health: JSON {"status", "scorer_id", "protocol_version", "cast_version",
  "max_images_per_request"}.
- Errors: JSON {"error": message}; 4xx is the request's fault (not retried; 413 for a body over the
  byte limit or more images than the cap), 5xx the service's (retried with backoff, as are refused
  or dropped connections).
So the service reproduces a local scorer's output bit for bit on pipeline images.

Timeouts: each attempt waits at most `timeout_s`; a read timeout is not retried (the service
may still be scoring, and a retry would queue behind it), so a call takes at most
(retries + 1) * timeout_s + backoff_s * (2^retries - 1).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Self

import httpx
import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from cast_core.csg.graph import CsgError, SceneGraph, validate_graph

PROTOCOL_VERSION = 1
_IMAGE_DTYPES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32)


class WireError(ValueError):
    """A request or response body that does not follow the wire format; the message says how."""


class RemoteScorerError(RuntimeError):
    """The scorer service is unreachable, incompatible, rejected the call or failed on it."""


def _metadata(blob: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors blob already parsed by safetensors (the header is an
    8-byte little-endian length followed by that many bytes of JSON)."""
    size = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + size]).get("__metadata__") or {}


def request_image_count(blob: bytes) -> int | None:
    """N of a request body's "images" [N, ...], read from the safetensors header alone (so a
    service can refuse an oversized batch before decoding it); None when the header does not
    say (`decode_request` then names what is wrong)."""
    try:
        size = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8 : 8 + size])
        return int(header["images"]["shape"][0])
    except (ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError):
        return None


def _load(blob: bytes, what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        tensors = load_safetensors(blob)
    except (SafetensorError, ValueError) as err:
        raise WireError(f"{what} body is not a safetensors blob ({err})") from err
    meta = _metadata(blob)
    version = meta.get("protocol_version")
    if version != str(PROTOCOL_VERSION):
        raise WireError(f"{what} speaks protocol {version!r}, this side speaks "
                        f"{PROTOCOL_VERSION}; run the same cast version on both sides")
    return tensors, meta


def encode_request(images: torch.Tensor, graphs: list[SceneGraph]) -> bytes:
    """images [N, 3, H, W] float in [0, 1] + N graphs -> request body."""
    x = images.detach().to("cpu", torch.float32).contiguous()
    q = (x * 255).round()
    lossless = bool(q.min() >= 0 and q.max() <= 255 and torch.equal(q / 255, x))
    meta = {"protocol_version": str(PROTOCOL_VERSION),
            "graphs": json.dumps([g.to_dict() for g in graphs])}
    return save_safetensors({"images": q.to(torch.uint8) if lossless else x}, metadata=meta)


def decode_request(blob: bytes) -> tuple[torch.Tensor, list[SceneGraph]]:
    """Request body -> (images [N, 3, H, W] float32 in [0, 1], N validated graphs)."""
    tensors, meta = _load(blob, "request")
    if set(tensors) != {"images"}:
        raise WireError(f"request must hold exactly one tensor 'images'; got {sorted(tensors)}")
    images = tensors["images"]
    if images.ndim != 4 or images.shape[1] != 3 or images.shape[0] == 0:
        raise WireError(f"images must be [N, 3, H, W] with N >= 1; got {list(images.shape)}")
    if images.dtype not in _IMAGE_DTYPES:
        raise WireError(f"images dtype must be one of uint8, float16, bfloat16, float32; got "
                        f"{images.dtype}")
    images = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    if not bool(torch.isfinite(images).all() and images.min() >= 0 and images.max() <= 1):
        raise WireError("float images must be finite and in [0, 1]; got values in "
                        f"[{images.min().item():.4g}, {images.max().item():.4g}]")
    return images, _graphs(meta, len(images))


def _graphs(meta: dict[str, str], n: int) -> list[SceneGraph]:
    if "graphs" not in meta:
        raise WireError("request metadata has no 'graphs' (a JSON list of SceneGraph.to_dict())")
    try:
        dicts = json.loads(meta["graphs"])
    except json.JSONDecodeError as err:
        raise WireError(f"request metadata 'graphs' is not JSON ({err})") from err
    if not isinstance(dicts, list) or len(dicts) != n:
        got = f"{len(dicts)} graphs" if isinstance(dicts, list) else type(dicts).__name__
        raise WireError(f"'graphs' must be a list of one graph per image: {n} images, {got}")
    graphs = []
    for i, d in enumerate(dicts):
        try:
            graph = SceneGraph.from_dict(d)
            validate_graph(graph)
        except (CsgError, AttributeError) as err:
            raise WireError(f"graphs[{i}]: {err}") from err
        graphs.append(graph)
    return graphs


def encode_response(results, scorer_id: str) -> bytes:
    """[(scores [A], heatmaps [A, h, w])] -> response body (float32)."""
    tensors = {}
    for i, (scores, heatmaps) in enumerate(results):
        tensors[f"scores.{i}"] = torch.from_numpy(np.ascontiguousarray(scores, np.float32))
        tensors[f"heatmaps.{i}"] = torch.from_numpy(np.ascontiguousarray(heatmaps, np.float32))
    meta = {"protocol_version": str(PROTOCOL_VERSION), "scorer_id": scorer_id,
            "count": str(len(results))}
    return save_safetensors(tensors, metadata=meta)


def decode_response(blob: bytes, graphs: list[SceneGraph]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Response body -> one (scores [A], heatmaps [A, h, w]) per graph, checked against atoms."""
    tensors, _ = _load(blob, "response")
    out = []
    for i, graph in enumerate(graphs):
        scores, heatmaps = tensors.get(f"scores.{i}"), tensors.get(f"heatmaps.{i}")
        n_atoms = len(graph.atoms())
        if scores is None or heatmaps is None:
            raise WireError(f"response lacks scores.{i} / heatmaps.{i} ({len(graphs)} expected)")
        if tuple(scores.shape) != (n_atoms,) or heatmaps.ndim != 3 or len(heatmaps) != n_atoms:
            raise WireError(f"image {i}: {n_atoms} atoms, but scores {list(scores.shape)} and "
                            f"heatmaps {list(heatmaps.shape)} came back")
        out.append((scores.numpy(), heatmaps.numpy()))
    return out


@dataclass(frozen=True)
class SelfTestReport:
    """What `self_test` scored: images (matched, mismatched and one black), atoms, score range,
    and the mean score of the matched (image i, graph i) and mismatched (image i, graph i + 1)
    pairs; a working scorer puts the first well above the second."""

    images: int
    atoms: int
    score_min: float
    score_max: float
    matched_mean: float
    mismatched_mean: float


class RemoteScorer:
    """Client of a scorer service; `score` (also `__call__`) follows the scorer protocol.

    url: the service root, e.g. "http://10.0.0.5:8765". timeout_s: per attempt. retries: extra
    attempts on refused/dropped connections and 5xx. backoff_s: sleep before retry k is
    backoff_s * 2^k."""

    def __init__(self, url: str, timeout_s: float = 300.0, retries: int = 3,
                 backoff_s: float = 1.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://; got {url!r}")
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError(f"need timeout_s > 0, retries >= 0, backoff_s >= 0; got "
                             f"{timeout_s}, {retries}, {backoff_s}")
        self.url, self.timeout_s, self.retries, self.backoff_s = (
            url.rstrip("/"), timeout_s, retries, backoff_s)
        self._client = httpx.Client(timeout=timeout_s)
        try:
            self.scorer_id, self.max_images = self._check_health()
        except BaseException:
            self._client.close()
            raise

    def _check_health(self) -> tuple[str, int | None]:
        """(scorer id, cap on images per request or None) from the service's /health."""
        response = self._request("GET", "/health")
        try:
            health = response.json()
        except ValueError as err:
            raise RemoteScorerError(f"{self.url}/health did not answer JSON (HTTP "
                                    f"{response.status_code}): {response.text[:200]!r}") from err
        if response.status_code != 200 or health.get("status") != "ok":
            raise RemoteScorerError(f"{self.url}/health is not ok (HTTP {response.status_code}): "
                                    f"{health}")
        if health.get("protocol_version") != PROTOCOL_VERSION:
            raise RemoteScorerError(
                f"{self.url} speaks scorer protocol {health.get('protocol_version')!r}, this "
                f"client speaks {PROTOCOL_VERSION} (service cast {health.get('cast_version')}); "
                "run the same cast version on both sides")
        if not isinstance(health.get("scorer_id"), str):
            raise RemoteScorerError(f"{self.url}/health gave no scorer_id: {health}")
        cap = health.get("max_images_per_request")
        if cap is not None and not (isinstance(cap, int) and cap >= 1):
            raise RemoteScorerError(f"{self.url}/health gave a bad max_images_per_request: {cap!r}")
        return health["scorer_id"], cap

    def _request(self, method: str, path: str, content: bytes | None = None) -> httpx.Response:
        """One call with retries; returns any response below 500."""
        failure = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = self._client.request(method, self.url + path, content=content)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError, httpx.WriteError,
                    httpx.RemoteProtocolError) as err:
                failure = f"unreachable ({type(err).__name__}: {err})"
                continue
            except httpx.TimeoutException as err:
                raise RemoteScorerError(
                    f"{self.url}{path} gave no answer within timeout_s={self.timeout_s} "
                    f"({type(err).__name__}); raise the timeout or send smaller batches") from err
            if response.status_code < 500:
                return response
            failure = f"HTTP {response.status_code}: {_error_text(response)}"
        raise RemoteScorerError(f"scorer service {self.url}{path} failed after "
                                f"{self.retries + 1} attempts; last: {failure}")

    def score(self, images: torch.Tensor, graphs: list[SceneGraph]):
        """images [N, 3, H, W] in [0, 1], N graphs -> [(scores [A], heatmaps [A, h, w])]."""
        if len(images) != len(graphs):
            raise ValueError(f"one graph per image: got {len(images)} images, {len(graphs)} "
                             "graphs")
        step = self.max_images or len(graphs)
        return [result for lo in range(0, len(graphs), step)
                for result in self._score_one(images[lo : lo + step], graphs[lo : lo + step])]

    def _score_one(self, images: torch.Tensor, graphs: list[SceneGraph]):
        """One POST /score of at most the service's cap of images."""
        response = self._request("POST", "/score", encode_request(images, graphs))
        if response.status_code != 200:
            raise RemoteScorerError(f"{self.url}/score rejected the request (HTTP "
                                    f"{response.status_code}): {_error_text(response)}")
        try:
            return decode_response(response.content, graphs)
        except WireError as err:
            raise RemoteScorerError(f"{self.url}/score sent a bad response: {err}") from err

    __call__ = score

    def self_test(self, images: torch.Tensor, graphs: list[SceneGraph]) -> SelfTestReport:
        """Score varied inputs: each image with its own graph, each with the next image's graph,
        and a black image with graphs[0]. Raise when every atom got the same score (a broken or
        stub scorer) or a score left [0, 1]. images [N, 3, H, W] in [0, 1]."""
        n = len(graphs)
        rolled = [graphs[(i + 1) % n] for i in range(n)]
        batch = torch.cat([images, images, torch.zeros_like(images[:1])])
        results = self.score(batch, [*graphs, *rolled, graphs[0]])
        per_image = [s for s, _ in results]
        scores = np.concatenate(per_image)
        report = SelfTestReport(
            len(results), len(scores), float(scores.min()), float(scores.max()),
            float(np.concatenate(per_image[:n]).mean()),
            float(np.concatenate(per_image[n : 2 * n]).mean()))
        if not (np.isfinite(scores).all() and report.score_min >= 0 and report.score_max <= 1):
            raise RemoteScorerError(f"{self.scorer_id} at {self.url} gave scores outside [0, 1]: "
                                    f"{report}")
        if report.score_max - report.score_min < 1e-6:
            raise RemoteScorerError(
                f"{self.scorer_id} at {self.url} gave the same score {report.score_min:.6g} to "
                f"all {report.atoms} atoms of {report.images} images (matched, mismatched and "
                "blank): a broken or stub scorer; check the model path and the service's log")
        return report

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _error_text(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"])
    except (ValueError, KeyError, TypeError):
        return response.text[:500]
