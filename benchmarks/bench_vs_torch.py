"""lightning_mmpp against ``torch.distributed.pipelining`` on the same sleep stages (gloo, CPU).

    python benchmarks/bench_vs_torch.py

Both sides run the same :class:`~benchmarks.common.SleepStage` modules (forward sleeps ``tf``,
backward ``tb``) on the same forked gloo processes, taking turns round by round:

* ours: lightning_mmpp's layout + communicator + schedule + runtime (1F1B or GPipe);
* torch: one ``PipelineStage`` per rank (explicit input/output examples) driven by
  ``Schedule1F1B`` or ``ScheduleGPipe``.

Two workloads:

* chain: one module in P stages (P=4, and P=8 with ``--p8``); the same work for both.
* two encoders -> LM (enc_a pp=2, enc_b pp=1, llm pp=2; 5 ranks). torch.distributed.pipelining
  runs a linear chain of stages only, so it must chain the encoders (enc_a s0 -> enc_a s1 ->
  enc_b -> llm s0 -> llm s1: 5 stages deep); ours runs enc_b beside enc_a (depth 4). The
  ``ours chained`` row runs our schedule on the same 5-stage chain, to separate what the DAG
  saves from what the implementation costs.

Step time = the median over the timed steps of the slowest rank (barrier, then one step).

``--cpu``: the 4-stage chain, 1F1B, ours (plain and static_shapes) and torch taking turns step
by step: the median CPU time of each rank's main thread per step (``time.thread_time``: the
Python and the gloo calls of the step, not the waiting), and ours / torch of their sums over the
ranks. With free stages (``--tf 0 --tb 0``) that is the framework's own cost per step, a figure
that moves far less with the load of a shared machine than the step time does. Beside it, the
Python function calls per step of each (counted by ``cProfile`` over 5 further steps): a count
that does not depend on the machine at all.

``--launches N``: the 4-stage chain, 1F1B, each of ours, ours with ``static_shapes`` and torch
alone in a launch of ``--steps`` steps (after 10 untimed), the three taking turns N times: no
pipeline runs between another's steps (interleaved, each pipeline's steps also change what the
next one finds: the other's buffers, pages and gloo state; torch's step is 10-20% shorter there
than alone).

``--zero-bubble``: the same 4-stage chain with :class:`~benchmarks.common.SplitSleepStage`
(forward ``tf``, input gradient ``tb``, weight gradient ``--tw``): our ``zero_bubble`` against
torch's ``ScheduleInterleavedZeroBubble`` with one stage per rank (it accepts that; its
``ScheduleZBVZeroBubble`` needs two stages per rank, a different amount of work per rank), and
both sides' 1F1B on the same stages.

``--virtual``: virtual stages. The 4-stage chain with ``v = 2`` chunks per rank (8 sleep stages,
each ``tf/2``, ``tb/2``: the same work per rank): our ``interleaved_1f1b`` against torch's
``ScheduleInterleaved1F1B`` (rank ``r`` holding stages ``r`` and ``r + 4`` on both sides), and
both sides' 1F1B with one whole stage per rank. Then two encoders -> LM (enc_a pp=2, enc_b,
llm pp=2) with ``virtual_stages=2`` on every module: our measured gain of ``interleaved_1f1b``
over ``1f1b`` (v = 1) beside the simulator's for the same costs.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.distributed.pipelining import (  # noqa: E402
    PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
)

from lightning_mmpp import ModulePlacement, PipelineLayout  # noqa: E402
from lightning_mmpp.core.kinds import SimulatorMode  # noqa: E402
from lightning_mmpp.core.schedule import build_schedule  # noqa: E402
from lightning_mmpp.core.simulator import simulate  # noqa: E402

from benchmarks.common import (  # noqa: E402
    OurPipeline, SleepStage, SplitSleepStage, chain, gather_max, interleaved, machine, median, section, table,
    two_encoders,
)
from tests.dist import run_distributed  # noqa: E402

MB_SHAPE = (8, 1024)


class TorchPipeline:
    """This rank's stage of a ``world``-stage chain under torch.distributed.pipelining."""

    def __init__(self, rank: int, world: int, m: int, tf: float, tb: float, tw: float | None = None) -> None:
        self.rank, self.world, self.m = rank, world, m
        self.module = SleepStage(tf, tb) if tw is None else SplitSleepStage(tf, tb, tw)
        # the examples' requires_grad tells torch that activations and their gradients cross stages
        example = torch.zeros(*MB_SHAPE, requires_grad=True)
        self.schedules = {}
        kinds = [("1f1b", Schedule1F1B), ("gpipe", ScheduleGPipe)]
        if tw is not None:
            kinds = [("1f1b", Schedule1F1B), ("zero_bubble", ScheduleInterleavedZeroBubble)]
        for name, cls in kinds:
            stage = PipelineStage(self.module, rank, world, torch.device("cpu"), input_args=example,
                                  output_args=example)
            stages = [stage] if cls is ScheduleInterleavedZeroBubble else stage
            self.schedules[name] = cls(stages, m, loss_fn=lambda out, target: out.pow(2).mean())
        g = torch.Generator().manual_seed(0)
        self.batch = torch.randn(m * MB_SHAPE[0], *MB_SHAPE[1:], generator=g)
        self.target = torch.zeros(m * MB_SHAPE[0], 1)

    def step(self, name: str) -> float:
        import time

        import torch.distributed as dist

        self.module.scale.grad = None
        schedule = self.schedules[name]
        dist.barrier()
        start = time.perf_counter()
        if self.rank == 0:
            schedule.step(self.batch)
        elif self.rank == self.world - 1:
            schedule.step(target=self.target, losses=[])
        else:
            schedule.step()
        return time.perf_counter() - start


