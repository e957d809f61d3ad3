"""``Ragged``: a variable number of items per sample (images, image tokens), packed along dim 0.

A vision-language batch is ragged: sample ``i`` carries ``n_i >= 0`` images. ``Ragged(values,
counts)`` holds them packed, ``values`` of shape ``[sum(counts), ...]`` (the items of sample 0,
then those of sample 1, ...) and ``counts`` a 1-D integer tensor with one entry per sample
(zeros allowed). Everything that splits or joins batches (microbatches, dp shards, bridges,
their gradients) does so by *sample*: a slice of samples ``[a, b)`` takes ``counts[a:b]`` and the
rows of ``values`` those samples own.

How a model uses it:

* the ``collate_fn`` puts a ``Ragged`` in the batch (:meth:`Ragged.from_list` packs a list of
  per-sample tensors);
* a module's ``pipeline_inputs`` may return one: its layers then receive ``values`` (rows =
  items) and its output, whose dim 0 must equal ``counts.sum()``, travels on as
  ``Ragged(output, counts)`` (:func:`run_ragged`);
* a downstream module's ``pipeline_inputs`` finds ``upstream[name]`` as a ``Ragged`` holding
  exactly its own samples' items, in sample order.

``Ragged`` is a pytree node (children ``values`` and ``counts``), so payload code that maps over
leaves sees two tensors; code that splits or joins by sample treats it as one field.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_mmpp import torch_api as pytree
from lightning_mmpp.errors import PipelineConfigError

__all__ = ["Ragged", "run_ragged"]


class Ragged:
    """Items of variable count per sample, packed along dim 0 (see the module docstring).

    Args:
        values: the packed items, ``[sum(counts), ...]`` (at least one dimension).
        counts: items per sample: a 1-D integer tensor (or a sequence of ints), entries >= 0.

    Raises:
        PipelineConfigError: ``values`` is not a tensor with a dimension, ``counts`` is not a
            1-D integer sequence, a count is negative, or ``counts`` does not sum to
            ``values.shape[0]``.
    """

    __slots__ = ("values", "counts")

    def __init__(self, values: Tensor, counts: Tensor | Sequence[int]) -> None:
        if not isinstance(counts, Tensor):
            try:
                counts = torch.tensor(list(counts), dtype=torch.int64)
            except (TypeError, ValueError):
                raise PipelineConfigError(
                    f"Ragged(counts={counts!r}): counts must be a 1-D sequence of integers, one per sample."
                ) from None
        if not isinstance(values, Tensor) or values.dim() == 0:
            raise PipelineConfigError(
                f"Ragged(values=...): values must be a tensor with the items along dim 0, got "
                f"{type(values).__name__ if not isinstance(values, Tensor) else 'a 0-dim tensor'}; pack the items of "
                "every sample with torch.cat (Ragged.from_list does it)."
            )
        if counts.dim() != 1 or counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
            raise PipelineConfigError(
                f"Ragged(counts=...): counts must be a 1-D integer tensor (one entry per sample), got "
                f"{counts.dtype}{list(counts.shape)}."
            )
        listed = counts.tolist()
        if any(c < 0 for c in listed):
            raise PipelineConfigError(
                f"Ragged(counts={listed}): counts must be >= 0 (sample i holds counts[i] items, zero allowed)."
            )
        if sum(listed) != values.shape[0]:
            raise PipelineConfigError(
                f"Ragged: counts sum to {sum(listed)} but values has {values.shape[0]} rows (shape "
                f"{list(values.shape)}); values must hold exactly the items counted, sample after sample."
            )
        self.values = values
        self.counts = counts

    @classmethod
    def _unchecked(cls, values: Any, counts: Any) -> "Ragged":
        """A ``Ragged`` built without checks (pytree rebuilds: gradients, metadata, ``None`` leaves)."""
        obj = cls.__new__(cls)
        obj.values = values
        obj.counts = counts
        return obj

    @classmethod
    def from_list(cls, items: Sequence[Tensor], like: Optional[Tensor] = None) -> "Ragged":
        """Pack per-sample tensors (``items[i]`` of shape ``[n_i, ...]``, ``n_i >= 0``).

        ``like``: a tensor of the item shape (``[0, ...]`` is fine) for when every sample is empty
        and ``items`` gives no trailing shape (a ``[0, *item shape]`` tensor in ``items`` works too).
        """
        tensors = list(items)
        counts = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64)
        if tensors:
            return cls(torch.cat(tensors), counts)
        if like is None:
            raise PipelineConfigError("Ragged.from_list([]) needs like=<a tensor of the item shape>.")
        return cls(like[:0], counts)

    def to(self, *args: Any, **kwargs: Any) -> "Ragged":
        """``values`` and ``counts`` moved like ``Tensor.to`` (a device moves both; a dtype converts
        ``values`` only), so Lightning's batch transfer moves a ``Ragged`` to the device."""
        counts_args = [a.device if isinstance(a, Tensor) else a for a in args if not isinstance(a, torch.dtype)]
        counts_kwargs = {k: v for k, v in kwargs.items() if k != "dtype"}
        return Ragged._unchecked(self.values.to(*args, **kwargs), self.counts.to(*counts_args, **counts_kwargs))

    def pin_memory(self) -> "Ragged":
        """Both tensors in pinned memory (what ``DataLoader(pin_memory=True)`` calls)."""
        return Ragged._unchecked(self.values.pin_memory(), self.counts.pin_memory())

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (DataLoader workers) through the checked constructor
        return (Ragged, (self.values, self.counts))

    @property
    def num_samples(self) -> int:
        """The number of samples (``len(counts)``)."""
        return int(self.counts.shape[0])

    def offsets(self) -> list[int]:
        """Row offsets: sample ``i``'s items are ``values[offsets[i]:offsets[i + 1]]`` (one host read)."""
        out = [0]
        for c in self.counts.tolist():
            out.append(out[-1] + int(c))
        return out

    def select(self, start: int, stop: int, offsets: Optional[list[int]] = None) -> "Ragged":
        """Samples ``start .. stop-1`` (views, no copy)."""
        rows = self.offsets() if offsets is None else offsets
        return Ragged._unchecked(self.values[rows[start] : rows[stop]], self.counts[start:stop])

    def split(self, sizes: Sequence[int]) -> list["Ragged"]:
        """Consecutive pieces of ``sizes[j]`` samples each (``sum(sizes) == num_samples``)."""
        rows = self.offsets()
        pieces, start = [], 0
        for size in sizes:
            pieces.append(self.select(start, start + size, rows))
            start += size
        return pieces

    @staticmethod
    def cat(pieces: Sequence["Ragged"]) -> "Ragged":
        """The samples of ``pieces`` one after another (the inverse of :meth:`split`)."""
        return Ragged._unchecked(
            torch.cat([p.values for p in pieces]), torch.cat([p.counts for p in pieces])
        )

    def items(self) -> list[Tensor]:
        """The items of each sample: ``values`` cut by ``counts`` (views)."""
        rows = self.offsets()
        return [self.values[rows[i] : rows[i + 1]] for i in range(len(rows) - 1)]

    def __repr__(self) -> str:
        shape = list(self.values.shape) if isinstance(self.values, Tensor) else self.values
        counts = self.counts.tolist() if isinstance(self.counts, Tensor) else self.counts
        return f"Ragged(values={shape}, counts={counts})"


