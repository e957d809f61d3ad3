"""The README's "Your LightningModule" snippet runs as shown: saved as a script, it trains under the
strategy (5 processes, Lightning's default popen launcher), only its step count lowered here."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_snippet(section: str) -> str:
    """The first ```python block after the README heading ``## {section}``."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    match = re.search(rf"^## {re.escape(section)}\n.*?^```python\n(.*?)^```", text, re.S | re.M)
    assert match, f"README.md has no python block under '## {section}'"
    return match.group(1)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_your_lightning_module_snippet_trains(tmp_path):
    code = readme_snippet("Your LightningModule")
    assert code.count("max_steps=16") == 1, "the snippet's Trainer line changed: update this test"
    script = tmp_path / "model.py"
    script.write_text(code.replace("max_steps=16", "max_steps=2"))
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=280)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Starting with 5 processes" in out, out[-4000:]
    assert "`max_steps=2` reached" in out, out[-4000:]