def worker_chain(rank: int, world: int, m: int, tf: float, tb: float, rounds: int, steps: int) -> dict:
    ours = OurPipeline(chain(world), rank, m, tf, tb, mb_shape=MB_SHAPE)
    static = OurPipeline(chain(world), rank, m, tf, tb, mb_shape=MB_SHAPE, static_specs=True)
    theirs = TorchPipeline(rank, world, m, tf, tb)
    runs = {
        "ours 1f1b": lambda: ours.step("1f1b")[0],
        "ours 1f1b static": lambda: static.step("1f1b")[0],
        "torch 1f1b": lambda: theirs.step("1f1b"),
        "ours gpipe": lambda: ours.step("gpipe")[0],
        "torch gpipe": lambda: theirs.step("gpipe"),
    }
    return interleaved(runs, rounds, steps)


def worker_cpu(rank: int, world: int, m: int, tf: float, tb: float, steps: int) -> dict[str, float]:
    """Median main-thread CPU seconds per step of ours (plain, static_shapes) and torch, taking
    turns; ``"<name> calls"``: Python function calls per step."""
    import cProfile
    import pstats
    import statistics
    import time

    ours = OurPipeline(chain(world), rank, m, tf, tb, mb_shape=MB_SHAPE)
    static = OurPipeline(chain(world), rank, m, tf, tb, mb_shape=MB_SHAPE, static_specs=True)
    theirs = TorchPipeline(rank, world, m, tf, tb)
    runs = {"ours 1f1b": lambda: ours.step("1f1b"), "ours 1f1b static": lambda: static.step("1f1b"),
            "torch 1f1b": lambda: theirs.step("1f1b")}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for index in range(steps + 3):  # 3 warm-up steps each
        for name, fn in runs.items():
            start = time.thread_time()
            fn()
            if index >= 3:
                cpu[name].append(time.thread_time() - start)
    result = {name: statistics.median(values) for name, values in cpu.items()}
    for name, fn in runs.items():
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(5):
            fn()
        profile.disable()
        result[f"{name} calls"] = pstats.Stats(profile).total_calls / 5  # type: ignore[attr-defined]
    ours.close()
    static.close()
    return result


