"""The step through ``Trainer.fit``: two encoders -> LM on sleep stages, against the ideal and
against plain Lightning's own per-step cost.

    python benchmarks/bench_fit.py                 # m=8, tf=20 ms, tb=40 ms, 20 timed steps
    python benchmarks/bench_fit.py --steps 40 --tf 0.02 --tb 0.04

Three runs in one command, one after the other, every one through ``Trainer.fit`` with the
same Trainer options (no logger, no progress bar, no checkpointing, no model summary):

* **ours**: ``MultiModulePipelineStrategy`` on 4 gloo processes: ``enc_a`` (pp=1, rank 0) and
  ``enc_b`` (pp=1, rank 1) -> ``llm`` (pp=2, ranks 2-3), 1F1B, ``m`` microbatches; every stage a
  :class:`~benchmarks.common.SleepStage` (forward ``tf``, backward ``tb``). Depth D = 3, so the
  ideal step is ``(m + D - 1)(tf + tb)`` (600 ms at the defaults).
* **Lightning, 1 process**: a LightningModule whose step sleeps what one pipeline rank's
  stages sleep, ``m (tf + tb)`` (480 ms), trained by plain Lightning on one process: the
  step time beyond the sleep is Lightning's own per-step cost (the floor).
* **Lightning DDP, 4 processes**: the same model under ``strategy="ddp"`` on 4 gloo processes
  (the floor of a 4-process run: its all-reduce and per-rank loop on the shared cores).

Step time = the median over the timed steps of the interval between consecutive
``on_train_batch_end`` calls on rank 0 (everything the loop does per step: fetching the
batch, the step hooks, the pipeline, the optimizer). For ours the breakdown (medians over the
timed steps, on the rank whose pipeline part is the longest) splits it into the engine's pipeline
(``run_pipeline``: the schedule's actions), the rest of ``engine.step`` (dp sync, metric
reduction), and everything else Lightning and the strategy do per step.

**The stages' own time.** A ``SleepStage`` call costs more than its sleep: the sleep's wake-up
(timer slack, the VM rescheduling an idle core) and the autograd function around it. Before its
fit, every rank of ours times its stage alone, forward and backward, on the microbatch shape
(``--stage-calls`` calls each, median): ``tf'``, ``tb'``. No runtime can run the schedule faster
than ``(m + D - 1)(tf' + tb')``, the ideal with the measured stages; the step beyond that is
the framework's (ours and Lightning's) and the transport's.

**The step's end, rank by rank.** ``time.perf_counter`` is one clock for every process on a
Linux host (``CLOCK_MONOTONIC``), so each rank's marks can be set beside the others'. Per rank,
the medians over the timed steps of its ``run_pipeline`` end, ``engine.step`` end (the metric
sum done), batch end and next ``run_pipeline`` start, each relative to the step's last
``run_pipeline`` end over all ranks: what the ranks wait for after the pipeline, and when the
next step really starts. (This table found gloo's ``all_reduce`` holding the last ranks 6 ms
after the pipeline; see benchmarks/README.md.)
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

from benchmarks.common import P, SleepStage, machine, median, section, table  # noqa: E402
from tests.dist import run_distributed  # noqa: E402

MB_SHAPE = (8, 1024)
PLACEMENTS = {"enc_a": P(pp=1), "enc_b": P(pp=1), "llm": P(pp=2)}
TOPOLOGY = {"enc_a": ["llm"], "enc_b": ["llm"], "llm": []}
DEPTH = 3


def _lightning() -> Any:
    import lightning as L

    return L


def _trainer(devices: int, steps: int, strategy: Any, callback: Any) -> Any:
    L = _lightning()
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, limit_val_batches=0, callbacks=[callback])


def _loader(m: int, steps: int) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    batch = m * MB_SHAPE[0]
    data = torch.randn(batch * steps, *MB_SHAPE[1:], generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(data), batch_size=batch, shuffle=False)


def _step_clock() -> Any:
    """A callback recording ``time.perf_counter()`` at every ``on_train_batch_end``."""
    L = _lightning()

    class StepClock(L.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, *args: Any) -> None:
            self.ends.append(time.perf_counter())

    return StepClock()


def _intervals(ends: list[float], warmup: int) -> list[float]:
    return [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:])]


def pipelined_model(m: int, tf: float, tb: float) -> Any:
    """The two-encoder -> LM LightningModule of sleep stages (one stage per pp stage)."""
    L = _lightning()

    class SleepPipeline(L.LightningModule):
        pipeline_topology = TOPOLOGY

        def __init__(self) -> None:
            super().__init__()
            for module, placement in PLACEMENTS.items():
                setattr(self, module, nn.Sequential(*(SleepStage(tf, tb) for _ in range(placement.pp))))

        def pipeline_inputs(self, module: str, batch: Any, upstream: dict[str, Any]) -> Any:
            if not upstream:
                return batch[0]
            return sum(upstream[name] for name in sorted(upstream))

        def pipeline_loss(self, module: str, output: torch.Tensor, batch: Any) -> torch.Tensor:
            return output.pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-6)

    return SleepPipeline()


def floor_model(sleep_f: float, sleep_b: float) -> Any:
    """A one-stage LightningModule whose step sleeps ``sleep_f`` forward and ``sleep_b`` backward."""
    L = _lightning()

    class SleepStep(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.stage = SleepStage(sleep_f, sleep_b)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.stage(batch[0]).pow(2).mean()
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-6)

    return SleepStep()


def stage_times(tf: float, tb: float, calls: int, input_grad: bool) -> tuple[float, float]:
    """Median seconds of one ``SleepStage(tf, tb)`` forward and backward alone, on a microbatch."""
    stage = SleepStage(tf, tb)
    forwards: list[float] = []
    backwards: list[float] = []
    for call in range(calls + 2):  # 2 untimed
        x = torch.randn(*MB_SHAPE, requires_grad=input_grad)
        start = time.perf_counter()
        out = stage(x)
        middle = time.perf_counter()
        out.backward(torch.ones_like(out))
        end = time.perf_counter()
        if call >= 2:
            forwards.append(middle - start)
            backwards.append(end - middle)
    return median(forwards), median(backwards)


def worker_ours(rank: int, world: int, m: int, tf: float, tb: float, steps: int, warmup: int,
                stage_calls: int, static_shapes: bool = False) -> dict:
    from lightning_mmpp import MultiModulePipelineStrategy

    L = _lightning()
    clock = _step_clock()
    marks: dict[str, list[float]] = {"run_pipeline": [], "engine.step": []}  # (start, end) pairs, flattened

    class Timers(L.Callback):  # time the engine's calls from inside this rank's fit
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            engine = trainer.strategy.engine
            for name, attr in (("run_pipeline", "run_pipeline"), ("engine.step", "step")):
                inner = getattr(engine, attr)

                def timed(*args: Any, _inner: Any = inner, _name: str = name, **kwargs: Any) -> Any:
                    start = time.perf_counter()
                    try:
                        return _inner(*args, **kwargs)
                    finally:
                        marks[_name] += [start, time.perf_counter()]

                setattr(engine, attr, timed)

    # this rank's stage alone (ranks 0-1 hold first stages, whose input needs no gradient)
    stage_f, stage_b = stage_times(tf, tb, stage_calls, input_grad=rank >= 2)
    strategy = MultiModulePipelineStrategy(PLACEMENTS, num_microbatches=m, schedule="1f1b", static_shapes=static_shapes)
    trainer = _trainer(world, warmup + steps + 1, strategy, clock)
    trainer.callbacks.append(Timers())
    L.seed_everything(0, verbose=False)
    trainer.fit(pipelined_model(m, tf, tb), _loader(m, warmup + steps + 1))
    first = warmup + 1  # the intervals' steps: the ends at index warmup .. warmup + steps
    durations = {name: [end - start for start, end in zip(flat[0::2], flat[1::2])][first:]
                 for name, flat in marks.items()}
    return {"steps": _intervals(clock.ends, warmup), "stage": (stage_f, stage_b), **durations,
            "marks": marks, "batch_ends": clock.ends}


def step_ends(per_rank: list[dict], warmup: int) -> list[tuple]:
    """Per rank, the medians (ms) of its run_pipeline end, engine.step end, batch end and next
    run_pipeline start, relative to each step's last run_pipeline end over all ranks."""
    steps = min(len(r["marks"]["run_pipeline"]) // 2 for r in per_rank)
    rows = []
    for rank, r in enumerate(per_rank):
        pipe, eng, ends = r["marks"]["run_pipeline"], r["marks"]["engine.step"], r["batch_ends"]
        columns: list[list[float]] = [[], [], [], []]
        for k in range(warmup + 1, steps - 1):
            last = max(q["marks"]["run_pipeline"][2 * k + 1] for q in per_rank)
            for column, mark in zip(columns, (pipe[2 * k + 1], eng[2 * k + 1], ends[k], pipe[2 * k + 2])):
                column.append((mark - last) * 1e3)
        rows.append((rank, *(median(c) for c in columns)))
    return rows


def worker_floor(rank: int, world: int, m: int, tf: float, tb: float, steps: int, warmup: int,
                 strategy: str) -> list[float]:
    L = _lightning()
    clock = _step_clock()
    trainer = _trainer(world, warmup + steps + 1, strategy, clock)
    L.seed_everything(0, verbose=False)
    trainer.fit(floor_model(m * tf, m * tb), _loader(m, warmup + steps + 1))
    return _intervals(clock.ends, warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--tf", type=float, default=0.020)
    parser.add_argument("--tb", type=float, default=0.040)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--stage-calls", type=int, default=30,
                        help="forward and backward calls of each rank's stage timed alone before its fit")
    parser.add_argument("--no-floor", action="store_true", help="only ours (skip the two plain-Lightning runs)")
    parser.add_argument("--static", action="store_true", help="ours with static_shapes=True")
    args = parser.parse_args()
    m, tf, tb, steps, warmup = args.m, args.tf, args.tb, args.steps, args.warmup
    ideal = (m + DEPTH - 1) * (tf + tb)
    sleep = m * (tf + tb)
    print(f"$ python benchmarks/bench_fit.py{' --static' if args.static else ''}  (m={m}, tf={tf * 1e3:g} ms, tb={tb * 1e3:g} ms, {steps} timed steps "
          f"after {warmup} warm-up; {machine()})")
    timeout = 120 + 3 * (warmup + steps) * ideal

    rows = []
    floors: dict[str, float] = {}
    if not args.no_floor:
        for name, world, strategy in (("Lightning, 1 process", 1, "auto"), ("Lightning DDP, 4 processes", 4, "ddp")):
            per_rank = run_distributed(worker_floor, world, m, tf, tb, steps, warmup, strategy, timeout=timeout,
                                       init_pg=False)
            step = median(per_rank[0])
            floors[name] = step - sleep
            rows.append((name, sleep * 1e3, step * 1e3, step / sleep, (step - sleep) * 1e3))
    per_rank = run_distributed(worker_ours, 4, m, tf, tb, steps, warmup, args.stage_calls, args.static,
                               timeout=timeout, init_pg=False)
    step = median(per_rank[0]["steps"])
    rows.append(("ours, 2 enc -> llm, 4 processes", ideal * 1e3, step * 1e3, step / ideal, (step - ideal) * 1e3))
    # the ideal with the stages as measured: every rank's stage is the same kind, so the mean
    # over ranks of each one's median
    stage_f = sum(r["stage"][0] for r in per_rank) / len(per_rank)
    stage_b = sum(r["stage"][1] for r in per_rank) / len(per_rank)
    measured_ideal = (m + DEPTH - 1) * (stage_f + stage_b)
    uptime = os.getloadavg()[0]
    section("Step time through Trainer.fit")
    print(table(["run", "ideal ms", "step ms", "step/ideal", "beyond ideal ms"], rows))

    # the rank whose pipeline ends the step (the longest run_pipeline): its engine.step and loop
    last = max(per_rank, key=lambda r: median(r["run_pipeline"]))
    pipeline, engine = median(last["run_pipeline"]), median(last["engine.step"])
    section("One stage call alone (median per rank, mean over ranks)")
    print(table(["phase", "nominal ms", "measured ms", "beyond ms"],
                [("forward", tf * 1e3, stage_f * 1e3, (stage_f - tf) * 1e3),
                 ("backward", tb * 1e3, stage_b * 1e3, (stage_b - tb) * 1e3)]))
    section("Where ours spends a step (medians, on the rank whose pipeline ends the step)")
    parts = [("ideal (m + D - 1)(tf + tb)", ideal * 1e3),
             ("the stages' own time beyond tf, tb: (m + D - 1)(tf' + tb' - tf - tb)", (measured_ideal - ideal) * 1e3),
             ("run_pipeline beyond that (schedule's actions)", (pipeline - measured_ideal) * 1e3),
             ("rest of engine.step (dp sync, metrics)", (engine - pipeline) * 1e3),
             ("outside engine.step (Lightning loop, strategy hooks)", (step - engine) * 1e3),
             ("step through Trainer.fit", step * 1e3)]
    print(table(["part", "ms per step"], parts))
    section("The step's end, rank by rank (medians, ms after the step's last run_pipeline end)")
    print(table(["rank", "run_pipeline end", "engine.step end", "batch end", "next run_pipeline start"],
                step_ends(per_rank, warmup)))
    print()
    print(f"ours through Trainer.fit: ideal / measured = {ideal / step:.3f} (measured / ideal {step / ideal:.3f})")
    print(f"ours through Trainer.fit: ideal with the measured stages / measured = {measured_ideal / step:.3f} "
          f"({measured_ideal * 1e3:.1f} ms; the framework's and the transport's share {(step - measured_ideal) * 1e3:.1f} ms)")
    for name, cost in floors.items():
        print(f"plain Lightning per-step cost beyond its sleep, {name}: {cost * 1e3:.1f} ms")
    print(f"(load average {uptime:.2f} at the end)")


if __name__ == "__main__":
    main()
