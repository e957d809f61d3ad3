#!/usr/bin/env bash
# Install lightning_mmpp (editable) and its extras, e.g. `scripts/install.sh test,examples`.
# Where no torch is installed yet, take the CPU build first: a bare `torch` requirement would
# otherwise pull a multi-GB CUDA build. An existing torch (a CUDA build on a GPU box) is kept:
# every later install pins it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet torch==2.13.0 \
    || "$PY" -m pip install --quiet torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
fi
TORCH=$("$PY" -c "import torch; print(torch.__version__)")
extras=${1:-}
if [[ ",$extras," == *",examples,"* ]] && ! "$PY" -c "import torchvision" >/dev/null 2>&1; then
  # timm imports torchvision. PyPI's torchvision wheel is built against CUDA torch and would pull
  # (or fail to load with) another torch: install the build matching this torch, without deps.
  TV=$("$PY" -c "v = '$TORCH'.split('+'); major, minor = v[0].split('.')[:2]; print(f'0.{int(minor) + 15}.*')")
  if [[ "$TORCH" == *+cpu ]]; then
    "$PY" -m pip install --quiet --no-deps "torchvision==$TV" --index-url https://download.pytorch.org/whl/cpu
  else
    "$PY" -m pip install --quiet --no-deps "torchvision==$TV"
  fi
fi
if [ -n "$extras" ]; then
  "$PY" -m pip install --quiet -e ".[$extras]" "torch==$TORCH"
else
  "$PY" -m pip install --quiet -e . "torch==$TORCH"
fi
# The only torchvision some registries offer is built against CUDA torch and fails to import
# beside a CPU torch (which then breaks every import of timm/transformers/lightning that probes
# it). Remove a torchvision that cannot load: the examples' tests then skip with that reason.
if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchvision') is None)" \
   && ! "$PY" -c "import torchvision" >/dev/null 2>&1; then
  echo "install.sh: torchvision does not load with torch $TORCH; uninstalling it (timm-based examples skip)" >&2
  "$PY" -m pip uninstall --quiet -y torchvision
fi
