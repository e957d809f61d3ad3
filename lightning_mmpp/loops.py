"""The pipeline optimisation loop installed in place of Lightning's automatic optimisation.

Lightning's closure runs ``training_step``, then ``zero_grad``, then ``backward``. A pipeline
step interleaves forwards and backwards of many microbatches, so the strategy's
``training_step`` already leaves the reduced gradients in ``param.grad``. The only change this
loop makes is to zero the gradients *before* that step instead of between it and the (no-op)
backward; the optimizer step, gradient clipping, hooks and progress tracking are Lightning's.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from lightning.pytorch.loops.optimization.automatic import ClosureResult, Closure, _AutomaticOptimization
from torch.optim import Optimizer


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
