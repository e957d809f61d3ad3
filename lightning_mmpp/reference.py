"""The unpipelined meaning of a multi-module model, on one process.

``run_unpipelined`` composes the modules in topological order through the same hooks the
pipeline uses (``pipeline_inputs`` / ``pipeline_loss``), on the whole batch. It is what the
pipeline is equivalent to, and a ready-made ``training_step`` for single-process runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from lightning_mmpp.topology import ModuleTopology


def run_unpipelined(
    model: nn.Module, topology: Mapping[str, Sequence[str]] | ModuleTopology, batch: Any
) -> tuple[Tensor, dict[str, Any]]:
    """Return ``(loss, outputs)``: the summed sink losses and every module's output.

    ``pipeline_loss`` may return a dict; its ``"loss"`` is used, or ``loss_sum / num_tokens`` in
    the per-token form.
    """
    topo = topology if isinstance(topology, ModuleTopology) else ModuleTopology(topology)
    outputs: dict[str, Any] = {}
    loss: Tensor | None = None
    for module in topo.order:
        upstream = {u: outputs[u] for u in topo.upstream(module)}
        x = model.pipeline_inputs(module, batch, upstream)  # type: ignore[operator]
        for layer in getattr(model, module):
            x = layer(x)
        outputs[module] = x
        if not topo.downstream(module):
            result = model.pipeline_loss(x, batch)  # type: ignore[operator]
            if isinstance(result, Mapping) and "loss_sum" in result:  # per-token form
                value = result["loss_sum"] / max(float(result["num_tokens"]), 1.0)
            else:
                value = result["loss"] if isinstance(result, Mapping) else result
            loss = value if loss is None else loss + value
    assert loss is not None
    return loss, outputs
