"""Schedules as data: per-rank action lists for one training (or evaluation) step.

A schedule is a pure function of ``(layout, num_microbatches)``. It returns, for every rank,
an ordered list of actions:

* :class:`Compute` — the forward or backward of one microbatch for one module the rank holds;
* :class:`Exchange` — one batch of point-to-point transfers (activations forward, gradients
  backward), posted together so that opposite directions cannot deadlock.

How the lists are built (lockstep construction). The generator plays all ranks on a tick
clock. In each tick every rank runs at most one action per module it holds — a backward if
one is ready (gradients arrived, or the module is a sink whose forward ran), otherwise a
forward if its inputs arrived and the module holds fewer than ``limit`` microbatches in
flight — then every transfer produced in that tick is placed in that tick's
:class:`Exchange` on *both* ends. Each exchange therefore matches exactly the exchanges of its
peers in the same tick, so every rank reaches its partners' exchanges without waiting on
anything later: the lists are deadlock-free even under rendezvous semantics (a send completes
only when its receive is posted), which covers gloo and NCCL alike. The simulator re-checks
this for every schedule it runs.

The in-flight limit is what makes the schedule 1F1B or GPipe:

* ``"1f1b"``: ``limit = depth - index(module, stage)``, Megatron's warmup (``depth - index - 1``
  forwards before the first backward) generalised to a DAG. ``index`` is the ALAP numbering by
  default (see :mod:`lightning_mmpp.topology`): a short branch holds fewer activations than
  under the ASAP numbering. ``benchmarks/bench_schedule.py`` measured it on the simulator: ALAP
  never stashed more in total (3% less on average over 200 random DAGs, up to 27%), and the
  step time was equal on 190 of the 200 (within -3% / +7% on the rest);
  ``numbering="asap"`` is there for a layout where that matters.
* ``"gpipe"``: all forwards of a module, then all its backwards.

Colocated modules keep one limit each, from their own stage index: a rank holding a short
encoder branch and the first LM stage warms each up by its own depth, rather than by "the first
module of the rank" (Megatron's open TODO).

Modules in ``no_grad_modules`` (no trainable parameter, nothing trainable upstream — a frozen
encoder) get forwards only: no backward, no gradient transfer. Under 1F1B such a module runs at
most ``limit`` microbatches ahead of its slowest consumer's forwards, which bounds the inputs
the consumer holds for it.

Replicas of a stage are symmetric, so all peers of one fan-in / fan-out message land in the
same exchange (``tests/test_schedule.py`` checks it on random layouts).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

from lightning_mmpp.comm import BACKWARD, FORWARD
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.placement import PipelineLayout, StageSlot

SCHEDULES = ("1f1b", "gpipe")
NUMBERINGS = ("alap", "asap")


@dataclass(frozen=True)
class Compute:
    """Run the forward or backward of ``microbatch`` for ``module`` (the stage this rank holds)."""

    phase: str
    module: str
    microbatch: int

    def __str__(self) -> str:
        return f"{'F' if self.phase == FORWARD else 'B'}{self.microbatch}:{self.module}"


@dataclass(frozen=True, order=True)
class Transfer:
    """One point-to-point message seen from one end.

    ``src_module`` produced the activation (forward) whose gradient travels back (backward);
    ``dst_module`` consumes it. Both are equal for a transfer between consecutive stages of one
    module. ``peer`` is the rank at the other end (this rank itself for colocated modules).
    """

    direction: str
    src_module: str
    dst_module: str
    microbatch: int
    peer: int

    def __str__(self) -> str:
        arrow = "->" if self.direction == FORWARD else "<-"
        return f"{self.src_module}{arrow}{self.dst_module}#{self.microbatch}@{self.peer}"


@dataclass(frozen=True)
class Exchange:
    """Transfers posted as one batch: ``sends`` go to, ``recvs`` come from, their ``peer``."""

    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]

    def __str__(self) -> str:
        return f"X(send[{' '.join(map(str, self.sends))}] recv[{' '.join(map(str, self.recvs))}])"


Action = Union[Compute, Exchange]


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists of one step."""

    name: str
    num_microbatches: int
    forward_only: bool
    actions: tuple[tuple[Action, ...], ...]

    def for_rank(self, rank: int) -> tuple[Action, ...]:
        return self.actions[rank]

    def render(self, rank: int) -> str:
        return " ".join(str(a) for a in self.actions[rank])


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
    no_grad_modules: frozenset[str] = frozenset(),
) -> Schedule:
    """Build the action lists of every rank for one step of ``num_microbatches`` microbatches.

    ``no_grad_modules`` must be closed upstream (every upstream module of a member is a
    member): gradients never need to reach them.
    """
    check_schedule_args(name, num_microbatches, numbering)
    for module in no_grad_modules:
        trained_upstream = [u for u in layout.topology.upstream(module) if u not in no_grad_modules]
        if trained_upstream:
            raise ValueError(f"no_grad module {module!r} has trained upstream modules {trained_upstream}")
    builder = _LockstepBuilder(layout, num_microbatches, name, forward_only, numbering, frozenset(no_grad_modules))
    return builder.build()


_Unit = tuple[int, str]  # (rank, module)


