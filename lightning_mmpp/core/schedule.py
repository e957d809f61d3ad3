"""Schedules as data: per-rank action lists for one training (or evaluation) step.

A schedule is a pure function of ``(layout, num_microbatches)``. It returns, for every rank,
an ordered list of actions (:mod:`lightning_mmpp.core.actions`):

* :class:`~lightning_mmpp.core.actions.Compute` — a forward, a backward (fused, or its
  input-gradient ``I`` / weight-gradient ``W`` halves) of one microbatch for one module the
  rank holds;
* :class:`~lightning_mmpp.core.actions.Exchange` — one batch of point-to-point transfers
  (activations forward, gradients backward), posted together so that opposite directions
  cannot deadlock.

How the lists are built (lockstep construction). The generator plays all ranks on a tick
clock. In each tick every rank runs at most one compute per module it holds, chosen by the
schedule's priority rule below, then every transfer produced in that tick is placed in that
tick's :class:`Exchange` on *both* ends. Each exchange therefore matches exactly the exchanges
of its peers in the same tick, so every rank reaches its partners' exchanges without waiting on
anything later: the lists are deadlock-free even under rendezvous semantics (a send completes
only when its receive is posted), which covers gloo and NCCL alike. The simulator re-checks
this for every schedule it runs.

A unit (rank, module) is *in flight* for a microbatch from its forward until its last backward
piece (the fused ``B``, or the ``W``). The schedules differ in the in-flight limit and in the
priority of the pieces:

* ``"1f1b"``: fused backward first, else a forward if fewer than ``limit = depth -
  index(module, stage)`` microbatches are in flight — Megatron's warmup (``depth - index - 1``
  forwards before the first backward) generalised to a DAG. ``index`` is the ALAP numbering by
  default (see :mod:`lightning_mmpp.core.topology`): a short branch holds fewer activations than
  under the ASAP numbering. ``benchmarks/bench_schedule.py`` measured it on the simulator: ALAP
  never stashed more in total (3% less on average over 200 random DAGs, up to 27%), and the
  step time was equal on 190 of the 200 (within -3% / +7% on the rest);
  ``numbering="asap"`` is there for a layout where that matters.
* ``"gpipe"``: all forwards of a module, then all its fused backwards.
* ``"zero_bubble"`` (ZB-H1 generalised to the DAG): the backward is split into ``I`` (input
  gradients, sent upstream at once) and ``W`` (weight gradients, which nothing waits for).
  Priority per unit and tick: ``I`` if its gradients arrived, else a forward within the
  in-flight limit, else the oldest pending ``W``: weight gradients fill the ticks where 1F1B
  would idle. See :class:`ZeroBubbleMemory` for the limit.

A stage whose inputs need no gradient (first stage of a source module, or fed only by modules
without backward) has nothing to send upstream: under zero_bubble its whole backward is one
``W`` (no ``I``), deferred like any other ``W``; 1F1B and GPipe keep a fused ``B`` everywhere.

Colocated modules keep one limit each, from their own stage index: a rank holding a short
encoder branch and the first LM stage warms each up by its own depth, rather than by "the first
module of the rank" (Megatron's open TODO).

Modules in ``no_backward_modules`` (see
:meth:`~lightning_mmpp.core.topology.ModuleTopology.no_backward_modules`) get forwards only: no
backward, no gradient transfer. Such a module runs at most ``limit`` microbatches ahead of its
slowest consumer's forwards, which bounds the inputs the consumer holds for it.

Replicas of a stage are symmetric, so all peers of one fan-in / fan-out message land in the
same exchange (``tests/test_schedule.py`` checks it on random layouts).
"""

from __future__ import annotations

import heapq
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from lightning_mmpp.core.actions import (
    Action,
    Compute,
    Direction,
    Exchange,
    MessageKey,
    Phase,
    Schedule,
    Transfer,
)
from lightning_mmpp.core.kinds import DEFAULT_NUMBERING, Numbering, ScheduleName, SimulatorMode
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.core.placement import PipelineLayout, StageSlot
from lightning_mmpp.core.simulator import simulate, validate_schedule

__all__ = [
    "NUMBERINGS",
    "SCHEDULES",
    "PhaseCosts",
    "ZeroBubbleMemory",
    "build_schedule",
    "check_schedule_args",
    "load_schedule",
    "message_groups",
]

SCHEDULES: tuple[ScheduleName, ...] = tuple(ScheduleName)  # members equal their spellings: "1f1b" in SCHEDULES
NUMBERINGS: tuple[Numbering, ...] = tuple(Numbering)
# built on the clock of :class:`_TimedBuilder`; the others in lockstep ticks
_TIMED = (ScheduleName.ZERO_BUBBLE, ScheduleName.INTERLEAVED_1F1B, ScheduleName.ZBV)


