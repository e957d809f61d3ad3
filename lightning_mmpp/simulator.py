"""Run every rank's action list in one process on a virtual clock.

The simulator proves a schedule deadlock-free and predicts its step time, bubble and peak
stashed microbatches, without processes. Two ways of completing an :class:`Exchange`:

* ``"rendezvous"`` (the strict check): an exchange completes when every partner exchange
  holding the other end of its transfers has been posted; a send waits for its receive.
  Deadlock-free here means deadlock-free on any backend.
* ``"eager"`` (the timing model): sends complete at once (gloo and NCCL post them
  asynchronously); an exchange completes when the sends it receives from were posted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lightning_mmpp.placement import PipelineLayout
from lightning_mmpp.schedule import FORWARD, Compute, Exchange, Schedule, Transfer

CostFn = Callable[[str, int], float]  # (module, stage) -> seconds


class DeadlockError(RuntimeError):
    """The action lists cannot all run to completion."""


@dataclass(frozen=True)
class SimulationResult:
    step_time: float
    busy: tuple[float, ...]  # compute time per rank
    peak_stashed: tuple[int, ...]  # max (module, microbatch) activations held per rank
    computes: tuple[tuple[int, float, float, Compute], ...] = ()  # (rank, start, end, action)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the total rank-time of the step."""
        total = self.step_time * len(self.busy)
        return 0.0 if total == 0 else 1.0 - sum(self.busy) / total


def simulate(
    schedule: Schedule,
    layout: PipelineLayout,
    forward_cost: CostFn | float = 1.0,
    backward_cost: CostFn | float = 2.0,
    mode: str = "rendezvous",
    latency: float = 0.0,
) -> SimulationResult:
    """Execute ``schedule`` on a virtual clock; raise :class:`DeadlockError` if it cannot finish."""
    if mode not in ("rendezvous", "eager"):
        raise ValueError(f"unknown mode {mode!r}")
    fwd = forward_cost if callable(forward_cost) else (lambda m, s, c=forward_cost: c)
    bwd = backward_cost if callable(backward_cost) else (lambda m, s, c=backward_cost: c)
    world = layout.world_size
    actions = schedule.actions

    # where the other end of every transfer sits: (rank, action index)
    partner: dict[tuple[int, int, Transfer], tuple[int, int]] = {}
    posts: dict[tuple[int, Transfer, str], int] = {}
    for rank in range(world):
        for i, action in enumerate(actions[rank]):
            if isinstance(action, Exchange):
                for role, transfers in (("send", action.sends), ("recv", action.recvs)):
                    for t in transfers:
                        if (rank, t, role) in posts:
                            raise DeadlockError(
                                f"rank {rank} {role}s {t} twice (actions {posts[(rank, t, role)]} and {i}); "
                                "every message must be posted once"
                            )
                        posts[(rank, t, role)] = i
    for (rank, t, role), i in posts.items():
        other_role = "recv" if role == "send" else "send"
        mirror = Transfer(t.direction, t.src_module, t.dst_module, t.microbatch, rank)
        j = posts.get((t.peer, mirror, other_role))
        if j is None:
            raise DeadlockError(f"rank {rank} {role}s {t} but rank {t.peer} never posts the other end")
        partner[(rank, i, t)] = (t.peer, j)

    # (rank, module) pairs that run backwards hold their forward activations until then
    trained = {
        (rank, a.module) for rank in range(world) for a in actions[rank] if isinstance(a, Compute) and a.phase != FORWARD
    }
    computes: list[tuple[int, float, float, Compute]] = []
    pc = [0] * world
    clock = [0.0] * world
    busy = [0.0] * world
    posted_at: dict[tuple[int, int], float] = {}
    stashed = [0] * world
    peak = [0] * world
    done = 0
    total = sum(len(a) for a in actions)
    while done < total:
        progressed = False
        for rank in range(world):
            while pc[rank] < len(actions[rank]):
                i = pc[rank]
                action = actions[rank][i]
                if isinstance(action, Compute):
                    stage = layout.slot(rank, action.module).stage
                    cost = fwd(action.module, stage) if action.phase == FORWARD else bwd(action.module, stage)
                    computes.append((rank, clock[rank], clock[rank] + cost, action))
                    clock[rank] += cost
                    busy[rank] += cost
                    if (rank, action.module) in trained:
                        stashed[rank] += 1 if action.phase == FORWARD else -1
                        peak[rank] = max(peak[rank], stashed[rank])
                else:
                    posted_at[(rank, i)] = clock[rank]
                    waits_on = action.sends + action.recvs if mode == "rendezvous" else action.recvs
                    ready = clock[rank]
                    blocked = False
                    for t in waits_on:
                        other = partner[(rank, i, t)]
                        if other not in posted_at:
                            blocked = True
                            break
                        ready = max(ready, posted_at[other])
                    if blocked:
                        break
                    clock[rank] = ready + (latency if action.recvs else 0.0)
                pc[rank] += 1
                done += 1
                progressed = True
        if not progressed:
            stuck = {r: str(actions[r][pc[r]]) for r in range(world) if pc[r] < len(actions[r])}
            raise DeadlockError(f"deadlock: ranks wait at {stuck}")
    return SimulationResult(
        step_time=max(clock), busy=tuple(busy), peak_stashed=tuple(peak), computes=tuple(computes)
    )


def render_timeline(result: SimulationResult, world_size: int, unit: float = 1.0) -> str:
    """A text Gantt chart: one row per rank, one cell per ``unit`` of virtual time.

    Each compute shows as ``F<k>`` / ``B<k>`` in its first cell (``.`` while idle), so a
    schedule run with unit costs reads like the usual 1F1B diagrams.
    """
    cells = int(round(result.step_time / unit))
    rows = [["  ."] * cells for _ in range(world_size)]
    for rank, start, end, action in result.computes:
        first = int(round(start / unit))
        label = f"{'F' if action.phase == FORWARD else 'B'}{action.microbatch}"
        for i in range(first, int(round(end / unit))):
            rows[rank][i] = f"{label:>3}" if i == first else "  -"
    return "\n".join(f"rank {r}" + "".join(row) for r, row in enumerate(rows))
