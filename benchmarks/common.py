"""Helpers shared by the process-based benchmarks: sleep stages, layouts, a step driver, tables.

Stage compute is simulated with ``time.sleep`` inside a custom autograd function: the forward
of a stage sleeps ``tf`` seconds, its backward ``tb``. A sleeping process uses no CPU, so eight
ranks on a two-core machine still measure the schedule (who waits for whom) rather than the
machine. What remains on the CPU is the framework: Python, packing, gloo transfers.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout  # noqa: E402
from lightning_mmpp.engine.engine import PipelineEngine  # noqa: E402
from lightning_mmpp.engine.runtime import StepResult  # noqa: E402

P = ModulePlacement


class Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``tf`` and whose backward sleeps ``tb`` seconds."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tf: float, tb: float) -> torch.Tensor:
        ctx.tb = tb
        time.sleep(tf)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.tb)
        return grad, None, None


class SleepStage(nn.Module):
    """A pipeline stage costing ``tf`` / ``tb`` seconds; one scalar parameter so that even a
    first stage (whose input needs no gradient) runs a backward."""

    def __init__(self, tf: float, tb: float) -> None:
        super().__init__()
        self.tf, self.tb = tf, tb
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Sleep.apply(x * self.scale, self.tf, self.tb)


class PerSampleSleepStage(SleepStage):
    """A layer costing ``tf`` / ``tb`` seconds per sample of its input (dim 0): its time scales
    with the microbatch and dp shard it gets, as a real layer's does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return Sleep.apply(x * self.scale, self.tf * n, self.tb * n)


class SleepOnBackward(torch.autograd.Function):
    """Identity whose forward costs nothing and whose backward sleeps ``tb`` seconds."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tb: float) -> torch.Tensor:
        ctx.tb = tb
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.tb)
        return grad, None


class SplitSleepStage(nn.Module):
    """A stage whose backward has a separate input part and weight part: ``Sleep(x) * w`` with
    the forward sleeping ``tf``, the gradient w.r.t. ``x`` sleeping ``ti`` (only on the path to
    the input) and the gradient w.r.t. the scalar weight ``w`` sleeping ``tw`` (only on the path
    to the weight). A fused backward sleeps ``ti + tw``; an input-gradient pass (``I``) ``ti``
    and a weight-gradient pass (``W``) ``tw``, whether the split is done by lightning_mmpp's
    runtime or by torch.distributed.pipelining. On a stage whose input needs no gradient
    (the first one) only ``tw`` runs, in every schedule."""

    def __init__(self, tf: float, ti: float, tw: float) -> None:
        super().__init__()
        self.tf, self.ti, self.tw = tf, ti, tw
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Sleep.apply(x, self.tf, self.ti) * SleepOnBackward.apply(self.scale, self.tw)


class PassThrough(torch.autograd.Function):
    """Hands its input on untouched (no copy) after sleeping ``tf``; its backward sleeps ``tb``
    and gives ``scale`` a zero gradient: a stage whose cost is its sleep whatever the payload size."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: torch.Tensor, tf: float, tb: float) -> torch.Tensor:
        ctx.tb = tb
        time.sleep(tf)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        time.sleep(ctx.tb)
        return grad, torch.zeros(()), None, None


class PassThroughLoss(torch.autograd.Function):
    """The loss of a pass-through sink: zero, whose backward hands back one gradient of the
    output's shape made once per shape (every element ``1e-3``), so the sink, like the stages,
    does no work per microbatch that grows with the payload. (A mean square of the output costs
    5.8 ms forward and backward at 4 MiB on the 2-core VM, 0.4 ms at 16 KiB: eight of them sit on
    the 1F1B critical path of a 4-stage chain.)"""

    gradients: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor) -> torch.Tensor:
        ctx.key = (tuple(output.shape), output.dtype)
        return output.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        cached = PassThroughLoss.gradients.get(ctx.key)
        if cached is None:
            cached = PassThroughLoss.gradients[ctx.key] = torch.full(ctx.key[0], 1e-3, dtype=ctx.key[1])
        return cached