def cpu(args: argparse.Namespace) -> None:
    steps = args.rounds * args.steps
    print(f"$ python benchmarks/bench_vs_torch.py --cpu --tf {args.tf:g} --tb {args.tb:g}  (m={args.m}, microbatch "
          f"float32 {list(MB_SHAPE)}, {steps} timed steps each; {machine()})")
    section("Chain of 4 stages, 1F1B: main-thread CPU ms per step (median), ours vs torch.distributed.pipelining")
    per_rank = run_distributed(worker_cpu, 4, args.m, args.tf, args.tb, steps, timeout=300)
    rows = []
    torch_total = sum(r["torch 1f1b"] for r in per_rank)
    for name in ("ours 1f1b", "ours 1f1b static", "torch 1f1b"):
        total = sum(r[name] for r in per_rank)
        rows.append((name, *(f"{r[name] * 1e3:.2f}" for r in per_rank), f"{total * 1e3:.2f}", total / torch_total))
    print(table(["run", "rank 0", "rank 1", "rank 2", "rank 3", "sum", "/ torch"], rows))
    section("Python function calls per step (cProfile), the same runs")
    rows = []
    torch_calls = sum(r["torch 1f1b calls"] for r in per_rank)
    for name in ("ours 1f1b", "ours 1f1b static", "torch 1f1b"):
        total = sum(r[f"{name} calls"] for r in per_rank)
        rows.append((name, *(f"{r[f'{name} calls']:.0f}" for r in per_rank), f"{total:.0f}", total / torch_calls))
    print(table(["run", "rank 0", "rank 1", "rank 2", "rank 3", "sum", "/ torch"], rows))


def worker_zero_bubble(rank: int, world: int, m: int, tf: float, tb: float, tw: float, rounds: int,
                       steps: int) -> dict:
    ours = OurPipeline(chain(world), rank, m, tf, tb, mb_shape=MB_SHAPE, tw=tw)
    theirs = TorchPipeline(rank, world, m, tf, tb, tw=tw)
    runs = {
        "ours zero_bubble": lambda: ours.step("zero_bubble")[0],
        "torch zero_bubble": lambda: theirs.step("zero_bubble"),
        "ours 1f1b": lambda: ours.step("1f1b")[0],
        "torch 1f1b": lambda: theirs.step("1f1b"),
    }
    return interleaved(runs, rounds, steps)


def zero_bubble(args: argparse.Namespace) -> None:
    m, tf, ti, tw = args.m, args.tf, args.tb, args.tw
    print(f"$ python benchmarks/bench_vs_torch.py --zero-bubble  (m={m}, tf={tf * 1e3:g} ms, ti={ti * 1e3:g} ms, "
          f"tw={tw * 1e3:g} ms, microbatch float32 {list(MB_SHAPE)}, {args.rounds}x{args.steps} timed steps each; "
          f"{machine()})")
    section("Chain of 4 split sleep stages: zero bubble, ours vs torch ScheduleInterleavedZeroBubble (1 stage/rank)")
    times = run_distributed(worker_zero_bubble, 4, m, tf, ti, tw, args.rounds, args.steps, timeout=300)[0]
    rows = []
    for sched in ("zero_bubble", "1f1b"):
        ours, theirs = times[f"ours {sched}"], times[f"torch {sched}"]
        rows.append((sched, median(ours) * 1e3, median(theirs) * 1e3, median(ours) / median(theirs),
                     min(ours) * 1e3, min(theirs) * 1e3, min(ours) / min(theirs)))
    print(table(["schedule", "ours ms", "torch ms", "ours/torch", "ours min", "torch min", "min ratio"], rows))
    for stat, fn in (("median", median), ("min", min)):
        print(f"zero_bubble / 1f1b ({stat}): ours {fn(times['ours zero_bubble']) / fn(times['ours 1f1b']):.3f}, "
              f"torch {fn(times['torch zero_bubble']) / fn(times['torch 1f1b']):.3f}")


class TorchInterleavedPipeline:
    """This rank's ``v`` stages (``rank``, ``rank + world``, ...) of a ``v * world``-stage chain
    under torch's ``ScheduleInterleaved1F1B``; each stage sleeps ``tf / v`` and ``tb / v``."""

    def __init__(self, rank: int, world: int, m: int, tf: float, tb: float, v: int) -> None:
        self.rank, self.world = rank, world
        example = torch.zeros(*MB_SHAPE, requires_grad=True)
        self.modules = [SleepStage(tf / v, tb / v) for _ in range(v)]
        stages = [PipelineStage(module, rank + i * world, v * world, torch.device("cpu"), input_args=example,
                                output_args=example) for i, module in enumerate(self.modules)]
        self.schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=lambda out, target: out.pow(2).mean())
        g = torch.Generator().manual_seed(0)
        self.batch = torch.randn(m * MB_SHAPE[0], *MB_SHAPE[1:], generator=g)
        self.target = torch.zeros(m * MB_SHAPE[0], 1)

    def step(self) -> float:
        import time

        import torch.distributed as dist

        for module in self.modules:
            module.scale.grad = None
        dist.barrier()
        start = time.perf_counter()
        if self.rank == 0:
            self.schedule.step(self.batch)
        elif self.rank == self.world - 1:
            self.schedule.step(target=self.target, losses=[])
        else:
            self.schedule.step()
        return time.perf_counter() - start


