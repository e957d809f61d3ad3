"""Gradients after a pipeline step: data-parallel synchronisation and global-norm clipping.

:class:`StageGradients` holds the parameters of the stages one rank owns, grouped by the dp
group that reduces them. After the pipeline step, :meth:`StageGradients.synchronize` sums each
group's gradients over its replicas (each step's loss is pre-scaled so that the sum is the
exact gradient of the global mean loss, see :mod:`lightning_mmpp.runtime`).
:meth:`StageGradients.clip_norm_` then clips by the norm of the *whole model's* gradient, over
every module and rank: each rank measures its own stages with
``torch.nn.utils.get_total_norm`` (dp replicas hold identical gradients after the sync, so
only replica 0 counts them), one all-reduce sums the squares over the world, and
``torch.nn.utils.clip_grads_with_norm_`` scales the local gradients.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["StageGradients", "sum_gradients"]


def sum_gradients(params_by_group: Mapping[tuple[int, ...], Sequence[nn.Parameter]], groups: Mapping) -> int:
    """All-reduce (sum) the gradients of each group's parameters; return the number of all-reduces.

    One flat buffer per group and dtype. Parameters whose ``grad`` is None are skipped;
    replicas run the same code, so they agree on which those are.
    """
    calls = 0
    for ranks, params in params_by_group.items():
        if len(ranks) < 2:
            continue
        by_dtype: dict[torch.dtype, list[Tensor]] = defaultdict(list)
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


class StageGradients:
    """The gradients of the stages one rank owns (see the module docstring).

    Args:
        params_by_group: ``{dp group ranks: parameters}``; colocated modules with the same dp
            group share one entry (one reduction).
        counted: the parameters whose gradients enter the global norm on this rank (those of
            the modules this rank holds as dp replica 0).
        groups: ``{dp group ranks: process group}``.
        world_size: ranks in the default group (1: no communication).
    """

    def __init__(
        self,
        params_by_group: Mapping[tuple[int, ...], Sequence[nn.Parameter]],
        counted: Iterable[nn.Parameter],
        groups: Mapping[tuple[int, ...], Any],
        world_size: int,
    ) -> None:
        self.params_by_group = {ranks: list(params) for ranks, params in params_by_group.items()}
        self.counted = list(counted)
        self.groups = groups
        self.world_size = world_size

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [p for params in self.params_by_group.values() for p in params]

    def synchronize(self) -> int:
        """Sum each dp group's gradients over its replicas; return the number of all-reduces."""
        return sum_gradients(self.params_by_group, self.groups)

    def total_norm(self, device: torch.device) -> Tensor:
        """The 2-norm of the whole model's gradient, on every rank (one all-reduce)."""
        grads = [p.grad for p in self.counted if p.grad is not None]
        local = torch.nn.utils.get_total_norm(grads, norm_type=2.0) if grads else torch.zeros(())
        squares = local.to(device=device, dtype=torch.float32).square()
        if self.world_size > 1:
            dist.all_reduce(squares, op=dist.ReduceOp.SUM)
        return squares.sqrt()

    def clip_norm_(self, max_norm: float, device: torch.device) -> Tensor:
        """Scale every local gradient so the global norm is at most ``max_norm``; return the norm."""
        total = self.total_norm(device)
        params = [p for p in self.parameters if p.grad is not None]
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total
