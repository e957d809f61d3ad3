"""The strategy-owned communicator: activations forward, gradients backward, between stages and modules.

:class:`MultiModuleCommunicator` moves payloads (pytrees of tensors, see
:mod:`lightning_mmpp.engine.payload`) along the edges a :class:`~lightning_mmpp.core.placement.PipelineLayout`
defines: from one pipeline stage of a module to the next, and across the bridges between modules
(the last stage of ``u`` to the first stage of ``d``), with fan-in (concatenate replicas along the
batch dim) and fan-out (split along it). Everything goes through one primitive,
:meth:`MultiModuleCommunicator.exchange`, which takes the messages this rank sends and receives
in one step, identified by :class:`MessageKey` ``(direction, src_module, dst_module, microbatch)``.

Wire protocol (per forward *channel* = (src rank, dst rank, src module, dst module)):

* Both ends cache the last :class:`~lightning_mmpp.engine.payload.PayloadSpec` of the channel. In the
  steady state one message travels per (channel, microbatch): a packed ``uint8`` buffer (16-byte
  header + the small leaves) whose size the receiver knows from its cache, followed by one
  transfer per *direct* leaf (a leaf of at least ``direct_leaf_bytes``, 1 MiB by default, sent
  from and received into the tensor's own memory: no copy into the packed buffer; see
  :class:`~lightning_mmpp.engine.payload.WireLayout`). The transfers of one message are its *data
  part*.
* When the spec changes (or on first use) the sender sends the data part of the old spec with
  header flag :data:`~lightning_mmpp.engine.payload.FLAG_STALE` (only if an old spec existed; its
  direct leaves unwritten), then its *further parts*: an int64 length, the serialised spec, the
  data part of the new spec. A message's first part goes on tag 0, its further parts on
  :data:`LATER_PARTS_TAG`. The receiver plans every message of a channel in one post with the
  spec it knows, so of a channel's messages in one exchange only the last may change the spec
  (the sender raises :class:`~lightning_mmpp.errors.PipelineConfigError` otherwise, before
  posting anything).
* The steady state of a one-tensor message to one remote peer is checked against the channel's
  cached spec directly (shape, dtype, ``requires_grad``), without flattening the payload or
  building a spec, and packed through views of the channel's buffer kept from its last message.
* Backward messages never carry metadata: their layout is the gradient layout of the spec of
  the same (key, peer) seen in forward, which both ends keep until that backward has run.

Ordering and deadlock freedom: a post is one ``batch_isend_irecv`` (on CPU: the same gloo calls
in the same order, straight on the process group, :func:`~lightning_mmpp.torch_api.direct_p2p`)
of the first part of each outgoing and each incoming message, each list sorted by a canonical
key that both ends compute (direction, src module, dst module, microbatch, sender rank,
receiver rank), then one batch of the outgoing messages' further parts, message by message in
the same order. All sends and receives of a batch go into it together, so opposite directions
cannot deadlock, and the per-rank-pair in-order matching of gloo and NCCL pairs the same
messages on both ends. The receiver asks for a message's further parts one by one when it
completes the message, messages in the order their first parts were posted. Steady state is
one batch per post; a metadata change adds three receives.

Posting and taking. :meth:`MultiModuleCommunicator.post` posts a batch and returns at once:
the sender posts every part of its messages, the receiver their first parts, as one *group*
per peer. :meth:`MultiModuleCommunicator.take` completes a message where its payload is
needed (the runtime: just before the compute that consumes it), receiving the further parts of
its messages whose spec changed. A group holding a message that may still need further parts
is *open*; a rank completes a peer's open groups in posting order, since their further parts
follow one another on the pair. (A gradient, or a forward message under ``static_specs`` on a
cached channel, is whole in its first part: its group is never open.) Before it plans a
forward receive, a rank completes the earlier messages of the same channel (one may bring the
spec the receive is sized by); on NCCL, which ignores tags, it completes every open group of the
peer before posting anything more from it, so nothing later is matched with a further part.
Every wait happens no earlier than in :meth:`MultiModuleCommunicator.exchange` (post, then take
everything), so a schedule that cannot deadlock with blocking exchanges cannot with deferred
takes either.

Receiving ahead. gloo's point-to-point protocol is a rendezvous: a send whose receive is not
posted yet waits for the receiver's notice before a byte moves. On CPU,
:meth:`MultiModuleCommunicator.post_ahead` posts the first part of a message before the
exchange that names it (the runtime: the next two exchanges' receives, in schedule order, after
each exchange and after each take): a gradient once its forward went out, a forward message on
a channel whose spec is cached and whose earlier messages are whole. It waits for nothing, and
gloo matches a pair's transfers per tag, so it never meets a further part (those travel on
:data:`LATER_PARTS_TAG`) and the argument above still holds.

Contract for callers (the schedule/runtime): for every pair of ranks and direction, the messages
that one :meth:`exchange` call sends must be received by exactly one :meth:`exchange` call on the
peer (the same set of messages between the two ranks), and exchanges must be issued in the same
order on both ends. Every packed buffer carries a tag of its key, so a violation that keeps the
sizes equal raises instead of silently mixing up data. With NCCL, run one collective on the group
(e.g. a barrier) before the first exchange so that the first batched P2P call is not the group's
first collective (see ``torch.distributed.batch_isend_irecv``).

Send completion: the send works of a post are kept (with their buffers) and waited at the
start of the next post or by :meth:`MultiModuleCommunicator.wait_sends`. A channel packs its
next message into its previous send buffer; on CPU a receive goes into a buffer of the channel
that nothing references any more (:class:`~lightning_mmpp.engine.incoming.ReceiveBuffers`).

Same-rank peers (colocated modules) move no bytes: the payload object is handed over with every
tensor leaf detached (``requires_grad`` kept), and gradients are handed back as objects.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from lightning_mmpp.core.actions import Direction, MessageKey
from lightning_mmpp.errors import ExchangeMismatchError, PipelineConfigError
from lightning_mmpp.engine.incoming import (
    BackwardIncoming,
    Channel,
    ForwardIncoming,
    Incoming,
    ReceiveBuffers,
    ReceiveGroup,
    buffer_slot,
    channel_of,
    describe_key,
    message_tag,
)
from lightning_mmpp.engine.payload import (
    FLAG_DATA,
    FLAG_STALE,
    HEADER_BYTES,
    PayloadSpec,
    WireLayout,
    DIRECT_LEAF_BYTES,
    concat_payloads,
    flatten_payload,
    leaf_batch_dims,
    pack,
    pack_header,
    split_payload,
    wire_tensor,
)
from lightning_mmpp.core.placement import BridgePeer, PipelineLayout, StageSlot
from lightning_mmpp.engine.microbatch import SampleRouting
from lightning_mmpp.torch_api import direct_p2p

__all__ = ["BACKWARD", "FORWARD", "CommStats", "Direction", "MessageKey", "MultiModuleCommunicator", "message_tag"]

FORWARD = Direction.FORWARD
BACKWARD = Direction.BACKWARD

# the tag of a changed spec's further parts (length, spec, new data); first parts go on tag 0,
# so on gloo, which matches a pair's transfers per tag, a receive posted ahead never meets them
LATER_PARTS_TAG = 1


@dataclass
class CommStats:
    """Counters of one communicator (see :meth:`MultiModuleCommunicator.reset_stats`).

    ``messages_*`` / ``bytes_*`` count point-to-point transfers (metadata parts included);
    ``metadata_exchanges`` counts spec transfers this rank took part in (sent or received);
    ``local_handovers`` counts payloads or gradients handed to a same-rank peer without bytes;
    ``rounds`` counts batched P2P calls; ``receives_ahead`` the receives posted ahead of their
    exchange (:meth:`MultiModuleCommunicator.post_ahead`).
    """

    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    metadata_exchanges: int = 0
    local_handovers: int = 0
    rounds: int = 0
    receives_ahead: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _order(key: MessageKey, sender: int, receiver: int) -> tuple[Any, ...]:
    return (key, sender, receiver)


@dataclass
class _PeerState:
    """What one end remembers about one peer of a forward message until its backward ran."""

    rank: int
    chunk: int
    spec: PayloadSpec


@dataclass
class _Outgoing:
    order: tuple[Any, ...]
    peer: int
    parts: list[list[torch.Tensor]]  # the first part, then the further parts: the tensors of each, in order


def _leaves(spec: PayloadSpec) -> str:
    """A spec's tensor leaves as ``[dtype shape, ...]`` for messages."""
    return "[" + ", ".join("None" if m is None else f"{str(m.dtype).replace('torch.', '')}{list(m.shape)}"
                           for m in spec.leaves) + "]"


