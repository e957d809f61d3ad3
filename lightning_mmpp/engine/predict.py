"""Predictions on every rank: the sink outputs of a forward-only step, moved as tensors.

After a predict step, the last stage of each sink module holds, per dp replica, its output for
every microbatch. :class:`SinkOutputGatherer` gives every rank the whole batch's output of
every sink, concatenated along the sink's ``batch_dim`` in sample order (microbatch by
microbatch, replica by replica inside a microbatch).

Transport: one owner rank per (sink, replica) packs its outputs (the list over microbatches,
a pytree of tensors) into one flat ``uint8`` buffer (:func:`lightning_mmpp.engine.payload.pack`) and
broadcasts it. Receivers need the payload's structure, shapes and dtypes (its
:class:`~lightning_mmpp.engine.payload.PayloadSpec`) to size and read the buffer: each step one small
all-reduce of an int64 header says which owners' specs changed, and only those are broadcast
(as spec bytes), then cached. Data never travels as pickled objects.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from lightning_mmpp.engine.payload import PayloadSpec, concat_payloads, flatten_payload, pack, unpack
from lightning_mmpp.core.placement import PipelineLayout
from lightning_mmpp.torch_api import tree_map

__all__ = ["SinkOutputGatherer"]


class SinkOutputGatherer:
    """Gathers sink outputs on every rank (see the module docstring); every rank must call :meth:`gather`.

    Args:
        layout: the placement.
        rank: this process's global rank.
        device: where buffers live (the rank's device: NCCL needs CUDA tensors).
        world_size: ranks in the default group (1: no communication).
    """

    def __init__(self, layout: PipelineLayout, rank: int, device: torch.device, world_size: int) -> None:
        self.layout = layout
        self.rank = rank
        self.device = device
        self.world_size = world_size
        # (sink, replica, owner rank), in a fixed order every rank agrees on
        self.owners = [
            (sink, replica, layout.rank_of(sink, layout.num_stages(sink) - 1, replica))
            for sink in layout.topology.sinks
            for replica in range(layout.placements[sink].dp)
        ]
        self._specs: dict[tuple[str, int], PayloadSpec] = {}

    def gather(self, local: Mapping[int, Mapping[str, Any]]) -> Any:
        """``{sink: output}`` for the whole batch (the output itself when there is one sink).

        Args:
            local: this rank's sink outputs, ``{microbatch: {sink: output}}`` (empty on ranks
                that hold no sink's last stage).
        """
        mine: dict[tuple[str, int], tuple[list[Any], PayloadSpec]] = {}
        for sink, replica, owner in self.owners:
            if owner == self.rank:
                outputs = [_detached(local[k][sink]) for k in sorted(local)]
                leaves, spec = flatten_payload(outputs, f"sink {sink!r} predict output")
                mine[(sink, replica)] = (leaves, spec)

        header = torch.zeros(2 * len(self.owners), dtype=torch.int64, device=self.device)
        spec_bytes: dict[tuple[str, int], bytes] = {}
        for i, (sink, replica, owner) in enumerate(self.owners):
            if owner == self.rank and self._specs.get((sink, replica)) != mine[(sink, replica)][1]:
                spec_bytes[(sink, replica)] = mine[(sink, replica)][1].to_bytes()
                header[2 * i] = 1
                header[2 * i + 1] = len(spec_bytes[(sink, replica)])
        if self.world_size > 1:
            dist.all_reduce(header)

        per_owner: dict[tuple[str, int], list[Any]] = {}
        for i, (sink, replica, owner) in enumerate(self.owners):
            key = (sink, replica)
            if header[2 * i].item():
                data = spec_bytes.get(key, b"")
                buffer = (
                    torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
                    if owner == self.rank
                    else torch.empty(int(header[2 * i + 1].item()), dtype=torch.uint8, device=self.device)
                )
                if self.world_size > 1:
                    dist.broadcast(buffer, src=owner)
                self._specs[key] = PayloadSpec.from_bytes(bytes(buffer.cpu().numpy().tobytes()))
            spec = self._specs[key]
            layout = spec.data_layout
            if owner == self.rank:
                leaves = mine[key][0]
                buffer = pack([leaves[j] for j in layout.indices], layout, self.device)
            else:
                buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
            if self.world_size > 1:
                dist.broadcast(buffer, src=owner)
            values: list[Any] = [None] * spec.num_leaves
            for j, tensor in zip(layout.indices, unpack(buffer, layout)):
                values[j] = tensor.clone()  # own storage, not a view of the shared buffer
            per_owner[key] = spec.unflatten(values)

        outputs = {}
        for sink in self.layout.topology.sinks:
            dp = self.layout.placements[sink].dp
            num_microbatches = len(per_owner[(sink, 0)])
            ordered = [per_owner[(sink, replica)][k] for k in range(num_microbatches) for replica in range(dp)]
            outputs[sink] = concat_payloads(ordered, dim=self.layout.placements[sink].batch_dim)
        sinks = self.layout.topology.sinks
        return outputs[sinks[0]] if len(sinks) == 1 else outputs


def _detached(payload: Any) -> Any:
    return tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, payload)
