#!/usr/bin/env bash
# The main job in one command: set-up, a local Prefect server and worker, the deployments, then
# `prefect deployment run cast/train-iteration --watch` on the shapes CAST recipe, showing the
# flow's stage logs as they come (with progress bars for window calibration and rollout); then
# where the results are (with the labelled rollout contact sheet and the window calibration plot,
# also Prefect image artifacts) and one SQL query over this iteration's atom scores. Running it
# again runs the next iteration from the saved checkpoint. The recipe and the paths it names are
# checked first (`python -m flows.preflight`: one line per problem, exit 2).
#
#   bash scripts/main.sh
#
# Environment: RECIPE (default data/recipes/shapes-cast.toml), CAST_STORE (default runs/store),
# CAST_OVERRIDES (JSON of dotted recipe fields, e.g. '{"run.threads": 1}'), CAST_PREFECT_DIR
# (Prefect state, default runs/prefect-local). The server and worker are stopped at the end, also
# on failure or Ctrl-C, unless they were already running before (then they are left running); if
# this script is killed with SIGKILL, a watchdog it started stops them within ~2 s.
# Exit status: non-zero when any step or the flow run fails.
set -euo pipefail
cd "$(dirname "$0")/.."
RECIPE=${RECIPE:-data/recipes/shapes-cast.toml}
export CAST_STORE=${CAST_STORE:-runs/store}
case $CAST_STORE in /*) ;; *) CAST_STORE=$PWD/$CAST_STORE ;; esac
LOCAL=scripts/prefect_local.sh

bash scripts/setup.sh

# the run's id; checks the recipe, the overrides and every path they name before anything starts
# (one line per problem, exit 2)
RUN_ID=$(.venv/bin/python -m flows.preflight --recipe "$RECIPE" --overrides "${CAST_OVERRIDES:-}" \
  --store "$CAST_STORE" --tag main) || exit 2

tail_pid=""
run_pid=""
started_here=1
if bash "$LOCAL" status >/dev/null 2>&1; then started_here=0; fi
watchdog_pid=""
cleanup() {
  local rc=$?
  local pid
  for pid in $run_pid $tail_pid $watchdog_pid; do
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if [ "$started_here" = 1 ]; then
    echo "[main] stopping the Prefect server and worker"
    bash "$LOCAL" stop || rc=$((rc == 0 ? 1 : rc))
  else
    echo "[main] the Prefect server and worker were running before: left running"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

bash "$LOCAL" start
eval "$(bash "$LOCAL" env)"
if [ "$started_here" = 1 ]; then
  # SIGKILL skips the cleanup: then this watchdog stops the server and worker started here
  main_pid=$$
  ( while kill -0 "$main_pid" 2>/dev/null; do sleep 2; done
    bash "$LOCAL" stop >/dev/null 2>&1 ) </dev/null >/dev/null 2>&1 &
  watchdog_pid=$!
fi
echo "[main] deploying (prefect --no-prompt deploy --all)"
if ! bash "$LOCAL" deploy > "$CAST_PREFECT_DIR/deploy.log" 2>&1; then
  cat "$CAST_PREFECT_DIR/deploy.log" >&2
  echo "[main] deploy failed; its output is above" >&2
  exit 1
fi
grep -o "Deployment '[^']*' successfully [a-z]*" "$CAST_PREFECT_DIR/deploy.log" | sed 's/^/[main] /'

params=(-p "recipe=$RECIPE" -p "store=$CAST_STORE")
if [ -n "${CAST_OVERRIDES:-}" ]; then params+=(-p "overrides=$CAST_OVERRIDES"); fi
echo "[main] prefect deployment run cast/train-iteration ${params[*]} --watch"
echo "[main] the flow's logs follow (from the worker, $CAST_PREFECT_WORKER_LOG)"
tail -n0 -F --pid=$$ "$CAST_PREFECT_WORKER_LOG" 2>/dev/null &
tail_pid=$!
run_log=$CAST_PREFECT_DIR/last-run.log
rc=0
# in the background so that a signal to this script is handled at once (bash defers traps while a
# foreground command runs); the cleanup stops it
.venv/bin/prefect deployment run cast/train-iteration "${params[@]}" --watch --watch-interval 5 \
  > "$run_log" 2>&1 &
run_pid=$!
wait "$run_pid" || rc=$?
run_pid=""
sleep 1
kill "$tail_pid" 2>/dev/null || true
wait "$tail_pid" 2>/dev/null || true
tail_pid=""
grep -E "^Created flow run|UUID:|URL:|^Flow run finished" "$run_log" | sed 's/^/[main] /' || true
if [ "$rc" -ne 0 ]; then
  echo "[main] the flow run did not complete (exit $rc); logs: $CAST_PREFECT_WORKER_LOG," \
    "$run_log" >&2
  exit "$rc"
fi

cast_sql() { .venv/bin/python -m flows.cli sql "$@" --root "$CAST_STORE"; }
iteration=$(cast_sql "SELECT max(iteration) FROM atom_scores WHERE run_id = '$RUN_ID'" \
  --format csv | tail -n 1)
checkpoint=$(cast_sql "SELECT lora_path FROM checkpoints WHERE run_id = '$RUN_ID' \
  AND iteration = $iteration" --format csv | tail -n +2 | head -n 1)
reports=$CAST_STORE/reports/$RUN_ID
sheet=$reports/iteration-$(printf %05d "$iteration")-rollouts.png
pictures=""
if [ -f "$sheet" ]; then
  pictures+="  rollouts    $sheet  (prompt per row, mean atom score under each image)"$'\n'
fi
if [ -f "$reports/window-calibration.png" ]; then
  pictures+="  window      $reports/window-calibration.png  (the window calibration plot)"$'\n'
fi
QUERY="SELECT atom_type, count(*) AS atoms,
       round(avg(score), 3)::DOUBLE AS mean_score,
       round(avg((score > 0.5)::INT), 3)::DOUBLE AS pass_rate
FROM atom_scores
WHERE run_id = '$RUN_ID' AND iteration = $iteration
GROUP BY atom_type ORDER BY atom_type"

cat <<EOF

[main] run '$RUN_ID', iteration $iteration finished; running this again runs iteration $((iteration + 1))
  store       $CAST_STORE  (Parquet tables in tables/, images and tensors in blobs/)
  catalog     $CAST_STORE/catalog.duckdb  (DuckDB views over the tables)
  checkpoint  $CAST_STORE/${checkpoint:-?}  (LoRA weights of this iteration)
${pictures}  flow logs   $CAST_PREFECT_WORKER_LOG
  query more  .venv/bin/cast sql "SELECT ..." --root $CAST_STORE  (see: .venv/bin/cast examples)

[main] atom scores of iteration $iteration:
$QUERY;

EOF
cast_sql "$QUERY"
