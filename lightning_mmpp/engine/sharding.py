"""The memory levers of a module's stages: FSDP2 sharding over the dp group, and activation recompute.

``ModulePlacement(shard=True)``: every layer of a stage (the unit the partitioner splits
modules into) becomes its own FSDP2 unit, ``fully_shard`` on a one-dimensional
:class:`~torch.distributed.device_mesh.DeviceMesh` made from the stage's dp group
(``DeviceMesh.from_group``, so gloo and NCCL alike). A layer's parameters are all-gathered for
its forward and again for its backward, and resharded after each (FSDP2's defaults);
parameters, gradients and optimizer state live as ``DTensor`` shards, 1/dp per rank.

Gradient reduction happens once per step, not once per microbatch: before each backward of a
sharded stage the runtime says whether it is the stage's last backward of the step
(:meth:`ShardedStage.before_backward`); earlier backwards accumulate unsharded gradients
locally (``set_requires_gradient_sync(False)``, what ``torch.distributed.pipelining`` stages
do), the last one reduce-scatters them. The reduction *sums* over the replicas
(``set_gradient_divide_factor(1.0)``): the runtime pre-scales every loss so that the sum is the
gradient of the global mean loss, as for unsharded modules.

``ModulePlacement(recompute=True)``: each layer's forward runs under
``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)``, so an
in-flight microbatch keeps only its layer inputs, and recomputing gives bitwise the same
values (dropout included). The layer's ``forward`` is wrapped on the instance rather than the
layer replaced by a wrapper module, so parameter names, state dicts and checkpoints do not
change.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_mmpp.core.kinds import ScheduleName
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.model.partition import StageRunner

__all__ = ["ShardedStage", "enable_recompute", "is_sharded", "mixed_precision_policy", "shard_stage"]

_RECOMPUTE_FLAG = "_mmpp_recompute"


def enable_recompute(layer: nn.Module) -> None:
    """Run ``layer``'s forward under non-reentrant activation checkpointing (idempotent)."""
    if getattr(layer, _RECOMPUTE_FLAG, False):
        return
    inner = layer.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing to save: checkpointing would only cost a call
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    layer.forward = forward  # type: ignore[method-assign]
    setattr(layer, _RECOMPUTE_FLAG, True)


def is_sharded(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (a parameter or gradient of a sharded stage)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def mixed_precision_policy(precision: str) -> Optional[Any]:
    """FSDP2's :class:`MixedPrecisionPolicy` for a Lightning precision string (``None``: keep dtypes).

    ``"bf16-mixed"``: parameters all-gathered and computed in bf16, gradients reduced in fp32
    (the fp32 shards stay the optimizer's). ``"bf16-true"`` / ``"16-true"``: the module is
    already cast by the precision plugin, so the shards are in that dtype and no policy is needed.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


class ShardedStage:
    """The FSDP2 units (one per layer with parameters) of one sharded stage on this rank."""

    def __init__(self, module: str, units: Sequence[nn.Module]) -> None:
        self.module = module
        self.units = list(units)

    def before_backward(self, last: bool) -> None:
        """Reduce-scatter gradients in this backward only if it is the stage's last of the step."""
        for unit in self.units:
            unit.set_requires_gradient_sync(last)  # type: ignore[operator]


def shard_stage(
    runner: StageRunner, mesh: Any, mp_policy: Optional[Any] = None
) -> tuple[ShardedStage, dict[int, nn.Parameter]]:
    """``fully_shard`` every layer of ``runner`` that has parameters over ``mesh`` (the dp group).

    Returns the sharded stage and ``{id(old parameter): new parameter}``: FSDP2 replaces each
    parameter by a DTensor parameter, so optimizers built on the old ones must be pointed at the
    new ones (:func:`replace_optimizer_parameters`).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    units = []
    replaced: dict[int, nn.Parameter] = {}
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in runner.layers:
        before = dict(layer.named_parameters())
        if not before:
            continue
        if isinstance(layer, FSDPModule):  # a re-fit of a model this strategy sharded already
            units.append(layer)
            continue
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, **kwargs)
        layer.set_gradient_divide_factor(1.0)  # a sum over replicas: losses are pre-scaled
        layer.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
        after = dict(layer.named_parameters())
        for name, old in before.items():
            replaced[id(old)] = after[name]
        units.append(layer)
    return ShardedStage(runner.module, units), replaced


def replace_optimizer_parameters(optimizers: Sequence[Any], replaced: Mapping[int, nn.Parameter]) -> None:
    """Point every optimizer parameter group at the sharded parameters (before the first step)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [replaced.get(id(p), p) for p in group["params"]]
        assert not optimizer.state, "sharding happens before the optimizer has state"


def dp_mesh(group: Any, device: torch.device) -> Any:
    """A one-dimensional device mesh over the ranks of ``group`` (a module stage's dp group).

    The dimension is named after the group: meshes compare equal by ranks and names, and DTensor
    caches sharding decisions (holding their mesh) by that equality, so two fits on the same
    ranks with new groups would otherwise get the first fit's, released, group back.
    """
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device_type=device.type, mesh_dim_names=(f"dp_{group.group_name}",))


def check_memory_options(placements: Mapping[str, Any], schedule: ScheduleName | str) -> None:
    """User errors of ``shard``/``recompute`` that need no model, raised on every rank at construction."""
    sharded = sorted(m for m, p in placements.items() if p.shard)
    if sharded and ScheduleName.parse(schedule).split_backward:
        raise PipelineConfigError(
            f"modules {sharded} have shard=True, which schedule='{schedule}' does not support: its split backward "
            "runs the weight half of a layer apart from its input half, and FSDP2 reduce-scatters a layer's "
            "gradients when its backward ends. Use schedule='1f1b' with shard=True, or shard=False."
        )


def apply_memory_options(
    layout: Any,
    runners: Mapping[str, StageRunner],
    tied: Sequence[Any],
    dp_groups: Mapping[tuple[int, ...], Any],
    device: torch.device,
    precision: str,
    optimizers: Sequence[Any],
    tp_index: int = 0,
    meshes: Optional[Any] = None,
) -> dict[str, ShardedStage]:
    """Recompute and shard this rank's stages as their placements ask; return the sharded stages.

    Runs after the stages are built (materialised, pretrained values loaded) and on the device,
    before the optimizer's first step; optimizers are pointed at the sharded parameters. ``meshes``
    (:class:`~lightning_mmpp.engine.tensor_parallel.StageMeshes`) gives a tp stage's dp dimension.
    """
    tied_modules = sorted({module for tie in tied for module, _ in tie.owners if layout.placements[module].shard})
    if tied_modules:
        raise PipelineConfigError(
            f"modules {tied_modules} have shard=True and a parameter tied across stages or modules; a tied "
            "parameter keeps one full copy per owning stage, which FSDP2 cannot shard. Untie it (separate "
            "parameters) or set shard=False on those modules."
        )
    sharded: dict[str, ShardedStage] = {}
    replaced: dict[int, nn.Parameter] = {}
    policy = mixed_precision_policy(precision)
    for module, runner in runners.items():
        placement = layout.placements[module]
        if placement.recompute:
            for layer in runner.layers:
                enable_recompute(layer)
        if placement.shard:
            mesh = meshes.dp_mesh(module) if meshes is not None else None  # a tp stage's 2-D mesh
            if mesh is None:
                mesh = dp_mesh(dp_groups[layout.dp_group(module, runner.stage, tp_index)], device)
            sharded[module], new = shard_stage(runner, mesh, policy)
            replaced.update(new)
    if replaced:
        replace_optimizer_parameters(optimizers, replaced)
    return sharded
