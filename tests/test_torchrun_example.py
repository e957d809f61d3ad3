"""examples/train_torchrun.py (PipelineEngine in a plain loop under torchrun) equals single-process training."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.dist import free_port

pytestmark = pytest.mark.distributed  # launches processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
STEPS, BATCH, MICRO, LR, SEED = 3, 8, 2, 0.05, 0
# SGD, not the example's default AdamW: Adam divides a gradient by its own magnitude, so the
# attention key bias (whose true gradient is 0, softmax ignores a shift of every key) would turn
# rounding noise of either run into full-size updates that differ between the two runs.
OPTIMIZER = "sgd"


def _single_process() -> dict[str, torch.Tensor]:
    """The same model, batches and optimizer on one process, without the pipeline."""
    sys.path.insert(0, EXAMPLES)
    try:
        from multimodal_model import TOPOLOGY, VisionAudioModel
        from train_torchrun import batches, make_optimizer
    finally:
        sys.path.remove(EXAMPLES)
    from lightning_mmpp import run_unpipelined

    torch.manual_seed(SEED)
    model = VisionAudioModel()
    optimizer = make_optimizer(OPTIMIZER, model.parameters(), LR)
    for _, batch in zip(range(STEPS), batches(BATCH, SEED)):
        optimizer.zero_grad(set_to_none=True)
        loss, _ = run_unpipelined(model, TOPOLOGY, batch)
        loss.backward()
        optimizer.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["zero_bubble"])
def test_torchrun_example_matches_single_process(tmp_path, schedule):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "5", "--master-port", str(free_port()),
           os.path.join(EXAMPLES, "train_torchrun.py"), "--steps", str(STEPS), "--batch-size", str(BATCH),
           "--microbatches", str(MICRO), "--lr", str(LR), "--optimizer", OPTIMIZER, "--seed", str(SEED), "--schedule", schedule,
           "--save", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # each rank prints "rank R: loss A -> B"; with unbuffered output a print's text and its newline
    # are two writes, so another rank's line may run on before or after it
    losses = re.findall(r"rank \d+: loss [0-9.]+ -> ([0-9.]+)", done.stdout)
    assert len(losses) == 5 and len(set(losses)) == 1, done.stdout  # every rank returns the same global loss

    reference = _single_process()
    seen: set[str] = set()
    for rank in range(5):
        for name, value in torch.load(tmp_path / f"rank{rank}.pt", weights_only=True).items():
            torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=f"{name} on rank {rank}")
            seen.add(name)
    assert seen == set(reference), sorted(set(reference) - seen)  # every parameter is owned by some rank