class PassThroughStage(nn.Module):
    """A sleep stage that does not touch its payload (for large payloads: the transfer is the
    only cost that grows with the size)."""

    def __init__(self, tf: float, tb: float) -> None:
        super().__init__()
        self.tf, self.tb = tf, tb
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return PassThrough.apply(x, self.scale, self.tf, self.tb)


class SleepHooks:
    """``pipeline_inputs`` / ``pipeline_loss`` for sleep stages: a source reads its microbatch,
    a module with upstream modules adds their outputs, the sink's loss is a mean square."""

    def pipeline_inputs(self, module: str, batch: Any, upstream: dict[str, Any]) -> Any:
        if not upstream:
            return batch
        return sum(upstream[name] for name in sorted(upstream))

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return output.pow(2).mean()


def chain(pp: int) -> PipelineLayout:
    """One module split into ``pp`` stages on ranks ``0 .. pp-1``."""
    return PipelineLayout({"a": P(pp=pp)}, {"a": []})


def vision_language() -> PipelineLayout:
    """vision (dp=2, ranks 0-1) and audio (dp=1, rank 2) -> llm (pp=2, ranks 3-4): fan-in. Depth 3."""
    return PipelineLayout(
        {"vision": P(dp=2), "audio": P(dp=1), "llm": P(pp=2)},
        {"vision": ["llm"], "audio": ["llm"], "llm": []},
    )


def two_encoders() -> PipelineLayout:
    """enc_a (pp=2, ranks 0-1) and enc_b (pp=1, rank 2) side by side -> llm (pp=2, ranks 3-4).
    Depth 4 (the same layout as ``bench_schedule.py``)."""
    return PipelineLayout(
        {"enc_a": P(pp=2), "enc_b": P(pp=1), "llm": P(pp=2)},
        {"enc_a": ["llm"], "enc_b": ["llm"], "llm": []},
    )


def _chunk_of(stage: nn.Module, v: int) -> nn.Module:
    """``stage`` sleeping ``1/v`` of its times (its ``tf``, ``tb``, ``ti``, ``tw``): one of ``v`` chunks."""
    for name in ("tf", "tb", "ti", "tw"):
        if hasattr(stage, name):
            setattr(stage, name, getattr(stage, name) / v)
    return stage


