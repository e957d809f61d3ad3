"""Contiguous balanced splits of a sequence of weights (pure Python, no torch).

Used by the partitioner (stages balanced by parameter count), by the planner (stages
balanced by measured time), and by ``ModulePlacement(balance="items")`` (a microbatch's samples
over a ragged module's replicas, balanced by item count: :func:`item_bounds`).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balanced_split", "item_bounds", "split_bounds"]


def balanced_split(weights: Sequence[float], parts: int) -> list[range]:
    """Split ``weights`` into ``parts`` contiguous non-empty ranges minimising the heaviest range.

    Ties go to the split that puts earlier boundaries as late as possible, so the result is
    deterministic (every rank computes the same split).
    """
    n = len(weights)
    if parts > n:
        raise ValueError(f"cannot split {n} layers into {parts} stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[p][i]: minimal max-part weight splitting the first i layers into p parts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for p in range(1, parts + 1):
        for i in range(p, n + 1):
            for j in range(p - 1, i):
                cost = max(best[p - 1][j], prefix[i] - prefix[j])
                if cost <= best[p][i]:
                    best[p][i], cut[p][i] = cost, j
    bounds = [n]
    for p in range(parts, 0, -1):
        bounds.append(cut[p][bounds[-1]])
    bounds.reverse()
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


def split_bounds(ranges: Sequence[range]) -> tuple[int, ...]:
    """The ``split_points`` form of stage ranges: the first layer of every stage after the first."""
    return tuple(r.start for r in ranges[1:])


def item_bounds(weights: Sequence[int], parts: int) -> tuple[int, ...]:
    """Sample boundaries ``(0, b1, ..., n)`` splitting ``n`` samples of integer ``weights`` (items
    per sample) into ``parts`` contiguous non-empty ranges whose heaviest is as light as possible.

    The smallest feasible capacity is found by bisection (``O(n log sum)``); each range then takes
    samples greedily up to it, stopping early only to leave one sample for each range still to
    come. Ties in items go to the split with fewer samples in its largest range (each sample
    weighs ``items * (n + 1) + 1``), so samples without items spread evenly. Pure arithmetic on the
    weights: every rank computes the same bounds.
    """
    n = len(weights)
    if parts < 1 or n < parts:
        raise ValueError(f"cannot split {n} samples into {parts} non-empty ranges")
    if any(w < 0 for w in weights):
        raise ValueError(f"item counts must be >= 0, got {list(weights)}")
    weights = [w * (n + 1) + 1 for w in weights]

    def ranges_needed(capacity: int) -> int:
        used, load = 1, 0
        for w in weights:
            if load + w > capacity:
                used, load = used + 1, 0
            load += w
        return used

    low, high = max(weights), sum(weights)
    while low < high:
        mid = (low + high) // 2
        if ranges_needed(mid) <= parts:
            high = mid
        else:
            low = mid + 1
    bounds, load = [0], 0
    for i, w in enumerate(weights):
        left = parts - len(bounds)  # ranges still to open after the current one
        if left and i > bounds[-1] and (load + w > low or n - i == left):
            bounds.append(i)
            load = 0
        load += w
    bounds.append(n)
    return tuple(bounds)