def virtual_chain(pp: int, v: int) -> PipelineLayout:
    return PipelineLayout({"a": ModulePlacement(pp=pp, virtual_stages=v)}, {"a": []})


def virtual_two_encoders(v: int) -> PipelineLayout:
    """:func:`two_encoders` with ``virtual_stages=v`` on every module (enc_b's chunks on its one
    rank: a local hand-off). The simulator's best v=2 placement of this DAG: with v=2 on enc_a
    and llm only, interleaved_1f1b takes as long as 1f1b (660 ms at tf=20, tb=40, m=8)."""
    base = two_encoders()
    placements = {m: ModulePlacement(pp=p.pp, dp=p.dp, virtual_stages=v) for m, p in base.placements.items()}
    return PipelineLayout(placements, {m: list(base.topology.downstream(m)) for m in base.modules})


def worker_virtual(rank: int, world: int, m: int, tf: float, tb: float, rounds: int, steps: int) -> dict:
    ours = OurPipeline(virtual_chain(world, 2), rank, m, tf, tb, mb_shape=MB_SHAPE)
    ours_plain = OurPipeline(chain(world), rank, m, tf, tb, mb_shape=MB_SHAPE)
    theirs = TorchInterleavedPipeline(rank, world, m, tf, tb, 2)
    theirs_plain = TorchPipeline(rank, world, m, tf, tb)
    runs = {
        "ours interleaved_1f1b": lambda: ours.step("interleaved_1f1b")[0],
        "torch interleaved_1f1b": theirs.step,
        "ours 1f1b": lambda: ours_plain.step("1f1b")[0],
        "torch 1f1b": lambda: theirs_plain.step("1f1b"),
    }
    return interleaved(runs, rounds, steps)


def worker_virtual_dag(rank: int, world: int, m: int, tf: float, tb: float, rounds: int, steps: int) -> dict:
    ours = OurPipeline(virtual_two_encoders(2), rank, m, tf, tb, mb_shape=MB_SHAPE)
    plain = OurPipeline(two_encoders(), rank, m, tf, tb, mb_shape=MB_SHAPE)
    runs = {
        "interleaved_1f1b v=2": lambda: ours.step("interleaved_1f1b")[0],
        "1f1b v=1": lambda: plain.step("1f1b")[0],
    }
    return interleaved(runs, rounds, steps)


def virtual(args: argparse.Namespace) -> None:
    m, tf, tb = args.m, args.tf, args.tb
    print(f"$ python benchmarks/bench_vs_torch.py --virtual  (m={m}, tf={tf * 1e3:g} ms, tb={tb * 1e3:g} ms per "
          f"stage, a chunk 1/v of it, microbatch float32 {list(MB_SHAPE)}, {args.rounds}x{args.steps} timed steps "
          f"each; {machine()})")
    section("Chain of 4 ranks, v = 2: ours interleaved_1f1b vs torch ScheduleInterleaved1F1B")
    times = run_distributed(worker_virtual, 4, m, tf, tb, args.rounds, args.steps, timeout=300)[0]
    rows = []
    for sched, v in (("interleaved_1f1b", 2), ("1f1b", 1)):
        layout = virtual_chain(4, v)
        sim = simulate(build_schedule(layout, m, sched), layout, tf, tb, mode=SimulatorMode.EAGER).step_time
        ours, theirs = median(times[f"ours {sched}"]), median(times[f"torch {sched}"])
        rows.append((sched, v, sim * 1e3, ours * 1e3, theirs * 1e3, ours / theirs))
    print(table(["schedule", "v", "simulator ms", "ours ms", "torch ms", "ours/torch"], rows))

    section("Two encoders -> LM (enc_a and llm pp=2, every module v=2): interleaved_1f1b against 1f1b v=1, "
            "measured vs simulator")
    layout = virtual_two_encoders(2)
    times = run_distributed(worker_virtual_dag, layout.world_size, m, tf, tb, args.rounds, args.steps, timeout=300)[0]
    plain = two_encoders()
    sim_plain = simulate(build_schedule(plain, m, "1f1b"), plain, tf, tb, mode=SimulatorMode.EAGER).step_time
    sim_virtual = simulate(build_schedule(layout, m, "interleaved_1f1b"), layout, tf, tb,
                           mode=SimulatorMode.EAGER).step_time
    measured = median(times["1f1b v=1"]) / median(times["interleaved_1f1b v=2"])
    predicted = sim_plain / sim_virtual
    print(table(["run", "simulator ms", "measured ms"], [
        ("1f1b v=1", sim_plain * 1e3, median(times["1f1b v=1"]) * 1e3),
        ("interleaved_1f1b v=2", sim_virtual * 1e3, median(times["interleaved_1f1b v=2"]) * 1e3)]))
    print(f"gain (1f1b step / interleaved_1f1b step): measured {measured:.3f}, simulator {predicted:.3f}, "
          f"measured / simulator {measured / predicted:.3f}")


