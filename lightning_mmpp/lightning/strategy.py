"""``MultiModulePipelineStrategy``: multi-module pipeline parallelism as a Lightning strategy.

Lightning glue over :class:`~lightning_mmpp.engine.engine.PipelineEngine`: the strategy sets up
the process group, builds one engine per Trainer call (``fit``, ``validate``, ...) in ``setup``,
runs the engine's step inside Lightning's training / evaluation / predict steps, logs the
engine's reduced metrics, and hands checkpoints to :mod:`lightning_mmpp.state.checkpoint`.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.core.module import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_mmpp.core.kinds import DEFAULT_NUMBERING, Numbering, ScheduleName, StepKind
from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout, placements_table, placements_world_size
from lightning_mmpp.core.schedule import Schedule
from lightning_mmpp.core.topology import ModuleTopology
from lightning_mmpp.engine.comm import MultiModuleCommunicator
from lightning_mmpp.engine.engine import PipelineEngine, StepOutput, check_engine_options, is_partitioned
from lightning_mmpp.engine.gc_freeze import FrozenHeap
from lightning_mmpp.engine.host_memory import KeptHostMemory
from lightning_mmpp.engine.microbatch import microbatch_count
from lightning_mmpp.engine.sharding import check_grad_reduction
from lightning_mmpp.engine.trace import NULL_TRACER
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.lightning import fit
from lightning_mmpp.lightning.checkpointing import PipelineCheckpointing
from lightning_mmpp.lightning.world import PipelineWorld
from lightning_mmpp.lightning.data import same_order_on_every_rank
from lightning_mmpp.lightning.lightning_api import (
    CheckedSubprocessLauncher,
    PipelineMultiProcessingLauncher,
    install_pipeline_optimization,
)
from lightning_mmpp.lightning.placeholders import PlaceholderSteps
from lightning_mmpp.lightning.plugins import with_global_norm_clipping
from lightning_mmpp.lightning.preemption import PreemptionHandler, install_preemption, stop_at_boundary
from lightning_mmpp.model.hooks import resolve_topology
from lightning_mmpp.model.initialization import has_meta_tensors
from lightning_mmpp.model.pretrained import PretrainedWeights
from lightning_mmpp.state.checkpoint import optimizer_state_to_device


class MultiModulePipelineStrategy(PipelineCheckpointing, PipelineWorld, ParallelStrategy):
    """Train a multi-module LightningModule with multi-module pipeline parallelism.

    Each module (an ``nn.Sequential`` / ``nn.ModuleList`` attribute of the LightningModule
    named like its placement key) gets its own ranks, pipeline depth and data-parallel size;
    modules form a DAG; a multi-module 1F1B (or GPipe, or zero-bubble) schedule drives them.

    Args:
        placements: ``{module: ModulePlacement(pp, dp, rank_offset)}``.
        topology: ``{module: [downstream modules]}``, a DAG whose sinks compute the loss. May be
            omitted when the LightningModule declares it as ``pipeline_topology``; if both are
            given they must agree.
        num_microbatches: microbatches per global batch.
        schedule, stage_numbering, pretrained, static_shapes, trace_dir, nvtx, sharded_grad_reduction: the
            engine's options, see
            :class:`~lightning_mmpp.engine.engine.PipelineEngine` (``"1f1b"``, ``"gpipe"`` or
            ``"zero_bubble"``; ``{module: weights file}``; a promise of fixed shapes; a directory
            for a Chrome trace of every action, written at teardown; NVTX ranges per action; when
            ``shard=True`` stages reduce-scatter gradients, ``"step"`` or ``"microbatch"``).
        process_group_backend: defaults to gloo on CPU, NCCL on CUDA.
        timeout: process-group timeout.
        start_method: ``"popen"`` (re-run the script per rank, like ``ddp``), ``"spawn"`` or
            ``"fork"``. Ignored under ``torchrun`` / SLURM.
        preemption_checkpoint: where to save a checkpoint when the job is preempted (SIGTERM, or
            SLURM's requeue signal): every rank stops at the next step boundary, saves it there
            and exits with status ``128 + signal`` (see :mod:`lightning_mmpp.lightning.preemption`).
        freeze_gc: when training starts, freeze the objects alive then (after collecting the
            young generations), so that Python's full collections stop walking them (one stopped
            a rank of the README example for 300-350 ms, its peers waiting); unfrozen at
            teardown. See :mod:`lightning_mmpp.engine.gc_freeze`. ``False``: leave the collector
            as it is.
        keep_host_memory: on a CPU device, when training starts, have glibc's ``malloc`` keep
            the memory a step frees (blocks up to 32 MiB, the heap's free top) for the next step
            instead of handing it back to the operating system, so the next step's activations
            take no page faults (a plan streaming 2 MiB activations stepped at 1.146-1.194x its
            predicted step as glibc was, at 1.016-1.079x kept: the planner's profile reuses its
            blocks); set back at teardown. Resident memory then stays near its peak between
            steps. See :mod:`lightning_mmpp.engine.host_memory`. ``False``: leave the allocator
            as it is.

    Modules built in ``configure_model()`` or under ``trainer.init_module()`` are created on the
    meta device; each rank allocates and initialises only the stages it holds
    (:func:`~lightning_mmpp.materialize`, seeded by the run's seed), so no rank holds the whole model.
    """

    strategy_name = "multimodule_pipeline"

    def __init__(
        self,
        placements: Mapping[str, ModulePlacement],
        topology: Optional[Mapping[str, Sequence[str]]] = None,
        num_microbatches: Optional[int] = None,
        schedule: ScheduleName | str = ScheduleName.ONE_F_ONE_B,
        *,
        stage_numbering: Numbering | str = DEFAULT_NUMBERING,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: timedelta = timedelta(minutes=30),
        start_method: Literal["popen", "spawn", "fork"] = "popen",
        trace_dir: Optional[str] = None,
        pretrained: Optional[Mapping[str, Union[str, os.PathLike, PretrainedWeights]]] = None,
        preemption_checkpoint: Optional[str] = None,
        static_shapes: bool = False,
        nvtx: Optional[bool] = None,
        sharded_grad_reduction: str = "step",
        freeze_gc: bool = True,
        keep_host_memory: bool = True,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        if start_method not in ("popen", "spawn", "fork"):
            raise PipelineConfigError(f"start_method={start_method!r}: choose 'popen', 'spawn' or 'fork'.")
        self._placements = dict(placements)
        # with ``topology=None`` the layout is built when the model (its ``pipeline_topology``) connects
        self._v_shape = ScheduleName.parse(schedule).v_shape  # zbv places chunks V-shaped
        self._layout: Optional[PipelineLayout] = (
            None if topology is None else PipelineLayout(placements, topology, v_shape=self._v_shape)
        )
        self.num_microbatches = num_microbatches
        self.schedule_name = schedule
        self.stage_numbering = stage_numbering
        self.static_shapes = static_shapes
        self.pretrained = dict(pretrained or {})
        self._check_options()
        self.trace_dir = trace_dir
        self.nvtx = nvtx
        self.sharded_grad_reduction = check_grad_reduction(sharded_grad_reduction)
        self.preemption_checkpoint = preemption_checkpoint
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self._num_nodes = 1
        self._engine: Optional[PipelineEngine] = None
        self._placeholders = PlaceholderSteps()
        self._preemption: Optional[PreemptionHandler] = None
        self.freeze_gc = freeze_gc
        self._frozen_heap = FrozenHeap()
        self.keep_host_memory = keep_host_memory
        self._kept_host_memory = KeptHostMemory()

    def _check_options(self) -> None:
        placeholder = self._layout or PipelineLayout(
            self._placements, {m: [] for m in self._placements}, v_shape=self._v_shape
        )
        self.schedule_name, self.stage_numbering = check_engine_options(
            placeholder if self._layout is None else self._layout, self.num_microbatches, self.schedule_name,
            self.stage_numbering, self.static_shapes, self.pretrained,
        )

    # --- what the strategy holds ---------------------------------------------------------------

    @property
    def layout(self) -> PipelineLayout:
        """The placement of every module on ranks (known once a topology is: see ``topology``)."""
        if self._layout is None:
            raise PipelineConfigError(
                "MultiModulePipelineStrategy(topology=None) has no topology until the Trainer connects the model; "
                "`strategy.ranks_needed` tells the world size already. Declare `pipeline_topology` on the "
                "LightningModule or pass topology= to the strategy."
            )
        return self._layout

    @property
    def topology(self) -> ModuleTopology:
        return self.layout.topology

    @property
    def ranks_needed(self) -> int:
        """How many processes the placements need (``devices`` x ``num_nodes``); known before the topology."""
        return placements_world_size(self._placements)

    @property
    def engine(self) -> Optional[PipelineEngine]:
        """This rank's :class:`~lightning_mmpp.engine.engine.PipelineEngine` of the current (or, closed,
        the last) Trainer call."""
        return self._engine

    @property
    def communicator(self) -> Optional[MultiModuleCommunicator]:
        """The communicator (during a Trainer call), with its traffic counters in ``.stats``."""
        return self._engine.comm if self._engine is not None else None

    def schedule(self, forward_only: bool = False, num_microbatches: Optional[int] = None) -> Schedule:
        """The action lists of a training (or forward-only) step (see :meth:`PipelineEngine.schedule`)."""
        assert self._engine is not None, "the schedule is built in setup"
        return self._engine.schedule(forward_only, num_microbatches)

    # --- Lightning plumbing ----------------------------------------------------------------------

    @property
    def is_distributed(self) -> bool:
        # False keeps Lightning from inserting a (re-shuffling) DistributedSampler: every rank
        # loads the same global batch, in the order the user's sampler gives (process_dataloader)
        return False

    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = with_global_norm_clipping(Precision(), self)
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        self._precision_plugin = None if precision_plugin is None else with_global_norm_clipping(precision_plugin, self)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}  # every rank loads the same global batch; the engine splits it

    def process_dataloader(self, dataloader: object) -> object:
        return same_order_on_every_rank(dataloader)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = CheckedSubprocessLauncher(self, self.cluster_environment, self.num_processes,
                                                        self.num_nodes)
        else:  # checks before launch; brings the whole trained model (or a clear warning) back to the parent
            self._launcher = PipelineMultiProcessingLauncher(self, start_method=self._start_method)

    def check_before_launch(self, trainer: Any, args: Sequence[Any]) -> None:
        """The configuration errors knowable before any worker starts, raised in the launching
        process (and, under torchrun / SLURM, on every rank before any collective): the model's
        wiring, the world size, the model's layers and hooks (unless built in
        ``configure_model``), and a fixed training batch size against ``num_microbatches`` x lcm(dp)."""
        model = args[0] if args and isinstance(args[0], LightningModule) else None
        if model is not None:
            self._connect_topology(model)
        if self._layout is None:
            return  # the wiring comes from a model given through a datamodule: checked in the workers
        self.layout.check_world_size(self.num_nodes * self.num_processes)
        if model is not None and not is_partitioned(model) and not is_overridden("configure_model", model):
            fit.check_model(model, self.layout)
        loader = args[1] if len(args) > 1 and trainer is not None and trainer.state.fn == TrainerFn.FITTING else None
        if isinstance(loader, DataLoader) and loader.batch_size is not None:
            microbatch_count(loader.batch_size, self.num_microbatches, self.layout.batch_divisor)  # type: ignore[arg-type]

    def _connect_topology(self, model: Any) -> None:
        self._layout = resolve_topology(model, self._placements, self._layout, v_shape=self._v_shape)
        self._check_options()

    def connect(self, model: Any) -> None:
        """Attach the model; give it placeholder step methods for this Trainer call (see
        :class:`~lightning_mmpp.lightning.placeholders.PlaceholderSteps`)."""
        self._connect_topology(model)
        trainer = getattr(model, "_trainer", None)
        if trainer is not None:
            self._placeholders.bind(model, trainer)
        super().connect(model)

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        lm = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            fit.check_fit_configuration(trainer, lm, self.precision_plugin)
            fit.setup_one_optimizer(self, trainer)
            fit.replace_model_summary(trainer, self.lightning_module, self.layout, self.schedule_name,
                                      self.num_microbatches)
        self._engine = PipelineEngine(
            lm, self.layout, self.num_microbatches, self.schedule_name,  # type: ignore[arg-type]
            stage_numbering=self.stage_numbering, device=self.root_device,
            optimizers=self.optimizers if fitting else (), convert_module=self.precision_plugin.convert_module,
            precision=str(getattr(self.precision_plugin, "precision", "32-true")), pretrained=self.pretrained,
            static_shapes=self.static_shapes, trace_dir=self.trace_dir, timeout=self._timeout, nvtx=self.nvtx,
            sharded_grad_reduction=self.sharded_grad_reduction,
        )
        self.setup_precision_plugin()
        if fitting:
            for optimizer in self.optimizers:
                optimizer_state_to_device(optimizer, self.root_device)
            install_pipeline_optimization(trainer)
        # Lightning suggests sync_dist=True for epoch-level values; the engine's metrics are
        # identical on every rank already, so that advice (and its extra all-reduce) does not apply
        warnings.filterwarnings(
            "ignore", message=r"It is recommended to use `self.log\('(train|val|test)_", category=PossibleUserWarning
        )
        self._preemption = install_preemption(self._preemption, trainer, self._engine.failures)

    def on_train_start(self) -> None:
        """Training starts: freeze the objects alive (``freeze_gc``); on a CPU device, keep
        the memory steps free (``keep_host_memory``)."""
        super().on_train_start()
        if self.freeze_gc:
            self._frozen_heap.freeze()
        if self.keep_host_memory and self.root_device.type == "cpu":
            self._kept_host_memory.keep()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Step boundary: stop every rank together if any was sent a preemption signal."""
        super().on_train_batch_start(batch, batch_idx)
        if self._preemption is not None and self._engine is not None:
            stop_at_boundary(self._preemption, self, self.preemption_checkpoint, self._engine.failures)

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Build on the meta device (``configure_model()``, ``trainer.init_module()``) unless
        ``empty_init=False``: each rank materialises only its own stages in ``setup``."""
        device = torch.device("meta") if empty_init is not False else nullcontext()
        with device, self.precision_plugin.tensor_init_context():
            yield

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # --- the pipelined steps -----------------------------------------------------------------

    def _step(self, batch: Any, kind: StepKind) -> StepOutput:
        """One engine step; a training, validation or test step also carries the ranks'
        preemption signals in its metric all-reduce, for the next step boundary to act on."""
        assert self._engine is not None
        trainer = self.lightning_module.trainer
        handler = self._preemption if kind is not StepKind.PREDICT else None
        # read when the metric all-reduce starts, after this rank's pipeline: with Lightning's
        # per-batch broadcast gone, a signal rank 0 got while the last stages ran still counts
        agreement = (lambda: handler.contribution(self.world_size, self.global_rank)) if handler is not None else None
        output = self._engine.step(batch, kind, step_index=trainer.global_step, agreement=agreement)
        if handler is not None and output.agreement is not None:
            handler.carried(output.agreement)
        return output

    def _log(self, kind: StepKind, output: StepOutput) -> None:
        lm = self.lightning_module
        on_step = kind is StepKind.TRAIN
        # per-token metrics weigh by tokens, so an epoch value is sum(loss_sum) / sum(num_tokens)
        for metrics, weight in ((output.metrics, output.num_samples), (output.token_metrics, output.num_tokens)):
            for name, value in metrics.items():
                lm.log(f"{kind.value}_{name}", value, prog_bar=name == "loss", on_step=on_step,
                       on_epoch=not on_step, batch_size=weight, sync_dist=False)  # identical on every rank

    def training_step(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        with self.precision_plugin.train_step_context():
            output = self._step(args[0] if args else kwargs["batch"], StepKind.TRAIN)
        self._log(StepKind.TRAIN, output)
        return {"loss": output.loss}  # type: ignore[dict-item]

    def _evaluation_step(self, kind: StepKind, batch: Any) -> dict[str, Tensor]:
        context = self.precision_plugin.val_step_context if kind is StepKind.VALIDATE else \
            self.precision_plugin.test_step_context
        with context():
            output = self._step(batch, kind)
        self._log(kind, output)
        return {f"{kind.value}_{n}": v for n, v in {**output.metrics, **output.token_metrics}.items()}

    def validation_step(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        return self._evaluation_step(StepKind.VALIDATE, args[0] if args else kwargs["batch"])

    def test_step(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        return self._evaluation_step(StepKind.TEST, args[0] if args else kwargs["batch"])

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward-only pipelined step; returns the sink output for the whole batch on every rank
        (gathered in sample order; a dict ``{sink: output}`` with several sinks)."""
        with self.precision_plugin.predict_step_context():
            return self._step(args[0] if args else kwargs["batch"], StepKind.PREDICT).predictions

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's optimizer step; the closure runs the whole pipeline step inside it. The
        trace's ``optimizer_step`` event covers what follows the closure (clipping, the update)."""
        tracer = self._engine.tracer if self._engine is not None else NULL_TRACER
        if not tracer.enabled:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        closure_end = [0]

        def timed_closure() -> Any:
            out = closure()
            closure_end[0] = time.time_ns()
            return out

        result = super().optimizer_step(optimizer, timed_closure, model, **kwargs)
        tracer.record("optimizer_step", "optimizer", closure_end[0], time.time_ns())
        return result

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Run the backward hooks only: the pipeline step already ran every backward."""
        lm = self.lightning_module
        return self.precision_plugin.post_backward(self.precision_plugin.pre_backward(closure_loss, lm), lm)

    def clip_grad_by_norm(self, max_norm: float) -> Tensor:
        """Clip by the global gradient norm over every module and rank, dp replicas counted once
        (Lightning's ``gradient_clip_val`` arrives here through :mod:`lightning_mmpp.lightning.plugins`)."""
        assert self._engine is not None
        return self._engine.clip_grad_norm_(max_norm)

    def on_exception(self, exception: BaseException) -> None:
        """A failure inside a pipeline step closes the process group so peers stop at once
        (see :meth:`PipelineEngine.abort`); the engine has done so already where it saw it."""
        if self._engine is not None:
            self._engine.abort(exception)

    def teardown(self) -> None:
        self._frozen_heap.release()
        self._kept_host_memory.release()
        if self._engine is not None:
            self._engine.close()  # kept (closed) for inspection: its partition, the keys it read
        self._placeholders.remove()
        if self._preemption is not None:
            self._preemption.uninstall()
        lm = self.lightning_module
        if lm is not None and has_meta_tensors(lm):
            # setup failed before this rank's stages were materialised: nothing to move to CPU
            self._lightning_module = None
            try:
                super().teardown()
            finally:
                self._lightning_module = lm
            return
        super().teardown()

    def __str__(self) -> str:
        head = f"MultiModulePipelineStrategy(schedule={self.schedule_name!r}, num_microbatches={self.num_microbatches}"
        if self._layout is None:
            return (f"{head}, world_size={self.ranks_needed}, topology from the model: global stages once the "
                    f"Trainer connects it)\n{placements_table(self._placements)}")
        return f"{head}, world_size={self.layout.world_size})\n{self.layout.table(self.stage_numbering)}"

    __repr__ = __str__

