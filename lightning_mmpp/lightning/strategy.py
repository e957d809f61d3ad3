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
import weakref
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.module import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import Tensor
from torch.distributed import ReduceOp
from torch.utils.data import DataLoader

from lightning_mmpp.state import checkpoint as _checkpoint
from lightning_mmpp.state.checkpoint import optimizer_state_to_device
from lightning_mmpp.engine.comm import MultiModuleCommunicator
from lightning_mmpp.model.construction import ConstructionPlan, build_own_stages, plan_construction
from lightning_mmpp.engine.data_parallel import StageGradients
from lightning_mmpp.engine.sharding import apply_memory_options, check_memory_options
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.model.initialization import has_meta_tensors
from lightning_mmpp.engine.failures import FailureBoard, drop_transfer_references, raise_if_loss_not_finite
from lightning_mmpp.lightning.preemption import PreemptionHandler, preemption_signals, stop_at_boundary
from lightning_mmpp.lightning.data import same_order_on_every_rank
from lightning_mmpp.lightning.lightning_api import (
    CheckedSubprocessLauncher,
    PipelineMultiProcessingLauncher,
    default_backend,
    has_validation_data,
    init_process_group,
    install_pipeline_optimization,
    reduce_tensor,
)
from lightning_mmpp.engine.metrics import MetricReducer
from lightning_mmpp.engine.microbatch import BatchSplitter, batch_size_of, microbatch_count
from lightning_mmpp.model.partition import Partition, check_model, partition_model
from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout
from lightning_mmpp.lightning.plugins import with_global_norm_clipping
from lightning_mmpp.engine.predict import SinkOutputGatherer
from lightning_mmpp.model.pretrained import PretrainedWeights
from lightning_mmpp.engine.runtime import TOKEN_COUNT, TOKEN_LOSS, PipelineRuntime, StepResult
from lightning_mmpp.core.schedule import Schedule, build_schedule, check_schedule_args
from lightning_mmpp.model.summary import pipeline_summary
from lightning_mmpp.engine.tied import counts_in_norm, sum_tied_gradients, tie_groups
from lightning_mmpp.core.topology import ModuleTopology
from lightning_mmpp.engine.trace import NULL_TRACER, Tracer, merge_traces

log = logging.getLogger(__name__)
_TOKEN_PREFIX = "tokens/"  # per-token sums travel beside the metrics in the one metrics all-reduce

# The models this process has partitioned, with (layout, rank, partition): a partitioned model
# keeps only its rank's layers, so it can be reused by the strategy that partitioned it (fit,
# then validate/test/predict) and by no other. Weak keys: the entry goes with the model.
_PARTITIONED: "weakref.WeakKeyDictionary[Any, tuple[PipelineLayout, int, Partition]]" = weakref.WeakKeyDictionary()


