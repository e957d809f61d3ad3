"""The placement planner: search time, predicted gains, and predicted against measured step time.

    python benchmarks/bench_plan.py              # planner time + ratios (one process, seconds)
    python benchmarks/bench_plan.py --validate   # also run plans on sleep stages (5 processes)
    python benchmarks/bench_plan.py --search     # only the 64 ranks x 4 modules search: wall and CPU time
    python benchmarks/bench_plan.py --search --tp 1 2 4   # the same, tp searched too
    python benchmarks/bench_plan.py --search --virtual 1 2 --repeats 1   # virtual stages searched too
    python benchmarks/bench_plan.py --virtual-example   # a case where the planner picks virtual stages
    python benchmarks/bench_plan.py --tp-check   # calibrate(4), then a planned tp=2 LM: predicted vs Trainer.fit
    python benchmarks/bench_plan.py --accuracy   # the issue's models: calibrate(4), profile, plan, Trainer.fit
    python benchmarks/bench_plan.py --held-out 1 # the same on 6 random models drawn from seed 1 (--accuracy-world N)

* planner time for 8, 16 and 64 ranks on a vision + audio + LM (+ a decoder) profile;
* predicted step of the top plan against the best uniform layout (every module the same pp,
  no colocation) and the best single chain (all layers in one pipeline, the encoders one after
  the other), at equal ranks and memory limit;
* ``--validate``: sleep-stage models with known costs (a layer sleeps its forward / backward
  time scaled by the samples it gets), the top plan, the best uniform plan and the best single
  chain run by lightning_mmpp's communicator, schedule and runtime, then through the Lightning
  Trainer, in forked gloo processes: measured median step (slowest rank) against the planner's
  prediction, and the measured ratios.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_mmpp.plan import LayerProfile, ModelProfile, ModuleProfile, chain_profile, plan_placements  # noqa: E402
from lightning_mmpp.plan.calibration import CALIBRATION_LAUNCHES  # noqa: E402
from benchmarks.common import SpeedProbe, calibration_at  # noqa: E402

MB = 2**20
GiB = 2**30


def layers(n: int, forward: float, backward: float, param_bytes: float, activation: float) -> list[LayerProfile]:
    return [LayerProfile(str(i), forward, backward, param_bytes=int(param_bytes), activation_bytes_per_sample=activation,
                         input_bytes_per_sample=activation / 8, output_bytes_per_sample=activation / 8)
            for i in range(n)]


def vlm_profile(decoder: bool = False) -> ModelProfile:
    """Times per 32 samples: a 12-layer vision encoder, a 6-layer audio encoder, a 32-layer LM."""
    modules = {"vision": ModuleProfile(layers(12, 0.008, 0.016, 40 * MB, 8 * MB)),
               "audio": ModuleProfile(layers(6, 0.006, 0.012, 20 * MB, 4 * MB)),
               "llm": ModuleProfile(layers(32, 0.010, 0.020, 400 * MB, 12 * MB))}
    topology: dict[str, list[str]] = {"vision": ["llm"], "audio": ["llm"], "llm": []}
    if decoder:
        modules["dec"] = ModuleProfile(layers(8, 0.006, 0.012, 100 * MB, 8 * MB))
        topology["llm"] = ["dec"]
        topology["dec"] = []
    return ModelProfile(modules=modules, topology=topology, profile_batch_size=32, batch_size=256,
                        bandwidth_bytes_per_s=50e9, latency_s=2e-5)


def planner_section() -> None:
    print("planner time and predicted gains (memory limit 40 GiB per rank, global batch 256)")
    print("ranks  modules  plan s  top ms  uniform ms  chain ms  uniform/top  chain/top")
    for world, decoder in ((8, False), (16, False), (64, False), (64, True)):
        profile = vlm_profile(decoder)
        start = time.perf_counter()
        top = plan_placements(profile, world, memory_limit_bytes=40 * GiB, top_k=5)[0]
        seconds = time.perf_counter() - start
        uniform = plan_placements(profile, world, memory_limit_bytes=40 * GiB, top_k=1, uniform=True)[0]
        chain = plan_placements(chain_profile(profile), world, memory_limit_bytes=40 * GiB, top_k=1)[0]
        print(f"{world:5d}  {len(profile.modules):7d}  {seconds:6.2f}  {top.step_time_s * 1e3:6.0f}  "
              f"{uniform.step_time_s * 1e3:10.0f}  {chain.step_time_s * 1e3:8.0f}  "
              f"{uniform.step_time_s / top.step_time_s:11.2f}  {chain.step_time_s / top.step_time_s:9.2f}")
        print(f"       top: {top.describe()}, m={top.num_microbatches}")


# --- validation on sleep stages -------------------------------------------------------------


def sleep_profile() -> ModelProfile:
    """Known costs per 16 samples (the whole batch): two encoders and a 6-layer LM."""
    return ModelProfile(
        modules={"vision": ModuleProfile(layers(2, 0.060, 0.120, 4, 4096)),
                 "audio": ModuleProfile(layers(1, 0.040, 0.080, 4, 4096)),
                 "llm": ModuleProfile(layers(6, 0.024, 0.048, 4, 4096))},
        topology={"vision": ["llm"], "audio": ["llm"], "llm": []},
        profile_batch_size=16, batch_size=16, bandwidth_bytes_per_s=2e9, latency_s=7e-4,
    )


def worker(rank: int, world: int, runs: list[tuple[Any, ModelProfile]], steps: int) -> list[float]:
    """Each ``(plan, profile)`` run by lightning_mmpp's communicator, schedule and runtime; per
    run the median step time (slowest rank, barrier before each step)."""
    import torch
    import torch.distributed as dist

    from benchmarks.common import PerSampleSleepStage, SleepHooks
    from lightning_mmpp.engine.comm import MultiModuleCommunicator
    from lightning_mmpp.model.partition import StageRunner
    from lightning_mmpp.plan.costs import CostModel
    from lightning_mmpp.engine.runtime import PipelineRuntime
    from lightning_mmpp.core.schedule import build_schedule

    medians = []
    for plan, profile in runs:
        per = profile.profile_batch_size
        layout = plan.layout()
        cost = CostModel(profile, plan.placements, plan.num_microbatches)
        runners = {}
        for slot in layout.slots(rank):
            prof = profile.modules[slot.module].layers
            span = cost.ranges(slot.module)[slot.stage]
            runners[slot.module] = StageRunner(slot.module, slot.stage,
                                               [PerSampleSleepStage(prof[i].forward_s / per, prof[i].backward_s / per) for i in span],
                                               [str(i) for i in span])
        comm = MultiModuleCommunicator(layout, rank, torch.device("cpu"))
        runtime = PipelineRuntime(layout, rank, comm, runners, SleepHooks())
        schedule = build_schedule(layout, plan.num_microbatches, plan.schedule)
        mb = profile.batch_size // plan.num_microbatches
        data = [torch.randn(mb, 128) for _ in range(plan.num_microbatches)]

        def shard(module: str, k: int) -> torch.Tensor:
            slot = layout.slot(rank, module)
            return data[k][layout.batch_shard(module, slot.replica, mb)]

        times = []
        for step in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            runtime.run(schedule, shard)  # ends with comm.finish_step()
            t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if step:
                times.append(float(t))
        times.sort()
        medians.append(times[len(times) // 2])
    return medians


def lightning_worker(rank: int, world: int, runs: list[tuple[Any, ModelProfile]], steps: int) -> list[float]:
    """The same sleep-stage models run through ``L.Trainer(strategy=MultiModulePipelineStrategy(plan...))``;
    returns per run the median step time (slowest rank, barrier before each step)."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.common import PerSampleSleepStage
    from lightning_mmpp import MultiModulePipelineStrategy

    class SleepModel(L.LightningModule):
        def __init__(self, profile: ModelProfile) -> None:
            super().__init__()
            per = profile.profile_batch_size
            for name, module in profile.modules.items():
                setattr(self, name, nn.Sequential(*[PerSampleSleepStage(x.forward_s / per, x.backward_s / per) for x in module.layers]))

        def pipeline_inputs(self, module: str, batch: Any, upstream: dict[str, Any]) -> Any:
            return batch[0] if not upstream else sum(upstream[n] for n in sorted(upstream))

        def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
            return output.square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-6)

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            dist.barrier()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            t = torch.tensor([time.perf_counter() - self.start], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            self.times.append(float(t))

    medians = []
    for plan, profile in runs:
        timer = StepTimer()
        strategy = MultiModulePipelineStrategy(plan.placements, profile.topology, plan.num_microbatches,
                                               schedule=plan.schedule)
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps + 1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[timer])
        data = TensorDataset(torch.randn(profile.batch_size * (steps + 1), 128))
        trainer.fit(SleepModel(profile), DataLoader(data, batch_size=profile.batch_size))
        times = sorted(timer.times[1:])  # the first step warms up
        medians.append(times[len(times) // 2])
    return medians


def validation_section(world: int, steps: int) -> None:
    from tests.dist import run_distributed

    profile = sleep_profile()
    chained = chain_profile(profile)
    runs = {"top": (plan_placements(profile, world, top_k=1)[0], profile),
            "uniform": (plan_placements(profile, world, top_k=1, uniform=True)[0], profile),
            "chain": (plan_placements(chained, world, top_k=1)[0], chained)}
    measured = run_distributed(worker, world, list(runs.values()), steps, timeout=900)[0]
    through_lightning = run_distributed(lightning_worker, world, list(runs.values()), steps, timeout=900,
                                        init_pg=False)[0]
    print(f"\nvalidation: sleep stages, {world} ranks, global batch {profile.batch_size}, median of {steps} steps")
    print("plan     predicted ms  runtime ms  runtime/predicted  Lightning ms  Lightning/predicted  layout")
    for i, (name, (plan, _)) in enumerate(runs.items()):
        seconds, lit = measured[i], through_lightning[i]
        print(f"{name:8s} {plan.step_time_s * 1e3:12.1f}  {seconds * 1e3:10.1f}  {seconds / plan.step_time_s:17.2f}  "
              f"{lit * 1e3:12.1f}  {lit / plan.step_time_s:19.2f}  {plan.describe()}, m={plan.num_microbatches}")
    for i, name in ((1, "uniform"), (2, "single chain")):
        print(f"measured {name}/top {measured[i] / measured[0]:.2f} (runtime), "
              f"{through_lightning[i] / through_lightning[0]:.2f} (Lightning); predicted "
              f"{runs[list(runs)[i]][0].step_time_s / runs['top'][0].step_time_s:.2f}")


# --- accuracy: calibrated predictions against Trainer.fit -----------------------------------


def _row_sleep_model(spec: dict[str, tuple[int, float, float]], topology: dict[str, list[str]], width: int,
                     state_floats: int = 0) -> Any:
    """A LightningModule with one ``nn.Sequential`` of ``n`` row-scaled sleep layers per module
    (``spec[module] = (n, forward s per row, backward s per row)``, optionally followed by a
    fixed forward and backward time per call): ``x * scale`` (a ``width``-vector), then a sleep of
    its fixed time plus its time per row times the rows; ``state_floats`` more
    parameters per layer give the optimizer state memory and work (added to the output through
    their mean, so that their gradient is not 0: AdamW's ``sqrt`` of an all-zero state runs ~8x
    slower on CPU than of a real one, which no real model's step shows). Sources read the batch,
    a module with upstream modules their sum."""
    import lightning as L
    import torch
    from torch import nn

    from benchmarks.common import Sleep

    class Layer(nn.Module):
        def __init__(self, tf: float, tb: float, f0: float = 0.0, b0: float = 0.0) -> None:
            super().__init__()
            self.tf, self.tb, self.f0, self.b0 = tf, tb, f0, b0
            self.scale = nn.Parameter(torch.ones(width))
            self.state = nn.Parameter(torch.zeros(state_floats)) if state_floats else None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.shape[0]
            y = x * self.scale if self.state is None else x * self.scale + self.state.mean()
            return Sleep.apply(y, self.f0 + self.tf * n, self.b0 + self.tb * n)

    class RowSleepModel(L.LightningModule):
        pipeline_topology = topology

        def __init__(self) -> None:
            super().__init__()
            for name, (n, *times) in spec.items():
                setattr(self, name, nn.Sequential(*[Layer(*times) for _ in range(n)]))

        def pipeline_inputs(self, module: str, batch: Any, upstream: dict[str, Any]) -> Any:
            return batch if not upstream else sum(upstream[n] for n in sorted(upstream))

        def pipeline_loss(self, module: str, output: Any, batch: Any) -> Any:
            return output.square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-6)

    return RowSleepModel()


ACCURACY_MODELS = {
    # the models: layer costs scale with rows; not used to tune the cost model
    "3-module DAG": ({"image": (4, 0.0005, 0.0010), "audio": (2, 0.0004, 0.0008), "lm": (6, 0.0003, 0.0006)},
                     {"image": ["lm"], "audio": ["lm"], "lm": []}),
    "ViT -> LM": ({"vit": (2, 0.0010, 0.0020), "lm": (8, 0.0003, 0.0006)}, {"vit": ["lm"], "lm": []}),
    # bench_plan.py --validate's model (vision 2 x 60/120 ms, audio 40/80, LM 6 x 24/48 per 16 rows)
    "bench VLM": ({"vision": (2, 0.060 / 16, 0.120 / 16), "audio": (1, 0.040 / 16, 0.080 / 16),
                   "llm": (6, 0.024 / 16, 0.048 / 16)}, {"vision": ["llm"], "audio": ["llm"], "llm": []}),
}


def _cell(text: str) -> str:
    """``text`` as one Markdown table cell (a layout's ``|`` between modules escaped)."""
    return text.replace("|", "\\|")


def accuracy_section(world: int, batch_size: int, width: int, steps: int, memory_limits: list[float],
                     launches: int = CALIBRATION_LAUNCHES, calibration: Optional[str] = None) -> None:
    """Calibrate, profile each model, plan (top and best uniform), run both through Trainer.fit;
    the calibration and the measurement each take the median over ``launches`` launches."""
    import functools
    import subprocess

    import torch

    from lightning_mmpp.plan import profile_model
    from lightning_mmpp.plan.launch import rank_threads
    from lightning_mmpp.plan.validate import measure_runs

    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    start = time.perf_counter()
    with SpeedProbe() as probe:
        cal = calibration_at(calibration, world, launches=launches)
        print(f"\naccuracy: calibrate({world}, launches={launches}) took {time.perf_counter() - start:.1f} s; {load}; "
              f"{probe.window()}")
        print(cal.describe())
        batch = torch.randn(batch_size, width)
        runs, rows = [], []
        # the memory-limited cases: 4 KiB more parameters per layer (16 KiB with AdamW's state); under
        # 80 KiB the best uniform plan must shard the LM (its unsharded layouts do not fit)
        cases = [(name, None, 0) for name in ACCURACY_MODELS] + [("3-module DAG", limit, 1024) for limit in memory_limits]
        for name, limit, state_floats in cases:
            spec, topology = ACCURACY_MODELS[name]
            make = functools.partial(_row_sleep_model, spec, topology, width, state_floats)
            profile = profile_model(make(), batch, calibration=cal, num_threads=rank_threads(world))
            for kind, uniform in (("top", False), ("uniform", True)):
                plan = plan_placements(profile, world, memory_limit_bytes=limit, top_k=1, uniform=uniform)[0]
                runs.append((make, batch, plan))
                label = name if limit is None else f"{name} + 4 KiB/layer, memory limit {limit / 1024:.0f} KiB"
                rows.append((label, kind, plan))
        probe.window()  # the profiles
        measured = measure_runs(runs, steps, launches=launches)
        load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        print(f"\n{world} ranks, global batch {batch_size}, median of {steps} steps x {launches} launches through "
              f"Trainer.fit; {load}; {probe.window()}")
    print("| model | plan | predicted ms | measured ms | measured/predicted | layout |")
    print("|---|---|---|---|---|---|")
    for (label, kind, plan), seconds in zip(rows, measured):
        print(f"| {label} | {kind} | {plan.step_time_s * 1e3:.1f} | {seconds * 1e3:.1f} | "
              f"{seconds / plan.step_time_s:.3f} | {_cell(plan.describe())}, m={plan.num_microbatches} |")
    for i in range(0, len(rows), 2):
        print(f"{rows[i][0]}: measured uniform/top {measured[i + 1] / measured[i]:.2f}, predicted "
              f"{rows[i + 1][2].step_time_s / rows[i][2].step_time_s:.2f}")


# --- held-out models: the accuracy check on random models the cost model was not tuned on -------

HELD_OUT_TOPOLOGIES = (
    {"enc": ["lm"], "lm": []},
    {"image": ["lm"], "audio": ["lm"], "lm": []},
    {"image": ["proj"], "proj": ["lm"], "lm": []},
    {"image": ["proj"], "audio": ["lm"], "proj": ["lm"], "lm": []},
    {"image": ["lm"], "audio": ["lm"], "video": ["lm"], "lm": []},
)


def held_out_case(rng: Any) -> tuple[dict[str, tuple[int, float, float, float, float]], dict[str, list[str]],
                                     int, int, int, bool]:
    """One random model for :func:`held_out_section`: a topology of ``HELD_OUT_TOPOLOGIES``; per
    module 1-8 layers (1-3 for a projector), each with a time per row and, for half the modules,
    a fixed time per call, backward 1.5-2.5x forward, scaled so that the whole model's step on
    one process takes 100-400 ms; activations of 16, 1024 or 16384 floats per row; 0, 4 Ki or 64
    Ki more parameter floats per layer; global batch 32 or 64; and whether to plan it under a
    memory limit. Returns ``(spec, topology, width, state_floats, batch_size, limited)``."""
    topology = dict(rng.choice(HELD_OUT_TOPOLOGIES))
    batch_size = rng.choice((32, 64))
    raw = {}
    for name in topology:
        n = rng.randint(1, 3) if name == "proj" else rng.randint(1, 8)
        per_row, ratio = rng.uniform(0.1, 1.0), rng.uniform(1.5, 2.5)
        fixed = rng.uniform(0.1, 1.0) * per_row * batch_size / 4 if rng.random() < 0.5 else 0.0
        raw[name] = (n, per_row, ratio, fixed)
    total = sum(n * (per_row * batch_size + fixed) * (1 + ratio) for n, per_row, ratio, fixed in raw.values())
    scale = rng.uniform(0.1, 0.4) / total
    spec = {name: (n, per_row * scale, per_row * ratio * scale, fixed * scale, fixed * ratio * scale)
            for name, (n, per_row, ratio, fixed) in raw.items()}
    return (spec, topology, rng.choice((16, 1024, 16384)), rng.choice((0, 4096, 65536)), batch_size,
            rng.random() < 0.3)


def held_out_section(world: int, seed: int, models: int, steps: int, launches: int = CALIBRATION_LAUNCHES,
                     calibration: Optional[str] = None) -> None:
    """:func:`accuracy_section` on ``models`` random models (:func:`held_out_case`, seeded): a
    limited case is planned under 60% of its unlimited top plan's peak memory per rank."""
    import functools
    import random

    import torch

    from lightning_mmpp.errors import PipelineConfigError
    from lightning_mmpp.plan import profile_model
    from lightning_mmpp.plan.launch import rank_threads
    from lightning_mmpp.plan.validate import measure_steps

    with SpeedProbe() as probe:
        rng = random.Random(seed)
        start = time.perf_counter()
        cal = calibration_at(calibration, world, launches=launches)
        print(f"\nheld-out: calibrate({world}, launches={launches}) took {time.perf_counter() - start:.1f} s; "
              f"load {os.getloadavg()[0]:.2f}; {probe.window()}")
        print(cal.describe())
        runs, rows = [], []
        for index in range(models):
            spec, topology, width, state_floats, batch_size, limited = held_out_case(rng)
            make = functools.partial(_row_sleep_model, spec, topology, width, state_floats)
            batch = torch.randn(batch_size, width)
            profile = profile_model(make(), batch, calibration=cal, num_threads=rank_threads(world))
            limit = None
            if limited:
                limit = 0.6 * plan_placements(profile, world, top_k=1)[0].max_memory_bytes
            label = (f"{index}: " + ", ".join(f"{name} {n}x({tf * 1e6:.0f}+{f0 * 1e3:.2f}ms)" for name, (n, tf, _, f0, _)
                                                in spec.items())
                     + f"; width {width}, +{state_floats} floats/layer, batch {batch_size}"
                     + (f", limit {limit / 1024:.0f} KiB" if limit else ""))
            print(label, "->", topology)
            for kind, uniform in (("top", False), ("uniform", True)):
                try:
                    plan = plan_placements(profile, world, memory_limit_bytes=limit, top_k=1, uniform=uniform)[0]
                except PipelineConfigError as error:
                    print(f"  {kind}: no plan ({error})")
                    continue
                runs.append((make, batch, plan))
                rows.append((index, kind, plan))
        probe.window()  # the profiles
        measured = measure_steps(runs, steps, launches=launches)
        print(f"\n{world} ranks, seed {seed}, median of {steps} steps x {launches} launches through Trainer.fit; "
              f"load {os.getloadavg()[0]:.2f}; {probe.window()}")
    print("| model | plan | predicted ms | measured ms (p10) | measured/predicted | layout |")
    print("|---|---|---|---|---|---|")
    for (index, kind, plan), step in zip(rows, measured):
        print(f"| {index} | {kind} | {plan.step_time_s * 1e3:.1f} | {step.median_s * 1e3:.1f} ({step.low_s * 1e3:.1f}) | "
              f"{step.median_s / plan.step_time_s:.3f} | {_cell(plan.describe())}, m={plan.num_microbatches} |")


def search_section(repeats: int = 3, tp: tuple[int, ...] = (1,), virtual: tuple[int, ...] = (1,)) -> None:
    """The 64 ranks x 4 modules search (issue 28's <= 10 s): wall and CPU seconds per call (CPU
    time is robust to other processes on the machine), the load, and the top plan; ``tp``: the
    tp sizes searched (every module of the profile may split); ``virtual``: the virtual stage
    counts searched (every module)."""
    profile = vlm_profile(True)
    print(f"search: 64 ranks x 4 modules, memory limit 40 GiB, top_k=5, tp_options={tp}, virtual_options={virtual}; "
          f"load {os.getloadavg()[0]:.2f}")
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        plans = plan_placements(profile, 64, memory_limit_bytes=40 * GiB, top_k=5, tp_options=tp,
                                virtual_options=virtual)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(f"  wall {wall:.2f} s  CPU {cpu:.2f} s  top {plans[0].step_time_s * 1e3:.1f} ms "
              f"(5th {plans[-1].step_time_s * 1e3:.1f} ms)  load {os.getloadavg()[0]:.2f}")
    print(f"  top: {plans[0].describe()}, m={plans[0].num_microbatches}")


def virtual_profile() -> ModelProfile:
    """Two 4-layer encoders feeding a 16-layer LM of 16 MiB layers (1 GiB of state), 4 samples
    per step (times per 4 samples): tests/test_plan_virtual.py's case where interleaving pays."""
    modules = {"vision": ModuleProfile(layers(4, 0.010, 0.020, 16 * MB, MB)),
               "audio": ModuleProfile(layers(4, 0.008, 0.016, 16 * MB, MB)),
               "llm": ModuleProfile(layers(16, 0.010, 0.020, 16 * MB, MB))}
    return ModelProfile(modules=modules, topology={"vision": ["llm"], "audio": ["llm"], "llm": []},
                        profile_batch_size=4, batch_size=4, bandwidth_bytes_per_s=20e9, latency_s=1e-5)


def virtual_section() -> None:
    """Where the planner interleaves: 6 ranks, 400 MiB per rank without sharding (the LM needs
    pp = 4), 4 samples (at most 4 microbatches); the top plan with ``virtual_options=(1, 2)``
    against the best plan without virtual stages, under 1F1B and zero-bubble schedules."""
    from lightning_mmpp.plan import plans_table

    profile = virtual_profile()
    kw = dict(memory_limit_bytes=400 * MB, allow_shard=False, tolerance=0.0)
    print(f"virtual stages: 2 encoders -> 16-layer LM, 6 ranks, 400 MiB per rank, no sharding; "
          f"load {os.getloadavg()[0]:.2f}")
    for schedules in (("1f1b",), ("zero_bubble",)):
        wall, cpu = time.perf_counter(), time.process_time()
        plans = plan_placements(profile, 6, top_k=3, virtual_options=(1, 2), schedules=schedules, **kw)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        plain = plan_placements(profile, 6, top_k=1, schedules=schedules, **kw)[0]
        print(f"schedules={schedules}: search with virtual_options=(1, 2) {cpu:.2f} s CPU")
        print(plans_table(plans))
        print(f"  best without virtual stages: {plain.step_time_s * 1e3:.1f} ms ({plain.schedule}, {plain.describe()}, "
              f"m={plain.num_microbatches}); top / that = {plans[0].step_time_s / plain.step_time_s:.3f}")


TP_TOPOLOGY = {"enc_a": ["llm"], "llm": []}


def _tp_test_model() -> Any:
    """The test suite's transformer-block LM with a ``pipeline_parallelize`` hook, behind an encoder."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from models import TensorParallelModel

    return TensorParallelModel(TP_TOPOLOGY, llm_layers=4)


def tp_check_section(world: int = 4, steps: int = 5) -> None:
    """Calibrate, profile the test suite's tp model, plan with ``tp_options={"llm": (1, 2)}`` and
    with the LM held at tp=2, train both plans through ``Trainer.fit``: predicted vs measured."""
    from lightning_mmpp.plan import calibrate, plans_table, profile_model
    from lightning_mmpp.plan.launch import rank_threads
    from lightning_mmpp.plan.validate import measure_plans

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from models import Head, make_loader

    cal = calibrate(world)
    batch = next(iter(make_loader(TP_TOPOLOGY, 8, 8)))
    model = _tp_test_model()
    profile = profile_model(model, batch, calibration=cal, num_threads=rank_threads(world))
    for layer, module in zip(profile.modules["llm"].layers, model.llm):
        if isinstance(module, Head):
            layer.tp_allreduces = 0  # the hook leaves the head whole
    print(f"tp check: {world} ranks, load {os.getloadavg()[0]:.2f}")
    searched = plan_placements(profile, world, top_k=3, tp_options={"llm": (1, 2)})
    held = plan_placements(profile, world, top_k=1, tp_options={"llm": (2,)})
    print(plans_table(searched))
    plans = [searched[0], held[0]]
    measured = measure_plans(_tp_test_model, batch, plans, steps=steps)
    for name, plan, seconds in zip(("top, tp searched", "best with llm tp=2"), plans, measured):
        print(f"{name}: {plan.describe()} m={plan.num_microbatches}: predicted {plan.step_time_s * 1e3:.1f} ms, "
              f"measured {seconds * 1e3:.1f} ms, measured/predicted {seconds / plan.step_time_s:.2f}")
    print(f"load {os.getloadavg()[0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--validate", action="store_true")
    parser.add_argument("--world", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--accuracy", action="store_true",
                        help="only the calibrated accuracy table (calibrate, profile, plan, Trainer.fit)")
    parser.add_argument("--accuracy-world", type=int, default=4)
    parser.add_argument("--accuracy-steps", type=int, default=15,
                        help="--accuracy: timed steps per plan (median); a pure-dp step spreads +-7%% on 2 cores, "
                             "so a 5-step median moves by up to 5%%")
    parser.add_argument("--accuracy-launches", type=int, default=CALIBRATION_LAUNCHES,
                        help="--accuracy: launches the calibration and each plan's steps are pooled over; one launch "
                             "can run a few percent off throughout on a shared CPU")
    parser.add_argument("--memory-limit", type=float, nargs="+", default=[100 * 1024, 80 * 1024],
                        help="bytes per rank, one --accuracy memory-limited case each")
    parser.add_argument("--held-out", type=int, metavar="SEED",
                        help="only the accuracy check on random models (seeded): calibrate, profile, plan, Trainer.fit")
    parser.add_argument("--held-out-models", type=int, default=6, help="--held-out: how many random models")
    parser.add_argument("--calibration", metavar="FILE",
                        help="--accuracy / --held-out: the calibration JSON to use, measured and written there when absent")
    parser.add_argument("--search", action="store_true", help="only the 64 x 4 search time")
    parser.add_argument("--tp", type=int, nargs="+", default=[1], help="--search: the tp sizes to search")
    parser.add_argument("--virtual", type=int, nargs="+", default=[1],
                        help="--search: the virtual stage counts to search, e.g. --virtual 1 2")
    parser.add_argument("--repeats", type=int, default=3, help="--search: searches to time")
    parser.add_argument("--virtual-example", action="store_true",
                        help="only the case where the planner picks virtual stages: top plan vs the best v=1 plan")
    parser.add_argument("--tp-check", action="store_true",
                        help="only the tp check: a planned tp=2 LM, predicted vs measured through Trainer.fit")
    args = parser.parse_args()
    if args.search:
        search_section(args.repeats, tuple(args.tp), tuple(args.virtual))
        return
    if args.virtual_example:
        virtual_section()
        return
    if args.tp_check:
        tp_check_section(steps=args.steps)
        return
    if args.held_out is not None:
        held_out_section(args.accuracy_world, args.held_out, args.held_out_models, args.accuracy_steps,
                         args.accuracy_launches, args.calibration)
        return
    if args.accuracy:
        accuracy_section(args.accuracy_world, 32, 16, args.accuracy_steps, args.memory_limit, args.accuracy_launches,
                         args.calibration)
        return
    planner_section()
    if args.validate:
        validation_section(args.world, args.steps)


if __name__ == "__main__":
    main()
