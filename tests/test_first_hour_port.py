"""Issue 19, item 15: the local Prefect server keeps port 4200 on an immediate re-run. After a
server stops, its port sits in TIME-WAIT for about a minute; a server binds it anyway (uvicorn sets
SO_REUSEADDR), so the port probe of scripts/prefect_local.sh must count it as free, and must still
count a port that a server listens on as taken."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "free_port.py"
_spec = importlib.util.spec_from_file_location("free_port", SCRIPT)  # scripts/ is no package
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
free_port = _module.free_port


def listener(port: int = 0) -> socket.socket:
    """A listening socket bound as uvicorn binds (SO_REUSEADDR)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def port_in_time_wait() -> int:
    """A port whose server closed a connection first and then stopped: its side is in TIME-WAIT."""
    server = listener()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server closes first, so the server's side ends in TIME-WAIT
    assert client.recv(1) == b""
    client.close()
    server.close()
    time.sleep(0.2)
    return port


def plain_bind_fails(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


def test_a_port_in_time_wait_is_kept():
    port = port_in_time_wait()
    if not plain_bind_fails(port):  # the old probe (a plain bind) moved off such a port
        pytest.skip("this kernel lets a plain bind reuse a TIME-WAIT port; nothing to show")
    assert free_port(port) == port
    done = subprocess.run([sys.executable, str(SCRIPT), str(port)], check=True,
                          capture_output=True, text=True)
    assert done.stdout.strip() == str(port)
    with listener(port):  # and a server really binds it
        pass


def test_a_port_a_server_listens_on_is_taken():
    with listener() as busy:
        port = busy.getsockname()[1]
        other = free_port(port)
        assert other != port and other > 0


def test_port_zero_means_any_free_port():
    assert free_port(0) > 0
