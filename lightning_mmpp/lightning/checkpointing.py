"""The strategy's checkpoint hooks: Lightning's calls, answered by :mod:`lightning_mmpp.state.checkpoint`.

Checkpoints are torch.distributed.checkpoint directories: every rank writes the tensors of the
stages it owns, parameters tied across stages are stored once under their canonical name, and
loading works across layouts (another pp / dp / sharding). Lightning restores a checkpoint after
``setup`` (``restore_checkpoint_after_setup``), once the model is partitioned, so each rank
reads only what it owns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from lightning.pytorch.trainer.states import TrainerFn

from lightning_mmpp.state import checkpoint as _checkpoint

__all__ = ["PipelineCheckpointing"]


class PipelineCheckpointing:
    """Mixed into :class:`~lightning_mmpp.MultiModulePipelineStrategy` before ``ParallelStrategy``."""

    # provided by the strategy
    lightning_module: Any
    optimizers: list[Any]
    layout: Any
    global_rank: int
    root_device: Any
    _engine: Any

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the model is partitioned in ``setup``: a rank loads only what it owns, after that

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
        _checkpoint.save_checkpoint(checkpoint, filepath, model=self.lightning_module, layout=self.layout,
                                    rank=self.global_rank, device=self.root_device, ties=self._ties())

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        lm = self.lightning_module
        trainer = getattr(lm, "_trainer", None)
        return _checkpoint.load_checkpoint(
            checkpoint_path, model=lm, optimizers=self.optimizers, layout=self.layout, rank=self.global_rank,
            device=self.root_device, fitting=trainer is not None and trainer.state.fn == TrainerFn.FITTING,
            strict=bool(getattr(lm, "strict_loading", True)), weights_only=weights_only, ties=self._ties(),
        )

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        _checkpoint.load_model_state(self.lightning_module, checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        _checkpoint.load_optimizer_states(self.lightning_module, self.optimizers, checkpoint["optimizer_states"],
                                          self.root_device)

    def remove_checkpoint(self, filepath: Any) -> None:
        _checkpoint.remove_checkpoint(filepath, rank=self.global_rank)

    def _ties(self) -> Sequence[Any]:
        """Parameters tied across stages: a checkpoint stores each once, under its canonical name."""
        return self._engine.partition.tied if self._engine is not None else ()
