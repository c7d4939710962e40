#!/usr/bin/env bash
# A local Prefect server (bound to 127.0.0.1) and one `process` worker for the CAST deployments.
#
#   bash scripts/prefect_local.sh start    server + work pool + worker (reuses running ones)
#   bash scripts/prefect_local.sh deploy   prefect --no-prompt deploy --all (needs `start`)
#   bash scripts/prefect_local.sh stop     stop the worker, then the server, by their recorded PIDs
#   bash scripts/prefect_local.sh status   what runs, where; exit 0 when both run, 3 otherwise
#   bash scripts/prefect_local.sh env      export lines for clients: eval "$(bash ... env)"
#
# State lives in $CAST_PREFECT_DIR (default runs/prefect-local, gitignored): PREFECT_HOME (the
# SQLite database), server.pid, worker.pid, port, server.log, worker.log. Analytics are off. The
# port is $CAST_PREFECT_PORT (default 4200) when free (a port in TIME-WAIT counts as free, as it
# does for the server: the same port on an immediate re-run), else any free one. The worker serves one
# flow run at a time and passes its environment (e.g. CAST_STORE) to the flow runs it starts.
# Before the worker starts, cron runs that were missed by more than 10 minutes while no worker
# ran are cancelled, so a stale nightly evaluation never competes with the run you asked for.
#
# Processes are started with job control (`set -m`): each gets its own process group, which
# `stop` signals as a whole (SIGTERM, then SIGKILL after $CAST_STOP_TIMEOUT s), together with
# every descendant found before signalling; `stop` fails if any of them survives. Without job
# control a worker started in the background by a script ignores the first SIGTERM and keeps
# taking runs; with `set -m` it stops within about a second.
set -euo pipefail
set -m
cd "$(dirname "$0")/.."
REPO=$PWD
STATE=${CAST_PREFECT_DIR:-$REPO/runs/prefect-local}
case $STATE in /*) ;; *) STATE=$REPO/$STATE ;; esac
POOL=cast-local  # also named in prefect.yaml
PREFECT=$REPO/.venv/bin/prefect
VPY=$REPO/.venv/bin/python
SERVER_TIMEOUT=${CAST_SERVER_TIMEOUT:-240}
STOP_TIMEOUT=${CAST_STOP_TIMEOUT:-30}

export PREFECT_HOME=$STATE/home PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
[ -x "$PREFECT" ] || { echo "[prefect] no $PREFECT: run bash scripts/setup.sh first" >&2; exit 2; }

say() { echo "[prefect] $*"; }
api_url() { echo "http://127.0.0.1:$(cat "$STATE/port")/api"; }
healthy() { [ -f "$STATE/port" ] && curl -fsS --max-time 3 "$(api_url)/health" >/dev/null 2>&1; }

# running PID: alive and not a zombie
running() { local s; s=$(ps -o stat= -p "$1" 2>/dev/null) || return 1; [[ $s != Z* ]]; }

# the PID recorded in $STATE/NAME.pid, printed only if that process still runs and is a prefect one
recorded() {
  local f=$STATE/$1.pid pid
  [ -f "$f" ] || return 1
  pid=$(cat "$f")
  running "$pid" && ours "$pid" && echo "$pid"
}

# ours PID: a process started with this state directory's PREFECT_HOME (guards against PID reuse)
ours() { tr '\0' '\n' < "/proc/$1/environ" 2>/dev/null | grep -qxF "PREFECT_HOME=$PREFECT_HOME"; }

descendants() {
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do echo "$child"; descendants "$child"; done
}

# the wanted port (CAST_PREFECT_PORT, default 4200) when the server could bind it, also while it
# is in TIME-WAIT after the last server stopped; else any free port (scripts/free_port.py)
free_port() { "$VPY" "$REPO/scripts/free_port.py" "${CAST_PREFECT_PORT:-4200}"; }

start_server() {
  local pid port waited=0
  if pid=$(recorded server); then
    say "server already running (pid $pid)"
  else
    port=$(free_port)
    echo "$port" > "$STATE/port"
    echo "=== $(date -u +%FT%TZ) prefect server start --host 127.0.0.1 --port $port" \
      >> "$STATE/server.log"
    "$PREFECT" server start --host 127.0.0.1 --port "$port" </dev/null >>"$STATE/server.log" 2>&1 &
    pid=$!
    echo "$pid" > "$STATE/server.pid"
    say "server starting (pid $pid) on $(api_url), log $STATE/server.log"
  fi
  until healthy; do
    if ! running "$pid"; then
      tail -n 30 "$STATE/server.log" >&2
      say "the server exited before answering; its log is above" >&2
      return 1
    fi
    if [ "$waited" -ge "$SERVER_TIMEOUT" ]; then
      say "no answer from $(api_url)/health after ${SERVER_TIMEOUT}s (CAST_SERVER_TIMEOUT)" >&2
      return 1
    fi
    sleep 1
    waited=$((waited + 1))
  done
  say "server healthy at $(api_url) (UI: http://127.0.0.1:$(cat "$STATE/port"))"
}

ensure_pool() {
  if "$PREFECT" work-pool inspect "$POOL" >/dev/null 2>&1; then
    say "work pool $POOL exists"
  else
    "$PREFECT" work-pool create "$POOL" --type process >/dev/null
    say "work pool $POOL created (type process)"
  fi
}

skip_missed_runs() {
  "$VPY" - "$POOL" <<'PY'
import asyncio
import sys
from datetime import UTC, datetime, timedelta

from prefect import get_client
from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterNextScheduledStartTime,
                                            FlowRunFilterState, FlowRunFilterStateType,
                                            WorkPoolFilter, WorkPoolFilterName)
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelled


async def main(pool: str) -> None:
    before = datetime.now(UTC) - timedelta(minutes=10)
    async with get_client() as client:
        runs = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
                next_scheduled_start_time=FlowRunFilterNextScheduledStartTime(before_=before)),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])))
        for run in (r for r in runs if r.auto_scheduled):
            message = "missed its schedule while no worker ran; skipped"
            await client.set_flow_run_state(run.id, Cancelled(message=message), force=True)
            print(f"[prefect] skipped the missed scheduled run {run.name} "
                  f"(due {run.expected_start_time:%Y-%m-%d %H:%M} UTC)")


asyncio.run(main(sys.argv[1]))
PY
}

start_worker() {
  local pid waited=0
  if pid=$(recorded worker); then
    say "worker already running (pid $pid), log $STATE/worker.log"
    return 0
  fi
  skip_missed_runs
  : > "$STATE/worker.log"
  PREFECT_WORKER_QUERY_SECONDS=${PREFECT_WORKER_QUERY_SECONDS:-3} \
    "$PREFECT" worker start --pool "$POOL" --type process --limit 1 \
    </dev/null >>"$STATE/worker.log" 2>&1 &
  pid=$!
  echo "$pid" > "$STATE/worker.pid"
  until grep -q "started" "$STATE/worker.log"; do
    if ! running "$pid"; then
      tail -n 30 "$STATE/worker.log" >&2
      say "the worker exited at start; its log is above" >&2
      return 1
    fi
    [ "$waited" -lt 120 ] || { say "worker gave no start message in 120s" >&2; return 1; }
    sleep 1
    waited=$((waited + 1))
  done
  say "worker running (pid $pid, pool $POOL, store ${CAST_STORE:-runs/store})," \
    "log $STATE/worker.log"
}

stop_one() {
  local name=$1 pid pids p waited=0
  if ! pid=$(recorded "$name"); then
    rm -f "$STATE/$name.pid"
    return 0
  fi
  pids="$pid $(descendants "$pid" | tr '\n' ' ')"
  kill -TERM -- "-$pid" 2>/dev/null || true
  # shellcheck disable=SC2086  # word splitting of the PID list is intended
  kill -TERM $pids 2>/dev/null || true
  while :; do
    local alive=""
    if running "$pid"; then  # a worker may start a flow run while it stops: stop that one too
      for p in $(descendants "$pid"); do
        case " $pids " in
          *" $p "*) ;;
          *) pids="$pids $p"; kill -TERM "$p" 2>/dev/null || true ;;
        esac
      done
    fi
    for p in $pids; do running "$p" && alive="$alive $p"; done
    [ -z "$alive" ] && break
    if [ "$waited" -ge $((2 * STOP_TIMEOUT)) ]; then  # waited counts half seconds
      say "$name still running after ${STOP_TIMEOUT}s (pids$alive): SIGKILL"
      kill -KILL -- "-$pid" 2>/dev/null || true
      # shellcheck disable=SC2086
      kill -KILL $alive 2>/dev/null || true
      sleep 1
      alive=""
      for p in $pids; do running "$p" && alive="$alive $p"; done
      [ -z "$alive" ] || { say "could not stop $name: pids$alive" >&2; return 1; }
      break
    fi
    sleep 0.5
    waited=$((waited + 1))
  done
  rm -f "$STATE/$name.pid"
  say "$name stopped (pids $pids)"
}

cmd_start() {
  mkdir -p "$STATE"
  start_server
  export PREFECT_API_URL
  PREFECT_API_URL=$(api_url)
  ensure_pool
  start_worker
}

cmd_deploy() {
  if ! healthy; then
    say "no server answers: run \`bash scripts/prefect_local.sh start\` first" >&2
    exit 1
  fi
  export PREFECT_API_URL
  PREFECT_API_URL=$(api_url)
  # prefect.yaml's pull step takes the repository directory from $PWD at deploy time
  "$PREFECT" --no-prompt deploy --all
}

cmd_stop() {
  local rc=0
  stop_one worker || rc=1
  stop_one server || rc=1
  return $rc
}

cmd_status() {
  local pid up=0
  if pid=$(recorded server); then
    if healthy; then say "server pid $pid, healthy, API $(api_url)"; up=$((up + 1))
    else say "server pid $pid, not answering yet"; fi
  else
    say "server not running"
  fi
  if pid=$(recorded worker); then say "worker pid $pid, pool $POOL"; up=$((up + 1))
  else say "worker not running"; fi
  say "state in $STATE"
  [ "$up" -eq 2 ] || return 3
}

cmd_env() {
  echo "export PREFECT_HOME='$PREFECT_HOME'"
  echo "export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1"
  if [ -f "$STATE/port" ]; then echo "export PREFECT_API_URL='$(api_url)'"; fi
  echo "export CAST_PREFECT_DIR='$STATE' CAST_PREFECT_WORKER_LOG='$STATE/worker.log'"
}

case ${1:-} in
  start) cmd_start ;;
  deploy) cmd_deploy ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) cmd_env ;;
  *) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