def _flatten(r: Ragged) -> tuple[list[Any], None]:
    return [r.values, r.counts], None


def _unflatten(children: Any, _context: Any) -> Ragged:
    values, counts = children
    return Ragged._unchecked(values, counts)


def _flatten_with_keys(r: Ragged) -> tuple[list[tuple[Any, Any]], None]:
    return [(pytree.GetAttrKey("values"), r.values), (pytree.GetAttrKey("counts"), r.counts)], None


pytree.register_pytree_node(
    Ragged, _flatten, _unflatten, serialized_type_name="lightning_mmpp.Ragged",
    flatten_with_keys_fn=_flatten_with_keys,
)


def run_ragged(fn: Callable[[Any], Any], x: Any, where: str) -> Any:
    """``fn(x)``, or for a :class:`Ragged` ``x``, ``Ragged(fn(x.values), x.counts)``: a module's
    layers see the packed items, and the output travels on with its counts.

    Raises:
        PipelineConfigError: the output for a ragged input is not a tensor whose dim 0 equals
            ``counts.sum()`` (``where`` names the module and stage).
    """
    if not isinstance(x, Ragged):
        return fn(x)
    out = fn(x.values)
    if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] != x.values.shape[0]:
        got = f"shape {list(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
        raise PipelineConfigError(
            f"{where}: the input is Ragged with {x.values.shape[0]} items, so the output must be a tensor with one "
            f"row per item (dim 0 = {x.values.shape[0]}), got {got}. Keep one row per item (pool inside the item, not "
            "across items), or return a plain tensor from pipeline_inputs."
        )
    return Ragged._unchecked(out, x.counts)
