#!/usr/bin/env bash
# CI: one real deployment end to end, exactly as the main job runs it (scripts/main.sh: a local
# server, a worker, `prefect deploy`, `prefect deployment run cast/train-iteration --watch`), on the
# small recipe data/recipes/shapes-ci.toml with a fresh store and a fresh PREFECT_HOME in a
# temporary directory; then DuckDB queries on the result; then main.sh once more at once, as a user
# re-runs it. Fails if any step fails, if the query returns no atom scores or no checkpoint, or if a
# server or worker process is left running; and, for the first hour of a new user (issue 19):
#   - the flow log shows the progress bars of window calibration and rollout (item 13);
#   - main.sh prints the labelled rollout contact sheet and the calibration plot, both exist and
#     both are Prefect image artifacts (item 14);
#   - the immediate re-run keeps the server's port (item 15) and trains iteration 1 without redoing
#     the run-level stages, which Prefect shows as Completed or Cached (README, item 16);
#   - the time of each run is printed (item 12).
# CAST_OVERRIDES defaults to '{"run.threads": 1}' (CI machines are small and shared);
# CAST_CI_KEEP=1 keeps the temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d "${TMPDIR:-/tmp}/cast-ci-deployment.XXXXXX")
finish() {
  local rc=$?
  CAST_PREFECT_DIR=$tmp/prefect bash scripts/prefect_local.sh stop >/dev/null 2>&1 || true
  if [ "${CAST_CI_KEEP:-0}" = 1 ] || [ "$rc" -ne 0 ]; then echo "[ci-deploy] kept $tmp"
  else rm -rf "$tmp"; fi
  exit "$rc"
}
trap finish EXIT
fail() { echo "[ci-deploy] FAIL: $*" >&2; exit 1; }
bash scripts/setup.sh >/dev/null
export CAST_PREFECT_DIR=$tmp/prefect CAST_STORE=$tmp/store
export CAST_OVERRIDES=${CAST_OVERRIDES:-'{"run.threads": 1}'}
# A free port other than 4200 (CI never meets a developer's server), the same for both runs.
export CAST_PREFECT_PORT=${CAST_PREFECT_PORT:-$(.venv/bin/python scripts/free_port.py 0)}
RUN=shapes-ci
REPORTS=$CAST_STORE/reports/$RUN
start=$(date +%s)

RECIPE=data/recipes/shapes-ci.toml bash scripts/main.sh 2>&1 | tee "$tmp/main-1.log"
first=$(($(date +%s) - start))

echo "[ci-deploy] checking the result"
for pidfile in "$CAST_PREFECT_DIR"/server.pid "$CAST_PREFECT_DIR"/worker.pid; do
  [ ! -f "$pidfile" ] || fail "$pidfile left behind"
done
if bash scripts/prefect_local.sh status >/dev/null 2>&1; then
  fail "server or worker still running after main.sh"
fi
count() { .venv/bin/python -m flows.cli sql "$1" --root "$CAST_STORE" --format csv | tail -n 1; }
scores=$(count "SELECT count(*) FROM atom_scores WHERE run_id = '$RUN' AND iteration = 0")
checkpoints=$(count "SELECT count(*) FROM checkpoints WHERE run_id = '$RUN' AND iteration = 0")
echo "[ci-deploy] iteration 0: $scores atom score rows, $checkpoints checkpoint rows"
if ! [ "$scores" -gt 0 ] 2>/dev/null || ! [ "$checkpoints" -eq 1 ] 2>/dev/null; then
  fail "expected atom scores and one checkpoint for iteration 0"
fi

# item 13: the bars reach the flow's log (the worker's output, which main.sh shows)
for bar in "window calibration (4 prompts): 100%" "rollout 0 (16 samples): 100%"; do
  grep -qF "$bar" "$CAST_PREFECT_DIR/worker.log" || fail "no progress line '$bar' in the flow log"
done
# item 14: the pictures exist, main.sh printed where, and Prefect holds them as artifacts
for picture in "$REPORTS/iteration-00000-rollouts.png" "$REPORTS/window-calibration.png"; do
  [ -s "$picture" ] || fail "no $picture"
  grep -qF "$picture" "$tmp/main-1.log" || fail "main.sh did not print $picture"
done
.venv/bin/python - "$CAST_PREFECT_DIR/home/prefect.db" "$RUN" <<'PY' || fail "image artifacts"
import sqlite3
import sys

db, run = sys.argv[1:]
with sqlite3.connect(db) as con:
    rows = dict(con.execute("SELECT key, data FROM artifact WHERE type = 'image'").fetchall())
for name in ("rollouts", "window-calibration"):
    data = rows.get(f"{run}-{name}") or ""
    if not data.startswith('"data:image/png;base64,'):
        sys.exit(f"[ci-deploy] no image artifact {run}-{name} in {db}")
print(f"[ci-deploy] image artifacts {run}-rollouts and {run}-window-calibration are in Prefect")
PY
port=$(cat "$CAST_PREFECT_DIR/port")

echo "[ci-deploy] main.sh again, at once (the next iteration)"
start=$(date +%s)
RECIPE=data/recipes/shapes-ci.toml bash scripts/main.sh > "$tmp/main-2.log" 2>&1 ||
  { cat "$tmp/main-2.log"; fail "the second main.sh failed"; }
second=$(($(date +%s) - start))
# item 15: the port in TIME-WAIT after the first server stopped is the second server's port
[ "$(cat "$CAST_PREFECT_DIR/port")" = "$port" ] ||
  fail "the re-run moved from port $port to $(cat "$CAST_PREFECT_DIR/port")"
checkpoints=$(count "SELECT count(*) FROM checkpoints WHERE run_id = '$RUN' AND iteration = 1")
[ "$checkpoints" -eq 1 ] || fail "the re-run wrote $checkpoints checkpoints for iteration 1"
# item 16: the run-level stages ran once; what Prefect showed for them on the re-run
for stage in build_csgs calibrate_window; do
  runs=$(count "SELECT count(*) FROM stages WHERE run_id = '$RUN' AND stage = '$stage'")
  [ "$runs" -eq 1 ] || fail "$stage ran $runs times in two runs"
  shown=$(grep -oE "Task run '$stage-[^']*' - Finished in state [A-Za-z]+" \
    "$CAST_PREFECT_DIR/worker.log" | grep -oE "[A-Za-z]+$" || true)
  case $shown in
    Completed|Cached) echo "[ci-deploy] re-run: $stage skipped by the store, Prefect shows $shown" ;;
    *) fail "re-run: Prefect showed '$shown' for $stage (README: Completed or Cached)" ;;
  esac
done
echo "[ci-deploy] OK: first run ${first} s, re-run ${second} s, port $port both times" \
  "($(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg))"
