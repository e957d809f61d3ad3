"""Ragged images over an encoder with dp=2: replicas by sample index vs by item count (issue 29).

    python benchmarks/bench_ragged.py [--tf-item 0.002] [--tb-item 0.004] [--rounds 3]

A vision encoder (``dp=2``, ranks 0-1) feeds an LM (rank 2) through a fan-in bridge. The
encoder costs ``--tf-item`` / ``--tb-item`` seconds per image (a sleep layer applied to the packed
images: its time scales with the images its replica gets), the LM ``--tf-sample`` /
``--tb-sample`` per sample. Global batch ``--batch`` samples in ``--microbatches`` microbatches.

Five runs, timed in one launch with rounds interleaved. In the skewed batches 20% of the samples
carry 80% of the images (16 images each, the others 1), placed either at random (``random``,
fixed seeds) or at the front of every microbatch (``clustered``, as when a loader emits an
image-heavy source before a text-heavy one). Each runs:

* ``by index`` (``balance="samples"``): replica j takes the j-th half of each microbatch's
  samples, whatever their images;
* ``by items`` (``balance="items"``): each microbatch's samples are split so that the replicas'
  image counts are as even as the samples allow.

``ideal``: the same number of images spread evenly (4 per sample), by index: both replicas always
hold half the images (the work of the skewed runs, perfectly balanced).

Step time: max over ranks, median over the timed steps. ``larger replica``: the images of the
vision replica holding more, per microbatch (mean) and over the whole step (mean over the
batches): replicas run their microbatches one after another, so the step waits for the replica
with the most images over the step, not per microbatch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import PerSampleSleepStage, interleaved, machine, median, section, table  # noqa: E402
from lightning_mmpp import Ragged  # noqa: E402
from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout  # noqa: E402
from lightning_mmpp.engine.engine import PipelineEngine  # noqa: E402
from lightning_mmpp.engine.microbatch import item_counts, sample_routing, split_microbatches  # noqa: E402
from tests.dist import run_distributed  # noqa: E402

TOPOLOGY = {"vision": ["llm"], "llm": []}
HEAVY, LIGHT, UNIFORM = 16, 1, 4  # images per sample: 20% heavy + 80% light = 4 on average
RUNS = (  # name, skew, balance
    ("random skew, by index", "random", "samples"),
    ("random skew, by items", "random", "items"),
    ("clustered skew, by index", "clustered", "samples"),
    ("clustered skew, by items", "clustered", "items"),
    ("ideal", "none", "samples"),
)


class RaggedSleepModel(nn.Module):
    """``vision``: one sleep layer per image; ``llm``: one sleep layer per sample."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.vision = nn.Sequential(PerSampleSleepStage(args.tf_item, args.tb_item))
        self.llm = nn.Sequential(PerSampleSleepStage(args.tf_sample, args.tb_sample))

    def pipeline_inputs(self, module: str, batch: Any, upstream: dict[str, Any]) -> Any:
        if module == "vision":
            return batch["images"]
        images = upstream["vision"]
        owner = torch.repeat_interleave(torch.arange(images.num_samples), images.counts)
        return torch.zeros(images.num_samples, images.values.shape[1]).index_add(0, owner, images.values)

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return output.pow(2).mean()


def make_batch(batch: int, m: int, skew: str, seed: int) -> dict[str, Any]:
    """``skew``: ``"random"`` (the heavy 20% anywhere), ``"clustered"`` (the heavy samples at the
    front of every microbatch, as when a loader emits an image-heavy source before a text-heavy
    one), ``"none"`` (4 images each)."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.full((batch,), LIGHT)
    if skew == "random":
        counts[torch.randperm(batch, generator=g)[: batch // 5]] = HEAVY
    elif skew == "clustered":
        per = batch // m
        for k in range(m):
            counts[k * per : k * per + per // 5] = HEAVY
    else:
        counts = torch.full((batch,), UNIFORM)
    return {"images": Ragged(torch.randn(int(counts.sum()), 4, generator=g), counts)}


def larger_share(layout: PipelineLayout, batch: dict[str, Any], m: int) -> tuple[float, int]:
    """The images of the vision replica that holds more of them: mean per microbatch, and over the step."""
    micro = split_microbatches(batch, m)
    per = batch["images"].num_samples // m
    routing = sample_routing(layout, micro, per)
    shares, totals = [], [0, 0]
    for k, mb in enumerate(micro):
        counts = item_counts(mb, per)
        bounds = routing.bounds("vision", k)
        loads = [sum(counts[a:b]) for a, b in zip(bounds, bounds[1:])]
        shares.append(max(loads))
        totals = [t + load for t, load in zip(totals, loads)]
    return sum(shares) / len(shares), max(totals)


def worker(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    runs = {}
    shares = {}
    engines = []
    for name, skew, balance in RUNS:
        layout = PipelineLayout({"vision": ModulePlacement(dp=2, balance=balance), "llm": ModulePlacement()},
                                TOPOLOGY)
        engine = PipelineEngine(RaggedSleepModel(args), layout, num_microbatches=args.microbatches,
                                schedule=args.schedule)
        engines.append(engine)
        batches = [make_batch(args.batch, args.microbatches, skew, seed) for seed in range(args.steps)]
        measured = [larger_share(layout, b, args.microbatches) for b in batches]
        shares[name] = tuple(sum(x[i] for x in measured) / len(measured) for i in range(2))

        def step(engine: PipelineEngine = engine, batches: list = batches, state: list = [0]) -> float:
            batch = batches[state[0] % len(batches)]
            state[0] += 1
            start = time.perf_counter()
            engine.step(batch)
            return time.perf_counter() - start

        runs[name] = step
    times = interleaved(runs, args.rounds, args.steps)
    for engine in engines:
        engine.close()
    return {"times": {name: median(t) for name, t in times.items()}, "shares": shares}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=40)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--tf-item", type=float, default=0.002)
    parser.add_argument("--tb-item", type=float, default=0.004)
    parser.add_argument("--tf-sample", type=float, default=0.0005)
    parser.add_argument("--tb-sample", type=float, default=0.001)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    result = run_distributed(worker, 3, args, timeout=600)[0]
    section(f"ragged images, vision dp=2 -> llm (3 ranks), {machine()}")
    per_mb = args.batch // args.microbatches
    print(f"batch {args.batch} in {args.microbatches} microbatches; {per_mb * UNIFORM} images per microbatch; "
          f"per image {args.tf_item * 1e3:.1f} + {args.tb_item * 1e3:.1f} ms (fwd + bwd), schedule {args.schedule}")
    ideal = result["times"]["ideal"]
    rows = [[name, *result["shares"][name], t * 1e3, t / ideal] for name, t in result["times"].items()]
    print(table(["run", "larger replica: images/microbatch", "images/step", "step ms", "vs ideal"], rows))


if __name__ == "__main__":
    main()
