"""Print the port for the local Prefect server: the wanted one when a server could bind it, else
any free one (issue 19, item 15).

    python scripts/free_port.py 4200

The probe binds with SO_REUSEADDR, as uvicorn (the server) does: a port whose last connections are
in TIME-WAIT, as the server's port is for about a minute after it stops, is free for the server, so
an immediate re-run keeps port 4200. On Linux SO_REUSEADDR never allows binding a port that a
socket still listens on, so a port in use is still seen as taken.
"""

from __future__ import annotations

import socket
import sys


def free_port(wanted: int, host: str = "127.0.0.1") -> int:
    """`wanted` when a server could bind it (0: none wanted), else a free port from the OS."""
    for port in (wanted, 0):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return probe.getsockname()[1]
    raise OSError(f"no free port on {host}")


if __name__ == "__main__":
    print(free_port(int(sys.argv[1]) if len(sys.argv) > 1 else 4200))
