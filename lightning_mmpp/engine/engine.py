"""``PipelineEngine``: one rank's part of a multi-module pipeline, assembled once and run step by step.

The engine owns everything a pipelined step needs on this rank: the partitioned model (its own
stages built, materialised or loaded), the data-parallel and tied-weight process groups, FSDP2
sharding and recompute, the communicator, the runtime that executes the rank's action lists,
gradient synchronisation, metric reduction, prediction gathering, the failure board and the
trace. It imports no Lightning: :class:`~lightning_mmpp.MultiModulePipelineStrategy` is glue on
top of it, and a plain PyTorch loop under ``torchrun`` drives it directly::

    dist.init_process_group("gloo")                      # torchrun set RANK / WORLD_SIZE
    engine = PipelineEngine(model, layout, num_microbatches=4)
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-3)
    for batch in loader:                                 # the same global batch on every rank
        optimizer.zero_grad()
        out = engine.step(batch)                         # forwards, backwards, dp sync
        optimizer.step()
        print(out.loss)                                  # identical on every rank
    dist.barrier()                                       # every rank done before any closes a group
    engine.close()

One step, whatever its kind: the global batch is split into microbatches and this rank's dp
shards (:mod:`~lightning_mmpp.engine.microbatch`), the runtime executes the schedule's actions
for this rank, and then, for training, every module's gradients are summed over its dp group,
tied copies are summed, and the metrics are reduced so that every rank returns the same values.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_mmpp.core.actions import Schedule
from lightning_mmpp.core.kinds import DEFAULT_NUMBERING, Numbering, ScheduleName, StepKind
from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout
from lightning_mmpp.core.schedule import build_schedule, check_schedule_args
from lightning_mmpp.engine.comm import MultiModuleCommunicator
from lightning_mmpp.engine.data_parallel import StageGradients
from lightning_mmpp.engine.failures import FailureBoard, drop_transfer_references, raise_if_loss_not_finite
from lightning_mmpp.engine.metrics import MetricReducer, PendingMetrics
from lightning_mmpp.engine.microbatch import BatchSplitter, batch_size_of
from lightning_mmpp.engine.predict import SinkOutputGatherer
from lightning_mmpp.engine.runtime import TOKEN_COUNT, TOKEN_LOSS, PipelineRuntime, StepResult
from lightning_mmpp.engine.sharding import (
    apply_memory_options, check_grad_reduction, dp_mesh, is_fsdp_unit, is_sharded, mixed_precision_policy,
    replace_optimizer_parameters, shard_layer,
)
from lightning_mmpp.engine.tensor_parallel import (
    StageMeshes, TensorParallelRelay, agree_on_errors, apply_tensor_parallel, check_tensor_parallel,
    parallelize_layer,
)
from lightning_mmpp.engine.tied import counts_in_norm, sum_groups, sum_tied_gradients, tie_groups
from lightning_mmpp.engine.trace import Tracer, merge_traces, tracer_for
from lightning_mmpp.errors import PipelineConfigError, PipelineError
from lightning_mmpp.model.construction import build_own_stages, plan_construction
from lightning_mmpp.model.initialization import release
from lightning_mmpp.model.partition import Partition, partition_model
from lightning_mmpp.model.pretrained import PretrainedWeights

__all__ = ["PipelineEngine", "StepOutput", "is_partitioned"]

log = logging.getLogger(__name__)

_TOKEN_PREFIX = "tokens/"  # per-token sums travel beside the metrics in the one metrics all-reduce

# The models this process has partitioned, with (layout, rank, partition): a partitioned model
# keeps only its rank's layers, so a later engine may reuse it (fit, then validate/test/predict)
# only with the same layout and rank. Weak keys: the entry goes with the model.
_PARTITIONED: "weakref.WeakKeyDictionary[Any, tuple[PipelineLayout, int, Partition]]" = weakref.WeakKeyDictionary()

# The tp process groups and meshes of the models this process has parallelized: the DTensor
# parameters and torch's parallel-style hooks hold the meshes, so a later engine on the same
# model (fit, then validate/test/predict) reuses them, and no engine destroys those groups
# (they go with the default process group).
_TENSOR_PARALLEL: "weakref.WeakKeyDictionary[Any, tuple[dict[tuple[int, ...], Any], StageMeshes]]" = (
    weakref.WeakKeyDictionary()
)

PretrainedSource = Union[str, os.PathLike, PretrainedWeights]


def is_partitioned(model: nn.Module) -> bool:
    """Whether an engine in this process has already partitioned ``model`` (it keeps only one rank's stages)."""
    return model in _PARTITIONED


@dataclass
class StepOutput:
    """What one step returns, identical on every rank.

    ``metrics`` are means over the step's samples (``loss`` among them for a loss returned as a
    tensor or ``{"loss": ...}``); ``token_metrics`` are per-token means (``loss`` among them when
    the sinks return ``{"loss_sum", "num_tokens"}``), divided by the global token count
    ``num_tokens``. ``loss`` is the step's loss from whichever holds it. For a predict step,
    ``predictions`` holds the sink output of the whole batch (a dict by sink with several
    sinks) and the metrics are empty. ``agreement`` is the element-wise sum over the world of
    the ``agreement`` values every rank passed to :meth:`PipelineEngine.step` (``None`` when none
    were passed, and for a predict step, which reduces no metrics).
    """

    kind: StepKind
    num_samples: int
    metrics: dict[str, Tensor] = field(default_factory=dict)
    token_metrics: dict[str, Tensor] = field(default_factory=dict)
    num_tokens: Optional[int] = None
    predictions: Any = None
    agreement: Optional[tuple[float, ...]] = None
    # this rank's runtime view of the step: peak stash, per-sink microbatch losses
    local: Optional[StepResult] = None

    @property
    def loss(self) -> Optional[Tensor]:
        return self.token_metrics.get("loss", self.metrics.get("loss"))


class PipelineEngine:
    """This rank's part of a multi-module pipeline: built once, then :meth:`step` per batch.

    Args:
        model: the multi-module model: one ``nn.Sequential`` / ``nn.ModuleList`` attribute per
            placed module, plus ``pipeline_inputs(module, batch, upstream)`` and
            ``pipeline_loss(module, output, batch)`` (see DESIGN.md). Partitioned in place: the
            rank keeps only its own stages (built on the meta device, they are materialised
            here with :func:`~lightning_mmpp.materialize`'s rule, or loaded from ``pretrained``).
        layout: where every module runs (:class:`~lightning_mmpp.PipelineLayout`).
        num_microbatches: microbatches per global batch.
        schedule: ``"1f1b"``, ``"gpipe"``, ``"zero_bubble"``, or, for a layout with virtual
            stages, ``"interleaved_1f1b"`` or ``"zbv"`` (its layout built with ``v_shape=True``).
        stage_numbering: ``"alap"`` (default) or ``"asap"`` (see :mod:`lightning_mmpp.core.topology`).
        device: this rank's device (default: CPU for gloo, ``cuda:<LOCAL_RANK>`` for NCCL).
        optimizers: optimizers built over the whole model before partitioning; each keeps the
            parameters this rank owns (and is pointed at sharded parameters). Optimizers built
            after the engine should take :meth:`parameters`.
        precision: ``"32-true"``, ``"bf16-mixed"`` or ``"bf16-true"``: FSDP2's mixed-precision policy.
        convert_module: called on the partitioned model before it moves to ``device`` and is
            sharded (a precision plugin's dtype conversion, say).
        pretrained: ``{module: source}`` initial weights (see :mod:`lightning_mmpp.model.pretrained`).
        seed: the materialisation seed (default: rank 0's ``torch.initial_seed()``).
        static_shapes: every microbatch sends the same shapes and dtypes across every boundary
            (headers checked once per step instead of per message).
        trace_dir: write a Chrome trace of every action there at :meth:`close`.
        timeout: timeout of the process groups the engine creates.
        launch_in_backward: start dp gradient buckets during the last backward (default: on
            accelerators, not on CPU; see :mod:`lightning_mmpp.engine.data_parallel`).
        overlap: transfers run beside computes (default); ``False`` waits for every exchange, for
            comparison (see :class:`~lightning_mmpp.engine.runtime.PipelineRuntime`).
        sharded_grad_reduction: when sharded stages reduce-scatter their gradients: ``"step"``
            (default, once after the stage's last backward) or ``"microbatch"`` (after every
            backward: less memory, more traffic); see :data:`~lightning_mmpp.engine.sharding.GRAD_REDUCTIONS`.
        nvtx: push an NVTX range per action (forward/backward/I/W/exchange with module, stage and
            microbatch) for Nsight Systems; default: ``MMPP_NVTX``, else on CUDA when tracing.

    ``torch.distributed`` must be initialised when the layout has more than one rank, with the
    layout's world size. Configuration errors are raised on every rank before any collective.
    """

    def __init__(
        self,
        model: nn.Module,
        layout: PipelineLayout,
        num_microbatches: int,
        schedule: ScheduleName | str = ScheduleName.ONE_F_ONE_B,
        *,
        stage_numbering: Numbering | str = DEFAULT_NUMBERING,
        device: Optional[torch.device] = None,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        precision: str = "32-true",
        convert_module: Optional[Callable[[nn.Module], Any]] = None,
        pretrained: Optional[Mapping[str, PretrainedSource]] = None,
        seed: Optional[int] = None,
        static_shapes: bool = False,
        trace_dir: Optional[str] = None,
        timeout: timedelta = timedelta(minutes=30),
        launch_in_backward: Optional[bool] = None,
        overlap: bool = True,
        nvtx: Optional[bool] = None,
        sharded_grad_reduction: str = "step",
    ) -> None:
        check_grad_reduction(sharded_grad_reduction)
        schedule, stage_numbering = check_engine_options(
            layout, num_microbatches, schedule, stage_numbering, static_shapes, pretrained
        )
        initialised = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if initialised else 1
        self.rank = dist.get_rank() if initialised else 0
        layout.check_world_size(self.world_size)
        check_tensor_parallel(model, layout)
        self.layout = layout
        self.model = model
        self.num_microbatches = num_microbatches
        self.schedule_name = schedule
        self.stage_numbering = stage_numbering
        self.device = device if device is not None else default_device()
        self.timeout = timeout
        self.trace_dir = trace_dir
        self._in_step = False
        self._closed = False
        self._steps = 0
        self._schedules: dict[tuple[ScheduleName, bool, int], Schedule] = {}
        self._groups: list[Any] = []

        reused = _TENSOR_PARALLEL.get(model)
        kept = self._kept_dp_groups() if reused is None else set()  # a 2-D mesh's dp groups live on with it
        self.dp_groups = {ranks: self._new_group(ranks, keep=ranks in kept) for ranks in layout.dp_groups()}
        self.tp_groups = (reused[0] if reused is not None
                          else {ranks: self._new_group(ranks, keep=True) for ranks in layout.tp_groups()})
        if self.world_size > 1:
            dist.barrier()  # NCCL wants one collective before the first batched P2P
        built_here = not is_partitioned(model)  # else an earlier engine built (and agreed on) the stages
        self._precision, self._convert_module = precision, convert_module
        self._meshes: dict[tuple[int, ...], Any] = {}
        self.meshes: Optional[StageMeshes] = (  # tp stages' meshes
            reused[1] if reused is not None
            else StageMeshes(layout, self.rank, self.dp_groups, self.tp_groups, self.device) if layout.max_tp > 1
            else None
        )
        self._split_built: set[int] = set()  # ids of tp layers split while built
        self._split_error: Optional[BaseException] = None
        self.partition, self.pretrained_keys_read, replaced = self._partition(model, dict(pretrained or {}), seed)
        owned = self.partition.owned_parameter_ids
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) in owned]
        if replaced:  # layers sharded while built: point the optimizers at their sharded parameters
            replace_optimizer_parameters(optimizers, replaced)
        if convert_module is not None:
            convert_module(model)
        model.to(self.device)
        self.tie_groups = tie_groups(layout, self.partition.tied, timeout) if self.world_size > 1 else {}
        self._groups += list(self.tie_groups.values())
        if built_here:
            self._agree_initial_values()
        if reused is None and self.meshes is not None:
            self._parallelize(optimizers)
        if self.meshes is not None:
            _TENSOR_PARALLEL[model] = (self.tp_groups, self.meshes)
        self.sharded = apply_memory_options(
            layout, self.partition.runners, self.partition.tied, self._mesh, self.device, precision, optimizers,
            sharded_grad_reduction,
        )
        self.no_backward_modules = layout.no_backward_modules(self.partition.frozen_modules)
        self.tracer: Tracer | Any = tracer_for(self.rank, trace_dir, nvtx=nvtx, device=self.device)
        # a parameter tied across ranks counts once in the global norm, on its first owner
        counted_elsewhere = [t.local for t in self.partition.tied
                             if t.local is not None and not counts_in_norm(layout, t, self.rank)]
        self.gradients = StageGradients.for_rank(
            layout, self.rank, self.partition.runners, self.dp_groups, self.world_size,
            counted_elsewhere=counted_elsewhere, sharded=self.sharded,
            launch_in_backward=self.device.type != "cpu" if launch_in_backward is None else launch_in_backward,
        )
        self.batches = BatchSplitter(layout, self.rank, num_microbatches)
        self.metrics = MetricReducer(self.world_size, self.device)
        self.predictions = SinkOutputGatherer(layout, self.rank, self.device, self.world_size)
        self.comm: Any = MultiModuleCommunicator(layout, self.rank, self.device, static_specs=static_shapes)
        tp_ranks = self._tp_ranks()
        if len(tp_ranks) > 1:  # the lead's transfers, relayed inside the tp group
            self.comm = TensorParallelRelay(self.comm, self.tp_groups[tp_ranks], tp_ranks, self.rank, self.device)
        self.failures = FailureBoard(layout, self.rank, self.world_size)
        self.failures.attach()
        self.runtime = PipelineRuntime(
            layout, self.rank, self.comm, self.partition.chunks, model, tracer=self.tracer,
            no_backward_modules=self.no_backward_modules, failures=self.failures, gradient_sync=self.gradients,
            overlap=overlap,
        )

    # --- construction ------------------------------------------------------------------------

    def _new_group(self, ranks: Sequence[int], keep: bool = False) -> Any:
        """A process group over ``ranks``, destroyed at :meth:`close` unless ``keep`` (a tp mesh's)."""
        group = dist.new_group(list(ranks), timeout=self.timeout) if self.world_size > 1 else None
        if not keep:
            self._groups.append(group)
        return group

    def _kept_dp_groups(self) -> set[tuple[int, ...]]:
        """The dp groups of sharded tp stages: dimensions of 2-D meshes that outlive the engine."""
        return {self.layout.dp_group(m, s, t) for m, p in self.layout.placements.items()
                if p.shard and p.tp > 1 for s in range(p.pp) for t in range(p.tp)}

    def _tp_ranks(self) -> tuple[int, ...]:
        """The ranks of this rank's tp group (every module on a rank has the same one)."""
        slot = self.layout.slots(self.rank)[0]
        return self.layout.tp_group(slot.module, slot.stage, slot.replica)

    def _parallelize(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Tensor parallelism: call the model's hook on every layer of this rank's tp stages not
        split while built; a failure on any rank (here or while building) is raised on every rank."""
        error = self._split_error
        replaced: dict[int, nn.Parameter] = {}
        if error is None:
            try:
                replaced = apply_tensor_parallel(self.model, self.layout, self.partition.runners, self.meshes,
                                                 self._split_built)
            except Exception as err:  # noqa: BLE001 - raised on every rank just below
                error = err
        agree_on_errors(error, self.world_size)
        replace_optimizer_parameters(optimizers, replaced)

    def _mesh(self, module: str, stage: int) -> Any:
        """The device mesh of ``module``'s stage ``stage`` over this rank's dp group (made once); a tp
        stage's dp dimension of its 2-D mesh."""
        mesh = self.meshes.dp_mesh(module) if self.meshes is not None else None
        if mesh is not None:
            return mesh
        ranks = self.layout.dp_group(module, stage, self.layout.tp_index(self.rank))
        if ranks not in self._meshes:
            self._meshes[ranks] = dp_mesh(self.dp_groups[ranks], self.device)
        return self._meshes[ranks]

    def _shard_while_building(self, partition: Partition) -> list[tuple[str, str, nn.Module]]:
        """``(module, layer name, layer)`` of every layer of a sharded stage that is wholly on the
        meta device: it is sharded before it is allocated (see :mod:`lightning_mmpp.model.construction`).
        A tp layer is split (whole) before it is sharded: :meth:`_split_while_building`."""
        return _meta_layers(partition, lambda p: p.shard and p.tp == 1, self.layout)

    def _split_while_building(self, partition: Partition) -> list[tuple[str, str, nn.Module]]:
        """``(module, layer name, layer)`` of every layer of a tp stage that is wholly on the meta
        device: it is built whole and split at once, one layer at a time (see
        :mod:`lightning_mmpp.model.construction`)."""
        return _meta_layers(partition, lambda p: p.tp > 1, self.layout)

    def _split_layer(self, partition: Partition) -> Callable[[str, nn.Module], None]:
        """The callback that splits a just-built layer of a tp stage: the model's hook, then
        ``fully_shard`` under ``shard=True``. The first failure is kept (raised on every rank by
        :meth:`_parallelize`); later layers are then left whole. The whole parameters a layer had
        go back to meta (the optimizers and the caller may still reference them until they are
        pointed at the shards), so their memory is free before the next layer is allocated."""
        index_of = {id(layer): runner.first_layer + i for runner in partition.runners.values()
                    for i, layer in enumerate(runner.layers)}
        shard = self._shard_layer({id(layer): (module, runner.stage) for module, runner in partition.runners.items()
                                   for layer in runner.layers})

        def split(module: str, layer: nn.Module) -> None:
            if self._split_error is not None:
                return
            whole = dict(layer.named_parameters())
            try:
                parallelize_layer(self.model, module, index_of[id(layer)], layer, self.meshes.tp_mesh(module))
                if self.layout.placements[module].shard:
                    shard(layer)
            except Exception as err:  # noqa: BLE001 - raised on every rank by _parallelize
                self._split_error = err
                return
            self._split_built.add(id(layer))
            split_now = dict(layer.named_parameters())
            release([p for name, p in whole.items() if split_now.get(name) is not p])

        return split

    def _shard_layer(self, module_of: Mapping[int, tuple[str, int]]) -> Callable[[nn.Module], tuple[int, int]]:
        """The callback that shards a meta layer of a sharded stage (dtype conversion first)."""
        policy = mixed_precision_policy(self._precision)

        def shard(layer: nn.Module) -> tuple[int, int]:
            if self._convert_module is not None:
                self._convert_module(layer)
            return shard_layer(layer, self._mesh(*module_of[id(layer)]), policy)

        return shard

    def _partition(
        self, model: nn.Module, pretrained: Mapping[str, PretrainedSource], seed: Optional[int]
    ) -> tuple[Partition, dict[str, list[str]], dict[int, nn.Parameter]]:
        """Keep this rank's stages of ``model`` and build them (or reuse an earlier engine's
        partition); also ``{id(meta parameter): sharded parameter}`` of the layers sharded while built."""
        cached = _PARTITIONED.get(model)
        if cached is not None:
            if cached[0] is self.layout and cached[1] == self.rank:
                return cached[2], {}, {}
            raise PipelineConfigError(
                "this model was already partitioned for another layout or rank (it keeps only that rank's stages); "
                "build a fresh model for a new layout."
            )
        plan = plan_construction(model, pretrained)  # every rank checks every key, before any collective
        partition = partition_model(model, self.layout, self.rank)
        if plan.on_meta and seed is None:
            seed = self._broadcast_seed()
        if self.layout.max_tp > 1:  # before a tp layer is split while built
            check_tensor_parallel(model, self.layout, [m for tie in partition.tied for m, _ in tie.owners])
        shard_layers = self._shard_while_building(partition) if plan.on_meta else []
        split_layers = self._split_while_building(partition) if plan.on_meta else []
        module_of = {id(layer): (module, partition.runners[module].stage) for module, _, layer in shard_layers}
        before = {id(layer): dict(layer.named_parameters()) for _, _, layer in (*shard_layers, *split_layers)}
        read = build_own_stages(model, plan, self.device, seed or 0, partition.tied, shard_layers,
                                self._shard_layer(module_of), split_layers, self._split_layer(partition))
        replaced = {}
        for _, _, layer in (*shard_layers, *split_layers):
            after = dict(layer.named_parameters())
            replaced.update({id(old): after[name] for name, old in before[id(layer)].items()})
        _PARTITIONED[model] = (self.layout, self.rank, partition)
        return partition, read, replaced

    @torch.no_grad()
    def _agree_initial_values(self) -> None:
        """Every copy of a parameter starts equal: the dp replicas of a stage take their first
        replica's parameters and buffers (as DDP does when it wraps a model), the copies of a
        parameter tied across ranks its first owner's. A process that built its own random
        weights (no common seed) would otherwise train a diverging replica without a word."""
        if self.world_size == 1:
            return
        for module, runner in self.partition.runners.items():
            ranks = self.layout.dp_group(module, runner.stage, self.layout.tp_index(self.rank))
            if len(ranks) > 1:
                for layer in runner.layers:
                    if is_fsdp_unit(layer) or id(layer) in self._split_built:
                        continue  # sharded or split while built: every replica built the same values
                    for tensor in [*layer.parameters(), *layer.buffers()]:
                        dist.broadcast(tensor, src=ranks[0], group=self.dp_groups[ranks])
        for tie in self.partition.tied:
            if tie.local is not None and is_sharded(tie.local):
                continue  # sharded while built: every copy built the same rows
            for group in sum_groups(self.layout, tie):  # all owners, or (sharded later) one set per replica
                if self.rank in group and group in self.tie_groups:
                    dist.broadcast(tie.local, src=group[0], group=self.tie_groups[group])

    def _broadcast_seed(self) -> int:
        """Rank 0's ``torch.initial_seed()`` (``seed_everything``'s seed), the same on every rank."""
        seed = torch.initial_seed()
        if self.world_size == 1:
            return seed
        box = [seed]
        dist.broadcast_object_list(box, 0)
        return int(box[0])

    # --- what the engine holds ---------------------------------------------------------------

    def parameters(self) -> list[nn.Parameter]:
        """The parameters this rank owns (its stages'), sharded ones as DTensors: what its optimizer steps."""
        return [p for runner in self.partition.runners.values() for p in runner.parameters()]

    def schedule(
        self, forward_only: bool = False, num_microbatches: Optional[int] = None,
        name: ScheduleName | str | None = None,
    ) -> Schedule:
        """The action lists of a training (or forward-only) step of ``num_microbatches`` under the
        engine's schedule (or ``name``), built once and cached."""
        m = num_microbatches or self.num_microbatches
        name = ScheduleName.GPIPE if forward_only else ScheduleName.parse(name or self.schedule_name)
        key = (name, forward_only, m)
        if key not in self._schedules:
            self._schedules[key] = build_schedule(
                self.layout, m, name, forward_only=forward_only, numbering=self.stage_numbering,
                no_backward_modules=frozenset() if forward_only else self.no_backward_modules,
            )
        return self._schedules[key]

    # --- one step ----------------------------------------------------------------------------

    def step(self, batch: Any, kind: StepKind | str = StepKind.TRAIN, *, step_index: Optional[int] = None,
             agreement: Optional[Sequence[float] | Callable[[], Sequence[float]]] = None) -> StepOutput:
        """Run one pipelined step on the global ``batch`` (the same on every rank) and return its
        reduced loss and metrics (or, for ``"predict"``, the sink outputs), identical on every rank.

        A training step leaves this rank's parameter gradients in ``.grad``: summed over each
        module's dp group and divided as the loss asks, ready for the optimizer. It does not
        zero them first (zero them before the step, as with a plain ``loss.backward()``).
        ``step_index`` names the step in failure reports (default: the engine's own count).
        ``agreement``: values every rank contributes (the same length everywhere), summed over
        the world in the step's metric all-reduce (float32) and returned as
        :attr:`StepOutput.agreement`: a caller agrees on something per step (the Lightning
        strategy: whether any rank was sent a preemption signal) without a collective of its own.
        A callable is called when the metric all-reduce starts, after this rank's part of the
        pipeline, so the values are as late as the step can carry them. Not for predict steps,
        which reduce no metrics.
        """
        kind = StepKind.parse(kind)
        result = self.run_pipeline(batch, kind, step_index=step_index)
        output = StepOutput(kind, batch_size_of(batch), local=result)
        if kind is StepKind.PREDICT:
            output.predictions = self.predictions.gather(result.sink_outputs)
            return output
        # the metric all-reduce (default group) is launched first and waited for last: it runs
        # beside the dp gradient sums (their own groups) instead of after them
        contributed = agreement() if callable(agreement) else agreement
        with self._collectives():
            pending = self.metrics.start(self._local_metrics(result), kind, contributed or ())
        if kind is StepKind.TRAIN:
            with self.tracer.span("dp_allreduce", "dp"), self._collectives():
                self.gradients.synchronize()
                if self.tie_groups:  # copies of a parameter tied across ranks get the summed gradient
                    sum_tied_gradients(self.layout, self.partition.tied, self.tie_groups, self.rank)
        with self.tracer.span("metrics_allreduce", "metrics"), self._collectives():
            output.metrics, output.token_metrics, output.num_tokens, sums = self._finish_metrics(pending)
        if agreement is not None:
            output.agreement = tuple(sums)
        if kind is StepKind.TRAIN:
            raise_if_loss_not_finite(self.failures, output.loss, result.sink_losses)
            if output.num_tokens is not None:  # per-token loss: every gradient holds a sum over tokens
                self._divide_gradients(output.num_tokens)
        return output

    def run_pipeline(
        self, batch: Any, kind: StepKind | str = StepKind.TRAIN, *, step_index: Optional[int] = None,
        schedule: ScheduleName | str | None = None,
    ) -> StepResult:
        """The pipeline part of :meth:`step` alone: this rank's actions for ``batch``, with no
        gradient synchronisation and no metric reduction afterwards (for measuring the schedule,
        or for a caller that reduces on its own). ``schedule`` runs another schedule than the
        engine's on the same stages (its results are the same; its timing and memory are not)."""
        kind = StepKind.parse(kind)
        m, shard = self.batches.split(batch, kind)
        self.comm.routing = self.batches.routing
        self.failures.begin(self._steps if step_index is None else step_index, kind)
        self.tracer.step = self._steps if step_index is None else step_index
        self._steps += 1
        predict = kind is StepKind.PREDICT
        with self._running():
            result = self.runtime.run(
                self.schedule(kind.forward_only, m, schedule), shard, keep_sink_outputs=predict,
                compute_loss=not predict,
            )  # ends with the communicator's finish_step: sends drained, headers checked
        return result

    @contextmanager
    def _running(self) -> Iterator[None]:
        """The span in which peers wait on this rank's messages: a failure there closes the process
        group (see :meth:`abort`) so that they stop at once instead of at the timeout."""
        self._in_step = True
        try:
            yield
        except BaseException as err:
            self.abort(err)
            raise
        self._in_step = False

    @contextmanager
    def _collectives(self) -> Iterator[None]:
        """The collectives after the pipeline (dp sums, metrics): a peer that failed mid-step makes
        them fail too. Name its root cause, as a failed transfer does, and close the group."""
        try:
            yield
        except PipelineError:
            raise
        except RuntimeError as err:
            if self.world_size == 1:
                raise
            failure = self.failures.transport_failure(err, range(self.world_size))
            self._in_step = True
            self.abort(failure)
            raise failure from err

    def _local_metrics(self, result: StepResult) -> dict[str, Tensor]:
        """This rank's shares of the step's metrics and per-token sums, as the reducer sums them."""
        if self.layout.tp_index(self.rank) > 0:  # the tp lead counts its group's (identical) values
            return {}
        return {**result.metric_sums, **{_TOKEN_PREFIX + k: v for k, v in result.token_sums.items()}}

    def _finish_metrics(
        self, pending: PendingMetrics
    ) -> tuple[dict[str, Tensor], dict[str, Tensor], Optional[int], list[float]]:
        """``(metrics, per-token metrics, global token count, extra summed)`` reduced over the world.

        Per-token sums (``loss_sum``, ``num_tokens``, ``<name>_sum``) become ``loss`` and ``<name>``
        divided by the global token count of the step (``None`` when no sink used that form).
        """
        reduced, extra_sums = self.metrics.finish(pending)
        metrics = {n: v for n, v in reduced.items() if not n.startswith(_TOKEN_PREFIX)}
        sums = {n[len(_TOKEN_PREFIX):]: v for n, v in reduced.items() if n.startswith(_TOKEN_PREFIX)}
        if not sums:
            return metrics, {}, None, extra_sums
        count = sums.pop(TOKEN_COUNT).clamp(min=1.0)
        token_metrics = {"loss" if n == TOKEN_LOSS else n[: -len("_sum")]: v / count for n, v in sums.items()}
        return metrics, token_metrics, int(count.item()), extra_sums

    def _divide_gradients(self, count: int) -> None:
        for p in self.parameters():
            if p.grad is not None:
                p.grad.div_(count)

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip by the global gradient norm over every module and rank (dp replicas and tied copies
        counted once); returns the norm before clipping, the same on every rank."""
        return self.gradients.clip_norm_(max_norm, self.device)

    # --- failure and teardown ----------------------------------------------------------------

    def abort(self, exception: BaseException) -> None:
        """After a failure: inside a step, close the process group so that peers waiting for this
        rank's messages fail at once; and on rank 0, which serves the failure board, wait until
        the peers that failed too have read the root cause (a failure between steps, in the
        preemption agreement say, included), so that none of them finds the board gone."""
        in_step, self._in_step = self._in_step, False
        if in_step and self.world_size > 1 and dist.is_available() and dist.is_initialized():
            log.error("rank %d failed inside a pipeline step; closing the process group so peers stop", self.rank)
            self._groups = []
            self.tie_groups = {}
            drop_transfer_references(exception, self.comm)
            dist.destroy_process_group()
        self.failures.linger()

    def close(self) -> None:
        """Write the trace (``trace_dir``), destroy the engine's process groups, remove gradient
        hooks and release the failure board. The default process group stays (it is the caller's).
        Closing twice is a no-op."""
        if self._closed:
            return
        self._closed = True
        initialised = dist.is_available() and dist.is_initialized()
        if self.tracer.enabled and self.trace_dir is not None:
            self.tracer.write(self.trace_dir)
            if self.world_size > 1 and initialised:
                dist.barrier()
            if self.rank == 0:
                merge_traces(self.trace_dir, self.world_size)
        for group in self._groups:
            if group is not None and initialised:
                dist.destroy_process_group(group)
        self._groups = []
        self.tie_groups = {}
        self.gradients.close()
        self.failures.release()

    def __enter__(self) -> "PipelineEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def check_engine_options(
    layout: PipelineLayout,
    num_microbatches: Optional[int],
    schedule: ScheduleName | str,
    stage_numbering: Numbering | str,
    static_shapes: bool,
    pretrained: Optional[Mapping[str, Any]],
) -> tuple[ScheduleName, Numbering]:
    """The engine's options against the layout, raised identically on every rank before any
    collective; returns the schedule and the stage numbering parsed."""
    parsed = check_schedule_args(schedule, num_microbatches, stage_numbering)  # type: ignore[arg-type]
    if layout.virtual and layout.v_shape != parsed[0].v_shape:
        raise PipelineConfigError(
            f"schedule={str(parsed[0])!r} with virtual stages needs the layout's chunks "
            + ("V-shaped: build it as PipelineLayout(..., v_shape=True)." if parsed[0].v_shape else
               "interleaved: build it as PipelineLayout(..., v_shape=False) (V-shaped chunks are for 'zbv').")
        )
    unsupported = sorted(m for m, p in layout.placements.items() if p.virtual_stages > 1 and (p.shard or p.tp > 1))
    if unsupported:
        raise PipelineConfigError(
            f"modules {unsupported} have virtual_stages > 1 with shard=True or tp > 1, which the engine does not "
            "run (their chunks are not sharded or tensor-parallel yet); give them virtual_stages=1, or shard=False "
            "and tp=1."
        )
    if not isinstance(static_shapes, bool):
        raise PipelineConfigError(f"static_shapes={static_shapes!r}: give True or False.")
    unknown = sorted(set(pretrained or {}) - set(layout.placements))
    if unknown:
        raise PipelineConfigError(
            f"pretrained= names {unknown}, which are not placed modules {list(layout.placements)}; key it by "
            "placement name."
        )
    return parsed


def default_device() -> torch.device:
    """``cuda:<LOCAL_RANK>`` where the default process group uses NCCL, else the CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _meta_layers(
    partition: Partition, wanted: Callable[[ModulePlacement], bool], layout: PipelineLayout
) -> list[tuple[str, str, nn.Module]]:
    """``(module, layer name, layer)`` of every layer with parameters, all of its tensors on the
    meta device, of this rank's stages whose placement is ``wanted``."""
    layers = []
    for module, runner in partition.runners.items():
        if wanted(layout.placements[module]):
            for name, layer in zip(runner.layer_names, runner.layers):
                tensors = [*layer.parameters(), *layer.buffers()]
                if any(True for _ in layer.parameters()) and all(t.is_meta for t in tensors):
                    layers.append((module, name, layer))
    return layers
