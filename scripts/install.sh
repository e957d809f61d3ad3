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
if [ -n "$extras" ]; then
  "$PY" -m pip install --quiet -e ".[$extras]" "torch==$TORCH"
else
  "$PY" -m pip install --quiet -e . "torch==$TORCH"
fi
# Nothing here needs torchvision, but a torchvision built against another torch (the only one some
# registries offer is CUDA-linked) breaks every import of transformers/lightning that probes it:
# remove one that cannot load beside this torch.
if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchvision') is None)" \
   && ! "$PY" -c "import torchvision" >/dev/null 2>&1; then
  echo "install.sh: torchvision does not load with torch $TORCH; uninstalling it (nothing here needs it)" >&2
  "$PY" -m pip uninstall --quiet -y torchvision
fi
