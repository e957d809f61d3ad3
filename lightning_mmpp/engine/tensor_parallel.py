"""Tensor parallelism inside a module's stages: the model's hook, the meshes, and the tp relay.

``ModulePlacement(tp=t)``: every replica of every stage of the module runs on ``t`` consecutive
ranks, a *tp group*. Torch does the splitting: the engine builds a
:class:`~torch.distributed.device_mesh.DeviceMesh` over the group and calls the model's hook
``pipeline_parallelize(module, index, layer, tp_mesh)`` for every layer of the stages the rank
holds, after construction (every tp rank materialises or loads the whole layer, with the same
values; a meta-built layer is split as soon as it is built, before the next one is allocated)
and before FSDP2 sharding; the hook typically calls
``torch.distributed.tensor.parallel.parallelize_module(layer, tp_mesh, plan)``, which replaces
the layer's parameters by ``DTensor`` shards. With ``shard=True`` the stage's mesh is
two-dimensional (``dp x tp``, :meth:`StageMeshes.dp_mesh` feeds ``fully_shard``), as FSDP2
needs for 2-D parallelism.

Pipeline transfers: a stage's input and output are replicated over its tp group, so the
pipeline treats the group as one unit, its lead (tp index 0): the schedule plans only the
leads, and only leads send and receive between stages and modules, over the same bridges as
without tp (fan-in, fan-out, routed). :class:`TensorParallelRelay` hands what a lead receives
(activations in the forward, output gradients in the backward) to the other ranks of its group
with a broadcast inside the group, where the payload is consumed; they run their lead's actions
and send nothing. So a boundary moves one copy of an activation per tp group, not ``t``, and a
gradient back the same way. The gradients the other ranks compute for their inputs equal the
lead's (torch's parallel styles all-reduce a replicated input's gradient) and are dropped.

Hand-written because torch has no notion of a pipeline boundary between meshes of different
shapes: ``torch.distributed.pipelining`` sends rank-to-rank between stages of equal layout.
"""

from __future__ import annotations

import warnings
from collections.abc import Container, Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_mmpp.core.actions import Direction, MessageKey
from lightning_mmpp.torch_api import tree_leaves, wait_collective
from lightning_mmpp.core.placement import PipelineLayout
from lightning_mmpp.engine.payload import PayloadSpec, flatten_payload
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.model.partition import StageRunner

__all__ = [
    "HOOK",
    "StageMeshes",
    "TensorParallelRelay",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "counts_on_this_tp_rank",
    "parallelize_layer",
]

HOOK = "pipeline_parallelize"
"""The model's hook: ``pipeline_parallelize(module, index, layer, tp_mesh)``."""

_TP_PREFIX = "tp_"  # mesh dimension names of tp groups start with it (dp ones with "dp_")


def check_tensor_parallel(model: Any, layout: PipelineLayout, tied_modules: Sequence[str] = ()) -> None:
    """User errors of ``tp`` that need only the model's class: raised on every rank before any collective."""
    wanted = sorted(m for m, p in layout.placements.items() if p.tp > 1)
    if not wanted:
        return
    if not callable(getattr(model, HOOK, None)):
        raise PipelineConfigError(
            f"modules {wanted} have tp > 1 but {type(model).__name__} has no `{HOOK}(self, module, index, layer, "
            "tp_mesh)` hook; define it (it typically calls torch.distributed.tensor.parallel.parallelize_module("
            "layer, tp_mesh, plan)) or set tp=1."
        )
    tied = sorted(set(tied_modules) & set(wanted))
    if tied:
        raise PipelineConfigError(
            f"modules {tied} have tp > 1 and a parameter tied across stages or modules; a tied parameter keeps one "
            "whole copy per owning stage, which tensor parallelism would split. Untie it or set tp=1 on those modules."
        )


def counts_on_this_tp_rank(param: torch.Tensor, tp_index: int) -> bool:
    """Whether this rank's part of ``param`` enters the global gradient norm: a part split over
    the tp group counts on every tp rank, a part replicated over it on the lead only."""
    if tp_index == 0:
        return True
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    return any(name.startswith(_TP_PREFIX) and isinstance(placement, Shard)
               for name, placement in zip(names, param.placements))


