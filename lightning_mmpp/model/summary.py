"""The pipeline summary printed at fit start: what every rank holds, from the unpartitioned model.

Lightning's model summary runs on rank 0, which after partitioning holds only its own stages.
:func:`pipeline_summary` describes the whole pipeline instead, one row per (module, stage):
its ranks (one per dp replica, times tp), under virtual stages which of its ranks' chunks it is, its layers, trainable and frozen parameters and the bytes of
parameters each of those ranks holds; then the parameter bytes of every rank. It needs no
communication: every rank computes the same split from the model before partitioning (meta
tensors count too, so a model built on the meta device is summarised before it exists).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_mmpp.model.partition import named_layers, stage_ranges
from lightning_mmpp.core.placement import PipelineLayout

__all__ = ["pipeline_summary"]


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def _bytes(n: int) -> str:
    for unit, size in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _span(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]}-{names[-1]} ({len(names)})"


def pipeline_summary(model: nn.Module, layout: PipelineLayout) -> str:
    """A table of the pipeline (see the module docstring); call it before partitioning."""
    with_tp = layout.max_tp > 1
    rows = [("module", "stage") + (("chunk",) if layout.virtual else ()) + ("ranks",) + (("tp",) if with_tp else ())
            + ("layers", "trainable", "frozen",
            "param bytes/rank" + (" (before tp splits)" if with_tp else ""))]
    per_rank = [0] * layout.world_size
    for module in layout.modules:
        placement = layout.placements[module]
        names, layers = named_layers(getattr(model, module))
        names = [name or "(whole module)" for name in names]
        ranges = stage_ranges(layers, placement.num_stages, placement.split_points, module)
        for stage, span in enumerate(ranges):
            params = {id(p): p for i in span for p in layers[i].parameters()}.values()
            trainable = sum(p.numel() for p in params if p.requires_grad)
            frozen = sum(p.numel() for p in params if not p.requires_grad)
            nbytes = sum(p.numel() * p.element_size() for p in params)
            ranks = [rank for group in layout.stage_mesh(module, stage) for rank in group]
            for rank in ranks:
                per_rank[rank] += nbytes
            rows.append((
                module, f"{stage}/{placement.num_stages}",
                *((f"{layout.chunk_of(module, stage)}/{placement.virtual_stages}",) if layout.virtual else ()),
                ",".join(map(str, ranks)),
                *((str(placement.tp),) if with_tp else ()), _span([names[i] for i in span]),
                _count(trainable), _count(frozen), _bytes(nbytes),
            ))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append("parameter bytes per rank: " + ", ".join(f"{r}: {_bytes(b)}" for r, b in enumerate(per_rank)))
    return "\n".join(lines)