class _LockstepBuilder:
    def __init__(
        self, layout: PipelineLayout, m: int, name: str, forward_only: bool, numbering: str, no_grad: frozenset[str]
    ) -> None:
        self.layout = layout
        self.no_grad = no_grad
        self.m = m
        self.name = name
        self.forward_only = forward_only
        self.units: dict[_Unit, StageSlot] = {
            (rank, slot.module): slot for rank in range(layout.world_size) for slot in layout.slots(rank)
        }
        self.limit: dict[_Unit, int] = {}
        for unit, slot in self.units.items():
            if forward_only or name == "gpipe":
                self.limit[unit] = m
            else:
                self.limit[unit] = layout.depth - layout.stage_index(slot.module, slot.stage, numbering)
        self.needed_inputs = {u: len(layout.forward_sources(s)) for u, s in self.units.items()}
        self.needed_grads = {u: len(layout.forward_targets(s)) for u, s in self.units.items()}
        self.consumers = {
            u: sorted({(peer.rank, dst) for dst, peer in layout.forward_targets(s)}) for u, s in self.units.items()
        }
        # every consumer of a trained module is trained (no_grad_modules is closed upstream),
        # so a trained module gets a gradient from each of its targets
        self.next_f = {u: 0 for u in self.units}
        self.next_b = {u: 0 for u in self.units}
        self.inputs: dict[tuple[_Unit, int], int] = defaultdict(int)
        self.grads: dict[tuple[_Unit, int], int] = defaultdict(int)
        self.forward_done_tick: dict[tuple[_Unit, int], int] = {}

    def _forward_only(self, unit: _Unit) -> bool:
        return self.forward_only or unit[1] in self.no_grad

    def _backward_ready(self, unit: _Unit, tick: int) -> bool:
        k = self.next_b[unit]
        if self._forward_only(unit) or k >= self.next_f[unit]:
            return False
        if self.name == "gpipe" and self.next_f[unit] < self.m:
            return False
        if self.needed_grads[unit] == 0:  # last stage of a sink: its own forward must be done
            return self.forward_done_tick[(unit, k)] < tick
        return self.grads[(unit, k)] == self.needed_grads[unit]

    def _forward_ready(self, unit: _Unit) -> bool:
        k = self.next_f[unit]
        if self.forward_only:
            in_flight = 0
        elif unit[1] in self.no_grad:  # ahead of the slowest consumer's forwards
            in_flight = k - min((self.next_f[c] for c in self.consumers[unit]), default=k)
        else:
            in_flight = k - self.next_b[unit]
        if k >= self.m or in_flight >= self.limit[unit]:
            return False
        return self.inputs[(unit, k)] == self.needed_inputs[unit]

    def _done(self) -> bool:
        return all(
            self.next_f[u] == self.m if self._forward_only(u) else self.next_b[u] == self.m for u in self.units
        )

    def build(self) -> Schedule:
        layout = self.layout
        world = layout.world_size
        actions: list[list[Action]] = [[] for _ in range(world)]
        tick = 0
        while not self._done():
            computes: list[tuple[_Unit, str, int]] = []
            for rank in range(world):
                slots = layout.slots(rank)
                for slot in reversed(slots):  # backwards first, downstream modules first
                    unit = (rank, slot.module)
                    if self._backward_ready(unit, tick):
                        computes.append((unit, BACKWARD, self.next_b[unit]))
                chosen = {u for u, _, _ in computes}
                for slot in slots:
                    unit = (rank, slot.module)
                    if unit not in chosen and self._forward_ready(unit):
                        computes.append((unit, FORWARD, self.next_f[unit]))
            if not computes:
                raise RuntimeError(
                    f"internal error: schedule {self.name!r} stalled at tick {tick} "
                    f"(next forwards {self.next_f}, next backwards {self.next_b})"
                )
            sends: dict[int, list[Transfer]] = defaultdict(list)
            recvs: dict[int, list[Transfer]] = defaultdict(list)
            arrivals: list[tuple[dict, tuple[_Unit, int]]] = []
            for unit, phase, k in computes:
                rank, module = unit
                slot = self.units[unit]
                actions[rank].append(Compute(phase, module, k))
                if phase == FORWARD:
                    self.next_f[unit] += 1
                    self.forward_done_tick[(unit, k)] = tick
                    if self.forward_only and layout.is_last_stage(slot) and not layout.topology.downstream(module):
                        continue
                    for dst_module, peer in layout.forward_targets(slot):
                        sends[rank].append(Transfer(FORWARD, module, dst_module, k, peer.rank))
                        recvs[peer.rank].append(Transfer(FORWARD, module, dst_module, k, rank))
                        arrivals.append((self.inputs, ((peer.rank, dst_module), k)))
                else:
                    self.next_b[unit] += 1
                    for src_module, peer in layout.forward_sources(slot):
                        if src_module in self.no_grad:
                            continue
                        sends[rank].append(Transfer(BACKWARD, src_module, module, k, peer.rank))
                        recvs[peer.rank].append(Transfer(BACKWARD, src_module, module, k, rank))
                        arrivals.append((self.grads, ((peer.rank, src_module), k)))
            for counter, key in arrivals:  # delivered for the next tick
                counter[key] += 1
            for rank in sorted(set(sends) | set(recvs)):
                actions[rank].append(Exchange(tuple(sorted(sends[rank])), tuple(sorted(recvs[rank]))))
            tick += 1
        return Schedule(self.name, self.m, self.forward_only, tuple(tuple(a) for a in actions))


def message_groups(transfers: Sequence[Transfer]) -> dict[tuple[str, str, str, int], list[Transfer]]:
    """Group the per-peer transfers of one exchange by message (direction, src, dst, microbatch)."""
    groups: dict[tuple[str, str, str, int], list[Transfer]] = defaultdict(list)
    for t in transfers:
        groups[(t.direction, t.src_module, t.dst_module, t.microbatch)].append(t)
    return dict(groups)
