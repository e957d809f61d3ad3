"""Per-rank timeline traces in Chrome trace-event JSON (Perfetto, chrome://tracing).

A :class:`Tracer` records complete events ("ph": "X") with wall-clock timestamps in
microseconds: computes (named by :data:`PHASE_SPANS`: ``forward``, ``backward`` for a fused
backward, ``backward_input`` / ``backward_weight`` for the two halves of a split one;
category = module name), communication posts and waits, the data-parallel gradient reduction
and the optimizer step on track (``tid``) 0; on track 1, every receive from its post to the
moment its consumer has it (category ``transfer``: with overlapped transfers these bars run
beside the computes on track 0). :data:`NULL_TRACER` records nothing
and costs one attribute lookup per span, so tracing is cheap when off.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning_mmpp.core.actions import Phase

# the event name of each compute phase
PHASE_SPANS: dict[Phase, str] = {
    Phase.FORWARD: "forward",
    Phase.BACKWARD: "backward",
    Phase.BACKWARD_INPUT: "backward_input",
    Phase.BACKWARD_WEIGHT: "backward_weight",
}


class Tracer:
    """Collects the trace events of one rank."""

    enabled = True

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: list[dict[str, Any]] = []
        self.step = 0

    @contextmanager
    def span(self, name: str, cat: str, **args: Any) -> Iterator[None]:
        """Record the time spent inside the ``with`` block as one event."""
        start = time.time_ns()
        try:
            yield
        finally:
            self.record(name, cat, start, time.time_ns(), **args)

    def record(self, name: str, cat: str, start_ns: int, end_ns: int, track: int = 0, **args: Any) -> None:
        """Record one event between two ``time.time_ns()`` readings. ``track`` is the row under
        the rank (the trace's ``tid``): 0 for what the rank does, 1 for receives in flight,
        which overlap the compute on track 0."""
        self.events.append({
            "name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": track,
            "ts": start_ns / 1000.0, "dur": (end_ns - start_ns) / 1000.0, "args": {"step": self.step, **args},
        })

    def write(self, directory: str) -> str:
        """Write ``trace_rank{rank}.json`` into ``directory``; return its path."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"trace_rank{self.rank}.json")
        meta = [
            {"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": f"rank {self.rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0, "args": {"sort_index": self.rank}},
        ]
        with open(path, "w") as f:
            json.dump({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}, f)
        return path


class _NullTracer:
    enabled = False
    events: list[dict[str, Any]] = []
    step = 0

    @contextmanager
    def span(self, name: str, cat: str, **args: Any) -> Iterator[None]:
        yield

    def record(self, name: str, cat: str, start_ns: int, end_ns: int, track: int = 0, **args: Any) -> None:
        pass


NULL_TRACER = _NullTracer()


def merge_traces(directory: str, world_size: int, name: str = "trace.json") -> str:
    """Merge ``trace_rank*.json`` of ``world_size`` ranks into one file; return its path."""
    events: list[dict[str, Any]] = []
    for rank in range(world_size):
        with open(os.path.join(directory, f"trace_rank{rank}.json")) as f:
            events.extend(json.load(f)["traceEvents"])
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return path
