"""What a Lightning fit needs beyond the engine: configuration checks with messages naming the fix,
one optimizer, and the pipeline summary in place of Lightning's model summary."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mmpp.engine.engine import is_partitioned
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.model.partition import check_model
from lightning_mmpp.model.summary import pipeline_summary

__all__ = ["check_fit_configuration", "check_model", "replace_model_summary", "setup_one_optimizer"]


def check_fit_configuration(trainer: Any, module: Any, precision_plugin: Any) -> None:
    """What the Trainer offers that a pipelined step cannot honour."""
    if not module.automatic_optimization:
        raise PipelineConfigError(
            "MultiModulePipelineStrategy drives forward, backward and the optimizer step itself; manual "
            "optimization (automatic_optimization = False) is not supported. Remove it."
        )
    if trainer.accumulate_grad_batches != 1:
        raise PipelineConfigError(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches} is not supported: the pipeline "
            "already accumulates over microbatches. Raise num_microbatches (and the batch size) instead."
        )
    if getattr(precision_plugin, "scaler", None) is not None:
        raise PipelineConfigError(
            "precision='16-mixed' with a gradient scaler is not supported by the pipeline; use "
            "precision='bf16-mixed' or '32-true'."
        )


def setup_one_optimizer(strategy: Any, trainer: Any) -> None:
    """Lightning's ``setup_optimizers``, with advice that works under the strategy for several optimizers."""
    try:
        strategy.setup_optimizers(trainer)
    except RuntimeError as err:
        if "multiple optimizers" not in str(err):
            raise
        raise PipelineConfigError(
            f"{type(strategy.lightning_module).__name__}.configure_optimizers returned several optimizers; "
            "MultiModulePipelineStrategy steps one optimizer (manual optimization is not supported). Put the "
            "parameters in one optimizer with a parameter group per part, each with its own hyper-parameters, "
            "e.g. torch.optim.AdamW([{'params': self.vision.parameters(), 'lr': 1e-4}, "
            "{'params': self.llm.parameters(), 'lr': 3e-4}]); LR schedulers scale each group."
        ) from None


def replace_model_summary(trainer: Any, module: Any, layout: Any, schedule: str, num_microbatches: Any) -> None:
    """Print the pipeline summary once (rank 0) instead of Lightning's model summary, which
    would describe only rank 0's stages once the model is partitioned."""
    from lightning.pytorch.callbacks import ModelSummary

    if not any(isinstance(c, ModelSummary) for c in trainer.callbacks):
        return
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, ModelSummary)]
    if not is_partitioned(module):  # a re-fit of a partitioned model was summarised before
        rank_zero_info(
            f"Pipeline: schedule {schedule!r}, {num_microbatches} microbatches, "
            f"{layout.world_size} ranks\n{pipeline_summary(module, layout)}"
        )
