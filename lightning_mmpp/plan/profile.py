"""Measure a LightningModule layer by layer for the planner (torch).

:func:`profile_model` composes the modules as :func:`lightning_mmpp.run_unpipelined` does
(``pipeline_inputs`` in topological order, then the layers of each module's container, the
same layers the partitioner splits) on one sample batch, in one process, and times every layer
on its own (and a module's ``pipeline_inputs`` of its upstream outputs as a layer too,
``ModuleProfile.inputs``): the forward, the fused backward (gradient of ones for every float
output), and the input-gradient part of it (``torch.autograd.grad`` w.r.t. the layer's inputs, the ``I`` of
zero_bubble). The forward and the backward are timed again on 2 samples, which
splits each into a fixed part per call (Python, autograd, kernel launches: paid by every
microbatch whatever its size) and a part that scales with the samples; scaling the whole time
from the profiled batch down to a small microbatch missed the fixed part (a row-scaled sleep
layer: 0.27 ms forward and 0.5 ms backward per call, about 10% of a 4-row microbatch). Both are
also timed on 1/2, 1/4, 1/8 and 1/16 of the samples (``LayerProfile.forward_points``): a plan's
microbatch is a fraction of the batch, and between the fixed part and the whole a layer's time
is seldom a straight line. It records parameter bytes, the bytes the layer saves for its backward (counted
with ``saved_tensors_hooks``, parameters excluded) and the bytes of its input and output
pytrees, per sample; per module, whether the model has the ``pipeline_parallelize`` hook
(``ModuleProfile.tp_capable``: the planner may then give it ``tp > 1``). Each sink's
``pipeline_loss`` is timed the same way, as a layer of the sink's output
(``ModuleProfile.loss``): the runtime runs it once per microbatch on the sink's last stage.

A model whose modules are built in ``configure_model()`` is built on the meta device and
profiled one layer at a time: each layer is materialised (:func:`lightning_mmpp.materialize`)
on ``device``, measured and returned to the meta device, so the whole model is never allocated.
"""

from __future__ import annotations

import functools
import inspect
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import torch
from torch import nn

from lightning_mmpp import torch_api as pytree
from lightning_mmpp.engine.runtime import TOKEN_COUNT, TOKEN_LOSS
from lightning_mmpp.engine.tensor_parallel import HOOK as TP_HOOK
from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.model.initialization import has_meta_tensors, materialize
from lightning_mmpp.model.hooks import pipeline_loss_caller
from lightning_mmpp.model.ragged import run_ragged
from lightning_mmpp.model.partition import _layer_container, named_layers
from lightning_mmpp.plan.calibration import Calibration
from lightning_mmpp.plan.costs import LayerProfile, ModelProfile, ModuleProfile
from lightning_mmpp.core.topology import ModuleTopology

__all__ = ["default_link", "profile_model"]

SMALL_SAMPLES = 2  # the second size each layer is timed at, for its fixed cost per call
# the fractions of the profiled samples each layer is also timed at (where a whole number of
# samples, at least twice SMALL_SAMPLES): the points of LayerProfile.forward_points / backward_points
POINT_FRACTIONS = (0.5, 0.25, 0.125, 0.0625)
# timed runs per measurement (the median): with 3, one profile in three of 8 equal Linear(1024)
# layers on a 2-core VM came out 25% dear (backward 3.5-6.4 ms per layer against 3.7), and the
# first layer's backward 3.5 ms against 2.1 ms with 9; with 9, three profiles within 4%
PROFILE_REPEATS = 9


def default_link(device: str) -> tuple[float, float]:
    """``(bandwidth bytes/s, latency s)`` assumed when none is given: gloo over loopback on
    CPU (about 2 GB/s, 0.7 ms per exchange, ``benchmarks/README.md``); a GPU link otherwise."""
    return (2e9, 7e-4) if torch.device(device).type == "cpu" else (25e9, 5e-5)


def _leaves(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _leaves(tree))


