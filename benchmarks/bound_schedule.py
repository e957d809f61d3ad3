"""Can any schedule of a layout finish a step by a given time? An exact check on the simulator's model.

    python benchmarks/bound_schedule.py            # the random DAGs of bench_schedule.py where
                                                   # interleaved_1f1b is longer than 1F1B
    python benchmarks/bound_schedule.py --seeds 124 --time-limit 600
    python benchmarks/bound_schedule.py --memory   # no rank above 1F1B's fullest rank

Needs scipy (``pip install scipy``: its MILP solver, HiGHS). The model is the simulator's eager
clock without transfer latency: every forward / fused backward of every (rank, module, chunk)
and microbatch is a job of fixed length (F = 1, B = 2 per whole stage, ``1/v`` of it per chunk),
one job at a time per rank, a forward after its inputs' forwards, a backward after its own
forward and its consumers' backwards. No memory limit: a bound found here holds for every
schedule, whatever it holds in flight. ``--memory`` adds issue 32's memory rule of zbv: no
rank holds more than 1F1B's fullest rank without virtual stages (a microbatch from its
forward's start to its backward's end, ``1/v`` of a stage per chunk). interleaved_1f1b's own
rules may hold more (Megatron's warmup bound does on a chain), so a "no" with ``--memory``
speaks of schedules within that rule only.

To keep the problem small it drops every job of a replica other than 0 (dp > 1). Dropping jobs
only removes constraints, so "no schedule of the kept jobs finishes by T" still proves that no
schedule of the whole layout does. The check is a time-indexed integer program (a job starts on
a grid of ``1 / lcm(v)``; a left-justified schedule starts every job on it) with each job's
window cut by its longest paths to and from the ends.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import sys
import time
from collections import defaultdict
from fractions import Fraction
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_mmpp.core.placement import PipelineLayout  # noqa: E402
from lightning_mmpp.core.schedule import build_schedule  # noqa: E402
from lightning_mmpp.core.simulator import simulate  # noqa: E402

from bench_schedule import VIRTUAL_CHOICES, one_f_one_b_bound, random_placements  # noqa: E402

Job = tuple[int, str, int, str, int]  # (rank, module, chunk, "F" or "B", microbatch)


def replica0_jobs(layout: PipelineLayout, m: int) -> tuple[dict[Job, int], list[tuple[Job, Job]], Fraction]:
    """The jobs of replica 0 (length in grid steps), their precedences, and the grid step."""
    grid = Fraction(1, math.lcm(*(p.virtual_stages for p in layout.placements.values())))
    slots = {(rank, s.module, s.chunk): s for rank in range(layout.world_size) for s in layout.scheduled_slots(rank)}
    kept = {u for u, s in slots.items() if s.replica == 0}
    length: dict[Job, int] = {}
    after: list[tuple[Job, Job]] = []
    for u in kept:
        slot = slots[u]
        v = layout.placements[slot.module].virtual_stages
        for k in range(m):
            length[(*u, "F", k)] = int(Fraction(1, v) / grid)
            length[(*u, "B", k)] = int(Fraction(2, v) / grid)
            after.append(((*u, "F", k), (*u, "B", k)))
            for dst, peer in layout.forward_targets(slot):
                c = (peer.rank, dst, layout.peer_chunk(slot, dst, True))
                if c in kept:
                    after.append(((*u, "F", k), (*c, "F", k)))
                    after.append(((*c, "B", k), (*u, "B", k)))
    return length, after, grid


def memory_caps(plain: PipelineLayout, m: int) -> dict[int, float]:
    """1F1B's fullest rank on ``plain`` (the layout without virtual stages), for every rank, in
    whole stages' microbatches."""
    fullest = float(one_f_one_b_bound(plain, m))
    return {rank: fullest for rank in range(plain.world_size)}


