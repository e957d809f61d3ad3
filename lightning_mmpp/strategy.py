"""``MultiModulePipelineStrategy``: multi-module pipeline parallelism as a Lightning strategy."""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
import types
import warnings
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.distributed import ReduceOp
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from lightning_mmpp.checkpoint import PipelineCheckpointMixin
from lightning_mmpp.comm import MultiModuleCommunicator
from lightning_mmpp.data_parallel import sum_gradients
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.failures import FailureBoard, drop_transfer_references, raise_if_loss_not_finite
from lightning_mmpp.preemption import PreemptionHandler, preemption_signals, stop_at_boundary
from lightning_mmpp.payload import concat_payloads
from lightning_mmpp.loops import install_pipeline_optimization
from lightning_mmpp.partition import Partition, partition_model
from lightning_mmpp.placement import ModulePlacement, PipelineLayout
from lightning_mmpp.runtime import PipelineRuntime, StepResult
from lightning_mmpp.schedule import Schedule, build_schedule, check_schedule_args
from lightning_mmpp.topology import ModuleTopology
from lightning_mmpp.trace import NULL_TRACER, Tracer, merge_traces

log = logging.getLogger(__name__)


def batch_size_of(batch: Any) -> int:
    """The size of dim 0 shared by every tensor leaf of ``batch``."""
    leaves, _ = tree_flatten(batch)
    sizes = {leaf.shape[0] for leaf in leaves if isinstance(leaf, Tensor) and leaf.dim() > 0}
    if not sizes:
        raise PipelineConfigError("the batch holds no tensor with a batch dimension; the pipeline splits dim 0.")
    if len(sizes) > 1:
        raise PipelineConfigError(f"the batch's tensors disagree on dim 0 (sizes {sorted(sizes)}); they must agree.")
    return sizes.pop()


def microbatch_count(batch_size: int, num_microbatches: int, divisor: int, short: bool = False) -> int:
    """The number of microbatches for a batch: ``num_microbatches``, or fewer for a short batch.

    Every microbatch must split evenly over every dp size (``divisor`` = their lcm). A full batch
    must divide by ``num_microbatches * divisor``. A ``short`` batch (the last one, with
    ``drop_last=False``) runs with the largest count <= ``num_microbatches`` that divides it;
    metrics weight each batch by its samples, so averages stay exact.
    """
    if batch_size % divisor or (not short and batch_size % (num_microbatches * divisor)):
        raise PipelineConfigError(
            f"a batch of {batch_size} samples cannot be split evenly over the dp replicas (every microbatch must "
            f"divide by lcm(dp sizes) = {divisor}); use a batch size that is a multiple of "
            f"{num_microbatches * divisor} (drop_last=True in the DataLoader avoids a short last batch)."
        )
    return max(m for m in range(1, num_microbatches + 1) if batch_size % (m * divisor) == 0)


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    """Split every tensor leaf of ``batch`` along dim 0 into ``num_microbatches`` equal parts.

    Non-tensor leaves are handed unchanged to every microbatch.
    """
    leaves, spec = tree_flatten(batch)
    per = batch_size_of(batch) // num_microbatches
    out = []
    for k in range(num_microbatches):
        part = [leaf[k * per:(k + 1) * per] if isinstance(leaf, Tensor) and leaf.dim() > 0 else leaf for leaf in leaves]
        out.append(spec.unflatten(part))
    return out


def slice_batch(batch: Any, index: slice) -> Any:
    leaves, spec = tree_flatten(batch)
    return spec.unflatten([x[index] if isinstance(x, Tensor) and x.dim() > 0 else x for x in leaves])


