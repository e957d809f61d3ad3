"""Lightning plugin pieces of :class:`~lightning_mmpp.MultiModulePipelineStrategy`.

* Gradient clipping. Lightning clips through the precision plugin
  (``configure_gradient_clipping`` -> ``Precision.clip_gradients`` -> ``clip_grad_by_norm``),
  whose own norm would cover one rank's stages only. :func:`with_global_norm_clipping` makes a
  copy of the run's precision plugin (any class; its state, e.g. a scaler, is shared) whose
  class adds one override: ``clip_grad_by_norm`` asks the strategy for the global norm over
  every module and rank. The user's plugin object is left untouched.

The launchers live in :mod:`lightning_mmpp.lightning.lightning_api`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

from lightning.pytorch.plugins.precision import Precision

if TYPE_CHECKING:
    from lightning_mmpp.lightning.strategy import MultiModulePipelineStrategy

__all__ = ["with_global_norm_clipping"]


class _GlobalNormClipping:
    """Placed before the run's precision class: clip by the norm of the whole pipeline's gradient.

    Lightning clips through ``Precision.clip_gradients`` (called from the module's
    ``configure_gradient_clipping``); the precision plugin's own norm would cover this rank's
    stages only. The strategy runs a copy of the user's plugin whose class adds this override.
    """

    pipeline_strategy: "MultiModulePipelineStrategy"

    def clip_grad_by_norm(self, optimizer: Any, clip_val: Union[int, float]) -> None:
        self.pipeline_strategy.clip_grad_by_norm(float(clip_val))

    def __reduce__(self) -> tuple[Any, ...]:
        # the class is made at run time: pickle (spawn launcher) rebuilds it from the user's class
        return _new_clipping_plugin, (type(self).__mro__[2],), dict(self.__dict__)


_CLIPPING_CLASSES: dict[type, type] = {}


def _new_clipping_plugin(cls: type) -> Any:
    if cls not in _CLIPPING_CLASSES:
        _CLIPPING_CLASSES[cls] = type(cls.__name__, (_GlobalNormClipping, cls), {"__module__": cls.__module__})
    return object.__new__(_CLIPPING_CLASSES[cls])


def with_global_norm_clipping(plugin: Precision, strategy: "MultiModulePipelineStrategy") -> Precision:
    """A copy of ``plugin`` (sharing its state, e.g. a scaler) that clips by the global norm."""
    if isinstance(plugin, _GlobalNormClipping):
        plugin.pipeline_strategy = strategy
        return plugin
    clone = _new_clipping_plugin(type(plugin))
    clone.__dict__.update(plugin.__dict__)
    clone.pipeline_strategy = strategy
    return clone