def worker_dag(rank: int, world: int, m: int, tf: float, tb: float, rounds: int, steps: int) -> dict:
    ours = OurPipeline(two_encoders(), rank, m, tf, tb, mb_shape=MB_SHAPE)
    ours_chained = OurPipeline(chain(world), rank, m, tf, tb, mb_shape=MB_SHAPE)
    theirs = TorchPipeline(rank, world, m, tf, tb)
    runs = {
        "ours 1f1b DAG": lambda: ours.step("1f1b")[0],
        "torch 1f1b chained": lambda: theirs.step("1f1b"),
        "ours 1f1b chained": lambda: ours_chained.step("1f1b")[0],
        "ours gpipe DAG": lambda: ours.step("gpipe")[0],
        "torch gpipe chained": lambda: theirs.step("gpipe"),
    }
    return interleaved(runs, rounds, steps)


def worker_launch(rank: int, world: int, m: int, tf: float, tb: float, who: str, steps: int) -> list[float]:
    """One pipeline alone in this launch: ``steps`` 1F1B steps (after 10 untimed), each from a
    barrier; the slowest rank's seconds per step."""
    if who == "torch":
        theirs = TorchPipeline(rank, world, m, tf, tb)
        step = lambda: theirs.step("1f1b")  # noqa: E731
    else:
        ours = OurPipeline(chain(world), rank, m, tf, tb, mb_shape=MB_SHAPE, static_specs=who == "ours static")
        step = lambda: ours.step("1f1b")[0]  # noqa: E731
    for _ in range(10):
        step()
    return gather_max([step() for _ in range(steps)])


