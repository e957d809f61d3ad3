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
do), the last one reduce-scatters them. ``sharded_grad_reduction="microbatch"`` reduce-scatters after every backward instead (see
:data:`GRAD_REDUCTIONS`). The reduction *sums* over the replicas
(``set_gradient_divide_factor(1.0)``): the runtime pre-scales every loss so that the sum is the
gradient of the global mean loss, as for unsharded modules.

Under ``zero_bubble`` a stage's backward is split into ``I`` (input gradients) and ``W`` (weight
gradients, :class:`~lightning_mmpp.engine.runtime.StageExecutor`): each is a separate autograd
call, so FSDP2's pre-backward hook gathers the layer for each and its post-backward reshards
after each; ``W`` asks autograd for the *unsharded* parameters the forward used
(:func:`forward_parameters`), whose gradients FSDP2 then reduces into the shards. The runtime
says which ``W`` is the stage's last of the step, as for a fused backward.

A meta-built sharded layer is sharded before it is allocated (:func:`shard_layer` as the
``shard`` callback of :func:`~lightning_mmpp.model.construction.build_own_stages`).

``ModulePlacement(recompute=True)``: each layer's forward runs under
``torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state=True)``, so an
in-flight microbatch keeps only its layer inputs, and recomputing gives bitwise the same
values (dropout included). The layer's ``forward`` is wrapped on the instance rather than the
layer replaced by a wrapper module, so parameter names, state dicts and checkpoints do not
change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.model.partition import StageRunner

__all__ = ["ShardedStage", "enable_recompute", "forward_parameters", "is_sharded", "mixed_precision_policy",
           "shard_layer", "shard_stage"]

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


