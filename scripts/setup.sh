#!/usr/bin/env bash
# One-time set-up: a virtual environment in .venv with the CPU torch pin first, then the project.
# Safe to re-run: it only installs what is missing. GPU users: set CAST_TORCH_SPEC to the torch
# build they want (e.g. CAST_TORCH_SPEC="torch==2.13.0" with their CUDA index) before running.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
TORCH_SPEC=${CAST_TORCH_SPEC:-torch==2.13.0}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.cast-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] .venv up to date"
else
  "$VPY" -m pip install -q --upgrade pip
  echo "[setup] installing $TORCH_SPEC first (the CPU build on this machine)"
  "$VPY" -m pip install -q "$TORCH_SPEC"
  echo "[setup] installing the project and its dependencies"
  "$VPY" -m pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
"$VPY" - <<'PY'
import importlib.util, torch
assert importlib.util.find_spec("torchvision") is None, (
    "torchvision is installed in .venv: it replaces the CPU torch and fails to import; "
    "remove it with .venv/bin/pip uninstall torchvision")
print(f"[setup] torch {torch.__version__}, cuda available: {torch.cuda.is_available()}")
PY