def launches(args: argparse.Namespace) -> None:
    """The 4-stage chain, 1F1B: ours (plain, static_shapes) and torch each alone in a launch of
    ``--steps`` steps, the three taking turns ``--launches`` times; per launch the median step
    (slowest rank), and over the launches the median of each and of ours / torch per turn."""
    print(f"$ python benchmarks/bench_vs_torch.py --launches {args.launches} --steps {args.steps} --tf {args.tf:g} "
          f"--tb {args.tb:g}  (m={args.m}, microbatch float32 {list(MB_SHAPE)}; {machine()})")
    section("Chain of 4 stages, 1F1B: each pipeline alone in its launch, launches taking turns")
    runs = ("ours", "ours static", "torch")
    per: dict[str, list[float]] = {who: [] for who in runs}
    for _ in range(args.launches):
        for who in runs:
            times = run_distributed(worker_launch, 4, args.m, args.tf, args.tb, who, args.steps, timeout=600)[0]
            per[who].append(median(times))
    rows = [(who, *(f"{t * 1e3:.2f}" for t in per[who]), median(per[who]) * 1e3,
             "" if who == "torch" else median([a / b for a, b in zip(per[who], per["torch"])])) for who in runs]
    print(table(["run", *(f"launch {i + 1} ms" for i in range(args.launches)), "median ms", "ours/torch (median)"],
                rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--tf", type=float, default=0.020)
    parser.add_argument("--tb", type=float, default=0.040)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--p8", action="store_true", help="also the 8-stage chain")
    parser.add_argument("--zero-bubble", action="store_true", help="zero bubble on split sleep stages only")
    parser.add_argument("--tw", type=float, default=0.020, help="--zero-bubble: weight-gradient seconds")
    parser.add_argument("--cpu", action="store_true", help="CPU time per step of ours and torch on the 4-stage chain")
    parser.add_argument("--virtual", action="store_true", help="virtual stages (interleaved_1f1b) only")
    parser.add_argument("--launches", type=int, default=0,
                        help="the 4-stage chain only, each pipeline alone in its launch of --steps steps, N turns")
    args = parser.parse_args()
    if args.launches:
        launches(args)
        return
    if args.zero_bubble:
        zero_bubble(args)
        return
    if args.virtual:
        virtual(args)
        return
    if args.cpu:
        cpu(args)
        return
    m, tf, tb = args.m, args.tf, args.tb
    unit = tf + tb

    print(f"$ python benchmarks/bench_vs_torch.py{' --p8' if args.p8 else ''}  (m={m}, tf={tf * 1e3:g} ms, "
          f"tb={tb * 1e3:g} ms, microbatch float32 {list(MB_SHAPE)}, {args.rounds}x{args.steps} timed steps "
          f"each; {machine()})")
    summary = []
    for p in (4, 8) if args.p8 else (4,):
        section(f"Chain of {p} sleep stages: ours vs torch.distributed.pipelining")
        times = run_distributed(worker_chain, p, m, tf, tb, args.rounds, args.steps, timeout=300)[0]
        ideal = (m + p - 1) * unit
        rows = []
        for sched in ("1f1b", "gpipe"):
            ours, theirs = median(times[f"ours {sched}"]), median(times[f"torch {sched}"])
            for who, t in (("ours", ours), ("torch", theirs)):
                rows.append((f"{who} {sched}", ideal * 1e3, t * 1e3, t / ideal if ideal else "-",
                             ours / theirs if who == "ours" else ""))
            summary.append((f"chain P={p} {sched}", ours / theirs))
            if sched == "1f1b":  # static_shapes: headers checked once per step
                t = median(times["ours 1f1b static"])
                rows.append(("ours 1f1b static", ideal * 1e3, t * 1e3, t / ideal if ideal else "-", t / theirs))
                summary.append((f"chain P={p} 1f1b static_shapes", t / theirs))
        print(table(["run", "ideal ms", "step ms", "step/ideal", "ours/torch"], rows))

    section("Two encoders -> LM: ours side by side (depth 4) vs torch chained (5 stages)")
    layout = two_encoders()
    times = run_distributed(worker_dag, layout.world_size, m, tf, tb, args.rounds, args.steps, timeout=300)[0]
    ideal_dag = (m + layout.depth - 1) * unit
    ideal_chain = (m + layout.world_size - 1) * unit
    rows = []
    for run, ideal in (("ours 1f1b DAG", ideal_dag), ("ours 1f1b chained", ideal_chain), ("torch 1f1b chained", ideal_chain),
                       ("ours gpipe DAG", ideal_dag), ("torch gpipe chained", ideal_chain)):
        t = median(times[run])
        sched = "1f1b" if "1f1b" in run else "gpipe"
        rows.append((run, ideal * 1e3, t * 1e3, t / ideal if ideal else "-",
                     t / median(times[f"torch {sched} chained"])))
    print(table(["run", "ideal ms", "step ms", "step/ideal", "/torch chained"], rows))
    dag_1f1b = median(times["ours 1f1b DAG"]) / median(times["torch 1f1b chained"])
    dag_gpipe = median(times["ours gpipe DAG"]) / median(times["torch gpipe chained"])
    summary += [("2enc->llm 1f1b: ours DAG / torch chained", dag_1f1b),
                ("2enc->llm gpipe: ours DAG / torch chained", dag_gpipe),
                ("2enc->llm 1f1b: ours DAG / ours chained",
                 median(times["ours 1f1b DAG"]) / median(times["ours 1f1b chained"]))]
    if ideal_chain:
        print(f"(ideal ratio DAG/chained = (m+3)/(m+4) = {ideal_dag / ideal_chain:.3f})")

    section("Summary (ratio < 1: ours faster)")
    print(table(["comparison", "ratio"], summary))


if __name__ == "__main__":
    main()