@dataclass(frozen=True)
class ZeroBubbleMemory:
    """The memory rule of ``"zero_bubble"``: how much a unit may hold in flight.

    A unit *holds* ``full + weight_fraction * deferred``: ``full`` counts its microbatches
    between their forward and their ``I`` (they keep every saved activation), ``deferred`` those
    between ``I`` and ``W``. A unit may always start a forward while it holds less than 1F1B's
    bound ``depth - index`` (``+ extra``): that keeps every unit progressing as under 1F1B.

    ``bound``:

    * ``"max"`` (default, ZB-H1's rule): beyond that, a unit may hold up to ``depth`` (``+
      extra``, 1F1B's bound of the deepest unit) as long as its rank holds no more than 1F1B's
      fullest rank may (the largest sum of ``min(m, depth - index)`` over the units of a rank),
      counting the other units of the rank at their own 1F1B bound at least. So no rank holds
      more than 1F1B's worst rank; the deferred ``W`` s wait on later stages, which hold more
      than their own 1F1B share.
    * ``"stage"``: never beyond ``depth - index``: every rank holds no more than under 1F1B.
      The last stages can then defer almost nothing, so less of the bubble goes (measured in
      ``benchmarks/README.md``).

    ``weight_fraction`` is what a deferred ``W`` holds relative to a whole microbatch (the layer
    inputs, outputs and output gradients its weight gradients need); ``1.0`` counts whole
    microbatches, a smaller value lets more ``W`` s wait for the same bytes. ``extra`` adds
    microbatches to the limit.
    """

    bound: str = "max"
    weight_fraction: float = 1.0
    extra: int = 0

    def __post_init__(self) -> None:
        if self.bound not in ("max", "stage"):
            raise PipelineConfigError(f"ZeroBubbleMemory(bound={self.bound!r}): use 'max' or 'stage'.")
        if not (0.0 <= self.weight_fraction <= 1.0):
            raise PipelineConfigError(f"ZeroBubbleMemory(weight_fraction={self.weight_fraction}): use 0.0 .. 1.0.")
        if not isinstance(self.extra, int) or self.extra < 0:
            raise PipelineConfigError(f"ZeroBubbleMemory(extra={self.extra!r}): use an integer >= 0.")


@dataclass(frozen=True)
class PhaseCosts:
    """Relative compute times the zero_bubble builder plans with (the same for every stage).

    The builder plays the schedule on a clock with these costs to decide what each rank runs
    next; the result is correct and deadlock-free for any costs, they only shape the order.
    ``lone_weight`` is the cost of a lone ``W`` (the whole backward of a stage with no ``I``,
    whose inputs need no gradient); ``None`` means ``input + weight``.
    """

    forward: float = 1.0
    input: float = 1.0
    weight: float = 1.0
    lone_weight: Optional[float] = None

    def __post_init__(self) -> None:
        costs = (self.forward, self.input, self.weight, self.lone_weight_cost)
        if min(costs) <= 0:
            raise PipelineConfigError(f"{self}: every cost must be > 0.")

    @property
    def lone_weight_cost(self) -> float:
        return self.input + self.weight if self.lone_weight is None else self.lone_weight


def check_schedule_args(
    name: ScheduleName | str, num_microbatches: int, numbering: Numbering | str = DEFAULT_NUMBERING
) -> tuple[ScheduleName, Numbering]:
    """The schedule and the stage numbering parsed; raise
    :class:`~lightning_mmpp.errors.PipelineConfigError` for an unknown schedule or numbering
    (naming the choices), or a microbatch count below 1."""
    schedule = ScheduleName.parse(name)
    if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool) or num_microbatches < 1:
        raise PipelineConfigError(f"num_microbatches={num_microbatches!r}: it must be an integer >= 1.")
    return schedule, Numbering.parse(numbering)


def build_schedule(
    layout: PipelineLayout,
    num_microbatches: int,
    name: ScheduleName | str = ScheduleName.ONE_F_ONE_B,
    forward_only: bool = False,
    numbering: Numbering | str = DEFAULT_NUMBERING,
    no_backward_modules: frozenset[str] = frozenset(),
    memory: Optional[ZeroBubbleMemory] = None,
    costs: Optional[PhaseCosts] = None,
) -> Schedule:
    """Build the action lists of every rank for one step of ``num_microbatches`` microbatches.

    ``no_backward_modules`` must be closed upstream (every upstream module of a member is a
    member): gradients never need to reach them. ``memory`` and ``costs`` apply to the timed
    builders (``"zero_bubble"``, ``"interleaved_1f1b"`` and ``"zbv"``): the rank memory rule and
    the phase costs their variants are timed with.
    """
    name, numbering = check_schedule_args(name, num_microbatches, numbering)
    no_backward = frozenset(no_backward_modules)
    if no_backward != layout.no_backward_modules(no_backward):
        raise ValueError(f"no_backward_modules {sorted(no_backward)} is not closed upstream")
    if name in _TIMED and not forward_only:
        memory, costs = memory or ZeroBubbleMemory(), costs or PhaseCosts()
        if name is ScheduleName.ZERO_BUBBLE:
            return _TimedBuilder(layout, num_microbatches, name, numbering, no_backward, memory, costs).build()
        return _shortest(layout, num_microbatches, name, numbering, no_backward, memory, costs)
    return _LockstepBuilder(layout, num_microbatches, name, forward_only, numbering, no_backward).build()


