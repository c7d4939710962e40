"""A temporary Prefect API server for one command, started so that it cannot outlive the command
and given the time it needs (issue 19, items 8 and 9).

Prefect 3 runs every flow against an API server. Without `PREFECT_API_URL` a flow call starts a
temporary one itself, with two flaws on a small machine: it gives up after
`PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS` (20 s by default, while a fresh database takes
17-22 s on an idle 2-core machine and more on a busy one), and when its parent is killed with
SIGKILL it keeps running, reparented to PID 1.

`temporary_api_server()` starts the same app (`prefect.server.api.server:create_app` under uvicorn,
UI off) in a child process of its own and waits for `/api/health` as long as `timeout_s`. The
parent binds the port (127.0.0.1, any free one) and hands the listening socket to the child, so no
other process can take the port between the choice and the bind. The child ties its life to the
parent's twice over: on Linux `prctl(PR_SET_PDEATHSIG, SIGTERM)`, which the kernel delivers when
the parent dies for any reason, and everywhere a watchdog thread that sees the parent gone (its
parent PID changes) and stops the server, with `os._exit` if the graceful stop hangs.

    python -m flows.api_server --fd FD --parent PID    (the child; started by the context manager)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# the settings Prefect's own temporary server runs with (prefect.server.api.server,
# SubprocessASGIServer._run_uvicorn_command): no UI, ephemeral mode, final app
SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
              "PREFECT__SERVER_FINAL": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
              "DO_NOT_TRACK": "1"}
PR_SET_PDEATHSIG = 1
WATCHDOG_PERIOD_S = 0.5
STOP_GRACE_S = 10.0


class ApiServerError(RuntimeError):
    """The temporary server did not come up; the message says why and what to do."""


def die_with_parent(parent: int, pdeathsig: bool = True) -> None:
    """End this process when the process `parent` dies: a parent-death signal (Linux, when
    `pdeathsig`) and a watchdog thread (all platforms) that sends SIGTERM to this process, then
    exits hard after STOP_GRACE_S. Exits at once if the parent is already gone."""
    if pdeathsig and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCHDOG_PERIOD_S)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(STOP_GRACE_S)
        os._exit(1)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def serve(fd: int) -> None:
    """Run Prefect's API app on the inherited listening socket `fd` until SIGTERM/SIGINT."""
    import uvicorn

    sock = socket.socket(fileno=fd)
    config = uvicorn.Config("prefect.server.api.server:create_app", factory=True,
                            log_level="error", lifespan="on",
                            timeout_graceful_shutdown=int(STOP_GRACE_S) // 2)
    uvicorn.Server(config).run(sockets=[sock])


def healthy(url: str, timeout_s: float = 3.0) -> bool:
    """True when `url`/health answers 200 within `timeout_s`."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    try:
        with direct.open(f"{url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except OSError:
        return False


def _log_tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(text[-lines:])


@contextmanager
def temporary_api_server(timeout_s: float, log_path: Path,
                         say=lambda message: print(message, file=sys.stderr, flush=True),
                         ) -> Iterator[str]:
    """Start the server, wait up to `timeout_s` for its health answer, yield its API URL
    (`http://127.0.0.1:PORT/api`), stop it on exit. Its output goes to `log_path`."""
    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/api"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "flows.api_server", "--fd", str(listener.fileno()),
             "--parent", str(os.getpid())],
            pass_fds=[listener.fileno()], env={**os.environ, **SERVER_ENV},
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    listener.close()
    try:
        say(f"starting a temporary Prefect server at {url} (pid {child.pid}, log {log_path}; "
            f"a new database takes 20-80 s on a busy 2-core machine)")
        started = time.monotonic()
        while not healthy(url, max(0.1, min(3.0, started + timeout_s - time.monotonic()))):
            if child.poll() is not None:
                raise ApiServerError(
                    f"the temporary Prefect server exited (code {child.returncode}) before it "
                    f"answered; its log {log_path} ends:\n{_log_tail(log_path)}")
            if time.monotonic() - started > timeout_s:
                raise ApiServerError(
                    f"the temporary Prefect server gave no answer in {timeout_s:.0f} s; raise "
                    f"CAST_SERVER_TIMEOUT, or start a server with `bash scripts/prefect_local.sh "
                    f"start` and run `eval \"$(bash scripts/prefect_local.sh env)\"` first")
            time.sleep(0.25)
        say(f"Prefect server ready after {time.monotonic() - started:.0f} s")
        yield url
    finally:
        child.terminate()
        try:
            child.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fd", type=int, required=True, help="inherited listening socket")
    parser.add_argument("--parent", type=int, required=True, help="PID whose death stops us")
    args = parser.parse_args(argv)
    die_with_parent(args.parent)
    serve(args.fd)


if __name__ == "__main__":
    main()
