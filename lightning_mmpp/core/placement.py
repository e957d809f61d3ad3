"""Rank-to-module placement: who holds which (module, pp stage, dp replica).

Everything here is computed from the placements and the topology alone, for any world size,
without starting processes.

Within a module's rank range the tp index varies fastest, then the dp replica (Megatron's
order): a module with ``pp=2, dp=2`` at offset 4 puts stage 0 on ranks 4 (replica 0) and 5
(replica 1), stage 1 on ranks 6 and 7; with ``tp=2`` as well, stage 0 replica 0 is ranks 4-5
(tp 0, 1), replica 1 ranks 6-7, stage 1 ranks 8-11. A stage's ranks form a dp x tp mesh.

Tensor parallelism: the ranks of one tp group (one stage, one replica) compute together and
hold replicated inputs and outputs, so the pipeline sees each tp group as one unit, its *tp
lead* (tp index 0): schedules, bridges and peers are planned between leads
(:meth:`PipelineLayout.scheduled_slots`), and the other ranks of a group follow their lead's
actions, taking what it receives by a broadcast inside the group.

Virtual stages (``virtual_stages=v``): the module's layers are split into ``pp * v`` contiguous
*stages* (chunks) and each of its ``pp`` rank positions holds ``v`` of them, not adjacent: in
the interleaved order chunk ``s`` sits on position ``s % pp`` (position ``i`` holds chunks
``i, i + pp, ...``); in the V-shape order (``v_shape=True``, for ``schedule="zbv"``) every
second group of ``pp`` chunks runs back, so position ``i`` holds chunks ``i, 2*pp - 1 - i,
2*pp + i, ...`` and the hand-off at the bottom of each V stays on one rank. Everything below
counts in stages: a :class:`StageSlot` is one chunk, ``slot.chunk`` its index among the
rank's chunks of that module (``stage // pp``), and the stage numbering runs over ``pp * v``
stages per module.

Bridges: on a DAG edge ``u -> d`` the last stage of ``u`` feeds the first stage of ``d``.
With ``dp_u == dp_d`` replica j feeds replica j. With ``dp_u = r * dp_d`` (fan-in) replicas
``j*r .. j*r+r-1`` of ``u`` feed replica j of ``d``, concatenated in replica order. With
``dp_d = r * dp_u`` (fan-out) replica i of ``u`` is split into r contiguous chunks, chunk c
going to replica ``i*r + c`` of ``d``. When one end has ``balance="items"`` the bridge is
*routed*: every replica of ``u`` connects to every replica of ``d`` and, per microbatch, sends
each the samples both hold (possibly none).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from lightning_mmpp.core.kinds import DEFAULT_NUMBERING, Numbering
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.core.topology import ModuleTopology, StageNumbering


BALANCE_CHOICES = ("samples", "items")
"""``ModulePlacement.balance``: equal shards by sample index, or shards balanced by item count."""


@dataclass(frozen=True)
class ModulePlacement:
    """How many pipeline stages and data-parallel replicas a module gets.

    Args:
        pp: pipeline stages; the module's layers are split into ``pp`` contiguous stages.
        dp: data-parallel replicas of every stage.
        rank_offset: first rank of the module's ``pp * dp`` ranks. ``None`` places the module
            right after the modules declared before it. Two modules with the same
            ``rank_offset``, ``pp`` and ``dp`` are colocated (the same ranks run both); a
            ``pp=1`` module may also sit on exactly the ranks of one stage of another module
            with its dp (``rank_offset`` = that module's offset + stage * dp).
        split_points: explicit stage boundaries, the index of the first layer of stages
            ``1 .. pp-1`` (``pp - 1`` increasing numbers). ``None`` balances the stages by
            parameter count.
        batch_dim: the batch dimension of this module's output tensors, used when a bridge
            concatenates (fan-in) or splits (fan-out) them.
        shard: shard each stage's parameters, gradients and optimizer state over its ``dp``
            replicas with FSDP2 (:mod:`lightning_mmpp.engine.sharding`); needs ``dp >= 2``.
        recompute: run each layer under activation checkpointing, so an in-flight microbatch
            keeps only its layer inputs; the layers run their forward again in the backward.
        tp: tensor-parallel ranks of every replica of every stage (consecutive ranks); the
            model's ``pipeline_parallelize`` hook splits each layer over them.
        virtual_stages: how many chunks of the module each of its ranks holds: the layers are
            split into ``pp * virtual_stages`` stages, placed interleaved (or V-shaped under
            ``schedule="zbv"``) over the ``pp`` rank positions; for the ``"interleaved_1f1b"``
            and ``"zbv"`` schedules, which cut the pipeline bubble about ``virtual_stages``
            times at the price of more transfers. ``split_points`` then gives
            ``pp * virtual_stages - 1`` boundaries.
        balance: how a microbatch's samples are assigned to the module's dp replicas:
            ``"samples"`` (equal contiguous shards, replica j taking shard j) or ``"items"``
            (contiguous shards balanced by the item counts of the batch's ``Ragged`` fields, so
            that a replica is not handed most of the images; see
            :func:`~lightning_mmpp.core.balance.item_bounds`). With ``"items"`` the bridges into
            and out of the module connect every replica with every replica of its neighbours and
            route each sample to the replica that holds it; results are unchanged. Not for a
            sink (its replicas average equal shares of the loss).
    """

    pp: int = 1
    dp: int = 1
    rank_offset: Optional[int] = None
    split_points: Optional[tuple[int, ...]] = None
    batch_dim: int = 0
    shard: bool = False
    recompute: bool = False
    tp: int = 1
    virtual_stages: int = 1
    balance: str = "samples"

    def __post_init__(self) -> None:
        if self.balance not in BALANCE_CHOICES:
            raise PipelineConfigError(
                f"ModulePlacement(balance={self.balance!r}): give one of {list(BALANCE_CHOICES)} (\"items\" assigns "
                "a ragged module's samples to its replicas by item count)."
            )
        for name in ("shard", "recompute"):
            if not isinstance(getattr(self, name), bool):
                raise PipelineConfigError(f"ModulePlacement({name}={getattr(self, name)!r}): {name} must be True or False.")
        if self.shard and self.dp < 2:
            raise PipelineConfigError(
                f"ModulePlacement(pp={self.pp}, dp={self.dp}, shard=True): with dp=1 there is nothing to shard over; "
                "give the module dp >= 2 or drop shard=True (recompute=True cuts activation memory on one replica)."
            )
        for name in ("pp", "dp", "tp", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PipelineConfigError(f"ModulePlacement({name}={value!r}): {name} must be an integer >= 1.")
        if self.rank_offset is not None and (
            not isinstance(self.rank_offset, int) or isinstance(self.rank_offset, bool) or self.rank_offset < 0
        ):
            raise PipelineConfigError(
                f"ModulePlacement(rank_offset={self.rank_offset!r}): rank_offset must be None or an integer >= 0."
            )
        if self.split_points is not None:
            stages = self.num_stages
            what = f"pp={self.pp}" + (f", virtual_stages={self.virtual_stages}" if self.virtual_stages > 1 else "")
            count = f"pp-1 = {stages - 1}" if self.virtual_stages == 1 else f"pp*virtual_stages-1 = {stages - 1}"
            try:
                points = tuple(self.split_points)
            except TypeError:
                raise PipelineConfigError(
                    f"ModulePlacement({what}, split_points={self.split_points!r}): give a tuple of "
                    f"{count} increasing layer indices > 0, e.g. split_points=(4,) for pp=2."
                ) from None
            object.__setattr__(self, "split_points", points)
            if len(points) != stages - 1 or any(not isinstance(p, int) for p in points) or any(
                b <= a for a, b in zip((0,) + points, points)
            ):
                raise PipelineConfigError(
                    f"ModulePlacement({what}, split_points={points}): give {count} increasing "
                    "layer indices > 0, the first layer of each stage after the first."
                )
        if not isinstance(self.batch_dim, int) or isinstance(self.batch_dim, bool):
            raise PipelineConfigError(f"ModulePlacement(batch_dim={self.batch_dim!r}): batch_dim must be an integer.")

    @property
    def shape(self) -> str:
        """``"pp=.., dp=.."`` (and ``", tp=.."`` when tp > 1), for messages."""
        return f"pp={self.pp}, dp={self.dp}" + (f", tp={self.tp}" if self.tp > 1 else "")

    @property
    def size(self) -> int:
        """Number of ranks the module occupies."""
        return self.pp * self.dp * self.tp

    @property
    def num_stages(self) -> int:
        """Pipeline stages (chunks) the module's layers are split into: ``pp * virtual_stages``."""
        return self.pp * self.virtual_stages

    def position(self, stage: int, v_shape: bool = False) -> int:
        """The rank position (``0 .. pp-1``) holding ``stage``: ``stage % pp`` interleaved; with
        ``v_shape`` every second group of ``pp`` stages runs back (``pp - 1 - stage % pp``)."""
        group, index = divmod(stage, self.pp)
        return self.pp - 1 - index if v_shape and group % 2 else index


@dataclass(frozen=True)
class StageSlot:
    """One stage (chunk) of one module held by a rank: ``stage`` counts the module's ``pp *
    virtual_stages`` stages, ``chunk`` is its index among the rank's chunks of the module
    (``stage // pp``; 0 without virtual stages)."""

    module: str
    stage: int
    replica: int
    tp_index: int = 0
    chunk: int = 0


@dataclass(frozen=True)
class BridgePeer:
    """One end of a cross-module transfer seen from a rank.

    ``chunk`` / ``num_chunks`` say which contiguous piece of the batch dimension this peer's
    data is: for fan-out the sender's chunk index, for fan-in the position of the sender in
    the receiver's concatenation. ``num_chunks`` is 1 when dp sizes match.
    """

    rank: int
    chunk: int
    num_chunks: int


def _beside_one_stage(offset_a: int, a: ModulePlacement, offset_b: int, b: ModulePlacement) -> bool:
    """Whether one of two overlapping modules is a ``pp=1`` module on exactly the ranks of one
    stage of the other (same dp): an adapter or projector beside, say, the LM's first stage."""
    for (o_small, small), (o_big, big) in (((offset_a, a), (offset_b, b)), ((offset_b, b), (offset_a, a))):
        if small.pp == 1 and (small.dp, small.tp) == (big.dp, big.tp) and big.pp > 1:
            shift = o_small - o_big
            width = big.dp * big.tp
            if shift % width == 0 and 0 <= shift // width < big.pp:
                return True
    return False


class PipelineLayout:
    """The placement of every module on ranks ``0 .. world_size - 1``.

    Args:
        placements: ``{module: ModulePlacement}``; declaration order drives automatic offsets.
        topology: the module DAG, as a dict or a :class:`ModuleTopology`.
        v_shape: place the chunks of modules with ``virtual_stages > 1`` in the V-shape order
            (``schedule="zbv"``) instead of interleaved (see the module docstring).
    """

    def __init__(
        self,
        placements: Mapping[str, ModulePlacement],
        topology: Mapping[str, Sequence[str]] | ModuleTopology,
        v_shape: bool = False,
    ) -> None:
        self.v_shape = bool(v_shape)
        if not isinstance(placements, Mapping) or not placements:
            raise PipelineConfigError(
                "placements must be a non-empty dict {module: ModulePlacement(...)}, e.g. "
                "{'vision': ModulePlacement(pp=1, dp=2), 'llm': ModulePlacement(pp=2)}."
            )
        for module, placement in placements.items():
            if not isinstance(placement, ModulePlacement):
                raise PipelineConfigError(
                    f"placements[{module!r}] is {placement!r}; wrap it as ModulePlacement(pp=..., dp=...)."
                )
        self.topology = topology if isinstance(topology, ModuleTopology) else ModuleTopology(topology)
        unplaced = [m for m in self.topology.modules if m not in placements]
        if unplaced:
            raise PipelineConfigError(
                f"module(s) {unplaced} appear in the topology but have no placement; add "
                + ", ".join(f"{m!r}: ModulePlacement(pp=1, dp=1)" for m in unplaced)
                + " to placements."
            )
        unknown = [m for m in placements if m not in self.topology.modules]
        if unknown:
            raise PipelineConfigError(
                f"placement(s) for {unknown} have no topology entry; add "
                + ", ".join(f"{m!r}: [downstream modules]" for m in unknown)
                + " to the topology or remove the placement."
            )
        self.placements: dict[str, ModulePlacement] = dict(placements)
        self.offsets = self._assign_offsets()
        self.world_size = max(self.offsets[m] + p.size for m, p in self.placements.items())
        self._slots = self._build_slots()
        self._check_bridges()
        self._check_balance()
        self.numbering: StageNumbering = self.topology.stage_numbering(
            {m: p.num_stages for m, p in self.placements.items()}
        )

    # --- construction ----------------------------------------------------------------------

    def _assign_offsets(self) -> dict[str, int]:
        return assign_offsets(self.placements)

    def _build_slots(self) -> dict[int, tuple[StageSlot, ...]]:
        slots: dict[int, list[StageSlot]] = {r: [] for r in range(self.world_size)}
        for module in self.topology.order:
            placement = self.placements[module]
            for stage in range(placement.num_stages):
                for replica in range(placement.dp):
                    for t in range(placement.tp):
                        slot = StageSlot(module, stage, replica, t, stage // placement.pp)
                        slots[self.rank_of(module, stage, replica, t)].append(slot)
        return {r: tuple(s) for r, s in slots.items()}

    def _check_bridges(self) -> None:
        for up, down in self.topology.edges():
            du, dd = self.placements[up].dp, self.placements[down].dp
            if max(du, dd) % min(du, dd):
                raise PipelineConfigError(
                    f"edge {up!r} -> {down!r}: dp sizes {du} and {dd} do not divide one another, so the bridge "
                    f"cannot fan in or out whole shards. Make one dp a multiple of the other (e.g. {up!r} dp="
                    f"{dd * max(1, du // dd)} or {down!r} dp={du})."
                )

    def _check_balance(self) -> None:
        if not any(True for _ in self.topology.edges()):
            return  # no wiring yet (the strategy's placeholder before the model declares it)
        for module in self.topology.sinks:
            if self.placements[module].balance != "samples":
                raise PipelineConfigError(
                    f"ModulePlacement(balance={self.placements[module].balance!r}) on {module!r}, a sink: the loss "
                    "module's replicas each take an equal share of the batch (the step's loss averages them); "
                    "use balance=\"items\" on the modules that consume the ragged items (the encoders)."
                )

    # --- queries ---------------------------------------------------------------------------

    @property
    def balanced_modules(self) -> frozenset[str]:
        """Modules whose replicas take samples by item count (``balance="items"``, ``dp > 1``)."""
        return frozenset(m for m, p in self.placements.items() if p.balance == "items" and p.dp > 1)

    def routed(self, up: str, down: str) -> bool:
        """Whether the bridge ``up -> down`` routes samples by a per-microbatch assignment (one end
        is balanced by items): every replica of one end then connects to every replica of the other."""
        return bool({up, down} & self.balanced_modules)

    @property
    def modules(self) -> tuple[str, ...]:
        """Modules in topological order."""
        return self.topology.order

    @property
    def max_dp(self) -> int:
        return max(p.dp for p in self.placements.values())

    @property
    def batch_divisor(self) -> int:
        """What every microbatch must divide by: the lcm of the modules' dp sizes (each replica
        of every module takes an equal shard)."""
        return math.lcm(*(p.dp for p in self.placements.values()))

    @property
    def depth(self) -> int:
        return self.numbering.depth

    def check_world_size(self, world_size: int) -> None:
        """Raise unless the placements cover exactly ``world_size`` ranks."""
        if world_size != self.world_size:
            needs = ", ".join(
                f"{m}: {p.pp}x{p.dp}{f'x{p.tp}' if p.tp > 1 else ''} at rank {self.offsets[m]}" for m, p in self.placements.items()
            )
            raise PipelineConfigError(
                f"the placements need {self.world_size} ranks ({needs}) but the world has {world_size}. "
                f"Launch with devices={self.world_size} (x num_nodes) or change pp/dp/tp."
            )

    @property
    def virtual(self) -> bool:
        """Whether some module has ``virtual_stages > 1`` (a rank may hold several of its chunks)."""
        return any(p.virtual_stages > 1 for p in self.placements.values())

    def num_stages(self, module: str) -> int:
        """The module's pipeline stages: ``pp * virtual_stages``."""
        return self.placements[module].num_stages

    def rank_of(self, module: str, stage: int, replica: int, tp_index: int = 0) -> int:
        """The rank of one (stage, replica, tp index) of ``module``; tp index 0 is the group's lead.
        ``stage`` counts the ``pp * virtual_stages`` stages (chunks)."""
        placement = self.placements[module]
        if not (0 <= stage < placement.num_stages and 0 <= replica < placement.dp and 0 <= tp_index < placement.tp):
            raise IndexError(f"{module!r} has no stage {stage} replica {replica} tp index {tp_index}")
        position = placement.position(stage, self.v_shape)
        return self.offsets[module] + (position * placement.dp + replica) * placement.tp + tp_index

    def module_ranks(self, module: str) -> range:
        return range(self.offsets[module], self.offsets[module] + self.placements[module].size)

    def slots(self, rank: int) -> tuple[StageSlot, ...]:
        """What ``rank`` holds, one slot per module and chunk, in topological order (a module's
        chunks in stage order)."""
        return self._slots[rank]

    def slot(self, rank: int, module: str, chunk: int = 0) -> Optional[StageSlot]:
        """The ``chunk``-th stage of ``module`` that ``rank`` holds (its only one without virtual
        stages), or None."""
        return next((s for s in self._slots[rank] if s.module == module and s.chunk == chunk), None)

    def chunk_slots(self, rank: int, module: str) -> tuple[StageSlot, ...]:
        """Every stage of ``module`` that ``rank`` holds, in stage order (``virtual_stages`` of them)."""
        return tuple(s for s in self._slots[rank] if s.module == module)

    def chunk_of(self, module: str, stage: int) -> int:
        """The index of ``stage`` among the chunks of ``module`` on the rank holding it."""
        return stage // self.placements[module].pp

    def peer_chunk(self, slot: StageSlot, other: str, downstream: bool) -> int:
        """The chunk, on its rank, of the neighbour of ``slot`` in module ``other`` (as listed by
        :meth:`forward_targets` when ``downstream``, else :meth:`forward_sources`)."""
        if other == slot.module:
            return self.chunk_of(other, slot.stage + (1 if downstream else -1))
        return 0 if downstream else self.chunk_of(other, self.num_stages(other) - 1)

    def tp_index(self, rank: int) -> int:
        """The rank's index in its tp groups (0 on a tp lead, and wherever ``tp == 1``). Modules
        that share a rank have the same ``tp``, so the index is the same for all of them."""
        return self._slots[rank][0].tp_index

    def tp_lead(self, rank: int) -> int:
        """The rank whose pipeline actions ``rank`` runs: the first rank of its tp group."""
        return rank - self.tp_index(rank)

    def scheduled_slots(self, rank: int) -> tuple[StageSlot, ...]:
        """The slots the schedule plans for ``rank``: all of them on a tp lead, none on the other
        ranks of a tp group (they run their lead's actions)."""
        return self._slots[rank] if self.tp_index(rank) == 0 else ()

    @property
    def max_tp(self) -> int:
        return max(p.tp for p in self.placements.values())

    def is_first_stage(self, slot: StageSlot) -> bool:
        return slot.stage == 0

    def is_last_stage(self, slot: StageSlot) -> bool:
        return slot.stage == self.placements[slot.module].num_stages - 1

    def is_loss_stage(self, slot: StageSlot) -> bool:
        """Whether ``slot`` computes a loss: the last stage of a sink module."""
        return self.is_last_stage(slot) and not self.topology.downstream(slot.module)

    def no_backward_modules(self, frozen: Iterable[str]) -> frozenset[str]:
        """Modules that run no backward given the ``frozen`` ones (see
        :meth:`ModuleTopology.no_backward_modules`)."""
        return self.topology.no_backward_modules(frozen)

    def sends_input_gradients(self, slot: StageSlot, no_backward_modules: Iterable[str]) -> bool:
        """Whether the backward of ``slot`` has gradients to send upstream: some producer of its
        input runs a backward. ``False`` on the first stage of a source module."""
        no_backward = set(no_backward_modules)
        return any(src not in no_backward for src, _ in self.forward_sources(slot))

    def stage_index(self, module: str, stage: int, numbering: Numbering | str = DEFAULT_NUMBERING) -> int:
        """The global stage index of ``module``'s stage ``stage`` (ALAP, as the runtime uses, by default)."""
        return self.numbering.index(module, stage, numbering)

    def pp_prev(self, slot: StageSlot) -> Optional[int]:
        """Rank of the previous stage of the same module and replica, or None on stage 0."""
        return None if slot.stage == 0 else self.rank_of(slot.module, slot.stage - 1, slot.replica)

    def pp_next(self, slot: StageSlot) -> Optional[int]:
        """Rank of the next stage of the same module and replica, or None on the last stage."""
        if self.is_last_stage(slot):
            return None
        return self.rank_of(slot.module, slot.stage + 1, slot.replica)

    def dp_group(self, module: str, stage: int, tp_index: int = 0) -> tuple[int, ...]:
        """Ranks holding the replicas of one stage of a module at one tp index, in replica order."""
        return tuple(self.rank_of(module, stage, j, tp_index) for j in range(self.placements[module].dp))

    def dp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every distinct dp group with more than one rank, sorted (the order to create them in)."""
        groups = {
            self.dp_group(m, s, t)
            for m, p in self.placements.items()
            for s in range(p.pp)  # a position's chunks share its dp group
            for t in range(p.tp)
            if p.dp > 1
        }
        return tuple(sorted(groups))

    def tp_group(self, module: str, stage: int, replica: int) -> tuple[int, ...]:
        """Ranks of one replica of one stage of a module (consecutive), in tp order."""
        return tuple(self.rank_of(module, stage, replica, t) for t in range(self.placements[module].tp))

    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every distinct tp group with more than one rank, sorted (the order to create them in)."""
        groups = {
            self.tp_group(m, s, j)
            for m, p in self.placements.items()
            for s in range(p.pp)
            for j in range(p.dp)
            if p.tp > 1
        }
        return tuple(sorted(groups))

    def stage_mesh(self, module: str, stage: int) -> tuple[tuple[int, ...], ...]:
        """The ranks of one stage as a dp x tp grid: row j is replica j's tp group."""
        return tuple(self.tp_group(module, stage, j) for j in range(self.placements[module].dp))

    def bridge_targets(self, up: str, down: str, replica: int) -> tuple[BridgePeer, ...]:
        """Receivers of the last stage of ``up`` replica ``replica`` on edge ``up -> down``."""
        return self._bridge_peers(up, down, replica, downstream=True)

    def bridge_sources(self, up: str, down: str, replica: int) -> tuple[BridgePeer, ...]:
        """Senders into the first stage of ``down`` replica ``replica`` on edge ``up -> down``."""
        return self._bridge_peers(down, up, replica, downstream=False)

    def _bridge_peers(self, module: str, other: str, replica: int, downstream: bool) -> tuple[BridgePeer, ...]:
        """The peers of ``module``'s ``replica`` in ``other`` across the edge between them: the
        first stage of ``other`` when it is downstream, its last stage when it is upstream.

        Seen from the end with more replicas, ``ratio`` of them share one peer, and this one is
        chunk ``replica % ratio`` of it; seen from the end with fewer, the peers are ``ratio``
        consecutive replicas, chunks ``0 .. ratio-1``. On a routed bridge (:meth:`routed`) the
        peers are all replicas of ``other``, chunk ``c`` being replica ``c``.
        """
        stage = 0 if downstream else self.placements[other].num_stages - 1
        mine, theirs = self.placements[module].dp, self.placements[other].dp
        if self.routed(module, other):  # every replica: chunk c = the other end's replica c
            return tuple(BridgePeer(self.rank_of(other, stage, c), c, theirs) for c in range(theirs))
        if mine >= theirs:
            ratio = mine // theirs
            return (BridgePeer(self.rank_of(other, stage, replica // ratio), replica % ratio, ratio),)
        ratio = theirs // mine
        return tuple(BridgePeer(self.rank_of(other, stage, replica * ratio + c), c, ratio) for c in range(ratio))

    def forward_targets(self, slot: StageSlot) -> tuple[tuple[str, BridgePeer], ...]:
        """Where the output of ``slot`` goes: ``(consumer module, peer)`` pairs.

        The next stage of the same module, or, on a last stage, the first stage of every
        downstream module (several peers on fan-out). Empty on the last stage of a sink.
        """
        return self._neighbours(slot, downstream=True)

    def forward_sources(self, slot: StageSlot) -> tuple[tuple[str, BridgePeer], ...]:
        """Where the input of ``slot`` comes from: ``(producer module, peer)`` pairs.

        The previous stage of the same module, or, on a first stage, the last stage of every
        upstream module (several peers on fan-in). Empty on the first stage of a source.
        """
        return self._neighbours(slot, downstream=False)

    def _neighbours(self, slot: StageSlot, downstream: bool) -> tuple[tuple[str, BridgePeer], ...]:
        """The adjacent stage of ``slot``'s own module, else the bridge peers in every module
        next to it, on its downstream or its upstream side."""
        adjacent = self.pp_next(slot) if downstream else self.pp_prev(slot)
        if adjacent is not None:
            return ((slot.module, BridgePeer(adjacent, 0, 1)),)
        others = self.topology.downstream(slot.module) if downstream else self.topology.upstream(slot.module)
        return tuple(
            (other, peer) for other in others for peer in self._bridge_peers(slot.module, other, slot.replica, downstream)
        )

    def batch_shard(self, module: str, replica: int, batch_size: int) -> slice:
        """The slice of a microbatch of ``batch_size`` samples that a replica of ``module`` processes."""
        dp = self.placements[module].dp
        if batch_size % dp:
            raise PipelineConfigError(
                f"a microbatch of {batch_size} samples cannot be split over {module!r} dp={dp}; make the "
                f"microbatch size (global batch / num_microbatches) a multiple of {self.max_dp}."
            )
        shard = batch_size // dp
        return slice(replica * shard, (replica + 1) * shard)

    # --- display ---------------------------------------------------------------------------

    def table(self, numbering: Numbering | str = DEFAULT_NUMBERING) -> str:
        """A human-readable placement table, one line per (rank, module).

        ``global-stage`` is the stage index under ``numbering``: by default ALAP, the one the
        runtime's schedules use unless the strategy or engine was given ``stage_numbering="asap"``.
        """
        numbering = Numbering.parse(numbering)
        with_tp = self.max_tp > 1
        rows = [("rank", "module", "stage") + (("chunk",) if self.virtual else ()) + ("replica",)
                + (("tp",) if with_tp else ()) + ("global-stage",)]
        for rank in range(self.world_size):
            for slot in self._slots[rank]:
                p = self.placements[slot.module]
                rows.append((
                    str(rank),
                    slot.module,
                    f"{slot.stage}/{p.num_stages}",
                    *((f"{slot.chunk}/{p.virtual_stages}",) if self.virtual else ()),
                    f"{slot.replica}/{p.dp}",
                    *((f"{slot.tp_index}/{p.tp}",) if with_tp else ()),
                    str(self.stage_index(slot.module, slot.stage, numbering)),
                ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"PipelineLayout(world_size={self.world_size}, modules={list(self.placements)})"


def assign_offsets(placements: Mapping[str, ModulePlacement]) -> dict[str, int]:
    """Each module's first rank: consecutive ranges in declaration order unless ``rank_offset`` is
    given; overlaps other than colocation and gaps are configuration errors. The topology plays no
    part, so the world size is known from the placements alone."""
    offsets: dict[str, int] = {}
    cursor = 0
    for module, placement in placements.items():
        offset = cursor if placement.rank_offset is None else placement.rank_offset
        offsets[module] = offset
        cursor = max(cursor, offset + placement.size)
    owner: dict[int, str] = {}
    for module, placement in placements.items():
        for rank in range(offsets[module], offsets[module] + placement.size):
            other = owner.get(rank)
            if other is None:
                owner[rank] = module
                continue
            a, b = placements[other], placement
            same_ranks = (offsets[other], a.pp, a.dp, a.tp) == (offsets[module], b.pp, b.dp, b.tp)
            if not same_ranks and not _beside_one_stage(offsets[other], a, offsets[module], b):
                raise PipelineConfigError(
                    f"modules {other!r} (ranks {offsets[other]}-{offsets[other] + a.size - 1}, {a.shape}) and "
                    f"{module!r} (ranks {offsets[module]}-{offsets[module] + b.size - 1}, {b.shape}) overlap on rank {rank}. Colocated modules need the same "
                    "rank_offset, pp, dp and tp, or a pp=1 module with the other's dp and tp on exactly the "
                    "ranks of one of its stages; otherwise give them disjoint rank ranges."
                )
    world = max(offsets[m] + p.size for m, p in placements.items())
    empty = [r for r in range(world) if r not in owner]
    if empty:
        raise PipelineConfigError(
            f"rank(s) {empty} hold no module: the placements leave a gap. Adjust rank_offset so the "
            f"modules cover ranks 0-{world - 1} without holes."
        )
    return offsets


def placements_world_size(placements: Mapping[str, ModulePlacement]) -> int:
    """How many ranks ``placements`` need (checked as :class:`PipelineLayout` checks them)."""
    offsets = assign_offsets(placements)
    return max(offsets[m] + p.size for m, p in placements.items())


def placements_table(placements: Mapping[str, ModulePlacement]) -> str:
    """One line per module: its ranks, pp and dp, tp when a module has tp > 1 and the chunks per
    rank when a module has virtual stages (what is known before the topology)."""
    offsets = assign_offsets(placements)
    with_tp = any(p.tp > 1 for p in placements.values())
    virtual = any(p.virtual_stages > 1 for p in placements.values())
    rows = [("module", "ranks", "pp", "dp") + (("tp",) if with_tp else ()) + (("chunks/rank",) if virtual else ())]
    for module, p in placements.items():
        rows.append((module, f"{offsets[module]}-{offsets[module] + p.size - 1}", str(p.pp), str(p.dp))
                    + ((str(p.tp),) if with_tp else ()) + ((str(p.virtual_stages),) if virtual else ()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