class MultiModulePipelineStrategy(ParallelStrategy):
    """Train a multi-module LightningModule with multi-module pipeline parallelism.

    Each module (an ``nn.Sequential`` / ``nn.ModuleList`` attribute of the LightningModule
    named like its placement key) gets its own ranks, pipeline depth and data-parallel size;
    modules form a DAG; a multi-module 1F1B (or GPipe) schedule drives them.

    Args:
        placements: ``{module: ModulePlacement(pp, dp, rank_offset)}``.
        topology: ``{module: [downstream modules]}``, a DAG whose sinks compute the loss. May be
            omitted when the LightningModule declares it as ``pipeline_topology``; if both are
            given they must agree.
        num_microbatches: microbatches per global batch.
        schedule: ``"1f1b"``, ``"gpipe"`` or ``"zero_bubble"`` (see :mod:`lightning_mmpp.core.schedule`).
        stage_numbering: ``"alap"`` (default) or ``"asap"``; which global stage index bounds the
            microbatches a stage holds in flight under 1F1B (see :mod:`lightning_mmpp.core.topology`).
        process_group_backend: defaults to gloo on CPU, NCCL on CUDA.
        timeout: process-group timeout.
        start_method: ``"popen"`` (re-run the script per rank, like ``ddp``), ``"spawn"`` or
            ``"fork"``. Ignored under ``torchrun`` / SLURM.
        trace_dir: record a timeline of every forward, backward, communication wait, gradient
            reduction and optimizer step, and write Chrome trace-event JSON there at teardown
            (``trace_rank{r}.json`` per rank and a merged ``trace.json``). Off by default.
        pretrained: ``{module: source}`` initial weights per module, loaded after partitioning
            (each rank reads only its own stages' tensors): a ``.safetensors`` file, a torch
            state-dict file, a torch.distributed.checkpoint directory, or
            :class:`~lightning_mmpp.PretrainedWeights` to rename keys. See :mod:`lightning_mmpp.model.pretrained`.

    Modules built in ``configure_model()`` or under ``trainer.init_module()`` are created on the
    meta device; each rank allocates and initialises only the stages it holds
    (:func:`~lightning_mmpp.materialize`, seeded by the run's seed), so no rank holds the whole model.
        preemption_checkpoint: where to save a checkpoint when the job is preempted (SIGTERM, or
            SLURM's requeue signal): every rank stops at the next step boundary, saves it there
            and exits with status ``128 + signal`` (see :mod:`lightning_mmpp.lightning.preemption`).
        static_shapes: promise that every microbatch sends the same shapes and dtypes across
            each stage boundary and bridge (training and evaluation alike: drop or pad a last
            smaller batch). Received headers are then checked once per step instead of where
            each payload is taken, which on a GPU removes a host synchronisation per received
            message. A changed shape raises a ``PipelineConfigError`` on the sending rank.
    """

    strategy_name = "multimodule_pipeline"

    def __init__(
        self,
        placements: Mapping[str, ModulePlacement],
        topology: Optional[Mapping[str, Sequence[str]]] = None,
        num_microbatches: Optional[int] = None,
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
        pretrained: Optional[Mapping[str, Union[str, os.PathLike, PretrainedWeights]]] = None,
        preemption_checkpoint: Optional[str] = None,
        static_shapes: bool = False,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        check_schedule_args(schedule, num_microbatches, stage_numbering)  # type: ignore[arg-type]
        if start_method not in ("popen", "spawn", "fork"):
            raise PipelineConfigError(f"start_method={start_method!r}: choose 'popen', 'spawn' or 'fork'.")
        if not isinstance(static_shapes, bool):
            raise PipelineConfigError(f"static_shapes={static_shapes!r}: give True or False.")
        self.static_shapes = static_shapes
        self._placements = placements
        # with ``topology=None`` the layout is built when the model (its ``pipeline_topology``) connects
        self._layout: Optional[PipelineLayout] = None if topology is None else PipelineLayout(placements, topology)
        if self._layout is not None:
            check_memory_options(self._layout.placements, schedule)
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
        self._batches: Optional[BatchSplitter] = None
        self._in_pipeline_step = False
        self._gradients: Optional[StageGradients] = None
        self._sharded: dict[str, Any] = {}  # this rank's FSDP2-sharded stages, by module
        self._metrics: Optional[MetricReducer] = None
        self._predictions: Optional[SinkOutputGatherer] = None
        self._placeholder_steps: list[tuple[Any, str]] = []  # (model, method name) bound by ``connect``
        self.trace_dir = trace_dir
        self._tracer: Tracer | Any = NULL_TRACER
        self.pretrained = dict(pretrained or {})
        unknown = sorted(set(self.pretrained) - set(placements))
        if unknown:
            raise PipelineConfigError(
                f"pretrained= names {unknown}, which are not placed modules {list(placements)}; key it by "
                "placement name."
            )
        self._pretrained_keys_read: dict[str, list[str]] = {}
        self._tie_groups: dict[tuple[int, ...], Any] = {}  # owner ranks of parameters tied across ranks
        self._failures = FailureBoard(self._layout, 0, 1)
        self.preemption_checkpoint = preemption_checkpoint
        self._preemption: Optional[PreemptionHandler] = None

    # --- Lightning plumbing ----------------------------------------------------------------

    @property
    def layout(self) -> PipelineLayout:
        """The placement of every module on ranks (known once a topology is: see ``topology``)."""
        if self._layout is None:
            raise PipelineConfigError(
                "MultiModulePipelineStrategy(topology=None) has no topology until the Trainer connects the model; "
                "declare `pipeline_topology` on the LightningModule or pass topology= to the strategy."
            )
        return self._layout

    @property
    def topology(self) -> ModuleTopology:
        return self.layout.topology

    def _resolve_topology(self, model: Any) -> None:
        """Take the model's ``pipeline_topology``; check it against the strategy's ``topology=``."""
        declared = getattr(model, "pipeline_topology", None)
        if declared is None:
            if self._layout is None:
                raise PipelineConfigError(
                    f"MultiModulePipelineStrategy has no topology: declare `pipeline_topology = {{module: "
                    f"[downstream modules]}}` on {type(model).__name__} or pass topology= to the strategy."
                )
            return
        try:
            ours = ModuleTopology(declared)
        except PipelineConfigError as err:
            raise PipelineConfigError(f"{type(model).__name__}.pipeline_topology: {err}") from None
        if self._layout is None:
            self._layout = PipelineLayout(self._placements, ours)
            check_memory_options(self._layout.placements, self.schedule_name)
            return
        theirs = self._layout.topology
        if _edges(ours) != _edges(theirs):
            raise PipelineConfigError(
                f"{type(model).__name__}.pipeline_topology {_edges(ours)} and the strategy's topology= "
                f"{_edges(theirs)} disagree; pass only one (the model's is enough) or make them equal."
            )

    @property
    def is_distributed(self) -> bool:
        # False keeps Lightning from inserting a (re-shuffling) DistributedSampler: every rank
        # loads the same global batch, in the order the user's sampler gives
        # (see ``process_dataloader``).
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
        """Every rank loads the same global batch: see :func:`~lightning_mmpp.engine.microbatch.same_order_on_every_rank`."""
        return same_order_on_every_rank(dataloader)

    @property
    def communicator(self) -> Optional[MultiModuleCommunicator]:
        """The communicator (after setup), with its traffic counters in ``.stats``."""
        return self._comm

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = CheckedSubprocessLauncher(self, self.cluster_environment, self.num_processes,
                                                        self.num_nodes)
        else:
            # checks before launch; brings the whole trained model (or a clear warning) back to the parent
            self._launcher = PipelineMultiProcessingLauncher(self, start_method=self._start_method)

    def check_before_launch(self, trainer: Any, args: Sequence[Any]) -> None:
        """The configuration errors knowable before any worker starts, raised in the launching
        process (and, under torchrun / SLURM, on every rank before any collective), with the
        messages the workers would give: the model's wiring, the world size, the model's layer
        containers and hooks (unless it builds them in ``configure_model``), and a fixed
        training ``DataLoader`` batch size against ``num_microbatches`` x lcm(dp sizes).
        """
        model = args[0] if args and isinstance(args[0], LightningModule) else None
        if model is not None:
            self._resolve_topology(model)
        if self._layout is None:
            return  # the wiring comes from a model given through a datamodule: checked in the workers
        self.layout.check_world_size(self.num_nodes * self.num_processes)
        if model is not None and model not in _PARTITIONED and not is_overridden("configure_model", model):
            check_model(model, self.layout)
        loader = args[1] if len(args) > 1 and trainer is not None and trainer.state.fn == TrainerFn.FITTING else None
        if isinstance(loader, DataLoader) and loader.batch_size is not None:
            divisor = math.lcm(*(p.dp for p in self.layout.placements.values()))
            microbatch_count(loader.batch_size, self.num_microbatches, divisor)  # type: ignore[arg-type]

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
        backend = self._process_group_backend or default_backend(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        init_process_group(self.cluster_environment, backend, timeout=self._timeout)
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
            self._setup_one_optimizer(trainer)
            self._replace_model_summary(trainer)
        self._partition_model()
        if fitting:
            self._filter_optimizers()
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._sharded = apply_memory_options(
            self.layout, self._partition.runners, self._partition.tied, self._dp_groups, self.root_device,
            str(getattr(self.precision_plugin, "precision", "32-true")), self.optimizers if fitting else (),
        )
        self.setup_precision_plugin()
        if fitting:
            for optimizer in self.optimizers:
                optimizer_state_to_device(optimizer, self.root_device)
            install_pipeline_optimization(trainer)
        # Lightning suggests sync_dist=True for epoch-level values; the strategy's metrics are
        # identical on every rank already, so that advice (and its extra all-reduce) does not apply
        warnings.filterwarnings(
            "ignore", message=r"It is recommended to use `self.log\('(train|val|test)_", category=PossibleUserWarning
        )
        assert self._partition is not None
        self._no_grad_modules = self.layout.no_backward_modules(self._partition.frozen_modules)
        self._schedules = {}
        if self.trace_dir is not None and not self._tracer.enabled:
            self._tracer = Tracer(self.global_rank)
        # a parameter tied across ranks counts once in the global norm, on its first owner
        counted_elsewhere = [t.local for t in self._partition.tied
                             if t.local is not None and not counts_in_norm(self.layout, t, self.global_rank)]
        if self._gradients is not None:
            self._gradients.close()
        self._gradients = StageGradients.for_rank(
            self.layout, self.global_rank, self._partition.runners, self._dp_groups, self.world_size,
            counted_elsewhere=counted_elsewhere, sharded=self._sharded,
            launch_in_backward=self.root_device.type != "cpu",  # see lightning_mmpp.engine.data_parallel
        )
        self._batches = BatchSplitter(self.layout, self.global_rank, self.num_microbatches)  # type: ignore[arg-type]
        if self.world_size > 1 and not self._tie_groups:
            self._tie_groups = tie_groups(self.layout, self._partition.tied, self._timeout)
        self._metrics = MetricReducer(self.world_size, self.root_device)
        self._predictions = SinkOutputGatherer(self.layout, self.global_rank, self.root_device, self.world_size)
        self._comm = MultiModuleCommunicator(self.layout, self.global_rank, self.root_device,
                                             static_specs=self.static_shapes)
        self._failures = FailureBoard(self.layout, self.global_rank, self.world_size)
        self._failures.attach()
        self._install_preemption(trainer)
        self._runtime = PipelineRuntime(
            self.layout, self.global_rank, self._comm, self._partition.runners, lm, tracer=self._tracer,
            no_backward_modules=self._no_grad_modules, failures=self._failures, gradient_sync=self._gradients,
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

    def connect(self, model: Any) -> None:
        """Attach the model; give it placeholder step methods for this Trainer call.

        The strategy runs its own pipelined training/validation/test/predict steps, so the
        module only needs the pipeline hooks. Lightning, however, enables a loop only when the
        module overrides its step method (``training_step``, ``validation_step`` when there is
        validation data, ``test_step``; ``predict_step`` or ``forward`` for predict). For the
        duration of the Trainer call, each missing one the call will run is bound on the
        instance to a placeholder that explains this if called directly; ``teardown`` removes
        them again.
        """
        self._resolve_topology(model)
        trainer = getattr(model, "_trainer", None)
        if trainer is not None:
            fn = trainer.state.fn
            val_data = has_validation_data(trainer)
            needed = {
                "training_step": fn == TrainerFn.FITTING,
                "validation_step": fn == TrainerFn.VALIDATING or (fn == TrainerFn.FITTING and val_data),
                "test_step": fn == TrainerFn.TESTING,
                "predict_step": fn == TrainerFn.PREDICTING and not is_overridden("forward", model),
            }
            for name, wanted in needed.items():
                if wanted and not is_overridden(name, model):
                    setattr(model, name, types.MethodType(_run_by_strategy, model))
                    self._placeholder_steps.append((model, name))
            if fn == TrainerFn.PREDICTING and is_overridden("predict_step", model):
                rank_zero_warn(
                    f"{type(model).__name__}.predict_step is not called under MultiModulePipelineStrategy: "
                    "trainer.predict runs the pipeline forward and returns each batch's sink output "
                    "(a dict by sink name with several sinks); post-process the returned predictions instead."
                )
        super().connect(model)

    def _remove_placeholder_steps(self) -> None:
        for model, name in self._placeholder_steps:
            model.__dict__.pop(name, None)
        self._placeholder_steps = []

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

    def _setup_one_optimizer(self, trainer: Any) -> None:
        """Lightning's ``setup_optimizers``, with advice that works under the strategy for several optimizers."""
        try:
            self.setup_optimizers(trainer)
        except RuntimeError as err:
            if "multiple optimizers" not in str(err):
                raise
            raise PipelineConfigError(
                f"{type(self.lightning_module).__name__}.configure_optimizers returned several optimizers; "
                "MultiModulePipelineStrategy steps one optimizer (manual optimization is not supported). Put the "
                "parameters in one optimizer with a parameter group per part, each with its own hyper-parameters, "
                "e.g. torch.optim.AdamW([{'params': self.vision.parameters(), 'lr': 1e-4}, "
                "{'params': self.llm.parameters(), 'lr': 3e-4}]); LR schedulers scale each group."
            ) from None

    def _replace_model_summary(self, trainer: Any) -> None:
        """Print the pipeline summary once (rank 0) instead of Lightning's model summary, which
        would describe only rank 0's stages once the model is partitioned."""
        from lightning.pytorch.callbacks import ModelSummary

        if not any(isinstance(c, ModelSummary) for c in trainer.callbacks):
            return
        trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, ModelSummary)]
        if self.lightning_module not in _PARTITIONED:  # a re-fit of a partitioned model was summarised before
            rank_zero_info(
                f"Pipeline: schedule {self.schedule_name!r}, {self.num_microbatches} microbatches, "
                f"{self.layout.world_size} ranks\n{pipeline_summary(self.lightning_module, self.layout)}"
            )

    def _partition_model(self) -> None:
        lm = self.lightning_module
        cached = _PARTITIONED.get(lm)
        if cached is not None and cached[0] is self.layout and cached[1] == self.global_rank:
            self._partition = cached[2]
            return
        if cached is not None:
            raise PipelineConfigError(
                "this LightningModule was already partitioned by another MultiModulePipelineStrategy or rank; "
                "build a fresh model for a new layout."
            )
        self._unpartitioned_keys = list(lm.state_dict().keys())  # modules built in configure_model included
        plan = plan_construction(lm, self.pretrained)  # every rank checks every key, before any collective
        self._partition = partition_model(lm, self.layout, self.global_rank)
        self._build_own_stages(plan)
        _PARTITIONED[lm] = (self.layout, self.global_rank, self._partition)


    # --- construction: meta build, materialisation, pretrained weights ------------------------

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """Build on the meta device (``configure_model()``, ``trainer.init_module()``) unless
        ``empty_init=False``: each rank materialises only its own stages in ``setup``."""
        device = torch.device("meta") if empty_init is not False else nullcontext()
        with device, self.precision_plugin.tensor_init_context():
            yield

    def _init_seed(self) -> int:
        """The materialisation seed: rank 0's ``torch.initial_seed()`` (``seed_everything``'s seed)."""
        seed = torch.initial_seed()
        return int(self.broadcast(seed, 0)) if self.world_size > 1 else seed

    def _build_own_stages(self, plan: ConstructionPlan) -> None:
        seed = self._init_seed() if plan.on_meta else 0
        assert self._partition is not None
        self._pretrained_keys_read = build_own_stages(
            self.lightning_module, plan, self.root_device, seed, self._partition.tied
        )

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
                no_backward_modules=frozenset() if forward_only else self._no_grad_modules,
            )
        return self._schedules[key]

    def _run_pipeline(self, batch: Any, forward_only: bool, predict: bool = False) -> StepResult:
        assert self._runtime is not None and self._comm is not None and self._batches is not None
        kind = "predict" if predict else "eval" if forward_only else "train"
        m, shard = self._batches.split(batch, kind)
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

    def reduce_metrics(self, local: Mapping[str, Tensor], kind: str) -> dict[str, Tensor]:
        """The step's metrics, identical on every rank (see :mod:`lightning_mmpp.engine.metrics`)."""
        assert self._metrics is not None
        return self._metrics.reduce(local, kind)

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
            if self._tie_groups:  # copies of a parameter tied across ranks get the summed gradient
                sum_tied_gradients(self.layout, self._partition.tied, self._tie_groups, self.global_rank)
        with self._tracer.span("metrics_allreduce", "metrics"):
            metrics, token_metrics, tokens = self._reduce_step_metrics(result, "train")
        raise_if_loss_not_finite(self._failures, {**metrics, **token_metrics}["loss"], result.sink_losses)
        if tokens is not None:  # per-token loss: every gradient holds a sum over tokens
            self._divide_gradients(tokens)
        self._log_metrics("train", metrics, batch_size_of(batch), on_step=True)
        self._log_metrics("train", token_metrics, tokens, on_step=True)
        return {"loss": {**metrics, **token_metrics}["loss"]}

    def _reduce_step_metrics(
        self, result: StepResult, stage: str
    ) -> tuple[dict[str, Tensor], dict[str, Tensor], Optional[int]]:
        """Reduce a step's metrics over the world: ``(metrics, per-token metrics, global token count)``.

        Per-token sums (``loss_sum``, ``num_tokens``, ``<name>_sum``) become ``loss`` and ``<name>``
        divided by the global token count of the step (``None`` when no sink used that form).
        """
        local = {**result.metric_sums, **{_TOKEN_PREFIX + k: v for k, v in result.token_sums.items()}}
        reduced = self.reduce_metrics(local, stage)
        metrics = {n: v for n, v in reduced.items() if not n.startswith(_TOKEN_PREFIX)}
        sums = {n[len(_TOKEN_PREFIX):]: v for n, v in reduced.items() if n.startswith(_TOKEN_PREFIX)}
        if not sums:
            return metrics, {}, None
        count = sums.pop(TOKEN_COUNT).clamp(min=1.0)
        token_metrics = {"loss" if n == TOKEN_LOSS else n[: -len("_sum")]: v / count for n, v in sums.items()}
        return metrics, token_metrics, int(count.item())

    def _divide_gradients(self, count: int) -> None:
        assert self._partition is not None
        for runner in self._partition.runners.values():
            for p in runner.parameters():
                if p.grad is not None:
                    p.grad.div_(count)

    def synchronize_gradients(self) -> None:
        """Sum each module's gradients over its dp group (colocated modules share one reduction)."""
        assert self._gradients is not None
        self._gradients.synchronize()

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
        metrics, token_metrics, tokens = self._reduce_step_metrics(result, prefix)
        self._log_metrics(prefix, metrics, batch_size_of(batch), on_step=False)
        # weighted by tokens, so the epoch value is sum(loss_sum) / sum(num_tokens)
        self._log_metrics(prefix, token_metrics, tokens, on_step=False)
        return {f"{prefix}_{n}": v for n, v in {**metrics, **token_metrics}.items()}

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
        assert self._predictions is not None
        return self._predictions.gather(result.sink_outputs)

    def clip_grad_by_norm(self, max_norm: float) -> Tensor:
        """Clip by the global gradient norm over every module and rank, dp replicas counted once.

        Lightning's gradient clipping (``gradient_clip_val``, ``configure_gradient_clipping``)
        arrives here through the precision plugin (see :mod:`lightning_mmpp.lightning.plugins`).
        """
        assert self._gradients is not None
        return self._gradients.clip_norm_(max_norm, self.root_device)

    # --- checkpoint hooks (the work is done by lightning_mmpp.state.checkpoint) -----------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # the model is partitioned in ``setup``: a rank loads only what it owns, after that
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return _checkpoint.model_state_dict(self.lightning_module)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return _checkpoint.optimizer_state_by_name(self.lightning_module, optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported: the checkpoint is "
                "written with torch.distributed.checkpoint, not the CheckpointIO plugin."
            )
        _checkpoint.save_checkpoint(
            checkpoint, filepath, model=self.lightning_module, layout=self.layout, rank=self.global_rank,
            device=self.root_device, ties=self._checkpoint_ties(),
        )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        lm = self.lightning_module
        trainer = getattr(lm, "_trainer", None)
        return _checkpoint.load_checkpoint(
            checkpoint_path, model=lm, optimizers=self.optimizers, layout=self.layout, rank=self.global_rank,
            device=self.root_device, fitting=trainer is not None and trainer.state.fn == TrainerFn.FITTING,
            strict=bool(getattr(lm, "strict_loading", True)), weights_only=weights_only,
            ties=self._checkpoint_ties(),
        )

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        _checkpoint.load_model_state(self.lightning_module, checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        _checkpoint.load_optimizer_states(
            self.lightning_module, self.optimizers, checkpoint["optimizer_states"], self.root_device
        )

    def remove_checkpoint(self, filepath: Any) -> None:
        _checkpoint.remove_checkpoint(filepath, rank=self.global_rank)

    def _checkpoint_ties(self) -> Sequence[Any]:
        """Parameters tied across stages: a checkpoint stores each once, under its canonical name."""
        return self._partition.tied if self._partition is not None else ()

    # --- collectives Lightning asks for ----------------------------------------------------

    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return reduce_tensor(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def on_exception(self, exception: BaseException) -> None:
        """An error inside a pipeline step (a bad ``pipeline_loss`` on a sink rank, say) is
        raised on one rank while its peers wait for its messages. Tearing down the process group
        makes their transfers fail at once instead of after the process-group timeout."""
        if self._in_pipeline_step and self.world_size > 1 and _distributed():
            log.error("rank %d failed inside a pipeline step; closing the process group so peers stop", self.global_rank)
            self._dp_groups = {}
            self._tie_groups = {}
            drop_transfer_references(exception, self._comm)
            dist.destroy_process_group()
            self._failures.linger()  # rank 0 serves the store: let peers read the root cause first
        self._in_pipeline_step = False

    def _write_trace(self) -> None:
        if not self._tracer.enabled or self.trace_dir is None:
            return
        self._tracer.write(self.trace_dir)
        if self.world_size > 1 and _distributed():
            dist.barrier()
        if self.global_rank == 0:
            merge_traces(self.trace_dir, self.world_size)

    def teardown(self) -> None:
        self._write_trace()
        self._remove_placeholder_steps()
        for group in [*self._dp_groups.values(), *self._tie_groups.values()]:
            if _distributed():
                dist.destroy_process_group(group)
        self._dp_groups = {}
        if self._gradients is not None:
            self._gradients.close()
            self._gradients = None
        self._failures.release()
        if self._preemption is not None:
            self._preemption.uninstall()
        self._tie_groups = {}
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
        if self._layout is None:
            return (
                f"MultiModulePipelineStrategy(schedule={self.schedule_name!r}, num_microbatches={self.num_microbatches}, "
                f"placements={dict(self._placements)}, topology from the model)"
            )
        return (
            f"MultiModulePipelineStrategy(schedule={self.schedule_name!r}, num_microbatches={self.num_microbatches}, "
            f"world_size={self.layout.world_size})\n{self.layout.table()}"
        )

    __repr__ = __str__


def _edges(topology: ModuleTopology) -> dict[str, list[str]]:
    """The DAG as ``{module: sorted downstream}`` in sorted module order (for comparisons)."""
    return {m: sorted(topology.downstream(m)) for m in sorted(topology.modules)}


def _run_by_strategy(self: Any, *args: Any, **kwargs: Any) -> Any:
    """The placeholder step bound by :meth:`MultiModulePipelineStrategy.connect`."""
    raise RuntimeError(
        f"{type(self).__name__} has no step method of its own: MultiModulePipelineStrategy runs the pipelined "
        "step and bound this placeholder only so Lightning enables the loop. Define the step yourself to use the "
        "module without the strategy."
    )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()