def _batch_size(batch: Any, default: Optional[int] = None) -> int:
    """The leading dimension of the first tensor leaf that has one; ``default`` (or an error,
    without one) when none has."""
    for leaf in _leaves(batch):
        if leaf.dim() > 0:
            return int(leaf.shape[0])
    if default is not None:
        return default
    raise PipelineConfigError("profile_model: the batch holds no tensor with a batch dimension; pass a collated batch.")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], prepare: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn(prepare())`` over ``repeats`` runs after one warmup."""
    return _timed_with_cpu(fn, prepare, repeats, device)[0]


def _timed_with_cpu(fn: Callable[[], Any], prepare: Callable[[], Any], repeats: int,
                    device: torch.device) -> tuple[float, float]:
    """Median seconds of ``fn(prepare())`` over ``repeats`` runs after one warmup, and the
    median of the process's CPU seconds in the same runs (every thread of it)."""
    times, cpu = [], []
    for i in range(repeats + 1):
        arg = prepare()
        _sync(device)
        start, start_cpu = time.perf_counter(), time.process_time()
        fn(arg)
        _sync(device)
        if i:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return statistics.median(times), statistics.median(cpu)


def _detached_input(x: Any, needs_grad: bool) -> Any:
    def leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.detach()
        return t.requires_grad_(True) if needs_grad and t.is_floating_point() else t

    return pytree.tree_map(leaf, x)


