"""Metric reduction: every rank ends a step with the same, exact metric values.

Only sink ranks compute metrics (``pipeline_loss`` runs there), and each holds its share of
every metric already divided by the number of microbatches and sink replicas (see
:class:`lightning_mmpp.engine.runtime.StepResult`); summing the shares over the world gives the step's
value. :class:`MetricReducer` does that sum with one all-reduce per step (:meth:`MetricReducer.start`,
then :meth:`MetricReducer.finish`).

The name protocol: the other ranks do not know the metric names, so the all-reduced vector is
laid out by a list of names cached per kind of step (:class:`~lightning_mmpp.core.kinds.StepKind`). The
vector carries one extra element, non-zero when any rank holds a name outside the cache; then
every rank gathers the names (an object gather, names only), rebuilds the cache and reduces
again. After the first step of each kind that happens only if a new metric appears.

The same all-reduce carries a caller's ``extra`` values (summed element-wise over the world):
the Lightning strategy agrees on preemption that way, with no collective of its own at the step
boundary (where the ranks all arrive together and a collective is slowest; see
:mod:`lightning_mmpp.lightning.preemption`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mmpp.core.kinds import StepKind

__all__ = ["MetricReducer", "PendingMetrics"]


class MetricReducer:
    """Sums every rank's metric shares over the world (see the module docstring).

    Args:
        world_size: number of ranks taking part (1: no communication).
        device: where the reduced vector lives (the rank's device: NCCL needs CUDA tensors).
    """

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size = world_size
        self.device = device
        self._names: dict[StepKind, list[str]] = {}

    def start(self, local: Mapping[str, Tensor], kind: StepKind, extra: Sequence[float] = ()) -> "PendingMetrics":
        """Launch the step's all-reduce of ``local`` and ``extra`` (every rank calls this, with
        ``extra`` of the same length everywhere) and return at once; :meth:`finish` waits for it
        and returns the metrics, identical on every rank, and ``extra`` summed over the world. The
        engine starts it before waiting for the dp gradient sums, which run on other process
        groups: the two collectives' wake-ups overlap instead of queueing at the step's end."""
        names = self._names.get(kind, [])
        unknown = float(any(n not in names for n in local))
        zero = torch.zeros((), device=self.device, dtype=torch.float32)  # whatever the default dtype
        values = [local[n].to(self.device, torch.float32) if n in local else zero for n in names]
        tail = torch.tensor([*extra, unknown], device=self.device, dtype=torch.float32)
        vector = torch.cat([torch.stack(values), tail]) if values else tail
        work = dist.all_reduce(vector, op=dist.ReduceOp.SUM, async_op=True) if self.world_size > 1 else None
        return PendingMetrics(local, kind, tuple(extra), names, vector, work)

    def finish(self, pending: "PendingMetrics") -> tuple[dict[str, Tensor], list[float]]:
        """Wait for :meth:`start`'s all-reduce and read it (one host read); when a rank held a
        metric name outside the cache, gather the names and reduce again."""
        while True:
            if pending.work is not None:
                pending.work.wait()
            names, vector = pending.names, pending.vector
            *sums, unknown_anywhere = vector[len(names):].tolist()  # one host read
            if unknown_anywhere == 0:
                return {n: vector[i] for i, n in enumerate(names)}, sums
            gathered: list[Any] = [sorted(pending.local)]
            if self.world_size > 1:
                gathered = [None] * self.world_size
                dist.all_gather_object(gathered, sorted(pending.local))
            self._names[pending.kind] = sorted({n for part in gathered for n in part})
            pending = self.start(pending.local, pending.kind, pending.extra)


@dataclass
class PendingMetrics:
    """A step's metric all-reduce in flight (:meth:`MetricReducer.start`)."""

    local: Mapping[str, Tensor]
    kind: StepKind
    extra: tuple[float, ...]
    names: list[str]
    vector: Tensor
    work: Optional[Any]