class StageMeshes:
    """The device meshes of this rank's tp stages (one tp group and one dp group per rank at most).

    Args:
        layout: the placement.
        rank: this process's global rank.
        dp_groups: ``{dp ranks: process group}`` (every dp group of the layout).
        tp_groups: ``{tp ranks: process group}`` (every tp group of the layout).
        device: this rank's device.
    """

    def __init__(self, layout: PipelineLayout, rank: int, dp_groups: Mapping[tuple[int, ...], Any],
                 tp_groups: Mapping[tuple[int, ...], Any], device: torch.device) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        self._tp: dict[str, Any] = {}
        self._dp: dict[str, Any] = {}
        for slot in layout.slots(rank):
            placement = layout.placements[slot.module]
            if placement.tp == 1:
                continue
            tp_group = tp_groups[layout.tp_group(slot.module, slot.stage, slot.replica)]
            tp_name = f"{_TP_PREFIX}{tp_group.group_name}"
            if placement.shard:  # FSDP2 over dp needs dp and tp as dimensions of one parent mesh
                dp_group = dp_groups[layout.dp_group(slot.module, slot.stage, slot.tp_index)]
                dp_name = f"dp_{dp_group.group_name}"
                mesh = DeviceMesh.from_group(
                    [dp_group, tp_group], device.type, mesh=torch.tensor(layout.stage_mesh(slot.module, slot.stage)),
                    mesh_dim_names=(dp_name, tp_name),
                )
                self._tp[slot.module], self._dp[slot.module] = mesh[tp_name], mesh[dp_name]
            else:
                self._tp[slot.module] = DeviceMesh.from_group(tp_group, device.type, mesh_dim_names=(tp_name,))

    def tp_mesh(self, module: str) -> Optional[Any]:
        """The tp mesh of this rank's stage of ``module`` (``None`` where tp == 1)."""
        return self._tp.get(module)

    def dp_mesh(self, module: str) -> Optional[Any]:
        """The dp dimension of a sharded tp stage's 2-D mesh (``None`` elsewhere)."""
        return self._dp.get(module)


def apply_tensor_parallel(
    model: Any, layout: PipelineLayout, runners: Mapping[str, StageRunner], meshes: StageMeshes,
    done: Container[int] = (),
) -> dict[int, nn.Parameter]:
    """Call the model's hook on every layer of this rank's tp stages but those in ``done`` (ids of
    layers split while built); return ``{id(old parameter): new parameter}`` (``parallelize_module``
    replaces parameters by DTensor ones).

    Errors are returned to the caller on this rank only; :func:`agree_on_errors` raises them everywhere.
    """
    replaced: dict[int, nn.Parameter] = {}
    for module, runner in runners.items():
        mesh = meshes.tp_mesh(module)
        if mesh is None:
            continue
        for i, layer in enumerate(runner.layers):
            if id(layer) not in done:
                replaced.update(parallelize_layer(model, module, runner.first_layer + i, layer, mesh))
    return replaced