def _shortest(
    layout: PipelineLayout, m: int, name: ScheduleName, numbering: Numbering, no_backward: frozenset[str],
    memory: ZeroBubbleMemory, costs: PhaseCosts,
) -> Schedule:
    """``"interleaved_1f1b"`` / ``"zbv"``: the shortest, on the planning clock, of the builder's
    rule variants (forward-first or backward-first; deeper chunks or older microbatches first;
    for interleaved_1f1b also Megatron's warmup bound on a rank's chunks or each chunk's own 1F1B
    bound, and with or without zbv's memory rule, which lets a unit warm up beyond its own bound
    while its rank holds no more than 1F1B's fullest rank). No single order is best on every DAG:
    forward-first with the warmup bound is Megatron's interleaved order on a chain, while a short
    branch next to deep modules prefers the backward-first order of 1F1B, and a non-virtual module
    feeding virtual ones loses less to their finer chunks when it warms up deeper.

    interleaved_1f1b also weighs 1F1B's own order over the chunks (the ``"1f1b"`` builder run on
    the same layout), so it is never longer than ``"1f1b"`` on that layout."""
    interleaved = name is ScheduleName.INTERLEAVED_1F1B
    bounds = (True, False) if interleaved else (False,)
    fills = (False, True) if interleaved else (False,)
    variants = [(f, w, o, fill) for fill in fills for o in (False, True) for f in (True, False) for w in bounds]
    best: Optional[tuple[float, Schedule]] = None
    for forward_first, warmup_bound, oldest, fill in variants:
        builder = _TimedBuilder(layout, m, name, numbering, no_backward, memory, costs, forward_first, warmup_bound,
                                oldest, fill)
        schedule = builder.build()
        if best is None or builder.makespan < best[0] - 1e-9:
            best = (builder.makespan, schedule)
    assert best is not None
    if interleaved:
        plain = _LockstepBuilder(layout, m, ScheduleName.ONE_F_ONE_B, False, numbering, no_backward).build()
        schedule = Schedule(name, m, False, plain.actions)
        step = simulate(schedule, layout, costs.forward, costs.input + costs.weight, mode=SimulatorMode.EAGER).step_time
        if step < best[0] - 1e-9:
            best = (step, schedule)
    return best[1]


def load_schedule(path: str | os.PathLike, layout: PipelineLayout,
                  no_backward_modules: frozenset[str] = frozenset()) -> Schedule:
    """Read a schedule from a ``.csv`` (:meth:`Schedule.to_csv`) or text file
    (:meth:`Schedule.to_text`), then validate it against ``layout`` with the simulator.

    Raises :class:`~lightning_mmpp.errors.PipelineConfigError` naming the first problem (a
    missing or repeated compute, a compute before its inputs arrive, a transfer the layout does
    not prescribe, a deadlock).
    """
    with open(path) as f:
        text = f.read()
    schedule = Schedule.from_csv(text) if str(path).endswith(".csv") else Schedule.from_text(text)
    validate_schedule(schedule, layout, no_backward_modules)
    return schedule


_Unit = tuple[int, str, int]  # (rank, module, chunk): one stage a rank holds


