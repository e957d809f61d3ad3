"""The strategy's launchers: configuration checks before any worker starts, and the launching
process after ``fit`` under ``start_method="fork"`` / ``"spawn"``.

Both launchers run the strategy's ``check_before_launch`` in the launching process, so an error
knowable there is raised once, before any worker starts.

Lightning's multiprocessing launcher hands rank 0's ``state_dict`` back to the launching
process and loads it with ``strict=False``. Under the pipeline strategy rank 0 holds only its
own stages, so the parent's model would end up partly trained without a word. This launcher
instead gathers every rank's stages to rank 0 (each tensor once) and the parent loads the
whole state dict strictly, so the model object the user holds is the trained model; it does so
only when the parent holds a built model (all modules present, nothing on the meta device).
When the modules are built in ``configure_model()`` (or on the meta device) the parent has no
weights to fill: it warns once and says how to get them. ``trainer.global_step``, the loop
progress and the callbacks' state come back to the parent in both cases.
"""

from __future__ import annotations

import io
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.utils._pytree import tree_map

from lightning_mmpp.initialization import has_meta_tensors

__all__ = ["CheckedSubprocessLauncher", "PipelineMultiProcessingLauncher"]

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


class PipelineMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher with the strategy's pre-launch checks, bringing the whole
    trained model back to the parent."""

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self._strategy.check_before_launch(trainer, args)  # type: ignore[attr-defined]
        # decided in the parent, read in the workers (the launcher travels with them)
        lm = trainer.lightning_module if trainer is not None else None
        self._parent_holds_model = lm is not None and self._model_is_built(lm)
        return super().launch(function, *args, trainer=trainer, **kwargs)

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
            call._call_callbacks_load_state_dict(
                trainer, torch.load(io.BytesIO(extra["callbacks_bytes"]), weights_only=False)
            )

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