def _grad_outputs(y: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    outs = [t for t in _leaves(y) if t.requires_grad]
    return outs, [torch.ones_like(t) for t in outs]


def _forward_for_backward(layer: nn.Module, inputs: Callable[[], Any]) -> Callable[[], tuple[Any, list, list]]:
    """A fresh forward of ``layer`` to run a backward of: ``(inputs, outputs, output gradients)``."""
    def run() -> tuple[Any, list, list]:
        xin = inputs()
        o, g = _grad_outputs(layer(xin))
        return xin, o, g

    return run


def _backward(a: tuple[Any, list, list]) -> None:
    torch.autograd.backward(a[1], a[2])


def _first_samples(x: Any, samples: int, n: int) -> Optional[Any]:
    """``x`` with every tensor leaf whose leading dimension is the batch cut to its first ``n``
    samples; ``None`` when no leaf has the batch dimension (packed items: nothing to cut)."""
    leaves = [t for t in _leaves(x) if t.dim() > 0 and t.shape[0] == samples]
    if not leaves:
        return None
    return pytree.tree_map(
        lambda t: t[:n] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == samples else t, x)


def _intercept(whole: float, part: float, samples: int, fewer: int) -> float:
    """The fixed part of a time measured as ``whole`` on ``samples`` and ``part`` on ``fewer``
    samples, with time = fixed + rate * samples; within ``[0, part]`` (timing noise)."""
    fixed = (part * samples - whole * fewer) / (samples - fewer)
    return min(max(fixed, 0.0), part)


def _profile_layer(name: str, layer: nn.Module, x: Any, needs_grad: bool, repeats: int,
                   device: torch.device, samples: int) -> tuple[LayerProfile, Any]:
    params = list(layer.parameters())
    param_ptrs = {p.data_ptr() for p in params}
    trainable = any(p.requires_grad for p in params)
    inputs = lambda: _detached_input(x, needs_grad)  # noqa: E731

    saved: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in param_ptrs:
            saved[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(inputs())
    forward, forward_cpu = _timed_with_cpu(layer, inputs, repeats, device)
    outs, grads = _grad_outputs(y)
    backward = input_grad = backward_cpu = 0.0
    forward_for_backward = _forward_for_backward(layer, inputs)
    if outs:
        backward, backward_cpu = _timed_with_cpu(_backward, forward_for_backward, repeats, device)
        wanted = [t for t in _leaves(inputs()) if t.requires_grad]
        if wanted and trainable:
            def input_half(a: tuple[Any, list, list]) -> None:
                needed = [t for t in _leaves(a[0]) if t.requires_grad]
                torch.autograd.grad(a[1], needed, a[2], allow_unused=True)

            input_grad = min(backward, _timed(input_half, forward_for_backward, repeats, device))
        else:
            input_grad = 0.0 if trainable else backward
    # the time on fewer samples, halving: a plan's microbatches are fractions of the batch, and
    # the time is seldom a straight line in the samples (LayerProfile.forward_points)
    forward_points: list[tuple[float, float]] = []
    backward_points: list[tuple[float, float]] = []
    lowest = (samples, forward, backward)  # the fewest samples timed so far, and their times
    for fraction in POINT_FRACTIONS:
        rows = samples * fraction
        cut = _first_samples(x, samples, int(rows)) if rows == int(rows) and rows >= 2 * SMALL_SAMPLES else None
        if cut is None:
            continue
        cut_inputs = functools.partial(_detached_input, cut, needs_grad)
        cut_forward = _timed(layer, cut_inputs, repeats, device)
        forward_points.append((fraction, cut_forward))
        cut_backward = 0.0
        if outs:
            cut_backward = _timed(_backward, _forward_for_backward(layer, cut_inputs), repeats, device)
            backward_points.append((fraction, cut_backward))
        lowest = (int(rows), cut_forward, cut_backward)
    # the fixed part per call: the same layer on 2 samples (time = fixed + rate * samples; 2, which a
    # layer normalising over the batch needs in training), against the fewest samples timed above
    # it: the fewer, the less the timing noise of either run moves the intercept (a quarter of 32
    # samples amplified it 1.33x, and a plan's small microbatches were priced by extrapolating
    # below the measured sizes)
    forward_fixed = backward_fixed = 0.0
    fewer = SMALL_SAMPLES
    small = _first_samples(x, samples, fewer) if fewer < samples else None
    if small is not None:
        small_inputs = lambda: _detached_input(small, needs_grad)  # noqa: E731
        rows, rows_forward, rows_backward = lowest
        forward_fixed = _intercept(rows_forward, _timed(layer, small_inputs, repeats, device), rows, fewer)
        if outs:
            small_backward = _timed(_backward, _forward_for_backward(layer, small_inputs), repeats, device)
            backward_fixed = _intercept(rows_backward, small_backward, rows, fewer)
    for p in params:
        p.grad = None
    profile = LayerProfile(
        name=name, forward_s=forward, backward_s=backward, input_grad_s=input_grad if outs else None,
        param_bytes=sum(p.numel() * p.element_size() for p in params), trainable=trainable,
        activation_bytes_per_sample=sum(saved.values()) / samples if trainable or needs_grad else 0.0,
        input_bytes_per_sample=_nbytes(x) / samples, output_bytes_per_sample=_nbytes(y) / samples,
        forward_fixed_s=forward_fixed, backward_fixed_s=backward_fixed,
        forward_points=tuple(forward_points), backward_points=tuple(backward_points),
        param_tensors=sum(1 for p in params if p.requires_grad),
        cpu_share=_cpu_share(forward + backward, forward_cpu + backward_cpu),
    )
    return profile, pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, y)


def _batch_cut_to(batch: Any, samples: int, data: Any) -> Any:
    """``batch`` (of ``samples`` samples) cut to the samples ``data`` holds: a hook timed on fewer
    samples (the points, the fixed part) gets the batch's first ones."""
    rows = _batch_size(data, default=samples)
    if rows == samples:
        return batch
    cut = _first_samples(batch, samples, rows)
    return batch if cut is None else cut


class _LossLayer(nn.Module):
    """A sink's ``pipeline_loss`` as a layer of the sink's output, for :func:`_profile_layer`: the
    call (its metrics included) returning the tensor the runtime starts the backward from (the
    loss, or the per-token form's ``loss_sum``), with the batch cut to the output's samples."""

    def __init__(self, loss: Callable[[str, Any, Any], Any], module: str, batch: Any, samples: int) -> None:
        super().__init__()
        self.loss, self.module, self.batch, self.samples = loss, module, batch, samples

    def forward(self, output: Any) -> torch.Tensor:
        result = self.loss(self.module, output, _batch_cut_to(self.batch, self.samples, output))
        if isinstance(result, Mapping):
            return result[TOKEN_LOSS] if TOKEN_LOSS in result else result["loss"]
        return result


class _InputsLayer(nn.Module):
    """A module's ``pipeline_inputs`` as a layer of its upstream outputs (a dict), for
    :func:`_profile_layer`: the call, with the batch cut to the upstream outputs' samples."""

    def __init__(self, inputs: Callable[[str, Any, Any], Any], module: str, batch: Any, samples: int) -> None:
        super().__init__()
        self.inputs, self.module, self.batch, self.samples = inputs, module, batch, samples

    def forward(self, upstream: dict[str, Any]) -> Any:
        return self.inputs(self.module, _batch_cut_to(self.batch, self.samples, upstream), upstream)


def _profile_inputs(lightning_module: nn.Module, module: str, upstream: dict[str, Any], batch: Any, needs_grad: bool,
                    repeats: int, device: torch.device, samples: int) -> Optional[LayerProfile]:
    """``pipeline_inputs`` of ``module`` timed as a layer of its upstream outputs (its backward:
    the gradients back to them, where ``needs_grad``); ``None`` when it cannot be timed here."""
    try:
        layer = _InputsLayer(lightning_module.pipeline_inputs, module, batch, samples)
        profiled, _ = _profile_layer("pipeline_inputs", layer, upstream, needs_grad, repeats, device, samples)
    except Exception:  # noqa: BLE001 - a hook that needs the step's state: nothing is charged
        return None
    profiled.tp_allreduces = 0  # whole on every tp rank
    return profiled


def _profile_loss(lightning_module: nn.Module, module: str, output: Any, batch: Any, trains: bool, repeats: int,
                  device: torch.device, samples: int) -> Optional[LayerProfile]:
    """The sink ``module``'s ``pipeline_loss`` timed as a layer of its ``output``; ``None`` when
    the hook cannot run here (it needs the Trainer or the step's state: then nothing is charged)."""
    try:
        layer = _LossLayer(pipeline_loss_caller(lightning_module), module, batch, samples)
        profiled, _ = _profile_layer("pipeline_loss", layer, output, trains, repeats, device, samples)
    except Exception:  # noqa: BLE001 - any failure of the user's hook outside a step
        return None
    if not trains:
        profiled.backward_s, profiled.input_grad_s, profiled.backward_fixed_s, profiled.backward_points = 0.0, None, 0.0, ()
    profiled.tp_allreduces = 0  # whole on every tp rank
    return profiled


def _cpu_share(wall: float, cpu: float) -> float:
    """The share of a layer's time that keeps a core busy: its process's CPU seconds over its
    wall seconds, within ``[0, 1]`` (a layer on several intra-op threads counts as one core: where
    ranks outnumber the cores, each rank runs one thread)."""
    return min(1.0, max(0.0, cpu / wall)) if wall > 0 else 0.0


def _logged_metrics(lightning_module: nn.Module, topo: ModuleTopology, outputs: Mapping[str, Any], batch: Any) -> int:
    """The metrics a training step logs: the keys of what ``pipeline_loss`` returns for every
    sink (a bare tensor is the loss alone; the token count of a per-token loss is not logged).
    1 when the hook cannot run here."""
    try:
        loss = pipeline_loss_caller(lightning_module)
        with torch.no_grad():
            results = [loss(m, outputs[m], batch) for m in topo.order if not topo.downstream(m)]
    except Exception:  # noqa: BLE001 - a hook that needs the Trainer or the step's state
        return 1
    names: set[str] = set()
    for result in results:
        if isinstance(result, Mapping):
            names.update(k for k in result if k != TOKEN_COUNT)
        else:
            names.add("loss")
    return max(1, len(names))


def _materialise_layer(layer: nn.Module, device: torch.device, seed: int) -> None:
    """Give a meta-built layer real tensors; values only need to be plausible for timing."""
    try:
        materialize(layer, seed, device=device)
    except PipelineConfigError:  # no reset_parameters(): random values are fine for timing
        layer.to_empty(device=device)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0.0, 0.02)


