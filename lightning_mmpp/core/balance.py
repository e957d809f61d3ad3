"""Contiguous balanced splits of a sequence of weights (pure Python, no torch).

Used by the partitioner (stages balanced by parameter count), by the planner (stages
balanced by measured time), and by ``ModulePlacement(balance="items")`` (a microbatch's samples
over a ragged module's replicas, balanced by item count: :func:`item_bounds`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

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


def item_bounds(weights: Sequence[int], parts: int, offsets: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """Sample boundaries ``(0, b1, ..., n)`` splitting ``n`` samples of integer ``weights`` (items
    per sample) into ``parts`` contiguous non-empty ranges whose heaviest is as light as possible.

    ``offsets``: items range ``j`` already carries (from earlier microbatches of the step); then
    the heaviest ``offsets[j] + load_j`` is minimised. Ties in items go to the split with fewer
    samples in its heaviest range (each sample weighs ``items * (n + 1) + 1``), so samples
    without items spread evenly. The smallest feasible capacity is found by bisection, each test
    a sweep over the ends each range can reach (``O(parts * n)``); the bounds are then read back
    from the last range, each range starting as late as it can. Pure arithmetic on the weights:
    every rank computes the same bounds.
    """
    n = len(weights)
    if parts < 1 or n < parts:
        raise ValueError(f"cannot split {n} samples into {parts} non-empty ranges")
    if any(w < 0 for w in weights):
        raise ValueError(f"item counts must be >= 0, got {list(weights)}")
    scale = n + 1
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w * scale + 1)
    base = [0] * parts if offsets is None else [o * scale for o in offsets]

    def reachable(capacity: int) -> Optional[list[list[bool]]]:
        """``starts[j][s]``: range ``j`` can start at sample ``s`` with every range so far within
        ``capacity``; ``None`` if the last range cannot end at ``n``."""
        starts = [[False] * (n + 1) for _ in range(parts + 1)]
        starts[0][0] = True
        for j in range(parts):
            last = n - (parts - j - 1)  # leave a sample for every later range
            marks = [0] * (n + 2)
            end = 0
            for s in range(n):
                if not starts[j][s]:
                    continue
                end = max(end, s)
                while end < last and base[j] + prefix[end + 1] - prefix[s] <= capacity:
                    end += 1
                if end > s:
                    marks[s + 1] += 1
                    marks[end + 1] -= 1
            running = 0
            for e in range(n + 1):
                running += marks[e]
                starts[j + 1][e] = running > 0
        return starts if starts[parts][n] else None

    low, high = 0, max(base) + prefix[n]
    while low < high:
        mid = (low + high) // 2
        if reachable(mid) is not None:
            high = mid
        else:
            low = mid + 1
    starts = reachable(low)
    assert starts is not None
    bounds = [n]
    for j in range(parts - 1, -1, -1):  # the latest start of range j that ends at the next bound
        end = bounds[-1]
        s = max(s for s in range(end) if starts[j][s] and base[j] + prefix[end] - prefix[s] <= low)
        bounds.append(s)
    return tuple(reversed(bounds))
