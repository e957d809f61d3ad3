#!/usr/bin/env bash
# The prepared GPU check: one command, no arguments, exit status non-zero on any failure,
# a summary table at the end. With no GPU it runs its "no GPU" mode on CPU/gloo (what CI runs
# through tests/test_gpu_check.py). See scripts/gpu_check.py for what each mode covers.
# Installs nothing: it uses the torch and lightning already installed (scripts/install.sh test).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec timeout --kill-after=10 ${MMPP_GPU_CHECK_TIMEOUT:-470} "$PY" scripts/gpu_check.py
