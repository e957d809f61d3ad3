"""``scripts/gpu_check.sh`` in its "no GPU" mode: its plumbing runs in CI so it cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist import TEST_DEVICE, requires_cuda

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_gpu_check_runs_green_without_a_gpu_and_fails_on_an_injected_failure():
    """One run of the whole no-GPU mode: every check passes, including the one marked failed
    after it ran, which turns the exit status non-zero and shows as the only FAIL row (so
    without the injection the script exits 0)."""
    env = {**os.environ, "MMPP_GPU_CHECK_MODE": "nogpu", "MMPP_GPU_CHECK_INJECT_FAILURE": "bf16",
           "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, text=True, timeout=280,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    table = out[out.index("=== gpu_check summary (mode=nogpu"):]
    lines = table.splitlines()
    assert lines[1].startswith("check ") and lines[2].startswith("-----"), table
    body = lines[3:lines.index("", 3)]
    rows = {line.split("  ")[0].strip(): line for line in body}
    assert len(rows) == len(body), table
    expected = {
        "equivalence (world 1, all colocated)": "max diff",
        "fit/validate/test/predict": "predict matches forward",
        "bf16-mixed": "the check itself passed: train_loss",
        "checkpoint save/resume": "bit-exact",
        "memory (max_memory_allocated vs theory)": "theory",
        "planner per-layer profile": "layers of 3 modules profiled on cpu",
        "NVTX ranges of a traced fit": "balanced ranges",
        "equivalence matrix (plumbing: 2 CPU ranks)": "1 passed",
        "schedule benchmark (plumbing: 1 ms sleep stages)": "ours DAG / ours chained",
    }
    assert sorted(rows) == sorted(expected), table
    for name, detail in expected.items():
        status = "FAIL" if name == "bf16-mixed" else "PASS"
        assert f"  {status}  " in rows[name] and detail in rows[name], rows[name]
    assert table.rstrip().endswith("FAILED: bf16-mixed"), table


@pytest.mark.distributed
@requires_cuda
@pytest.mark.timeout(600)
def test_gpu_check_on_cuda():
    """On a GPU machine (MMPP_TEST_DEVICE=cuda) the real check must pass."""
    assert TEST_DEVICE == "cuda"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, text=True, timeout=590,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.returncode == 0, proc.stdout[-5000:]