class _Origin(enum.Enum):
    """Where one piece of a received message comes from."""

    READY = "ready"  # an object at hand: a same-rank handover, or no gradient at all
    REMOTE = "remote"  # an :class:`Incoming` message from another rank


# One source of a received message: (READY, payload) or (REMOTE, Incoming).
_Source = Union[tuple[_Origin, Any], tuple[_Origin, Incoming]]


class MultiModuleCommunicator:
    """Point-to-point transfers of pytree payloads between the stages and modules of a layout.

    Args:
        layout: the placement of every module on ranks.
        rank: this process's global rank.
        device: where receive and send buffers live (``cpu`` for gloo, the rank's CUDA device
            for NCCL).
        group: the process group for P2P (``None``: the default group). Peers are addressed by
            global rank.
        static_specs: every message of a channel keeps the first message's spec (shapes,
            dtypes, structure), as ``torch.distributed.pipelining`` and Megatron assume. Then a
            received buffer's header is not read where the payload is taken (on an accelerator
            that read is a host synchronisation per message): the headers of the step are
            checked together by :meth:`finish_step`, one read per step. A sender
            whose spec changes raises :class:`~lightning_mmpp.errors.PipelineConfigError`
            before anything is posted. The first message of a channel still carries its spec.
        reuse_receive_buffers: on CPU, receive into a buffer the channel used before once
            nothing uses it any more (warm pages, see
            :class:`~lightning_mmpp.engine.incoming.ReceiveBuffers`); ``False``: a fresh buffer per
            message, for comparison (``benchmarks/bench_overlap.py --receive-pool``); settable
            later as :attr:`reuse_receive_buffers`.
        direct_leaf_bytes: a tensor leaf of at least this many bytes travels as a transfer of its
            own, sent from and received into the tensor's memory, instead of being copied into the
            message's packed buffer (:class:`~lightning_mmpp.engine.payload.WireLayout`). Every
            rank must use the same value; settable between steps (as :attr:`direct_leaf_bytes`)
            only on every rank at once.
    """

    def __init__(self, layout: PipelineLayout, rank: int, device: torch.device,
                 group: Optional[dist.ProcessGroup] = None, static_specs: bool = False,
                 reuse_receive_buffers: bool = True, direct_leaf_bytes: int = DIRECT_LEAF_BYTES) -> None:
        if not isinstance(static_specs, bool):
            raise PipelineConfigError(f"static_specs={static_specs!r}: give True or False.")
        if not isinstance(layout, PipelineLayout):
            raise TypeError(f"layout must be a PipelineLayout, got {type(layout).__name__}")
        if not 0 <= rank < layout.world_size:
            raise PipelineConfigError(
                f"rank {rank} is outside the layout's {layout.world_size} ranks; launch with "
                f"devices={layout.world_size} or change the placements."
            )
        if dist.is_available() and dist.is_initialized():
            layout.check_world_size(dist.get_world_size(group))
        self.layout = layout
        self.rank = rank
        self.device = torch.device(device)
        self.group = group
        self.stats = CommStats()
        self._training = True  # the kind of the step under way (see begin_step)
        self._send_cache: dict[Channel, PayloadSpec] = {}
        self._recv_cache: dict[Channel, PayloadSpec] = {}
        # Forward state kept for the backward of the same microbatch, keyed by MessageKey.edge.
        self._sent: dict[tuple[str, str, int], list[_PeerState]] = {}
        self._received: dict[tuple[str, str, int], tuple[PayloadSpec, list[_PeerState]]] = {}
        # Same-rank handovers waiting to be picked up (a same-rank peer is never a fan-in/out).
        self._mailbox: dict[MessageKey, Any] = {}
        # (work, buffer, whether it is a further part of a changed spec's message)
        self._pending_sends: list[tuple[Any, Optional[torch.Tensor], bool]] = []
        # Receives posted and not taken: key -> (its sources, the groups its remote parts are in).
        self._inbox: dict[MessageKey, tuple[list[tuple[BridgePeer, _Source]], list[ReceiveGroup]]] = {}
        # peer -> its posted groups not complete yet that hold a message which may need further
        # parts, in posting order (see _complete)
        self._open: dict[int, list[ReceiveGroup]] = {}
        # the last packed buffer per (peer, direction, src module, dst module), reused by the next
        # message of the channel; ``_packed``: channels packed in the current post
        self._send_buffers: dict[tuple[int, Direction, str, str, int, int], torch.Tensor] = {}
        # per channel: (its last packed buffer, the layout packed, a numpy view of the header on
        # CPU, a view per leaf entry), to pack the next message of the same layout without slicing
        self._pack_views: dict[tuple[int, Direction, str, str, int, int], tuple[Any, ...]] = {}
        self._recv_buffers = ReceiveBuffers(self.device, enabled=reuse_receive_buffers)
        self.static_specs = static_specs
        self.direct_leaf_bytes = direct_leaf_bytes
        # static_specs: (key, peer, header view) of the messages taken unread this step
        self._deferred: list[tuple[MessageKey, int, torch.Tensor]] = []
        self._packed: set[tuple[int, Direction, str, str, int, int]] = set()
        # forward channels whose spec changed in the current post (no later message may follow on them)
        self._changed: set[Channel] = set()
        # which samples every replica holds in this step's microbatches (bridges routed by item count)
        self.routing: Optional[SampleRouting] = None
        # the layout is fixed: this rank's slot and the peers at the other end of each edge,
        # resolved on first use (key: this end's module, the other end's, downstream, the key's chunks)
        self._peer_cache: dict[tuple[str, str, bool, int, int], tuple[StageSlot, list[BridgePeer]]] = {}
        # (send, recv) straight on the process group (CPU / gloo), made at the first post
        self._direct: Optional[tuple[Any, Any]] = None
        # gloo (CPU) posts op by op and matches a pair's transfers per tag: a changed spec's
        # further parts go on LATER_PARTS_TAG, apart from first parts (NCCL ignores tags)
        self._tagged_later_parts = self.device.type == "cpu"

    # --- public API ----------------------------------------------------------------------

    def exchange(self, sends: Mapping[MessageKey, Any], recvs: Iterable[MessageKey]) -> dict[MessageKey, Any]:
        """Send ``sends`` and receive ``recvs`` in one batched step; returns ``{key: payload}`` for ``recvs``.

        * forward send ``(forward, u, d, k)``: the payload is the output of this rank's stage of
          ``u``; it goes to the next stage of ``u`` (``u == d``) or to the first stage of ``d``
          on every bridge peer (split along ``u``'s ``batch_dim`` on fan-out).
        * forward recv ``(forward, u, d, k)``: the input of this rank's stage of ``d`` coming from
          ``u`` (concatenated in replica order on fan-in). Leaves that required grad at the sender
          are fresh leaf tensors with ``requires_grad=True``.
        * backward send ``(backward, u, d, k)``: the gradient w.r.t. the payload received by
          forward recv ``(forward, u, d, k)``, same structure (``None`` allowed anywhere: a
          missing gradient of a leaf that required grad is sent as zeros).
        * backward recv ``(backward, u, d, k)``: the gradient w.r.t. the payload sent by forward
          send ``(forward, u, d, k)``: tensors where the leaf required grad, ``None`` elsewhere.
        """
        recvs = list(recvs)
        self.post(sends, recvs)
        return {key: self.take(key) for key in recvs}

    def post(self, sends: Mapping[MessageKey, Any], recvs: Iterable[MessageKey]) -> None:
        """Post ``sends`` and ``recvs`` (the contract of :meth:`exchange`) without waiting for them.

        Sends are packed (into the channel's previous buffer when it fits) and handed to the
        backend at once; they complete in the background until the next :meth:`post` (or
        :meth:`wait_sends`) waits for them. Receives are completed by :meth:`take`, where their
        payload is needed, so the transfer runs while this rank computes. A forward receive on a
        channel whose earlier message may still need further parts (a changed spec's) first
        completes that message, whose spec it is planned with (on NCCL: any receive from a peer
        with an open group, since per-pair in-order matching must see those parts first).
        """
        recvs = list(recvs)
        self._packed, self._changed = set(), set()
        # The previous post's sends first: on gloo, sends left in flight compete for the link and
        # the cores with the transfer the next compute waits for (measured: benchmarks/bench_overlap.py).
        self._wait_sends(keep_later_rounds=True)
        # An earlier message of a channel must be whole first: it may carry the spec this
        # batch's receive on the channel is planned with (and on a backend that matches a pair's
        # transfers in order whatever their tag, nothing later from a peer may be posted while
        # parts of its earlier messages are still to come).
        for key in recvs if self._open else ():
            _, peers = self._sources(key) if key.direction == FORWARD else self._targets(key)
            for peer in peers:
                self._settle(peer.rank, key)
        # Planning validates every payload and may raise; it must then leave no trace, so that
        # an error surfaces before any message is posted and with the caches still consistent.
        saved = (dict(self._send_cache), dict(self._sent), dict(self._received), dict(self._mailbox),
                 dict(vars(self.stats)))
        outgoing: list[_Outgoing] = []
        try:
            for key, payload in sends.items():
                if key.direction == FORWARD:
                    self._plan_forward_send(key, payload, outgoing)
                else:
                    self._plan_backward_send(key, payload, outgoing)
            pending, incoming = self._plan_receives(recvs)
        except BaseException:
            self._send_cache, self._sent, self._received, self._mailbox, stats = saved
            vars(self.stats).update(stats)
            raise
        groups = self._post_batch(outgoing, incoming)
        for key, sources in pending:
            self._file(key, sources, groups)

    def post_ahead(self, key: MessageKey) -> bool:
        """Post the receive of ``key`` now, ahead of the exchange that names it, where that is
        safe; return whether it was posted (:meth:`take` then completes it as any other).

        gloo's point-to-point protocol is a rendezvous: a send whose receive is not posted yet
        waits for the receiver's notice, a round trip of both ends' transport threads, before
        any byte moves. A receive posted early lets the peer's data land while this rank still
        computes (``benchmarks/README.md``: free stages, 4-stage chain).

        Posted only where its first part can be planned now: a gradient once its forward was
        sent (its layout comes from that forward), a forward message on a channel whose spec is
        cached and whose earlier messages are whole (one of them may bring a new spec); and only
        where every source is on another rank and the backend posts op by op and matches a
        pair's transfers per tag (CPU / gloo: a changed spec's further parts travel on their own
        tag, :data:`LATER_PARTS_TAG`, so a first part posted ahead never meets them; on NCCL a
        receive posted alone would also hold the stream the rank's sends go on). Nothing is
        waited for. The receives of one peer must be posted in the order of its sends (as for
        :meth:`post`, canonical within an exchange): the runtime posts ahead in schedule order
        and stops at the first receive refused.
        """
        if not self._tagged_later_parts or key in self._inbox:
            return False
        forward = key.direction == FORWARD
        _, peers = self._sources(key) if forward else self._targets(key)
        if any(peer.rank == self.rank for peer in peers):
            return False
        if forward:
            for peer in peers:
                channel = channel_of(peer.rank, self.rank, key, self._training)
                if channel not in self._recv_cache or any(g.unsettled(channel) for g in self._open.get(peer.rank, ())):
                    return False
        elif key.edge not in self._sent:
            return False
        sources = self._plan_forward_recv(key) if forward else self._plan_backward_recv(key)
        self._file(key, sources, self._post_batch([], [src for _, (kind, src) in sources if kind is _Origin.REMOTE]))
        self.stats.receives_ahead += 1
        return True

    def _settle(self, peer: int, key: MessageKey) -> None:
        """Complete what must be whole before a receive of ``key`` from ``peer`` is posted: the
        peer's earlier messages on the same channel (one may bring the spec the receive is
        planned with); where the backend ignores tags (NCCL), every open group of the peer."""
        groups = self._open.get(peer)
        if not groups:
            return
        if not self._tagged_later_parts:
            self._complete(groups[-1])  # completes the earlier groups first
            return
        if key.direction != FORWARD:
            return
        channel = channel_of(peer, self.rank, key, self._training)
        for group in reversed(groups):
            if group.unsettled(channel):
                self._complete(group)
                return

    def _file(self, key: MessageKey, sources: list[tuple[BridgePeer, _Source]], groups: dict[int, "ReceiveGroup"]) -> None:
        """Keep a posted receive for :meth:`take`: its sources and the groups its remote parts are in."""
        peers = {src.peer for _, (kind, src) in sources if kind is _Origin.REMOTE}
        self._inbox[key] = (sources, [groups[peer] for peer in sorted(peers)])

    def _plan_receives(
        self, recvs: list[MessageKey]
    ) -> tuple[list[tuple[MessageKey, list[tuple[BridgePeer, _Source]]]], list[Incoming]]:
        """Each receive's sources, and the messages to post for those on other ranks."""
        pending: list[tuple[MessageKey, list[tuple[BridgePeer, _Source]]]] = []
        incoming: list[Incoming] = []
        for key in recvs:
            if key in self._inbox:
                raise RuntimeError(f"rank {self.rank}: '{describe_key(key)}' is posted twice without a take()")
            sources = self._plan_forward_recv(key) if key.direction == FORWARD else self._plan_backward_recv(key)
            pending.append((key, sources))
            incoming.extend(src for _, (kind, src) in sources if kind is _Origin.REMOTE)
        return pending, incoming

    def take(self, key: MessageKey) -> Any:
        """The payload of a receive posted by :meth:`post`, waiting for it if it has not arrived."""
        try:
            sources, groups = self._inbox.pop(key)
        except KeyError:
            raise RuntimeError(f"rank {self.rank}: take('{describe_key(key)}') without a post() of it") from None
        for group in groups:
            self._complete(group)
        if key.direction == FORWARD:
            return self._finish_forward_recv(key, sources)
        return self._finish_backward_recv(key, sources)

    def posted(self) -> list[MessageKey]:
        """Receives posted and not taken yet."""
        return list(self._inbox)

    def wait_sends(self) -> None:
        """Wait for the send works still in flight and free their buffers.

        :meth:`exchange` calls it first thing, :meth:`finish_step` at the end of a step; call it
        yourself after exchanges outside a step, before the process group is destroyed, so that
        no send is abandoned when a process exits.
        """
        self._wait_sends(keep_later_rounds=False)

    def _wait_sends(self, keep_later_rounds: bool) -> None:
        """Wait for the sends in flight; with ``keep_later_rounds``, leave a changed spec's
        further parts in flight: their receives are posted only when the receiver completes
        the message (at its take, or before it plans a receive its spec sizes), and waiting for
        them here would deadlock two ranks that each sent the other a changed spec (ragged
        payloads change shape every microbatch). Their buffers are not packed into again meanwhile."""
        pending, self._pending_sends = self._pending_sends, []
        for work, buffer, later in pending:
            if later and keep_later_rounds:
                self._pending_sends.append((work, buffer, later))
            else:
                work.wait()

    def drop_transfers(self) -> None:
        """Forget every send and receive in flight (after a failure: the works hold the process
        group, which must be able to close)."""
        self._pending_sends, self._inbox, self._open, self._deferred = [], {}, {}, []
        self._direct = None  # a new process group may follow

    def begin_step(self, training: bool) -> None:
        """Start a step: ``training`` (backwards follow) or forward-only. The runtime calls it
        once at the start of :meth:`~lightning_mmpp.engine.runtime.PipelineRuntime.run`; every
        rank runs the same kind of step, so both ends of a channel use the same spec cache."""
        self._training = training

    def finish_step(self) -> None:
        """End a step: check the headers of the messages taken unread (``static_specs``), wait
        for the sends still in flight, and forget the forward specs kept for backward (channels
        that carried no gradient, a forward-only step). The runtime calls it once at the end of
        :meth:`~lightning_mmpp.engine.runtime.PipelineRuntime.run`.

        Raises:
            ExchangeMismatchError: a header taken unread is not a data header of the expected
                message (nothing is waited for or forgotten then).
        """
        self._check_deferred_headers()
        self.wait_sends()
        self.discard_backward_state()

    def _check_deferred_headers(self) -> None:
        """With ``static_specs``: check the headers of every message taken unread since the last
        call, with one host read for all of them."""
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        flat = torch.cat([header for _, _, header in deferred]).tolist()
        for i, (key, peer, _) in enumerate(deferred):
            flag, tag = flat[2 * i], flat[2 * i + 1]
            if flag != FLAG_DATA or tag != message_tag(key):
                raise ExchangeMismatchError(
                    f"rank {self.rank} took '{describe_key(key)}' from rank {peer} unread (static_shapes) and its "
                    f"header says flag {flag}, tag {tag} (expected {FLAG_DATA}, {message_tag(key)}): the two ranks "
                    "exchanged different messages or in a different order, or the peer's payload changed."
                )

    @property
    def reuse_receive_buffers(self) -> bool:
        """Whether receives go into pooled buffers (CPU; see the constructor's argument). May be
        changed between steps."""
        return self._recv_buffers.enabled

    @reuse_receive_buffers.setter
    def reuse_receive_buffers(self, value: bool) -> None:
        self._recv_buffers.enabled = bool(value) and self.device.type == "cpu"

    def reset_stats(self) -> None:
        """Zero the counters in :attr:`stats`."""
        self.stats = CommStats()

    def pending_backward(self) -> int:
        """Number of forward messages whose backward has not been exchanged yet (sent + received)."""
        return len(self._sent) + len(self._received)

    def discard_backward_state(self) -> None:
        """Forget the forward specs kept for backward (e.g. after a forward-only validation step)."""
        self._sent.clear()
        self._received.clear()
        self._mailbox = {k: v for k, v in self._mailbox.items() if k.direction == FORWARD}

    # --- planning: who talks to whom -----------------------------------------------------

    def _slot(self, module: str, chunk: int = 0) -> StageSlot:
        if module not in self.layout.placements:
            raise PipelineConfigError(f"unknown module {module!r}; the layout has {list(self.layout.placements)}.")
        slot = self.layout.slot(self.rank, module, chunk)
        if slot is None:
            ranks = self.layout.module_ranks(module)
            raise ValueError(
                f"rank {self.rank} holds no stage of module {module!r} (ranks {ranks.start}-{ranks.stop - 1}); "
                "only exchange messages of modules this rank runs."
            )
        return slot

    @staticmethod
    def _distinct(pairs: Iterable[tuple[str, BridgePeer]]) -> list[str]:
        modules: list[str] = []
        for module, _ in pairs:
            if module not in modules:
                modules.append(module)
        return modules

    def _targets(self, key: MessageKey) -> tuple[StageSlot, list[BridgePeer]]:
        """This rank's slot of ``key.src_module`` and the peers its output goes to for ``key``."""
        return self._peers(key, downstream=True)

    def _sources(self, key: MessageKey) -> tuple[StageSlot, list[BridgePeer]]:
        """This rank's slot of ``key.dst_module`` and the peers its input from ``key.src_module`` comes from."""
        return self._peers(key, downstream=False)

    def _peers(self, key: MessageKey, downstream: bool) -> tuple[StageSlot, list[BridgePeer]]:
        """This rank's slot at one end of ``key``'s edge (``downstream``: the producing end) and
        the peers at the other end, in chunk order."""
        mine, theirs = (key.src_module, key.dst_module) if downstream else (key.dst_module, key.src_module)
        memo = (mine, theirs, downstream, key.src_chunk, key.dst_chunk)  # chunks: for virtual stages
        cached = self._peer_cache.get(memo)
        if cached is not None:
            return cached
        slot = self._slot(mine, key.src_chunk if downstream else key.dst_chunk)
        edges = self.layout.forward_targets(slot) if downstream else self.layout.forward_sources(slot)
        peers = [peer for module, peer in edges if module == theirs]
        if not peers:
            what, verb, others, none = (("output", "go to", "consumers", "last stage of a sink") if downstream
                                        else ("input", "come from", "producers", "first stage of a source"))
            raise ValueError(
                f"'{describe_key(key)}': the {what} of rank {self.rank}'s stage {slot.stage} of {mine!r} does not {verb} "
                f"{theirs!r}; its {others} are {self._distinct(edges) or f'none ({none})'}."
            )
        resolved = (slot, sorted(peers, key=lambda p: p.chunk))
        self._peer_cache[memo] = resolved
        return resolved

    def _bridge_context(self, key: MessageKey, kind: str) -> str:
        du = self.layout.placements[key.src_module].dp
        dd = self.layout.placements[key.dst_module].dp
        return f"for {kind} from {key.src_module!r} (dp={du}) to {key.dst_module!r} (dp={dd})"

    def _batch_dim(self, key: MessageKey) -> int:
        return self.layout.placements[key.src_module].batch_dim

    def _routed_sizes(self, key: MessageKey, slot: StageSlot) -> Optional[list[int]]:
        """On a routed bridge (``balance="items"`` at one end): the samples this replica sends to
        each replica of ``key.dst_module`` in this microbatch; ``None`` on an ordinary bridge."""
        if not self.layout.routed(key.src_module, key.dst_module):
            return None
        if self.routing is None:
            raise RuntimeError(
                f"rank {self.rank}: '{describe_key(key)}' crosses a bridge routed by item count but no sample routing "
                "was set; set comm.routing (BatchSplitter.routing) for the step before exchanging."
            )
        return self.routing.piece_sizes(key.src_module, key.dst_module, slot.replica, True, key.microbatch)

    def _plan_forward_send(self, key: MessageKey, payload: Any, outgoing: list[_Outgoing]) -> None:
        slot, peers = self._targets(key)
        if isinstance(payload, torch.Tensor) and len(peers) == 1 and peers[0].rank != self.rank:
            # the steady state of a one-tensor message to one remote peer: the channel's cached
            # spec is checked against the tensor directly, nothing is flattened or built
            peer = peers[0]
            channel = channel_of(self.rank, peer.rank, key, self._training)
            cached = self._send_cache.get(channel)
            if cached is not None and channel not in self._changed and cached.matches_tensor(payload):
                part = self._data_part(peer.rank, key, [payload], cached.wire(False, self.direct_leaf_bytes))
                outgoing.append(_Outgoing(_order(key, self.rank, peer.rank), peer.rank, [part]))
                self._sent[key.edge] = [_PeerState(peer.rank, peer.chunk, cached)]
                return
        where = f"module {key.src_module!r} stage {slot.stage} output (to {key.dst_module!r})"
        flat = flatten_payload(payload, where)  # validates every leaf, naming module, stage and path
        # Fan-out: several receivers, each taking its chunk. (On fan-in the single receiver's
        # BridgePeer also has num_chunks > 1: our position in its concatenation; no split.)
        chunks: list[Any] = []
        if len(peers) > 1:
            chunks = split_payload(payload, len(peers), self._batch_dim(key), self._bridge_context(key, "fan-out"),
                                   sizes=self._routed_sizes(key, slot))
        states: list[_PeerState] = []
        for peer in peers:
            leaves, spec = flatten_payload(chunks[peer.chunk], where) if chunks else flat
            states.append(_PeerState(peer.rank, peer.chunk, spec))
            if peer.rank == self.rank:
                # No bytes move: the same storage, detached, requires_grad kept.
                handed = spec.unflatten(
                    [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in leaves]
                )
                self._mailbox[key] = handed
                self.stats.local_handovers += 1
                continue
            parts: list[list[torch.Tensor]] = []
            channel = channel_of(self.rank, peer.rank, key, self._training)
            if channel in self._changed:
                raise PipelineConfigError(
                    f"rank {self.rank}: {where} to rank {peer.rank} (microbatch {key.microbatch}) follows, in the same "
                    "exchange, a message of the same channel whose spec changed; the receiver sizes every message "
                    "of a channel in one exchange by the spec it knew before. Send them in separate exchanges "
                    "(the built-in schedules do), or keep the spec of all but the last."
                )
            cached = self._send_cache.get(channel)
            if cached == spec:
                spec = states[-1].spec = cached  # the cached object: its wire layouts are computed already
            else:
                if cached is not None and self.static_specs:
                    raise PipelineConfigError(
                        f"rank {self.rank}: {where} to rank {peer.rank} changed from {_leaves(cached)} to "
                        f"{_leaves(spec)} (microbatch {key.microbatch}), but static_shapes=True: every microbatch "
                        "must send the same shapes and dtypes. Pad to fixed shapes, or pass static_shapes=False "
                        "to MultiModulePipelineStrategy (a changed spec is then sent along)."
                    )
                if cached is not None:  # the parts the peer expects of the old spec, header flagged stale
                    old = cached.wire(False, self.direct_leaf_bytes)
                    parts.append([pack_header(old.packed.nbytes, self.device, FLAG_STALE, message_tag(key))]
                                 + [torch.empty(m.nbytes, dtype=torch.uint8, device=self.device)
                                    for m in old.direct_metas])
                blob = spec.to_bytes()
                parts.append([torch.tensor([len(blob)], dtype=torch.int64, device=self.device)])
                parts.append([torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device)])
                self._send_cache[channel] = spec
                self._changed.add(channel)
                self.stats.metadata_exchanges += 1
            parts.append(self._data_part(peer.rank, key, leaves, spec.wire(False, self.direct_leaf_bytes)))
            outgoing.append(_Outgoing(_order(key, self.rank, peer.rank), peer.rank, parts))
        self._sent[key.edge] = states

    def _plan_backward_send(self, key: MessageKey, grads: Any, outgoing: list[_Outgoing]) -> None:
        slot, peers = self._sources(key)
        state = self._received.pop(key.edge, None)
        if state is None:
            raise RuntimeError(
                f"rank {self.rank}: backward send '{describe_key(key)}' without a forward recv of the same microbatch "
                "(or its backward was already sent)."
            )
        combined, peer_states = state
        meta = combined.single_tensor
        if (meta is not None and meta.requires_grad and isinstance(grads, torch.Tensor) and len(peer_states) == 1
                and peer_states[0].rank != self.rank and tuple(grads.shape) == meta.shape):
            # the steady state of a one-tensor gradient to one remote peer (no fan-in to cut)
            peer_rank = peer_states[0].rank
            part = self._data_part(peer_rank, key, [grads.detach().to(meta.dtype)],
                                   peer_states[0].spec.wire(True, self.direct_leaf_bytes))
            outgoing.append(_Outgoing(_order(key, self.rank, peer_rank), peer_rank, [part]))
            return
        where = f"gradient of module {key.dst_module!r} stage {slot.stage} input from {key.src_module!r}"
        if grads is None:
            grad_leaves: list[Any] = [None] * combined.num_leaves
        else:
            grad_leaves, grad_spec = flatten_payload(grads, where)
            if grad_spec.treespec != combined.treespec:
                raise ValueError(
                    f"{where}: the gradient's structure {grad_spec.describe()} differs from the structure of the "
                    f"received input {combined.describe()}; give the gradient in the same pytree (None for "
                    "leaves without a gradient)."
                )
        full: list[Optional[torch.Tensor]] = []
        for index, meta in enumerate(combined.leaves):
            grad = grad_leaves[index]
            if meta is None or not meta.requires_grad:
                full.append(None)
            elif grad is None:
                full.append(torch.zeros(meta.shape, dtype=meta.dtype, device=self.device))
            elif tuple(grad.shape) != meta.shape:
                raise ValueError(
                    f"{where}: the gradient of leaf {index} has shape {list(grad.shape)} but the input had "
                    f"{list(meta.shape)}."
                )
            else:
                full.append(grad.detach().to(meta.dtype))
        dims = leaf_batch_dims(combined, self._batch_dim(key)) if len(peer_states) > 1 else []
        starts = [0] * len(full)
        for peer_state in peer_states:
            spec = peer_state.spec
            if len(peer_states) == 1:
                chunk = full
            else:  # fan-in: cut the gradient back into the replicas' pieces (each leaf by its own size)
                chunk = []
                for index, (grad, meta) in enumerate(zip(full, spec.leaves)):
                    if grad is None or meta is None:
                        chunk.append(None)
                        continue
                    size = meta.shape[dims[index]]
                    chunk.append(grad.narrow(dims[index], starts[index], size))
                    starts[index] += size
            if not spec.requires_grad:
                continue  # the peer's forward had no leaf requiring grad: it expects nothing
            chunk = [g if (meta is not None and meta.requires_grad) else None for g, meta in zip(chunk, spec.leaves)]
            if peer_state.rank == self.rank:
                self._mailbox[key] = spec.unflatten(chunk)
                self.stats.local_handovers += 1
                continue
            part = self._data_part(peer_state.rank, key, chunk, spec.wire(True, self.direct_leaf_bytes))
            outgoing.append(_Outgoing(_order(key, self.rank, peer_state.rank), peer_state.rank, [part]))

    def _data_part(self, peer: int, key: MessageKey, leaves: Sequence[Optional[torch.Tensor]],
                   wire: WireLayout) -> list[torch.Tensor]:
        """The tensors of a data part to ``peer``: the small leaves packed (into the channel's
        previous buffer when it is free), then every direct leaf's own memory (no copy)."""
        slot = buffer_slot(peer, key)
        reuse = self._send_buffer(slot, wire.packed.nbytes)
        packed = [leaves[i] for i in wire.packed.indices]
        views = self._pack_views.get(slot)
        if reuse is not None and views is not None and views[0] is reuse and views[1] is wire.packed:
            # the channel's buffer and layout as last time: write through the views kept of it
            # (the spec matched, so every leaf has its entry's shape and dtype)
            _, _, header, dests = views
            if header is not None:
                header[0], header[1] = FLAG_DATA, message_tag(key)
            else:
                reuse[:HEADER_BYTES].view(torch.int64).copy_(
                    torch.tensor([FLAG_DATA, message_tag(key)], dtype=torch.int64))
            for dest, tensor in zip(dests, packed):
                dest.copy_(tensor.detach())  # type: ignore[union-attr]
            buffer = reuse
        else:
            buffer = pack(packed, wire.packed, self.device, FLAG_DATA, message_tag(key), out=reuse)  # type: ignore[arg-type]
            header = buffer[:HEADER_BYTES].view(torch.int64).numpy() if buffer.device.type == "cpu" else None
            dests = [buffer[offset : offset + meta.nbytes].view(meta.dtype).view(meta.shape)
                     for meta, offset in zip(wire.packed.metas, wire.packed.offsets)]
            self._pack_views[slot] = (buffer, wire.packed, header, dests)
        self._send_buffers[slot] = buffer
        self._packed.add(slot)
        return [buffer, *(wire_tensor(leaves[i], self.device) for i in wire.direct_indices)]  # type: ignore[arg-type]

    def _send_buffer(self, slot: tuple[int, Direction, str, str, int, int], nbytes: int) -> Optional[torch.Tensor]:
        """The packed buffer of the last message on this (peer, direction, edge) channel
        (``slot``, see :func:`buffer_slot`), to pack into again: free, since a post first waits
        for the previous posts' sends; not one already used in this post."""
        buffer = self._send_buffers.get(slot)
        if buffer is None or slot in self._packed or buffer.numel() != nbytes:
            return None
        if any(buffer is sent for _, sent, later in self._pending_sends if later):
            return None  # a further part still in flight
        return buffer

    def _take_local(self, key: MessageKey) -> Any:
        try:
            return self._mailbox.pop(key)
        except KeyError:
            raise RuntimeError(
                f"rank {self.rank}: '{describe_key(key)}' comes from this same rank (colocated modules) but was not sent yet; "
                "send it in this exchange or an earlier one."
            ) from None

    def _plan_forward_recv(self, key: MessageKey) -> list[tuple[BridgePeer, _Source]]:
        _, peers = self._sources(key)
        sources: list[tuple[BridgePeer, _Source]] = []
        for peer in peers:
            if peer.rank == self.rank:
                sources.append((peer, (_Origin.READY, self._take_local(key))))
                continue
            channel = channel_of(peer.rank, self.rank, key, self._training)
            msg = ForwardIncoming(key, peer.rank, _order(key, peer.rank, self.rank), self.direct_leaf_bytes,
                                   channel, self._recv_cache.get(channel))
            sources.append((peer, (_Origin.REMOTE, msg)))
        return sources

    def _plan_backward_recv(self, key: MessageKey) -> list[tuple[BridgePeer, _Source]]:
        _, peers = self._targets(key)
        states = self._sent.pop(key.edge, None)
        if states is None:
            raise RuntimeError(
                f"rank {self.rank}: backward recv '{describe_key(key)}' without a forward send of the same microbatch "
                "(or its backward was already received)."
            )
        sources: list[tuple[BridgePeer, _Source]] = []
        for peer, state in zip(peers, states):
            if not state.spec.requires_grad:
                sources.append((peer, (_Origin.READY, state.spec.unflatten([None] * state.spec.num_leaves))))
            elif peer.rank == self.rank:
                sources.append((peer, (_Origin.READY, self._take_local(key))))
            else:
                msg = BackwardIncoming(key, peer.rank, _order(key, peer.rank, self.rank), self.direct_leaf_bytes,
                                        state.spec)
                sources.append((peer, (_Origin.REMOTE, msg)))
        return sources

    # --- posting and completing -------------------------------------------------------------

    def _check_initialised(self) -> None:
        if self._direct is not None:  # posted on this group already
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"rank {self.rank} must exchange messages with other ranks but torch.distributed is not "
                "initialised; initialise the process group before the first exchange."
            )

    def _post_batch(self, outgoing: list[_Outgoing], incoming: list[Incoming]) -> dict[int, "ReceiveGroup"]:
        """Post every part of ``outgoing`` and the first part of ``incoming``; return the new
        receive groups by peer.

        First parts go in one batch, in canonical order on both ends, so per-pair in-order
        matching pairs the same buffers. A changed spec's further parts (length, spec, new data)
        follow in a second batch, message by message in the same order, on
        :data:`LATER_PARTS_TAG`; the receiving end asks for them in that order when it
        completes the message (see :meth:`_complete`). Nothing on the sending end waits for them.
        """
        if not outgoing and not incoming:
            return {}
        self._check_initialised()
        if len(outgoing) > 1:
            outgoing = sorted(outgoing, key=lambda m: m.order)
        if len(incoming) > 1:
            incoming = sorted(incoming, key=lambda m: m.order)
        by_peer: dict[int, list[Incoming]] = {}
        for msg in incoming:
            by_peer.setdefault(msg.peer, []).append(msg)
        assert self._tagged_later_parts or not by_peer.keys() & self._open.keys(), \
            "post() completes a peer's open groups first"
        first = [(buffer, m.peer) for m in outgoing for buffer in m.parts[0]]
        later = [(buffer, m.peer) for m in outgoing for part in m.parts[1:] for buffer in part]
        for buffer, _ in first + later:
            self.stats.bytes_sent += buffer.numel() * buffer.element_size()
        self.stats.messages_sent += sum(len(m.parts) for m in outgoing)
        recv_parts = [part for msg in incoming for part in self._recv_parts(msg)]
        works = self._post_parts(first, recv_parts)
        self.stats.rounds += 1
        groups: dict[int, ReceiveGroup] = {}
        if len(works) == len(first) + len(recv_parts):  # one work per op (gloo)
            self._pending_sends.extend((w, buffer, False) for w, (buffer, _) in zip(works, first))
            recv_works = works[len(first):]
            for peer, msgs in by_peer.items():
                groups[peer] = ReceiveGroup(peer, msgs, [w for w, (_, p) in zip(recv_works, recv_parts) if p == peer])
        else:  # coalesced (NCCL): the works cover the whole batch (a stream wait, not a host wait)
            self._pending_sends.extend((w, None, False) for w in works)
            for peer, msgs in by_peer.items():
                groups[peer] = ReceiveGroup(peer, msgs, list(works))
        if later:
            works = self._post_parts(later, [], LATER_PARTS_TAG)
            self.stats.rounds += 1
            if len(works) == len(later):
                self._pending_sends.extend((w, buffer, True) for w, (buffer, _) in zip(works, later))
            else:
                self._pending_sends.extend((w, None, False) for w in works)
        for peer, group in groups.items():
            if not all(map(self._whole_at_once, group.messages)):
                self._open.setdefault(peer, []).append(group)
        return groups

    def _whole_at_once(self, msg: Incoming) -> bool:
        """Whether ``msg`` is whole in its first part whatever its sender sends: a gradient (never
        metadata), or with ``static_specs`` a forward message on a channel whose spec is cached
        (a sender whose spec changes raises instead). Nothing later from its peer can then be
        matched with a further part of it, so its group need not be complete first."""
        return isinstance(msg, BackwardIncoming) or (self.static_specs and msg.steady())

    def _post_parts(self, sends: list[tuple[torch.Tensor, int]],
                    recvs: list[tuple[torch.Tensor, int]], tag: int = 0) -> list[Any]:
        """Post one batch: every ``(buffer, peer)`` of ``sends`` and ``recvs``, sends first, on
        ``tag``; the works in that order (one per op), or a backend's coalesced works (NCCL).

        On CPU (gloo, which does not coalesce: ``batch_isend_irecv`` posts op by op there) the
        ops go straight to the process group (:func:`~lightning_mmpp.torch_api.direct_p2p`), the
        same calls in the same order without torch's per-op wrappers."""
        if self.device.type == "cpu":
            if self._direct is None:
                self._direct = direct_p2p(self.group)
            send, recv = self._direct
            if tag:
                return ([send(buffer, peer, tag) for buffer, peer in sends]
                        + [recv(buffer, peer, tag) for buffer, peer in recvs])
            return [send(buffer, peer) for buffer, peer in sends] + [recv(buffer, peer) for buffer, peer in recvs]
        ops = [dist.P2POp(dist.isend, buffer, peer, self.group, tag) for buffer, peer in sends]
        ops += [dist.P2POp(dist.irecv, buffer, peer, self.group, tag) for buffer, peer in recvs]
        return dist.batch_isend_irecv(ops)

    def _recv_parts(self, msg: Incoming) -> list[tuple[torch.Tensor, int]]:
        buffers = msg.next_buffers(self.device, self._recv_buffers)
        self.stats.messages_received += 1
        self.stats.bytes_received += sum(b.numel() * b.element_size() for b in buffers)
        return [(buffer, msg.peer) for buffer in buffers]

    def _complete(self, group: "ReceiveGroup") -> None:
        """Make every message of ``group`` whole: the peer's earlier open groups first (their
        further parts come first on the pair), then wait for the group's first parts, read their
        headers, and receive each changed spec's further parts (length, spec, new data) message
        by message, in the order the sender sent them."""
        if group.done:
            return
        earlier = self._open.get(group.peer, [])
        if any(g is group for g in earlier):
            while earlier[0] is not group:
                self._complete_one(earlier[0])
        self._complete_one(group)

    def _complete_one(self, group: "ReceiveGroup") -> None:
        for work in group.works:
            work.wait()
        self._advance(group.messages)
        for msg in group.messages:
            while not msg.done:
                for work in self._post_parts([], self._recv_parts(msg), LATER_PARTS_TAG):
                    work.wait()
                self.stats.rounds += 1
                self._advance([msg])
        group.done, group.works = True, []
        groups = self._open.get(group.peer)
        if groups is not None:
            groups[:] = [g for g in groups if g is not group]
            if not groups:
                del self._open[group.peer]

    def _advance(self, recvs: Sequence[Incoming]) -> None:
        if self.static_specs:  # steady-state messages are whole as received; headers read per step
            unread = [m for m in recvs if m.steady()]
            for msg in unread:
                header = msg.scalars()
                assert header is not None
                self._deferred.append((msg.key, msg.peer, header))
                msg.done = True
            recvs = [m for m in recvs if not m.done]
            if not recvs:
                return
        if len(recvs) == 1:  # one message: its header from host memory where it was pooled
            values = recvs[0].host_header()
            if values is not None:
                self._advanced(recvs[0], values)
                return
        views = [m.scalars() for m in recvs]
        present = [v for v in views if v is not None]
        # one host sync for all headers
        flat: list[int] = (present[0].tolist() if len(present) == 1 else torch.cat(present).tolist()) if present else []
        cursor = 0
        for msg, view in zip(recvs, views):
            values: list[int] = []
            if view is not None:
                values = flat[cursor : cursor + view.numel()]
                cursor += view.numel()
            self._advanced(msg, values)

    def _advanced(self, msg: Incoming, values: list[int]) -> None:
        """Move ``msg`` on by its received part's ``values``; cache a forward channel's new spec."""
        spec = msg.advance(values, self.rank)
        if spec is not None:  # a forward channel's new spec, cached for its next messages
            assert isinstance(msg, ForwardIncoming)
            self._recv_cache[msg.channel] = spec
            self.stats.metadata_exchanges += 1

    # --- assembling received payloads --------------------------------------------------------

    def _finish_forward_recv(self, key: MessageKey, sources: list[tuple[BridgePeer, _Source]]) -> Any:
        chunks: list[list[Optional[torch.Tensor]]] = []
        states: list[_PeerState] = []
        for peer, (kind, src) in sources:
            if kind is _Origin.READY:
                leaves, spec = flatten_payload(src, f"'{describe_key(key)}' on rank {self.rank}")
            else:
                assert isinstance(src, ForwardIncoming) and src.spec is not None and src.buffer is not None
                spec = src.spec
                leaves = src.leaves()
            chunks.append(leaves)
            states.append(_PeerState(peer.rank, peer.chunk, spec))
        if len(chunks) == 1:
            spec = states[0].spec
            if sources[0][1][0] is _Origin.READY:
                payload = sources[0][1][1]  # already detached, requires_grad kept, at send time
            elif spec.single_tensor is not None:  # one tensor: no tree to rebuild
                payload = chunks[0][0].detach().requires_grad_(spec.single_tensor.requires_grad)  # type: ignore[union-attr]
            else:
                payload = spec.unflatten([
                    None if t is None else t.detach().requires_grad_(meta is not None and meta.requires_grad)
                    for t, meta in zip(chunks[0], spec.leaves)
                ])
            self._received[key.edge] = (spec, states)
            return payload
        where = f"'{describe_key(key)}' on rank {self.rank}"
        slot = self._slot(key.dst_module)
        context = (
            f"{self._bridge_context(key, 'fan-in')}: replicas on ranks {[s.rank for s in states]} into replica "
            f"{slot.replica} (microbatch {key.microbatch})"
        )
        pieces = [s.spec.unflatten([None if t is None else t.detach() for t in leaves]) for s, leaves in zip(states, chunks)]
        joined = concat_payloads(
            pieces,
            self._batch_dim(key),
            context,
        )
        leaves, combined = flatten_payload(joined, where)
        wants = [any(_needs_grad(s.spec, i) for s in states) for i in range(combined.num_leaves)]
        payload = combined.unflatten([None if t is None else t.requires_grad_(w) for t, w in zip(leaves, wants)])
        _, combined = flatten_payload(payload, where)
        self._received[key.edge] = (combined, states)
        return payload

    def _finish_backward_recv(self, key: MessageKey, sources: list[tuple[BridgePeer, _Source]]) -> Any:
        grads: list[Any] = []
        for _peer, (kind, src) in sources:
            if kind is _Origin.READY:
                grads.append(src)
                continue
            assert isinstance(src, BackwardIncoming) and src.buffer is not None
            leaves = src.leaves()
            grads.append(leaves[0] if src.spec.single_tensor is not None else src.spec.unflatten(leaves))
        if len(grads) == 1:
            return grads[0]
        return concat_payloads(grads, self._batch_dim(key), self._bridge_context(key, "fan-out gradients"))


def _needs_grad(spec: PayloadSpec, index: int) -> bool:
    meta = spec.leaves[index]
    return meta is not None and meta.requires_grad
