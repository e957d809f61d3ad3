"""The step of a plan whose ranks outnumber their host's cores (pure Python, no torch).

The search times a plan as if every rank had a core of its own (each rank's clock runs alone).
On a host running more ranks than it has cores (several CPU ranks on a small machine, the way
this project's tests and examples run), ranks that compute at the same moment share the cores:
four ranks of a pure-dp plan computing at once on two cores each run at half speed. Measured on
a 2-core VM, a pure-dp plan of ``Linear(1024)`` layers on 4 ranks took 1.56x the step the search
predicted for it, while the same model's plan on 2 ranks (one core each) came within 1%.

Where the profile's calibration says so (:attr:`~lightning_mmpp.plan.calibration.Calibration.host_cores`
fewer than the ranks of a host) and the layers compute on the CPU (``LayerProfile.cpu_share``:
at least ``COMPUTING_SHARE`` of their time keeps a core busy), the search times every candidate
with :func:`shared_step_seconds`, which runs :func:`~lightning_mmpp.core.host_sharing.simulate_shared`
on the action lists of the whole layout:

* a compute waits for its layers' time not spent on a core (times ``1 - cpu_share``: a sleep,
  a device's kernels); all the rest needs a core: the layers' CPU time, and the framework's and
  the messages' costs, which on a CPU host are Python, autograd and gloo's copies (modelled as
  waiting, the README example's plans came out 1.32x under their measured step, as a core's
  work 1.20x);
* on a CPU device the dp gradient syncs and the step's closing work (the optimizer step, the
  gradients' copies for their sums) need a core too, for their calibrated time: gloo moves and
  sums the bytes with the CPU (a 16 MiB all-reduce between two processes on a 2-core VM: 16 ms,
  12.5 ms of it CPU on each), beside the ranks still computing; the optimizer updates and the
  copies run on it (a sharded stage's reduce-scatters inside its last backward piece, before the
  gradients it sends: :attr:`~lightning_mmpp.plan.costs.StageCost.sync_in_backward`). On an
  accelerator they wait;
* the ranks of one host are ``calibration.world_size`` consecutive ranks (the calibration ran on
  one host, as many ranks as it runs); a tp group's followers compute beside their lead, whose
  pieces count once per rank of the group.

The search prunes such candidates with :func:`host_bound_seconds`, the host's core work over
its cores, beside its critical-path bound.

With a core per rank (or more) the result is the search's own prediction where every module has
one dp; where the replicas of one module feed fewer of another, the whole layout's action lists
order a little differently from the search's (one replica per stage): within 1% in the tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from lightning_mmpp.core.actions import Compute, Schedule
from lightning_mmpp.core.host_sharing import Work, simulate_shared
from lightning_mmpp.core.kinds import ScheduleName
from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout
from lightning_mmpp.core.schedule import PhaseCosts, build_schedule
from lightning_mmpp.core.simulator import PhaseSeconds
from lightning_mmpp.plan.costs import CostModel, ModelProfile, in_lockstep, step_overhead_seconds

__all__ = ["COMPUTING_SHARE", "cpu_share_of_work", "host_bound_seconds", "planned_schedule", "ranks_per_host",
           "shared_step_seconds", "shares_cores"]


def ranks_per_host(profile: ModelProfile, world_size: int) -> int:
    """Ranks of ``world_size`` that share one host: the calibration's ranks (one host's), at most all."""
    cal = profile.calibration
    return world_size if cal is None else max(1, min(world_size, cal.world_size))


# the share of a model's layer time that must keep a core busy for its ranks to be timed sharing
# the cores: layers that wait (a timer, a GPU's kernels) still spend a little CPU on the call
# itself (2-5% for the benchmarks' sleeping layers), which changes no plan's step
COMPUTING_SHARE = 0.1


def cpu_share_of_work(profile: ModelProfile) -> float:
    """The share of the model's forward + backward layer time (its sinks' losses and its
    modules' ``pipeline_inputs`` included) that keeps a core busy."""
    total = busy = 0.0
    for module in profile.modules.values():
        for layer in [*module.layers, *(x for x in (module.loss, module.inputs) if x is not None)]:
            work = layer.forward_s + layer.backward_s
            total += work
            busy += work * layer.cpu_share
    return busy / total if total > 0 else 0.0


def shares_cores(profile: ModelProfile, world_size: int) -> bool:
    """Whether ranks of a ``world_size`` plan compete for their host's cores: the calibration
    knows the host's cores, a host runs more ranks than that, and the layers compute on the CPU
    (at least ``COMPUTING_SHARE`` of their time keeps a core busy)."""
    cal = profile.calibration
    if cal is None or cal.host_cores <= 0 or ranks_per_host(profile, world_size) <= cal.host_cores:
        return False
    return cpu_share_of_work(profile) >= COMPUTING_SHARE