def is_fsdp_unit(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module``."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


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


GRAD_REDUCTIONS = ("step", "microbatch")
"""When a sharded stage reduce-scatters its gradients (``sharded_grad_reduction=``):

- ``"step"`` (default): once per step, after the stage's last backward (its last ``W`` under
  ``zero_bubble``); earlier backwards accumulate *unsharded* gradients locally. Least
  communication (one reduce-scatter per layer and step), but the stage's whole unsharded
  gradient stays resident from its first backward to its last.
- ``"microbatch"``: after every backward, for ``m`` times the reduce-scatter traffic; no
  unsharded gradient is kept between microbatches. Measured, the training peak is the same as
  with ``"step"``: every layer is its own FSDP2 root, so each layer's reduce-scatter input stays
  in flight until the backward ends, a stage's worth of unsharded gradients either way
  (benchmarks/README.md, "FSDP2 sharded while built")."""


def check_grad_reduction(value: str) -> str:
    """``value`` if it is one of :data:`GRAD_REDUCTIONS`, else a :class:`PipelineConfigError`."""
    if value not in GRAD_REDUCTIONS:
        raise PipelineConfigError(
            f"sharded_grad_reduction={value!r}: choose 'step' (reduce-scatter once per step, unsharded gradients "
            "accumulate in between) or 'microbatch' (reduce-scatter after every backward, less memory, more traffic)."
        )
    return value


class ShardedStage:
    """The FSDP2 units (one per layer with parameters) of one sharded stage on this rank.

    ``every_microbatch``: reduce-scatter after every backward instead of after the step's last.
    """

    def __init__(self, module: str, units: Sequence[nn.Module], every_microbatch: bool = False) -> None:
        self.module = module
        self.units = list(units)
        self.every_microbatch = every_microbatch

    def before_backward(self, last: bool) -> None:
        """Reduce-scatter gradients in this backward only if it is the stage's last of the step
        (or always, with ``every_microbatch``)."""
        for unit in self.units:
            unit.set_requires_gradient_sync(last or self.every_microbatch)  # type: ignore[operator]


def shard_stage(
    runner: StageRunner, mesh: Any, mp_policy: Optional[Any] = None, grad_reduction: str = "step"
) -> tuple[ShardedStage, dict[int, nn.Parameter]]:
    """``fully_shard`` every layer of ``runner`` that has parameters over ``mesh`` (the dp group).

    Returns the sharded stage and ``{id(old parameter): new parameter}``: FSDP2 replaces each
    parameter by a DTensor parameter, so optimizers built on the old ones must be pointed at the
    new ones (:func:`replace_optimizer_parameters`).
    """
    units = []
    replaced: dict[int, nn.Parameter] = {}
    for layer in runner.layers:
        before = dict(layer.named_parameters())
        if not before:
            continue
        if not is_fsdp_unit(layer):  # else sharded while built, or by an earlier fit
            shard_layer(layer, mesh, mp_policy)
            after = dict(layer.named_parameters())
            for name, old in before.items():
                replaced[id(old)] = after[name]
        units.append(layer)
    return ShardedStage(runner.module, units, every_microbatch=grad_reduction == "microbatch"), replaced


def shard_layer(layer: nn.Module, mesh: Any, mp_policy: Optional[Any] = None) -> tuple[int, int]:
    """``fully_shard`` one layer over ``mesh`` (on meta too: then only the shards get allocated);
    returns ``(this rank's chunk index, number of chunks)`` of its row-sharded parameters."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    fully_shard(layer, mesh=mesh, reshard_after_forward=True, **kwargs)
    layer.set_gradient_divide_factor(1.0)  # a sum over replicas: losses are pre-scaled
    layer.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    _record_forward_parameters(layer)
    return mesh.get_local_rank(), mesh.size()


_FORWARD_PARAMETERS = "_mmpp_forward_parameters"


def _record_forward_parameters(layer: nn.Module) -> None:
    """Remember the parameters ``layer``'s forward computed with (see :func:`forward_parameters`).

    FSDP2 swaps a unit's sharded parameters for unsharded ones around its forward and swaps them
    back in its forward hook; this hook runs first (``prepend=True``), while the unsharded ones,
    which autograd accumulates gradients into, are still the module's.
    """

    def remember(module: nn.Module, args: Any, output: Any) -> None:
        setattr(module, _FORWARD_PARAMETERS, [p for p in module.parameters() if p.requires_grad])

    layer.register_forward_hook(remember, prepend=True)


def forward_parameters(layer: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters ``layer``'s last forward used: what a split backward's ``W`` asks
    autograd for. The module's own parameters, except for an FSDP2 unit, whose forward runs on
    the unsharded parameters that FSDP2 then reduce-scatters into the sharded ones' gradients."""
    recorded = getattr(layer, _FORWARD_PARAMETERS, None)
    return list(recorded) if recorded is not None else [p for p in layer.parameters() if p.requires_grad]


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


def apply_memory_options(
    layout: Any,
    runners: Mapping[str, StageRunner],
    tied: Sequence[Any],
    mesh_of: Callable[[str, int], Any],
    device: torch.device,
    precision: str,
    optimizers: Sequence[Any],
    grad_reduction: str = "step",
) -> dict[str, ShardedStage]:
    """Recompute and shard this rank's stages as their placements ask; return the sharded stages.

    Runs after the stages are built (materialised, pretrained values loaded) and on the device,
    before the optimizer's first step; optimizers are pointed at the sharded parameters.
    ``mesh_of(module, stage)`` is the mesh to shard over (a tp stage's dp dimension of its 2-D mesh).
    """
    check_sharded_ties(layout, tied)
    sharded: dict[str, ShardedStage] = {}
    replaced: dict[int, nn.Parameter] = {}
    policy = mixed_precision_policy(precision)
    for module, runner in runners.items():
        placement = layout.placements[module]
        if placement.recompute:
            for layer in runner.layers:
                enable_recompute(layer)
        if placement.shard:
            sharded[module], new = shard_stage(runner, mesh_of(module, runner.stage), policy, grad_reduction)
            replaced.update(new)
    if replaced:
        replace_optimizer_parameters(optimizers, replaced)
        for tie in tied:  # a tied copy sharded here: the tie now names the sharded parameter
            if tie.local is not None and id(tie.local) in replaced:
                tie.local = replaced[id(tie.local)]
    return sharded


def check_sharded_ties(layout: Any, tied: Sequence[Any]) -> None:
    """A parameter tied across stages with a sharded owner: every owner must be sharded with the
    same ``dp`` (replica r of each owner holds the same rows, so the copies' shards are summed
    row for row), on ranks of its own, without tensor parallelism. Raised on every rank alike."""
    for tie in tied:
        placements = {module: layout.placements[module] for module, _ in tie.owners}
        if not any(p.shard for p in placements.values()):
            continue
        dps = {p.dp for p in placements.values()}
        if not all(p.shard for p in placements.values()) or len(dps) > 1 or any(p.tp > 1 for p in placements.values()):
            raise PipelineConfigError(
                f"parameter {tie.names[0]!r} is tied across {sorted(placements)} with shard="
                f"{ {m: p.shard for m, p in placements.items()} } and dp={ {m: p.dp for m, p in placements.items()} }; "
                "a tied parameter is sharded only when every owning module has shard=True, the same dp and tp=1. "
                "Make them agree, or untie the parameter."
            )
        owner_ranks = [rank for rank in range(layout.world_size) for module, stage in tie.owners
                       for slot in layout.chunk_slots(rank, module) if slot.stage == stage]
        if len(owner_ranks) != len(set(owner_ranks)):
            raise PipelineConfigError(
                f"parameter {tie.names[0]!r} is tied across stages {tie.owners} that share ranks, and shard=True: "
                "FSDP2 cannot shard one parameter in two units. Place the owning stages on different ranks, or "
                "set shard=False."
            )
