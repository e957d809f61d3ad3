"""What Python's full garbage collections cost a training step, with and without ``freeze_gc``.

    python benchmarks/bench_gc.py                      # the README example, batch 32, 2 ranks
    python benchmarks/bench_gc.py --dp --batch-size 256 --steps 100

The README example (``examples/train_multimodal.py:VisionAudioLM``) is trained through
``Trainer.fit`` on 2 ranks: vision and LM on rank 0, audio on rank 1 (the planner's top plan
at batch 32), or with ``--dp`` every module over both ranks. It runs ``--steps`` steps and drops
the first 10. The launches alternate ``MultiModulePipelineStrategy(freeze_gc=True)``, the
default, and ``freeze_gc=False``, ``--launches`` of each. No barrier or collective of the
benchmark's own runs between steps: the steps follow each other as in a training job.

Printed per launch and rank:

* the median and the mean of the step, batch start to batch end;
* the time per step from the first timed step's start to the last step's start, everything a
  training job spends per step;
* the longest step, and the steps that ran 50 ms or more over the median.

A full collection stops one rank for as long as it takes to walk every object the process
holds, and its peers wait for it at the next exchange. The mean and the start-to-start time
show it; the median does not. CI never runs this.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lightning_mmpp import ModulePlacement  # noqa: E402
from lightning_mmpp.plan.launch import run_local  # noqa: E402
from lightning_mmpp.plan.target import ScriptModel, load_target  # noqa: E402

WARMUP = 10
PAUSE_S = 0.05  # a step this far over the median counts as paused
MODEL = os.path.join(ROOT, "examples", "train_multimodal.py") + ":VisionAudioLM"


def _worker(rank: int, world: int, make: Any, placements: dict, topology: dict, batch: Any, steps: int,
            freeze_gc: bool) -> tuple[float, float, float, float, int]:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_mmpp import MultiModulePipelineStrategy

    starts: list[float] = []
    ends: list[float] = []

    class Marks(L.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            starts.append(time.perf_counter())

        def on_train_batch_end(self, *args: Any) -> None:
            ends.append(time.perf_counter())

    strategy = MultiModulePipelineStrategy(placements, topology, 1, freeze_gc=freeze_gc)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[Marks()])
    trainer.fit(make(), DataLoader([batch] * steps, batch_size=None, collate_fn=lambda b: b))
    timed = [end - start for start, end in zip(starts, ends)][WARMUP:]
    per_step = (starts[-1] - starts[WARMUP]) / (len(starts) - 1 - WARMUP)
    median = statistics.median(timed)
    paused = sum(t > median + PAUSE_S for t in timed)
    return median, statistics.mean(timed), per_step, max(timed), paused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=70)
    parser.add_argument("--launches", type=int, default=2, help="launches of each setting, alternating")
    parser.add_argument("--dp", action="store_true", help="every module over both ranks")
    args = parser.parse_args()
    _, batch, topology = load_target(MODEL, args.batch_size)
    if args.dp:
        placements = {m: ModulePlacement(pp=1, dp=2, rank_offset=0) for m in ("vision", "audio", "llm")}
    else:
        placements = {"vision": ModulePlacement(pp=1, dp=1, rank_offset=0),
                      "audio": ModulePlacement(pp=1, dp=1, rank_offset=1),
                      "llm": ModulePlacement(pp=1, dp=1, rank_offset=0)}
    path, _, name = MODEL.rpartition(":")
    make = ScriptModel(path, name)
    print(f"$ python benchmarks/bench_gc.py --batch-size {args.batch_size} --steps {args.steps} "
          f"--launches {args.launches}{' --dp' if args.dp else ''}   (load average {os.getloadavg()[0]:.2f})")
    print("ms per step: median, mean, start to start, longest (batch start to batch end; the first "
          f"{WARMUP} steps dropped); steps over the median by {PAUSE_S * 1e3:.0f} ms or more")
    for _ in range(args.launches):
        for freeze_gc in (True, False):
            results = run_local(_worker, 2, make, placements, topology, batch, args.steps, freeze_gc, timeout=600)
            cells = "  |  ".join(f"rank {r}: {med * 1e3:6.2f} {mean * 1e3:6.2f} {per * 1e3:6.2f} {top * 1e3:7.2f} {n:3d}"
                                 for r, (med, mean, per, top, n) in enumerate(results))
            print(f"  freeze_gc={str(freeze_gc):5s}  {cells}")


if __name__ == "__main__":
    main()