def parallelize_layer(model: Any, module: str, index: int, layer: nn.Module, tp_mesh: Any) -> dict[int, nn.Parameter]:
    """Call the model's hook on one layer (global layer ``index`` of ``module``); return
    ``{id(old parameter): new parameter}``. A plan key that resolves to no submodule (torch
    warns) is an error naming the layer."""
    before = dict(layer.named_parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        getattr(model, HOOK)(module, index, layer, tp_mesh)
    unresolved = [str(w.message).split(":")[0] for w in caught if "could not be resolved" in str(w.message)]
    if unresolved:
        raise PipelineConfigError(
            f"{type(model).__name__}.{HOOK}({module!r}, {index}, ...): the plan names submodules that "
            f"layer {type(layer).__name__} does not have ({unresolved[0]}); fix the plan's keys for this layer."
        )
    after = dict(layer.named_parameters())
    return {id(old): after[name] for name, old in before.items() if after.get(name) is not None
            and after[name] is not old}


def agree_on_errors(error: Optional[BaseException], world_size: int) -> None:
    """Raise ``error``'s message on every rank if any rank has one (one object all-gather)."""
    message = None if error is None else f"{type(error).__name__}: {error}"
    if world_size == 1:
        found = [message]
    else:
        found = [None] * world_size
        dist.all_gather_object(found, message)
    first = next(((r, m) for r, m in enumerate(found) if m is not None), None)
    if first is None:
        return
    if error is not None:
        raise error
    raise PipelineConfigError(f"rank {first[0]} failed to apply tensor parallelism: {first[1]}")


class TensorParallelRelay:
    """The communicator of a rank in a tp group: the lead's transfers, relayed inside the group.

    Wraps the rank's :class:`~lightning_mmpp.engine.comm.MultiModuleCommunicator` (every other
    attribute is the wrapped one's). On the lead, :meth:`post` posts as usual and :meth:`take`
    broadcasts the payload to the group; on the other ranks :meth:`post` sends nothing and
    :meth:`take` receives the broadcast. Every rank of a group runs the same actions, so the
    broadcasts happen in the same order on all of them. A payload's spec (structure, shapes,
    dtypes, ``requires_grad``) is broadcast only when it differs from the channel's last one;
    a one-element header says whether it does.

    Args:
        inner: the rank's communicator.
        group: the tp process group; ``ranks``: its ranks, the lead first.
        device: where the broadcast buffers live.
    """

    def __init__(self, inner: Any, group: Any, ranks: Sequence[int], rank: int, device: torch.device) -> None:
        self.inner = inner
        self.group = group
        self.lead = ranks[0]
        self.is_lead = rank == ranks[0]
        self.device = device
        self._specs: dict[tuple[Direction, str, str, bool], PayloadSpec] = {}
        self._training = True
        self.relayed_bytes = 0  # payload bytes this rank broadcast (lead) or received (others)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "routing":  # the engine sets the step's sample routing on the communicator
            setattr(self.inner, name, value)
        else:
            object.__setattr__(self, name, value)

    def begin_step(self, training: bool) -> None:
        self._training = training
        self.inner.begin_step(training)

    def post(self, sends: Mapping[MessageKey, Any], recvs: Sequence[MessageKey]) -> None:
        if self.is_lead:
            self.inner.post(sends, recvs)
            return
        for payload in sends.values():  # dropped here, sent by the lead: finish the collectives behind them
            for leaf in tree_leaves(payload):
                wait_collective(leaf)

    def post_ahead(self, key: MessageKey) -> bool:
        return self.is_lead and self.inner.post_ahead(key)  # the others receive nothing but the relay

    def take(self, key: MessageKey) -> Any:
        payload = self.inner.take(key) if self.is_lead else None
        return self._relay(key, payload)

    def exchange(self, sends: Mapping[MessageKey, Any], recvs: Sequence[MessageKey]) -> dict[MessageKey, Any]:
        recvs = list(recvs)
        self.post(sends, recvs)
        return {key: self.take(key) for key in recvs}

    def _relay(self, key: MessageKey, payload: Any) -> Any:
        channel = (key.direction, key.src_module, key.dst_module, self._training)
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        if self.is_lead:
            leaves, spec = flatten_payload(payload, f"the {key.direction.value} message {key.src_module}->"
                                                    f"{key.dst_module}")
            encoded = spec.to_bytes() if self._specs.get(channel) != spec else b""
            header[0] = len(encoded)
        dist.broadcast(header, src=self.lead, group=self.group)
        size = int(header[0])
        if size:
            buffer = (torch.frombuffer(bytearray(encoded), dtype=torch.uint8).to(self.device) if self.is_lead
                      else torch.empty(size, dtype=torch.uint8, device=self.device))
            dist.broadcast(buffer, src=self.lead, group=self.group)
            if not self.is_lead:
                spec = PayloadSpec.from_bytes(bytes(buffer.cpu().numpy().tobytes()))
            self._specs[channel] = spec
        spec = self._specs[channel]
        if not self.is_lead:
            leaves = [None if meta is None else torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
                      for meta in spec.leaves]
        for leaf in leaves:
            if leaf is not None:
                dist.broadcast(leaf.detach(), src=self.lead, group=self.group)
                self.relayed_bytes += leaf.numel() * leaf.element_size()
        if self.is_lead:
            return payload
        leaves = [None if meta is None else leaf.requires_grad_(meta.requires_grad)
                  for leaf, meta in zip(leaves, spec.leaves)]
        return spec.unflatten(leaves)
