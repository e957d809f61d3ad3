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

On CPU (gloo) with up to :data:`DIRECT_SUM_MAX_WORLD` ranks the sum is not gloo's
``all_reduce`` but every rank sending its vector to every other (tag :data:`METRIC_SUM_TAG`) and
adding the world's vectors in rank order, the same additions on every rank, so the result is
identical everywhere. Why: the ranks reach the sum at different times (a 1F1B step's last
stages finish long before its first), and gloo's collective then runs its rounds of messages
after the last arrival, each waking a rank that slept through the wait; through
``Trainer.fit`` on the two-encoder -> LM benchmark (4 ranks, 2 cores) the last rank waited
~6 ms for it against ~2.5 ms with one message per pair (benchmarks/README.md; timed alone on
8 ranks the messages still won, 2.8-3.1 ms against 3.7-4.1). Each rank posts ``world - 1`` sends
and receives, which grows linearly where the collective's rounds grow with the ring; beyond
:data:`DIRECT_SUM_MAX_WORLD` ranks (not measured) the reducer keeps gloo's ``all_reduce``. NCCL
keeps ``all_reduce`` at any size.

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
from lightning_mmpp.torch_api import direct_p2p

__all__ = ["DIRECT_SUM_MAX_WORLD", "METRIC_SUM_TAG", "MetricReducer", "PendingMetrics"]

# the largest world whose CPU ranks sum the metrics with one message per pair (module docstring)
DIRECT_SUM_MAX_WORLD = 16
# the point-to-point tag of those messages on the default group: distinct from the
# communicator's (0 and comm.LATER_PARTS_TAG), whose messages may be in flight beside them
METRIC_SUM_TAG = 2


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
        # one message per pair instead of gloo's all_reduce (see the module docstring)
        self.direct = device.type == "cpu" and 1 < world_size <= DIRECT_SUM_MAX_WORLD

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
        work: Optional[Any] = None
        if self.direct:
            work = _DirectSum(vector, self.world_size)
        elif self.world_size > 1:
            work = dist.all_reduce(vector, op=dist.ReduceOp.SUM, async_op=True)
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


class _DirectSum:
    """The world's sum of ``vector`` by one message per pair (see the module docstring): posted
    at construction, written into ``vector`` by :meth:`wait`, identical on every rank (the same
    additions in rank order)."""

    def __init__(self, vector: Tensor, world_size: int) -> None:
        rank = dist.get_rank()
        send, recv = direct_p2p(None)
        self.vector = vector
        self.parts: list[Tensor] = [vector if peer == rank else torch.empty_like(vector) for peer in range(world_size)]
        peers = [peer for peer in range(world_size) if peer != rank]
        self.works = ([send(vector, peer, METRIC_SUM_TAG) for peer in peers]
                      + [recv(self.parts[peer], peer, METRIC_SUM_TAG) for peer in peers])

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        total = self.parts[0].clone()
        for part in self.parts[1:]:
            total += part
        self.vector.copy_(total)
