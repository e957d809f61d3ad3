"""Execute one rank's action list: stage forwards and backwards, with the communicator.

Loss scaling. The loss of a step is the mean over microbatches and over the replicas of each
sink module (summed over sinks). Each sink replica backpropagates ``loss / (M * dp_sink)``,
gradients cross the bridges unscaled (split and concatenation are exact), and every module's
data-parallel group then *sums* its gradients: the result is exactly the gradient of the
global mean loss, for any fan-in or fan-out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from lightning_mmpp.comm import MessageKey
from lightning_mmpp.errors import PipelineConfigError, PipelineError
from lightning_mmpp.failures import FailureBoard
from lightning_mmpp.partition import StageRunner
from lightning_mmpp.placement import PipelineLayout
from lightning_mmpp.schedule import BACKWARD, FORWARD, Exchange, Schedule, Transfer
from lightning_mmpp.trace import NULL_TRACER, Tracer


class PipelineHooks(Protocol):
    """What the runtime needs from the user's model (a LightningModule provides these)."""

    def pipeline_inputs(self, module: str, batch: Any, upstream: dict[str, Any]) -> Any: ...

    def pipeline_loss(self, output: Any, batch: Any) -> Tensor | dict[str, Tensor]: ...


class Communicator(Protocol):
    def exchange(self, sends: Mapping[MessageKey, Any], recvs: Sequence[MessageKey]) -> dict[MessageKey, Any]: ...


@dataclass
class StepResult:
    """What one rank computed in a step.

    ``metric_sums`` holds this rank's share of every metric (already divided by the number of
    microbatches and sink replicas), so a sum over all ranks gives the step's value.
    ``sink_outputs`` holds the sink stage outputs per microbatch (kept only when asked).
    """

    metric_sums: dict[str, Tensor] = field(default_factory=dict)
    # (sink module, microbatch) -> the unscaled loss (detached), to name a non-finite one
    sink_losses: dict[tuple[str, int], Tensor] = field(default_factory=dict)
    sink_outputs: dict[int, Any] = field(default_factory=dict)
    peak_stashed: int = 0
    # bytes of the stashed outputs and received inputs held for backwards, at their peak
    peak_stashed_bytes: int = 0


def _loss_and_metrics(result: Any, module: str) -> tuple[Tensor, dict[str, Tensor]]:
    if isinstance(result, Tensor):
        loss, extra = result, {}
    elif isinstance(result, Mapping) and isinstance(result.get("loss"), Tensor):
        loss = result["loss"]
        extra = {k: v for k, v in result.items() if k != "loss"}
    else:
        raise PipelineConfigError(
            f"pipeline_loss for sink {module!r} returned {type(result).__name__}; return a scalar tensor or a "
            "dict with a scalar tensor under 'loss' (and further scalar metrics)."
        )
    if loss.numel() != 1:
        raise PipelineConfigError(
            f"pipeline_loss for sink {module!r} returned a loss of shape {tuple(loss.shape)}; reduce it to a scalar."
        )
    metrics: dict[str, Tensor] = {}
    for name, value in extra.items():
        value = torch.as_tensor(value)
        if value.numel() != 1:
            raise PipelineConfigError(
                f"pipeline_loss metric {name!r} of sink {module!r} has shape {tuple(value.shape)}; metrics must be "
                "scalars."
            )
        metrics[str(name)] = value
    return loss.reshape(()), metrics


def _grad_payload(payload: Any) -> Any:
    """The gradients accumulated on the leaves of a received payload (None where there is none)."""
    return tree_map(lambda x: x.grad if isinstance(x, Tensor) else None, payload)


def _payload_bytes(payload: Any) -> int:
    """Bytes of the distinct tensors in a pytree (a tensor passed through twice counts once)."""
    seen = {(t.data_ptr(), t.dtype, t.numel()): t.numel() * t.element_size()
            for t in tree_flatten(payload)[0] if isinstance(t, Tensor)}
    return sum(seen.values())


def _add_payloads(a: Any, b: Any) -> Any:
    la, spec = tree_flatten(a)
    lb, _ = tree_flatten(b)
    out = [x if y is None else y if x is None else x + y for x, y in zip(la, lb)]
    return spec.unflatten(out)


