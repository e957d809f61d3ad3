"""Lightning's private API, touched here and nowhere else in the package.

The strategy needs a few things Lightning keeps internal: its process-group setup, whether a
validation loader is defined, the cluster environment and signal handlers the Trainer
installs, the automatic-optimisation loop (to run a whole pipeline step in its closure) and the
launchers (to check the configuration before any worker starts and to bring the trained model
back to the launching process). Each name below wraps one such use; ``tests/test_lightning_api.py``
pins the behaviour it relies on, so a Lightning release that changes one fails there first,
with the name of what changed. The supported range is pyproject.toml's ``lightning`` pin.

The launchers. Both run the strategy's ``check_before_launch`` in the launching process, so an
error knowable there is raised once, before any worker starts. Lightning's multiprocessing
launcher hands rank 0's ``state_dict`` back to the launching process and loads it with
``strict=False``. Under the pipeline strategy rank 0 holds only its own stages, so the parent's
model would end up partly trained without a word. :class:`PipelineMultiProcessingLauncher`
instead gathers every rank's stages to rank 0 (each tensor once) and the parent loads the whole
state dict strictly, so the model object the user holds is the trained model; it does so only
when the parent holds a built model (all modules present, nothing on the meta device). When the
modules are built in ``configure_model()`` (or on the meta device) the parent has no weights to
fill: it warns once and says how to get them. ``trainer.global_step``, the loop progress and the
callbacks' state come back to the parent in both cases.

The loop. Lightning's closure runs ``training_step``, then ``zero_grad``, then ``backward``. A
pipeline step interleaves forwards and backwards of many microbatches, so the strategy's
``training_step`` already leaves the reduced gradients in ``param.grad``. The only change
:class:`PipelineOptimization` makes is to zero the gradients *before* that step instead of
between it and the (no-op) backward; the optimizer step, gradient clipping, hooks and progress
tracking are Lightning's.
"""

from __future__ import annotations

import io
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _suggested_max_num_threads,
    _sync_ddp_if_available,
)
from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult, _AutomaticOptimization
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.data import _update_dataloader
from torch import Tensor
from torch.optim import Optimizer

from lightning_mmpp.model.initialization import has_meta_tensors
from lightning_mmpp.torch_api import tree_map

__all__ = [
    "CheckedSubprocessLauncher",
    "PipelineMultiProcessingLauncher",
    "PipelineOptimization",
    "cluster_environment_of",
    "default_backend",
    "has_validation_data",
    "init_process_group",
    "install_pipeline_optimization",
    "reduce_tensor",
    "replace_sigterm_broadcast",
    "restore_sigterm_broadcast",
    "route_signal_handlers",
    "update_dataloader",
]


# --- process group -------------------------------------------------------------------------------


def default_backend(device: torch.device) -> str:
    """Lightning's default backend for ``device`` (NCCL for CUDA, gloo otherwise)."""
    return _get_default_process_group_backend_for_device(device)


def init_process_group(cluster_environment: Any, backend: str, timeout: timedelta) -> None:
    """The default process group, from the cluster environment's rank, world size and address."""
    _init_dist_connection(cluster_environment, backend, timeout=timeout)


def reduce_tensor(tensor: Tensor, group: Optional[Any], reduce_op: Any) -> Tensor:
    """``Strategy.reduce`` as Lightning's DDP does it (``"mean"``/``"sum"``/a ``ReduceOp``)."""
    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


# --- the Trainer's state -------------------------------------------------------------------------


def has_validation_data(trainer: Any) -> bool:
    """Whether the fit will run validation (a val dataloader is given or defined by the model)."""
    return bool(trainer.fit_loop.epoch_loop.val_loop._data_source.is_defined())


def cluster_environment_of(trainer: Any) -> Any:
    """The cluster environment the Trainer resolved (SLURM, torchrun, Lightning's own)."""
    return trainer._accelerator_connector.cluster_environment


def route_signal_handlers(trainer: Any, handler: Callable[[int, Any], None]) -> bool:
    """Replace the Trainer's SIGTERM notifier and SLURM requeue handler by ``handler``.

    Lightning registers its handlers after the strategy's setup and composes them with any
    handler already installed, so replacing its functions is the only way to keep its
    collective out of the signal handler. False when the Trainer has no signal connector.
    """
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None or not hasattr(connector, "_sigterm_notifier_fn"):
        return False
    connector._sigterm_notifier_fn = handler
    connector._slurm_sigusr_handler_fn = handler
    return True


