"""Placeholder step methods, so that Lightning runs the loops the strategy drives.

The strategy runs its own pipelined training / validation / test / predict steps, so the
LightningModule only needs the pipeline hooks. Lightning, however, enables a loop only when the
module overrides its step method (``training_step``, ``validation_step`` when there is
validation data, ``test_step``; ``predict_step`` or ``forward`` for predict). For the duration
of one Trainer call, each missing one that the call will run is bound on the instance to a
placeholder that explains this if called directly; :meth:`PlaceholderSteps.remove` takes them
away again.
"""

from __future__ import annotations

import types
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_mmpp.lightning.lightning_api import has_validation_data

__all__ = ["PlaceholderSteps"]


def _run_by_strategy(self: Any, *args: Any, **kwargs: Any) -> Any:
    """The placeholder bound by :class:`PlaceholderSteps`."""
    raise RuntimeError(
        f"{type(self).__name__} has no step method of its own: MultiModulePipelineStrategy runs the pipelined "
        "step and bound this placeholder only so Lightning enables the loop. Define the step yourself to use the "
        "module without the strategy."
    )


class PlaceholderSteps:
    """The placeholders bound for the current Trainer call."""

    def __init__(self) -> None:
        self._bound: list[tuple[Any, str]] = []

    def bind(self, model: Any, trainer: Any) -> None:
        """Bind the step methods ``trainer``'s current call needs and ``model`` lacks; warn once
        when the model's own ``predict_step`` will not be called."""
        fn = trainer.state.fn
        if fn == TrainerFn.PREDICTING and is_overridden("predict_step", model):  # the user's own, not ours
            rank_zero_warn(
                f"{type(model).__name__}.predict_step is not called under MultiModulePipelineStrategy: "
                "trainer.predict runs the pipeline forward and returns each batch's sink output "
                "(a dict by sink name with several sinks); post-process the returned predictions instead."
            )
        needed = {
            "training_step": fn == TrainerFn.FITTING,
            "validation_step": fn == TrainerFn.VALIDATING or (fn == TrainerFn.FITTING and has_validation_data(trainer)),
            "test_step": fn == TrainerFn.TESTING,
            "predict_step": fn == TrainerFn.PREDICTING and not is_overridden("forward", model),
        }
        for name, wanted in needed.items():
            if wanted and not is_overridden(name, model):
                setattr(model, name, types.MethodType(_run_by_strategy, model))
                self._bound.append((model, name))

    def remove(self) -> None:
        for model, name in self._bound:
            model.__dict__.pop(name, None)
        self._bound = []
