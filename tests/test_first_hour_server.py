"""Issue 19, items 8 and 9: the Prefect server of a `python -m flows.cast` command dies with the
command, even on SIGKILL, and is given the time it needs to start (or one line says the fix).

The fast tests kill a real parent process with SIGKILL and watch a grandchild tied to it by
`flows.api_server.die_with_parent`; a control grandchild that is not tied to it survives, so the
test can tell the difference. The slow test does it end to end with the real command and server.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.api_server import ApiServerError, temporary_api_server
from flows.launch import DEFAULT_SERVER_TIMEOUT_S, command_settings, launch, server_timeout_s

REPO = Path(__file__).resolve().parent.parent

GRANDCHILD = """
import sys, time
from flows.api_server import die_with_parent
parent, mode = int(sys.argv[1]), sys.argv[2]
if mode != "none":
    die_with_parent(parent, pdeathsig=mode == "both")
print("ready", flush=True)
time.sleep(120)
"""

PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid()), sys.argv[2]])
print(child.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, which a container's PID 1 may never reap, is dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state != "Z"


def wait_gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return not alive(pid)


@pytest.mark.parametrize("mode", ["both", "watchdog", "none"])
def test_sigkill_of_the_parent_ends_a_tied_child_and_only_a_tied_one(mode):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, GRANDCHILD, mode], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert parent.stdout.readline().strip() == "ready"
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        gone = wait_gone(child, within_s=3.0)
        if mode == "none":
            assert not gone, "the control child died with its parent: the test cannot see orphans"
        else:
            assert gone, f"child {child} outlived its SIGKILLed parent (mode {mode})"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
        parent.stdout.close()


def test_a_server_that_does_not_answer_in_time_fails_in_one_line_naming_the_fix(tmp_path):
    server = temporary_api_server(0.0, tmp_path / "server.log", say=lambda text: None)
    with pytest.raises(ApiServerError) as caught, server:
        pytest.fail("the server cannot be healthy at once")
    message = str(caught.value)
    assert "\n" not in message
    assert "CAST_SERVER_TIMEOUT" in message and "prefect_local.sh start" in message


def test_the_server_gets_more_time_than_prefects_own_temporary_server(monkeypatch):
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    monkeypatch.delenv("CAST_SERVER_TIMEOUT", raising=False)
    # Prefect's 20 s is what a fresh database needs on an idle 2-core machine (a temporary server
    # with a new SQLite database took 17-22 s there); a busy machine needs several times more
    assert server_timeout_s() == DEFAULT_SERVER_TIMEOUT_S
    assert server_timeout_s() >= 10 * PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
    monkeypatch.setenv("CAST_SERVER_TIMEOUT", "soon")
    with pytest.raises(ApiServerError, match="CAST_SERVER_TIMEOUT='soon' is not a number"):
        server_timeout_s()


def test_an_api_url_that_does_not_answer_is_one_line_with_the_fix(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # discard port: refused
    args = argparse.Namespace(recipe=str(REPO / "data/recipes/shapes-ci.toml"), set=[],
                              store=str(tmp_path / "store"))
    assert launch("flows.cast", args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "PREFECT_API_URL=http://127.0.0.1:9/api does not answer" in err[0]
    assert "prefect_local.sh start" in err[0]


@pytest.mark.slow
def test_the_command_starts_a_fresh_server_and_sigkill_leaves_no_server(tmp_path):
    """A fresh PREFECT_HOME (a new database, the slow case of item 9), then SIGKILL (item 8)."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    env.pop("PREFECT_API_URL", None)
    command = [sys.executable, "-m", "flows.cast", "--recipe", "data/recipes/shapes-ci.toml",
               "--store", str(tmp_path / "store"), "--set", "run.threads=1"]
    main = subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in main.stderr:
            lines.append(line)
            if "Prefect server ready" in line:
                break
        assert any("Prefect server ready" in line for line in lines), "".join(lines)
        server = int(lines[0].split("(pid ")[1].split(",")[0])
        assert alive(server)
        main.send_signal(signal.SIGKILL)
        main.wait(10)
        assert wait_gone(server, within_s=15.0), f"server {server} outlived its killed command"
    finally:
        if main.poll() is None:
            main.kill()
        main.stderr.close()


def test_flow_runs_on_a_temporary_server_send_no_heartbeats():
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        get_current_settings,
        temporary_settings,
    )

    with temporary_settings(updates=command_settings("http://127.0.0.1:9/api", temporary=True)):
        assert get_current_settings().flows.heartbeat_frequency is None
        assert get_current_settings().api.url == "http://127.0.0.1:9/api"
    given = command_settings("http://127.0.0.1:9/api", temporary=False)  # a server that stays
    assert PREFECT_FLOWS_HEARTBEAT_FREQUENCY not in given
    assert given[PREFECT_API_URL] == "http://127.0.0.1:9/api"