class SleepModel(nn.Module):
    """One ``nn.Sequential`` of sleep stages per module of ``layout`` (one stage per pp stage),
    with :class:`SleepHooks`' pipeline hooks: a model :class:`~lightning_mmpp.PipelineEngine` can run.

    A module with ``virtual_stages=v`` gets ``pp * v`` stages (chunks), each sleeping ``1/v`` of
    what ``stage()`` sleeps: the module's work per rank is the same whatever ``v`` (the
    simulator weighs a chunk ``1/v`` of a stage alike)."""

    def __init__(self, layout: PipelineLayout, stage: Callable[[], nn.Module],
                 loss: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        """``loss``: the sink's loss of its output (default: :class:`SleepHooks`' mean square)."""
        super().__init__()
        for module, placement in layout.placements.items():
            self.add_module(module, nn.Sequential(*(_chunk_of(stage(), placement.virtual_stages)
                                                    for _ in range(placement.num_stages))))
        self.hooks = SleepHooks()
        self.loss = loss

    def pipeline_inputs(self, module: str, batch: Any, upstream: dict[str, Any]) -> Any:
        return self.hooks.pipeline_inputs(module, batch, upstream)

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return self.hooks.pipeline_loss(output, batch) if self.loss is None else self.loss(output)


class OurPipeline:
    """This rank's part of a sleep-stage pipeline run by :class:`~lightning_mmpp.PipelineEngine`
    (no Lightning Trainer). :meth:`step` times the pipeline part of an engine step
    (:meth:`~lightning_mmpp.PipelineEngine.run_pipeline`): what the schedule costs, without the
    dp sync and metric reduction that a whole ``engine.step`` adds."""

    def __init__(self, layout: PipelineLayout, rank: int, m: int, tf: float, tb: float,
                 mb_shape: Sequence[int] = (8, 1024), trace_dir: Optional[str] = None, seed: int = 0,
                 tw: Optional[float] = None, overlap: bool = True, pass_through: bool = False,
                 static_specs: bool = False, reuse_receive_buffers: bool = True,
                 direct_leaf_bytes: Optional[int] = None, full_loss: bool = False) -> None:
        """``tw=None``: :class:`SleepStage` (backward ``tb``); otherwise :class:`SplitSleepStage`
        (input gradient ``tb``, weight gradient ``tw``); ``pass_through``: :class:`PassThroughStage`
        with :class:`PassThroughLoss` at the sink (``full_loss``: the mean square of the output).
        ``overlap``: the runtime's mode (see :class:`~lightning_mmpp.engine.runtime.PipelineRuntime`);
        ``static_specs``, ``reuse_receive_buffers``: the communicator's (headers checked once per
        step; receive buffers pooled), ``direct_leaf_bytes`` (None: its default); ``trace_dir``: the engine writes its trace there at :meth:`close`."""
        self.layout, self.rank, self.m = layout, rank, m

        def stage() -> nn.Module:
            if pass_through:
                return PassThroughStage(tf, tb)
            return SleepStage(tf, tb) if tw is None else SplitSleepStage(tf, tb, tw)

        loss = PassThroughLoss.apply if pass_through and not full_loss else None
        self.engine = PipelineEngine(SleepModel(layout, stage, loss), layout, m, device=torch.device("cpu"),
                                     static_shapes=static_specs, trace_dir=trace_dir, overlap=overlap)
        self.engine.comm.reuse_receive_buffers = reuse_receive_buffers
        if direct_leaf_bytes is not None:
            self.engine.comm.direct_leaf_bytes = direct_leaf_bytes
        g = torch.Generator().manual_seed(seed)
        self.batch = torch.cat([torch.randn(*mb_shape, generator=g) for _ in range(m)])  # m microbatches

    @property
    def tracer(self) -> Any:
        return self.engine.tracer

    def step(self, schedule: str = "1f1b") -> tuple[float, StepResult]:
        """One training step after a barrier; returns (this rank's seconds, its StepResult)."""
        for p in self.engine.parameters():
            p.grad = None
        dist.barrier()
        start = time.perf_counter()
        result = self.engine.run_pipeline(self.batch, schedule=schedule)
        return time.perf_counter() - start, result

    def close(self) -> None:
        self.engine.close()


def gather_max(values: list[float]) -> list[float]:
    """Element-wise max over ranks (a step ends when its slowest rank ends)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def interleaved(runs: dict[str, Callable[[], float]], rounds: int, steps: int, warmup: int = 1) -> dict[str, list[float]]:
    """Time every entry of ``runs`` (a step function returning this rank's seconds): ``warmup``
    untimed steps each, then ``rounds`` rounds of ``steps`` steps each, the entries taking turns
    round by round so that a slow spell of the machine hits all of them alike. Returns the
    per-step times (max over ranks) of every entry."""
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            times[name].extend(gather_max([fn() for _ in range(steps)]))
    return times


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def quantiles(values: Sequence[float], fractions: Sequence[float] = (0.1, 0.5, 0.9)) -> tuple[float, ...]:
    """``values`` at each of ``fractions``: the median at 0.5, the nearest rank elsewhere."""
    ordered = sorted(values)
    return tuple(statistics.median(ordered) if q == 0.5 else ordered[round(q * (len(ordered) - 1))]
                 for q in fractions)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A right-aligned plain-text table; floats with 3 significant decimals."""

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3f}"
        if isinstance(v, (tuple, list)):
            return " ".join(map(str, v))
        return str(v)

    cells = [list(headers)] + [[fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def section(title: str) -> None:
    print()
    print(title)
    print("=" * len(title))


def proc_status(field: str) -> int:
    """A byte count from ``/proc/self/status`` (``VmRSS``, ``VmHWM``; Linux only)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def start_memory_measurement() -> int:
    """Fix glibc's mmap threshold and reset the peak RSS; return the current RSS (the base).

    glibc otherwise raises the threshold after the first large free, and freed tensors then stay
    in the heap (resident), which measures the allocator rather than the model."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    return proc_status("VmRSS")


def machine() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{os.cpu_count()} CPU cores, torch {torch.__version__}, load average {load:.2f} at start"


def calibration_at(path: Optional[str], world_size: int, **options: Any) -> Any:
    """The :class:`~lightning_mmpp.plan.Calibration` saved at ``path``, or one measured now on
    ``world_size`` processes (``calibrate(world_size, **options)``; saved there when a path is given)."""
    from lightning_mmpp.plan import Calibration, calibrate

    if path and os.path.exists(path):
        return Calibration.from_json(path)
    calibration = calibrate(world_size, **options)
    if path:
        calibration.to_json(path)
    return calibration


# what the speed probe times: a fixed pure-Python loop (about 2 ms at this VM's full speed), the
# fastest of 5 runs back to back
_PROBE_CODE = """
import sys, time
def loop():
    start, total = time.perf_counter(), 0
    for i in range(100_000):
        total += i
    return time.perf_counter() - start
while True:
    print(min(loop() for _ in range(5)), flush=True)  # the first runs after a sleep run slow (a core waking)
    time.sleep(float(sys.argv[1]))
"""


class SpeedProbe:
    """How fast this machine runs short bursts of work, sampled beside a benchmark: a separate
    process wakes every ``interval`` seconds and times the same pure-Python loop (the fastest of 5
    runs back to back: 10-17 ms of work every half second, 2-3% of a core). On the 2-core VM the burst ran
    at full speed or at half speed (1.8 vs 3.4 ms), the slow one most of the time on some days;
    work run without pause (``machine_drift.py``) stays near full speed. A pipeline rank's work is
    such bursts between waits. :meth:`window` says how a stretch of the benchmark ran, so a
    prediction measured against a step can be read beside it. Use as a context manager."""

    SLOW = 1.3  # a sample slower than this many times the fastest one counts as slow

    def __init__(self, interval: float = 0.5) -> None:
        import subprocess

        self._process = subprocess.Popen([sys.executable, "-c", _PROBE_CODE, str(interval)],
                                         stdout=subprocess.PIPE, text=True)
        os.set_blocking(self._process.stdout.fileno(), False)
        self._samples: list[float] = []
        self._partial = ""
        self._since = 0

    def _read(self) -> None:
        while True:
            line = self._process.stdout.readline()
            if not line:
                return
            self._partial += line
            if self._partial.endswith("\n"):  # a line the probe is still writing waits for the rest
                self._samples.append(float(self._partial))
                self._partial = ""

    def window(self) -> str:
        """The samples since the last call, against the fastest sample so far, in words."""
        self._read()
        fresh, self._since = self._samples[self._since:], len(self._samples)
        if not fresh:
            return "burst speed: no samples"
        fastest = min(self._samples)
        slow = sum(1 for t in fresh if t > self.SLOW * fastest)
        return (f"burst speed: {len(fresh)} probes, median {statistics.median(fresh) / fastest:.2f}x the fastest "
                f"({fastest * 1e3:.2f} ms), {slow / len(fresh):.0%} over {self.SLOW}x")

    def __enter__(self) -> "SpeedProbe":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._process.kill()
        self._process.wait()
