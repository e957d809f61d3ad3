"""The launching process after fit under fork / spawn: the whole trained model, or a clear warning."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_parent_holds_the_trained_model(start_method):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.launch_script", start_method], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert re.search(r"GLOBAL_STEP 3\n", out), out
    assert float(re.search(r"MAX_DIFF (\S+)", out).group(1)) < 1e-5, out
    val, ref = map(float, re.search(r"VAL (\S+) REFERENCE (\S+)", out).groups())
    assert val == pytest.approx(ref, rel=1e-5)
    if start_method == "fork":
        # a model built in configure_model(): no weights in the parent, said once; the step count comes back
        assert "META_WARNINGS 1 GLOBAL_STEP 3" in out, out
