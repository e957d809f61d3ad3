#!/usr/bin/env bash
# Install lightning_mmpp (editable) and, with "test" or "bench", its extras.
# Where no torch is installed yet, take the CPU build first: a bare `torch` requirement would
# otherwise pull a multi-GB CUDA build. An existing torch (a CUDA build on a GPU box) is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet torch==2.13.0 \
    || "$PY" -m pip install --quiet torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
fi
extras=${1:-}
if [ -n "$extras" ]; then
  "$PY" -m pip install --quiet -e ".[$extras]"
else
  "$PY" -m pip install --quiet -e .
fi
