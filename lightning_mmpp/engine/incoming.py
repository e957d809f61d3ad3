"""Messages on their way in: the receive side of the communicator's wire protocol.

:class:`MultiModuleCommunicator <lightning_mmpp.engine.comm.MultiModuleCommunicator>` posts the
first part of every message it receives as an :class:`Incoming` (a :class:`ForwardIncoming`,
whose spec may change and bring further parts, or a :class:`BackwardIncoming`, whose layout
both ends know), gathered per peer and post into a :class:`ReceiveGroup`. On CPU the received
bytes land in pooled memory (:class:`ReceiveBuffers`, :class:`LentBuffer`) that is lent again
once nothing derived from it exists. The protocol itself (parts, tags, ordering) is described
in :mod:`lightning_mmpp.engine.comm`.
"""

from __future__ import annotations

import enum
import functools
import struct
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_mmpp.core.actions import Direction, MessageKey
from lightning_mmpp.errors import ExchangeMismatchError
from lightning_mmpp.engine.payload import (
    FLAG_DATA,
    FLAG_STALE,
    HEADER_BYTES,
    PayloadSpec,
    WireLayout,
    direct_leaf,
    unpack,
)

__all__ = [
    "BackwardIncoming",
    "Channel",
    "ForwardIncoming",
    "ForwardPart",
    "Incoming",
    "LentBuffer",
    "ReceiveBuffers",
    "ReceiveGroup",
    "buffer_slot",
    "channel_of",
    "describe_key",
    "message_tag",
]


@functools.lru_cache(maxsize=8192)
def message_tag(key: MessageKey) -> int:
    """A stable 32-bit tag of ``key``, written into the header of every packed buffer of it
    (cached: every message of a step asks for its tag on both ends)."""
    text = f"{key.direction.value}|{key.src_module}|{key.dst_module}|{key.microbatch}"
    if key.src_chunk or key.dst_chunk:  # virtual stages: two chunks of a module share a rank pair
        text += f"|{key.src_chunk}|{key.dst_chunk}"
    return zlib.crc32(text.encode())


def describe_key(key: MessageKey) -> str:
    """``key`` as error messages name it: ``forward a->b mb3``."""
    return f"{key.direction.value} {key.src_module}{key.direction.arrow}{key.dst_module} mb{key.microbatch}"


# the packed header (flag, tag) as the sender's int64 view of the buffer writes it
_HEADER = struct.Struct("=qq")
assert _HEADER.size == HEADER_BYTES


# (src rank, dst rank, src module, dst module, src chunk, dst chunk, training step): a forward
# channel; its spec is cached at both ends (the chunks tell apart the stages of a module with
# virtual stages that one rank pair connects). Training and forward-only steps keep apart caches: a training step's
# activations require grad, an evaluation step's do not, so alternating steps do not re-send
# specs, and a ``static_specs`` promise holds per kind of step.
Channel = tuple[int, int, str, str, int, int, bool]


def channel_of(sender: int, receiver: int, key: MessageKey, training: bool) -> Channel:
    """The forward channel ``key`` travels on from ``sender`` to ``receiver`` in a training or a
    forward-only step."""
    return (sender, receiver, key.src_module, key.dst_module, key.src_chunk, key.dst_chunk, training)


