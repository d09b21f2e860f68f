#!/usr/bin/env bash
# Set up a virtual environment with lm-eval-safe and its test tools.
#   bash scripts/setup.sh [VENV]        (default: .venv)
# torch is installed first and pinned to 2.13.0 (on a machine without a GPU this is the CPU
# build); pyproject.toml leaves torch open so GPU users keep their own build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
"$VENV/bin/python" -m pip install -q -e ".[test]"
echo "ready: source $VENV/bin/activate"