def planned_schedule(layout: PipelineLayout, m: int, schedule: ScheduleName, cost: CostModel,
                     no_backward: frozenset[str]) -> Schedule:
    """The action lists the planner times for a candidate: zero_bubble ordered by the
    candidate's mean phase costs (a chunk's times its ``virtual_stages``: a whole stage's);
    every other schedule as the engine builds it (its default phase costs)."""
    if schedule is ScheduleName.ZERO_BUBBLE:
        stages = [(cost.stage(n, s), p.virtual_stages) for n, p in cost.placements.items()
                  for s in range(p.num_stages) if n not in no_backward]
        mean = [max(1e-9, sum(x) / max(1, len(stages))) for x in
                zip(*[(c.forward_s * v, c.input_s * v, c.weight_s * v) for c, v in stages])] \
            if stages else [1.0, 1.0, 1.0]
        return build_schedule(layout, m, schedule, no_backward_modules=no_backward, costs=PhaseCosts(*mean))
    return build_schedule(layout, m, schedule, no_backward_modules=no_backward)


def shared_step_seconds(profile: ModelProfile, placements: Mapping[str, ModulePlacement], m: int,
                        schedule: ScheduleName, cost: CostModel, no_backward: frozenset[str],
                        layout: Optional[PipelineLayout] = None) -> float:
    """The step of a plan with its ranks sharing their hosts' cores (see the module docstring);
    ``cost`` is the plan's :class:`~lightning_mmpp.plan.costs.CostModel`."""
    cal = profile.calibration
    layout = layout or PipelineLayout(dict(placements), profile.topology, v_shape=cost.v_shape)
    world = layout.world_size
    built = planned_schedule(layout, m, schedule, cost, no_backward)
    total = PhaseSeconds(built, layout, cost.forward, cost.backward, cost.input, cost.weight)
    waits = PhaseSeconds(built, layout, lambda n, s: cost.stage(n, s).forward_wait_s,
                         lambda n, s: cost.stage(n, s).backward_wait_s, lambda n, s: cost.stage(n, s).input_wait_s,
                         lambda n, s: cost.stage(n, s).weight_wait_s)

    on_cpu = profile.device.startswith("cpu")

    def work(rank: int, action: Compute, stage: int) -> Work:
        seconds = total.seconds(rank, action, stage)
        wait = min(seconds, waits.seconds(rank, action, stage))
        return Work(wait_s=wait, cpu_s=seconds - wait, ranks=cost.placements[action.module].tp)

    cores = float(cal.host_cores) if cal is not None and cal.host_cores > 0 else float(world)
    syncs, blocking, finals = {}, {}, {}
    for rank in range(world):
        if layout.tp_index(rank):
            continue  # a tp follower: its lead's pieces count for it
        tp = cost.placements[layout.slots(rank)[0].module].tp if layout.slots(rank) else 1

        def piece(seconds: float) -> Work:
            return Work(cpu_s=seconds, ranks=tp) if on_cpu else Work(wait_s=seconds)

        for module in {slot.module for slot in layout.slots(rank)}:
            if module in no_backward:
                continue
            stages = [cost.stage(module, s.stage) for s in layout.chunk_slots(rank, module)]
            trailing = sum(st.trailing_sync_s for st in stages)
            inside = sum(st.blocking_sync_s for st in stages)
            if trailing:
                syncs[(rank, module)] = piece(trailing)
            if inside:
                blocking[(rank, module)] = piece(inside)
        finals[rank] = piece(sum(cost.stage(s.module, s.stage).closing_s for s in layout.slots(rank)))
    timing = simulate_shared(built, layout, work, cores, ranks_per_host(profile, world), syncs, finals, blocking)
    return timing.step_time + step_overhead_seconds(profile, world, in_lockstep(placements, world))


def host_bound_seconds(profile: ModelProfile, cost: CostModel, no_backward: frozenset[str], world_size: int) -> float:
    """A lower bound of a ``world_size`` plan's step on the shared clock, before the per-step
    cost: every rank's core work over every host's cores (a host cannot do more core work than
    it has cores, and no host does less than the average). Per step, each rank of a stage runs
    its ``m`` forwards and ``m`` backwards (an ``I`` and ``W`` split does at least the fused
    backward's core work), and on a CPU device its gradient sync and its closing work. The
    search prunes with it: the per-rank clocks' bounds sit far under a shared step, and without
    it a search of zero_bubble with virtual stages on 8 CPU ranks simulated 1668 candidates in
    87 s (0.7 s with it)."""
    cal = profile.calibration
    if cal is None or cal.host_cores <= 0:
        return 0.0
    on_cpu = profile.device.startswith("cpu")
    work = 0.0
    for module, placement in cost.placements.items():
        ranks = placement.dp * placement.tp
        for stage in range(placement.num_stages):
            st = cost.stage(module, stage)
            per_microbatch = st.forward_s - st.forward_wait_s
            if module not in no_backward:
                per_microbatch += st.backward_s - st.backward_wait_s
            once = st.sync_s + st.closing_s if on_cpu else 0.0
            work += ranks * (cost.m * per_microbatch + once)
    hosts = -(-world_size // ranks_per_host(profile, world_size))
    return work / (hosts * cal.host_cores)
