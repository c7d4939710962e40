#!/usr/bin/env bash
# The test command: set-up (idempotent) then the default test run (slow tests excluded).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ $# -eq 0 ]; then set -- -m "not slow"; fi
exec .venv/bin/python -m pytest "$@"
