"""Check and time every rank's action list in one process, on a virtual clock.

Pure Python (no torch). :func:`validate_schedule` proves that a schedule (built, or loaded from
a hand-edited file) computes what the layout needs, in dependency order, and cannot deadlock.
:func:`simulate` runs it and reports the step time, the bubble and the peak stash, from costs
per phase and per ``(module, stage)``. Three ways of completing an
:class:`~lightning_mmpp.core.actions.Exchange`:

* ``"rendezvous"`` (the strict check): an exchange completes when every partner exchange
  holding the other end of its transfers has been posted; a send waits for its receive.
  Deadlock-free here means deadlock-free on any backend.
* ``"eager"``: sends complete at once (gloo and NCCL post them asynchronously); an exchange
  completes when the sends it receives from were posted.
* ``"overlap"`` (the timing model of the runtime, whose ``overlap`` mode is its default): sends
  complete at once; an exchange only posts its receives and the rank goes on; the compute that
  consumes a message (the forward of its destination stage, the first backward piece of its
  source stage) waits until its send was posted (:func:`receive_waits`). A rank that receives
  the next microbatch's input before a backward runs that backward without waiting for it.

Costs: ``forward_cost`` (F), ``backward_cost`` (a fused B), ``input_cost`` (I) and
``weight_cost`` (W), each a number or a function ``(module, stage) -> seconds``. A number is
the cost of a whole stage of a module without virtual stages; a chunk of a module with
``virtual_stages=v`` costs ``1/v`` of it (its layers are split ``v`` times finer). A function
gets the stage index (``0 .. pp * v - 1``) and returns that stage's own cost. ``I`` and
``W`` default to half the fused cost. A ``W`` without an ``I`` (a stage whose inputs need no
gradient) is that stage's whole backward and costs ``backward_cost``, as the fused ``B`` of
1F1B does, so the schedules are compared on the same work.

``blocking_sync_cost`` (a function ``(module, stage) -> seconds``): work that runs inside a
rank's last gradient piece of a module in the step (its last ``B`` or ``W``, over all its
chunks), before that piece's messages can be sent: a gradient sum issued from the backward
that blocks it (FSDP2's reduce-scatters on gloo, :func:`last_gradient_pieces`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NoReturn, Optional

from lightning_mmpp.core.actions import Compute, Direction, Exchange, MessageKey, Phase, Schedule, Transfer
from lightning_mmpp.core.kinds import SimulatorMode
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.core.placement import PipelineLayout, StageSlot

CostFn = Callable[[str, int], float]  # (module, stage) -> seconds


class DeadlockError(RuntimeError):
    """The action lists cannot all run to completion."""


@dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` measured on its virtual clock.

    ``peak_stashed`` counts, per rank, the most microbatches held at once between a forward
    and its last backward piece (the fused ``B`` or the ``W``), one per stage (chunk) holding
    it; ``peak_stash_units`` weighs a microbatch between its ``I`` and its ``W`` by
    ``weight_stash`` (what a deferred ``W`` keeps, relative to a whole microbatch), and one on a
    chunk of a module with ``virtual_stages=v`` by ``1/v`` (the chunk holds ``1/v`` of a stage's
    layers), so ranks compare in whole stages' activations.
    """

    step_time: float
    busy: tuple[float, ...]  # compute time per rank
    peak_stashed: tuple[int, ...]
    computes: tuple[tuple[int, float, float, Compute], ...] = ()  # (rank, start, end, action)
    peak_stash_units: tuple[float, ...] = ()

    @property
    def bubble(self) -> float:
        """Step time minus the busiest rank's compute: what a perfect schedule would remove."""
        return self.step_time - max(self.busy, default=0.0)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the total rank-time of the step."""
        total = self.step_time * len(self.busy)
        return 0.0 if total == 0 else 1.0 - sum(self.busy) / total


def _cost_fn(cost: CostFn | float, layout: PipelineLayout) -> CostFn:
    """A function ``(module, stage) -> seconds``; a number is a whole stage's cost, ``1/v`` of it per chunk."""
    if callable(cost):
        return cost
    per_stage = {m: float(cost) / p.virtual_stages for m, p in layout.placements.items()}
    return lambda module, stage: per_stage[module]


