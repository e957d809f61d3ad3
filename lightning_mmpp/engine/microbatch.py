"""The global batch: loaded identically on every rank, split into microbatches and dp shards.

Every rank loads the same global batch (the Lightning adapter makes a shuffling ``DataLoader``
agree across ranks). The strategy splits it into microbatches along dim 0
(:func:`split_microbatches`), and each dp replica of a module takes its contiguous shard of a
microbatch (:func:`slice_batch`).

What is split, leaf by leaf (the *splitting rule*):

* a tensor with at least one dimension is split along dim 0 (all such tensors must agree on
  its size: that is the batch size);
* a ``list`` or ``tuple`` that holds no tensor and whose length equals the batch size is a
  per-sample field (ids, captions, file names collated by ``default_collate``) and is split
  with its samples;
* everything else (0-d tensors, numbers, strings, lists of another length, ``None``, any
  other object) is handed whole to every microbatch and shard.

A list or tuple that *contains* tensors is a container (like a dict), not a field: its
elements follow the rule one by one. The ambiguous case is a list without tensors whose length
happens to equal the batch size although it is not per-sample (say, four class names with a
batch of four): wrap it in :class:`Unsplit` in the ``collate_fn`` and the hooks receive the
list itself, whole, in every microbatch and shard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor

from lightning_mmpp import torch_api as pytree
from lightning_mmpp.core.kinds import StepKind
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.core.placement import PipelineLayout

__all__ = [
    "BatchSplitter",
    "Unsplit",
    "batch_size_of",
    "microbatch_count",
    "slice_batch",
    "split_microbatches",
    "unwrap_unsplit",
]


@dataclass(frozen=True)
class Unsplit:
    """A batch field handed whole to every microbatch and dp shard (the escape hatch of the
    splitting rule); the pipeline hooks receive ``value`` itself."""

    value: Any


def _holds_tensor(node: Any) -> bool:
    return any(isinstance(leaf, Tensor) for leaf in pytree.tree_leaves(node))


def _is_sample_list(node: Any) -> bool:
    """A list/tuple field without tensors (namedtuples are records, not fields)."""
    return (
        isinstance(node, (list, tuple))
        and not hasattr(node, "_fields")
        and not _holds_tensor(node)
    )


def _is_field(node: Any) -> bool:
    return isinstance(node, Unsplit) or _is_sample_list(node)


def _fields(batch: Any) -> tuple[list[Any], pytree.TreeSpec]:
    return pytree.tree_flatten(batch, is_leaf=_is_field)


def batch_size_of(batch: Any) -> int:
    """The batch size: dim 0 of every tensor leaf with a dimension (they must agree).

    A batch without such tensors takes the length of its per-sample lists, if they agree.
    """
    leaves, _ = _fields(batch)
    sizes = {leaf.shape[0] for leaf in leaves if isinstance(leaf, Tensor) and leaf.dim() > 0}
    if len(sizes) > 1:
        raise PipelineConfigError(f"the batch's tensors disagree on dim 0 (sizes {sorted(sizes)}); they must agree.")
    if not sizes:
        sizes = {len(leaf) for leaf in leaves if _is_sample_list(leaf) and len(leaf) > 0}
        if len(sizes) != 1:
            raise PipelineConfigError(
                "the batch holds no tensor with a batch dimension (and no per-sample lists of one length); the "
                "pipeline splits the batch along dim 0."
            )
    return sizes.pop()


def microbatch_count(batch_size: int, num_microbatches: int, divisor: int, short: bool = False) -> int:
    """The number of microbatches for a batch: ``num_microbatches``, or fewer for a short batch.

    Every microbatch must split evenly over every dp size (``divisor`` = their lcm). A full batch
    must divide by ``num_microbatches * divisor``. A ``short`` batch (the last one, with
    ``drop_last=False``) runs with the largest count <= ``num_microbatches`` that divides it;
    metrics weight each batch by its samples, so averages stay exact.
    """
    if batch_size % divisor or (not short and batch_size % (num_microbatches * divisor)):
        if divisor == 1:
            reason = f"it must split into num_microbatches={num_microbatches} equal microbatches"
        else:
            reason = (
                f"it must split into num_microbatches={num_microbatches} microbatches that each divide evenly over "
                f"the dp replicas (lcm of the dp sizes = {divisor})"
            )
        raise PipelineConfigError(
            f"a batch of {batch_size} samples cannot be split: {reason}; use a batch size that is a multiple of "
            f"{num_microbatches * divisor} (drop_last=True in the DataLoader avoids a short last batch)."
        )
    return max(m for m in range(1, num_microbatches + 1) if batch_size % (m * divisor) == 0)


def _slice_field(leaf: Any, index: slice, batch_size: int) -> Any:
    if isinstance(leaf, Tensor):
        return leaf[index] if leaf.dim() > 0 else leaf
    if _is_sample_list(leaf) and len(leaf) == batch_size:
        return leaf[index]
    return leaf


def slice_batch(batch: Any, index: slice, batch_size: Optional[int] = None) -> Any:
    """The samples ``index`` of ``batch`` (of ``batch_size`` samples), by the splitting rule."""
    size = batch_size_of(batch) if batch_size is None else batch_size
    leaves, spec = _fields(batch)
    return spec.unflatten([_slice_field(leaf, index, size) for leaf in leaves])


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """Split ``batch`` into ``num_microbatches`` equal, contiguous parts by the splitting rule."""
    size = batch_size_of(batch)
    per = size // num_microbatches
    return [slice_batch(batch, slice(k * per, (k + 1) * per), size) for k in range(num_microbatches)]


def unwrap_unsplit(batch: Any) -> Any:
    """Replace every :class:`Unsplit` by its value (what the pipeline hooks receive)."""
    leaves, spec = _fields(batch)
    if not any(isinstance(leaf, Unsplit) for leaf in leaves):
        return batch
    return spec.unflatten([leaf.value if isinstance(leaf, Unsplit) else leaf for leaf in leaves])


class BatchSplitter:
    """Splits each global batch for one rank: microbatches, then this rank's dp shard of them.

    Tracks, per :class:`~lightning_mmpp.core.kinds.StepKind`, the largest batch seen: a smaller
    one is a short last batch and runs with fewer microbatches (:func:`microbatch_count`).
    """

    def __init__(self, layout: PipelineLayout, rank: int, num_microbatches: int) -> None:
        self.layout = layout
        self.rank = rank
        self.num_microbatches = num_microbatches
        self.divisor = layout.batch_divisor
        self._largest: dict[StepKind, int] = {}

    def split(self, batch: Any, kind: StepKind) -> tuple[int, Callable[[str, int], Any]]:
        """``(m, shard)``: the microbatch count, and ``shard(module, k)``, the part of microbatch
        ``k`` this rank's replica of ``module`` processes (what the pipeline hooks receive)."""
        size = batch_size_of(batch)
        largest = self._largest.get(kind, 0)
        m = microbatch_count(size, self.num_microbatches, self.divisor, short=size < largest)
        self._largest[kind] = max(largest, size)
        micro = split_microbatches(batch, m)
        per = size // m

        def shard(module: str, k: int) -> Any:
            slot = self.layout.slot(self.rank, module)
            assert slot is not None, f"rank {self.rank} holds no stage of {module!r}"
            return unwrap_unsplit(slice_batch(micro[k], self.layout.batch_shard(module, slot.replica, per), per))

        return m, shard
