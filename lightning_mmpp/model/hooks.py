"""The pipeline hooks a model provides, called in one form whatever form the model wrote.

``pipeline_loss(self, module, output, batch)`` names the sink it is called for (a model with
several sinks can tell them apart). The older form ``pipeline_loss(self, output, batch)`` stays
accepted: :func:`pipeline_loss_caller` inspects the signature once and returns a callable that
always takes ``(module, output, batch)``. ``pipeline_topology`` declares the module DAG on the
model (:func:`resolve_topology`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Optional

from lightning_mmpp.core.placement import PipelineLayout
from lightning_mmpp.core.topology import ModuleTopology
from lightning_mmpp.errors import PipelineConfigError

__all__ = ["pipeline_loss_caller", "pipeline_loss_takes_module", "resolve_topology"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def pipeline_loss_takes_module(loss: Callable[..., Any], owner: str = "the model") -> bool:
    """Whether a (bound) ``pipeline_loss`` takes ``(module, output, batch)`` rather than ``(output, batch)``."""
    try:
        params = list(inspect.signature(loss).parameters.values())
    except (TypeError, ValueError):  # no signature (a C function): assume the current form
        return True
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return True
    positional = [p for p in params if p.kind in _POSITIONAL]
    required = [p for p in positional if p.default is inspect.Parameter.empty]
    if len(positional) >= 3:
        return True
    if len(required) == 2 or len(positional) == 2:
        return False
    raise PipelineConfigError(
        f"{owner}.pipeline_loss{inspect.signature(loss)} cannot be called; define "
        "`pipeline_loss(self, module, output, batch)` (or the older `pipeline_loss(self, output, batch)`)."
    )


def pipeline_loss_caller(hooks: Any) -> Callable[[str, Any, Any], Any]:
    """``hooks.pipeline_loss`` as a callable of ``(module, output, batch)`` (signature read once)."""
    loss = hooks.pipeline_loss
    if pipeline_loss_takes_module(loss, type(hooks).__name__):
        return loss
    return lambda module, output, batch: loss(output, batch)


def resolve_topology(
    model: Any, placements: Mapping[str, Any], layout: Optional[PipelineLayout], v_shape: bool = False
) -> PipelineLayout:
    """The layout of ``placements`` over the model's ``pipeline_topology`` (or ``layout``'s, given
    to the strategy); when both exist they must agree. ``v_shape``: chunks placed for ``"zbv"``."""
    declared = getattr(model, "pipeline_topology", None)
    if declared is None:
        if layout is None:
            raise PipelineConfigError(
                f"MultiModulePipelineStrategy has no topology: declare `pipeline_topology = {{module: "
                f"[downstream modules]}}` on {type(model).__name__} or pass topology= to the strategy."
            )
        return layout
    try:
        ours = ModuleTopology(declared)
    except PipelineConfigError as err:
        raise PipelineConfigError(f"{type(model).__name__}.pipeline_topology: {err}") from None
    if layout is None:
        return PipelineLayout(placements, ours, v_shape=v_shape)
    if _edges(ours) != _edges(layout.topology):
        raise PipelineConfigError(
            f"{type(model).__name__}.pipeline_topology {_edges(ours)} and the strategy's topology= "
            f"{_edges(layout.topology)} disagree; pass only one (the model's is enough) or make them equal."
        )
    return layout


def _edges(topology: ModuleTopology) -> dict[str, list[str]]:
    """The DAG as ``{module: sorted downstream}`` in sorted module order (for comparisons)."""
    return {m: sorted(topology.downstream(m)) for m in sorted(topology.modules)}