def _identity(t: Transfer) -> tuple[bool, str, str, int, int, int]:
    """A transfer's message as a plain tuple (hashing the frozen dataclasses dominated planning)."""
    key = t.key
    return (key.direction is Direction.FORWARD, key.src_module, key.dst_module, key.microbatch, key.src_chunk,
            key.dst_chunk)


def exchange_partners(schedule: Schedule) -> list[list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]]:
    """Per rank and action index: the ``(peer, its action index)`` of every send and of every
    receive of that action (empty lists for computes)."""
    posts: dict[tuple[int, int, tuple[bool, str, str, int, int, int], bool], int] = {}  # (rank, peer, message, is send)
    for rank, actions in enumerate(schedule.actions):
        for i, action in enumerate(actions):
            if isinstance(action, Exchange):
                for is_send, transfers in ((True, action.sends), (False, action.recvs)):
                    for t in transfers:
                        slot = (rank, t.peer, _identity(t), is_send)
                        if slot in posts:
                            role = "send" if is_send else "recv"
                            raise DeadlockError(
                                f"rank {rank} {role}s {t} twice (actions {posts[slot]} and {i}); "
                                "every message must be posted once"
                            )
                        posts[slot] = i
    partner: list[list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]] = []
    for rank, actions in enumerate(schedule.actions):
        mine: list[tuple[list[tuple[int, int]], list[tuple[int, int]]]] = []
        for i, action in enumerate(actions):
            if not isinstance(action, Exchange):
                mine.append(([], []))
                continue
            lists: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])
            for is_send, transfers, out in ((True, action.sends, lists[0]), (False, action.recvs, lists[1])):
                role = "send" if is_send else "recv"
                for t in transfers:
                    if not 0 <= t.peer < schedule.world_size:
                        raise DeadlockError(f"rank {rank} {role}s {t} but rank {t.peer} does not exist")
                    j = posts.get((t.peer, rank, _identity(t), not is_send))
                    if j is None:
                        raise DeadlockError(f"rank {rank} {role}s {t} but rank {t.peer} never posts the other end")
                    out.append((t.peer, j))
            mine.append(lists)
        partner.append(mine)
    return partner


def receive_waits(schedule: Schedule,
                  partner: list[list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]]) -> list[list[list[tuple[int, int]]]]:
    """Per rank and action index, under ``"overlap"``: the ``(rank, action index)`` of the
    exchanges an action waits for. An exchange waits for none (it posts its receives); a forward
    consumes the forward messages to its stage and microbatch, and the first backward piece
    (``B``, ``I``, or a ``W`` without an ``I``) of a stage and microbatch the gradients of that
    stage's output: such a compute waits for the exchanges that send them and for its own rank's
    exchange that receives them (one placed after the compute never comes first: a deadlock).
    ``partner`` is :func:`exchange_partners`'s."""
    waits: list[list[list[tuple[int, int]]]] = []
    for rank, actions in enumerate(schedule.actions):
        receives: dict[tuple[bool, str, int, int], list[tuple[int, int]]] = {}  # (forward, module, chunk, k)
        for i, action in enumerate(actions):
            if isinstance(action, Exchange):
                for t, sender in zip(action.recvs, partner[rank][i][1]):
                    key = t.key
                    forward = key.direction is Direction.FORWARD
                    module, chunk = (key.dst_module, key.dst_chunk) if forward else (key.src_module, key.src_chunk)
                    receives.setdefault((forward, module, chunk, key.microbatch), []).extend([sender, (rank, i)])
        waits.append([[] if isinstance(action, Exchange) else
                      receives.pop((action.phase is Phase.FORWARD, action.module, action.chunk, action.microbatch), [])
                      for action in actions])
    return waits


def last_gradient_pieces(schedule: Schedule) -> dict[tuple[int, str], int]:
    """``(rank, module) -> index`` of the rank's last ``B`` or ``W`` of the module in the step
    (over all its chunks): the action after which the runtime starts the module's gradient sum,
    and in which a sharded stage reduce-scatters its gradients."""
    last: dict[tuple[int, str], int] = {}
    for rank, actions in enumerate(schedule.actions):
        for i, action in enumerate(actions):
            if isinstance(action, Compute) and action.phase in (Phase.BACKWARD, Phase.BACKWARD_WEIGHT):
                last[(rank, action.module)] = i
    return last


