"""Time a step whose ranks share a host's CPU cores (pure Python, no torch).

:func:`~lightning_mmpp.core.simulator.simulate` gives every rank a clock of its own: a compute
takes its cost whatever the other ranks do. That holds where each rank has its own device (or
its own cores). Where a host runs more ranks than it has cores (several CPU ranks on a small
machine), ranks that compute at the same moment share the cores, and each runs slower:
:func:`simulate_shared` times the same action lists with **processor sharing**. Every piece of
work has a part that waits (for a device, a transfer, a timer: it runs at full speed whatever
the load) and a part that needs a core; at every moment the core parts active on one host
progress at ``min(1, cores / active)`` of full speed (a piece a tensor-parallel group runs in
lockstep counts once per rank of the group: only the group's lead has actions).

Besides each rank's action list, a rank runs two more kinds of work:

* **gradient syncs**, one queue per rank: the sync of ``(rank, module)`` starts once that
  module's last backward piece on the rank is done and the previous sync in the queue is over,
  and runs beside the rank's remaining actions (a collective posted while the pipeline drains);
  a **blocking sync** instead runs inside that last piece, before the piece counts as done and
  its messages as sent (FSDP2's reduce-scatters on gloo, issued from the backward's hooks);
* a **final** piece (the optimizer step) once the rank's actions and syncs are all done and
  every rank's action list has ended (the step's metrics sum joins them all before it).

Exchanges as in the simulator's ``"overlap"`` mode (the runtime's): a rank posts an exchange and
goes on; a compute starts once every send whose message it consumes has been posted.
Hand-written (not a general discrete-event library) because the rule is one line and the
planner runs it on a handful of plans per search.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Optional

from lightning_mmpp.core.actions import Compute, Exchange, Schedule
from lightning_mmpp.core.placement import PipelineLayout
from lightning_mmpp.core.simulator import DeadlockError, exchange_partners, last_gradient_pieces, receive_waits

__all__ = ["SharedTiming", "Work", "simulate_shared"]

_EPS = 1e-12


@dataclass(frozen=True)
class Work:
    """Seconds of one piece of work at full speed: ``wait_s`` that no other rank slows (it runs
    first), then ``cpu_s`` that needs a core on each of ``ranks`` ranks of the host running it in
    lockstep (a tensor-parallel group: its lead's actions stand for the whole group's)."""

    wait_s: float = 0.0
    cpu_s: float = 0.0
    ranks: int = 1


@dataclass(frozen=True)
class SharedTiming:
    """What :func:`simulate_shared` measured: the step (the last rank's end), each rank's end,
    and each rank's end of its action list alone (before its syncs and final piece)."""

    step_time: float
    finish: tuple[float, ...]
    actions_end: tuple[float, ...]


@dataclass
class _Running:
    wait: float
    cpu: float
    ranks: int
    host: int
    done: Callable[[float], None]


@dataclass
class _Rank:
    pc: int = 0
    busy: bool = False  # an action's work is running
    actions_end: Optional[float] = None
    sync_queue: list[Work] = field(default_factory=list)  # syncs due, in the order their backwards ended
    sync_busy: bool = False
    syncs_left: int = 0
    final_started: bool = False
    finish: Optional[float] = None


def simulate_shared(
    schedule: Schedule,
    layout: PipelineLayout,
    work: Callable[[int, Compute, int], Work],
    cores: float,
    ranks_per_host: int,
    syncs: Optional[Mapping[tuple[int, str], Work]] = None,
    finals: Optional[Mapping[int, Work]] = None,
    blocking_syncs: Optional[Mapping[tuple[int, str], Work]] = None,
) -> SharedTiming:
    """Run ``schedule`` on a shared clock (see the module docstring).

    Args:
        schedule: every rank's actions for one step.
        layout: the layout they run on.
        work: ``(rank, compute, stage) -> Work`` of every compute.
        cores: cores per host, shared by its ranks' core parts.
        ranks_per_host: ranks ``h * ranks_per_host ..`` share host ``h``.
        syncs: ``(rank, module) -> Work``: the module's gradient sync on that rank (absent: none).
        finals: ``rank -> Work`` run once the rank's actions and syncs are done and every
            rank's actions have ended (absent: none).
        blocking_syncs: ``(rank, module) -> Work`` run inside the rank's last gradient piece of
            the module, after its own work (absent: none).

    Raises:
        DeadlockError: the action lists cannot all complete.
        ValueError: ``cores`` or ``ranks_per_host`` is not positive.
    """
    if cores <= 0 or ranks_per_host < 1:
        raise ValueError(f"simulate_shared needs cores > 0 and ranks_per_host >= 1, got {cores}, {ranks_per_host}")
    syncs = syncs or {}
    finals = finals or {}
    blocking_syncs = blocking_syncs or {}
    world = schedule.world_size
    actions = schedule.actions
    partner = exchange_partners(schedule)
    consumed = receive_waits(schedule, partner)
    last_backward = last_gradient_pieces(schedule)  # (rank, module) -> index of its last B or W
    ranks = [_Rank(syncs_left=sum(1 for (r, _m) in syncs if r == rank)) for rank in range(world)]
    posted: set[tuple[int, int]] = set()
    running: list[_Running] = []
    clock = 0.0

    def start(rank: int, piece: Work, done: Callable[[float], None]) -> None:
        running.append(_Running(max(0.0, piece.wait_s), max(0.0, piece.cpu_s), max(1, piece.ranks),
                                rank // ranks_per_host, done))

    def sync_lane(rank: int) -> None:
        state = ranks[rank]
        if state.sync_busy or not state.sync_queue:
            return
        piece = state.sync_queue.pop(0)
        state.sync_busy = True

        def synced(now: float, state: _Rank = state) -> None:
            state.sync_busy = False
            state.syncs_left -= 1
            sync_lane(rank)
            maybe_final(rank, now)

        start(rank, piece, synced)

    def maybe_final(rank: int, now: float) -> None:
        state = ranks[rank]
        if state.actions_end is None or state.syncs_left or state.final_started:
            return
        if any(other.actions_end is None for other in ranks):
            return  # the metrics sum: every rank's pipeline first
        state.final_started = True

        def ended(t: float, state: _Rank = state) -> None:
            state.finish = t

        start(rank, finals.get(rank, Work()), ended)

    def advance(rank: int, now: float) -> bool:
        """Start what ``rank`` can start now; whether anything changed."""
        state = ranks[rank]
        changed = False
        while not state.busy and state.pc < len(actions[rank]):
            i = state.pc
            action = actions[rank][i]
            if isinstance(action, Exchange):
                posted.add((rank, i))
                state.pc += 1
                changed = True
                continue
            if not all(other in posted for other in consumed[rank][i]):
                return changed
            slot = layout.slot(rank, action.module, action.chunk)
            if slot is None:
                raise DeadlockError(f"rank {rank} computes {action} but holds no such stage")
            state.busy = True

            def computed(t: float, rank: int = rank, i: int = i, action: Compute = action) -> None:
                st = ranks[rank]
                st.busy = False
                st.pc += 1
                if last_backward.get((rank, action.module)) == i and (rank, action.module) in syncs:
                    st.sync_queue.append(syncs[(rank, action.module)])
                    sync_lane(rank)

            key = (rank, action.module)
            inside = blocking_syncs.get(key) if last_backward.get(key) == i else None
            if inside is None:
                start(rank, work(rank, action, slot.stage), computed)
            else:  # the piece's own work, then the sum inside it, then it is done
                start(rank, work(rank, action, slot.stage),
                      lambda t, rank=rank, inside=inside, done=computed: start(rank, inside, done))
            return True
        if not state.busy and state.actions_end is None and state.pc == len(actions[rank]):
            state.actions_end = now
            for other in range(world):  # the last rank's end lets every rank's final start
                maybe_final(other, now)
            changed = True
        return changed

    while True:
        while any(advance(rank, clock) for rank in range(world)):
            pass
        if not running:
            break
        active: dict[int, int] = {}
        for piece in running:
            if piece.wait <= _EPS and piece.cpu > _EPS:
                active[piece.host] = active.get(piece.host, 0) + piece.ranks
        rate = {host: min(1.0, cores / n) for host, n in active.items()}
        step = min(piece.wait if piece.wait > _EPS else piece.cpu / rate[piece.host] if piece.cpu > _EPS else 0.0
                   for piece in running)
        for piece in running:
            if piece.wait > _EPS:
                piece.wait -= step
            elif piece.cpu > _EPS:
                piece.cpu -= step * rate[piece.host]
        clock += step
        finished = [p for p in running if p.wait <= _EPS and p.cpu <= _EPS]
        running = [p for p in running if not (p.wait <= _EPS and p.cpu <= _EPS)]
        for piece in finished:
            piece.done(clock)
    stuck = {r: str(actions[r][s.pc]) for r, s in enumerate(ranks) if s.pc < len(actions[r])}
    if stuck:
        raise DeadlockError(f"deadlock: ranks wait at {stuck}")
    finish = tuple(s.finish if s.finish is not None else clock for s in ranks)
    ends = tuple(s.actions_end if s.actions_end is not None else clock for s in ranks)
    return SharedTiming(step_time=max(finish, default=0.0), finish=finish, actions_end=ends)
