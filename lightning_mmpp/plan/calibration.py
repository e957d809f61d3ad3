"""This machine's framework, link and collective costs, as the cost model uses them (pure Python).

:func:`lightning_mmpp.plan.calibrate` measures a :class:`Calibration` with a few real steps on
``world_size`` processes; :class:`~lightning_mmpp.plan.costs.CostModel` then charges, on top of
the profiled layer times:

* ``action_s`` per compute action (a forward, a backward, an input-gradient or weight-gradient
  half): what the runtime, the autograd calls and the step's bookkeeping cost per microbatch
  and stage beyond the layers themselves;
* ``message_s`` per message a stage receives (activations or gradients across a stage boundary
  or a bridge), plus its bytes over ``p2p_bandwidth``: the communicator's packing, posting and
  waiting, with the link's latency; the several messages of one action (a fan-in) are posted
  ahead and waited on together, so they pay ``p2p_latency_s`` once between them;
* ``step_s`` per training step: the Trainer's loop, ``zero_grad``, the optimizer's fixed cost,
  the closing all-reduce of the loss and metrics, as a layout whose ranks all run every module
  (pure dp) pays it, every rank at once: fitted from the pure-dp framework run.
  ``pipeline_step_s`` is the same for a pipelined layout, whose ranks end their steps one after
  another, each while the others still drain: measured in the chain run as the time its first
  rank, which starts the pipeline and ends it, spends outside ``run_pipeline`` per step (older
  calibrations: the chain's step less its simulated actions); on a CPU with fewer cores than
  ranks the two differ by a few milliseconds, either way from one calibration to the next;
* a dp gradient all-reduce as a ring with ``allreduce_call_s`` per call, ``allreduce_latency_s``
  per ring step and ``allreduce_bandwidth``; FSDP2's all-gather (per layer ``gather_layer_s`` + ``gather_step_s``
  per ring step + bytes, once per layer for every forward and every backward: unshard +
  reshard) and reduce-scatter (``scatter_layer_s`` + ``scatter_step_s`` per ring step + bytes,
  once per layer per step) for a sharded module;
* the optimizer step, ``optimizer_s_per_byte`` times the parameter bytes a rank holds (its
  shard, when sharded);
* ``module_s`` per module beyond the first of a layout whose ranks all run every module (pure
  dp): what a module adds to such a step beyond its actions and its gradient sum (the sum issued
  while the next module's backward runs, its wait and write-back, the hand-offs between modules),
  fitted from a pure-dp run of three modules against the one-module run (0 in older calibrations);
* ``sharded_tensor_s`` per trainable parameter tensor of a sharded stage: the optimizer step
  over FSDP2's ``DTensor`` parameters costs this much more per tensor than over plain ones (0 in
  older calibrations);
* ``gradient_copy_s_per_byte`` per gradient byte of an unsharded stage with ``dp > 1``: the
  engine packs its gradients into one flat buffer for the all-reduce and copies the sum back,
  both on the rank's main thread (0 in older calibrations);
* ``metric_s`` per logged metric and step beyond the loss (the framework model logs one; a
  model whose ``pipeline_loss`` returns more pays this for each: ``ModelProfile.metrics``);
* ``host_cores``: the cores of the host the ``world_size`` ranks ran on (0 on an accelerator,
  whose layers do not run on them, and in older calibrations). Where ranks outnumber them, ranks
  that compute at once share the cores (:mod:`lightning_mmpp.plan.sharing`).

Every constant is measured (:mod:`lightning_mmpp.plan.measure`), never assumed: the
framework's own costs change as it changes. The raw samples behind each fit are kept in
``samples`` so a calibration can be inspected or refitted.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from lightning_mmpp.errors import PipelineConfigError

__all__ = ["CALIBRATION_VERSION", "Calibration", "fit_line", "median_samples", "read_json", "write_json"]

CALIBRATION_VERSION = 1


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(intercept, slope)`` of ``y = intercept + slope * x`` through measured points: the
    intercept is the time at the smallest size (a fixed cost is best seen where the bytes cost
    nothing), the slope the least-squares fit of the rest through that point; both clipped at 0
    (a cost never shrinks with size, and a negative fixed cost is noise)."""
    if not points:
        return 0.0, 0.0
    x0, y0 = min(points)
    rest = [(x - x0, y - y0) for x, y in points if x > x0]
    var = sum(dx * dx for dx, _ in rest)
    slope = sum(dx * dy for dx, dy in rest) / var if var > 0 else 0.0
    return max(0.0, y0), max(0.0, slope)