def blocking_sync_seconds(schedule: Schedule, layout: PipelineLayout,
                          cost: Optional[CostFn]) -> dict[tuple[int, int], float]:
    """``(rank, action index) -> seconds`` that ``cost`` adds to each last gradient piece
    (:func:`last_gradient_pieces`): the sum of ``cost`` over the module's chunks on the rank."""
    if cost is None:
        return {}
    extra = {}
    for (rank, module), i in last_gradient_pieces(schedule).items():
        seconds = sum(cost(module, slot.stage) for slot in layout.chunk_slots(rank, module))
        if seconds:
            extra[(rank, i)] = seconds
    return extra


class PhaseSeconds:
    """Seconds of each compute of a schedule: ``F``, a fused ``B``, ``I``, ``W`` per ``(module,
    stage)``; a ``W`` without an ``I`` before it (a lone W) is the whole backward and costs a ``B``."""

    def __init__(
        self,
        schedule: Schedule,
        layout: PipelineLayout,
        forward_cost: CostFn | float,
        backward_cost: CostFn | float,
        input_cost: Optional[CostFn | float],
        weight_cost: Optional[CostFn | float],
    ) -> None:
        fused = _cost_fn(backward_cost, layout)
        self.fused = fused
        half = lambda m, s: fused(m, s) / 2  # noqa: E731
        self.by_phase = {
            Phase.FORWARD: _cost_fn(forward_cost, layout),
            Phase.BACKWARD: fused,
            Phase.BACKWARD_INPUT: _cost_fn(input_cost, layout) if input_cost is not None else half,
            Phase.BACKWARD_WEIGHT: _cost_fn(weight_cost, layout) if weight_cost is not None else half,
        }
        # (rank, module) units that run an I: their W is the second half; elsewhere W is the whole backward
        self.with_input_half = _units_running(schedule, lambda phase: phase is Phase.BACKWARD_INPUT)

    def seconds(self, rank: int, action: Compute, stage: int) -> float:
        if action.phase is Phase.BACKWARD_WEIGHT and (rank, *action.unit) not in self.with_input_half:
            return self.fused(action.module, stage)
        return self.by_phase[action.phase](action.module, stage)


def _units_running(schedule: Schedule, phase_matches: Callable[[Phase], bool]) -> set[tuple[int, str, int]]:
    """The ``(rank, module, chunk)`` units with a compute whose phase matches."""
    return {
        (rank, *a.unit) for rank, actions in enumerate(schedule.actions) for a in actions
        if isinstance(a, Compute) and phase_matches(a.phase)
    }


class _StashCounter:
    """Microbatches each rank holds between a forward and its last backward piece, and their peaks."""

    def __init__(
        self, schedule: Schedule, layout: PipelineLayout, with_input_half: set[tuple[int, str, int]], weight_stash: float
    ) -> None:
        world = schedule.world_size
        self.trained = _units_running(schedule, lambda phase: phase.is_backward)
        self.with_input_half = with_input_half
        self.weight_stash = weight_stash
        self.size = {m: 1.0 / p.virtual_stages for m, p in layout.placements.items()}
        self.full_units = [0.0] * world
        self.deferred_units = [0.0] * world
        self.full = [0] * world  # microbatches between F and I (or the fused B / whole W)
        self.deferred = [0] * world  # microbatches between I and W
        self.peak = [0] * world
        self.peak_units = [0.0] * world

    def count(self, rank: int, action: Compute) -> None:
        unit = (rank, *action.unit)
        if unit not in self.trained:
            return
        phase = action.phase
        size = self.size[action.module]
        if phase is Phase.FORWARD:
            full, deferred = 1, 0
        elif phase is Phase.BACKWARD_INPUT:
            full, deferred = -1, 1
        elif phase is Phase.BACKWARD_WEIGHT and unit in self.with_input_half:
            full, deferred = 0, -1
        else:
            full, deferred = -1, 0
        self.full[rank] += full
        self.deferred[rank] += deferred
        self.full_units[rank] += full * size
        self.deferred_units[rank] += deferred * size
        self.peak[rank] = max(self.peak[rank], self.full[rank] + self.deferred[rank])
        held = self.full_units[rank] + self.weight_stash * self.deferred_units[rank]
        self.peak_units[rank] = max(self.peak_units[rank], round(held, 9))