def profile_model(
    lightning_module: nn.Module,
    batch: Any,
    device: str | torch.device = "cpu",
    repeats: int = PROFILE_REPEATS,
    *,
    topology: Optional[Mapping[str, Sequence[str]]] = None,
    bandwidth_bytes_per_s: Optional[float] = None,
    latency_s: Optional[float] = None,
    seed: int = 0,
    calibration: Optional[Calibration] = None,
    num_threads: Optional[int] = None,
) -> ModelProfile:
    """Measure every layer of every module of ``lightning_module`` on ``batch``.

    Args:
        lightning_module: the model, with ``pipeline_inputs`` and one layer container per
            module (``nn.Sequential`` / ``nn.ModuleList``, or any module run as one layer).
            Modules built in ``configure_model()`` are built on the meta device here and
            materialised one layer at a time.
        batch: one collated batch; its leading dimension is the profiled batch size, and the
            plans are for that global batch unless ``plan_placements(batch_size=...)`` says
            otherwise.
        device: where to measure (the target device).
        repeats: timed runs per measurement (the median is kept), after one warmup.
        topology: ``{module: [downstream]}``; default ``lightning_module.pipeline_topology``.
        bandwidth_bytes_per_s, latency_s: the link between ranks; default
            :func:`default_link` for ``device``.
        seed: initialisation seed of meta-built layers.
        calibration: this machine's measured costs (:func:`lightning_mmpp.plan.calibrate`),
            kept with the profile for the cost model; its link (p2p latency and bandwidth) is
            then the default link too.
        num_threads: torch's intra-op threads while measuring (restored after): give what each
            rank will run with (Lightning gives a CPU rank ``cpu_count // processes per node``);
            on a CPU with fewer cores than ranks, layer times measured with every core differ
            from the ranks' by orders of magnitude. ``None``: the current setting.

    Returns:
        A :class:`~lightning_mmpp.plan.costs.ModelProfile`.
    """
    if num_threads is not None:
        previous = torch.get_num_threads()
        torch.set_num_threads(num_threads)
        try:
            return profile_model(lightning_module, batch, device, repeats, topology=topology,
                                 bandwidth_bytes_per_s=bandwidth_bytes_per_s, latency_s=latency_s, seed=seed,
                                 calibration=calibration)
        finally:
            torch.set_num_threads(previous)
    device = torch.device(device)
    topology, topo = _model_topology(lightning_module, topology)
    no_backward = topo.no_backward_modules(_frozen_modules(lightning_module, topo))
    batch = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)
    samples = _batch_size(batch)
    modules: dict[str, ModuleProfile] = {}
    outputs: dict[str, Any] = {}
    was_training = lightning_module.training
    lightning_module.train()
    try:
        for module in topo.order:
            upstream = {u: outputs[u] for u in topo.upstream(module)}
            x = lightning_module.pipeline_inputs(module, batch, upstream)
            trains = module not in no_backward
            glue = None
            if upstream:  # the gradients flow back through it to upstream modules that train
                glue = _profile_inputs(lightning_module, module, upstream, batch,
                                       any(u not in no_backward for u in upstream), repeats, device, samples)

            def profile(inputs: Any, module: str = module, trains: bool = trains) -> Any:
                modules[module], out = _profile_module(
                    lightning_module, module, inputs, trains, bool(topo.upstream(module)), repeats, device, samples,
                    seed,
                )
                return out

            # a Ragged input: the layers see the packed items, the output travels on with its counts
            outputs[module] = run_ragged(profile, x, f"module {module!r}")
            modules[module].inputs = glue
            if not topo.downstream(module):
                modules[module].loss = _profile_loss(lightning_module, module, outputs[module], batch, trains, repeats,
                                                     device, samples)
    finally:
        lightning_module.train(was_training)
    default_bw, default_latency = default_link(str(device))
    if calibration is not None:
        default_latency = calibration.p2p_latency_s
        if calibration.p2p_bandwidth != float("inf"):
            default_bw = calibration.p2p_bandwidth
    tp_capable = callable(getattr(lightning_module, TP_HOOK, None))  # tp > 1 needs the model's hook
    for profiled in modules.values():
        profiled.tp_capable = tp_capable
    ordered = {m: modules[m] for m in topology}
    optimizer_ratio, optimizer_tensor_s = _optimizer_costs(lightning_module, device)
    return ModelProfile(
        optimizer_ratio=optimizer_ratio, optimizer_tensor_s=optimizer_tensor_s,
        metrics=_logged_metrics(lightning_module, topo, outputs, batch),
        modules=ordered, topology={m: list(d) for m, d in topology.items()}, profile_batch_size=samples,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s or default_bw,
        latency_s=default_latency if latency_s is None else latency_s, device=str(device), calibration=calibration,
    )


