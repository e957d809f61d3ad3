"""Payloads: the pytrees of tensors that cross stage and module boundaries.

A payload is a ``Tensor`` or any nesting of ``dict`` / ``list`` / ``tuple`` (namedtuples too)
whose leaves are tensors or ``None``. This module knows nothing about torch.distributed; it
describes, packs, splits and concatenates payloads for :mod:`lightning_mmpp.engine.comm`.

* :class:`PayloadSpec` is the metadata of a payload: its tree structure plus, per leaf, the
  shape, dtype and ``requires_grad`` flag (``None`` for a ``None`` leaf). It is hashable,
  cheap to compare, and serialisable with :meth:`PayloadSpec.to_bytes` /
  :meth:`PayloadSpec.from_bytes`.
* :func:`pack` writes the tensor leaves of one message into a single contiguous ``uint8``
  buffer: a 16-byte header (int64 control flag, int64 message tag) followed by each leaf's
  bytes at an offset aligned to 16 bytes, so that :func:`unpack` can ``view`` each leaf back
  in its own dtype without copying. :class:`BufferLayout` says where each leaf goes.
* :func:`split_payload` / :func:`concat_payloads` cut or join a payload by sample: every tensor
  leaf along a batch dimension, every :class:`~lightning_mmpp.model.ragged.Ragged` by its counts
  (what the bridges between modules of different dp sizes do).

``None`` leaves are always treated as leaves (``is_leaf=None``), whatever the installed
torch's pytree registry does with ``None``, so a gradient pytree with ``None`` at some leaves
has the same structure as the payload it belongs to.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_mmpp import torch_api as pytree
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.model.ragged import Ragged

__all__ = [
    "ALIGNMENT",
    "FLAG_DATA",
    "FLAG_STALE",
    "HEADER_BYTES",
    "BufferLayout",
    "DIRECT_LEAF_BYTES",
    "PayloadSpec",
    "TensorMeta",
    "concat_payloads",
    "flatten_payload",
    "leaf_batch_dims",
    "pack",
    "pack_header",
    "read_header",
    "split_payload",
    "unpack",
    "WireLayout",
    "direct_leaf",
    "wire_tensor",
]

HEADER_BYTES = 16
"""Bytes before the first leaf of a packed buffer: int64 control flag, int64 message tag."""

ALIGNMENT = 16
"""Byte alignment of every leaf inside a packed buffer (enough for any torch dtype)."""

FLAG_DATA = 0
"""Header flag: the buffer holds data laid out by the spec both sides know."""

FLAG_STALE = 1
"""Header flag: the metadata changed; discard this buffer, the new spec and data follow."""


def _is_none(node: Any) -> bool:
    return node is None


def _align(offset: int) -> int:
    return (offset + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _path_str(path: tuple[Any, ...]) -> str:
    return pytree.keystr(path) if path else "(the payload itself)"


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and ``requires_grad`` of one tensor leaf."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class BufferLayout:
    """Where the selected tensor leaves of a spec sit in a packed buffer.

    Attributes:
        indices: the leaf indices (into :attr:`PayloadSpec.leaves`) stored in the buffer, in order.
        metas: their :class:`TensorMeta`.
        offsets: byte offset of each of them (multiples of :data:`ALIGNMENT`).
        nbytes: total size of the buffer, header included.
    """

    indices: tuple[int, ...]
    metas: tuple[TensorMeta, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def build(cls, indices: Sequence[int], metas: Sequence[TensorMeta]) -> "BufferLayout":
        offsets: list[int] = []
        cursor = HEADER_BYTES
        for meta in metas:
            cursor = _align(cursor)
            offsets.append(cursor)
            cursor += meta.nbytes
        return cls(tuple(indices), tuple(metas), tuple(offsets), cursor)


DIRECT_LEAF_BYTES = 1 << 20
"""A tensor leaf of at least this many bytes travels as its own transfer, without a copy into
the packed buffer (see :class:`WireLayout`); smaller leaves are packed together."""


@dataclass(frozen=True)
class WireLayout:
    """How one message travels: its small leaves packed into one buffer (``packed``, header
    included), each large leaf (at least :data:`DIRECT_LEAF_BYTES`) as a transfer of its own,
    straight from / into the tensor's memory (``direct_indices`` / ``direct_metas``, in leaf
    order, after the packed buffer). Copying a large leaf into a packed buffer costs a pass over
    its bytes on the sender's critical path; one more transfer costs a fixed few tens of us.
    """

    packed: BufferLayout
    direct_indices: tuple[int, ...]
    direct_metas: tuple[TensorMeta, ...]

    @classmethod
    def build(cls, indices: Sequence[int], metas: Sequence[TensorMeta],
              direct_bytes: Optional[int] = None) -> "WireLayout":
        """``direct_bytes``: the threshold (default :data:`DIRECT_LEAF_BYTES`); both ends of a
        channel must use the same."""
        if direct_bytes is None:
            direct_bytes = DIRECT_LEAF_BYTES
        packed = [(i, m) for i, m in zip(indices, metas) if m.nbytes < direct_bytes]
        direct = [(i, m) for i, m in zip(indices, metas) if m.nbytes >= direct_bytes]
        return cls(BufferLayout.build([i for i, _ in packed], [m for _, m in packed]),
                   tuple(i for i, _ in direct), tuple(m for _, m in direct))

    @property
    def sizes(self) -> list[int]:
        """Bytes of each transfer of the message: the packed buffer, then every direct leaf."""
        return [self.packed.nbytes, *(meta.nbytes for meta in self.direct_metas)]


def wire_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor``'s bytes as a 1-d ``uint8`` tensor on ``device`` to send as a direct leaf: a
    view of its memory when it is contiguous and on ``device`` (no copy), else one copy."""
    flat = tensor.detach().to(device).contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def direct_leaf(buffer: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """The leaf of ``meta`` received as a direct transfer into the ``uint8`` ``buffer`` (a view)."""
    return buffer.view(meta.dtype).view(meta.shape)


@dataclass(frozen=True)
class PayloadSpec:
    """The metadata of a payload: tree structure plus per-leaf :class:`TensorMeta` (or ``None``).

    Two payloads with equal specs pack into buffers of the same layout. Specs are frozen,
    hashable (the hash is computed once) and serialisable with :meth:`to_bytes`.
    """

    treespec: pytree.TreeSpec
    leaves: tuple[Optional[TensorMeta], ...]

    def __hash__(self) -> int:
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.treespec, self.leaves))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, PayloadSpec):
            return NotImplemented
        return hash(self) == hash(other) and self.leaves == other.leaves and self.treespec == other.treespec

    def __reduce__(self) -> tuple[Any, ...]:
        return (PayloadSpec.from_bytes, (self.to_bytes(),))

    @property
    def num_leaves(self) -> int:
        return len(self.leaves)

    @functools.cached_property
    def tensor_indices(self) -> tuple[int, ...]:
        """Indices of the leaves that are tensors (not ``None``)."""
        return tuple(i for i, meta in enumerate(self.leaves) if meta is not None)

    @functools.cached_property
    def grad_indices(self) -> tuple[int, ...]:
        """Indices of the tensor leaves that require grad (the ones whose gradient travels back)."""
        return tuple(i for i, meta in enumerate(self.leaves) if meta is not None and meta.requires_grad)

    @property
    def requires_grad(self) -> bool:
        """Whether any leaf requires grad (i.e. whether a backward message exists)."""
        return bool(self.grad_indices)

    @functools.cached_property
    def data_layout(self) -> BufferLayout:
        """Layout of a forward message: every tensor leaf."""
        return BufferLayout.build(self.tensor_indices, [self.leaves[i] for i in self.tensor_indices])

    @functools.cached_property
    def grad_layout(self) -> BufferLayout:
        """Layout of a backward message: the gradients of the leaves that require grad."""
        return BufferLayout.build(self.grad_indices, [self.leaves[i] for i in self.grad_indices])

    @functools.cached_property
    def single_tensor(self) -> Optional[TensorMeta]:
        """The leaf's :class:`TensorMeta` when the payload is one tensor (no container), else ``None``."""
        return self.leaves[0] if self.treespec.is_leaf() and self.leaves[0] is not None else None

    def matches_tensor(self, tensor: torch.Tensor) -> bool:
        """Whether a payload that is the single (strided) ``tensor`` has exactly this spec: the
        steady-state check of a one-tensor message without flattening it."""
        meta = self.single_tensor
        return (meta is not None and tensor.layout == torch.strided and tensor.dtype == meta.dtype
                and tensor.requires_grad == meta.requires_grad and tuple(tensor.shape) == meta.shape)

    def wire(self, grad: bool, direct_bytes: Optional[int] = None) -> WireLayout:
        """How a forward (``grad=False``) or backward message of this spec travels: leaves of at
        least ``direct_bytes`` (default :data:`DIRECT_LEAF_BYTES`) direct, see :class:`WireLayout`.
        Computed once per spec and threshold."""
        if direct_bytes is None:
            direct_bytes = DIRECT_LEAF_BYTES
        cache: dict[tuple[bool, int], WireLayout] = self.__dict__.setdefault("_wires", {})
        wire = cache.get((grad, direct_bytes))
        if wire is None:
            indices = self.grad_indices if grad else self.tensor_indices
            wire = WireLayout.build(indices, [self.leaves[i] for i in indices], direct_bytes)  # type: ignore[misc]
            cache[(grad, direct_bytes)] = wire
        return wire

    def unflatten(self, leaves: Sequence[Any]) -> Any:
        """Rebuild a payload of this structure from its leaves (in flattening order)."""
        return pytree.tree_unflatten(list(leaves), self.treespec)

    def to_bytes(self) -> bytes:
        """Serialise the spec (tree structure, shapes, dtype names, requires_grad flags)."""
        plain = [
            None if meta is None else (meta.shape, str(meta.dtype).removeprefix("torch."), meta.requires_grad)
            for meta in self.leaves
        ]
        return pickle.dumps((_encode_treespec(self.treespec), plain), protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def from_bytes(cls, data: bytes) -> "PayloadSpec":
        """Inverse of :meth:`to_bytes`."""
        encoded, plain = pickle.loads(data)
        treespec = _decode_treespec(encoded)
        leaves = tuple(
            None if item is None else TensorMeta(tuple(item[0]), getattr(torch, item[1]), bool(item[2]))
            for item in plain
        )
        return cls(treespec, leaves)

    def describe(self) -> str:
        """A one-line description: ``<path>: dtype[shape]`` per leaf."""
        paths = _leaf_paths(self.unflatten([None] * self.num_leaves))
        parts = []
        for path, meta in zip(paths, self.leaves):
            if meta is None:
                parts.append(f"{path}: None")
            else:
                grad = ", grad" if meta.requires_grad else ""
                parts.append(f"{path}: {str(meta.dtype).removeprefix('torch.')}{list(meta.shape)}{grad}")
        return "{" + "; ".join(parts) + "}"


def _encode_treespec(spec: pytree.TreeSpec) -> Any:
    """A plain nested-tuple description of a TreeSpec: ``None`` for a leaf, else (type, context, children)."""
    if spec.is_leaf():
        return None
    children = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs
    return (spec.type, spec.context, [_encode_treespec(child) for child in children])


def _decode_treespec(encoded: Any) -> pytree.TreeSpec:
    if encoded is None:
        return pytree.treespec_leaf() if hasattr(pytree, "treespec_leaf") else pytree.LeafSpec()
    node_type, context, children = encoded
    return pytree.TreeSpec(node_type, context, [_decode_treespec(child) for child in children])


def _leaf_paths(payload: Any) -> list[str]:
    with_path, _ = pytree.tree_flatten_with_path(payload, is_leaf=_is_none)
    return [_path_str(path) for path, _ in with_path]


def _bad_leaf_error(payload: Any, index: int, where: str) -> PipelineConfigError:
    with_path, _ = pytree.tree_flatten_with_path(payload, is_leaf=_is_none)
    path, leaf = with_path[index]
    if isinstance(leaf, torch.Tensor):
        what = f"a {leaf.layout} tensor; only strided (dense) tensors can be sent"
    else:
        text = repr(leaf)
        what = f"a {type(leaf).__name__} ({text[:60] + '...' if len(text) > 60 else text})"
    return PipelineConfigError(
        f"{where}: the leaf at {_path_str(path)} is {what}. Payloads between stages and modules must be "
        "tensors, None, or dicts/lists/tuples of them; convert the value to a tensor, or keep it out of "
        "the layer's output (e.g. recompute it from the batch in pipeline_inputs)."
    )


def flatten_payload(payload: Any, where: str) -> tuple[list[Optional[torch.Tensor]], PayloadSpec]:
    """Flatten ``payload`` into its leaves and compute its :class:`PayloadSpec`.

    Args:
        payload: a tensor, ``None``, or a dict/list/tuple nesting of them.
        where: what the payload is, for error messages (e.g. ``"module 'vision' stage 0 output"``).

    Raises:
        PipelineConfigError: a leaf is neither a tensor nor ``None``; the message names
            ``where`` and the leaf's pytree path.
    """
    leaves, treespec = pytree.tree_flatten(payload, is_leaf=_is_none)
    metas: list[Optional[TensorMeta]] = []
    for index, leaf in enumerate(leaves):
        if leaf is None:
            metas.append(None)
        elif isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided:
            metas.append(TensorMeta(tuple(leaf.shape), leaf.dtype, leaf.requires_grad))
        else:
            raise _bad_leaf_error(payload, index, where)
    return leaves, PayloadSpec(treespec, tuple(metas))


# --- packing -------------------------------------------------------------------------------


def pack_header(nbytes: int, device: torch.device, flag: int, tag: int) -> torch.Tensor:
    """A buffer of ``nbytes`` bytes whose header says ``flag`` / ``tag``; the body is not written."""
    if nbytes < HEADER_BYTES:
        raise ValueError(f"a packed buffer holds at least the {HEADER_BYTES}-byte header, got {nbytes}")
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    header = buffer[:HEADER_BYTES].view(torch.int64)
    header[0] = flag
    header[1] = tag
    return buffer


def pack(
    tensors: Sequence[torch.Tensor],
    layout: BufferLayout,
    device: torch.device,
    flag: int = FLAG_DATA,
    tag: int = 0,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Copy ``tensors`` (one per entry of ``layout``) into one contiguous ``uint8`` buffer.

    Each tensor must have the shape and dtype its :class:`TensorMeta` says. Non-contiguous
    tensors and tensors on another device are fine (one strided copy each). ``out``: a buffer
    of exactly ``layout.nbytes`` bytes on ``device`` to write into instead of a new one (a fresh
    large buffer costs page faults on every use).
    """
    if len(tensors) != len(layout.metas):
        raise ValueError(f"pack got {len(tensors)} tensors for a layout of {len(layout.metas)} leaves")
    if out is not None and out.dtype == torch.uint8 and out.dim() == 1 and out.numel() == layout.nbytes \
            and out.device == torch.device(device):
        buffer = out
        header = buffer[:HEADER_BYTES].view(torch.int64)
        header[0] = flag
        header[1] = tag
    else:
        buffer = pack_header(layout.nbytes, device, flag, tag)
    for tensor, meta, offset in zip(tensors, layout.metas, layout.offsets):
        if tuple(tensor.shape) != meta.shape or tensor.dtype != meta.dtype:
            raise ValueError(
                f"pack: tensor {tensor.dtype}{list(tensor.shape)} does not match its layout entry "
                f"{meta.dtype}{list(meta.shape)}"
            )
        nbytes = meta.nbytes
        if nbytes:
            buffer[offset : offset + nbytes].view(meta.dtype).view(meta.shape).copy_(tensor.detach())
    return buffer


def read_header(buffer: torch.Tensor) -> tuple[int, int]:
    """``(flag, tag)`` of a packed buffer (synchronises with the device on CUDA)."""
    flag, tag = buffer[:HEADER_BYTES].view(torch.int64).tolist()
    return int(flag), int(tag)


def unpack(buffer: torch.Tensor, layout: BufferLayout, checked: bool = True) -> list[torch.Tensor]:
    """The tensors packed in ``buffer``: views into it, in ``layout`` order, ``requires_grad=False``.

    ``checked=False``: ``buffer`` is known to be a 1-d uint8 buffer of ``layout.nbytes`` bytes
    (the communicator's own receive buffer of that layout), not checked again."""
    if checked and (buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != layout.nbytes):
        raise ValueError(
            f"unpack: expected a 1-d uint8 buffer of {layout.nbytes} bytes, got {buffer.dtype}{list(buffer.shape)}"
        )
    tensors: list[torch.Tensor] = []
    for meta, offset in zip(layout.metas, layout.offsets):
        nbytes = meta.nbytes
        if nbytes:
            tensors.append(buffer[offset : offset + nbytes].view(meta.dtype).view(meta.shape))
        else:
            tensors.append(torch.empty(meta.shape, dtype=meta.dtype, device=buffer.device))
    return tensors


# --- split / concatenate along the batch dim --------------------------------------------------


def _is_none_or_ragged(node: Any) -> bool:
    return node is None or isinstance(node, Ragged)


def _fields_of(payload: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """The payload's leaves with every :class:`Ragged` kept whole (it splits and joins by sample)."""
    return pytree.tree_flatten(payload, is_leaf=_is_none_or_ragged)


def leaf_batch_dims(spec: PayloadSpec, dim: int) -> list[int]:
    """The batch dimension of each leaf of ``spec``: 0 for the parts of a :class:`Ragged`
    (``values`` and ``counts`` are packed by sample along dim 0), ``dim`` for the others."""
    template = spec.unflatten(list(range(spec.num_leaves)))
    fields, _ = _fields_of(template)
    dims = [dim] * spec.num_leaves
    for field in fields:
        if isinstance(field, Ragged):
            for index in (field.values, field.counts):
                if isinstance(index, int):
                    dims[index] = 0
    return dims


def split_payload(
    payload: Any, num_chunks: int, dim: int = 0, context: str = "", sizes: Optional[Sequence[int]] = None
) -> list[Any]:
    """Split ``payload`` by sample into ``num_chunks`` contiguous chunks (equal, or of ``sizes`` samples).

    A tensor leaf is cut along ``dim`` (its rows are samples); a :class:`Ragged` is cut by
    sample, each chunk taking its samples' counts and item rows. Chunks are views, no copies;
    ``None`` leaves are ``None`` in every chunk; a chunk of zero samples holds empty tensors.

    Args:
        payload: the payload to split.
        num_chunks: number of chunks (``1`` returns ``[payload]``).
        dim: the batch dimension (negative values count from the end of each leaf's shape).
        context: appended to error messages, e.g. ``"for fan-out from 'vision' (dp=1) to 'llm' (dp=4)"``.
        sizes: samples per chunk (``num_chunks`` entries summing to the batch); ``None``: equal chunks.

    Raises:
        PipelineConfigError: a leaf is 0-dim, has no dimension ``dim``, or its size along
            ``dim`` is not divisible by ``num_chunks`` (or does not match ``sizes``).
    """
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be an integer >= 1, got {num_chunks!r}")
    if sizes is not None and len(sizes) != num_chunks:
        raise ValueError(f"split_payload got {len(sizes)} sizes for {num_chunks} chunks")
    suffix = f" {context}" if context else ""
    flatten_payload(payload, where=f"payload to split{suffix}")  # validates every leaf
    if num_chunks == 1:
        return [payload]
    fields, spec = _fields_of(payload)
    chunked: list[list[Any]] = [[] for _ in range(num_chunks)]
    for index, leaf in enumerate(fields):
        if leaf is None:
            for chunk in chunked:
                chunk.append(None)
            continue
        ragged = isinstance(leaf, Ragged)
        total = leaf.num_samples if ragged else None
        ndim = leaf.dim() if not ragged else 1
        problem = ""
        if not ragged and ndim == 0:
            problem = "is a 0-dim tensor and has no batch dim"
        elif not ragged and not -ndim <= dim < ndim:
            problem = f"has shape {list(leaf.shape)} and no dim {dim}"
        else:
            total = total if ragged else int(leaf.shape[dim])
            if sizes is None and total % num_chunks:
                problem = f"size {total}"
            elif sizes is not None and sum(sizes) != total:
                problem = f"size {total} (the bridge routes {sum(sizes)} samples)"
        if problem:
            paths = _leaf_paths(spec.unflatten([None] * spec.num_leaves))
            what = ("the samples" if ragged else "the batch dim") + f" of {problem}"
            if problem.startswith("size"):
                head = f"cannot split {what} of leaf {paths[index]} into {num_chunks} chunks"
            else:
                head = f"leaf {paths[index]} {problem} to split into {num_chunks} chunks"
            raise PipelineConfigError(
                f"{head}{suffix}. Every tensor in a module's output must carry the batch along its "
                f"batch_dim ({dim}): make the microbatch size divisible by the largest dp, set "
                "ModulePlacement(batch_dim=...) to the batch dimension of this output, or keep "
                "per-batch scalars out of the output."
            )
        assert total is not None
        counts = list(sizes) if sizes is not None else [total // num_chunks] * num_chunks
        if ragged:
            for chunk, piece in zip(chunked, leaf.split(counts)):
                chunk.append(piece)
            continue
        start = 0
        for chunk, size in zip(chunked, counts):
            chunk.append(leaf.narrow(dim, start, size))
            start += size
    return [spec.unflatten(chunk) for chunk in chunked]


def concat_payloads(payloads: Sequence[Any], dim: int = 0, context: str = "") -> Any:
    """Concatenate payloads of the same structure leaf by leaf along ``dim`` (inverse of :func:`split_payload`).

    Args:
        payloads: the payloads, in chunk order.
        dim: the batch dimension.
        context: appended to error messages (which replicas / modules the payloads came from).

    Raises:
        PipelineConfigError: the payloads differ in structure, a leaf is ``None`` in some
            and a tensor in others, or the leaves do not concatenate (other dims differ).
    """
    if not payloads:
        raise ValueError("concat_payloads needs at least one payload")
    suffix = f" {context}" if context else ""
    flat = [flatten_payload(p, where=f"payload {i} to concatenate{suffix}") for i, p in enumerate(payloads)]
    if len(payloads) == 1:
        return payloads[0]
    _, first_spec = flat[0]
    for i, (_, spec) in enumerate(flat[1:], start=1):
        if spec.treespec != first_spec.treespec:
            raise PipelineConfigError(
                f"cannot concatenate payloads of different structure{suffix}: payload 0 is "
                f"{first_spec.describe()} but payload {i} is {spec.describe()}. Every replica of a "
                "module must return outputs of the same structure (same keys, same nesting, None at "
                "the same places)."
            )
    fields = [_fields_of(p)[0] for p in payloads]
    _, field_spec = _fields_of(payloads[0])
    joined: list[Any] = []
    for index, first in enumerate(fields[0]):
        if isinstance(first, Ragged):  # by sample: the items and the counts, one piece after another
            pieces = [f[index] for f in fields]
            joined.append(Ragged._unchecked(
                _concat_column([p.values for p in pieces], 0, first_spec, suffix, payloads),
                _concat_column([p.counts for p in pieces], 0, first_spec, suffix, payloads),
            ))
        else:
            joined.append(_concat_column([f[index] for f in fields], dim, first_spec, suffix, payloads))
    return field_spec.unflatten(joined)


def _concat_column(
    column: list[Optional[torch.Tensor]], dim: int, first_spec: PayloadSpec, suffix: str, payloads: Sequence[Any]
) -> Optional[torch.Tensor]:
    """One leaf of every payload, concatenated along ``dim`` (``None`` if it is ``None`` in all)."""
    if all(leaf is None for leaf in column):
        return None
    problem = ""
    if any(leaf is None for leaf in column):
        problem = "is None in some payloads and a tensor in others"
    elif any(leaf.dim() == 0 for leaf in column):
        problem = "is a 0-dim tensor and has no batch dim"
    elif len({leaf.dtype for leaf in column}) > 1:
        problem = f"has different dtypes {[str(leaf.dtype) for leaf in column]}"
    else:
        try:
            return torch.cat(column, dim=dim)
        except (RuntimeError, IndexError) as err:
            shapes = [list(leaf.shape) for leaf in column]
            problem = f"has shapes/dtypes that do not concatenate along dim {dim}: {shapes} ({err})"
    owner = next(j for j, leaf in enumerate(column) if leaf is not None)
    leaves = flatten_payload(payloads[owner], "payload")[0]
    index = next(i for i, leaf in enumerate(leaves) if leaf is column[owner])
    path = _leaf_paths(first_spec.unflatten([None] * first_spec.num_leaves))[index]
    raise PipelineConfigError(
        f"cannot concatenate payloads{suffix}: leaf {path} {problem}. Every replica must "
        "return the same structure with tensors that differ only along the batch dim."
    )