class Incoming:
    """A message from a remote peer, received part by part (a first part, then any further parts)."""

    peer: int
    done: bool

    def __init__(self, key: MessageKey, peer: int, order: tuple[Any, ...], direct_bytes: int) -> None:
        self.key = key
        self.peer = peer
        self.order = order
        self.direct_bytes = direct_bytes  # the communicator's direct_leaf_bytes
        self.buffer: Optional[torch.Tensor] = None
        self.lent: Optional[LentBuffer] = None  # the pooled memory of a data part's packed buffer
        self.direct: list[torch.Tensor] = []  # the direct leaves' buffers of a data part
        # the data part's leaves (views into its buffers), made when its buffers are: before the
        # wait, so the take that follows the wait only reads the header
        self.received: Optional[list[Optional[torch.Tensor]]] = None
        self.done = False

    def next_buffers(self, device: torch.device, pool: "ReceiveBuffers") -> list[torch.Tensor]:
        """The buffers of the next part, in the order the sender sends them."""
        raise NotImplementedError

    def data_buffers(self, spec: PayloadSpec, wire: WireLayout, device: torch.device,
                     pool: "ReceiveBuffers") -> list[torch.Tensor]:
        """A data part's buffers: the packed one, then one per direct leaf (each pooled by its
        own slot of the channel). The leaves the part will hold (:meth:`leaves`) are made here,
        as views, while nothing waits for them yet."""
        slot = self.channel_slot
        self.buffer, self.lent = pool.get_lent(slot, wire.packed.nbytes, device)
        self.direct = [pool.get((*slot, index), meta.nbytes, device)
                       for index, meta in zip(wire.direct_indices, wire.direct_metas)]
        leaves: list[Optional[torch.Tensor]] = [None] * spec.num_leaves
        for index, tensor in zip(wire.packed.indices, unpack(self.buffer, wire.packed, checked=False)):
            leaves[index] = tensor
        for index, meta, buffer in zip(wire.direct_indices, wire.direct_metas, self.direct):
            leaves[index] = direct_leaf(buffer, meta)
        self.received = leaves
        return [self.buffer, *self.direct]

    def leaves(self) -> list[Optional[torch.Tensor]]:
        """The received data part's leaves (views into its buffers), ``None`` where nothing travels."""
        assert self.buffer is not None and self.received is not None, "leaves() of a data part that was not posted"
        return self.received

    def steady(self) -> bool:
        """Whether the received buffer is the whole message when the spec did not change."""
        return False

    @property
    def channel_slot(self) -> tuple[int, Direction, str, str, int, int]:
        """The channel whose receive buffers this reuses."""
        return buffer_slot(self.peer, self.key)

    def scalars(self) -> Optional[torch.Tensor]:
        """The int64 values of the received buffer the state machine needs on the host."""
        return None

    def host_header(self) -> Optional[list[int]]:
        """The values :meth:`scalars` would give, read from pooled host memory without a tensor
        op; ``None`` where they must come from :meth:`scalars`."""
        return None

    def advance(self, values: list[int], rank: int) -> Optional[PayloadSpec]:
        """Take the received part's ``values`` (see :meth:`scalars`) on ``rank``; returns the spec
        of the channel when this part completed a new one."""
        raise NotImplementedError

    def check_tag(self, tag: int, rank: int) -> None:
        if tag != message_tag(self.key):
            raise ExchangeMismatchError(
                f"rank {rank} expected '{describe_key(self.key)}' from rank {self.peer} but received a buffer with "
                f"tag {tag} (expected {message_tag(self.key)}): the two ranks issued their exchanges with different "
                "messages or in a different order. Every exchange's messages between two ranks must be "
                "matched by one exchange on the peer, in the same order."
            )


class ForwardPart(enum.Enum):
    """What a forward message's next received buffer is (see the wire protocol above)."""

    DATA = "data"  # a data buffer of the cached spec's size (or a stale flag)
    LENGTH = "length"  # the int64 length of the serialised spec
    SPEC = "spec"  # the serialised spec
    NEW_DATA = "new_data"  # the data buffer of the new spec's size


