"""Parameters tied across stages or modules: one copy per owning stage, gradients summed.

Megatron keeps the input embedding and the output head on the first and last stage and
all-reduces their gradients in an "embedding group"; this is the same for any parameter a
``LightningModule`` shares between layers that land on different stages (found by identity,
see :func:`lightning_mmpp.model.partition.find_tied_parameters`). After the data-parallel sums, every
replica of an owner stage holds that stage's gradient; one all-reduce over all owner ranks, to
which replica 0 of each owner contributes its gradient and every other rank zeros, gives each
copy the sum: the gradient of the single parameter in one process. Equal copies, equal
gradients and the same optimizer keep the copies equal after every step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_mmpp.model.partition import TiedParameter
from lightning_mmpp.core.placement import PipelineLayout

__all__ = ["owner_ranks", "sum_groups", "sum_tied_gradients", "tie_groups", "counts_in_norm"]


def _sharded(layout: PipelineLayout, tie: TiedParameter) -> bool:
    return layout.placements[tie.owners[0][0]].shard


def sum_groups(layout: PipelineLayout, tie: TiedParameter) -> list[tuple[int, ...]]:
    """The rank sets whose copies are summed: all owner ranks, or for sharded copies one set per
    replica index (the ranks holding the same rows)."""
    if not _sharded(layout, tie):
        return [owner_ranks(layout, tie)]
    by_replica: dict[int, set[int]] = {}
    for rank in range(layout.world_size):
        for module, stage in tie.owners:
            for slot in layout.chunk_slots(rank, module):
                if slot.stage == stage:
                    by_replica.setdefault(slot.replica, set()).add(rank)
    return [tuple(sorted(by_replica[r])) for r in sorted(by_replica)]


def _holds(layout: PipelineLayout, rank: int, module: str, stage: int, replica: int | None = None) -> bool:
    """Whether ``rank`` holds ``stage`` of ``module`` (as any of its chunks), of ``replica`` if given."""
    return any(s.stage == stage and (replica is None or s.replica == replica)
               for s in layout.chunk_slots(rank, module))


def owner_ranks(layout: PipelineLayout, tie: TiedParameter) -> tuple[int, ...]:
    """Every rank holding a copy (all dp replicas of every owner stage; two owner chunks on one
    rank share one copy)."""
    return tuple(rank for rank in range(layout.world_size)
                 if any(_holds(layout, rank, module, stage) for module, stage in tie.owners))


def _contributes(layout: PipelineLayout, tie: TiedParameter, rank: int) -> bool:
    """Whether this rank's copy enters the sum: it is replica 0 of an owner stage it holds (every
    sharded copy: its group holds one copy of those rows per owner)."""
    if _sharded(layout, tie):
        return True
    return any(_holds(layout, rank, module, stage, replica=0) for module, stage in tie.owners)


def counts_in_norm(layout: PipelineLayout, tie: TiedParameter, rank: int) -> bool:
    """Whether this rank counts the tied parameter in the global gradient norm: replica 0 of
    its first owner stage only (every replica of it for sharded copies: each its rows), so the
    parameter counts once, as in one process."""
    module, stage = tie.owners[0]
    return _holds(layout, rank, module, stage, replica=None if _sharded(layout, tie) else 0)


def tie_groups(layout: PipelineLayout, tied: Sequence[TiedParameter], timeout: timedelta) -> dict[tuple[int, ...], Any]:
    """Process groups over the owner ranks of every trainable tie spanning several ranks.

    Collective over the world: every rank calls it with the same ties, in the same order.
    """
    groups: dict[tuple[int, ...], Any] = {}
    for tie in tied:
        for ranks in sum_groups(layout, tie):
            if tie.requires_grad and len(ranks) > 1 and ranks not in groups:
                groups[ranks] = dist.new_group(list(ranks), timeout=timeout)
    return groups


def sum_tied_gradients(
    layout: PipelineLayout, tied: Sequence[TiedParameter], groups: Mapping[tuple[int, ...], Any], rank: int
) -> None:
    """Give every copy of every tied parameter the sum of its owners' gradients."""
    for tie in tied:
        if tie.local is None or not tie.requires_grad:
            continue
        ranks = next((r for r in sum_groups(layout, tie) if rank in r), ())
        if len(ranks) < 2:
            continue
        param = tie.local
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad  # a shard's rows
        buffer = grad.clone() if _contributes(layout, tie, rank) else torch.zeros_like(grad)
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=groups[ranks])
        grad.copy_(buffer)