def simulate(
    schedule: Schedule,
    layout: PipelineLayout,
    forward_cost: CostFn | float = 1.0,
    backward_cost: CostFn | float = 2.0,
    mode: SimulatorMode | str = SimulatorMode.RENDEZVOUS,
    latency: float = 0.0,
    input_cost: Optional[CostFn | float] = None,
    weight_cost: Optional[CostFn | float] = None,
    weight_stash: float = 1.0,
    blocking_sync_cost: Optional[CostFn] = None,
) -> SimulationResult:
    """Execute ``schedule`` on a virtual clock; raise :class:`DeadlockError` if it cannot finish.

    ``mode`` (a :class:`~lightning_mmpp.core.kinds.SimulatorMode` or its spelling) says when an
    exchange completes (see the module docstring); an unknown one is a
    :class:`~lightning_mmpp.errors.PipelineConfigError`.
    """
    mode = SimulatorMode.parse(mode)
    rendezvous = mode is SimulatorMode.RENDEZVOUS
    overlap = mode is SimulatorMode.OVERLAP
    costs = PhaseSeconds(schedule, layout, forward_cost, backward_cost, input_cost, weight_cost)
    blocking = blocking_sync_seconds(schedule, layout, blocking_sync_cost)
    stash = _StashCounter(schedule, layout, costs.with_input_half, weight_stash)
    world = layout.world_size
    actions = schedule.actions
    partner = exchange_partners(schedule)
    consumed = receive_waits(schedule, partner) if overlap else None
    computes: list[tuple[int, float, float, Compute]] = []
    pc = [0] * world
    clock = [0.0] * world
    busy = [0.0] * world
    posted_at: dict[tuple[int, int], float] = {}

    def exchange_ready(rank: int, i: int) -> Optional[float]:
        """When action ``i`` of ``rank`` (an exchange) completes; ``None`` while a partner has not posted."""
        sends_of, recvs_of = partner[rank][i]
        ready = clock[rank]
        for other in (sends_of + recvs_of if rendezvous else recvs_of):
            if other not in posted_at:
                return None
            ready = max(ready, posted_at[other])
        return ready

    done = 0
    total = sum(len(a) for a in actions)
    while done < total:
        progressed = False
        for rank in range(world):
            while pc[rank] < len(actions[rank]):
                i = pc[rank]
                action = actions[rank][i]
                if isinstance(action, Compute):
                    slot = layout.slot(rank, action.module, action.chunk)
                    if slot is None:
                        raise DeadlockError(f"rank {rank} computes {action} but holds no such stage")
                    if consumed is not None:
                        senders = consumed[rank][i]
                        if any(other not in posted_at for other in senders):
                            break
                        if senders:  # a message lands ``latency`` after its send was posted
                            clock[rank] = max(clock[rank], max(posted_at[other] for other in senders) + latency)
                    seconds = costs.seconds(rank, action, slot.stage) + blocking.get((rank, i), 0.0)
                    computes.append((rank, clock[rank], clock[rank] + seconds, action))
                    clock[rank] += seconds
                    busy[rank] += seconds
                    stash.count(rank, action)
                else:
                    posted_at[(rank, i)] = clock[rank]
                    if not overlap:  # overlap: the rank goes on; its consumers wait (above)
                        ready = exchange_ready(rank, i)
                        if ready is None:
                            break
                        clock[rank] = ready + (latency if action.recvs else 0.0)
                pc[rank] += 1
                done += 1
                progressed = True
        if not progressed:
            stuck = {r: str(actions[r][pc[r]]) for r in range(world) if pc[r] < len(actions[r])}
            raise DeadlockError(f"deadlock: ranks wait at {stuck}")
    return SimulationResult(
        step_time=max(clock), busy=tuple(busy), peak_stashed=tuple(stash.peak), computes=tuple(computes),
        peak_stash_units=tuple(stash.peak_units),
    )