class ForwardIncoming(Incoming):
    """Parts: ``DATA`` (cached spec) -> [flag stale] -> ``LENGTH`` -> ``SPEC`` -> ``NEW_DATA``."""

    def __init__(self, key: MessageKey, peer: int, order: tuple[Any, ...], direct_bytes: int, channel: Channel,
                 cached: Optional[PayloadSpec]) -> None:
        super().__init__(key, peer, order, direct_bytes)
        self.channel = channel
        self.spec = cached
        self.part = ForwardPart.DATA if cached is not None else ForwardPart.LENGTH
        self.spec_len = 0

    def next_buffers(self, device: torch.device, pool: "ReceiveBuffers") -> list[torch.Tensor]:
        if self.part in (ForwardPart.DATA, ForwardPart.NEW_DATA):
            assert self.spec is not None
            return self.data_buffers(self.spec, self.spec.wire(False, self.direct_bytes), device, pool)
        self.direct, self.lent, self.received = [], None, None
        if self.part is ForwardPart.LENGTH:
            self.buffer = torch.empty(1, dtype=torch.int64, device=device)
        else:
            self.buffer = torch.empty(self.spec_len, dtype=torch.uint8, device=device)
        return [self.buffer]

    def steady(self) -> bool:
        return self.part is ForwardPart.DATA

    def host_header(self) -> Optional[list[int]]:
        if self.lent is None or self.part not in (ForwardPart.DATA, ForwardPart.NEW_DATA):
            return None
        return self.lent.header()

    def scalars(self) -> Optional[torch.Tensor]:
        assert self.buffer is not None
        if self.part in (ForwardPart.DATA, ForwardPart.NEW_DATA):
            return self.buffer[:HEADER_BYTES].view(torch.int64)
        if self.part is ForwardPart.LENGTH:
            return self.buffer
        return None

    def advance(self, values: list[int], rank: int) -> Optional[PayloadSpec]:
        assert self.buffer is not None
        if self.part in (ForwardPart.DATA, ForwardPart.NEW_DATA):
            flag, tag = values
            self.check_tag(tag, rank)
            if flag == FLAG_DATA:
                self.done = True
            elif flag == FLAG_STALE and self.part is ForwardPart.DATA:
                self.part = ForwardPart.LENGTH
            else:
                raise RuntimeError(f"rank {rank}: bad header flag {flag} in '{describe_key(self.key)}' from rank {self.peer}")
        elif self.part is ForwardPart.LENGTH:
            (self.spec_len,) = values
            self.part = ForwardPart.SPEC
        else:
            self.spec = PayloadSpec.from_bytes(bytes(self.buffer.cpu().tolist()))
            self.part = ForwardPart.NEW_DATA
            return self.spec
        return None


class BackwardIncoming(Incoming):
    """A gradient buffer whose layout both ends derive from the forward spec."""

    def __init__(self, key: MessageKey, peer: int, order: tuple[Any, ...], direct_bytes: int,
                 spec: PayloadSpec) -> None:
        super().__init__(key, peer, order, direct_bytes)
        self.spec = spec
        self.wire: WireLayout = spec.wire(True, direct_bytes)

    def next_buffers(self, device: torch.device, pool: "ReceiveBuffers") -> list[torch.Tensor]:
        return self.data_buffers(self.spec, self.wire, device, pool)

    def steady(self) -> bool:
        return True

    def host_header(self) -> Optional[list[int]]:
        return None if self.lent is None else self.lent.header()

    def scalars(self) -> Optional[torch.Tensor]:
        assert self.buffer is not None
        return self.buffer[:HEADER_BYTES].view(torch.int64)

    def advance(self, values: list[int], rank: int) -> Optional[PayloadSpec]:
        flag, tag = values
        self.check_tag(tag, rank)
        if flag != FLAG_DATA:
            raise RuntimeError(f"rank {rank}: bad header flag {flag} in '{describe_key(self.key)}' from rank {self.peer}")
        self.done = True
        return None


def buffer_slot(peer: int, key: MessageKey) -> tuple[int, Direction, str, str, int, int]:
    """(peer, direction, src module, dst module, src chunk, dst chunk): the channel a send or
    receive buffer is kept for."""
    return (peer, key.direction, key.src_module, key.dst_module, key.src_chunk, key.dst_chunk)