class MultiModulePipelineStrategy(PipelineCheckpointMixin, ParallelStrategy):
    """Train a multi-module LightningModule with multi-module pipeline parallelism.

    Each module (an ``nn.Sequential`` / ``nn.ModuleList`` attribute of the LightningModule
    named like its placement key) gets its own ranks, pipeline depth and data-parallel size;
    modules form a DAG; a multi-module 1F1B (or GPipe) schedule drives them.

    Args:
        placements: ``{module: ModulePlacement(pp, dp, rank_offset)}``.
        topology: ``{module: [downstream modules]}``, a DAG whose sinks compute the loss.
        num_microbatches: microbatches per global batch.
        schedule: ``"1f1b"`` or ``"gpipe"``.
        stage_numbering: ``"alap"`` (default) or ``"asap"``; which global stage index bounds the
            microbatches a stage holds in flight under 1F1B (see :mod:`lightning_mmpp.topology`).
        process_group_backend: defaults to gloo on CPU, NCCL on CUDA.
        timeout: process-group timeout.
        start_method: ``"popen"`` (re-run the script per rank, like ``ddp``), ``"spawn"`` or
            ``"fork"``. Ignored under ``torchrun`` / SLURM.
        trace_dir: record a timeline of every forward, backward, communication wait, gradient
            reduction and optimizer step, and write Chrome trace-event JSON there at teardown
            (``trace_rank{r}.json`` per rank and a merged ``trace.json``). Off by default.
        preemption_checkpoint: where to save a checkpoint when the job is preempted (SIGTERM, or
            SLURM's requeue signal): every rank stops at the next step boundary, saves it there
            and exits with status ``128 + signal`` (see :mod:`lightning_mmpp.preemption`).
    """

    strategy_name = "multimodule_pipeline"

    def __init__(
        self,
        placements: Mapping[str, ModulePlacement],
        topology: Mapping[str, Sequence[str]],
        num_microbatches: int,
        schedule: str = "1f1b",
        *,
        stage_numbering: Literal["alap", "asap"] = "alap",
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: timedelta = timedelta(minutes=30),
        start_method: Literal["popen", "spawn", "fork"] = "popen",
        trace_dir: Optional[str] = None,
        preemption_checkpoint: Optional[str] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        check_schedule_args(schedule, num_microbatches, stage_numbering)
        if start_method not in ("popen", "spawn", "fork"):
            raise PipelineConfigError(f"start_method={start_method!r}: choose 'popen', 'spawn' or 'fork'.")
        self.layout = PipelineLayout(placements, topology)
        self.num_microbatches = num_microbatches
        self.schedule_name = schedule
        self.stage_numbering = stage_numbering
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self._num_nodes = 1
        self._dp_groups: dict[tuple[int, ...], Any] = {}
        self._partition: Optional[Partition] = None
        self._comm: Optional[MultiModuleCommunicator] = None
        self._runtime: Optional[PipelineRuntime] = None
        self._schedules: dict[tuple[bool, int], Schedule] = {}
        self._no_grad_modules: frozenset[str] = frozenset()
        # per kind of step (train / eval / predict): a batch smaller than one seen before is a
        # short last batch
        self._largest_batch: dict[str, int] = {}
        self._in_pipeline_step = False
        self._metric_names: dict[str, list[str]] = {}
        self._batch_divisor = math.lcm(*(p.dp for p in self.layout.placements.values()))
        self.trace_dir = trace_dir
        self._tracer: Tracer | Any = NULL_TRACER
        self._failures = FailureBoard(self.layout, 0, 1)
        self.preemption_checkpoint = preemption_checkpoint
        self._preemption: Optional[PreemptionHandler] = None

    # --- Lightning plumbing ----------------------------------------------------------------

    @property
    def topology(self) -> ModuleTopology:
        return self.layout.topology

    @property
    def is_distributed(self) -> bool:
        # False keeps Lightning from inserting a (re-shuffling) DistributedSampler: every rank
        # loads the same global batch, in the order the user's sampler gives
        # (see ``process_dataloader``).
        return False

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank loads the same global batch; the strategy splits it
        return {"num_replicas": 1, "rank": 0}

    def process_dataloader(self, dataloader: object) -> object:
        """Give a shuffling DataLoader the same order on every rank.

        A ``RandomSampler`` without its own generator draws from each process's global RNG,
        which differs across ranks; it is replaced by a sampler seeded from the run's seed
        (``seed_everything``, else 0) and re-shuffled each epoch. Sequential and user-seeded
        samplers are kept as they are.
        """
        if (
            isinstance(dataloader, DataLoader)
            and isinstance(dataloader.sampler, RandomSampler)
            and dataloader.sampler.generator is None
            and not dataloader.sampler.replacement
        ):
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
            sampler = DistributedSampler(dataloader.dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
            return _update_dataloader(dataloader, sampler)
        return dataloader

    @property
    def communicator(self) -> Optional[MultiModuleCommunicator]:
        """The communicator (after setup), with its traffic counters in ``.stats``."""
        return self._comm

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        super().setup_environment()
        # user errors first, identically on every rank, before any collective
        self.layout.check_world_size(self.world_size)
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        self._dp_groups = {ranks: dist.new_group(list(ranks), timeout=self._timeout) for ranks in self.layout.dp_groups()}
        if self.world_size > 1:
            dist.barrier()  # NCCL wants one collective before the first batched P2P

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        lm = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._check_fit_configuration(trainer)
            self.setup_optimizers(trainer)
        self._partition_model()
        if fitting:
            self._filter_optimizers()
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
            install_pipeline_optimization(trainer)
        self._install_gradient_clipping()
        # Lightning suggests sync_dist=True for epoch-level values; the strategy's metrics are
        # identical on every rank already, so that advice (and its extra all-reduce) does not apply
        warnings.filterwarnings(
            "ignore", message=r"It is recommended to use `self.log\('(train|val|test)_", category=PossibleUserWarning
        )
        assert self._partition is not None
        self._no_grad_modules = self._modules_without_backward(self._partition.frozen_modules)
        self._schedules = {}
        if self.trace_dir is not None and not self._tracer.enabled:
            self._tracer = Tracer(self.global_rank)
        self._comm = MultiModuleCommunicator(self.layout, self.global_rank, self.root_device)
        self._failures = FailureBoard(self.layout, self.global_rank, self.world_size)
        self._failures.attach()
        self._install_preemption(trainer)
        self._runtime = PipelineRuntime(
            self.layout, self.global_rank, self._comm, self._partition.runners, lm, tracer=self._tracer,
            no_grad_modules=self._no_grad_modules, failures=self._failures,
        )

    def _install_preemption(self, trainer: Any) -> None:
        board = self._failures

        def on_stuck(signum: int, waited_s: float) -> None:  # watcher thread: leave a root cause
            report = board.report("preempted", message=(
                f"received {signal.Signals(signum).name} and left mid-step (no step boundary within {waited_s:.0f} s)"))
            print(f"{report.describe()}; exiting with status {128 + signum}", file=sys.stderr, flush=True)
            board.publish(report)

        if self._preemption is None:
            self._preemption = PreemptionHandler(preemption_signals(trainer), on_stuck)
        self._preemption.install(trainer)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Step boundary: stop every rank together if any was sent a preemption signal."""
        super().on_train_batch_start(batch, batch_idx)
        if self._preemption is not None:
            stop_at_boundary(self._preemption, self, self.preemption_checkpoint, self._failures)

    def _modules_without_backward(self, frozen: frozenset[str]) -> frozenset[str]:
        """Frozen modules with nothing trainable upstream: they get no backward at all."""
        closed: set[str] = set()
        for module in self.layout.topology.order:
            if module in frozen and all(u in closed for u in self.layout.topology.upstream(module)):
                closed.add(module)
        return frozenset(closed)

    def connect(self, model: Any) -> None:
        """Attach the model; give it placeholder step methods Lightning's checks look for.

        The strategy runs its own pipelined training/validation/test steps, so the module only
        needs the pipeline hooks. A missing ``training_step`` / ``validation_step`` /
        ``test_step`` that the current Trainer call will run (validation only when there is
        validation data) is bound to a placeholder that explains this if called directly.
        """
        trainer = getattr(model, "_trainer", None)
        if trainer is not None:
            fn = trainer.state.fn
            val_data = trainer.fit_loop.epoch_loop.val_loop._data_source.is_defined()
            needed = {
                "training_step": fn == TrainerFn.FITTING,
                "validation_step": fn == TrainerFn.VALIDATING or (fn == TrainerFn.FITTING and val_data),
                "test_step": fn == TrainerFn.TESTING,
            }
            for name, wanted in needed.items():
                if wanted and not is_overridden(name, model):
                    setattr(model, name, types.MethodType(_run_by_strategy(name), model))
        super().connect(model)

    def _check_fit_configuration(self, trainer: Any) -> None:
        lm = self.lightning_module
        if not lm.automatic_optimization:
            raise PipelineConfigError(
                "MultiModulePipelineStrategy drives forward, backward and the optimizer step itself; manual "
                "optimization (automatic_optimization = False) is not supported. Remove it."
            )
        if trainer.accumulate_grad_batches != 1:
            raise PipelineConfigError(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} is not supported: the pipeline "
                "already accumulates over microbatches. Raise num_microbatches (and the batch size) instead."
            )
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            raise PipelineConfigError(
                "precision='16-mixed' with a gradient scaler is not supported by the pipeline; use "
                "precision='bf16-mixed' or '32-true'."
            )

    def _partition_model(self) -> None:
        lm = self.lightning_module
        cached = getattr(lm, "_mmpp_partition", None)
        if cached is not None and cached[0] is self.layout and cached[1] == self.global_rank:
            self._partition = cached[2]
            return
        if cached is not None:
            raise PipelineConfigError(
                "this LightningModule was already partitioned by another MultiModulePipelineStrategy or rank; "
                "build a fresh model for a new layout."
            )
        self._partition = partition_model(lm, self.layout, self.global_rank)
        lm._mmpp_partition = (self.layout, self.global_rank, self._partition)

    def _filter_optimizers(self) -> None:
        assert self._partition is not None
        owned = self._partition.owned_parameter_ids
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) in owned]

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # --- the pipelined steps ---------------------------------------------------------------

    def schedule(self, forward_only: bool = False, num_microbatches: Optional[int] = None) -> Schedule:
        """The action lists of a training (or forward-only) step, built once and cached."""
        m = num_microbatches or self.num_microbatches
        key = (forward_only, m)
        if key not in self._schedules:
            name = "gpipe" if forward_only else self.schedule_name
            self._schedules[key] = build_schedule(
                self.layout, m, name, forward_only=forward_only, numbering=self.stage_numbering,
                no_grad_modules=frozenset() if forward_only else self._no_grad_modules,
            )
        return self._schedules[key]

    def _run_pipeline(self, batch: Any, forward_only: bool, predict: bool = False) -> StepResult:
        assert self._runtime is not None and self._comm is not None
        size = batch_size_of(batch)
        kind = "predict" if predict else "eval" if forward_only else "train"
        largest = self._largest_batch.get(kind, 0)
        m = microbatch_count(size, self.num_microbatches, self._batch_divisor, short=size < largest)
        self._largest_batch[kind] = max(largest, size)
        micro = split_microbatches(batch, m)
        per = batch_size_of(batch) // m
        rank = self.global_rank

        def shard(module: str, k: int) -> Any:
            slot = self.layout.slot(rank, module)
            assert slot is not None
            return slice_batch(micro[k], self.layout.batch_shard(module, slot.replica, per))

        trainer = self.lightning_module.trainer
        self._failures.begin(trainer.global_step, trainer.state.stage.value if trainer.state.stage else kind)
        self._in_pipeline_step = True
        result = self._runtime.run(
            self.schedule(forward_only, m), shard, keep_sink_outputs=predict, compute_loss=not predict
        )
        self._in_pipeline_step = False
        self._comm.wait_sends()
        self._comm.discard_backward_state()  # specs of channels that carried no gradient
        return result

    def reduce_metrics(self, local: Mapping[str, Tensor], stage: str) -> dict[str, Tensor]:
        """Sum every rank's metric shares over the world, so every rank holds the same values.

        Only sink ranks know the metric names. They are gathered once per stage and cached;
        the one all-reduce per step carries a flag that is non-zero when any rank saw a name
        outside the cache, and then the names are gathered again.
        """
        names = self._metric_names.get(stage, [])
        while True:
            unknown = float(any(n not in names for n in local))
            zero = torch.zeros((), device=self.root_device)
            values = [local[n].to(self.root_device, torch.float32) if n in local else zero for n in names]
            vector = torch.stack(values + [torch.tensor(unknown, device=self.root_device)])
            if self.world_size > 1:
                dist.all_reduce(vector, op=ReduceOp.SUM)
            if vector[-1].item() == 0:
                return {n: vector[i] for i, n in enumerate(names)}
            gathered: list[Any] = [sorted(local)]
            if self.world_size > 1:
                gathered = [None] * self.world_size
                dist.all_gather_object(gathered, sorted(local))
            names = sorted({n for part in gathered for n in part})
            self._metric_names[stage] = names

    def _log_metrics(self, prefix: str, metrics: Mapping[str, Tensor], batch_size: int, on_step: bool) -> None:
        lm = self.lightning_module
        for name, value in metrics.items():
            lm.log(
                f"{prefix}_{name}",
                value,
                prog_bar=name == "loss",
                on_step=on_step,
                on_epoch=not on_step or prefix != "train",
                batch_size=batch_size,
                sync_dist=False,  # already identical on every rank
            )

    def training_step(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        batch = args[0] if args else kwargs["batch"]
        self._tracer.step = self.lightning_module.trainer.global_step
        with self.precision_plugin.train_step_context():
            result = self._run_pipeline(batch, forward_only=False)
        with self._tracer.span("dp_allreduce", "dp"):
            self.synchronize_gradients()
        with self._tracer.span("metrics_allreduce", "metrics"):
            metrics = self.reduce_metrics(result.metric_sums, "train")
        raise_if_loss_not_finite(self._failures, metrics["loss"], result.sink_losses)
        self._log_metrics("train", metrics, batch_size_of(batch), on_step=True)
        return {"loss": metrics["loss"]}

    def synchronize_gradients(self) -> None:
        """Sum each module's gradients over its dp group (colocated modules share one reduction)."""
        assert self._partition is not None
        by_group: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
        for module, runner in self._partition.runners.items():
            ranks = self.layout.dp_group(module, runner.stage)
            by_group.setdefault(ranks, []).extend(runner.parameters())
        sum_gradients(by_group, self._dp_groups)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's optimizer step; the closure runs the whole pipeline step inside it.

        The trace's ``optimizer_step`` event covers what follows the closure: gradient
        clipping and the parameter update.
        """
        if not self._tracer.enabled:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        closure_end = [0]

        def timed_closure() -> Any:
            out = closure()
            closure_end[0] = time.time_ns()
            return out

        result = super().optimizer_step(optimizer, timed_closure, model, **kwargs)
        self._tracer.record("optimizer_step", "optimizer", closure_end[0], time.time_ns())
        return result

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Run the backward hooks only: the pipeline step already ran every backward."""
        lm = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, lm)
        return self.precision_plugin.post_backward(closure_loss, lm)

    def _evaluation_step(self, prefix: str, batch: Any) -> dict[str, Tensor]:
        context = self.precision_plugin.val_step_context if prefix == "val" else self.precision_plugin.test_step_context
        with context():
            result = self._run_pipeline(batch, forward_only=True)
        metrics = self.reduce_metrics(result.metric_sums, prefix)
        self._log_metrics(prefix, metrics, batch_size_of(batch), on_step=False)
        return {f"{prefix}_{n}": v for n, v in metrics.items()}

    def validation_step(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        return self._evaluation_step("val", args[0] if args else kwargs["batch"])

    def test_step(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        return self._evaluation_step("test", args[0] if args else kwargs["batch"])

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward-only pipelined step; returns the sink output for the whole batch on every rank.

        The outputs of every microbatch and dp replica are gathered and concatenated along the
        sink's ``batch_dim`` in sample order. With several sinks, a dict ``{sink: output}``.
        """
        batch = args[0] if args else kwargs["batch"]
        with self.precision_plugin.predict_step_context():
            result = self._run_pipeline(batch, forward_only=True, predict=True)
        return self._gather_sink_outputs(result.sink_outputs)

    def _gather_sink_outputs(self, local: Mapping[int, Mapping[str, Any]]) -> Any:
        mine = {}
        for k, per_sink in local.items():
            for sink, out in per_sink.items():
                replica = self.layout.slot(self.global_rank, sink).replica  # type: ignore[union-attr]
                mine[(sink, replica, k)] = _to_cpu(out)
        if self.world_size > 1:
            parts: list[Any] = [None] * self.world_size
            dist.all_gather_object(parts, mine)
        else:
            parts = [mine]
        pieces: dict[tuple[str, int, int], Any] = {}
        for part in parts:
            pieces.update(part)
        outputs = {}
        for sink in self.layout.topology.sinks:
            ordered = [
                pieces[key] for key in sorted((key for key in pieces if key[0] == sink), key=lambda key: (key[2], key[1]))
            ]
            outputs[sink] = concat_payloads(ordered, dim=self.layout.placements[sink].batch_dim)
        return outputs[self.layout.topology.sinks[0]] if len(outputs) == 1 else outputs

    # --- gradient clipping over the whole model --------------------------------------------

    def _install_gradient_clipping(self) -> None:
        plugin = self.precision_plugin
        if getattr(plugin, "_mmpp_clipping", None) is self:
            return
        plugin.clip_grad_by_norm = self.clip_grad_by_norm  # type: ignore[method-assign]
        plugin._mmpp_clipping = self

    def clip_grad_by_norm(self, optimizer: Any, clip_val: Union[int, float]) -> None:
        """Clip by the global gradient norm over every module and rank, dp replicas counted once."""
        assert self._partition is not None
        squares = torch.zeros((), device=self.root_device, dtype=torch.float32)
        grads: list[Tensor] = []
        for module, runner in self._partition.runners.items():
            slot = self.layout.slot(self.global_rank, module)
            assert slot is not None
            for p in runner.parameters():
                if p.grad is None:
                    continue
                grads.append(p.grad)
                if slot.replica == 0:
                    squares += p.grad.detach().float().pow(2).sum()
        if self.world_size > 1:
            dist.all_reduce(squares, op=ReduceOp.SUM)
        total = squares.sqrt()
        coef = torch.clamp(clip_val / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))

    # --- collectives Lightning asks for ----------------------------------------------------

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def on_exception(self, exception: BaseException) -> None:
        """An error inside a pipeline step (a bad ``pipeline_loss`` on a sink rank, say) is
        raised on one rank while its peers wait for its messages. Tearing down the process group
        makes their transfers fail at once instead of after the process-group timeout."""
        if self._in_pipeline_step and self.world_size > 1 and _distributed_is_initialized():
            log.error("rank %d failed inside a pipeline step; closing the process group so peers stop", self.global_rank)
            self._dp_groups = {}
            drop_transfer_references(exception, self._comm)
            dist.destroy_process_group()
            self._failures.linger()  # rank 0 serves the store: let peers read the root cause first
        self._in_pipeline_step = False

    def _write_trace(self) -> None:
        if not self._tracer.enabled or self.trace_dir is None:
            return
        self._tracer.write(self.trace_dir)
        if self.world_size > 1 and _distributed_is_initialized():
            dist.barrier()
        if self.global_rank == 0:
            merge_traces(self.trace_dir, self.world_size)

    def teardown(self) -> None:
        self._write_trace()
        for group in self._dp_groups.values():
            if _distributed_is_initialized():
                dist.destroy_process_group(group)
        self._dp_groups = {}
        self._failures.release()
        if self._preemption is not None:
            self._preemption.uninstall()
        super().teardown()

    def __str__(self) -> str:
        return (
            f"MultiModulePipelineStrategy(schedule={self.schedule_name!r}, num_microbatches={self.num_microbatches}, "
            f"world_size={self.layout.world_size})\n{self.layout.table()}"
        )

    __repr__ = __str__


def _to_cpu(payload: Any) -> Any:
    return tree_map(lambda x: x.detach().cpu() if isinstance(x, Tensor) else x, payload)


def _run_by_strategy(name: str) -> Any:
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{type(self).__name__}.{name} is run by MultiModulePipelineStrategy as a pipelined step; it was bound "
            "only so Lightning enables the loop. Define it yourself to use the module without the strategy."
        )

    return step
