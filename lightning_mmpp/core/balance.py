"""Contiguous balanced splits of a sequence of weights (pure Python, no torch).

Used by the partitioner (stages balanced by parameter count) and by the planner (stages
balanced by measured time).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balanced_split", "split_bounds"]


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