class _Builder:
    """What both builders know about every (rank, module) unit of a layout, and the forward
    progress they track alike."""

    def __init__(self, layout: PipelineLayout, m: int, no_backward: frozenset[str]) -> None:
        self.layout = layout
        self.m = m
        self.no_backward = no_backward
        self.units: dict[_Unit, StageSlot] = {
            (rank, slot.module, slot.chunk): slot for rank in range(layout.world_size) for slot in layout.scheduled_slots(rank)
        }
        self.needed_inputs = {u: len(layout.forward_sources(s)) for u, s in self.units.items()}
        self.needed_grads = {u: len(layout.forward_targets(s)) for u, s in self.units.items()}
        # every consumer of a trained module is trained (no_backward is closed upstream),
        # so a trained module gets a gradient from each of its targets
        self.consumers = {
            u: sorted({(peer.rank, dst, layout.peer_chunk(s, dst, True)) for dst, peer in layout.forward_targets(s)})
            for u, s in self.units.items()
        }
        # gradients this unit sends upstream: none when every producer runs no backward
        self.sends_grads = {u: layout.sends_input_gradients(s, no_backward) for u, s in self.units.items()}
        self.next_f = {u: 0 for u in self.units}
        # the messages of a unit's forward / backward, but for the microbatch: (other module, the
        # chunk at the other end, the peer rank), looked up in the layout once instead of per action
        self.forward_edges = {
            u: tuple((dst, layout.peer_chunk(s, dst, True), peer.rank) for dst, peer in layout.forward_targets(s))
            for u, s in self.units.items()
        }
        self.gradient_edges = {
            u: tuple((src, layout.peer_chunk(s, src, False), peer.rank)
                     for src, peer in layout.forward_sources(s) if src not in no_backward)
            for u, s in self.units.items()
        }

    def _own_limit(self, slot: StageSlot, numbering: Numbering) -> int:
        """1F1B's in-flight bound of a unit: ``depth - index`` of its stage."""
        return self.layout.depth - self.layout.stage_index(slot.module, slot.stage, numbering)

    def _consumers_behind(self, unit: _Unit) -> int:
        """How far a no-backward unit's next forward is ahead of its slowest consumer's."""
        k = self.next_f[unit]
        return k - min((self.next_f[c] for c in self.consumers[unit]), default=k)

    def _forward_transfers(self, unit: _Unit, k: int) -> list[tuple[int, Transfer, int]]:
        """``(sender, transfer at the sender, receiver)`` of the output of ``unit``'s forward of ``k``."""
        rank, module, chunk = unit
        return [(rank, Transfer(MessageKey(Direction.FORWARD, module, dst, k, chunk, dst_chunk), peer), peer)
                for dst, dst_chunk, peer in self.forward_edges[unit]]

    def _gradient_transfers(self, unit: _Unit, k: int) -> list[tuple[int, Transfer, int]]:
        """``(sender, transfer at the sender, receiver)`` of the input gradients of ``unit`` for ``k``."""
        rank, module, chunk = unit
        return [(rank, Transfer(MessageKey(Direction.BACKWARD, src, module, k, src_chunk, chunk), peer), peer)
                for src, src_chunk, peer in self.gradient_edges[unit]]


def _exchanges(
    sends: Mapping[int, Sequence[Transfer]], recvs: Mapping[int, Sequence[Transfer]]
) -> list[tuple[int, Exchange]]:
    """One :class:`Exchange` per rank taking part in a tick (or round), transfers in canonical order."""
    return [
        (rank, Exchange(tuple(sorted(sends.get(rank, ()))), tuple(sorted(recvs.get(rank, ())))))
        for rank in sorted(set(sends) | set(recvs))
    ]


class _LockstepBuilder(_Builder):
    """1F1B and GPipe (and every forward-only schedule): one compute per unit per tick."""

    def __init__(
        self, layout: PipelineLayout, m: int, name: ScheduleName, forward_only: bool, numbering: Numbering,
        no_backward: frozenset[str],
    ) -> None:
        super().__init__(layout, m, no_backward)
        self.name = name
        self.forward_only = forward_only
        whole = forward_only or name is ScheduleName.GPIPE
        self.limit: dict[_Unit, int] = {
            unit: m if whole else self._own_limit(slot, numbering) for unit, slot in self.units.items()
        }
        self.next_b = {u: 0 for u in self.units}
        self.inputs: dict[tuple[_Unit, int], int] = defaultdict(int)
        self.grads: dict[tuple[_Unit, int], int] = defaultdict(int)
        self.forward_done_tick: dict[tuple[_Unit, int], int] = {}

    def _no_backward(self, unit: _Unit) -> bool:
        return self.forward_only or unit[1] in self.no_backward

    def _backward_ready(self, unit: _Unit, tick: int) -> bool:
        k = self.next_b[unit]
        if self._no_backward(unit) or k >= self.next_f[unit]:
            return False
        if self.name is ScheduleName.GPIPE and self.next_f[unit] < self.m:
            return False
        if self.needed_grads[unit] == 0:  # last stage of a sink: its own forward must be done
            return self.forward_done_tick[(unit, k)] < tick
        return self.grads[(unit, k)] == self.needed_grads[unit]

    def _forward_ready(self, unit: _Unit) -> bool:
        k = self.next_f[unit]
        if self.forward_only:
            in_flight = 0
        elif unit[1] in self.no_backward:  # ahead of the slowest consumer's forwards
            in_flight = self._consumers_behind(unit)
        else:
            in_flight = k - self.next_b[unit]
        if k >= self.m or in_flight >= self.limit[unit]:
            return False
        return self.inputs[(unit, k)] == self.needed_inputs[unit]

    def _done(self) -> bool:
        return all(
            self.next_f[u] == self.m if self._no_backward(u) else self.next_b[u] == self.m for u in self.units
        )

    def build(self) -> Schedule:
        layout = self.layout
        world = layout.world_size
        actions: list[list[Action]] = [[] for _ in range(world)]
        tick = 0
        while not self._done():
            computes: list[tuple[_Unit, Phase, int]] = []
            for rank in range(world):
                slots = layout.scheduled_slots(rank)
                for slot in reversed(slots):  # backwards first, downstream modules first
                    unit = (rank, slot.module, slot.chunk)
                    if self._backward_ready(unit, tick):
                        computes.append((unit, Phase.BACKWARD, self.next_b[unit]))
                chosen = {u for u, _, _ in computes}
                for slot in slots:
                    unit = (rank, slot.module, slot.chunk)
                    if unit not in chosen and self._forward_ready(unit):
                        computes.append((unit, Phase.FORWARD, self.next_f[unit]))
            if not computes:
                raise RuntimeError(
                    f"internal error: schedule {self.name!r} stalled at tick {tick} "
                    f"(next forwards {self.next_f}, next backwards {self.next_b})"
                )
            sends: dict[int, list[Transfer]] = defaultdict(list)
            recvs: dict[int, list[Transfer]] = defaultdict(list)
            arrivals: list[tuple[dict, tuple[_Unit, int]]] = []
            for unit, phase, k in computes:
                rank, module, chunk = unit
                actions[rank].append(Compute(phase, module, k, chunk))
                if phase is Phase.FORWARD:
                    self.next_f[unit] += 1
                    self.forward_done_tick[(unit, k)] = tick
                    transfers = self._forward_transfers(unit, k)
                    counter = self.inputs
                else:
                    self.next_b[unit] += 1
                    transfers = self._gradient_transfers(unit, k)
                    counter = self.grads
                for sender, t, receiver in transfers:
                    sends[sender].append(t)
                    recvs[receiver].append(t.mirror(sender))
                    target = t.key.consumer if phase is Phase.FORWARD else t.key.producer
                    arrivals.append((counter, ((receiver, *target), k)))
            for counter, key in arrivals:  # delivered for the next tick
                counter[key] += 1
            for rank, exchange in _exchanges(sends, recvs):
                actions[rank].append(exchange)
            tick += 1
        return Schedule(self.name, self.m, self.forward_only, tuple(tuple(a) for a in actions))


