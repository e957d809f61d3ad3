"""The unpipelined meaning of a multi-module model, on one process.

``run_unpipelined`` composes the modules in topological order through the same hooks the
pipeline uses (``pipeline_inputs`` / ``pipeline_loss``), on the whole batch. It is what the
pipeline is equivalent to, and a ready-made ``training_step`` for single-process runs.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.model.hooks import pipeline_loss_caller
from lightning_mmpp.model.ragged import run_ragged
from lightning_mmpp.core.topology import ModuleTopology

_NOT_GIVEN: Any = object()


def run_unpipelined(
    model: nn.Module,
    topology_or_batch: Mapping[str, Sequence[str]] | ModuleTopology | Any,
    batch: Any = _NOT_GIVEN,
) -> tuple[Tensor, dict[str, Any]]:
    """Return ``(loss, outputs)``: the summed sink losses and every module's output.

    Call it as ``run_unpipelined(model, batch)`` when the model declares its wiring as
    ``pipeline_topology``, or ``run_unpipelined(model, topology, batch)``. ``pipeline_loss``
    may return a dict; its ``"loss"`` is used, or ``loss_sum / num_tokens`` in the per-token
    form.
    """
    if batch is _NOT_GIVEN:
        batch, topology = topology_or_batch, getattr(model, "pipeline_topology", None)
        if topology is None:
            raise PipelineConfigError(
                f"run_unpipelined(model, batch) needs {type(model).__name__}.pipeline_topology; declare it or call "
                "run_unpipelined(model, topology, batch)."
            )
    else:
        topology = topology_or_batch
    topo = topology if isinstance(topology, ModuleTopology) else ModuleTopology(topology)
    pipeline_loss = pipeline_loss_caller(model)
    outputs: dict[str, Any] = {}
    loss: Tensor | None = None
    for module in topo.order:
        upstream = {u: outputs[u] for u in topo.upstream(module)}
        x = model.pipeline_inputs(module, batch, upstream)  # type: ignore[operator]
        x = run_ragged(functools.partial(_run_layers, getattr(model, module)), x, f"module {module!r}")
        outputs[module] = x
        if not topo.downstream(module):
            result = pipeline_loss(module, x, batch)
            if isinstance(result, Mapping) and "loss_sum" in result:  # per-token form
                value = result["loss_sum"] / max(float(result["num_tokens"]), 1.0)
            else:
                value = result["loss"] if isinstance(result, Mapping) else result
            loss = value if loss is None else loss + value
    assert loss is not None
    return loss, outputs


def _run_layers(container: nn.Module, x: Any) -> Any:
    for layer in _layers(container):
        x = layer(x)
    return x


def _layers(container: nn.Module) -> Any:
    """The layers of a module: its children in order, or the module itself when it is one layer."""
    return container if isinstance(container, (nn.Sequential, nn.ModuleList)) else [container]
