#!/usr/bin/env bash
# CI: one real deployment end to end, exactly as the main job runs it (scripts/main.sh: a local
# server, a worker, `prefect deploy`, `prefect deployment run cast/train-iteration --watch`), on the
# small recipe data/recipes/shapes-ci.toml with a fresh store and a fresh PREFECT_HOME in a
# temporary directory; then DuckDB queries on the result. Fails if any step fails, if the query
# returns no atom scores or no checkpoint, or if a server or worker process is left running.
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
export CAST_PREFECT_DIR=$tmp/prefect CAST_STORE=$tmp/store
export CAST_OVERRIDES=${CAST_OVERRIDES:-'{"run.threads": 1}'}
# A port other than 4200, so that CI never meets a developer's server.
export CAST_PREFECT_PORT=${CAST_PREFECT_PORT:-0}
start=$(date +%s)

RECIPE=data/recipes/shapes-ci.toml bash scripts/main.sh

echo "[ci-deploy] checking the result"
for pidfile in "$CAST_PREFECT_DIR"/server.pid "$CAST_PREFECT_DIR"/worker.pid; do
  if [ -f "$pidfile" ]; then echo "[ci-deploy] FAIL: $pidfile left behind" >&2; exit 1; fi
done
if bash scripts/prefect_local.sh status >/dev/null 2>&1; then
  echo "[ci-deploy] FAIL: server or worker still running after main.sh" >&2
  exit 1
fi
count() { .venv/bin/python -m flows.cli sql "$1" --root "$CAST_STORE" --format csv | tail -n 1; }
scores=$(count "SELECT count(*) FROM atom_scores WHERE run_id = 'shapes-ci' AND iteration = 0")
checkpoints=$(count "SELECT count(*) FROM checkpoints WHERE run_id = 'shapes-ci' AND iteration = 0")
echo "[ci-deploy] iteration 0: $scores atom score rows, $checkpoints checkpoint rows"
if ! [ "$scores" -gt 0 ] 2>/dev/null || ! [ "$checkpoints" -eq 1 ] 2>/dev/null; then
  echo "[ci-deploy] FAIL: expected atom scores and one checkpoint for iteration 0" >&2
  exit 1
fi
echo "[ci-deploy] OK in $(($(date +%s) - start)) s"