def replace_sigterm_broadcast(trainer: Any, check: Callable[[], None]) -> None:
    """Run ``check`` where the training loop broadcasts rank 0's SIGTERM flag before each batch.

    That broadcast is a collective every rank enters at the start of every training batch (4-7
    ms per step on 4 gloo processes on 2 cores, the ranks arriving at different times), and it
    only carries rank 0's flag. The preemption handler already agrees on every rank's signal
    inside the step's metric all-reduce, so the loop's broadcast is replaced by ``check``
    (which folds Lightning's own flag into that agreement). Set on the loop instance, so other
    Trainers are untouched; :func:`restore_sigterm_broadcast` undoes it.
    """
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = check


def restore_sigterm_broadcast(trainer: Any) -> None:
    """Undo :func:`replace_sigterm_broadcast` (the loop's own method again)."""
    trainer.fit_loop.epoch_loop.__dict__.pop("_broadcast_sigterm_tensor", None)


def update_dataloader(dataloader: Any, sampler: Any) -> Any:
    """The same DataLoader (class, arguments, workers) re-created with ``sampler``."""
    return _update_dataloader(dataloader, sampler)


# --- the optimisation loop -----------------------------------------------------------------------


class PipelineOptimization(_AutomaticOptimization):
    """Automatic optimisation whose training step runs a whole pipeline step."""

    def _make_closure(self, kwargs: OrderedDict, optimizer: Optimizer, batch_idx: int) -> Closure:
        zero_grad_fn = self._make_zero_grad_fn(batch_idx, optimizer)
        step_fn = self._make_step_fn(kwargs)

        def zero_grad_then_step() -> ClosureResult:
            if zero_grad_fn is not None:
                zero_grad_fn()
            return step_fn()

        return Closure(step_fn=zero_grad_then_step, backward_fn=self._make_backward_fn(optimizer), zero_grad_fn=None)


def install_pipeline_optimization(trainer: "object") -> Optional[PipelineOptimization]:
    """Swap the fit loop's automatic optimisation for :class:`PipelineOptimization` (idempotent)."""
    epoch_loop = trainer.fit_loop.epoch_loop  # type: ignore[attr-defined]
    current = epoch_loop.automatic_optimization
    if isinstance(current, PipelineOptimization):
        return current
    loop = PipelineOptimization(trainer)  # type: ignore[arg-type]
    loop.optim_progress = current.optim_progress
    epoch_loop.automatic_optimization = loop
    return loop


# --- the launchers -------------------------------------------------------------------------------


NO_WEIGHTS_IN_PARENT = (
    "MultiModulePipelineStrategy: the model in the launching process was built in configure_model() or on the meta "
    "device, so it holds no weights and was not updated by fit(); the trained weights live in the worker processes. "
    "Save them with a ModelCheckpoint callback or trainer.save_checkpoint(...) inside the run and load them with "
    "ckpt_path=... or lightning_mmpp.export_checkpoint(...) (one file for a single process), or launch with "
    "start_method='popen' / torchrun, where every process keeps its trainer."
)


def _to_cpu(state: Any) -> Any:
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, Tensor) else t, state)


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class CheckedSubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher; the strategy's pre-launch checks run before any child starts."""

    def __init__(self, strategy: Any, *args: Any) -> None:
        super().__init__(*args)
        self._pipeline_strategy = strategy

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self._pipeline_strategy.check_before_launch(trainer, args)
        return super().launch(function, *args, trainer=trainer, **kwargs)


FORKED_WORKERS_ONE_THREAD = (
    "start_method='fork': each worker would run {due} intra-op threads, but this process runs {threads} and "
    "may have used them already, after which a forked process hangs in its first multi-threaded op (GNU OpenMP's "
    "thread pool does not survive a fork). The workers run one thread each. For {due} each, call "
    "torch.set_num_threads(1) at the top of the script (before building the model), or use start_method='popen' "
    "or 'spawn'."
)


class PipelineMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher with the strategy's pre-launch checks, bringing the whole
    trained model back to the parent."""

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self._strategy.check_before_launch(trainer, args)  # type: ignore[attr-defined]
        # decided in the parent, read in the workers (the launcher travels with them)
        lm = trainer.lightning_module if trainer is not None else None
        self._parent_holds_model = lm is not None and self._model_is_built(lm)
        self._worker_threads = self._forked_worker_threads()
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _forked_worker_threads(self) -> Optional[int]:
        """1 where forked CPU workers would run several intra-op threads and this process runs
        several itself (so it may have run an OpenMP team already): a forked process hangs in its
        first parallel region then, GNU libgomp's thread pool not surviving a fork. ``None``:
        Lightning's choice (the cores shared out) stands. Warns here, in the launching process."""
        if self._start_method != "fork" or self._strategy.root_device.type != "cpu":
            return None
        threads = torch.get_num_threads()
        # what a worker would run: Lightning's share of the cores unless OMP_NUM_THREADS is set,
        # when the worker keeps this process's setting
        due = threads if "OMP_NUM_THREADS" in os.environ else _suggested_max_num_threads(self._strategy.num_processes)
        if due == 1 or threads == 1:
            return None
        warnings.warn(FORKED_WORKERS_ONE_THREAD.format(due=due, threads=threads), stacklevel=3)
        return 1

    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        threads = getattr(self, "_worker_threads", None)
        if threads is not None:  # before Lightning's own thread setting, which then stands aside
            torch.set_num_threads(threads)
            os.environ["OMP_NUM_THREADS"] = str(threads)
        super()._wrapping_function(process_idx, *args, **kwargs)

    def _model_is_built(self, lm: Any) -> bool:
        modules = self._strategy.layout.modules  # type: ignore[attr-defined]
        if any(p.shard for p in self._strategy.layout.placements.values()):  # type: ignore[attr-defined]
            return False  # sharded stages are DTensors over dp groups gone after fit: use a checkpoint
        return all(isinstance(getattr(lm, m, None), torch.nn.Module) for m in modules) and not has_meta_tensors(lm)

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Optional[_WorkerOutput]:
        fitted = trainer.state.fn == TrainerFn.FITTING
        whole: Optional[dict[str, Any]] = None
        if fitted and getattr(self, "_parent_holds_model", False):
            mine = _to_cpu(trainer.lightning_module.state_dict())
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                parts: Optional[list[Any]] = [None] * dist.get_world_size() if self._strategy.global_rank == 0 else None
                dist.gather_object(mine, parts, dst=0)
            else:
                parts = [mine]
            if parts is not None:
                whole = {}
                for part in parts:
                    for name, value in part.items():
                        whole.setdefault(name, value)  # dp replicas hold identical copies
        self._close_process_group()
        if self._strategy.local_rank != 0:
            return None
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        weights_path = None
        if whole is not None:
            import os
            import tempfile

            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(whole, weights_path)
        extra = self.get_extra_results(trainer)
        extra["fitted"] = fitted
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, extra)

    @staticmethod
    def _close_process_group() -> None:
        """Close the default process group before the worker exits. A gloo group left for the
        interpreter's exit is destroyed while its peers may still be closing their pairs, which
        now and then aborts a worker ("terminate called without an active exception")."""
        if dist.is_available() and dist.is_initialized():
            if dist.get_world_size() > 1:
                dist.barrier()
            dist.destroy_process_group()

    def get_extra_results(self, trainer: Any) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        extra["fit_loop_bytes"] = _dumps(trainer.fit_loop.state_dict())
        extra["callbacks_bytes"] = _dumps(_to_cpu(call._call_callbacks_state_dict(trainer)))
        return extra

    def update_main_process_results(self, trainer: Any, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        if extra.get("fitted"):
            trainer.fit_loop.load_state_dict(torch.load(io.BytesIO(extra["fit_loop_bytes"]), weights_only=False))
            states = torch.load(io.BytesIO(extra["callbacks_bytes"]), weights_only=False)
            call._call_callbacks_load_state_dict(trainer, {"callbacks": states})  # it reads a checkpoint's key

    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: Any) -> None:
        if trainer.checkpoint_callback and hasattr(trainer.checkpoint_callback, "best_model_path"):
            trainer.checkpoint_callback.best_model_path = str(worker_output.best_model_path)
        if worker_output.weights_path is not None:
            state = self._strategy.checkpoint_io.load_checkpoint(worker_output.weights_path)
            trainer.lightning_module.load_state_dict(state, strict=True)  # every stage of every module
            self._strategy.checkpoint_io.remove_checkpoint(worker_output.weights_path)
        elif worker_output.extra.get("fitted") and not getattr(self, "_parent_holds_model", False):
            warnings.warn(NO_WEIGHTS_IN_PARENT, stacklevel=2)
        trainer.state = worker_output.trainer_state
        self.update_main_process_results(trainer, worker_output.extra)