class LentBuffer:
    """One pooled receive buffer: memory the pool owns, lent as a tensor over a fresh memoryview.

    ``torch.frombuffer`` makes a tensor whose storage holds the memoryview it was given until
    the storage is freed, and every alias of that tensor (a view, ``detach()``, ``.data``, a
    tensor saved for backward) shares the storage. The pool keeps only a weak reference to the
    memoryview of the latest loan: once it is dead, nothing can read or write the memory any
    more, and the buffer can be lent again.
    """

    ALIGNMENT = 64  # bytes, as torch's CPU allocator

    def __init__(self, nbytes: int) -> None:
        self.memory = bytearray(nbytes + self.ALIGNMENT - 1)
        address = torch.frombuffer(self.memory, dtype=torch.uint8).data_ptr()
        self.start = -address % self.ALIGNMENT
        self.nbytes = nbytes
        self.loan: Optional[weakref.ref[memoryview]] = None

    def returned(self) -> bool:
        """Whether nothing uses the latest loan any more (or it was never lent)."""
        return self.loan is None or self.loan() is None

    def lend(self) -> torch.Tensor:
        view = memoryview(self.memory)[self.start : self.start + self.nbytes]
        self.loan = weakref.ref(view)
        return torch.frombuffer(view, dtype=torch.uint8)

    def header(self) -> list[int]:
        """The two int64 values of the packed header (flag, tag) the latest loan received, read
        from the memory directly: no tensor is built to read them."""
        return list(_HEADER.unpack_from(self.memory, self.start))


class ReceiveBuffers:
    """Receive buffers per channel, lent again once nothing uses them (CPU only).

    A received payload is a set of views into its buffer and lives as long as the stage keeps
    it (until its backward), or longer where the user keeps it. A buffer is lent again only
    once nothing derived from its last loan exists (:class:`LentBuffer`). Each channel keeps
    buffers of its latest message size only, at most as many as it ever had in use at once
    (the step's own peak; capped at :data:`MAX_POOLED`). Reusing saves the page faults of a
    fresh allocation (see benchmarks/README.md, "Transfers beside compute"). On accelerators
    the caching allocator already reuses memory (and knows the streams still using it), so
    buffers come from ``torch.empty`` there.
    """

    MAX_POOLED = 64

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.enabled = enabled and device.type == "cpu"
        # per channel: the size of its last message and the buffers of that size (a new size
        # drops them, so variable shapes cannot pile up buffers of every size seen)
        self.buffers: dict[tuple[Any, ...], tuple[int, list[LentBuffer]]] = {}

    def get(self, slot: tuple[Any, ...], nbytes: int, device: torch.device) -> torch.Tensor:
        return self.get_lent(slot, nbytes, device)[0]

    def get_lent(self, slot: tuple[Any, ...], nbytes: int,
                 device: torch.device) -> tuple[torch.Tensor, Optional[LentBuffer]]:
        """A buffer of ``nbytes`` for ``slot``, and the pooled buffer it was lent from (``None``
        where it is a fresh tensor)."""
        if not self.enabled:
            return torch.empty(nbytes, dtype=torch.uint8, device=device), None
        size, pool = self.buffers.get(slot, (-1, []))
        if size != nbytes:
            pool = []
            self.buffers[slot] = (nbytes, pool)
        for buffer in pool:
            if buffer.returned():
                return buffer.lend(), buffer
        if len(pool) >= self.MAX_POOLED:
            return torch.empty(nbytes, dtype=torch.uint8, device=device), None
        pool.append(LentBuffer(nbytes))
        return pool[-1].lend(), pool[-1]


@dataclass(eq=False)
class ReceiveGroup:
    """The messages one :meth:`~lightning_mmpp.engine.comm.MultiModuleCommunicator.post` (or ``post_ahead``) receives from
    one peer: their first parts posted together and completed together; a changed spec's
    further parts then message by message."""

    peer: int
    messages: list[Incoming]
    works: list[Any]  # the receive works of the first parts
    done: bool = False

    def unsettled(self, channel: Optional[Channel] = None) -> bool:
        """Whether a message of the group (on ``channel``, or any) may still need further parts."""
        return any(not m.done and isinstance(m, ForwardIncoming) and channel in (None, m.channel)
                   for m in self.messages)
