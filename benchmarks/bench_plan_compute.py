"""The planner on models that compute on the CPU: predicted against measured step time.

    python benchmarks/bench_plan_compute.py                          # calibrate(4), then plan and measure
    python benchmarks/bench_plan_compute.py --calibration cal.json   # reuse a calibration (written when absent)

``bench_plan.py --accuracy`` measures models whose layers wait (sleep) a time that scales with
their rows: their ranks do not compete for the CPU. These two models compute, so on a CPU with
fewer cores than ranks they do:

* 8 ``Linear(1024) + Tanh`` layers, an encoder of 3 feeding an LM of 5, trained with SGD, batch 64;
* the README's example model (``examples/train_multimodal.py:VisionAudioLM``, AdamW), batch 32.

Each is profiled with one intra-op thread per rank (what a rank gets), planned for ``--world``
ranks with the calibration, and its top plan, best uniform plan and best pure-dp plan are trained
through ``Trainer.fit`` (``--steps`` steps in each of ``--launches`` launches, the median):
measured / predicted per plan. Each plan is also predicted as if every rank had a core of its
own (the calibration's ``host_cores`` cleared), and that search's top plan is measured too: what
timing the ranks' sharing of the cores (``lightning_mmpp.plan.sharing``) changes. CI never runs this.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.common import calibration_at  # noqa: E402
from lightning_mmpp.plan import plan_placements, profile_model  # noqa: E402
from lightning_mmpp.plan.costs import CostModel  # noqa: E402
from lightning_mmpp.plan.launch import rank_threads  # noqa: E402
from lightning_mmpp.plan.sharing import shared_step_seconds  # noqa: E402
from lightning_mmpp.plan.validate import measure_runs  # noqa: E402


class LinearModel(L.LightningModule):
    """``{module: layers}`` of ``Linear(width) + Tanh``; a module sums its upstream outputs."""

    def __init__(self, spec: dict[str, int], topology: dict[str, list[str]], width: int) -> None:
        super().__init__()
        self.pipeline_topology = topology
        torch.manual_seed(0)
        for name, n in spec.items():
            setattr(self, name, nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)]))

    def pipeline_inputs(self, module: str, batch: Any, upstream: dict[str, Any]) -> Any:
        return batch if not upstream else sum(upstream[k] for k in sorted(upstream))

    def pipeline_loss(self, module: str, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return output.square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)


def linear_model() -> LinearModel:
    return LinearModel({"a": 3, "lm": 5}, {"a": ["lm"], "lm": []}, 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--calibration", help="a calibration JSON file: read if it exists, else measured and written")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args()

    cal = calibration_at(args.calibration, args.world)
    print(cal.describe(), flush=True)

    from train_multimodal import TOPOLOGY, VisionAudioLM, sample_batch

    cases = [("8 Linear(1024), enc(3) -> lm(5), SGD, batch 64", linear_model, torch.randn(64, 1024), None),
             ("example VisionAudioLM, AdamW, batch 32", VisionAudioLM, sample_batch(32), TOPOLOGY)]
    alone = dataclasses.replace(cal, host_cores=0)  # every rank with a core of its own
    runs, rows = [], []
    for name, make, batch, topology in cases:
        profile = profile_model(make(), batch, calibration=cal, num_threads=rank_threads(args.world), topology=topology)
        plans = plan_placements(profile, args.world, top_k=40)
        plans_alone = plan_placements(profile, args.world, top_k=200, calibration=alone)
        picks = {"top": plans[0], "top with a core per rank": plans_alone[0]}
        uniform = plan_placements(profile, args.world, top_k=1, uniform=True)
        if uniform:
            picks["uniform"] = uniform[0]
        pure_dp = [p for p in plans if all(q.num_stages == 1 and q.dp == args.world for q in p.placements.values())]
        if pure_dp:
            picks["pure dp"] = pure_dp[0]
        print(f"{name}: optimizer ratio {profile.optimizer_ratio}, per tensor {(profile.optimizer_tensor_s or 0) * 1e6:.1f} us",
              flush=True)
        alone_by = {_key(p): p for p in plans_alone}
        measured_keys = set()
        for kind, plan in picks.items():
            if _key(plan) in measured_keys:
                continue
            measured_keys.add(_key(plan))
            if kind == "top with a core per rank":  # its prediction with the cores shared
                cost = CostModel(profile, plan.placements, plan.num_microbatches, profile.frozen_modules())
                plan = dataclasses.replace(plan, step_time_s=shared_step_seconds(
                    profile, plan.placements, plan.num_microbatches, plan.schedule, cost, profile.frozen_modules()))
            runs.append((make, batch, plan))
            rows.append((name, kind, plan, alone_by.get(_key(plan))))
    measured = measure_runs(runs, args.steps, launches=args.launches)
    print("\n| model | plan | predicted, a core per rank | predicted | measured | ratio |\n|---|---|---|---|---|---|")
    for (name, kind, plan, alone_plan), seconds in zip(rows, measured):
        alone_s = f"{alone_plan.step_time_s * 1e3:.1f} ms" if alone_plan is not None else "-"
        print(f"| {name} | {kind}: {plan.describe().replace(' | ', ' / ')}, m={plan.num_microbatches} | {alone_s} "
              f"| {plan.step_time_s * 1e3:.1f} ms | {seconds * 1e3:.1f} ms | {seconds / plan.step_time_s:.3f} |")


def _key(plan: Any) -> tuple:
    return plan.describe(), plan.num_microbatches


if __name__ == "__main__":
    main()