def validate_schedule(
    schedule: Schedule, layout: PipelineLayout, no_backward_modules: Iterable[str] = frozenset()
) -> None:
    """Raise :class:`~lightning_mmpp.errors.PipelineConfigError` unless ``schedule`` is a
    correct step for ``layout``.

    Checked: every rank forwards each microbatch of every module it holds exactly once; in a
    training schedule every module outside ``no_backward_modules`` runs, per microbatch, a
    fused ``B``, or an ``I`` then a ``W``, or (a stage with no gradient to send upstream) a
    lone ``W``, after its forward; the transfers are exactly those the layout prescribes, each
    posted once on each end, a message's transfers in one exchange; every compute comes after
    the exchanges that bring its inputs (or gradients) and before those that send its
    results; and the lists run to completion under rendezvous semantics.
    """
    no_backward = frozenset(no_backward_modules)

    def fail(message: str) -> NoReturn:
        raise PipelineConfigError(f"schedule {schedule.name!r} is invalid for this layout: {message}")

    if schedule.world_size != layout.world_size:
        fail(f"it has {schedule.world_size} ranks, the layout {layout.world_size}.")
    posted: Counter = Counter()
    for rank in range(layout.world_size):
        _RankCheck(schedule, layout, rank, no_backward, fail, posted).run()
    expected = _expected_transfers(layout, schedule.num_microbatches, not schedule.forward_only, no_backward)
    if posted != expected:
        extra = sorted(str(key) for key in (posted - expected))[:3]
        missing = sorted(str(key) for key in (expected - posted))[:3]
        fail(f"its transfers differ from the layout's: unexpected {extra}, missing {missing}.")
    try:
        simulate(schedule, layout, mode=SimulatorMode.RENDEZVOUS)
    except DeadlockError as err:
        fail(str(err))


def _expected_transfers(layout: PipelineLayout, m: int, training: bool, no_backward: frozenset[str]) -> Counter:
    """``(rank, "send" | "recv", transfer)`` of every transfer the layout prescribes for a step."""
    expected: Counter = Counter()
    for rank in range(layout.world_size):
        for slot in layout.scheduled_slots(rank):
            for k in range(m):
                for dst, peer in layout.forward_targets(slot):
                    chunks = (slot.chunk, layout.peer_chunk(slot, dst, True))
                    key = MessageKey(Direction.FORWARD, slot.module, dst, k, *chunks)
                    expected[(rank, "send", Transfer(key, peer.rank))] += 1
                    if training and slot.module not in no_backward:
                        back = MessageKey(Direction.BACKWARD, slot.module, dst, k, *chunks)
                        expected[(rank, "recv", Transfer(back, peer.rank))] += 1
                for src, peer in layout.forward_sources(slot):
                    chunks = (layout.peer_chunk(slot, src, False), slot.chunk)
                    key = MessageKey(Direction.FORWARD, src, slot.module, k, *chunks)
                    expected[(rank, "recv", Transfer(key, peer.rank))] += 1
                    if training and src not in no_backward:
                        back = MessageKey(Direction.BACKWARD, src, slot.module, k, *chunks)
                        expected[(rank, "send", Transfer(back, peer.rank))] += 1
    return expected


