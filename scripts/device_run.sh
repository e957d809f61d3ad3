#!/usr/bin/env bash
# One prepared run on a lent GPU machine (fresh and bare, no internet), all logs under $OUT:
#
#   bash scripts/device_run.sh            # e.g. through the device tool with timeout_s=540
#
# Parts, in order, each under its own timeout and all of them within DEVICE_RUN_BUDGET seconds
# (default 450: the machine is lent for 15 minutes in all, its start included):
#   env       what is there: GPU (nvidia-smi), Python, torch / CUDA / NCCL / NVTX, lightning, pytest
#   install   nothing when torch, lightning, pytest and pytest-timeout already import (the package
#             then runs from this tree through PYTHONPATH); else `scripts/install.sh test`, which
#             keeps an installed (CUDA) torch. Offline, pip reaches wheels only: put them in
#             $MMPP_WHEELS (default shared/wheels or .whl, when present) and they are used alone
#   gpu_check `scripts/gpu_check.sh`: GPU mode where torch sees CUDA (summary table at its end)
#   pytest    the CUDA-capable tests with MMPP_TEST_DEVICE=cuda (tests/test_equivalence.py,
#             tests/test_nvtx.py; layouts needing more GPUs than visible skip with the reason)
#
# Assumption: the machine's python3 may or may not hold torch with CUDA (the H200 image had
# torch 2.11+cu130, lightning 2.6, pytest, pytest-timeout); every part prints what it finds and
# a part that cannot run says why. Logs: $OUT/{env,install,gpu_check,pytest}.log and
# $OUT/summary.txt (one line per part: exit status, seconds). Exit status: 0 when gpu_check and
# pytest both passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET=${DEVICE_RUN_BUDGET:-450}
START=$SECONDS
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# part NAME MAX_SECONDS COMMAND...: run with timeout min(MAX, budget left), log to $OUT/NAME.log
part() {
  local name=$1 max=$2 left t begin rc
  shift 2
  left=$((BUDGET - (SECONDS - START)))
  t=$((max < left ? max : left))
  if ((t < 30)); then
    echo "$name: not run, ${left}s of the budget left" | tee -a "$SUMMARY"
    return 1
  fi
  echo "=== $name (timeout ${t}s) ==="
  begin=$SECONDS
  timeout --kill-after=10 "$t" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  tail -n 30 "$OUT/$name.log"
  ((rc == 124 || rc == 137)) && echo "$name: TIMED OUT after ${t}s" >>"$OUT/$name.log"
  printf '%-9s exit %-3s %4ss\n' "$name" "$rc" "$((SECONDS - begin))" | tee -a "$SUMMARY"
  return "$rc"
}

probe_env() {
  date -u
  uname -a
  echo "--- nvidia-smi"
  if command -v nvidia-smi >/dev/null; then timeout 30 nvidia-smi; else echo "nvidia-smi: not found"; fi
  echo "--- python: $(command -v "$PY") $("$PY" --version 2>&1)"
  "$PY" - <<'EOF'
import importlib, importlib.metadata as md
for name in ("torch", "lightning", "pytest", "pytest-timeout", "hypothesis", "safetensors", "transformers"):
    try:
        print(f"{name:16s} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name:16s} NOT INSTALLED")
try:
    import torch
except Exception as err:  # noqa: BLE001
    print(f"import torch failed: {err!r}")
    raise SystemExit(0)
print(f"torch {torch.__version__}  cuda build {torch.version.cuda}  cuda available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB cc {p.major}.{p.minor}")
    print(f"  bf16 {torch.cuda.is_bf16_supported()}  nccl {torch.cuda.nccl.version()}"
          f"  distributed nccl {torch.distributed.is_nccl_available()}")
    try:
        torch.cuda.nvtx.range_push("probe"); torch.cuda.nvtx.range_pop(); print("  nvtx ok")
    except Exception as err:  # noqa: BLE001
        print(f"  nvtx unusable: {err}")
EOF
  echo "--- nsys: $(command -v nsys || echo 'not on PATH')"
}

requirements_import() {
  "$PY" -c "import torch, lightning, pytest, pytest_timeout" >/dev/null 2>&1
}

install_package() {
  if requirements_import; then
    echo "torch, lightning, pytest and pytest-timeout import: nothing to install; lightning_mmpp runs from $PWD (PYTHONPATH)"
  else
    local wheels=${MMPP_WHEELS:-}
    for candidate in shared/wheels .whl; do
      [ -z "$wheels" ] && [ -d "$candidate" ] && wheels=$candidate
    done
    if [ -n "$wheels" ]; then
      echo "installing from the wheels in $wheels only (no index)"
      export PIP_FIND_LINKS="$PWD/$wheels" PIP_NO_INDEX=1
    fi
    bash scripts/install.sh test || echo "install.sh failed (exit $?): offline without the wheels it needs?"
  fi
  "$PY" -c "import torch, lightning, lightning_mmpp; print('torch', torch.__version__, '| lightning', lightning.__version__, '| lightning_mmpp from', lightning_mmpp.__file__)"
  requirements_import
}

export PY
export -f probe_env requirements_import install_package
part env 60 bash -c probe_env
part install 150 bash -c install_package
install_rc=$?
cuda=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
[ "$cuda" = 1 ] || echo "NO CUDA: gpu_check runs its no-GPU mode; the CUDA tests skip" | tee -a "$SUMMARY"
# gpu_check's own timeout a little under the part's, so its summary table is printed
left=$((BUDGET - (SECONDS - START)))
check_limit=$((left - 120 < 300 ? left - 120 : 300))
MMPP_GPU_CHECK_TIMEOUT=$((check_limit - 15)) part gpu_check "$check_limit" bash scripts/gpu_check.sh
check_rc=$?
MMPP_TEST_DEVICE=cuda part pytest 240 "$PY" -m pytest -q -rA -p no:cacheprovider \
  tests/test_equivalence.py tests/test_nvtx.py
test_rc=$?
# DEVICE_RUN_BENCH=1: benchmarks, after the checks. The engine's overhead on the GPU, then the
# sleep-stage schedule benchmarks on this machine's CPU cores (gloo), for this tree and, when
# MMPP_BENCH_BASELINE names another checkout, for that one right after (a before/after in one run)
if [ -n "${DEVICE_RUN_BENCH:-}" ]; then
  part bench_gpu 90 "$PY" benchmarks/bench_engine_overhead.py --rounds 5 --steps 5
  bench_cpu() {
    for bench in bench_pipeline bench_vs_torch; do
      for tree in . ${MMPP_BENCH_BASELINE:-}; do
        echo "##### tree: $tree"
        (cd "$tree" && PYTHONPATH=$PWD "$PY" "benchmarks/$bench.py" --rounds 2 --steps 3)
      done
    done
  }
  export -f bench_cpu
  part bench_cpu 200 bash -c bench_cpu
fi
echo "--- summary ($((SECONDS - START)) s in all; install exit $install_rc)"
cat "$SUMMARY"
((check_rc == 0 && test_rc == 0))