# launches whose samples a calibration takes the median of. The chain run's cost per action
# (action + message) came out 0.49-0.97 ms in single launches of 4 ranks on a 2-core VM (15
# launches); the median of 3 of them spreads with a standard deviation of 0.08 ms, of 5 0.06 ms
# (every subset of those 15), and pipelined plans are charged it on every action of their
# critical path
CALIBRATION_LAUNCHES = 5


def median_samples(launches: Sequence[Any]) -> Any:
    """The element-wise median of the raw samples of several calibration launches (the same
    structure in each: dicts, lists and tuples of numbers; sizes are equal, so they stay as
    they are). One launch of processes on a shared CPU can run a few percent slower or faster
    than the next throughout (the same pure-dp plan: 124-130 ms over six launches on a 2-core
    VM), which no number of steps inside it averages out; the median over launches does."""
    first = launches[0]
    if isinstance(first, Mapping):
        return {key: median_samples([run[key] for run in launches]) for key in first}
    if isinstance(first, (list, tuple)):
        if any(len(run) != len(first) for run in launches):
            raise ValueError("calibration launches measured different sample counts")
        merged = [median_samples([run[i] for run in launches]) for i in range(len(first))]
        return type(first)(merged) if isinstance(first, tuple) else merged
    if all(value == first for value in launches):
        return first  # a size or microbatch count: the same in every launch, and an int stays an int
    return statistics.median(launches)


def write_json(data: Mapping[str, Any], path: Optional[str | os.PathLike] = None) -> str:
    """``data`` as indented JSON text; also written to ``path`` when given."""
    text = json.dumps(data, indent=1)
    if path is not None:
        with open(path, "w") as f:
            f.write(text + "\n")
    return text


def read_json(source: str | os.PathLike) -> Any:
    """The JSON of a file path, or of JSON text."""
    text = str(source)
    if not text.lstrip().startswith("{"):
        with open(source) as f:
            text = f.read()
    return json.loads(text)