class _RankCheck:
    """One rank's actions in order: each compute after its inputs and before its results are
    sent, each piece once, every piece done by the end. Counts the rank's posted transfers into
    ``posted`` (checked against the layout by the caller)."""

    def __init__(
        self, schedule: Schedule, layout: PipelineLayout, rank: int, no_backward: frozenset[str],
        fail: Callable[[str], NoReturn], posted: Counter,
    ) -> None:
        self.schedule = schedule
        self.layout = layout
        self.rank = rank
        self.no_backward = no_backward
        self.fail = fail
        self.posted = posted
        self.m = schedule.num_microbatches
        self.training = not schedule.forward_only
        self.held = {(s.module, s.chunk): s for s in layout.scheduled_slots(rank)}
        self.arrived: Counter = Counter()  # (direction, (module, chunk), k) -> transfers received
        self.done: dict[tuple[tuple[str, int], int], list[Phase]] = defaultdict(list)
        self.message_exchange: dict[tuple[str, MessageKey], int] = {}

    def run(self) -> None:
        for i, action in enumerate(self.schedule.for_rank(self.rank)):
            if isinstance(action, Exchange):
                self.exchange(i, action)
            else:
                self.compute(i, action)
        self.finish()

    def exchange(self, i: int, action: Exchange) -> None:
        rank = self.rank
        for role, transfers in (("send", action.sends), ("recv", action.recvs)):
            for t in transfers:
                self.posted[(rank, role, t)] += 1
                first = self.message_exchange.setdefault((role, t.key), i)
                if first != i:
                    self.fail(f"rank {rank} splits message {t.key} over actions {first} and {i}; post all its "
                              "transfers in one exchange.")
                if role == "recv":
                    unit = t.key.consumer if t.direction is Direction.FORWARD else t.key.producer
                    self.arrived[(t.direction, unit, t.microbatch)] += 1
                    continue
                if t.direction is Direction.FORWARD:
                    ready = Phase.FORWARD in self.done[(t.key.producer, t.microbatch)]
                else:
                    phases = self.done[(t.key.consumer, t.microbatch)]
                    ready = Phase.BACKWARD in phases or Phase.BACKWARD_INPUT in phases
                if not ready:
                    self.fail(f"rank {rank} sends {t} (action {i}) before computing it.")

    def compute(self, i: int, action: Compute) -> None:
        rank = self.rank
        slot = self.held.get(action.unit)
        if slot is None:
            what = f"stage of {action.module!r}" if action.chunk == 0 else f"chunk {action.chunk} of {action.module!r}"
            self.fail(f"rank {rank} computes {action} but holds no {what}.")
        k = action.microbatch
        if not 0 <= k < self.m:
            self.fail(f"rank {rank} computes {action}: microbatch outside 0..{self.m - 1}.")
        phases = self.done[(action.unit, k)]
        if action.phase in phases:
            self.fail(f"rank {rank} computes {action} twice.")
        if action.phase is Phase.FORWARD:
            if self.arrived[(Direction.FORWARD, action.unit, k)] != len(self.layout.forward_sources(slot)):
                self.fail(f"rank {rank} computes {action} (action {i}) before its inputs arrive.")
        else:
            self.backward(i, action, slot, phases)
        phases.append(action.phase)

    def backward(self, i: int, action: Compute, slot: StageSlot, phases: list[Phase]) -> None:
        rank = self.rank
        if not self.training or action.module in self.no_backward:
            self.fail(f"rank {rank} computes {action} but {action.module!r} runs no backward in this schedule.")
        if Phase.FORWARD not in phases:
            self.fail(f"rank {rank} computes {action} (action {i}) before its forward.")
        lone_w = action.phase is Phase.BACKWARD_WEIGHT and Phase.BACKWARD_INPUT not in phases
        if action.phase is Phase.BACKWARD_WEIGHT and not lone_w:
            return  # the I brought the gradients
        if Phase.BACKWARD in phases or Phase.BACKWARD_INPUT in phases:
            self.fail(f"rank {rank} computes {action} after another backward of that microbatch.")
        if lone_w and self.layout.sends_input_gradients(slot, self.no_backward):
            self.fail(f"rank {rank} computes {action} without its I: stage {slot.stage} of "
                      f"{action.module!r} must send input gradients upstream (use I then W, or B).")
        if self.arrived[(Direction.BACKWARD, action.unit, action.microbatch)] != len(self.layout.forward_targets(slot)):
            self.fail(f"rank {rank} computes {action} (action {i}) before its gradients arrive.")

    def finish(self) -> None:
        for (module, chunk) in self.held:
            for k in range(self.m):
                phases = self.done[((module, chunk), k)]
                if Phase.FORWARD not in phases:
                    self.fail(f"rank {self.rank} never computes {Compute(Phase.FORWARD, module, k, chunk)}.")
                trained = self.training and module not in self.no_backward
                if trained and Phase.BACKWARD not in phases and Phase.BACKWARD_WEIGHT not in phases:
                    self.fail(f"rank {self.rank} never completes the backward of microbatch {k} of {module!r} "
                              "(B, or W after I).")


def render_timeline(result: SimulationResult, world_size: int, unit: float = 1.0) -> str:
    """A text Gantt chart: one row per rank, one cell per ``unit`` of virtual time.

    Each compute shows as its phase letter and microbatch (``F3``, ``B3``, ``I3``, ``W3``) in
    its first cell (``.`` while idle), so a schedule run with unit costs reads like the usual
    pipeline diagrams.
    """
    cells = int(round(result.step_time / unit))
    rows = [["  ."] * cells for _ in range(world_size)]
    for rank, start, end, action in result.computes:
        first = int(round(start / unit))
        label = f"{action.phase.value}{action.microbatch}"
        for i in range(first, int(round(end / unit))):
            rows[rank][i] = f"{label:>3}" if i == first else "  -"
    return "\n".join(f"rank {r}" + "".join(row) for r, row in enumerate(rows))
