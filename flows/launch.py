"""Running a flow from the command line: check first, then a Prefect server that the command owns,
then the slow imports and the flow (issue 19, items 6, 8 and 9).

`launch(module, args)` is what `python -m flows.cast` and `python -m flows.evaluate` run before they
import torch or Prefect:

1. the recipe, its overrides and every path they name are checked (`flows.preflight`); a problem
   ends the command in about a second with one line per problem and exit status 2;
2. with `PREFECT_API_URL` set (e.g. `eval "$(bash scripts/prefect_local.sh env)"`), that server
   must answer, else one line says how to start it; without it a temporary server is started for
   this command (`flows.api_server`: it waits up to `CAST_SERVER_TIMEOUT` s, default 240, and dies
   with the command, even on SIGKILL);
3. `module.run(args, overrides)` imports the stages and runs the flow; a failed flow run ends with
   one line under Prefect's own log of it, and exit status 1. On a temporary server flow runs send
   no heartbeats (`command_settings`).

The server starts before the ~9 s of imports, so the two overlap.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from flows.api_server import ApiServerError, healthy, temporary_api_server
from flows.preflight import checked_recipe
from tasks.stages.recipe import RecipeError, parse_overrides
from tasks.store.locations import store_root

DEFAULT_SERVER_TIMEOUT_S = 240.0
QUIET_ENV = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}


def _say(tag: str, text: str) -> None:
    print("\n".join(f"[{tag}] {line}" for line in text.splitlines()), file=sys.stderr, flush=True)


def server_timeout_s() -> float:
    """$CAST_SERVER_TIMEOUT in seconds (default 240); a clear error when it is not a number."""
    text = os.environ.get("CAST_SERVER_TIMEOUT", str(DEFAULT_SERVER_TIMEOUT_S))
    try:
        return float(text)
    except ValueError:
        raise ApiServerError(f"CAST_SERVER_TIMEOUT={text!r} is not a number of seconds") from None


def prefect_home() -> Path:
    """$PREFECT_HOME, else Prefect's default ~/.prefect."""
    return Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()


def temporary_server_settings() -> dict:
    """The Prefect settings of flow runs on a server that dies with the command: no flow-run
    heartbeats. Heartbeats feed a server's detection of crashed runs, which a temporary server
    does not keep; and Prefect's heartbeat thread sleeps in whole seconds and is joined when the
    flow run ends, so each flow run would end up to a second late (about 0.5 s on average for an
    iteration's run)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY

    return {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}


def command_settings(url: str, temporary: bool) -> dict:
    """The Prefect settings a command's flow runs take: its API `url` and, on a `temporary`
    server, `temporary_server_settings`."""
    from prefect.settings import PREFECT_API_URL

    return {PREFECT_API_URL: url, **(temporary_server_settings() if temporary else {})}


def _run_with_api(module: str, args: argparse.Namespace, overrides: dict | None, url: str,
                  temporary: bool) -> None:
    os.environ["PREFECT_API_URL"] = url  # read by Prefect when it is first imported, just below
    flow_module = importlib.import_module(module)
    from prefect.settings import temporary_settings

    with temporary_settings(updates=command_settings(url, temporary)):
        try:
            flow_module.run(args, overrides)
        finally:
            _drain_prefect()


def _drain_prefect(timeout_s: float = 10.0) -> None:
    """Send Prefect's queued logs and events while the server still runs (else the exit hooks
    retry against a stopped server for a minute)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=timeout_s)
    EventsWorker.drain_all(timeout=timeout_s)


def launch(module: str, args: argparse.Namespace, tag: str = "cast") -> int:
    """Check, get an API server, run `module.run(args, overrides)`; the exit status."""
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    try:
        overrides = parse_overrides(args.set) or None
        checked_recipe(args.recipe, overrides, store_root(args.store))
    except RecipeError as err:
        _say(tag, str(err))
        return 2
    try:
        given = os.environ.get("PREFECT_API_URL")
        if given:
            if not healthy(given):
                raise ApiServerError(
                    f"PREFECT_API_URL={given} does not answer; start that server (bash "
                    f"scripts/prefect_local.sh start) or unset PREFECT_API_URL to use a "
                    f"temporary one")
            _run_with_api(module, args, overrides, given, temporary=False)
        else:
            log = prefect_home() / "cast-temporary-server.log"
            with temporary_api_server(server_timeout_s(), log,
                                      say=lambda text: _say(tag, text)) as url:
                _run_with_api(module, args, overrides, url, temporary=True)
    except ApiServerError as err:
        _say(tag, str(err))
        return 1
    except KeyboardInterrupt:
        _say(tag, "interrupted")
        return 130
    except ImportError:
        raise
    except Exception as err:  # noqa: BLE001 - Prefect has logged the traceback; one line here
        first = (str(err).splitlines() or [""])[0]
        _say(tag, f"the flow run failed: {type(err).__name__}: {first} (Prefect's log of it, "
                  f"with the traceback, is above)")
        return 1
    return 0
