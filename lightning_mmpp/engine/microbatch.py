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

* a :class:`~lightning_mmpp.model.ragged.Ragged` (a variable number of items per sample) is
  split by sample: a slice of samples takes their counts and the rows of ``values`` they own.
  Its sample count (``len(counts)``) must equal the batch size.

A list or tuple that *contains* tensors is a container (like a dict), not a field: its
elements follow the rule one by one. So a per-sample list of tensors of different lengths (the
images of each sample, say) is *not* accepted as ragged: its elements would be taken as
separate fields. The batch is refused with an error naming the field; pack it in the
``collate_fn`` as ``Ragged.from_list(images)`` (``values`` = the images one after another,
``counts`` = images per sample). The ambiguous case is a list without tensors whose length
happens to equal the batch size although it is not per-sample (say, four class names with a
batch of four): wrap it in :class:`Unsplit` in the ``collate_fn`` and the hooks receive the
list itself, whole, in every microbatch and shard.

Replicas: a module's dp replica ``j`` takes the equal contiguous shard ``j`` of each
microbatch, or, with ``ModulePlacement(balance="items")``, a contiguous shard balanced by the
items of the batch's ``Ragged`` fields (summed over those fields, per sample), computed
identically on every rank from the counts (:class:`SampleRouting`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from torch import Tensor

from lightning_mmpp import torch_api as pytree
from lightning_mmpp.core.balance import item_bounds
from lightning_mmpp.core.kinds import StepKind
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.core.placement import PipelineLayout
from lightning_mmpp.model.ragged import Ragged

__all__ = [
    "BatchSplitter",
    "SampleRouting",
    "Unsplit",
    "batch_size_of",
    "item_counts",
    "microbatch_count",
    "sample_routing",
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
    return isinstance(node, (Unsplit, Ragged)) or _is_sample_list(node)


def _fields(batch: Any) -> tuple[list[Any], pytree.TreeSpec]:
    return pytree.tree_flatten(batch, is_leaf=_is_field)


def _field_size(leaf: Any) -> Optional[int]:
    """The samples a field carries: dim 0 of a tensor, ``len(counts)`` of a ``Ragged``."""
    if isinstance(leaf, Ragged):
        return leaf.num_samples
    if isinstance(leaf, Tensor) and leaf.dim() > 0:
        return int(leaf.shape[0])
    return None


def _check_ragged(leaf: Ragged, path: str) -> None:
    """The ``Ragged`` invariants again (a collate_fn may have replaced ``values`` or ``counts``)."""
    try:
        Ragged(leaf.values, leaf.counts)
    except PipelineConfigError as err:
        raise PipelineConfigError(f"batch field {path}: {err}") from None


def _disagreement(batch: Any) -> PipelineConfigError:
    """The error for fields that disagree on the sample count, naming each field."""
    with_path, _ = pytree.tree_flatten_with_path(batch, is_leaf=_is_field)
    named = [(pytree.keystr(path) or "(the batch)", _field_size(leaf)) for path, leaf in with_path]
    listing = ", ".join(f"{path}: {size}" for path, size in named if size is not None)
    hint = ""
    lists = [path for path in _tensor_lists(batch, ())]
    if lists:
        hint = (
            f" The batch holds a list of tensors at {', '.join(lists)}: a list is a container, its tensors are "
            "separate fields. If it holds a variable number of items per sample (images of each sample), pack it "
            "in the collate_fn as lightning_mmpp.Ragged.from_list(items) (values packed along dim 0, counts = "
            "items per sample)."
        )
    return PipelineConfigError(
        f"the batch's fields disagree on dim 0, the number of samples ({listing}); every tensor's dim 0 and every "
        f"Ragged's len(counts) must equal the batch size.{hint}"
    )


def _tensor_lists(node: Any, path: tuple[Any, ...]) -> list[str]:
    """Paths of the lists/tuples (not namedtuples) in ``node`` whose elements are all tensors."""
    if isinstance(node, dict):
        return [p for key, value in node.items() for p in _tensor_lists(value, path + (pytree.MappingKey(key),))]
    if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
        if node and all(isinstance(item, Tensor) for item in node):
            return [pytree.keystr(path) or "(the batch)"]
        return [p for i, item in enumerate(node) for p in _tensor_lists(item, path + (pytree.SequenceKey(i),))]
    return []


def batch_size_of(batch: Any) -> int:
    """The batch size: dim 0 of every tensor leaf with a dimension and ``len(counts)`` of every
    :class:`~lightning_mmpp.model.ragged.Ragged` (they must agree).

    A batch without such tensors takes the length of its per-sample lists, if they agree.

    Raises:
        PipelineConfigError: the fields disagree (the message names each field and its count),
            or a ``Ragged``'s counts do not match its values.
    """
    with_path, _ = pytree.tree_flatten_with_path(batch, is_leaf=_is_field)
    leaves = [leaf for _, leaf in with_path]
    for path, leaf in with_path:
        if isinstance(leaf, Ragged):
            _check_ragged(leaf, pytree.keystr(path) or "(the batch)")
    sizes = {size for size in map(_field_size, leaves) if size is not None}
    if len(sizes) > 1:
        raise _disagreement(batch)
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
    if isinstance(leaf, Ragged):
        return leaf.select(index.start, index.stop)
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


def item_counts(batch: Any, batch_size: int) -> list[int]:
    """Items per sample: the counts of every ``Ragged`` field of ``batch``, summed per sample."""
    fields = [leaf for leaf in _fields(batch)[0] if isinstance(leaf, Ragged)]
    totals = [0] * batch_size
    for field in fields:
        for i, count in enumerate(field.counts.tolist()):
            totals[i] += int(count)
    return totals


@dataclass(frozen=True)
class SampleRouting:
    """Which samples of each microbatch every replica of every module holds, for one step.

    ``per``: samples per microbatch. ``balanced``: for each module with ``balance="items"``,
    per microbatch, the sample boundaries ``(0, b1, ..., per)`` of its replicas; every other
    module's replicas take equal shards. The bridges route by it
    (:class:`~lightning_mmpp.engine.comm.MultiModuleCommunicator`), and
    :class:`BatchSplitter` hands each replica its shard by it.
    """

    layout: PipelineLayout
    per: int
    balanced: dict[str, tuple[tuple[int, ...], ...]]

    def bounds(self, module: str, k: int) -> tuple[int, ...]:
        """Sample boundaries of ``module``'s replicas in microbatch ``k``."""
        if module in self.balanced:
            return self.balanced[module][k]
        dp = self.layout.placements[module].dp
        return tuple(range(0, self.per + 1, self.per // dp))

    def shard(self, module: str, replica: int, k: int) -> slice:
        """The samples of microbatch ``k`` that ``module``'s ``replica`` processes."""
        if module not in self.balanced:
            return self.layout.batch_shard(module, replica, self.per)
        bounds = self.balanced[module][k]
        return slice(bounds[replica], bounds[replica + 1])

    def piece_sizes(self, up: str, down: str, replica: int, downstream: bool, k: int) -> list[int]:
        """On the routed bridge ``up -> down`` in microbatch ``k``: the samples ``replica`` (of
        ``up`` when ``downstream``, else of ``down``) shares with each replica of the other end,
        in replica order (what it sends to / receives from each; zeros allowed)."""
        mine, theirs = (up, down) if downstream else (down, up)
        a, b = self.bounds(mine, k), self.bounds(theirs, k)
        lo, hi = a[replica], a[replica + 1]
        return [max(0, min(hi, b[c + 1]) - max(lo, b[c])) for c in range(len(b) - 1)]


def _step_bounds(counts: list[list[int]], parts: int) -> tuple[tuple[int, ...], ...]:
    """The replicas' sample bounds in every microbatch of a step, microbatch by microbatch: the
    contiguous split that makes the heaviest running item total (this microbatch's items plus
    those the replica took in the earlier ones) as light as possible
    (:func:`~lightning_mmpp.core.balance.item_bounds` with offsets), filled from the first replica
    or from the last, whichever is lighter (alternating on ties). Replicas run their microbatches
    one after another, so the step waits for the replica with the most items in all of them."""
    totals = [0] * parts
    out = []
    for k, c in enumerate(counts):
        n = len(c)
        forward = item_bounds(c, parts, totals)
        backward = tuple(n - b for b in reversed(item_bounds(c[::-1], parts, totals[::-1])))
        options = []
        for bounds in (forward, backward) if k % 2 == 0 else (backward, forward):
            loads = [sum(c[a:b]) for a, b in zip(bounds, bounds[1:])]
            options.append((max(t + load for t, load in zip(totals, loads)), bounds, loads))
        _, bounds, loads = min(options, key=lambda option: option[0])  # ties: the first (alternating)
        totals = [t + load for t, load in zip(totals, loads)]
        out.append(bounds)
    return tuple(out)


def sample_routing(layout: PipelineLayout, micro: list[Any], per: int) -> SampleRouting:
    """The :class:`SampleRouting` of one step's microbatches (``per`` samples each).

    Raises:
        PipelineConfigError: a module has ``balance="items"`` but the batch holds no ``Ragged``
            field to count items in.
    """
    balanced: dict[str, tuple[tuple[int, ...], ...]] = {}
    if layout.balanced_modules:
        counts = [item_counts(mb, per) for mb in micro]
        if micro and not any(isinstance(leaf, Ragged) for leaf in _fields(micro[0])[0]):
            names = sorted(layout.balanced_modules)
            raise PipelineConfigError(
                f"ModulePlacement(balance=\"items\") on {names}, but the batch holds no lightning_mmpp.Ragged field: "
                "the items balanced over the replicas are counted from the batch's Ragged fields. Put the "
                "per-sample items in the batch as a Ragged, or use balance=\"samples\"."
            )
        for module in sorted(layout.balanced_modules):
            dp = layout.placements[module].dp
            balanced[module] = _step_bounds(counts, dp)
    return SampleRouting(layout, per, balanced)


class BatchSplitter:
    """Splits each global batch for one rank: microbatches, then this rank's dp shard of them.

    Tracks, per :class:`~lightning_mmpp.core.kinds.StepKind`, the largest batch seen: a smaller
    one is a short last batch and runs with fewer microbatches (:func:`microbatch_count`).
    After :meth:`split`, :attr:`routing` says which samples every replica holds in that step.
    """

    def __init__(self, layout: PipelineLayout, rank: int, num_microbatches: int) -> None:
        self.layout = layout
        self.rank = rank
        self.num_microbatches = num_microbatches
        self.divisor = layout.batch_divisor
        self._largest: dict[StepKind, int] = {}
        self.routing: Optional[SampleRouting] = None
        self._replicas = {slot.module: slot.replica for slot in layout.slots(rank)}  # module -> this rank's replica

    def split(self, batch: Any, kind: StepKind) -> tuple[int, Callable[[str, int], Any]]:
        """``(m, shard)``: the microbatch count, and ``shard(module, k)``, the part of microbatch
        ``k`` this rank's replica of ``module`` processes (what the pipeline hooks receive)."""
        size = batch_size_of(batch)
        largest = self._largest.get(kind, 0)
        m = microbatch_count(size, self.num_microbatches, self.divisor, short=size < largest)
        self._largest[kind] = max(largest, size)
        per = size // m
        # the batch's fields flattened once; microbatch k's are sliced from them when first asked for
        leaves, spec = _fields(batch)
        fields: dict[int, list[Any]] = {}

        def micro_fields(k: int) -> list[Any]:
            got = fields.get(k)
            if got is None:
                got = fields[k] = [_slice_field(leaf, slice(k * per, (k + 1) * per), size) for leaf in leaves]
            return got

        micro = [spec.unflatten(micro_fields(k)) for k in range(m)] if self.layout.balanced_modules else []
        routing = self.routing = sample_routing(self.layout, micro, per)

        def shard(module: str, k: int) -> Any:
            # called per forward (and per loss): one pass over the microbatch's fields, slicing
            # each and unwrapping Unsplit, into a fresh container every call
            assert module in self._replicas, f"rank {self.rank} holds no stage of {module!r}"
            index = routing.shard(module, self._replicas[module], k)
            return spec.unflatten([leaf.value if isinstance(leaf, Unsplit) else _slice_field(leaf, index, per)
                                   for leaf in micro_fields(k)])

        return m, shard
