"""Schedules as data: per-rank action lists for one training (or evaluation) step.

A schedule is a pure function of ``(layout, num_microbatches)``. It returns, for every rank,
an ordered list of actions (:mod:`lightning_mmpp.actions`):

* :class:`~lightning_mmpp.actions.Compute` — a forward, a backward (fused, or its
  input-gradient ``I`` / weight-gradient ``W`` halves) of one microbatch for one module the
  rank holds;
* :class:`~lightning_mmpp.actions.Exchange` — one batch of point-to-point transfers
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
  default (see :mod:`lightning_mmpp.topology`): a short branch holds fewer activations than
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
:meth:`~lightning_mmpp.topology.ModuleTopology.no_backward_modules`) get forwards only: no
backward, no gradient transfer. Such a module runs at most ``limit`` microbatches ahead of its
slowest consumer's forwards, which bounds the inputs the consumer holds for it.

Replicas of a stage are symmetric, so all peers of one fan-in / fan-out message land in the
same exchange (``tests/test_schedule.py`` checks it on random layouts).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from lightning_mmpp.actions import (
    Action,
    Compute,
    Direction,
    Exchange,
    MessageKey,
    Phase,
    Schedule,
    Transfer,
)
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.placement import PipelineLayout, StageSlot

__all__ = [
    "NUMBERINGS",
    "SCHEDULES",
    "ZeroBubbleMemory",
    "build_schedule",
    "check_schedule_args",
    "load_schedule",
    "message_groups",
]

SCHEDULES = ("1f1b", "gpipe", "zero_bubble")
NUMBERINGS = ("alap", "asap")


@dataclass(frozen=True)
class ZeroBubbleMemory:
    """The memory rule of ``"zero_bubble"``: how many microbatches a unit may hold in flight.

    A unit may start a forward while ``full + weight_fraction * deferred < limit``, where
    ``full`` counts microbatches between their forward and their ``I`` (they hold every saved
    activation), ``deferred`` those between ``I`` and ``W``, and ``limit = depth - index +
    extra`` (1F1B's bound with ``extra = 0``).

    ``weight_fraction`` is what a deferred ``W`` holds relative to a whole microbatch (the
    layer inputs and output gradients the weight gradients need). ``1.0`` counts whole
    microbatches: never more stashed microbatches than 1F1B on any unit.
    """

    weight_fraction: float = 1.0
    extra: int = 0

    def __post_init__(self) -> None:
        if not (0.0 <= self.weight_fraction <= 1.0):
            raise PipelineConfigError(f"ZeroBubbleMemory(weight_fraction={self.weight_fraction}): use 0.0 .. 1.0.")
        if not isinstance(self.extra, int) or self.extra < 0:
            raise PipelineConfigError(f"ZeroBubbleMemory(extra={self.extra!r}): use an integer >= 0.")


def check_schedule_args(name: str, num_microbatches: int, numbering: str = "alap") -> None:
    """Raise for an unknown schedule or numbering, or a microbatch count below 1."""
    if name not in SCHEDULES:
        raise PipelineConfigError(f"unknown schedule {name!r}; choose one of {list(SCHEDULES)}.")
    if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool) or num_microbatches < 1:
        raise PipelineConfigError(f"num_microbatches={num_microbatches!r}: it must be an integer >= 1.")
    if numbering not in NUMBERINGS:
        raise PipelineConfigError(f"unknown stage numbering {numbering!r}; choose one of {list(NUMBERINGS)}.")


def build_schedule(
    layout: PipelineLayout,
    num_microbatches: int,
    name: str = "1f1b",
    forward_only: bool = False,
    numbering: str = "alap",
    no_backward_modules: frozenset[str] = frozenset(),
    memory: Optional[ZeroBubbleMemory] = None,
) -> Schedule:
    """Build the action lists of every rank for one step of ``num_microbatches`` microbatches.

    ``no_backward_modules`` must be closed upstream (every upstream module of a member is a
    member): gradients never need to reach them. ``memory`` applies to ``"zero_bubble"`` only.
    """
    check_schedule_args(name, num_microbatches, numbering)
    no_backward = frozenset(no_backward_modules)
    if no_backward != layout.no_backward_modules(no_backward):
        raise ValueError(f"no_backward_modules {sorted(no_backward)} is not closed upstream")
    builder = _LockstepBuilder(layout, num_microbatches, name, forward_only, numbering, no_backward,
                               memory or ZeroBubbleMemory())
    return builder.build()


def load_schedule(path: str | os.PathLike, layout: PipelineLayout,
                  no_backward_modules: frozenset[str] = frozenset()) -> Schedule:
    """Read a schedule from a ``.csv`` (:meth:`Schedule.to_csv`) or text file
    (:meth:`Schedule.to_text`), then validate it against ``layout`` with the simulator.

    Raises :class:`~lightning_mmpp.errors.PipelineConfigError` naming the first problem (a
    missing or repeated compute, a compute before its inputs arrive, a transfer the layout does
    not prescribe, a deadlock).
    """
    from lightning_mmpp.simulator import validate_schedule

    with open(path) as f:
        text = f.read()
    schedule = Schedule.from_csv(text) if str(path).endswith(".csv") else Schedule.from_text(text)
    validate_schedule(schedule, layout, no_backward_modules)
    return schedule


_Unit = tuple[int, str]  # (rank, module)


class _LockstepBuilder:
    def __init__(
        self, layout: PipelineLayout, m: int, name: str, forward_only: bool, numbering: str,
        no_backward: frozenset[str], memory: ZeroBubbleMemory,
    ) -> None:
        self.layout = layout
        self.no_backward = no_backward
        self.m = m
        self.name = name
        self.forward_only = forward_only
        self.split = name == "zero_bubble" and not forward_only
        self.memory = memory
        self.units: dict[_Unit, StageSlot] = {
            (rank, slot.module): slot for rank in range(layout.world_size) for slot in layout.slots(rank)
        }
        self.limit: dict[_Unit, float] = {}
        for unit, slot in self.units.items():
            if forward_only or name == "gpipe":
                self.limit[unit] = m
            else:
                self.limit[unit] = layout.depth - layout.stage_index(slot.module, slot.stage, numbering)
                if self.split:
                    self.limit[unit] += memory.extra
        self.needed_inputs = {u: len(layout.forward_sources(s)) for u, s in self.units.items()}
        self.needed_grads = {u: len(layout.forward_targets(s)) for u, s in self.units.items()}
        # gradients this unit sends upstream: none when every producer runs no backward
        self.sends_grads = {u: layout.sends_input_gradients(s, no_backward) for u, s in self.units.items()}
        self.consumers = {
            u: sorted({(peer.rank, dst) for dst, peer in layout.forward_targets(s)}) for u, s in self.units.items()
        }
        # every consumer of a trained module is trained (no_backward is closed upstream),
        # so a trained module gets a gradient from each of its targets
        self.next_f = {u: 0 for u in self.units}
        self.next_b = {u: 0 for u in self.units}  # next fused B, or next I (zero_bubble)
        self.next_w = {u: 0 for u in self.units}  # next W (zero_bubble)
        self.inputs: dict[tuple[_Unit, int], int] = defaultdict(int)
        self.grads: dict[tuple[_Unit, int], int] = defaultdict(int)
        self.forward_done_tick: dict[tuple[_Unit, int], int] = {}

    def _no_backward(self, unit: _Unit) -> bool:
        return self.forward_only or unit[1] in self.no_backward

    def _has_input_half(self, unit: _Unit) -> bool:
        """Under zero_bubble: whether the unit's backward has an ``I`` (it sends gradients)."""
        return self.sends_grads[unit]

    def _grads_ready(self, unit: _Unit, k: int, tick: int) -> bool:
        if self.needed_grads[unit] == 0:  # last stage of a sink: its own forward must be done
            return self.forward_done_tick[(unit, k)] < tick
        return self.grads[(unit, k)] == self.needed_grads[unit]

    def _backward_ready(self, unit: _Unit, tick: int) -> bool:
        """A fused ``B`` (1F1B, GPipe) or an ``I`` (zero_bubble) can run."""
        k = self.next_b[unit]
        if self._no_backward(unit) or k >= self.next_f[unit]:
            return False
        if self.split and not self._has_input_half(unit):
            return False
        if self.name == "gpipe" and self.next_f[unit] < self.m:
            return False
        return self._grads_ready(unit, k, tick)

    def _weight_ready(self, unit: _Unit, tick: int) -> bool:
        """A ``W`` can run: its ``I`` ran, or (no ``I``) its gradients arrived."""
        if not self.split or self._no_backward(unit):
            return False
        k = self.next_w[unit]
        if self._has_input_half(unit):
            return k < self.next_b[unit]
        return k < self.next_f[unit] and self._grads_ready(unit, k, tick)

    def _in_flight(self, unit: _Unit) -> float:
        if not self.split:
            return self.next_f[unit] - self.next_b[unit]
        if not self._has_input_half(unit):
            return self.next_f[unit] - self.next_w[unit]
        full = self.next_f[unit] - self.next_b[unit]
        deferred = self.next_b[unit] - self.next_w[unit]
        return full + self.memory.weight_fraction * deferred

    def _forward_ready(self, unit: _Unit) -> bool:
        k = self.next_f[unit]
        if self.forward_only:
            in_flight: float = 0
        elif unit[1] in self.no_backward:  # ahead of the slowest consumer's forwards
            in_flight = k - min((self.next_f[c] for c in self.consumers[unit]), default=k)
        else:
            in_flight = self._in_flight(unit)
        if k >= self.m or in_flight + 1 > self.limit[unit] + 1e-9:
            return False
        return self.inputs[(unit, k)] == self.needed_inputs[unit]

    def _done(self) -> bool:
        for u in self.units:
            if self._no_backward(u):
                if self.next_f[u] < self.m:
                    return False
            elif (self.next_w[u] if self.split else self.next_b[u]) < self.m:
                return False
        return True

    def _choose(self, rank: int, tick: int) -> list[tuple[_Unit, Phase, int]]:
        """The computes of ``rank`` in this tick: at most one per module it holds."""
        chosen: list[tuple[_Unit, Phase, int]] = []
        taken: set[_Unit] = set()
        slots = self.layout.slots(rank)
        backward = Phase.BACKWARD_INPUT if self.split else Phase.BACKWARD
        for slot in reversed(slots):  # backwards first, downstream modules first
            unit = (rank, slot.module)
            if self._backward_ready(unit, tick):
                chosen.append((unit, backward, self.next_b[unit]))
                taken.add(unit)
        for slot in slots:
            unit = (rank, slot.module)
            if unit not in taken and self._forward_ready(unit):
                chosen.append((unit, Phase.FORWARD, self.next_f[unit]))
                taken.add(unit)
        for slot in reversed(slots):  # weight gradients fill what is left
            unit = (rank, slot.module)
            if unit not in taken and self._weight_ready(unit, tick):
                chosen.append((unit, Phase.BACKWARD_WEIGHT, self.next_w[unit]))
        return chosen

    def build(self) -> Schedule:
        layout = self.layout
        world = layout.world_size
        actions: list[list[Action]] = [[] for _ in range(world)]
        tick = 0
        while not self._done():
            computes = [c for rank in range(world) for c in self._choose(rank, tick)]
            if not computes:
                raise RuntimeError(
                    f"internal error: schedule {self.name!r} stalled at tick {tick} "
                    f"(next forwards {self.next_f}, next backwards {self.next_b}, next W {self.next_w})"
                )
            sends: dict[int, list[Transfer]] = defaultdict(list)
            recvs: dict[int, list[Transfer]] = defaultdict(list)
            arrivals: list[tuple[dict, tuple[_Unit, int]]] = []
            for unit, phase, k in computes:
                rank, module = unit
                slot = self.units[unit]
                actions[rank].append(Compute(phase, module, k))
                if phase is Phase.FORWARD:
                    self.next_f[unit] += 1
                    self.forward_done_tick[(unit, k)] = tick
                    for dst_module, peer in layout.forward_targets(slot):
                        key = MessageKey(Direction.FORWARD, module, dst_module, k)
                        sends[rank].append(Transfer(key, peer.rank))
                        recvs[peer.rank].append(Transfer(key, rank))
                        arrivals.append((self.inputs, ((peer.rank, dst_module), k)))
                elif phase is Phase.BACKWARD_WEIGHT:
                    self.next_w[unit] += 1
                    if not self._has_input_half(unit):
                        self.next_b[unit] += 1  # the W was the whole backward
                else:  # fused B or I: the input gradients go upstream now
                    self.next_b[unit] += 1
                    for src_module, peer in layout.forward_sources(slot):
                        if src_module in self.no_backward:
                            continue
                        key = MessageKey(Direction.BACKWARD, src_module, module, k)
                        sends[rank].append(Transfer(key, peer.rank))
                        recvs[peer.rank].append(Transfer(key, rank))
                        arrivals.append((self.grads, ((peer.rank, src_module), k)))
            for counter, key in arrivals:  # delivered for the next tick
                counter[key] += 1
            for rank in sorted(set(sends) | set(recvs)):
                actions[rank].append(Exchange(tuple(sorted(sends[rank])), tuple(sorted(recvs[rank]))))
            tick += 1
        return Schedule(self.name, self.m, self.forward_only, tuple(tuple(a) for a in actions))


def message_groups(transfers: Sequence[Transfer]) -> dict[MessageKey, list[Transfer]]:
    """Group the per-peer transfers of one exchange by message key."""
    groups: dict[MessageKey, list[Transfer]] = defaultdict(list)
    for t in transfers:
        groups[t.key].append(t)
    return dict(groups)