def finishes_by(length: dict[Job, int], after: list[tuple[Job, Job]], horizon: int, time_limit: float,
                caps: Optional[dict[int, float]] = None,
                weight: Optional[dict[str, float]] = None) -> tuple[str, float]:
    """``"yes"`` (a schedule of the jobs ends by ``horizon`` grid steps), ``"no"`` (proved
    impossible) or ``"unknown"`` (time limit), and the solver's seconds. With ``caps``, a rank
    holds at most ``caps[rank]`` (a microbatch from its forward's start to its backward's end,
    ``weight[module]`` of it per job)."""
    import numpy as np
    import scipy.sparse as sparse
    from scipy.optimize import Bounds, LinearConstraint, milp

    succ: dict[Job, list[Job]] = defaultdict(list)
    indegree = {j: 0 for j in length}
    for a, b in after:
        succ[a].append(b)
        indegree[b] += 1
    order, ready = [], [j for j, d in indegree.items() if d == 0]
    while ready:
        j = ready.pop()
        order.append(j)
        for s in succ[j]:
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.append(s)
    head = {j: 0 for j in length}
    for j in order:
        for s in succ[j]:
            head[s] = max(head[s], head[j] + length[j])
    tail = {j: 0 for j in length}
    for j in reversed(order):
        for s in succ[j]:
            tail[j] = max(tail[j], length[s] + tail[s])
    last = {j: horizon - length[j] - tail[j] for j in length}
    if any(last[j] < head[j] for j in length):
        return "no", 0.0  # the longest path alone is longer
    var = {(j, t): i for i, (j, t) in enumerate((j, t) for j in length for t in range(head[j], last[j] + 1))}
    rows: list[int] = []
    cols: list[int] = []
    lo: list[float] = []
    hi: list[float] = []

    def constraint(columns: list[int], low: float, high: float) -> None:
        rows.extend([len(lo)] * len(columns))
        cols.extend(columns)
        lo.append(low)
        hi.append(high)

    coef: list[float] = []
    for j in length:  # every job starts once
        columns = [var[(j, t)] for t in range(head[j], last[j] + 1)]
        constraint(columns, 1, 1)
        coef.extend([1.0] * len(columns))
    for a, b in after:  # b started by t => a started by t - length[a]
        for t in range(head[b], last[b] + 1):
            mine = [var[(b, s)] for s in range(head[b], t + 1)]
            before = [var[(a, s)] for s in range(head[a], min(last[a], t - length[a]) + 1)]
            constraint(mine + before, -np.inf, 0)
            coef.extend([1.0] * len(mine) + [-1.0] * len(before))
    per_rank: dict[int, list[Job]] = defaultdict(list)
    for j in length:
        per_rank[j[0]].append(j)
    for jobs in per_rank.values():  # one job at a time per rank
        for t in range(horizon):
            columns = [var[(j, s)] for j in jobs for s in range(max(head[j], t - length[j] + 1), min(last[j], t) + 1)]
            if len(columns) > 1:
                constraint(columns, -np.inf, 1)
                coef.extend([1.0] * len(columns))
    if caps is not None:
        assert weight is not None
        for rank, jobs in per_rank.items():  # held at t: forwards started by t, less backwards ended by t
            for t in range(horizon):
                columns, values = [], []
                for j in jobs:
                    if j[3] == "F":
                        starts = range(head[j], min(last[j], t) + 1)
                    else:
                        starts = range(head[j], min(last[j], t - length[j]) + 1)
                    columns += [var[(j, s)] for s in starts]
                    values += [weight[j[1]] if j[3] == "F" else -weight[j[1]]] * len(starts)
                constraint(columns, -np.inf, caps[rank] + 1e-9)
                coef.extend(values)
    matrix = sparse.csr_matrix((coef, (rows, cols)), shape=(len(lo), len(var)))
    start = time.perf_counter()
    result = milp(np.zeros(len(var)), constraints=LinearConstraint(matrix, lo, hi), integrality=np.ones(len(var)),
                  bounds=Bounds(0, 1), options={"time_limit": time_limit})
    seconds = time.perf_counter() - start
    verdict = {0: "yes", 2: "no"}.get(result.status, "unknown")
    return verdict, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="*", help="layout indices of the seed-0 family (default: the "
                        "ones where interleaved_1f1b is longer than 1F1B)")
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds per check")
    parser.add_argument("--memory", action="store_true", help="no rank holds more than 1F1B's fullest rank")
    args = parser.parse_args()
    print("$ python benchmarks/bound_schedule.py" + (f" --seeds {' '.join(map(str, args.seeds))}" if args.seeds else "")
          + (f" --time-limit {args.time_limit:g}" if args.time_limit != 120.0 else "")
          + (" --memory" if args.memory else ""))
    rng = random.Random(0)
    print("index  m  1f1b (v=1)  interleaved_1f1b  can any schedule of the virtual layout end by 1F1B's step?")
    for i in range(200):
        placements, topology = random_placements(rng, VIRTUAL_CHOICES)
        m = rng.randint(1, 9)
        if args.seeds is not None and i not in args.seeds:
            continue
        plain = PipelineLayout({k: dataclasses.replace(p, virtual_stages=1) for k, p in placements.items()}, topology)
        layout = PipelineLayout(placements, topology)
        base = simulate(build_schedule(plain, m, "1f1b"), plain, 1.0, 2.0, mode="eager").step_time
        ours = simulate(build_schedule(layout, m, "interleaved_1f1b"), layout, 1.0, 2.0, mode="eager").step_time
        if args.seeds is None and ours <= base + 1e-9:
            continue
        length, after, grid = replica0_jobs(layout, m)
        caps = memory_caps(plain, m) if args.memory else None
        weight = {name: 1.0 / p.virtual_stages for name, p in layout.placements.items()}
        verdict, seconds = finishes_by(length, after, int(Fraction(base).limit_denominator(1000) / grid),
                                       args.time_limit, caps, weight)
        rules = "no rank above 1F1B's fullest" if args.memory else "whatever it holds"
        meaning = {"no": f"no (proved, {rules})", "yes": f"yes ({rules})",
                   "unknown": "unknown (time limit)"}[verdict]
        print(f"{i:5d} {m:2d} {base:11.3f} {ours:17.3f}  {meaning} [{seconds:.1f} s]", flush=True)


if __name__ == "__main__":
    main()
