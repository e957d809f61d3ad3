"""Measure plans on this machine: a few training steps through ``Trainer.fit`` (torch, Lightning).

:func:`measure_plans` starts ``world_size`` local processes (:func:`~lightning_mmpp.plan.launch.run_local`)
and, in them, after one untimed warm-up fit of the first plan, trains a fresh model under each
plan for ``warmup + steps`` steps on one sample batch, with
``MultiModulePipelineStrategy(plan.placements, ...)``; a step is timed from
``on_train_batch_start`` (after a barrier, so every rank starts together) to
``on_train_batch_end`` on the slowest rank, which is what the planner predicts: the pipeline,
the gradient sums, the optimizer step and the metrics reduction, without data loading.
:func:`timed_fit` is one such run, also what :func:`lightning_mmpp.plan.calibrate` times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["MeasuredStep", "measure_plans", "measure_runs", "measure_steps", "timed_fit"]

WARMUP_STEPS = 2
WARMUP_FIT_STEPS = 5  # timed steps of the untimed fit that warms a measuring process up


def _identity(batch: Any) -> Any:
    return batch


def timed_fit(model: Any, placements: Mapping[str, Any], topology: Mapping[str, Sequence[str]],
              num_microbatches: int, schedule: str, batch: Any, steps: int, device: str = "cpu",
              outside: Optional[list[float]] = None) -> list[float]:
    """Train ``model`` for ``WARMUP_STEPS + steps`` steps on ``batch`` (in a process of a local
    launch whose environment is set); the seconds of each timed step on the slowest rank. With
    ``outside``, also append to it, per timed step, the seconds this rank spent outside its
    pipeline: from the step's start to the engine's ``run_pipeline`` and from its return to the
    step's end (the loop, the gradient sums' and metrics' wait, logging, the optimizer)."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lightning_mmpp.lightning.strategy import MultiModulePipelineStrategy

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.outside: list[float] = []
            self.start = self.pipeline = 0.0  # the step's start; seconds inside run_pipeline

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            engine = trainer.strategy.engine
            run_pipeline = engine.run_pipeline

            def timed_pipeline(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return run_pipeline(*args, **kwargs)
                finally:
                    self.pipeline += time.perf_counter() - start

            engine.run_pipeline = timed_pipeline

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            dist.barrier()
            self.start, self.pipeline = time.perf_counter(), 0.0

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            seconds = time.perf_counter() - self.start
            self.outside.append(seconds - self.pipeline)
            t = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            self.times.append(float(t))

    timer = StepTimer()
    strategy = MultiModulePipelineStrategy(dict(placements), {k: list(v) for k, v in topology.items()},
                                           num_microbatches, schedule=schedule)
    total = WARMUP_STEPS + steps
    trainer = L.Trainer(accelerator="gpu" if device.startswith("cuda") else "cpu", devices=dist_world_size(),
                        strategy=strategy, max_steps=total, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[timer])
    trainer.fit(model, DataLoader([batch] * total, batch_size=None, collate_fn=_identity))
    if outside is not None:
        outside.extend(timer.outside[WARMUP_STEPS:])
    return timer.times[WARMUP_STEPS:]


def dist_world_size() -> int:
    """The launch's world size, from the environment :func:`run_local` sets."""
    import os

    return int(os.environ["WORLD_SIZE"])


def _measure_worker(rank: int, world_size: int, runs: list[tuple], steps: int, device: str) -> list[list[float]]:
    # the first fit of a process runs slower for longer than its warm-up steps hide (a 4-stage
    # plan of Linear(1024) layers on a 2-core VM: 87.8 ms first, 72.3 and 75.2 ms when measured
    # again later in the same launch): an untimed fit first, so no plan pays for its place in the list
    make_model, batch, placements, topology, m, schedule = runs[0]
    timed_fit(make_model(), placements, topology, m, schedule, batch, WARMUP_FIT_STEPS, device)
    return [timed_fit(make_model(), placements, topology, m, schedule, batch, steps, device)
            for make_model, batch, placements, topology, m, schedule in runs]


@dataclass(frozen=True)
class MeasuredStep:
    """A plan's measured step: the median of every launch's timed steps pooled, and each
    launch's own median (their spread shows how far one launch on this machine can be off).
    ``low_s``: the 10th percentile of the pooled steps, the steps that nothing stalled. Where it
    sits near the prediction and the median well above, the difference is stalls the cost model
    does not price (on a CPU of few cores: in the collectives that close a step,
    benchmarks/README.md); where it is above the prediction too, the prediction is short."""

    median_s: float
    launch_medians_s: tuple[float, ...]
    low_s: Optional[float] = None

    @property
    def spread_s(self) -> tuple[float, float]:
        """The smallest and the largest launch median."""
        return min(self.launch_medians_s), max(self.launch_medians_s)


def measure_steps(runs: Sequence[tuple[Callable[[], Any], Any, Any]], steps: int = 5, device: str = "cpu",
                  timeout: float = 900.0, launches: int = 1) -> list[MeasuredStep]:
    """The measured step (seconds, slowest rank) of each ``(make_model, batch, plan)``, all run
    one after the other in each of ``launches`` launches of ``plan.world_size`` processes (equal
    for all); the median pools the steps of every launch (a launch on a shared CPU can run a few
    percent off throughout, see :func:`~lightning_mmpp.plan.calibration.median_samples`).
    ``make_model()`` builds a fresh LightningModule, trained on ``batch`` (one global batch of
    ``plan.batch_size`` samples) at every step; ``timeout`` is per launch."""
    from lightning_mmpp.errors import PipelineConfigError
    from lightning_mmpp.plan.launch import run_local

    if not runs:
        return []
    worlds = {plan.world_size for _, _, plan in runs}
    if len(worlds) != 1:
        raise PipelineConfigError(f"measure_runs: plans for world sizes {sorted(worlds)}; measure one size per call.")
    if not isinstance(launches, int) or launches < 1:
        raise PipelineConfigError(f"measure_runs(launches={launches!r}): give the number of launches, >= 1.")
    world = worlds.pop()
    packed = [(make, batch, p.placements, p.topology, p.num_microbatches, str(p.schedule)) for make, batch, p in runs]
    per_launch: list[list[list[float]]] = [[] for _ in packed]
    for _ in range(launches):
        for times, got in zip(per_launch, run_local(_measure_worker, world, packed, steps, device, device=device,
                                                    timeout=timeout)[0]):
            times.append(got)
    measured = []
    for times in per_launch:
        pooled = [t for launch in times for t in launch]
        measured.append(MeasuredStep(statistics.median(pooled), tuple(statistics.median(launch) for launch in times),
                                     _tenth_percentile(pooled)))
    return measured


def _tenth_percentile(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[round(0.1 * (len(ordered) - 1))]


def measure_runs(runs: Sequence[tuple[Callable[[], Any], Any, Any]], steps: int = 5, device: str = "cpu",
                 timeout: float = 900.0, launches: int = 1) -> list[float]:
    """The median measured step (seconds) of each ``(make_model, batch, plan)``: the medians of
    :func:`measure_steps`."""
    return [m.median_s for m in measure_steps(runs, steps, device, timeout, launches)]


def measure_plans(make_model: Callable[[], Any], batch: Any, plans: Sequence[Any], steps: int = 5,
                  device: str = "cpu", timeout: float = 900.0, launches: int = 1) -> list[float]:
    """:func:`measure_runs` of every plan of one model."""
    return measure_runs([(make_model, batch, plan) for plan in plans], steps, device, timeout, launches)
