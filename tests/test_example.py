"""The README's example job trains: its loss falls (5 processes, fork launcher, a few steps)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed  # every test here launches processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_example_loss_falls():
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_multimodal.py"), "--steps", "40"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank  module  stage  replica  global-stage" in proc.stdout
    match = re.search(r"loss ([0-9.]+) -> ([0-9.]+)", proc.stdout)
    assert match, proc.stdout[-3000:]
    first, last = map(float, match.groups())
    assert last < 0.7 * first, (first, last)