# the model's optimizer and AdamW are timed on this many parameter bytes each (4 tensors), in turn
OPTIMIZER_PROBE_BYTES = 4 * 1024 * 1024
OPTIMIZER_PROBE_ROUNDS = 9
# the model's optimizer's cost per parameter tensor: its step on this many tiny tensors against
# its step on FEW_TENSORS of them (an optimizer that loops over tensors, as torch's do on CPU by
# default, pays a fixed cost for each: 27 us per tensor for AdamW on one thread of a 2-core VM,
# ten times the example model's 111 KB of parameters at AdamW's rate per byte)
MANY_TENSORS = 64
FEW_TENSORS = 8
TINY_TENSOR_BYTES = 64


def _configured_optimizer(configured: Any) -> Optional[torch.optim.Optimizer]:
    """The optimizer of what ``configure_optimizers`` returned (an optimizer, a dict with
    ``"optimizer"``, a list / tuple of them, or ``(optimizers, schedulers)``); ``None`` when
    there is not exactly one (the strategy trains with one optimizer)."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, Mapping):
        return _configured_optimizer(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)) and configured:
        if len(configured) == 2 and isinstance(configured[1], (list, tuple)):  # (optimizers, schedulers)
            return _configured_optimizer(configured[0])
        return _configured_optimizer(configured[0]) if len(configured) == 1 else None
    return None


def reference_optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer whose step per parameter byte :func:`~lightning_mmpp.plan.calibrate` times
    (``Calibration.optimizer_s_per_byte``), and which a model's own is compared with."""
    return torch.optim.AdamW(params, lr=1e-6)


