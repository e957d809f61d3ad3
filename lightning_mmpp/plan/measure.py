"""Measure a :class:`~lightning_mmpp.plan.calibration.Calibration` on this machine (torch, Lightning).

:func:`calibrate` starts ``world_size`` local processes and measures, in one launch:

* the link: ping-pong between ranks 0 and 1 (``dist.send`` / ``dist.recv``) at several sizes,
  fitted as one-way ``latency + bytes / bandwidth``;
* the dp gradient all-reduce over all ranks at several sizes, fitted as a ring (``2 (n-1)``
  steps of latency, ``2 (n-1)/n`` of the bytes over the bandwidth), and the smallest over a
  pair of ranks, which splits its fixed cost into a part per call and the latency per ring step;
* FSDP2 per layer, with the strategy's own sharding (:func:`~lightning_mmpp.engine.sharding.shard_stage`
  over all ranks): a linear layer's forward + backward sharded without gradient sync, minus the
  same unsharded, is two all-gathers (unshard and reshard, forward and backward); with the sync
  on, the difference is the reduce-scatter; at several parameter sizes; and the smallest over a
  pair of ranks, which splits the fixed cost per layer into the hooks' part and a latency per
  ring step (a stage sharded over fewer ranks than were calibrated pays fewer steps). The pair
  (ranks 0 and 1) is timed alone, the other ranks waiting: as a plan's two-rank stage runs its
  collectives beside ranks that do their own work, whose contention for a CPU host's cores the
  planner's shared clock charges where the layers compute (:mod:`lightning_mmpp.plan.sharing`).
  Timed with a second pair at once on a 2-core VM, a dp=2 all-gather cost 3.41 ms per layer
  against 1.65 alone, which over-predicted a plan sharding one module over 2 of 4 ranks by 10%;
* the optimizer step (AdamW) per parameter byte;
* the optimizer step's extra cost per FSDP2-sharded parameter (a ``DTensor``: each of its
  operations is dispatched through the sharding rules) over a plain one of its local shard's size;
* the copy of gradients into a flat all-reduce buffer and back
  (:func:`~lightning_mmpp.engine.data_parallel.pack_gradients` and ``unpack_gradients``, as an
  unsharded dp stage does around its gradient sum, on its main thread) per gradient byte,
  after an idle gap on every rank at once;
* the framework's own costs through ``Trainer.fit`` with ``MultiModulePipelineStrategy`` on a
  model whose layers do no work (a scalar scale, then a known wait), less what ``profile_model``
  measures for such a layer (its wait and its own call): a pure data-parallel layout at two microbatch
  counts gives the cost per compute action (every microbatch is one forward and one backward
  on every rank) and per step; a ``pp = world_size`` chain at two microbatch counts gives, under
  1F1B (``(m + pp - 1)`` forward + backward pairs on the critical path), the cost per action
  with a received message, so the message's own cost; and three such modules in a chain, all
  pure dp, against the one, what a module beyond the first adds to a pure-dp step.

Times are the slowest rank's (an all-reduce of the maximum), medians over repeats; the
collectives' (the all-reduce sizes, the FSDP2 layers) are each timed alone after an idle gap, as
a step issues them after a compute, and averaged (:func:`_after_gaps`).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

from lightning_mmpp.core.kinds import ScheduleName
from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout
from lightning_mmpp.plan.calibration import CALIBRATION_LAUNCHES, Calibration, fit_line, median_samples
from lightning_mmpp.plan.lockstep import time_lockstep

__all__ = ["calibrate"]

P2P_SIZES = (256, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024)
# up to a gradient bucket's size (25 MiB): the pure-dp all-reduce of 32 MB of gradients was
# charged at a bandwidth fitted up to 4 MiB alone
ALLREDUCE_SIZES = (256, 256 * 1024, 4 * 1024 * 1024, 16 * 1024 * 1024)
FSDP_WIDTHS = (32, 256, 1024)  # square linear layers: 4 KiB, 256 KiB, 4 MiB of fp32 parameters
OPTIMIZER_SIZES = (64 * 1024, 1024 * 1024, 8 * 1024 * 1024)
# gradient bytes packed and unpacked, in tensors of COPY_TENSOR_BYTES (a layer's weight)
COPY_SIZES = (256 * 1024, 4 * 1024 * 1024, 16 * 1024 * 1024)
COPY_TENSOR_BYTES = 256 * 1024
SHARDED_OPTIMIZER_TENSORS = 16  # FSDP2 units of one parameter each, stepped by the reference optimizer
# the framework constants are slopes over the microbatch count: the wider apart the two counts,
# the less a few milliseconds of noise per step moves them (2 -> 32: 30 microbatches apart)
DP_MICROBATCHES = (2, 32)
CHAIN_MICROBATCHES_PER_STAGE = (1, 8)  # a chain of pp stages runs pp and 8 pp microbatches
FRAMEWORK_ROUNDS = 3
MESSAGE_FIT_STEPS = 40  # bisection steps of the per-message fit: 2**-40 of a microbatch's growth
# metrics the framework model logs in its metrics run, beside its loss: the cost of a logged
# metric per step (a LightningModule.log call, its share of the metrics all-reduce) is the
# difference from the same run logging the loss alone, over these
EXTRA_METRICS = 8
DP_LAYERS = 2
# modules of the pure-dp run that measures what a module adds to a lockstep step beyond its
# actions and its gradient sum (Calibration.module_s), at the dp run's fewer microbatches
MODULES_RUN_MODULES = 3
FORWARD_S, BACKWARD_S = 0.002, 0.004  # per layer: known work, subtracted by the fits
FEATURES = 32  # width of the framework runs' activations (small: their transfers are latency only)
# a collective is timed after this much idle time on every rank (a layer's compute in a step)
GAP_S = 0.002
GAP_CALLS = 30  # calls per size timed after a gap (10 for the biggest sizes)
GAP_TRIM = 0.05  # the slowest calls left out of their mean: a garbage collection, not the collective


def _framework_gradient_bytes(world: int) -> int:
    """The fp32 gradient bytes of one framework-run module (a float per feature and layer)."""
    return 4 * DP_LAYERS * _width(world)


def _width(world: int) -> int:
    """Width of the framework runs' activations and of each layer's parameter: at least
    ``FEATURES``, and wide enough that the dp run's gradient sum has a float per rank. A sum of
    fewer floats than ranks (one scalar per layer) leaves ring chunks empty: it took 2.4 ms against
    6-7 ms for any real gradient (4 ranks, 2-core VM), and the per-step cost fitted around it came
    out ~4 ms short on every plan with a dp sum."""
    return max(FEATURES, -(-world // DP_LAYERS))


class _Wait(torch.autograd.Function):
    """Identity whose forward waits ``tf`` and whose backward ``tb`` seconds without using the
    CPU, as a kernel on an accelerator does: the framework around it is what is measured."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tf: float, tb: float) -> torch.Tensor:
        ctx.tb = tb
        time.sleep(tf)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.tb)
        return grad, None, None


