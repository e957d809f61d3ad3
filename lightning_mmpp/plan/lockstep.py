"""The planner's timing of a 1F1B or GPipe step in one pass (pure Python).

:func:`time_lockstep` gives what :func:`~lightning_mmpp.core.schedule.build_schedule` followed by
:func:`~lightning_mmpp.core.simulator.simulate` (``mode="overlap"``, no latency) give for those
schedules: the step time, each rank's busy time, and per ``(rank, module)`` unit the end of its
last backward and the most microbatches it held in flight. It plays the same lockstep ticks as
the schedule builder (per tick and unit: a fused backward whose gradients arrived, downstream
modules first, else a forward whose inputs arrived within the unit's in-flight limit; transfers
delivered at the next tick; every rank that sends or receives in a tick posts one exchange after
that tick's computes) and times them as it goes, on integer unit indices and flat lists instead
of action and transfer objects: a planner simulation costs a few milliseconds instead of a few
hundred. Its clock is the simulator's ``"overlap"`` mode, the runtime's: a rank never waits at an
exchange; a compute starts once the sends of the messages it consumes were posted.
``tests/test_plan_lockstep.py`` checks it against the builder and the simulator on random DAG
layouts (colocated modules, fan-in / fan-out, frozen modules, both schedules).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from lightning_mmpp.core.kinds import ScheduleName
from lightning_mmpp.core.placement import PipelineLayout

__all__ = ["LockstepTiming", "time_lockstep"]

CostFn = Callable[[str, int], float]  # (module, stage) -> seconds

LOCKSTEP_SCHEDULES = (ScheduleName.ONE_F_ONE_B, ScheduleName.GPIPE)


@dataclass(frozen=True)
class LockstepTiming:
    """What one step of a lockstep schedule takes on the simulator's overlap clock.

    ``finish`` is each rank's last compute end; ``last_backward`` and ``peak_in_flight`` are
    keyed by ``(rank, module)`` for units that train.
    """

    step_time: float
    busy: tuple[float, ...]
    finish: tuple[float, ...]
    last_backward: dict[tuple[int, str], float]
    peak_in_flight: dict[tuple[int, str], int]


def time_lockstep(layout: PipelineLayout, m: int, schedule: ScheduleName, forward: CostFn, backward: CostFn,
                  no_backward: frozenset[str] = frozenset(),
                  blocking_sync: Optional[CostFn] = None) -> LockstepTiming:
    """Time one training step of ``schedule`` (``"1f1b"`` or ``"gpipe"``) on ``layout`` with
    ``m`` microbatches; ``forward`` / ``backward`` give the seconds of one microbatch's forward /
    fused backward of ``(module, stage)``; ``blocking_sync`` what a unit's last backward (of
    microbatch ``m - 1``: both schedules run a unit's backwards in order) does more, before its
    gradients are sent (``simulate``'s ``blocking_sync_cost``). The layout must not have
    virtual stages."""
    if schedule not in LOCKSTEP_SCHEDULES:
        raise ValueError(f"time_lockstep times {[s.value for s in LOCKSTEP_SCHEDULES]}, not {schedule!r}")
    if layout.virtual:
        raise ValueError("time_lockstep takes layouts without virtual stages")
    world = layout.world_size
    gpipe = schedule is ScheduleName.GPIPE
    # units: one per (rank, module) the schedule plans, in rank order and slot order
    rank_of: list[int] = []
    module_of: list[str] = []
    index: dict[tuple[int, str], int] = {}
    per_rank: list[list[int]] = []
    slots = []
    for rank in range(world):
        mine = []
        for slot in layout.scheduled_slots(rank):
            index[(rank, slot.module)] = len(rank_of)
            mine.append(len(rank_of))
            rank_of.append(rank)
            module_of.append(slot.module)
            slots.append(slot)
        per_rank.append(mine)
    n = len(rank_of)
    trains = [module_of[u] not in no_backward for u in range(n)]
    limit = [m if gpipe else layout.depth - layout.stage_index(s.module, s.stage) for s in slots]
    need_in = [len(layout.forward_sources(s)) for s in slots]
    need_grad = [len(layout.forward_targets(s)) for s in slots]
    f_cost = [forward(s.module, s.stage) for s in slots]
    b_cost = [backward(s.module, s.stage) if trains[u] else 0.0 for u, s in enumerate(slots)]
    b_last = [b_cost[u] + (blocking_sync(s.module, s.stage) if blocking_sync is not None and trains[u] else 0.0)
              for u, s in enumerate(slots)]
    # the receiving unit of each forward output and of each input gradient
    out_to = [[index[(peer.rank, dst)] for dst, peer in layout.forward_targets(s)] for s in slots]
    grad_to = [[index[(peer.rank, src)] for src, peer in layout.forward_sources(s) if src not in no_backward]
               for s in slots]
    consumers = [sorted(set(out_to[v])) for v in range(n)]
    inputs = [[0] * m for _ in range(n)]
    grads = [[0] * m for _ in range(n)]
    # when the last send of a unit's inputs / output gradients of microbatch k was posted
    inputs_at = [[0.0] * m for _ in range(n)]
    grads_at = [[0.0] * m for _ in range(n)]
    forward_tick = [[0] * m for _ in range(n)]
    next_f = [0] * n
    next_b = [0] * n
    held = [0] * n
    peak = [0] * n
    last_b = [0.0] * n
    clock = [0.0] * world
    busy = [0.0] * world
    finish = [0.0] * world
    remaining = sum(m if trains[u] else 0 for u in range(n)) + m * n  # computes still to run
    tick = 0
    while remaining:
        computes: list[tuple[int, bool]] = []  # (unit, is backward), in the builder's order
        for rank in range(world):
            units = per_rank[rank]
            chosen = set()
            for u in reversed(units):  # backwards first, downstream modules first
                k = next_b[u]
                if not trains[u] or k >= next_f[u] or (gpipe and next_f[u] < m):
                    continue
                if forward_tick[u][k] < tick if need_grad[u] == 0 else grads[u][k] == need_grad[u]:
                    computes.append((u, True))
                    chosen.add(u)
            for u in units:
                if u in chosen:
                    continue
                k = next_f[u]
                if trains[u]:
                    in_flight = k - next_b[u]
                else:  # a no-backward unit runs ahead of its slowest consumer's forwards
                    in_flight = k - min((next_f[c] for c in consumers[u]), default=k)
                if k < m and in_flight < limit[u] and inputs[u][k] == need_in[u]:
                    computes.append((u, False))
        if not computes:
            raise RuntimeError(f"internal error: {schedule.value} stalled at tick {tick} "
                               f"(next forwards {next_f}, next backwards {next_b})")
        arrivals: list[tuple[list[int], list[float], int, int]] = []  # (counts, posted at, k, sender)
        for u, is_backward in computes:
            rank = rank_of[u]
            if is_backward:
                k = next_b[u]
                next_b[u] += 1
                seconds = b_last[u] if k == m - 1 else b_cost[u]
                held[u] -= 1
                targets = grad_to[u]
                counters, posted_at = grads, grads_at
                ready = grads_at[u][k]
            else:
                k = next_f[u]
                next_f[u] += 1
                forward_tick[u][k] = tick
                seconds = f_cost[u]
                if trains[u]:
                    held[u] += 1
                    peak[u] = max(peak[u], held[u])
                targets = out_to[u]
                counters, posted_at = inputs, inputs_at
                ready = inputs_at[u][k]
            clock[rank] = max(clock[rank], ready) + seconds
            busy[rank] += seconds
            finish[rank] = clock[rank]
            if is_backward:
                last_b[u] = clock[rank]
            for target in targets:
                arrivals.append((counters[target], posted_at[target], k, rank))
            remaining -= 1
        # each exchange is posted when its rank's computes of the tick end; the receiving rank
        # goes on, and the compute consuming the message waits for that post (sends complete at once)
        for counter, posted_at, k, sender in arrivals:  # delivered for the next tick
            counter[k] += 1
            posted_at[k] = max(posted_at[k], clock[sender])
        tick += 1
    return LockstepTiming(
        step_time=max(clock, default=0.0), busy=tuple(busy), finish=tuple(finish),
        last_backward={(rank_of[u], module_of[u]): last_b[u] for u in range(n) if trains[u]},
        peak_in_flight={(rank_of[u], module_of[u]): peak[u] for u in range(n) if trains[u]},
    )
