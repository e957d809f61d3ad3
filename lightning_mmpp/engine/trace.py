"""Per-rank timeline traces in Chrome trace-event JSON (Perfetto, chrome://tracing).

A :class:`Tracer` records complete events ("ph": "X") with wall-clock timestamps in
microseconds: computes (named by :data:`PHASE_SPANS`: ``forward``, ``backward`` for a fused
backward, ``backward_input`` / ``backward_weight`` for the two halves of a split one;
category = module name), communication posts and waits, the data-parallel gradient reduction
and the optimizer step on track (``tid``) 0; on track 1, every receive from its post to the
moment its consumer has it (category ``transfer``: with overlapped transfers these bars run
beside the computes on track 0). :data:`NULL_TRACER` records nothing
and costs one attribute lookup per span, so tracing is cheap when off.

NVTX ranges (for Nsight Systems, ``nsys profile``): a tracer can also push one
``torch.cuda.nvtx`` range around each span, named by :func:`nvtx_range_name`, e.g.
``"forward llm microbatch=3 stage=1"``, ``"backward_input enc_a microbatch=0 stage=0"``,
``"exchange comm sends=2 recvs=1"``, ``"dp_allreduce dp"``. Which tracers do (see
:func:`resolve_nvtx`): an explicit ``nvtx=True`` / ``False``; else the environment variable
``MMPP_NVTX`` (``1`` on, ``0`` off); else on where CUDA is in use and a tracer is built at all
(``trace_dir=`` set). Events recorded after the fact (``record``: receives in flight, the
optimizer step) have no NVTX range. Without a tracer (the default, :func:`tracer_for`) nothing
calls ``torch.cuda``; a tracer with NVTX off calls no ``torch.cuda`` function per span.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional, Union

import torch

from lightning_mmpp.core.actions import Phase
from lightning_mmpp.errors import PipelineConfigError

# the event name of each compute phase
PHASE_SPANS: dict[Phase, str] = {
    Phase.FORWARD: "forward",
    Phase.BACKWARD: "backward",
    Phase.BACKWARD_INPUT: "backward_input",
    Phase.BACKWARD_WEIGHT: "backward_weight",
}


# NVTX on/off from the environment when no explicit option is given
NVTX_ENV = "MMPP_NVTX"


def nvtx_range_name(name: str, cat: str, args: dict[str, Any]) -> str:
    """The NVTX range name of a span: its name, category (the module of a compute) and
    arguments, e.g. ``"forward llm microbatch=3 stage=1"``."""
    return " ".join([name, cat, *(f"{key}={value}" for key, value in args.items())])


def _nvtx_from_env() -> Optional[bool]:
    """``MMPP_NVTX``: ``True`` / ``False``, or ``None`` when unset."""
    env = os.environ.get(NVTX_ENV, "").strip()
    if not env:
        return None
    if env not in ("0", "1"):
        raise PipelineConfigError(f"{NVTX_ENV}={env!r}: set it to 1 (NVTX ranges on) or 0 (off), or unset it.")
    return env == "1"


def resolve_nvtx(nvtx: Optional[bool], device: Union[str, torch.device, None] = None) -> bool:
    """Whether a tracer pushes NVTX ranges: ``nvtx`` when given; else ``MMPP_NVTX`` (``1`` /
    ``0``) when set; else whether ``device`` is a CUDA device (``device=None``: whether this
    process has initialised CUDA)."""
    if nvtx is not None:
        return bool(nvtx)
    env = _nvtx_from_env()
    if env is not None:
        return env
    if device is not None:
        return torch.device(device).type == "cuda"
    return torch.cuda.is_initialized()


def _nvtx_functions(rank: int) -> tuple[Callable[[str], Any], Callable[[], Any]]:
    """``torch.cuda.nvtx``'s push / pop, checked once: a build without NVTX fails here, naming
    the fix, instead of in the first step."""
    push, pop = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    try:
        push(f"lightning_mmpp rank {rank}")
        pop()
    except RuntimeError as err:
        raise PipelineConfigError(
            f"NVTX ranges were asked for (nvtx=True or {NVTX_ENV}=1) but torch.cuda.nvtx cannot record them "
            f"({err}); use a CUDA build of torch, or turn them off ({NVTX_ENV}=0)."
        ) from err
    return push, pop


class Tracer:
    """Collects the trace events of one rank, and (``nvtx``) pushes NVTX ranges.

    Args:
        rank: the global rank (the trace's ``pid``).
        nvtx: push a ``torch.cuda.nvtx`` range around every span; ``None`` decides by
            :func:`resolve_nvtx` (``MMPP_NVTX``, else whether CUDA is in use).
        device: the rank's device, for ``nvtx=None``.
        record: keep the events for :meth:`write` (``False``: NVTX ranges only).
    """

    def __init__(self, rank: int, nvtx: Optional[bool] = None, device: Union[str, torch.device, None] = None,
                 record: bool = True) -> None:
        self.rank = rank
        self.events: list[dict[str, Any]] = []
        self.step = 0
        # ``enabled``: events are recorded (callers skip the bookkeeping of ``record`` otherwise)
        self.enabled = record
        self._push: Optional[Callable[[str], Any]] = None
        self._pop: Optional[Callable[[], Any]] = None
        if resolve_nvtx(nvtx, device):
            self._push, self._pop = _nvtx_functions(rank)

    @property
    def nvtx(self) -> bool:
        """Whether spans push NVTX ranges."""
        return self._push is not None

    @contextmanager
    def span(self, name: str, cat: str, **args: Any) -> Iterator[None]:
        """Record the time spent inside the ``with`` block as one event (and one NVTX range)."""
        if self._push is not None:
            self._push(nvtx_range_name(name, cat, args))
        start = time.time_ns()
        try:
            yield
        finally:
            end = time.time_ns()
            if self._pop is not None:
                self._pop()
            self.record(name, cat, start, end, **args)

    def record(self, name: str, cat: str, start_ns: int, end_ns: int, track: int = 0, **args: Any) -> None:
        """Record one event between two ``time.time_ns()`` readings. ``track`` is the row under
        the rank (the trace's ``tid``): 0 for what the rank does, 1 for receives in flight,
        which overlap the compute on track 0."""
        if not self.enabled:
            return
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


class _NoSpan:
    """The span of :data:`NULL_TRACER`: a reusable ``with`` block that does nothing (no
    generator per span, as ``contextmanager`` would make)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NO_SPAN = _NoSpan()


class _NullTracer:
    enabled = False
    events: list[dict[str, Any]] = []
    step = 0

    def span(self, name: str, cat: str, **args: Any) -> _NoSpan:
        return _NO_SPAN

    def record(self, name: str, cat: str, start_ns: int, end_ns: int, track: int = 0, **args: Any) -> None:
        pass


NULL_TRACER = _NullTracer()


def tracer_for(rank: int, trace_dir: Optional[str], nvtx: Optional[bool] = None,
               device: Union[str, torch.device, None] = None) -> Union[Tracer, _NullTracer]:
    """The tracer of a rank: events when ``trace_dir`` is set, NVTX ranges as
    :func:`resolve_nvtx` decides (with no ``trace_dir`` only when asked for: ``nvtx=True`` or
    ``MMPP_NVTX=1``), :data:`NULL_TRACER` when neither (nothing called, not even ``torch.cuda``)."""
    if trace_dir is not None:
        return Tracer(rank, nvtx=nvtx, device=device)
    asked = nvtx if nvtx is not None else _nvtx_from_env()
    return Tracer(rank, nvtx=True, record=False) if asked else NULL_TRACER


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