class PipelineRuntime:
    """Runs the actions of ``rank`` for one step.

    Args:
        layout: the placement.
        rank: this process's global rank.
        comm: the communicator (anything with ``exchange``).
        runners: the stage this rank holds of each module.
        hooks: ``pipeline_inputs`` / ``pipeline_loss`` provider.
    """

    def __init__(
        self,
        layout: PipelineLayout,
        rank: int,
        comm: Communicator,
        runners: Mapping[str, StageRunner],
        hooks: PipelineHooks,
        tracer: Tracer | None = None,
        no_grad_modules: frozenset[str] = frozenset(),
        failures: FailureBoard | None = None,
    ) -> None:
        self.no_grad_modules = no_grad_modules
        self.failures = failures if failures is not None else FailureBoard(layout, rank, 1)
        self.tracer = tracer if tracer is not None else NULL_TRACER
        self.layout = layout
        self.rank = rank
        self.comm = comm
        self.runners = dict(runners)
        self.hooks = hooks
        self.sinks = set(layout.topology.sinks)

    def run(
        self,
        schedule: Schedule,
        shard: Callable[[str, int], Any],
        keep_sink_outputs: bool = False,
        compute_loss: bool = True,
    ) -> StepResult:
        """Execute ``schedule`` for this rank.

        Args:
            shard: ``shard(module, k)`` -> the slice of microbatch ``k`` this rank's replica of
                ``module`` processes.
            keep_sink_outputs: keep the sink stage outputs (for predict).
            compute_loss: call ``pipeline_loss`` on sink stages (not for predict).
        """
        step = _StepState(
            schedule.num_microbatches, not schedule.forward_only, shard, keep_sink_outputs, compute_loss
        )
        for action in schedule.for_rank(self.rank):
            try:
                if isinstance(action, Exchange):
                    self._exchange(step, action)
                    continue
                runner = self.runners[action.module]
                name = "forward" if action.phase == FORWARD else "backward"
                with self.tracer.span(name, action.module, microbatch=action.microbatch, stage=runner.stage):
                    if action.phase == FORWARD:
                        self._forward(step, runner, action.microbatch)
                    else:
                        self._backward(step, runner, action.microbatch)
            except PipelineError:
                raise
            except Exception as err:  # this rank's own failure: the root cause its peers will name
                transfers = action.sends + action.recvs if isinstance(action, Exchange) else ()
                k = action.microbatch if not transfers else min(t.microbatch for t in transfers)
                self.failures.publish_exception(err, k)
                raise
        assert not step.received and not step.out_grads and not step.losses, "stash not drained"
        return step.result

    def _exchange(self, step: "_StepState", action: Exchange) -> None:
        sends = self._collect_sends(step, action.sends)
        recv_keys = list(dict.fromkeys(_key(t) for t in action.recvs))
        with self.tracer.span("exchange", "comm", sends=len(sends), recvs=len(recv_keys)):
            try:
                got = self.comm.exchange(sends, recv_keys)
            except RuntimeError as err:  # a peer failed, died or timed out: name the root cause
                transfers = action.sends + action.recvs
                peers = {t.peer for t in transfers}
                raise self.failures.transport_failure(err, peers, min(t.microbatch for t in transfers)) from err
        for key, payload in got.items():
            if key.direction == FORWARD:
                step.received.setdefault((key.dst_module, key.microbatch), {})[key.src_module] = payload
            else:
                step.out_grads.setdefault((key.src_module, key.microbatch), {})[key.dst_module] = payload

    def _is_loss_stage(self, runner: StageRunner) -> bool:
        return runner.module in self.sinks and runner.stage == self.layout.placements[runner.module].pp - 1

    def _forward(self, step: "_StepState", runner: StageRunner, k: int) -> None:
        module = runner.module
        inputs = step.received.get((module, k), {})
        if runner.stage == 0:
            upstream = {u: inputs[u] for u in self.layout.topology.upstream(module)}
            x = self.hooks.pipeline_inputs(module, step.shard(module, k), upstream)
        else:
            x = inputs[module]
        trained = step.training and module not in self.no_grad_modules
        if trained:
            out = runner(x)
        else:
            with torch.no_grad():
                out = runner(x)
        loss_stage = self._is_loss_stage(runner)
        if loss_stage and step.keep_sink_outputs:
            step.result.sink_outputs.setdefault(k, {})[module] = out
        if loss_stage and step.compute_loss:
            loss, metrics = _loss_and_metrics(self.hooks.pipeline_loss(out, step.shard(module, k)), module)
            scale = 1.0 / (step.num_microbatches * self.layout.placements[module].dp)
            step.result.sink_losses[(module, k)] = loss.detach()
            if step.training:
                step.losses[(module, k)] = loss * scale
            self._accumulate(step.result, module, loss, metrics, scale)
        if trained:
            step.outputs[(module, k)] = out  # stashed until its backward
            step.stashed += 1
            step.result.peak_stashed = max(step.result.peak_stashed, step.stashed)
            step.stash_bytes[(module, k)] = _payload_bytes((out, inputs))
            step.result.peak_stashed_bytes = max(step.result.peak_stashed_bytes, sum(step.stash_bytes.values()))
            return
        step.received.pop((module, k), None)
        if not loss_stage:
            step.outputs[(module, k)] = out  # freed once sent

    def _backward(self, step: "_StepState", runner: StageRunner, k: int) -> None:
        module = runner.module
        if self._is_loss_stage(runner):
            loss = step.losses.pop((module, k))
            if loss.requires_grad:
                torch.autograd.backward(loss)
        else:
            grad: Optional[Any] = None
            for g in step.out_grads.pop((module, k), {}).values():
                grad = g if grad is None else _add_payloads(grad, g)
            out_leaves, _ = tree_flatten(step.outputs[(module, k)])
            grad_leaves = tree_flatten(grad)[0] if grad is not None else [None] * len(out_leaves)
            tensors, grad_tensors = [], []
            for out, g in zip(out_leaves, grad_leaves):
                if isinstance(out, Tensor) and out.requires_grad and g is not None:
                    tensors.append(out)
                    grad_tensors.append(g)
            if tensors:
                torch.autograd.backward(tensors, grad_tensors)
        inputs = step.received.pop((module, k), {})
        step.in_grads[(module, k)] = {
            src: _grad_payload(p) for src, p in inputs.items() if src not in self.no_grad_modules
        }
        if not step.in_grads[(module, k)]:
            del step.in_grads[(module, k)]
        step.outputs.pop((module, k), None)
        step.stashed -= 1
        step.stash_bytes.pop((module, k), None)

    def _collect_sends(self, step: "_StepState", transfers: Sequence[Transfer]) -> dict[MessageKey, Any]:
        sends: dict[MessageKey, Any] = {}
        for t in transfers:
            key = _key(t)
            if key in sends:
                continue
            if t.direction == FORWARD:
                sends[key] = step.outputs[(t.src_module, t.microbatch)]
            else:
                sends[key] = step.in_grads[(t.dst_module, t.microbatch)][t.src_module]
        for key in sends:
            if key.direction == FORWARD and (not step.training or key.src_module in self.no_grad_modules):
                # not stashed for a backward: an output is dropped once its consumers have it
                step.outputs.pop((key.src_module, key.microbatch), None)
            elif key.direction == BACKWARD:
                pending = step.in_grads[(key.dst_module, key.microbatch)]
                pending.pop(key.src_module, None)
                if not pending:
                    del step.in_grads[(key.dst_module, key.microbatch)]
        return sends

    def _accumulate(self, result: StepResult, module: str, loss: Tensor, metrics: dict[str, Tensor], scale: float) -> None:
        prefix = "" if len(self.sinks) == 1 else f"{module}_"
        values = {"loss": loss, **{f"{prefix}{n}": v for n, v in metrics.items()}}
        for name, value in values.items():
            share = value.detach().float() * scale
            result.metric_sums[name] = result.metric_sums[name] + share if name in result.metric_sums else share


@dataclass
class _StepState:
    """Everything one step holds between actions; emptied as backwards run."""

    num_microbatches: int
    training: bool
    shard: Callable[[str, int], Any]
    keep_sink_outputs: bool
    compute_loss: bool
    result: StepResult = field(default_factory=StepResult)
    stashed: int = 0
    stash_bytes: dict[tuple[str, int], int] = field(default_factory=dict)           # (module, k) -> bytes held
    received: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)   # (dst, k) -> {src: payload}
    outputs: dict[tuple[str, int], Any] = field(default_factory=dict)               # (module, k) -> output
    losses: dict[tuple[str, int], Tensor] = field(default_factory=dict)             # (sink, k) -> scaled loss
    out_grads: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)  # (module, k) -> {consumer: grad}
    in_grads: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)   # (module, k) -> {producer: grad}


def _key(t: Transfer) -> MessageKey:
    return MessageKey(t.direction, t.src_module, t.dst_module, t.microbatch)