def _fullest_1f1b_rank(
    layout: PipelineLayout, m: int, numbering: Numbering, no_backward: frozenset[str], extra: int
) -> float:
    """What 1F1B's fullest rank holds, in whole stages' microbatches: the largest sum over a rank's
    trained modules of ``min(m, depth - index + extra)``, on the layout without virtual stages (a
    module's chunks on one rank together hold one stage's worth of layers)."""
    pp = {module: p.pp for module, p in layout.placements.items()}
    plain = layout.topology.stage_numbering(pp)
    per_rank: dict[int, float] = defaultdict(float)
    for rank in range(layout.world_size):
        for slot in layout.scheduled_slots(rank):
            if slot.module in no_backward or slot.chunk:
                continue
            position = layout.placements[slot.module].position(slot.stage, layout.v_shape)
            per_rank[rank] += min(m, plain.depth - plain.index(slot.module, position, numbering) + extra)
    return max(per_rank.values(), default=0.0)


class _TimedBuilder(_Builder):
    """zero_bubble, zbv and interleaved_1f1b: every rank runs one compute at a time on a clock with
    :class:`PhaseCosts`.

    Whenever a rank is free it starts, among the stages (units) it holds, a backward whose
    gradients arrived (an ``I`` when the schedule splits backwards, else a fused ``B``;
    downstream modules and deeper chunks first), else a forward whose inputs arrived and that the
    memory rule allows (deeper chunks of a module first: they are closer to the loss), else the
    oldest pending ``W``. A stage of a module with ``virtual_stages=v`` costs ``1/v`` of a whole
    stage. A message produced by a compute that
    ends at time ``t`` belongs to *round* ``t``; every rank posts one :class:`Exchange` per
    round it takes part in, in round order, after its computes that started before ``t`` and
    before those that start at ``t`` or later. Deadlock freedom, by induction on rounds: once
    every exchange of earlier rounds completed, every compute placed before a round-``t``
    exchange has its inputs (they came in earlier rounds), so every rank reaches its round-``t``
    exchange, and all its partners are in that same round.
    """

    def __init__(
        self, layout: PipelineLayout, m: int, name: ScheduleName, numbering: Numbering, no_backward: frozenset[str],
        memory: ZeroBubbleMemory, costs: PhaseCosts, forward_first: bool = False, warmup_bound: bool = False,
        oldest_first: bool = False, fill: bool = False,
    ) -> None:
        super().__init__(layout, m, no_backward)
        self.name = name
        # interleaved_1f1b: a unit may go beyond its own bound under the memory rule of zbv
        self.fill = fill
        self.split = name.split_backward
        # the schedules over virtual stages fill the pipeline first: a forward whenever the
        # memory rule allows one, deeper chunks first (Megatron's interleaved order on a chain)
        self.forward_first = forward_first
        self.oldest_first = oldest_first
        self.memory = memory
        self.costs = costs
        # 1F1B's bound per unit, always allowed (it is what keeps 1F1B from stalling)
        self.own_limit: dict[_Unit, float] = {
            u: self._own_limit(slot, numbering) + memory.extra for u, slot in self.units.items()
        }
        # interleaved_1f1b: a module's chunks on one rank hold at most Megatron's warmup + 1
        self.chunk_limit: dict[_Unit, int] = {}
        self.chunk_units: dict[_Unit, list[_Unit]] = {}
        # what a microbatch in flight on a unit weighs: 1/v of a whole stage of its module
        self.weight = {u: 1.0 / layout.placements[u[1]].virtual_stages for u in self.units}
        trained = [u for u in self.units if u[1] not in no_backward]
        self.virtual = layout.virtual
        if memory.bound == "max":
            # beyond it, up to 1F1B's deepest unit, while the rank holds no more than 1F1B's
            # fullest rank would
            self.unit_cap = {u: float(layout.depth + memory.extra) for u in self.units}
            self.rank_cap = _fullest_1f1b_rank(layout, m, numbering, no_backward, memory.extra)
        else:
            self.unit_cap = dict(self.own_limit)
            self.rank_cap = 0.0
        if name is ScheduleName.INTERLEAVED_1F1B:
            self._interleaved_limits(numbering, memory.extra, warmup_bound)
        self.trained_on_rank: dict[int, list[_Unit]] = defaultdict(list)
        for u in trained:
            self.trained_on_rank[u[0]].append(u)
        # per rank: units in backward priority order, then in forward priority order
        self.backward_order: dict[int, list[_Unit]] = {}
        self.forward_order: dict[int, list[_Unit]] = {}
        modules = {module: i for i, module in enumerate(layout.modules)}
        for rank in range(layout.world_size):
            units = [(rank, slot.module, slot.chunk) for slot in layout.scheduled_slots(rank)]
            self.backward_order[rank] = sorted(units, key=lambda u: (-modules[u[1]], -u[2]))
            self.forward_order[rank] = sorted(units, key=lambda u: (modules[u[1]], -u[2]))
        self.next_i = {u: 0 for u in self.units}  # next I or fused B (or, without an I, next lone W)
        self.next_w = {u: 0 for u in self.units}
        # arrival times of the inputs / gradients of (unit, k)
        self.inputs: dict[tuple[_Unit, int], list[float]] = defaultdict(list)
        self.grads: dict[tuple[_Unit, int], list[float]] = defaultdict(list)
        self.forward_end: dict[tuple[_Unit, int], float] = {}
        self.ends: list[float] = []  # heap of the end times of the computes started so far
        # Ranks to ask for a compute when free: a rank that found nothing keeps finding nothing
        # until something it depends on changes: an input or gradient arrives (at the end of its
        # sender's compute: ``_wake``), or a consumer of one of its no-backward units starts a
        # forward (``watchers``). Its own counters change only when it computes, and a rank
        # that computes stays in the set. The same choices as asking every free rank every time.
        self.dirty: set[int] = set(range(layout.world_size))
        self._wake: dict[float, set[int]] = defaultdict(set)
        self.watchers: dict[_Unit, set[int]] = {}
        for u in self.units:
            if u[1] in no_backward:
                for consumer in self.consumers[u]:
                    self.watchers.setdefault(consumer, set()).add(u[0])
        self.unfinished = set(self.units)

    def _interleaved_limits(self, numbering: Numbering, extra: int, warmup_bound: bool) -> None:
        """Megatron's interleaved bound, on the DAG: the chunks of a module with ``virtual_stages=v``
        on one rank hold at most ``2 * (depth - index - 1) + (v - 1) * pp + 1`` microbatches
        together, ``depth`` and ``index`` in the numbering without virtual stages (on a chain
        ``depth - index - 1 = pp - 1 - rank``: Megatron's warmup plus one). A module without
        virtual stages keeps 1F1B's bound in that numbering. A unit goes beyond its own bound
        only under ``fill`` (zbv's rule: while its rank holds no more than 1F1B's fullest rank)."""
        layout = self.layout
        plain = layout.topology.stage_numbering({module: p.pp for module, p in layout.placements.items()})
        for unit, slot in self.units.items():
            p = layout.placements[slot.module]
            position = p.position(slot.stage, layout.v_shape)
            remaining = plain.depth - plain.index(slot.module, position, numbering)
            if p.virtual_stages == 1:
                self.own_limit[unit] = remaining + extra
            elif warmup_bound:
                self.chunk_limit[unit] = 2 * (remaining - 1) + (p.virtual_stages - 1) * p.pp + 1 + extra
                self.chunk_units[unit] = [u for u in self.units if u[:2] == unit[:2]]
            if not self.fill:  # else beyond it while the rank holds no more than 1F1B's fullest rank
                self.unit_cap[unit] = self.own_limit[unit]

    # --- readiness at time ``now`` ----------------------------------------------------------

    def _arrived(self, times: list[float], needed: int, now: float) -> bool:
        return len(times) == needed and max(times, default=0.0) <= now

    def _grads_ready(self, unit: _Unit, k: int, now: float) -> bool:
        if self.needed_grads[unit] == 0:  # last stage of a sink: its own forward must be done
            return self.forward_end[(unit, k)] <= now
        return self._arrived(self.grads[(unit, k)], self.needed_grads[unit], now)

    def _input_ready(self, unit: _Unit, now: float) -> bool:
        """An ``I`` (split schedules) or a fused ``B`` can start."""
        k = self.next_i[unit]
        if unit[1] in self.no_backward or k >= self.next_f[unit]:
            return False
        if self.split and not self.sends_grads[unit]:
            return False  # its whole backward is a lone W
        return self._grads_ready(unit, k, now)

    def _forward_ready(self, unit: _Unit, now: float) -> bool:
        k = self.next_f[unit]
        if k >= self.m:
            return False
        if unit[1] in self.no_backward:  # ahead of the slowest consumer's forwards
            in_flight: float = self._consumers_behind(unit)
            if in_flight + 1 > self.own_limit[unit] + 1e-9:
                return False
        else:
            in_flight = self._held(unit)
            within_own = in_flight + 1 <= self.own_limit[unit] + 1e-9
            if unit in self.chunk_limit and in_flight >= 1:  # interleaved: the module's chunks on the rank together
                held = sum(self._held(u) for u in self.chunk_units[unit])
                if held + 1 > self.chunk_limit[unit]:
                    return False
            if within_own and self.virtual and self.split and in_flight >= 1:  # zbv
                # chunks share their rank's memory: the virtual bounds of a rank's chunks add up
                # to more than 1F1B's, so they hold what 1F1B's fullest rank does at most
                total = sum(self.weight[u] * self._held(u) for u in self.trained_on_rank[unit[0]])
                within_own = total + self.weight[unit] <= self.rank_cap + 1e-9
            if not within_own:
                # room beyond the unit's own 1F1B bound, keeping the others' own bounds free
                others = [u for u in self.trained_on_rank[unit[0]] if u != unit]
                reserved = sum(self.weight[u] * max(self._held(u), min(self.m, self.own_limit[u])) for u in others)
                mine = self.weight[unit] * (in_flight + 1)
                if in_flight + 1 > self.unit_cap[unit] + 1e-9 or mine + reserved > self.rank_cap + 1e-9:
                    return False
        return self._arrived(self.inputs[(unit, k)], self.needed_inputs[unit], now)

    def _held(self, unit: _Unit) -> float:
        """What a trained unit holds, in its microbatches: whole ones until their I (or B),
        ``weight_fraction`` after."""
        if not self.split or not self.sends_grads[unit]:
            return self.next_f[unit] - self.next_w[unit]
        full = self.next_f[unit] - self.next_i[unit]
        return full + self.memory.weight_fraction * (self.next_i[unit] - self.next_w[unit])

    def _weight_ready(self, unit: _Unit, now: float) -> bool:
        if unit[1] in self.no_backward or not self.split:
            return False
        k = self.next_w[unit]
        if self.sends_grads[unit]:
            return k < self.next_i[unit]
        return k < self.next_f[unit] and self._grads_ready(unit, k, now)

    def _choose(self, rank: int, now: float) -> Optional[tuple[_Unit, Phase]]:
        backward = Phase.BACKWARD_INPUT if self.split else Phase.BACKWARD
        if self.oldest_first:
            fs = [u for u in self.forward_order[rank] if self._forward_ready(u, now)]
            bs = [u for u in self.backward_order[rank] if self._input_ready(u, now)]
            f = min(fs, key=lambda u: self.next_f[u]) if fs else None
            b = min(bs, key=lambda u: self.next_i[u]) if bs else None
            order = [(f, Phase.FORWARD), (b, backward)] if self.forward_first else [(b, backward), (f, Phase.FORWARD)]
            for u, ph in order:
                if u is not None:
                    return u, ph
            pending = [u for u in self.backward_order[rank] if self._weight_ready(u, now)]
            if pending:
                return min(pending, key=lambda u: self.next_w[u]), Phase.BACKWARD_WEIGHT
            return None
        if self.forward_first:
            for unit in self.forward_order[rank]:
                if self._forward_ready(unit, now):
                    return unit, Phase.FORWARD
        for unit in self.backward_order[rank]:
            if self._input_ready(unit, now):
                return unit, backward
        for unit in self.forward_order[rank]:
            if self._forward_ready(unit, now):
                return unit, Phase.FORWARD
        pending = [u for u in self.backward_order[rank] if self._weight_ready(u, now)]
        if pending:
            return min(pending, key=lambda u: self.next_w[u]), Phase.BACKWARD_WEIGHT
        return None

    def _done(self) -> bool:
        return not self.unfinished

    def _cost(self, unit: _Unit, phase: Phase) -> float:
        if phase is Phase.FORWARD:
            cost = self.costs.forward
        elif phase is Phase.BACKWARD_INPUT:
            cost = self.costs.input
        elif phase is Phase.BACKWARD:
            cost = self.costs.input + self.costs.weight
        else:
            cost = self.costs.weight if self.sends_grads[unit] else self.costs.lone_weight_cost
        return cost * self.weight[unit]

    # --- the clock ------------------------------------------------------------------------

    def build(self) -> Schedule:
        layout = self.layout
        world = layout.world_size
        free_at = [0.0] * world
        # per rank: (time, order, action); order 0 = an exchange (before computes starting then)
        timeline: list[list[tuple[float, int, Action]]] = [[] for _ in range(world)]
        rounds: dict[float, tuple[dict[int, list[Transfer]], dict[int, list[Transfer]]]] = {}
        now = 0.0
        dirty = self.dirty
        while not self._done():
            for rank in range(world):
                if free_at[rank] > now or rank not in dirty:
                    continue
                choice = self._choose(rank, now)
                if choice is None:
                    dirty.discard(rank)
                    continue
                unit, phase = choice
                self._run(unit, phase, now, timeline, rounds, free_at)
            # every arrival and every rank becoming free is the end of a compute
            while self.ends and self.ends[0] <= now:
                heapq.heappop(self.ends)
            if not self.ends:
                if self._done():
                    break
                raise RuntimeError(
                    f"internal error: {self.name} stalled at time {now} (next forwards {self.next_f}, "
                    f"next I {self.next_i}, next W {self.next_w})"
                )
            now = heapq.heappop(self.ends)
            for time in [t for t in self._wake if t <= now]:
                dirty |= self._wake.pop(time)
        for time, (sends, recvs) in rounds.items():
            for rank, exchange in _exchanges(sends, recvs):
                timeline[rank].append((time, 0, exchange))
        actions = tuple(tuple(a for _, _, a in sorted(events, key=lambda e: e[:2])) for events in timeline)
        self.makespan = max(free_at)
        return Schedule(self.name, self.m, False, actions)

    def _run(self, unit: _Unit, phase: Phase, now: float, timeline: list, rounds: dict, free_at: list) -> None:
        rank, module, chunk = unit
        end = round(now + self._cost(unit, phase), 9)
        free_at[rank] = end
        heapq.heappush(self.ends, end)
        if phase is Phase.FORWARD:
            k = self.next_f[unit]
            self.next_f[unit] += 1
            self.forward_end[(unit, k)] = end
            transfers = self._forward_transfers(unit, k)
        elif phase in (Phase.BACKWARD_INPUT, Phase.BACKWARD):
            k = self.next_i[unit]
            self.next_i[unit] += 1
            if phase is Phase.BACKWARD:
                self.next_w[unit] += 1  # nothing deferred
            transfers = self._gradient_transfers(unit, k)
        else:
            k = self.next_w[unit]
            self.next_w[unit] += 1
            if not self.sends_grads[unit]:
                self.next_i[unit] += 1  # the lone W was the whole backward
            transfers = []
        timeline[rank].append((now, 1, Compute(phase, module, k, chunk)))
        if phase is Phase.FORWARD:
            self.dirty.update(self.watchers.get(unit, ()))  # a no-backward producer may go ahead now
        if (self.next_f[unit] if module in self.no_backward else self.next_w[unit]) == self.m:
            self.unfinished.discard(unit)
        if transfers:
            sends, recvs = rounds.setdefault(end, ({}, {}))
            # the receivers may start something once the message is there
            woken = self.dirty if end <= now else self._wake[end]
            for sender, t, receiver in transfers:
                sends.setdefault(sender, []).append(t)
                recvs.setdefault(receiver, []).append(t.mirror(sender))
                woken.add(receiver)
                if phase is Phase.FORWARD:
                    self.inputs[((receiver, *t.key.consumer), k)].append(end)
                else:
                    self.grads[((receiver, *t.key.producer), k)].append(end)


def message_groups(transfers: Sequence[Transfer]) -> dict[MessageKey, list[Transfer]]:
    """Group the per-peer transfers of one exchange by message key."""
    groups: dict[MessageKey, list[Transfer]] = defaultdict(list)
    for t in transfers:
        groups[t.key].append(t)
    return dict(groups)

