"""The planner's one-pass 1F1B / GPipe timing equals the schedule builder followed by the simulator."""

from __future__ import annotations

import random

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lightning_mmpp.core.actions import Phase
from lightning_mmpp.core.kinds import ScheduleName, SimulatorMode
from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout
from lightning_mmpp.core.schedule import build_schedule
from lightning_mmpp.core.simulator import simulate
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.plan.lockstep import time_lockstep


@st.composite
def planner_layouts(draw):
    """DAGs of 2-6 modules placed as the planner places them: groups of colocated modules
    (same pp, dp, offset) one after the other, and pp=1 modules beside one stage of a group."""
    n = draw(st.integers(2, 6))
    names = [f"m{i}" for i in range(n)]
    topology = {m: [names[j] for j in range(i + 1, n) if draw(st.booleans())] for i, m in enumerate(names)}
    groups: list[list[str]] = []
    sizes: list[tuple[int, int]] = []
    beside: list[tuple[str, int, int]] = []  # (module, group, stage)
    for name in names:
        choice = draw(st.integers(0, 5)) if groups else 0
        if choice == 1:
            groups[draw(st.integers(0, len(groups) - 1))].append(name)
        elif choice == 2:
            g = draw(st.integers(0, len(groups) - 1))
            beside.append((name, g, draw(st.integers(0, sizes[g][0] - 1))))
        else:
            groups.append([name])
            sizes.append((draw(st.integers(1, 4)), draw(st.sampled_from([1, 1, 2, 4]))))
    order = draw(st.permutations(range(len(groups))))
    offsets = {}
    cursor = 0
    placements = {}
    for g in order:
        pp, dp = sizes[g]
        offsets[g] = cursor
        for name in groups[g]:
            placements[name] = ModulePlacement(pp=pp, dp=dp, rank_offset=cursor)
        cursor += pp * dp
    for name, g, stage in beside:
        pp, dp = sizes[g]
        placements[name] = ModulePlacement(pp=1, dp=dp, rank_offset=offsets[g] + stage * dp)
    frozen = {name for name in names if draw(st.integers(0, 4)) == 0}
    return {name: placements[name] for name in names}, topology, frozen


def _reference(layout, m, schedule, forward, backward, no_backward, blocking=None):
    built = build_schedule(layout, m, schedule, no_backward_modules=no_backward)
    result = simulate(built, layout, forward, backward, mode=SimulatorMode.OVERLAP, latency=0.0,
                      blocking_sync_cost=blocking)
    last_backward, held, peak = {}, {}, {}
    finish = [0.0] * layout.world_size
    for rank, start, end, action in sorted(result.computes, key=lambda c: c[1]):
        finish[rank] = max(finish[rank], end)
        unit = (rank, action.module)
        if action.module in no_backward:
            continue
        if action.phase is Phase.FORWARD:
            held[unit] = held.get(unit, 0) + 1
            peak[unit] = max(peak.get(unit, 0), held[unit])
        else:
            held[unit] -= 1
            last_backward[unit] = max(last_backward.get(unit, 0.0), end)
    return result.step_time, result.busy, tuple(finish), last_backward, peak


@settings(max_examples=150, deadline=None, database=None)
@given(planner_layouts(), st.integers(1, 12), st.sampled_from([ScheduleName.ONE_F_ONE_B, ScheduleName.GPIPE]),
       st.integers(0, 2**31))
def test_time_lockstep_equals_build_schedule_and_simulate(data, m, schedule, seed):
    placements, topology, frozen = data
    try:
        layout = PipelineLayout(placements, topology)
    except PipelineConfigError:
        assume(False)
    no_backward = layout.no_backward_modules(frozen)
    rng = random.Random(seed)
    # a gradient sum inside the last backward on some stages (a sharded stage on gloo)
    costs = {(name, s): (rng.uniform(0.1, 3.0), rng.uniform(0.1, 6.0), rng.choice((0.0, rng.uniform(0.1, 4.0))))
             for name, p in placements.items() for s in range(p.pp)}
    forward = lambda module, stage: costs[(module, stage)][0]  # noqa: E731
    backward = lambda module, stage: costs[(module, stage)][1]  # noqa: E731
    blocking = lambda module, stage: costs[(module, stage)][2]  # noqa: E731
    fast = time_lockstep(layout, m, schedule, forward, backward, no_backward, blocking)
    step, busy, finish, last_backward, peak = _reference(layout, m, schedule, forward, backward, no_backward,
                                                         blocking)
    assert fast.step_time == step
    assert fast.busy == busy
    assert fast.finish == finish
    assert fast.last_backward == last_backward
    assert fast.peak_in_flight == peak


def test_time_lockstep_refuses_what_it_does_not_time():
    layout = PipelineLayout({"a": ModulePlacement(pp=2)}, {"a": []})
    with pytest.raises(ValueError, match="1f1b"):
        time_lockstep(layout, 2, ScheduleName.ZERO_BUBBLE, lambda *_: 1.0, lambda *_: 2.0)