@dataclass
class Calibration:
    """Measured constants of one machine and framework version; see the module docstring.

    Bandwidths are bytes per second (``inf``: the fit found no size dependence); latencies and
    fixed costs are seconds. ``allreduce_call_s``, ``gather_layer_s`` and ``scatter_layer_s`` are
    the parts of a collective's fixed cost that do not grow with its ring's steps, fitted exactly
    through 2 ranks and the calibrated size: they may be negative where a ring of more ranks costs
    more than its steps (a CPU with fewer cores than ranks); over 2 or more ranks every charge is
    at least the measured pair's.
    """

    world_size: int
    device: str = "cpu"
    action_s: float = 0.0
    message_s: float = 0.0
    step_s: float = 0.0
    p2p_latency_s: float = 0.0
    p2p_bandwidth: float = float("inf")
    allreduce_latency_s: float = 0.0
    allreduce_bandwidth: float = float("inf")
    gather_layer_s: float = 0.0
    gather_bandwidth: float = float("inf")
    scatter_layer_s: float = 0.0
    scatter_bandwidth: float = float("inf")
    optimizer_s_per_byte: float = 0.0
    samples: dict[str, Any] = field(default_factory=dict)
    gather_step_s: float = 0.0
    scatter_step_s: float = 0.0
    allreduce_call_s: float = 0.0
    pipeline_step_s: Optional[float] = None  # None (older calibrations): step_s
    host_cores: int = 0  # 0 (an accelerator, older calibrations): ranks are not taken to share cores
    metric_s: float = 0.0  # per logged metric and step beyond the loss; 0 in older calibrations
    gradient_copy_s_per_byte: float = 0.0  # packing a gradient byte for its all-reduce and back; 0 in older ones
    sharded_tensor_s: float = 0.0  # the optimizer step's extra per sharded (DTensor) parameter; 0 in older ones
    module_s: float = 0.0  # per module beyond the first of a pure-dp step; 0 in older calibrations

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise PipelineConfigError(f"a calibration needs world_size >= 1, got {self.world_size}.")

    # --- costs the cost model charges --------------------------------------------------------

    def step_seconds(self, lockstep: bool) -> float:
        """The per-step cost of a layout whose ranks all run every module (``lockstep``) or of a
        pipelined one (see the module docstring)."""
        if lockstep or self.pipeline_step_s is None:
            return self.step_s
        return self.pipeline_step_s

    def message_seconds(self, nbytes: float, messages: int = 1) -> float:
        """``messages`` received messages carrying ``nbytes`` bytes in all."""
        return messages * self.message_s + nbytes / self.p2p_bandwidth

    def allreduce_seconds(self, nbytes: float, group: int, calls: int = 1) -> float:
        """A ring all-reduce of ``nbytes`` over ``group`` ranks, in ``calls`` collectives."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        steps = 2 * (group - 1)
        return steps / group * nbytes / self.allreduce_bandwidth + \
            calls * (self.allreduce_call_s + steps * self.allreduce_latency_s)

    def gather_seconds(self, nbytes: float, group: int, layers: int) -> float:
        """FSDP2's all-gather (unshard, then reshard) of ``layers`` layers holding ``nbytes``
        parameter bytes over ``group`` ranks: one forward's or one backward's worth."""
        if group <= 1 or layers <= 0:
            return 0.0
        per_layer = self.gather_layer_s + (group - 1) * self.gather_step_s
        return layers * per_layer + (group - 1) / group * nbytes / self.gather_bandwidth

    def scatter_seconds(self, nbytes: float, group: int, layers: int) -> float:
        """FSDP2's gradient reduce-scatter of ``layers`` layers (``nbytes`` gradient bytes)."""
        if group <= 1 or layers <= 0:
            return 0.0
        per_layer = self.scatter_layer_s + (group - 1) * self.scatter_step_s
        return layers * per_layer + (group - 1) / group * nbytes / self.scatter_bandwidth

    def gradient_copy_seconds(self, nbytes: float) -> float:
        """Packing ``nbytes`` of gradients into an all-reduce's flat buffer and copying the sum back."""
        return self.gradient_copy_s_per_byte * nbytes

    def optimizer_seconds(self, nbytes: float) -> float:
        """The optimizer step over ``nbytes`` of parameters held by one rank."""
        return self.optimizer_s_per_byte * nbytes

    # --- JSON --------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (:meth:`from_dict` reads it back)."""
        data = asdict(self)
        data["version"] = CALIBRATION_VERSION
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Calibration":
        """Read the dict written by :meth:`to_dict`."""
        data = dict(data)
        version = data.pop("version", CALIBRATION_VERSION)
        if version != CALIBRATION_VERSION:
            raise PipelineConfigError(
                f"calibration version {version} is not supported (expected {CALIBRATION_VERSION}); "
                "measure a new one with lightning_mmpp.plan.calibrate(world_size)."
            )
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise PipelineConfigError(f"calibration has unknown fields {unknown}; measure a new one.")
        return cls(**data)

    def to_json(self, path: Optional[str | os.PathLike] = None) -> str:
        """The calibration as JSON text; also written to ``path`` when given."""
        return write_json(self.to_dict(), path)

    @classmethod
    def from_json(cls, source: str | os.PathLike) -> "Calibration":
        """Read a calibration from a JSON file path, or from JSON text."""
        return cls.from_dict(read_json(source))

    def describe(self) -> str:
        """A few lines for people: the fitted constants."""
        def bw(x: float) -> str:
            return "inf" if x == float("inf") else f"{x / 1e9:.2f} GB/s"

        return "\n".join([
            f"calibration: {self.world_size} ranks on {self.device}",
            f"  per compute action {self.action_s * 1e3:.3f} ms, per received message {self.message_s * 1e3:.3f} ms, "
            f"per step {self.step_s * 1e3:.2f} ms (pipelined: {self.step_seconds(False) * 1e3:.2f} ms; pure dp: "
            f"{self.module_s * 1e3:.2f} ms more per module beyond the first), "
            f"per logged metric {self.metric_s * 1e3:.3f} ms",
            f"  p2p: latency {self.p2p_latency_s * 1e3:.3f} ms, {bw(self.p2p_bandwidth)}",
            f"  all-reduce: {self.allreduce_call_s * 1e3:.3f} ms per call + {self.allreduce_latency_s * 1e3:.3f} ms "
            f"per ring step, {bw(self.allreduce_bandwidth)}",
            f"  FSDP2 per layer: all-gather {self.gather_layer_s * 1e3:.3f} ms + {self.gather_step_s * 1e3:.3f} ms "
            f"per ring step + {bw(self.gather_bandwidth)}, reduce-scatter {self.scatter_layer_s * 1e3:.3f} ms + "
            f"{self.scatter_step_s * 1e3:.3f} ms per ring step + {bw(self.scatter_bandwidth)}",
            f"  optimizer step: {self.optimizer_s_per_byte * 1e9:.3f} ns per parameter byte; gradients packed for "
            f"their all-reduce and back: {self.gradient_copy_s_per_byte * 1e9:.3f} ns per byte; per sharded parameter "
            f"tensor: {self.sharded_tensor_s * 1e3:.3f} ms",
            f"  host: {self.host_cores} cores for {self.world_size} ranks" if self.host_cores else
            "  host: cores not shared (an accelerator, or not measured)",
        ])
