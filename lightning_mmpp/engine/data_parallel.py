"""Gradients of a pipeline step: data-parallel reduction, overlapped with the drain, and global-norm clipping.

:class:`StageGradients` holds the parameters of the stages one rank owns. Each unsharded stage
with ``dp > 1`` sums its gradients over its replicas (each step's loss is pre-scaled so that the
sum is the exact gradient of the global mean loss, see :mod:`lightning_mmpp.engine.runtime`) with
asynchronous all-reduces of buckets of gradients, started before the step ends: the runtime
says which backward is the stage's last of the step, and the sums start right after it (after
the exchange that sends its input gradients upstream, which other ranks are waiting for), so
they run while other ranks are still draining. With ``launch_in_backward`` a bucket starts even
earlier, from a gradient hook during that last backward as soon as its gradients are final
(DDP's overlap: the sums run while the backward computes the stage's first layers). The
strategy turns that on for accelerators, where the collective runs beside the compute; on CPU
(gloo) the collective takes cores from the backward and from other ranks, and the in-backward
launch measured slower (benchmarks/README.md, "Sharding and recompute").
:meth:`StageGradients.synchronize` waits for the sums before the optimizer.

Why the unsharded reduction is hand-written: DDP's reducer (and composable ``replicate``, built
on it) pairs every backward with the forward before it and launches bucket all-reduces from
autograd hooks during every backward; a pipeline stage runs m forwards and m backwards per step
in an order the schedule decides (1F1B keeps several forwards in flight), so the reducer would
need ``no_sync`` bookkeeping around each of them and still could not know which backward is the
last of the step. The schedule knows, so the runtime starts one flat all-reduce per stage at
exactly that point. FSDP2 without resharding would do the same reduction as a reduce-scatter
plus an all-gather of the parameters every step: twice the traffic for replicated parameters.

:meth:`StageGradients.clip_norm_` clips by the norm of the *whole model's* gradient, over
every module and rank: each rank measures what it counts (its replica-0 stages, whose
replicas hold identical gradients after the sum, and the local shards of every sharded stage),
one all-reduce sums the squares over the world, and every local gradient is scaled. In a tp
group a parameter split over the group counts its shard on every tp rank, one replicated over
it counts on the lead only (:func:`~lightning_mmpp.engine.tensor_parallel.counts_on_this_tp_rank`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mmpp.model.partition import StageRunner
from lightning_mmpp.core.placement import PipelineLayout
from lightning_mmpp.engine.sharding import ShardedStage, local_tensor
from lightning_mmpp.engine.tensor_parallel import counts_on_this_tp_rank

__all__ = ["StageGradients", "pack_gradients", "unpack_gradients"]


BUCKET_BYTES = 25 * 1024 * 1024
"""Gradient bytes per all-reduce of an unsharded stage (DDP's default bucket size)."""


def pack_gradients(grads: Sequence[Tensor]) -> Tensor:
    """One flat tensor holding ``grads`` one after the other: what a bucket's all-reduce sums
    (a copy of every byte, on the calling thread; the planner calibrates its cost per byte)."""
    return torch.cat([g.reshape(-1) for g in grads])


def unpack_gradients(flat: Tensor, grads: Sequence[Tensor]) -> None:
    """Copy the summed ``flat`` (of :func:`pack_gradients`) back into ``grads``."""
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


@dataclass
class _Bucket:
    """Consecutive parameters of one dtype, in reverse definition order (the order a backward
    usually finishes them), summed by one all-reduce."""

    params: list[nn.Parameter]
    ready: set[int] = field(default_factory=set)  # ids of parameters whose gradient is final
    pending: Any = None  # (work, flat, grads) once launched


class _Reduction:
    """The asynchronous sum of one stage's gradients over its dp group, in buckets.

    During the stage's last backward of the step (``armed``) a bucket is launched as soon as
    every gradient in it has been accumulated (``register_post_accumulate_grad_hook``), so the
    first buckets' sums run while the backward is still computing the stage's first layers.
    Buckets are launched strictly in order, so every replica issues the same collectives in the
    same order whatever order its hooks fire in. What no hook launched (parameters that got no
    gradient, a weight-gradient pass that writes ``.grad`` itself) is launched when the
    backward has ended (:meth:`start`), skipping parameters without a gradient (replicas run
    the same code, so they agree on which those are).
    """

    def __init__(self, group: Any, params: Sequence[nn.Parameter], bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group = group
        self.buckets: list[_Bucket] = []
        for dtype in sorted({p.dtype for p in params}, key=str):
            # every dtype starts a bucket of its own (one flat tensor per all-reduce), also when
            # its first parameter has no elements; a full bucket is closed before the next one
            bucket: _Bucket | None = None
            size = 0
            for p in reversed([q for q in params if q.dtype is dtype]):
                nbytes = p.numel() * p.element_size()
                if bucket is None or size + nbytes > bucket_bytes:
                    bucket = _Bucket([])
                    self.buckets.append(bucket)
                    size = 0
                bucket.params.append(p)
                size += nbytes
        self.bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        self.launched = 0  # buckets launched this step, a prefix of ``buckets``
        self.armed = False
        self.started = False
        self.hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in params]

    def _on_gradient(self, param: nn.Parameter) -> None:
        if not self.armed:
            return
        self.bucket_of[id(param)].ready.add(id(param))
        while self.launched < len(self.buckets):
            bucket = self.buckets[self.launched]
            if len(bucket.ready) < len(bucket.params):
                break
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        grads = [local_tensor(p.grad) for p in bucket.params if p.grad is not None]
        if grads:
            flat = pack_gradients(grads)
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            bucket.pending = (work, flat, grads)
        self.launched += 1

    def start(self) -> None:
        """The stage's last backward has ended: launch every bucket not launched yet."""
        self.armed = False
        while self.launched < len(self.buckets):
            self._launch(self.buckets[self.launched])
        self.started = True

    def finish(self) -> int:
        """Wait for the sums and write them back; return the number of all-reduces."""
        if not self.started:
            self.start()
        calls = 0
        for bucket in self.buckets:
            if bucket.pending is not None:
                work, flat, grads = bucket.pending
                work.wait()
                unpack_gradients(flat, grads)
                calls += 1
            bucket.pending, bucket.ready = None, set()
        self.launched, self.armed, self.started = 0, False, False
        return calls

    def remove_hooks(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks = []


class StageGradients:
    """The gradients of the stages one rank owns (see the module docstring).

    Args:
        reductions: ``{module: (dp process group, parameters)}`` for this rank's unsharded
            stages with ``dp > 1``.
        counted: the parameters whose gradients enter the global norm on this rank.
        parameters: every parameter of this rank's stages (what clipping scales).
        world_size: ranks in the default group (1: no communication).
        sharded: this rank's sharded stages (FSDP2 reduces them), by module.
        bucket_bytes: gradient bytes per all-reduce.
        launch_in_backward: start a bucket's sum from a gradient hook during the stage's last
            backward as soon as its gradients are final, instead of after that backward.

    It is the runtime's :class:`~lightning_mmpp.engine.runtime.GradientSync`: told before every
    backward whether it is a stage's last of the step, and after that last one.
    """

    def __init__(
        self,
        reductions: Mapping[str, tuple[Any, Sequence[nn.Parameter]]],
        counted: Iterable[nn.Parameter],
        parameters: Iterable[nn.Parameter],
        world_size: int,
        sharded: Mapping[str, ShardedStage] = {},
        bucket_bytes: int = BUCKET_BYTES,
        launch_in_backward: bool = False,
    ) -> None:
        self.launch_in_backward = launch_in_backward
        self.sharded = dict(sharded)
        self.reductions = {
            module: _Reduction(group, list(params), bucket_bytes) for module, (group, params) in reductions.items()
        }
        self.counted = list(counted)
        self.parameters = list(parameters)
        self.world_size = world_size

    @classmethod
    def for_rank(
        cls,
        layout: PipelineLayout,
        rank: int,
        runners: Mapping[str, StageRunner],
        groups: Mapping,
        world_size: int,
        counted_elsewhere: Iterable[nn.Parameter] = (),
        sharded: Mapping[str, ShardedStage] = {},
        bucket_bytes: int = BUCKET_BYTES,
        launch_in_backward: bool = False,
    ) -> "StageGradients":
        """This rank's stages. Replica-0 stages count in the norm, every replica of a sharded
        stage counts its own shards, except ``counted_elsewhere`` (a tied parameter counts once,
        on one of its owners)."""
        reductions: dict[str, tuple[Any, list[nn.Parameter]]] = {}
        counted: list[nn.Parameter] = []
        everything: list[nn.Parameter] = []
        for module, runner in runners.items():
            params = runner.parameters()
            everything.extend(params)
            placement = layout.placements[module]
            trainable = [p for p in params if p.requires_grad]
            slot = layout.slot(rank, module)
            tp_index = slot.tp_index if slot is not None else 0
            if placement.dp > 1 and not placement.shard and trainable:
                reductions[module] = (groups[layout.dp_group(module, runner.stage, tp_index)], trainable)
            if placement.shard or (slot is not None and slot.replica == 0):
                counted.extend(p for p in params if counts_on_this_tp_rank(p, tp_index))
        skip = {id(p) for p in counted_elsewhere}
        counted = [p for p in dict.fromkeys(counted) if id(p) not in skip]
        return cls(reductions, counted, dict.fromkeys(everything), world_size, sharded, bucket_bytes, launch_in_backward)

    def before_backward(self, module: str, last: bool) -> None:
        stage = self.sharded.get(module)
        if stage is not None:
            stage.before_backward(last)
        reduction = self.reductions.get(module)
        if reduction is not None and last and self.launch_in_backward:
            reduction.armed = True  # buckets launch from gradient hooks during this backward

    def after_last_backward(self, module: str) -> None:
        self.start(module)

    def start(self, module: str) -> None:
        """The last backward of ``module``'s stage in this step has run: start summing its gradients."""
        reduction = self.reductions.get(module)
        if reduction is not None and not reduction.started:
            reduction.start()

    def close(self) -> None:
        """Remove the gradient hooks from the parameters (the end of a fit)."""
        for reduction in self.reductions.values():
            reduction.remove_hooks()

    def synchronize(self) -> int:
        """Finish (start where the runtime did not) every stage's sum; return the number of all-reduces."""
        return sum(reduction.finish() for reduction in self.reductions.values())

    def total_norm(self, device: torch.device) -> Tensor:
        """The 2-norm of the whole model's gradient, on every rank (one all-reduce)."""
        grads = [local_tensor(p.grad) for p in self.counted if p.grad is not None]
        local = torch.nn.utils.get_total_norm(grads, norm_type=2.0) if grads else torch.zeros(())
        squares = local.to(device=device, dtype=torch.float32).square()
        if self.world_size > 1:
            dist.all_reduce(squares, op=dist.ReduceOp.SUM)
        return squares.sqrt()

    def clip_norm_(self, max_norm: float, device: torch.device) -> Tensor:
        """Scale every local gradient so the global norm is at most ``max_norm``; return the norm.

        The same coefficient as ``torch.nn.utils.clip_grads_with_norm_``, applied to the local
        tensors (a sharded gradient's shard is scaled in place).
        """
        total = self.total_norm(device)
        grads = [local_tensor(p.grad) for p in self.parameters if p.grad is not None]
        if grads:
            coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coefficient.to(g.device))
        return total
