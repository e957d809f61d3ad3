"""The README's "Your LightningModule" snippet runs as shown: saved as a script, it trains under the
strategy (5 processes, Lightning's default popen launcher), only its step count lowered here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_snippet(section: str) -> str:
    """The first ```python block after the README heading ``## {section}``."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    match = re.search(rf"^## {re.escape(section)}\n.*?^```python\n(.*?)^```", text, re.S | re.M)
    assert match, f"README.md has no python block under '## {section}'"
    return match.group(1)


def run_readme_snippet(section: str, tmp_path: Any, steps: str, fewer: str) -> str:
    """Save the ``## {section}`` snippet as a script with ``steps`` (its Trainer's step count,
    e.g. ``max_steps=16``) replaced by ``fewer``, run it, and return its output (it must succeed)."""
    code = readme_snippet(section)
    assert code.count(steps) == 1, f"the snippet's Trainer line changed ({steps!r}): update this test"
    script = tmp_path / "snippet.py"
    script.write_text(code.replace(steps, fewer))
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_your_lightning_module_snippet_trains(tmp_path):
    out = run_readme_snippet("Your LightningModule", tmp_path, "max_steps=16", "max_steps=2")
    assert "Starting with 5 processes" in out, out[-4000:]
    assert "`max_steps=2` reached" in out, out[-4000:]