class _Scale(nn.Module):
    """A layer of known cost: ``x * scale`` (a parameter per feature, so the backward runs and
    the dp sum moves a real gradient) then a wait of ``FORWARD_S`` / ``BACKWARD_S``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Wait.apply(x * self.scale, FORWARD_S, BACKWARD_S)


class _FrameworkModel(L.LightningModule):
    """One module ``net`` of ``layers`` no-work layers (or ``modules`` of them in a chain,
    ``net0 -> net1 -> ...``): what is measured is the framework."""

    def __init__(self, layers: int, width: int, extra_metrics: int = 0, modules: int = 1) -> None:
        super().__init__()
        names = ["net"] if modules == 1 else [f"net{i}" for i in range(modules)]
        self.pipeline_topology = {name: names[i + 1:i + 2] for i, name in enumerate(names)}
        for name in names:
            setattr(self, name, nn.Sequential(*[_Scale(width) for _ in range(layers)]))
        self.extra_metrics = extra_metrics

    def pipeline_inputs(self, module: str, batch: Any, upstream: dict[str, Any]) -> Any:
        return next(iter(upstream.values())) if upstream else batch

    def pipeline_loss(self, module: str, output: torch.Tensor, batch: Any) -> Any:
        loss = output.square().mean()
        if not self.extra_metrics:
            return loss
        return {"loss": loss, **{f"metric_{i}": loss.detach() for i in range(self.extra_metrics)}}

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-6)


def _device(device: str, rank: int) -> torch.device:
    return torch.device("cuda", rank % torch.cuda.device_count()) if device.startswith("cuda") else torch.device("cpu")


def _slowest(fn: Any, repeats: int, device: torch.device, rounds: int = 3) -> float:
    """Median over ``rounds`` of the mean seconds of ``fn()`` over ``repeats`` calls, on the slowest rank."""
    results = []
    for _ in range(rounds):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = torch.tensor([(time.perf_counter() - start) / repeats], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        results.append(float(t))
    return statistics.median(results)


def _after_gaps(fn: Any, calls: int, device: torch.device, gap_s: float = GAP_S, group: Any = None) -> float:
    """Mean seconds of ``fn()`` (a collective, or a layer's step with its collectives) timed call
    by call, each after ``gap_s`` of sleep on every rank, the slowest rank's time per call; the
    slowest ``GAP_TRIM`` of the calls left out.

    Why after a gap and why the mean: a step issues its collectives after a compute, with gloo's
    threads idle, not back to back. On a 2-core VM a 256-byte all-reduce took, as a mean per
    call, 0.69 ms over 2 ranks back to back and 1.58 ms after a 2 ms sleep; over 4 ranks 4.99
    and 6.47 ms (``benchmarks/collective_stalls.py --after-gaps``: a thread woken onto a busy
    core waits for the scheduler's tick). A step sums many such calls (an FSDP2 stage: three
    per layer), so what adds up is their mean, not their median. ``group``: the ranks that time
    ``fn`` (default: every rank)."""
    dist.barrier(group=group)
    times = []
    for _ in range(calls):
        time.sleep(gap_s)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    kept = sorted(slowest.tolist())[:max(1, calls - int(calls * GAP_TRIM))]
    return statistics.fmean(kept)


def _p2p(rank: int, device: torch.device) -> list[tuple[int, float]]:
    """One-way seconds per message size between ranks 0 and 1 (half a round trip)."""
    points = []
    for size in P2P_SIZES:
        buf = torch.zeros(size // 4, dtype=torch.float32, device=device)

        def ping_pong() -> None:
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        ping_pong()
        points.append((size, _slowest(ping_pong, 10 if size < 2**20 else 4, device) / 2))
    return points


def _allreduce(device: torch.device, group: Any = None,
               sizes: tuple[int, ...] = ALLREDUCE_SIZES) -> list[tuple[int, float]]:
    """Seconds of an all-reduce per size, over ``group`` (default: every rank)."""
    points = []
    for size in sizes:
        buf = torch.zeros(size // 4, dtype=torch.float32, device=device)
        dist.all_reduce(buf, group=group)
        points.append((size, _after_gaps(lambda: dist.all_reduce(buf, group=group),
                                         GAP_CALLS if size < 2**20 else GAP_CALLS // 3, device, group=group)))
    return points


def _fsdp(device: torch.device, group: Any = None,
          widths: tuple[int, ...] = FSDP_WIDTHS) -> list[tuple[int, float, float]]:
    """``(parameter bytes, all-gather seconds, reduce-scatter seconds)`` per layer and size,
    sharded over ``group`` (default: every rank)."""
    from lightning_mmpp.engine.sharding import dp_mesh, shard_stage
    from lightning_mmpp.model.partition import StageRunner

    mesh = dp_mesh(group if group is not None else dist.group.WORLD, device)
    points = []
    for width in widths:
        torch.manual_seed(0)
        plain = nn.Linear(width, width, bias=False).to(device)
        sharded = nn.Linear(width, width, bias=False).to(device)
        stage, _ = shard_stage(StageRunner("calibration", 0, [sharded], ["0"]), mesh)
        x = torch.randn(8, width, device=device)

        def step(layer: nn.Module) -> None:
            layer(x).sum().backward()

        def sharded_step(sync: bool) -> None:
            stage.before_backward(sync)
            step(sharded)

        for sync in (False, True):
            sharded_step(sync)
        step(plain)
        calls = GAP_CALLS if width < 1024 else GAP_CALLS // 3
        t_plain = _after_gaps(lambda: step(plain), calls, device, group=group)
        t_nosync = _after_gaps(lambda: sharded_step(False), calls, device, group=group)
        t_sync = _after_gaps(lambda: sharded_step(True), calls, device, group=group)
        nbytes = width * width * 4
        points.append((nbytes, max(0.0, t_nosync - t_plain) / 2, max(0.0, t_sync - t_nosync)))
    return points


def _optimizer(device: torch.device) -> list[tuple[int, float]]:
    from lightning_mmpp.plan.profile import optimizer_probe, reference_optimizer

    return [(size, _slowest(optimizer_probe(reference_optimizer, device, size), 5, device)) for size in OPTIMIZER_SIZES]


def _sharded_optimizer(device: torch.device) -> tuple[int, float]:
    """``(tensors, seconds)``: the reference optimizer's step over ``SHARDED_OPTIMIZER_TENSORS``
    parameters sharded over every rank (the strategy's own sharding) less its step over as many
    plain tensors of their local shards' size, every rank at once."""
    from lightning_mmpp.engine.sharding import dp_mesh, shard_stage
    from lightning_mmpp.model.partition import StageRunner
    from lightning_mmpp.plan.profile import primed_step, reference_optimizer

    mesh = dp_mesh(dist.group.WORLD, device)
    layers = [nn.Linear(64, 64, bias=False).to(device) for _ in range(SHARDED_OPTIMIZER_TENSORS)]
    shard_stage(StageRunner("calibration", 0, layers, [str(i) for i in range(len(layers))]), mesh)
    sharded = [p for layer in layers for p in layer.parameters()]
    plain = [nn.Parameter(torch.zeros_like(p.to_local())) for p in sharded]
    seconds = [_slowest(primed_step(reference_optimizer, params), 10, device) for params in (sharded, plain)]
    return len(sharded), max(0.0, seconds[0] - seconds[1])


def _gradient_copy(device: torch.device) -> list[tuple[int, float]]:
    """Seconds per size of packing gradients into one flat tensor and copying the sum back (the
    all-reduce itself left out: :func:`_allreduce` times it), after a gap, every rank at once."""
    from lightning_mmpp.engine.data_parallel import pack_gradients, unpack_gradients

    points = []
    for size in COPY_SIZES:
        grads = [torch.ones(COPY_TENSOR_BYTES // 4, device=device) for _ in range(size // COPY_TENSOR_BYTES)]
        points.append((size, _after_gaps(lambda: unpack_gradients(pack_gradients(grads), grads), GAP_CALLS, device)))
    return points


def _framework(world: int, device: str, steps: int) -> dict[str, list[tuple[int, float]]]:
    """Median step seconds through ``Trainer.fit`` per microbatch count: ``dp`` (one stage, dp =
    world, 2 layers) and ``chain`` (pp = world, one layer per stage); ``metrics``, the ``dp``
    run at its fewer microbatches logging ``EXTRA_METRICS`` more metrics, keyed by that number;
    and ``modules``, ``MODULES_RUN_MODULES`` such modules in a chain, every one pure dp over all
    ranks, at the ``dp`` run's fewer microbatches, keyed by the microbatches.
    The runs alternate over ``FRAMEWORK_ROUNDS`` rounds and each median pools the rounds' steps,
    so a burst of load from elsewhere weighs on every run alike instead of on one fit."""
    from lightning_mmpp.plan.validate import timed_fit

    # name: (placement, layers, microbatch counts, metrics beyond the loss, modules)
    runs = {"dp": (ModulePlacement(pp=1, dp=world), DP_LAYERS, DP_MICROBATCHES, 0, 1),
            "metrics": (ModulePlacement(pp=1, dp=world), DP_LAYERS, DP_MICROBATCHES[:1], EXTRA_METRICS, 1),
            "modules": (ModulePlacement(pp=1, dp=world, rank_offset=0), DP_LAYERS, DP_MICROBATCHES[:1], 0,
                        MODULES_RUN_MODULES)}
    if world > 1:
        runs["chain"] = (ModulePlacement(pp=world, dp=1), world, tuple(c * world for c in CHAIN_MICROBATCHES_PER_STAGE),
                         0, 1)
    width = _width(world)
    times: dict[tuple[str, int], list[float]] = {}
    chain_outside: list[float] = []  # this rank's time outside its pipeline in the chain runs
    for _ in range(FRAMEWORK_ROUNDS):
        for name, (placement, layers, counts, extra, modules) in runs.items():
            for m in counts:
                torch.manual_seed(0)
                batch = torch.randn(m * placement.dp * 2, width)
                model = _FrameworkModel(layers, width, extra, modules)
                times.setdefault((name, m), []).extend(timed_fit(
                    model, {module: placement for module in model.pipeline_topology}, model.pipeline_topology, m,
                    "1f1b", batch, steps, device, outside=chain_outside if name == "chain" else None))
    timed: dict[str, Any] = {name: [(m, statistics.median(times[(name, m)])) for m in counts]
                             for name, (_, _, counts, _, _) in runs.items()}
    timed["metrics"] = [(EXTRA_METRICS, t) for _, t in timed["metrics"]]
    if chain_outside:
        timed["chain_outside"] = statistics.median(chain_outside)
    return timed


def _layer(device: str, width: int) -> tuple[list[float], list[float]]:
    """``[forward, backward]`` seconds of one framework-run layer on one microbatch of theirs (2
    rows), and of the framework model's ``pipeline_loss`` on it, measured by
    :func:`~lightning_mmpp.plan.profile_model` as a plan's layers and loss are: its wait plus its
    call (Python, autograd, the sleep's overshoot). The framework fits subtract these, so the
    framework's constants hold what a profile does not already count."""
    from lightning_mmpp.plan.profile import profile_model

    net = profile_model(_FrameworkModel(1, width), torch.randn(2, width), device=_device(device, 0),
                        repeats=5).modules["net"]
    layer, loss = net.layers[0], net.loss
    return [layer.forward_s, layer.backward_s], [0.0, 0.0] if loss is None else [loss.forward_s, loss.backward_s]


def _worker(rank: int, world: int, device: str, steps: int) -> dict[str, Any]:
    dev = _device(device, rank)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=timedelta(seconds=300))
    layer, loss = _layer(device, _width(world))
    samples: dict[str, Any] = {"layer": layer, "loss": loss}
    if world > 1:
        samples["p2p"] = _p2p(rank, dev)
        samples["allreduce"] = _allreduce(dev)
        samples["fsdp"] = _fsdp(dev)
        samples["sharded_optimizer"] = _sharded_optimizer(dev)
        if world > 2:  # a pair of ranks too: a collective's fixed cost grows with its ring's steps
            pair = dist.new_group([0, 1])
            if rank < 2:  # alone: the other ranks wait (see the module docstring)
                samples["allreduce_pairs"] = _allreduce(dev, pair, ALLREDUCE_SIZES[:1])
                samples["fsdp_pairs"] = _fsdp(dev, pair, FSDP_WIDTHS[:1])
            dist.barrier()
    samples["optimizer"] = _optimizer(dev)
    samples["gradient_copy"] = _gradient_copy(dev)
    samples["framework"] = _framework(world, device, steps)
    return samples


def fit_calibration(world_size: int, device: str, samples: dict[str, Any]) -> Calibration:
    """The constants of :class:`Calibration` fitted to the raw ``samples`` of a calibration run."""
    cal = Calibration(world_size=world_size, device=device, samples=samples)
    inf = float("inf")
    if "p2p" in samples:
        cal.p2p_latency_s, slope = fit_line(samples["p2p"])
        cal.p2p_bandwidth = 1.0 / slope if slope > 0 else inf
    if "allreduce" in samples:
        fixed, slope = fit_line(samples["allreduce"])
        steps = 2 * (world_size - 1)
        cal.allreduce_bandwidth = steps / world_size / slope if slope > 0 else inf
        cal.allreduce_latency_s = fixed / steps
        if samples.get("allreduce_pairs") and world_size > 2:
            # the smallest over 2 ranks (2 ring steps) against over all: the fixed cost of a call
            # is its own part plus one latency per ring step
            nbytes, pair = samples["allreduce_pairs"][0]
            pair = max(0.0, pair - nbytes / cal.allreduce_bandwidth)
            # exact at 2 ranks and at the calibrated size (the part per call may come out negative
            # where a ring of more ranks costs more than its steps, on a CPU with fewer cores than
            # ranks: a charge over 2 or more ranks is still at least the pair's)
            cal.allreduce_latency_s = max(0.0, (fixed - pair) / (steps - 2))
            cal.allreduce_call_s = fixed - steps * cal.allreduce_latency_s
    if "fsdp" in samples:
        share = (world_size - 1) / world_size
        for attr, column in (("gather", 1), ("scatter", 2)):
            fixed, slope = fit_line([(p[0], p[column]) for p in samples["fsdp"]])
            setattr(cal, f"{attr}_bandwidth", share / slope if slope > 0 else inf)
            step = 0.0
            if samples.get("fsdp_pairs") and world_size > 2:
                # the smallest layer over 2 ranks (1 ring step) against over all (world - 1 steps):
                # the fixed cost per layer is the hooks' part plus one latency per ring step
                nbytes, *times = samples["fsdp_pairs"][0]
                pair = max(0.0, times[column - 1] - 0.5 * nbytes / getattr(cal, f"{attr}_bandwidth"))
                step = max(0.0, (fixed - pair) / (world_size - 2))
            setattr(cal, f"{attr}_step_s", step)
            setattr(cal, f"{attr}_layer_s", fixed - (world_size - 1) * step)  # exact at 2 ranks, as above
    cal.optimizer_s_per_byte = fit_line(samples["optimizer"])[1]
    if "sharded_optimizer" in samples:
        tensors, seconds = samples["sharded_optimizer"]
        cal.sharded_tensor_s = seconds / tensors
    if "gradient_copy" in samples:
        cal.gradient_copy_s_per_byte = fit_line(samples["gradient_copy"])[1]
    if "metrics" in samples["framework"]:
        (extra, t_extra), = samples["framework"]["metrics"]
        cal.metric_s = max(0.0, (t_extra - samples["framework"]["dp"][0][1]) / extra)
    cal.host_cores = int(samples.get("host_cores", 0))
    # one layer's forward + backward as a profile measures it (older samples: its known wait), and
    # the loss's, which the cost model charges on the loss stage (older samples: not measured)
    layer = samples.get("layer", (FORWARD_S, BACKWARD_S))
    loss = samples.get("loss", (0.0, 0.0))
    work = sum(layer)
    # pure dp, 2 layers: every microbatch is one forward and one backward on every rank, in turn,
    # and the loss between them
    (m1, t1), (m2, t2) = samples["framework"]["dp"]
    per_microbatch = DP_LAYERS * work + sum(loss)
    cal.action_s = max(0.0, ((t2 - t1) / (m2 - m1) - per_microbatch) / 2)
    # the step's gradient all-reduce (fp32, a float per feature and layer) and its copies are charged by the cost
    # model itself
    gradient_bytes = _framework_gradient_bytes(world_size)
    cal.step_s = max(0.0, t1 - m1 * (per_microbatch + 2 * cal.action_s)
                     - cal.allreduce_seconds(gradient_bytes, world_size) - cal.gradient_copy_seconds(gradient_bytes))
    if "modules" in samples["framework"]:
        cal.module_s = _fit_module_s(world_size, samples["framework"], work, layer[1], cal)
    if "chain" in samples["framework"]:
        # 1F1B on a chain of equal one-layer stages: (m + pp - 1) forward + backward pairs on the
        # critical path, every microbatch's through the last stage, which also runs the loss; each
        # action there but the first forward and the last backward receives a message
        (m1, t1), (m2, t2) = samples["framework"]["chain"]
        cal.message_s = _fit_message_s(world_size, (m1, t1), (m2, t2), layer, loss, cal)
        # what the chain's step costs beyond its actions: the per-step cost of a pipelined layout;
        # measured on its first rank, which starts the pipeline and ends it (older samples: what
        # remains of its step beyond the simulated actions, which at the pipeline's ends charges
        # each receiving action a message cost that a trace shows on the sender and as latency,
        # and left 0.8-0.9 ms of the 2.2 ms a traced 2-rank chain step spends outside its actions)
        outside = samples["framework"].get("chain_outside")
        cal.pipeline_step_s = max(0.0, outside if outside is not None else
                                  t1 - _chain_seconds(world_size, m1, layer[0], layer[1], cal, loss))
    return cal


def _sync_tail(modules: int, backward: float, sync: float) -> float:
    """How far the gradient sums of ``modules`` pure-dp modules in a chain run past the step's
    last backward: each starts when its module's last backward ends (the last module's first,
    ``backward`` apart) and after the sum before it (as the cost model queues them)."""
    done = -math.inf
    for index in range(modules):  # backward order: the last module first, ending (modules - 1 - index) backwards early
        done = max(done, -(modules - 1 - index) * backward) + sync
    return done


def _fit_module_s(world: int, framework: dict[str, Any], work: float, backward: float, cal: Calibration) -> float:
    """What each module beyond the first adds to a lockstep step beyond its actions and its
    gradient sum: the ``modules`` run (``MODULES_RUN_MODULES`` pure-dp modules in a chain) against
    the one-module ``dp`` run at the same microbatches, less the modules' layers and actions
    (``2 m`` actions each) and the part of their gradient sums that runs past the last backward
    (:func:`_sync_tail`, as the cost model times it); at least 0."""
    (m, t_modules), = framework["modules"]
    t_one = dict(framework["dp"])[m]
    k = MODULES_RUN_MODULES
    gradient_bytes = _framework_gradient_bytes(world)
    sync = cal.allreduce_seconds(gradient_bytes, world)
    layers = (k - 1) * m * (DP_LAYERS * work + 2 * cal.action_s)
    tails = _sync_tail(k, DP_LAYERS * backward + cal.action_s, sync) - _sync_tail(1, 0.0, sync)
    return max(0.0, (t_modules - t_one - layers - tails) / (k - 1))


def _fit_message_s(world: int, first: tuple[int, float], second: tuple[int, float], layer: Sequence[float],
                   loss: Sequence[float], cal: Calibration) -> float:
    """The cost per received message that makes the chain run's step grow from ``first`` to
    ``second`` (microbatches, seconds) as :func:`_chain_seconds` times it, by bisection (the
    simulated growth never falls as the message cost rises). A closed form over the critical path
    holds for one chain length only: ``(growth per microbatch - work) / 2 - action`` assumed two
    messages per microbatch, which a middle stage receives, and over 2 ranks (no middle stage, one
    message per microbatch on each) fitted half the message cost, the rest landing in the per-step
    cost of every pipelined plan."""
    (m1, t1), (m2, t2) = first, second

    def growth(message_s: float) -> float:
        trial = replace(cal, message_s=message_s)
        return (_chain_seconds(world, m2, layer[0], layer[1], trial, loss)
                - _chain_seconds(world, m1, layer[0], layer[1], trial, loss))

    low, high = 0.0, max(0.0, (t2 - t1) / (m2 - m1))  # a message costs at most a microbatch's whole growth
    if growth(low) >= t2 - t1:
        return 0.0
    for _ in range(MESSAGE_FIT_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if growth(middle) < t2 - t1 else (low, middle)
    return (low + high) / 2


def _chain_seconds(world: int, m: int, forward: float, backward: float, cal: Calibration,
                   loss: Sequence[float] = (0.0, 0.0)) -> float:
    """The framework run's chain (1F1B over ``world`` one-layer stages, ``m`` microbatches, the
    last also running the ``loss`` forward and backward) as the cost model times it from ``cal``'s
    per-action and per-message costs, without a per-step cost (its messages are a few hundred
    bytes: their bandwidth term is left out)."""
    layout = PipelineLayout({"net": ModulePlacement(pp=world, dp=1)}, {"net": []})

    def forward_s(module: str, stage: int) -> float:
        return forward + cal.action_s + (cal.message_s if stage > 0 else 0.0) + (loss[0] if stage == world - 1 else 0.0)

    def backward_s(module: str, stage: int) -> float:
        last = stage == world - 1
        return backward + cal.action_s + (loss[1] if last else cal.message_s)

    return time_lockstep(layout, m, ScheduleName.ONE_F_ONE_B, forward_s, backward_s).step_time


def calibrate(world_size: int, device: str = "cpu", steps: int = 5, timeout: float = 600.0,
              launches: int = CALIBRATION_LAUNCHES) -> Calibration:
    """Measure this machine's framework, link and collective costs on ``world_size`` local processes.

    Args:
        world_size: processes to measure with (at least 2 for the link and collectives); plans
            for other world sizes reuse the fitted constants.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU per rank).
        steps: timed training steps per framework run (after two warm-up steps).
        timeout: seconds for each launch.
        launches: separate launches of ``world_size`` processes, each measuring everything; the
            constants are fitted to the median of their samples
            (:func:`~lightning_mmpp.plan.calibration.median_samples`: a launch on a shared CPU
            can run a few percent off throughout).

    Returns:
        A :class:`~lightning_mmpp.plan.calibration.Calibration`; pass it to
        ``plan_placements(..., calibration=...)`` or ``profile_model(..., calibration=...)``, or
        keep it with :meth:`~lightning_mmpp.plan.calibration.Calibration.to_json`.
    """
    from lightning_mmpp.errors import PipelineConfigError
    from lightning_mmpp.plan.launch import run_local

    if not isinstance(world_size, int) or world_size < 1:
        raise PipelineConfigError(f"calibrate(world_size={world_size!r}): give the number of processes, >= 1.")
    if device.startswith("cuda") and world_size > torch.cuda.device_count():
        raise PipelineConfigError(
            f"calibrate(world_size={world_size}, device={device!r}) needs one GPU per rank; "
            f"{torch.cuda.device_count()} visible. Use a smaller world_size."
        )
    if not isinstance(launches, int) or launches < 1:
        raise PipelineConfigError(f"calibrate(launches={launches!r}): give the number of launches, >= 1.")
    runs = [run_local(_worker, world_size, device, steps, device=device, timeout=timeout)[0] for _ in range(launches)]
    samples = median_samples(runs)
    # on an accelerator the layers run on the devices: the host's cores are not what ranks share
    samples["host_cores"] = 0 if device.startswith("cuda") else host_cores()
    return fit_calibration(world_size, device, samples)


def host_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS tells it, else the count)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
