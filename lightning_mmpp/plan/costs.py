"""A model profile and the cost model the planner scores placements with (pure Python, no torch).

:class:`ModelProfile` holds what :func:`lightning_mmpp.plan.profile_model` measured (or what a
user wrote by hand): per layer of every module its forward and backward time on
``profile_batch_size`` samples, the input-gradient part of the backward (for zero_bubble), its
parameter bytes, and its activation bytes per sample; the module topology; the link bandwidth
and per-message latency. It is saved as a small JSON file (:meth:`ModelProfile.to_json`), so
planning can be redone without the model.

:class:`CostModel` maps one candidate (placements with split points, shard / recompute flags,
the microbatch count and the global batch) to what the simulator and the memory check need:

* compute per ``(module, stage)`` and microbatch: a layer's fixed part per call
  (``LayerProfile.forward_fixed_s`` / ``backward_fixed_s``) plus the rest scaled with the
  samples a replica processes, ``batch / (num_microbatches * dp)``, along the times measured on
  fractions of the batch (``LayerProfile.forward_points``; linearly without), and a sink's last stage
  its ``pipeline_loss`` the same way (``ModuleProfile.loss``); ``recompute`` adds the forward to
  the backward; ``shard`` adds a parameter all-gather (``(dp-1)/dp * bytes / bandwidth``) to
  every forward and backward; under zero_bubble, where the backward runs as two autograd
  calls (``I``, then ``W``), each gathers a sharded layer and reruns a recomputed forward;
* transfers: the bytes crossing a stage boundary or a bridge, over ``bandwidth``, plus
  ``latency`` per message; a stage's received activations are added to its forward, its
  received gradients to its backward (a receive blocks the stage that needs the data); a
  bridge between modules on the same ranks (colocated, or a ``pp=1`` module beside a stage)
  stays in the process and costs nothing;
* the dp gradient sum after a stage's last backward: a ring all-reduce, ``2 (dp-1)/dp * bytes
  / bandwidth`` plus ``2 (dp-1) latency`` per 25 MiB bucket (a reduce-scatter, half that, per
  layer, when sharded); it runs beside the rank's later actions, except a sharded stage's on a
  CPU device, whose reduce-scatters gloo runs inside the last backward, before the gradients it
  sends upstream (:attr:`StageCost.sync_in_backward`); the step ends with the loss and metrics
  all-reduced over every rank (:func:`metrics_seconds`);
* tensor parallelism (``ModulePlacement.tp = t > 1``): a layer the model's hook splits
  (``LayerProfile.tp_allreduces > 0``) runs its per-sample part on ``1/t`` of the work (its
  fixed part per call does not shrink), holds ``1/t`` of its parameters, gradients and
  optimizer state (so its dp gradient sum and FSDP2 gathers move ``1/t`` of the bytes), and
  pays ``tp_allreduces`` all-reduces of its output activation over the ``t`` ranks per forward
  (again when recomputed) and as many per backward (in ``I`` under zero_bubble): with the
  calibration's all-reduce costs when the profile has one, the ring formula over
  ``bandwidth`` / ``latency`` otherwise. A layer with ``tp_allreduces=0`` runs whole on every
  tp rank. Activations are not divided (a tp group holds replicated layer inputs and outputs;
  an upper bound for the split inner activations). A stage boundary or bridge moves one copy
  per tp group (lead to lead, as without tp), and the receiving tp group's lead broadcasts it
  to its other ranks (:func:`broadcast_seconds`; activations forward, gradients backward);
* memory per rank: parameters, gradients and Adam state (``state_bytes_per_param_byte`` times
  the parameter bytes, 16 B per fp32 parameter; parameter bytes only for a frozen module; all
  of it / dp when sharded, plus one gathered layer), and the activations of the microbatches in
  flight (with ``recompute``, only each layer's input, plus one layer's activations while it is
  recomputed).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from lightning_mmpp.core.balance import balanced_split
from lightning_mmpp.core.kinds import ScheduleName
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout
from lightning_mmpp.plan.calibration import Calibration, read_json, write_json

__all__ = ["CostModel", "LayerProfile", "ModelProfile", "ModuleProfile", "StageCost", "allreduce_seconds",
           "broadcast_seconds", "in_lockstep", "metrics_seconds", "step_overhead_seconds", "tp_allreduce_seconds"]

PROFILE_VERSION = 1


@dataclass
class LayerProfile:
    """One layer of a module, measured on :attr:`ModelProfile.profile_batch_size` samples.

    ``input_grad_s`` is the input-gradient part (``I``) of ``backward_s``; the rest is the
    weight-gradient part (``W``). ``None``: half each. ``activation_bytes_per_sample``: what the
    layer saves for its backward; ``input_bytes_per_sample`` / ``output_bytes_per_sample``: the
    pytree it receives / returns (what a stage boundary carries, what recompute keeps).

    ``forward_fixed_s`` / ``backward_fixed_s``: the part of ``forward_s`` / ``backward_s`` that
    does not depend on the samples (the call itself: Python, autograd, kernel launches), paid
    once per microbatch; the rest scales with the samples (:meth:`forward_seconds`). 0 (the
    default): all of it scales.

    ``forward_points`` / ``backward_points``: ``(fraction, seconds)`` measured on fractions of
    the profiled samples between the fixed part and the whole (:func:`~lightning_mmpp.plan.profile_model`
    times each layer on 1/2, 1/4, 1/8 and 1/16 of them). A layer's time is seldom a straight
    line in its samples: a matrix product on few rows uses its cores (or a GPU) less well than on
    many, so the line from the fixed part to the whole runs below the time at the sizes between
    (the README example's LM on 64 of 256 samples: 1.68 ms measured, 1.53 ms on the line). With
    points, the time at a fraction is read off the line through its two neighbours. Empty (the
    default, and a hand-written profile's): the straight line.

    ``tp_allreduces``: the all-reduces of the layer's output activation that the model's
    ``pipeline_parallelize`` hook adds per forward (and as many per backward) when the module
    runs with ``tp > 1``; default 2, a transformer block (attention and MLP, each column- then
    row-wise). 0: the hook leaves the layer whole (an embedding, a norm, a head it does not
    split), so every tp rank runs all of it and holds all its parameters. A hand-written
    profile should set 0 on such layers; :func:`~lightning_mmpp.plan.profile_model` cannot see
    what the hook splits and keeps the default.

    ``param_tensors``: the layer's trainable parameter tensors; an optimizer that loops over
    tensors pays :attr:`ModelProfile.optimizer_tensor_s` for each (every rank holding a shard
    or a tp slice of the layer holds as many tensors).

    ``cpu_share``: the share of the layer's time that keeps a CPU core busy (its process's CPU
    seconds over its wall seconds, at most 1): about 1 for a layer that computes on the CPU,
    about 0 for one that waits (for a GPU's kernels, or a timer). Where a host runs more ranks
    than it has cores and the model's layers compute, everything a compute does but the rest of
    its layers' time (``1 - cpu_share`` of it, spent waiting) needs a core, and runs slower while
    more ranks than cores need one (:mod:`lightning_mmpp.plan.sharing`). 0 (the default, and a
    hand-written profile's): the layer waits.
    """

    name: str
    forward_s: float
    backward_s: float
    input_grad_s: Optional[float] = None
    param_bytes: int = 0
    trainable: bool = True
    activation_bytes_per_sample: float = 0.0
    input_bytes_per_sample: float = 0.0
    output_bytes_per_sample: float = 0.0
    forward_fixed_s: float = 0.0
    backward_fixed_s: float = 0.0
    tp_allreduces: int = 2
    param_tensors: int = 0
    cpu_share: float = 0.0
    forward_points: tuple[tuple[float, float], ...] = ()
    backward_points: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:  # in order, strictly between 0 and 1 (JSON gives lists)
        self.forward_points = _sorted_points(self.forward_points)
        self.backward_points = _sorted_points(self.backward_points)

    def split_by(self, tp: int) -> int:
        """The ranks this layer's work and parameters are divided over at ``tp``: ``tp`` when
        the hook splits it (``tp_allreduces > 0``), else 1."""
        return tp if self.tp_allreduces > 0 else 1

    def forward_seconds(self, fraction: float) -> float:
        """The forward on ``fraction`` of the profiled samples: the fixed part, plus the rest
        scaled along the measured points."""
        return _on_curve(self.forward_s, self.forward_fixed_s, self.forward_points, fraction)

    def backward_seconds(self, fraction: float) -> float:
        """The fused backward on ``fraction`` of the profiled samples."""
        return _on_curve(self.backward_s, self.backward_fixed_s, self.backward_points, fraction)

    def forward_rate_floor(self) -> float:
        """The least of ``(forward_seconds(f) - forward_seconds(0)) / f`` over ``0 < f``: what
        a sample costs at least beyond the fixed part, so that a bound of ``fixed + floor * f``
        stays below every charge (``forward_seconds(1) - forward_seconds(0)`` without points)."""
        return _rate_floor(self.forward_s, self.forward_fixed_s, self.forward_points)

    def backward_rate_floor(self) -> float:
        """:meth:`forward_rate_floor` of the fused backward."""
        return _rate_floor(self.backward_s, self.backward_fixed_s, self.backward_points)

    def input_grad_seconds(self, fraction: float) -> float:
        """The ``I`` part of :meth:`backward_seconds` (its share of the profiled backward)."""
        return self.backward_seconds(fraction) * self.input_grad_share()

    def input_grad_share(self) -> float:
        """The share of the backward that is ``I`` (a half where not measured)."""
        if self.input_grad_s is None:
            return 0.5
        return self.input_grad_s / self.backward_s if self.backward_s > 0 else 0.0


def _sorted_points(points: Sequence[Sequence[float]]) -> tuple[tuple[float, float], ...]:
    return tuple(sorted((float(f), float(t)) for f, t in points if 0.0 < f < 1.0))


def _knots(measured: float, fixed: float, points: tuple[tuple[float, float], ...]) -> list[tuple[float, float]]:
    """``(fraction, seconds)`` from the fixed part at 0 through the points to the whole at 1, each
    at least the one before (more samples never take less time: a point below its predecessor
    is timing noise) and at most the whole."""
    fixed = min(max(fixed, 0.0), measured)
    knots = [(0.0, fixed)]
    for f, t in points:
        knots.append((f, min(max(t, knots[-1][1]), measured)))
    knots.append((1.0, measured))
    return knots


def _on_curve(measured: float, fixed: float, points: tuple[tuple[float, float], ...], fraction: float) -> float:
    """The time at ``fraction`` on the line through its two neighbouring knots (the last
    segment's slope above 1). Without points, the line from the fixed part to the whole (the
    planner's hot path: no list is built)."""
    if not points:
        fixed = min(max(fixed, 0.0), measured)
        return fixed + (measured - fixed) * fraction
    knots = _knots(measured, fixed, points)
    for (f0, t0), (f1, t1) in zip(knots, knots[1:]):
        if fraction <= f1 or f1 == 1.0:
            return t0 + (t1 - t0) * (fraction - f0) / (f1 - f0)
    raise AssertionError("unreachable: the last knot is at 1")


def _rate_floor(measured: float, fixed: float, points: tuple[tuple[float, float], ...]) -> float:
    knots = _knots(measured, fixed, points)
    base = knots[0][1]
    floor = min((t - base) / f for f, t in knots[1:])
    # above 1, (t(f) - base) / f averages the whole's rate and the last segment's slope
    (f0, t0), (f1, t1) = knots[-2], knots[-1]
    return min(floor, (t1 - t0) / (f1 - f0))


@dataclass
class ModuleProfile:
    """The layers of one module, in order (the children the partitioner splits).

    ``tp_capable``: whether the module can run with ``tp > 1``, i.e. its model has the
    ``pipeline_parallelize`` hook (:func:`~lightning_mmpp.plan.profile_model` records it).
    True by default, so a hand-written profile may be planned with tensor parallelism; the
    planner gives a module ``tp > 1`` only where ``plan_placements(tp_options=...)`` allows it.

    ``loss``: a sink's ``pipeline_loss`` (its metrics included) timed as a layer on the module's
    output, on the profiled samples: its forward is the call, its backward the gradient down to
    the output; no parameters, never split over stages or tp ranks. The runtime calls it in the
    sink's last stage's forward and starts that stage's backward from it, once per microbatch, so
    the cost model charges it there (:meth:`CostModel.stage`). ``None``: not a sink, or not
    measured (a hand-written profile).

    ``inputs``: the model's ``pipeline_inputs`` of a module with upstream modules, timed the same
    way on the upstream outputs: its forward is the call (a concatenation of image tokens and
    text embeddings, a sum of encoders' features), its backward the gradients back to the
    upstream outputs. The runtime calls it in the module's first stage before its first layer,
    once per microbatch, so the cost model charges it there. ``None``: a source, or not measured.
    """

    layers: list[LayerProfile]
    tp_capable: bool = True
    loss: Optional[LayerProfile] = None
    inputs: Optional[LayerProfile] = None

    @property
    def trainable(self) -> bool:
        """Whether any layer has parameters that train."""
        return any(layer.trainable and layer.param_bytes > 0 for layer in self.layers)

    def work(self) -> list[float]:
        """Forward + backward seconds of every layer (the weights the stages are balanced by)."""
        return [layer.forward_s + layer.backward_s for layer in self.layers]


@dataclass
class ModelProfile:
    """Measured costs of a multi-module model; see the module docstring.

    Args:
        modules: ``{module: ModuleProfile}`` in declaration order.
        topology: ``{module: [downstream modules]}``.
        profile_batch_size: samples the layer times and bytes were measured on.
        batch_size: the global batch of a training step the plans are for (default: the
            profiled batch).
        bandwidth_bytes_per_s: link bandwidth between ranks.
        latency_s: fixed cost per message (and per collective).
        state_bytes_per_param_byte: parameter + gradient + optimizer bytes per parameter byte
            (4.0: fp32 parameters with Adam, 16 B per parameter).
        device: where the profile was measured: on a CPU device (``"cpu..."``) a sharded
            stage's gradient reduce-scatters are charged inside its last backward (gloo runs
            them there), elsewhere beside the rank's later actions (they queue on their own stream).
        calibration: this machine's measured framework, link and collective costs
            (:func:`lightning_mmpp.plan.calibrate`); when given, the cost model charges them
            instead of ``bandwidth_bytes_per_s`` / ``latency_s`` alone (see
            :mod:`lightning_mmpp.plan.calibration`).
        optimizer_ratio: a step of the model's own optimizer per parameter byte over AdamW's
            (:func:`~lightning_mmpp.plan.profile_model` times the one ``configure_optimizers``
            returns beside AdamW); the calibration's optimizer rate (AdamW's) is charged times
            this. ``None``: 1 (AdamW).
        optimizer_tensor_s: the model's own optimizer's fixed cost per parameter tensor it steps
            (:func:`~lightning_mmpp.plan.profile_model` times it on tiny tensors), charged per
            :attr:`LayerProfile.param_tensors` beside the rate per byte. ``None``: 0.
        metrics: the metrics a step logs (what the loss modules' ``pipeline_loss`` returns, the
            loss included; :func:`~lightning_mmpp.plan.profile_model` counts them): each beyond
            the loss costs the calibration's ``metric_s`` per step.
    """

    modules: dict[str, ModuleProfile]
    topology: dict[str, list[str]]
    profile_batch_size: int
    batch_size: int = 0
    bandwidth_bytes_per_s: float = 10e9
    latency_s: float = 0.0
    state_bytes_per_param_byte: float = 4.0
    device: str = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)
    calibration: Optional[Calibration] = None
    optimizer_ratio: Optional[float] = None
    optimizer_tensor_s: Optional[float] = None
    metrics: int = 1

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            self.batch_size = self.profile_batch_size
        if set(self.modules) != set(self.topology):
            raise PipelineConfigError(
                f"profile modules {list(self.modules)} differ from its topology {list(self.topology)}; "
                "every module of the topology needs a profile and vice versa."
            )
        if self.profile_batch_size <= 0 or self.bandwidth_bytes_per_s <= 0:
            raise PipelineConfigError("a profile needs profile_batch_size > 0 and bandwidth_bytes_per_s > 0.")

    # --- JSON ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (:meth:`from_dict` reads it back)."""
        data = asdict(self)
        data["version"] = PROFILE_VERSION
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelProfile":
        """Read the dict written by :meth:`to_dict`."""
        data = dict(data)
        version = data.pop("version", PROFILE_VERSION)
        if version != PROFILE_VERSION:
            raise PipelineConfigError(f"profile version {version} is not supported (expected {PROFILE_VERSION}).")
        modules = {
            name: ModuleProfile([LayerProfile(**layer) for layer in module["layers"]],
                                tp_capable=module.get("tp_capable", True),
                                loss=None if module.get("loss") is None else LayerProfile(**module["loss"]),
                                inputs=None if module.get("inputs") is None else LayerProfile(**module["inputs"]))
            for name, module in data.pop("modules").items()
        }
        topology = {m: list(d) for m, d in data.pop("topology").items()}
        calibration = data.pop("calibration", None)
        return cls(modules=modules, topology=topology, **data,
                   calibration=None if calibration is None else Calibration.from_dict(calibration))

    def to_json(self, path: Optional[str | os.PathLike] = None) -> str:
        """The profile as JSON text; also written to ``path`` when given."""
        return write_json(self.to_dict(), path)

    @classmethod
    def from_json(cls, source: str | os.PathLike) -> "ModelProfile":
        """Read a profile from a JSON file path, or from JSON text."""
        return cls.from_dict(read_json(source))

    # --- derived ---------------------------------------------------------------------------

    def total_work_s(self, samples: Optional[int] = None) -> float:
        """Forward + backward seconds of the whole model on ``samples`` (default: the batch)."""
        n = self.batch_size if samples is None else samples
        return sum(sum(m.work()) for m in self.modules.values()) * n / self.profile_batch_size

    def optimizer_seconds(self, nbytes: float, tensors: int = 0) -> float:
        """The optimizer step over ``nbytes`` of parameters in ``tensors`` tensors held by one
        rank: the calibration's rate (AdamW's) times ``optimizer_ratio``, plus
        ``optimizer_tensor_s`` per tensor; 0 without a calibration."""
        if self.calibration is None:
            return 0.0
        ratio = 1.0 if self.optimizer_ratio is None else self.optimizer_ratio
        per_tensor = self.optimizer_tensor_s or 0.0
        return ratio * self.calibration.optimizer_seconds(nbytes) + per_tensor * tensors

    def frozen_modules(self) -> frozenset[str]:
        """Modules with no trainable parameter."""
        return frozenset(name for name, m in self.modules.items() if not m.trainable)


def allreduce_seconds(nbytes: float, group: int, bandwidth: float, latency: float = 0.0, scatter_only: bool = False,
                      collectives: int = 1) -> float:
    """Ring all-reduce (or reduce-scatter / all-gather with ``scatter_only``) of ``nbytes`` over
    ``group`` ranks, in ``collectives`` calls: each call's ring takes ``2 (group - 1)`` steps
    (``group - 1`` with ``scatter_only``), each paying ``latency``."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    steps = (1 if scatter_only else 2) * (group - 1)
    return steps / group * nbytes / bandwidth + collectives * steps * latency


def broadcast_seconds(nbytes: float, group: int, profile: "ModelProfile") -> float:
    """A tp group's lead broadcasting ``nbytes`` to the other ``group - 1`` ranks (a pipelined
    ring: the bytes once over the link, a latency per hop). With the profile's calibration: the
    fixed cost of one calibrated all-reduce over the group (one collective call over the same
    ranks; never below 0, as the fitted per-call part alone may be) plus the bytes once over its
    bandwidth; otherwise ``bandwidth`` and ``latency``."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    cal = profile.calibration
    if cal is not None:
        fixed = cal.allreduce_call_s + 2 * (group - 1) * cal.allreduce_latency_s
        return max(0.0, fixed) + nbytes / cal.allreduce_bandwidth
    return nbytes / profile.bandwidth_bytes_per_s + (group - 1) * profile.latency_s


def tp_allreduce_seconds(nbytes: float, group: int, calls: int, profile: "ModelProfile") -> float:
    """``calls`` all-reduces of ``nbytes`` each over a tp group of ``group`` ranks: the
    calibration's all-reduce when the profile has one, the ring formula otherwise."""
    if group <= 1 or nbytes <= 0 or calls <= 0:
        return 0.0
    if profile.calibration is not None:
        return profile.calibration.allreduce_seconds(calls * nbytes, group, calls)
    return allreduce_seconds(calls * nbytes, group, profile.bandwidth_bytes_per_s, profile.latency_s,
                             collectives=calls)


GRADIENT_BUCKET_BYTES = 25 * 2**20  # lightning_mmpp.engine.data_parallel's bucket: one all-reduce each
METRICS_BYTES = 64  # the step's loss and metrics, all-reduced once per step over every rank


def metrics_seconds(profile: "ModelProfile", world_size: int) -> float:
    """The once-per-step all-reduce of the loss and metrics over all ranks, after the pipeline."""
    return allreduce_seconds(METRICS_BYTES, world_size, profile.bandwidth_bytes_per_s, profile.latency_s)


def step_overhead_seconds(profile: "ModelProfile", world_size: int, lockstep: bool = True) -> float:
    """What a step costs beyond its stages and gradient sums: the calibrated per-step cost
    (loop, optimizer's fixed cost, metrics all-reduce) when the profile has a calibration, of a
    layout whose ranks run in ``lockstep`` (see :func:`in_lockstep`; and there the calibrated
    cost of each module beyond the first, ``Calibration.module_s``) or of a pipelined one, plus
    the calibrated cost of each logged metric beyond the loss (``ModelProfile.metrics``); the
    metrics all-reduce alone otherwise."""
    cal = profile.calibration
    if cal is not None:
        extra = max(0, profile.metrics - 1)  # the calibration's model logs its loss
        modules = len(profile.modules) - 1 if lockstep else 0
        return cal.step_seconds(lockstep) + extra * cal.metric_s + modules * cal.module_s
    return metrics_seconds(profile, world_size)


def in_lockstep(placements: Mapping[str, ModulePlacement], world_size: int) -> bool:
    """Whether every rank runs the same work at the same time: every module one stage over all
    ``world_size`` ranks (pure dp, tp within it), so the ranks end their steps together."""
    return all(p.num_stages == 1 and p.dp * p.tp == world_size for p in placements.values())


@dataclass(frozen=True)
class StageCost:
    """Seconds per microbatch and bytes of one ``(module, stage)`` under a :class:`CostModel`."""

    forward_s: float
    backward_s: float
    input_s: float  # the I half (zero_bubble)
    weight_s: float  # the W half
    sync_s: float  # dp gradient sum after the stage's last backward of the step
    static_bytes: float  # parameters, gradients, optimizer state (this rank's share)
    activation_bytes: float  # per microbatch in flight
    transient_bytes: float  # one recomputed layer's activations, one gathered layer
    optimizer_s: float = 0.0  # the optimizer step over this rank's share of the stage's parameters
    # the parts of forward_s / backward_s / input_s / weight_s spent waiting rather than on a
    # core: the layers' time times ``1 - cpu_share`` (the rest, the framework's and the messages'
    # included, is CPU work where ranks share a host's cores: lightning_mmpp.plan.sharing)
    forward_wait_s: float = 0.0
    backward_wait_s: float = 0.0
    input_wait_s: float = 0.0
    weight_wait_s: float = 0.0
    # an unsharded stage with dp > 1 packs its gradients into one flat buffer for their sum and
    # copies the sum back, on the rank's main thread: charged with the optimizer step at the
    # step's close (the pack runs after the stage's last backward, which delays the rank's later
    # actions and the sum by as much as it delays the close)
    gradient_copy_s: float = 0.0
    # the sum runs inside the stage's last backward piece of the step instead of after it: a
    # sharded stage on a CPU device (FSDP2 reduce-scatters each layer from its post-backward
    # hook, and gloo runs the collective before the hook returns), so the gradients the piece
    # sends upstream wait for it
    sync_in_backward: bool = False

    @property
    def blocking_sync_s(self) -> float:
        """The part of :attr:`sync_s` run inside the last backward piece."""
        return self.sync_s if self.sync_in_backward else 0.0

    @property
    def trailing_sync_s(self) -> float:
        """The part of :attr:`sync_s` run after the last backward piece, beside later actions."""
        return 0.0 if self.sync_in_backward else self.sync_s

    @property
    def closing_s(self) -> float:
        """The stage's part of its rank's work after the gradient sums: the optimizer step and
        the gradients' copies for their sum."""
        return self.optimizer_s + self.gradient_copy_s


class CostModel:
    """Costs of one candidate; see the module docstring.

    A module with ``virtual_stages=v`` has ``pp * v`` stages (chunks), each costed on its own
    layers; a hand-off between two of its stages on the same rank (the bottom of a V with
    ``v_shape``) stays in the process and costs nothing, like a bridge between modules on the
    same ranks.

    Args:
        profile: the measured model.
        placements: ``{module: ModulePlacement}``; ``split_points=None`` balances the stages by
            measured time (:meth:`split`).
        num_microbatches: microbatches per step.
        no_backward: modules that run no backward (frozen with nothing trainable upstream).
        v_shape: the chunks of modules with virtual stages sit V-shaped (``schedule="zbv"``), not
            interleaved (see :mod:`lightning_mmpp.core.placement`).
    """

    def __init__(self, profile: ModelProfile, placements: Mapping[str, ModulePlacement], num_microbatches: int,
                 no_backward: frozenset[str] = frozenset(), memo: Optional[dict] = None, v_shape: bool = False) -> None:
        self.profile = profile
        self.placements = dict(placements)
        self.m = num_microbatches
        self.no_backward = no_backward
        self.v_shape = v_shape
        self._ranges = {name: self.split(profile, name, p.num_stages, p.split_points)
                        for name, p in self.placements.items()}
        self._stages: dict[tuple[str, int], StageCost] = {}
        for name, placement in self.placements.items():
            # a stage's costs depend on its own placement, m and its neighbours' dp and
            # colocation only: a search shares them across candidates through ``memo``
            key = (name, placement, num_microbatches, self._neighbours(name), v_shape) if memo is not None else None
            stages = memo.get(key) if key is not None else None
            if stages is None:
                stages = [self._stage(name, stage) for stage in range(placement.num_stages)]
                if key is not None:
                    memo[key] = stages
            for stage, cost in enumerate(stages):
                self._stages[(name, stage)] = cost

    def _neighbours(self, module: str) -> tuple:
        """What of the other modules' placements ``module``'s stage costs depend on."""
        topology = self.profile.topology
        ups = tuple((up, self.placements[up].dp, self._in_process(up, module))
                    for up, downs in topology.items() if module in downs)
        downs = tuple((down, self.placements[down].dp, self._in_process(module, down)) for down in topology[module])
        return ups, downs

    @staticmethod
    def split(profile: ModelProfile, module: str, pp: int, split_points: Optional[Sequence[int]] = None) -> list[range]:
        """Layer ranges of the ``pp`` stages (``pp * virtual_stages`` with virtual stages):
        ``split_points`` if given, else balanced by time."""
        layers = profile.modules[module].layers
        if split_points is not None:
            bounds = [0, *split_points, len(layers)]
            return [range(bounds[i], bounds[i + 1]) for i in range(pp)]
        return balanced_split(profile.modules[module].work(), pp)

    def ranges(self, module: str) -> list[range]:
        return self._ranges[module]

    def samples(self, module: str) -> float:
        """Samples one replica of ``module`` processes per microbatch."""
        return self.profile.batch_size / (self.m * self.placements[module].dp)

    def _message_seconds(self, producer: str, stage: int, samples: float, messages: int) -> float:
        """Seconds to receive ``samples`` samples of the output of ``(producer, stage)`` in ``messages`` messages."""
        layer = self.profile.modules[producer].layers[self._ranges[producer][stage][-1]]
        nbytes = layer.output_bytes_per_sample * samples
        if self.profile.calibration is not None:
            return self.profile.calibration.message_seconds(nbytes, messages)
        return nbytes / self.profile.bandwidth_bytes_per_s + messages * self.profile.latency_s

    def _in_process(self, up: str, down: str) -> bool:
        """Whether ``up``'s last stage and ``down``'s first run on the same ranks (colocated or
        beside): their transfers stay in the process and cost nothing."""
        a, b = self.placements[up], self.placements[down]
        if a.rank_offset is None or b.rank_offset is None or (a.dp, a.tp) != (b.dp, b.tp):
            return False
        return a.rank_offset + a.position(a.num_stages - 1, self.v_shape) * a.dp * a.tp == b.rank_offset

    def _same_rank(self, module: str, stage: int) -> bool:
        """Whether stages ``stage`` and ``stage + 1`` of ``module`` sit on the same ranks (the
        bottom of a V): their hand-off stays in the process."""
        p = self.placements[module]
        return p.position(stage, self.v_shape) == p.position(stage + 1, self.v_shape)

    def _relay_seconds(self, module: str, producer: str, stage: int, samples: float) -> float:
        """The broadcast inside ``module``'s receiving tp group of ``samples`` samples of the
        output of ``(producer, stage)`` (or of its gradient), which the group's lead received."""
        tp = self.placements[module].tp
        if tp <= 1:
            return 0.0
        layer = self.profile.modules[producer].layers[self._ranges[producer][stage][-1]]
        return broadcast_seconds(layer.output_bytes_per_sample * samples, tp, self.profile)

    def received_seconds(self, module: str, stage: int) -> float:
        """Seconds one replica of ``(module, stage)`` spends receiving a microbatch's inputs:
        its own samples of every producer's output (from ``up.dp / dp`` senders on a fan-in)."""
        samples = self.samples(module)
        if stage > 0 and self._same_rank(module, stage - 1):
            return 0.0
        if stage > 0:
            return self._message_seconds(module, stage - 1, samples, 1) + \
                self._relay_seconds(module, module, stage - 1, samples)
        dp = self.placements[module].dp
        parts = []
        for up, downs in self.profile.topology.items():
            if module in downs and not self._in_process(up, module):
                last, senders = self.placements[up].num_stages - 1, max(1, self.placements[up].dp // dp)
                parts.append((self._message_seconds(up, last, samples, senders)
                              + self._relay_seconds(module, up, last, samples), senders))
        return self._together(parts)

    def _together(self, parts: Sequence[tuple[float, int]]) -> float:
        """Seconds of an action's receives, ``(seconds, messages)`` per peer module: they are
        posted ahead and waited on together, so the link's calibrated latency is paid once, not
        once per message (each message's own packing and posting still add). A fan-in of three
        messages priced one after another ran its stage's forward 0.6 ms per microbatch short of
        the prediction (benchmarks/README.md, session 17)."""
        seconds = sum(part for part, _ in parts)
        messages = sum(count for _, count in parts)
        cal = self.profile.calibration
        if cal is None or messages <= 1:
            return seconds
        return seconds - (messages - 1) * min(cal.p2p_latency_s, cal.message_s)

    def gradient_seconds(self, module: str, stage: int) -> float:
        """Seconds one replica of ``(module, stage)`` spends receiving the gradients of its output."""
        placement = self.placements[module]
        samples = self.samples(module)
        if stage < placement.num_stages - 1 and self._same_rank(module, stage):
            return 0.0
        if stage < placement.num_stages - 1:
            return self._message_seconds(module, stage, samples, 1) + self._relay_seconds(module, module, stage, samples)
        parts = []
        for down in self.profile.topology[module]:
            if down not in self.no_backward and not self._in_process(module, down):
                senders = max(1, self.placements[down].dp // placement.dp)
                parts.append((self._message_seconds(module, stage, samples, senders)
                              + self._relay_seconds(module, module, stage, samples), senders))
        return self._together(parts)

    def _stage(self, module: str, stage: int) -> StageCost:
        profile = self.profile
        placement = self.placements[module]
        layers = [profile.modules[module].layers[i] for i in self._ranges[module][stage]]
        scale = self.samples(module) / profile.profile_batch_size
        tp = placement.tp
        # a split layer: its per-sample part over tp ranks, 1/tp of its parameters (module docstring)
        forward = backward = input_half = forward_wait = backward_wait = input_wait = 0.0
        for layer in layers:  # one pass: the planner's hot path
            fraction = scale / layer.split_by(tp)
            layer_forward, layer_backward = layer.forward_seconds(fraction), layer.backward_seconds(fraction)
            layer_input = layer_backward * layer.input_grad_share()
            waiting = 1 - layer.cpu_share
            forward += layer_forward
            backward += layer_backward
            input_half += layer_input
            forward_wait += layer_forward * waiting
            backward_wait += layer_backward * waiting
            input_wait += layer_input * waiting
        param_bytes = sum(layer.param_bytes / layer.split_by(tp) for layer in layers)
        trainable_bytes = sum(layer.param_bytes / layer.split_by(tp) for layer in layers if layer.trainable)
        # the tp all-reduces of each split layer's output, per forward and as many per backward
        tp_collectives = sum(
            tp_allreduce_seconds(layer.output_bytes_per_sample * self.samples(module), tp, layer.tp_allreduces, profile)
            for layer in layers) if tp > 1 else 0.0
        forward += tp_collectives
        backward += tp_collectives
        input_half += tp_collectives
        dp = placement.dp
        bw, lat = profile.bandwidth_bytes_per_s, profile.latency_s
        cal = profile.calibration
        sharded_layers = sum(1 for layer in layers if layer.param_bytes > 0)  # one FSDP2 unit per layer
        calls = sharded_layers if placement.shard else max(1, math.ceil(trainable_bytes / GRADIENT_BUCKET_BYTES))
        trains = module not in self.no_backward
        if cal is None:
            gather = allreduce_seconds(param_bytes, dp, bw, lat, scatter_only=True,
                                       collectives=sharded_layers) if placement.shard else 0.0
            sync = allreduce_seconds(trainable_bytes, dp, bw, lat, scatter_only=placement.shard,
                                     collectives=calls) if trains else 0.0
            action = optimizer = copy = 0.0
        else:
            gather = cal.gather_seconds(param_bytes, dp, sharded_layers) if placement.shard else 0.0
            if not trains:
                sync = 0.0
            elif placement.shard:
                sync = cal.scatter_seconds(trainable_bytes, dp, sharded_layers)
            else:
                sync = cal.allreduce_seconds(trainable_bytes, dp, calls)
            action = cal.action_s
            tensors = sum(layer.param_tensors for layer in layers if layer.trainable)
            optimizer = profile.optimizer_seconds(trainable_bytes / dp if placement.shard else trainable_bytes,
                                                  tensors) if trains else 0.0
            if trains and placement.shard:  # each parameter a DTensor: dispatched through its sharding
                optimizer += cal.sharded_tensor_s * tensors
            copy = cal.gradient_copy_seconds(trainable_bytes) if trains and dp > 1 and not placement.shard else 0.0
        recomputed = forward if placement.recompute else 0.0
        recomputed_wait = forward_wait if placement.recompute else 0.0
        weight_wait = max(0.0, backward_wait - input_wait) + recomputed_wait
        backward_wait += recomputed_wait
        input_wait += recomputed_wait
        backward += recomputed
        input_half += recomputed
        glue = profile.modules[module].inputs if stage == 0 else None
        loss = profile.modules[module].loss if stage == placement.num_stages - 1 else None
        # pipeline_inputs before the first layer, the sink's loss after the last: whole on every
        # tp rank, never recomputed; their backwards (the gradients to the upstream outputs, the
        # start of the backward) are part of I, none of W
        for whole in (glue, loss):
            if whole is not None:
                whole_forward, whole_backward = whole.forward_seconds(scale), whole.backward_seconds(scale)
                waiting = 1 - whole.cpu_share
                forward += whole_forward
                forward_wait += whole_forward * waiting
                backward += whole_backward
                input_half += whole_backward
                backward_wait += whole_backward * waiting
                input_wait += whole_backward * waiting
        forward += action + gather + self.received_seconds(module, stage)
        if not trains:
            backward = input_half = weight_half = 0.0
            backward_wait = input_wait = weight_wait = 0.0
        else:
            # zero_bubble: I waits for the output gradient and the gathered weights; W is an
            # autograd call (and, calibrated, an action) of its own: it gathers a sharded layer
            # again and reruns a recomputed layer's forward (the checkpoint recomputes per call)
            own = 0.0 if cal is None else action
            weight_half = max(0.0, backward - input_half) + own + gather + recomputed
            extra = own + gather + self.gradient_seconds(module, stage)
            backward += extra
            input_half += extra
        state = param_bytes + trainable_bytes * (profile.state_bytes_per_param_byte - 1.0)
        biggest_layer = max((layer.param_bytes / layer.split_by(tp) for layer in layers), default=0.0)
        static = state / dp + biggest_layer if placement.shard else state
        samples = self.samples(module)
        if not trains:
            activation = 0.0
            transient = max((layer.activation_bytes_per_sample for layer in layers), default=0.0) * samples
        elif placement.recompute:
            activation = sum(layer.input_bytes_per_sample for layer in layers) * samples
            transient = max((layer.activation_bytes_per_sample for layer in layers), default=0.0) * samples
        else:
            activation = sum(layer.activation_bytes_per_sample for layer in layers) * samples
            transient = 0.0
        if loss is not None and trains:  # what the loss saves for its backward, held until then
            activation += loss.activation_bytes_per_sample * samples
        blocking = trains and placement.shard and dp > 1 and profile.device.startswith("cpu")
        return StageCost(forward, backward, input_half, weight_half, sync, static, activation, transient, optimizer,
                         forward_wait, backward_wait, input_wait, weight_wait, copy, blocking)

    def stage(self, module: str, stage: int) -> StageCost:
        """The costs of ``(module, stage)``."""
        return self._stages[(module, stage)]

    # simulator cost functions: (module, stage) -> seconds
    def forward(self, module: str, stage: int) -> float:
        return self._stages[(module, stage)].forward_s

    def backward(self, module: str, stage: int) -> float:
        return self._stages[(module, stage)].backward_s

    def input(self, module: str, stage: int) -> float:
        return self._stages[(module, stage)].input_s

    def weight(self, module: str, stage: int) -> float:
        return self._stages[(module, stage)].weight_s

    def blocking_sync(self, module: str, stage: int) -> float:
        return self._stages[(module, stage)].blocking_sync_s

    def inflight_bound(self, layout: PipelineLayout, module: str, stage: int, schedule: ScheduleName) -> int:
        """Microbatches ``(module, stage)`` holds at most under ``schedule`` (1F1B: ``depth - index``,
        in the default stage numbering the schedules use)."""
        if module in self.no_backward:
            return 0
        if schedule == ScheduleName.GPIPE:
            return self.m
        if schedule == ScheduleName.ZERO_BUBBLE:
            return min(self.m, layout.depth)
        return min(self.m, layout.depth - layout.stage_index(module, stage))

    def peak_memory(self, layout: PipelineLayout, inflight: Mapping[tuple[int, str, int], float]) -> list[float]:
        """Peak bytes per rank of ``layout`` given the microbatches each ``(rank, module, chunk)``
        holds (chunk 0 without virtual stages; the chunks of a rank add up)."""
        peaks = []
        for rank in range(layout.world_size):
            total = 0.0
            transient = 0.0
            for slot in layout.slots(rank):
                cost = self._stages[(slot.module, slot.stage)]
                total += cost.static_bytes + inflight.get((rank, slot.module, slot.chunk), 0) * cost.activation_bytes
                transient = max(transient, cost.transient_bytes)
            peaks.append(total + transient)
        return peaks
