"""examples/cli_multimodal.py + .yaml: LightningCLI builds the strategy from a YAML config.

Needs ``jsonargparse[signatures]`` (the ``examples`` extra); skipped cleanly without it. CI
installs it (scripts/install.sh test,examples).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("jsonargparse", reason="the 'examples' extra (jsonargparse[signatures]) is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "cli_multimodal.py")
CONFIG = os.path.join(ROOT, "examples", "cli_multimodal.yaml")
sys.path.insert(0, os.path.join(ROOT, "examples"))


def test_config_gives_the_layout_of_train_multimodal(monkeypatch):
    """The YAML's plain mappings become ModulePlacements: the layout of examples/train_multimodal.py."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # the config's seed_everything sets it: unset again afterwards
    import cli_multimodal
    import multimodal_model
    import train_multimodal
    from lightning.pytorch.cli import LightningCLI

    from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy

    cli = LightningCLI(train_multimodal.VisionAudioLM, cli_multimodal.SyntheticCaptionsData, run=False,
                       save_config_callback=None, args=["--config", CONFIG])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, MultiModulePipelineStrategy)
    placements = strategy.layout.placements
    assert all(isinstance(p, ModulePlacement) for p in placements.values()), placements
    assert dict(placements) == dict(multimodal_model.PLACEMENTS)
    assert strategy.layout.world_size == cli.trainer.num_devices == 5
    assert strategy.num_microbatches == 4


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_cli_fit_runs_from_the_yaml_config():
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, SCRIPT, "fit", "--config", CONFIG, "--trainer.max_steps", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Starting with 5 processes" in proc.stdout + proc.stderr
    match = re.search(r"loss ([0-9.]+) -> ([0-9.]+) after (\d+) steps", proc.stdout)
    assert match, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert int(match.group(3)) == 2
    assert not os.path.exists(os.path.join(ROOT, "config.yaml")), "LightningCLI wrote its config into the tree"