def optimizer_probe(build: Callable[[list[nn.Parameter]], torch.optim.Optimizer], device: torch.device,
                    nbytes: int = OPTIMIZER_PROBE_BYTES, tensors: int = 4) -> Callable[[], None]:
    """A step of ``build(params)`` on ``nbytes`` of fresh fp32 parameters (``tensors`` equal
    tensors) with gradients, its state created by a first step."""
    params = [nn.Parameter(torch.zeros(max(1, nbytes // (4 * tensors)), device=device)) for _ in range(tensors)]
    return primed_step(build, params)


def primed_step(build: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                params: list[nn.Parameter]) -> Callable[[], None]:
    """The ``step`` of ``build(params)`` with a small gradient on every parameter, its state
    created by a first step (what a probe times)."""
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    optimizer = build(params)
    optimizer.step()
    return optimizer.step


def _constructor_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's ``defaults`` its constructor takes (AdamW keeps one its constructor fixes)."""
    parameters = inspect.signature(type(optimizer)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in parameters}


def _optimizer_costs(lightning_module: nn.Module, device: torch.device) -> tuple[Optional[float], Optional[float]]:
    """``(ratio, seconds per tensor)`` of the model's own optimizer (``ModelProfile.optimizer_ratio``
    and ``optimizer_tensor_s``).

    The ratio: its step over AdamW's (which the calibration times per parameter byte, among ranks
    sharing the machine) on the same parameter bytes (4 MiB), both timed here side by side: an
    SGD step costs a fraction of AdamW's. The cost per tensor: its step on ``MANY_TENSORS`` tiny
    tensors minus its step on ``FEW_TENSORS``, per extra tensor. Each is the median over rounds
    that time the pair in turn, so a burst of load elsewhere moves one round, not the result.
    ``(None, None)`` when the model configures no single optimizer here (e.g. its scheduler needs
    the Trainer) or its class cannot be rebuilt from its ``defaults``: the cost model then
    charges AdamW's rate and nothing per tensor."""
    configure = getattr(lightning_module, "configure_optimizers", None)
    if not callable(configure):
        return None, None
    try:
        optimizer = _configured_optimizer(configure())
        if optimizer is None:
            return None, None
        build = functools.partial(type(optimizer), **_constructor_settings(optimizer))
        own = optimizer_probe(build, device)
        many = optimizer_probe(build, device, MANY_TENSORS * TINY_TENSOR_BYTES, MANY_TENSORS)
        few = optimizer_probe(build, device, FEW_TENSORS * TINY_TENSOR_BYTES, FEW_TENSORS)
    except Exception:  # noqa: BLE001 - anything the user's hook or optimizer needs that a profile lacks
        return None, None
    adamw = optimizer_probe(reference_optimizer, device)
    ratios, per_tensor = [], []
    for _ in range(OPTIMIZER_PROBE_ROUNDS):
        t_own = _timed(lambda _: own(), lambda: None, 1, device)
        t_adamw = _timed(lambda _: adamw(), lambda: None, 1, device)
        if t_adamw > 0:
            ratios.append(t_own / t_adamw)
        t_many = _timed(lambda _: many(), lambda: None, 1, device)
        t_few = _timed(lambda _: few(), lambda: None, 1, device)
        per_tensor.append(max(0.0, t_many - t_few) / (MANY_TENSORS - FEW_TENSORS))
    return (statistics.median(ratios) if ratios else None), statistics.median(per_tensor)


def _model_topology(
    lightning_module: nn.Module, topology: Optional[Mapping[str, Sequence[str]]]
) -> tuple[Mapping[str, Sequence[str]], ModuleTopology]:
    """The topology to profile (given, or the model's ``pipeline_topology``), with every module
    built: modules the model creates in ``configure_model()`` are built on the meta device."""
    topology = topology if topology is not None else getattr(lightning_module, "pipeline_topology", None)
    if topology is None:
        raise PipelineConfigError(
            f"profile_model: {type(lightning_module).__name__} has no pipeline_topology; declare it or pass "
            "topology={module: [downstream modules]}."
        )
    topo = ModuleTopology(topology)
    if any(getattr(lightning_module, m, None) is None for m in topo.order):
        configure = getattr(lightning_module, "configure_model", None)
        if callable(configure):
            with torch.device("meta"):
                configure()
    return topology, topo


def _frozen_modules(lightning_module: nn.Module, topo: ModuleTopology) -> list[str]:
    """Modules without a trainable parameter."""
    return [m for m in topo.order if isinstance(getattr(lightning_module, m, None), nn.Module)
            and not any(p.requires_grad for p in getattr(lightning_module, m).parameters())]


def _profile_module(
    lightning_module: nn.Module, module: str, x: Any, trains: bool, has_upstream: bool, repeats: int,
    device: torch.device, samples: int, seed: int,
) -> tuple[ModuleProfile, Any]:
    """Every layer of ``module`` measured on its input ``x``, one layer on ``device`` at a time (a
    meta-built layer is materialised for its measurement and goes back to meta); and the module's output."""
    names, layers = named_layers(_layer_container(lightning_module, module, pp=1))
    profiled = []
    for i, (name, layer) in enumerate(zip(names, layers)):
        on_meta = has_meta_tensors(layer)
        if on_meta:
            _materialise_layer(layer, device, seed)
        else:
            layer.to(device)
        needs_grad = trains and (i > 0 or has_upstream)
        result, x = _profile_layer(name or module, layer, x, needs_grad, repeats, device, samples)
        if not trains:
            result.backward_s, result.input_grad_s, result.backward_fixed_s, result.backward_points = 0.0, None, 0.0, ()
        profiled.append(result)
        if on_meta:
            layer.to("meta")
    return ModuleProfile(profiled), x
