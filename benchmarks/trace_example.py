"""Trace a few training steps of ``examples/train_multimodal.py`` and draw the last one.

    python benchmarks/trace_example.py docs/pipeline_1f1b.png
    python benchmarks/trace_example.py docs/pipeline_1f1b_sleep.png --sleep
    python benchmarks/trace_example.py docs/pipeline_gpipe_sleep.png --sleep --schedule gpipe

The example's model (``VisionAudioLM``) and layout (vision dp=2 and audio -> llm pp=2, five
ranks) are imported from the example module and trained by the Lightning ``Trainer`` with
``MultiModulePipelineStrategy(trace_dir=...)`` on forked CPU processes (gloo). The merged
``trace.json`` (kept in ``--trace-dir``, a temporary directory by default) is then drawn by
``plot_trace.py``.

The real model is tiny: its stages compute in well under a millisecond, so the chart of a real
step is mostly communication. ``--sleep`` makes the pattern legible: the last layer of every
pipeline stage is wrapped so that the stage's forward also sleeps ``--tf`` and its backward
``--tb`` seconds (same model, same stage split, same layout).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import train_multimodal as example  # noqa: E402
from benchmarks.common import Sleep  # noqa: E402
from benchmarks.plot_trace import load_trace, plot_step  # noqa: E402
from lightning_mmpp import MultiModulePipelineStrategy  # noqa: E402
from lightning_mmpp.model.partition import stage_ranges  # noqa: E402


class SleepAfter(nn.Module):
    """Runs ``layer``, then passes its first float tensor that needs a gradient through
    :class:`Sleep`, so the forward costs ``tf`` more seconds and the backward ``tb`` more."""

    def __init__(self, layer: nn.Module, tf: float, tb: float) -> None:
        super().__init__()
        self.layer, self.tf, self.tb = layer, tf, tb

    def forward(self, x: Any) -> Any:
        out = self.layer(x)
        leaves, spec = tree_flatten(out)
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.requires_grad:
                leaves[i] = Sleep.apply(leaf, self.tf, self.tb)
                break
        return spec.unflatten(leaves)


def add_sleeps(model: example.VisionAudioLM, tf: float, tb: float) -> example.VisionAudioLM:
    """Wrap the last layer of every pipeline stage of ``model`` (the stage split is unchanged:
    the wrapper holds the same parameters)."""
    for module, placement in example.PLACEMENTS.items():
        container: nn.Sequential = getattr(model, module)
        names = list(container._modules)
        for span in stage_ranges(list(container), placement.pp, placement.split_points, module):
            last = names[span[-1]]
            container._modules[last] = SleepAfter(container._modules[last], tf, tb)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_png")
    parser.add_argument("--sleep", action="store_true", help="add tf/tb sleeps to every stage")
    parser.add_argument("--tf", type=float, default=0.020)
    parser.add_argument("--tb", type=float, default=0.040)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--trace-dir", default=None, help="where the trace JSON goes (default: a temporary dir)")
    args = parser.parse_args()

    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="mmpp_trace_")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    strategy = MultiModulePipelineStrategy(
        placements=example.PLACEMENTS, topology=example.TOPOLOGY, num_microbatches=args.microbatches,
        schedule=args.schedule, start_method="fork", trace_dir=trace_dir,
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=strategy.layout.world_size, strategy=strategy, max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    model = example.VisionAudioLM()
    if args.sleep:
        add_sleeps(model, args.tf, args.tb)
    data = DataLoader(example.SyntheticCaptions(args.batch_size * args.steps), batch_size=args.batch_size,
                      shuffle=True, drop_last=True)
    trainer.fit(model, data)

    events, names = load_trace(os.path.join(trace_dir, "trace.json"))
    what = f"sleep stages tf={args.tf * 1e3:g} ms, tb={args.tb * 1e3:g} ms" if args.sleep else "real compute"
    step = max(e["args"]["step"] for e in events)
    span = (max(e["ts"] + e["dur"] for e in events if e["args"]["step"] == step)
            - min(e["ts"] for e in events if e["args"]["step"] == step)) / 1e3
    title = (f"examples/train_multimodal.py, {args.schedule.upper()}, m={args.microbatches}, {what}: "
             f"step {step}, {span:.1f} ms")
    os.makedirs(os.path.dirname(os.path.abspath(args.out_png)), exist_ok=True)
    summary = plot_step(events, names, args.out_png, step, title)
    print(f"trace: {os.path.join(trace_dir, 'trace.json')}")
    print(f"wrote {args.out_png}: step {summary['step']}, {summary['span_ms']:.1f} ms, {summary['forward']} forwards, "
          f"{summary['backward']} backwards, {summary['exchange']} exchanges")


if __name__ == "__main__":
    main()
