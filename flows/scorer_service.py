"""The scorer service: any scorer behind HTTP, so one model on its own GPUs serves many workers.

    cast serve-scorer --scorer shapes-verifier --host 127.0.0.1 --port 8765
    python -m flows.scorer_service --scorer soft-tifa --model PATH --device cuda

A Starlette app served by uvicorn. GET /health -> {"status": "ok", "scorer_id", "protocol_version",
"cast_version", "max_images_per_request"}; POST /score takes and returns safetensors bodies (wire
format in `cast_core.scorers.remote`, whose `RemoteScorer` is the client and splits its batches to
the cap). Requests are validated before the model sees them (400 naming what is wrong; 413 past
`max_body_bytes`, or with more than `max_images` images, counted from the body's header before it
is decoded); scorer calls run one at a time under a lock in a worker thread, so /health answers
while a batch is scored, and the cap bounds how long one request holds the lock (a single
8000-image request held it for 41 s); an exception in the scorer is a 500 carrying its text.

`make_app(scorer, scorer_id)` serves any scorer object (a `score(images, graphs)` method, or a
plain callable); the command line serves a scorer of `cast_core.scorers.registry` by name, whose
factories import their model code lazily: the service starts without the heavy dependencies of
scorers it does not serve.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cast_core.scorers.registry import SCORERS, ScorerArgs, load_scorer
from cast_core.scorers.remote import (
    PROTOCOL_VERSION,
    WireError,
    decode_request,
    encode_response,
    request_image_count,
)

DEFAULT_MAX_BODY_BYTES = 256 * 2**20
DEFAULT_MAX_IMAGES = 256
_log = logging.getLogger(__name__)


def cast_version() -> str:
    try:
        return version("cast-rl")
    except PackageNotFoundError:
        return "unknown"


def make_app(scorer, scorer_id: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
             max_images: int = DEFAULT_MAX_IMAGES) -> Starlette:
    """The HTTP app serving `scorer`: an object with `score(images, graphs)`, or that callable;
    at most `max_images` images per request."""
    score = getattr(scorer, "score", scorer)
    if not callable(score):
        raise TypeError(f"scorer must have score(images, graphs) or be callable; got {scorer!r}")
    if max_images < 1:
        raise ValueError(f"max_images must be >= 1; got {max_images}")
    lock = threading.Lock()

    def score_locked(images: torch.Tensor, graphs) -> bytes:
        with lock, torch.no_grad():
            results = list(score(images, graphs))
        if len(results) != len(graphs):
            raise RuntimeError(f"scorer returned {len(results)} results for {len(graphs)} images")
        return encode_response(results, scorer_id)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "scorer_id": scorer_id,
                             "protocol_version": PROTOCOL_VERSION, "cast_version": cast_version(),
                             "max_images_per_request": max_images})

    async def score_endpoint(request: Request) -> Response:
        body = await _read_body(request, max_body_bytes)
        if isinstance(body, Response):
            return body
        try:
            count = request_image_count(body)
            if count is not None and count > max_images:
                return _error(413, f"{count} images in one request; this service takes at most "
                                   f"{max_images} per request (max_images_per_request in GET "
                                   f"/health): send batches of at most {max_images}, or restart "
                                   f"the service with a larger --max-images")
            images, graphs = decode_request(body)
        except WireError as err:
            return _error(400, str(err))
        try:
            blob = await run_in_threadpool(score_locked, images, graphs)
        except Exception as err:  # noqa: BLE001 - any scorer failure goes back as text
            _log.exception("scorer %s failed", scorer_id)
            return _error(500, f"scorer {scorer_id} failed: {type(err).__name__}: {err}")
        return Response(blob, media_type="application/octet-stream")

    return Starlette(routes=[Route("/health", health, methods=["GET"]),
                             Route("/score", score_endpoint, methods=["POST"])])


async def _read_body(request: Request, limit: int) -> bytes | Response:
    """The body, or a 413/400 response when it is too large or the length header is bad."""
    too_large = _error(413, f"request body over the service's limit of {limit} bytes; send "
                            "fewer images per call or raise --max-body-mb")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        return too_large if declared.isdigit() else _error(400, "bad Content-Length header")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


@contextmanager
def serve_in_thread(app: Starlette, host: str = "127.0.0.1", port: int = 0,
                    start_timeout_s: float = 10.0) -> Iterator[str]:
    """Serve `app` from a background thread (port 0: a free one); yields its URL, stops on exit."""
    sock = _bind(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError(f"scorer service did not start within {start_timeout_s} s")
        time.sleep(0.01)
    try:
        yield _url(sock)
    finally:
        server.should_exit = True
        thread.join(start_timeout_s)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m flows.scorer_service",
                                description="Serve a CAST scorer over HTTP.")
    p.add_argument("--scorer", required=True, choices=sorted(SCORERS))
    p.add_argument("--model", default=None, help="local model folder (soft-tifa)")
    p.add_argument("--device", default="cpu", help="torch device for a model, e.g. cuda:0")
    p.add_argument("--dtype", default=None, help="model dtype, e.g. bfloat16 (default: saved)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765, help="0 picks a free port")
    p.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / 2**20)
    p.add_argument("--max-images", type=int, default=DEFAULT_MAX_IMAGES,
                   help="most images per request, stated in GET /health (bounds how long one "
                        "request holds the model)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.max_images < 1:
        print(f"scorer service: --max-images must be 1 or more; got {args.max_images}",
              file=sys.stderr)
        return 2
    try:
        loaded = load_scorer(args.scorer, ScorerArgs(args.model, args.device, args.dtype))
    except (ValueError, OSError, ImportError) as err:
        print(f"scorer service: {err}", file=sys.stderr)
        return 2
    app = make_app(loaded.score, loaded.scorer_id, int(args.max_body_mb * 2**20),
                   args.max_images)
    sock = _bind(args.host, args.port)
    print(f"serving {loaded.scorer_id} at {_url(sock)} (GET /health, POST /score, at most "
          f"{args.max_images} images a request); Ctrl-C stops", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="info", lifespan="off")).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shut down cleanly, then re-raised the signal
        pass
    print("scorer service stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
