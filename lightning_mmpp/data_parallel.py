"""Gradient reduction over each module's data-parallel group, one flat buffer per dtype."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn


def sum_gradients(params_by_group: Mapping[tuple[int, ...], Sequence[nn.Parameter]], groups: Mapping) -> int:
    """All-reduce (sum) the gradients of each group's parameters; return the number of all-reduces.

    Each step's loss is pre-scaled so that the sum over replicas is the exact gradient of the
    global mean loss (see :mod:`lightning_mmpp.runtime`). Parameters whose ``grad`` is None are
    skipped; replicas run the same code, so they agree on which those are.
    """
    calls = 0
    for ranks, params in params_by_group.items():
        if len(ranks) < 2:
            continue
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
        for p in params:
            if p.grad is not None:
                by_dtype[p.grad.dtype].append(p.grad)
        for dtype in sorted(by_dtype, key=str):
            grads = by_dtype[dtype]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=groups[ranks])
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            calls += 1
    return calls
