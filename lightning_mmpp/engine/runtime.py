"""Execute one rank's action list: stage forwards and backwards, with the communicator.

Stage execution lives in :class:`StageExecutor` (forward, fused backward, and the two halves
of a split backward); :class:`PipelineRuntime` walks the schedule, moves payloads through the
communicator and keeps the per-step stash.

Split backward (``I`` then ``W``, for ``schedule="zero_bubble"``). The forward applies the
stage's layers one at a time, each on a detached copy of the previous layer's output (a leaf
that requires grad), so every layer owns a separate autograd graph piece. ``I`` walks the
layers from last to first with ``torch.autograd.grad`` w.r.t. each layer's input only, keeping
the graph of layers that have trainable parameters; the stage input's gradient lands in the
``.grad`` of the received leaves and is sent upstream. ``W`` then runs
``torch.autograd.backward(layer outputs, their gradients, inputs=layer parameters)`` per layer,
accumulating into ``.grad``. Layer boundaries make ``W`` exact without hooks into autograd's
graph (torch.distributed.pipelining finds the param/input split inside the graph instead); the
price is that activation gradients *inside* a multi-op layer are computed again by ``W``. A
stage whose inputs need no gradient gets a lone ``W``: a fused backward run late.

Loss scaling. The loss of a step is the mean over microbatches and over the replicas of each
sink module (summed over sinks). Each sink replica backpropagates ``loss / (M * dp_sink)``,
gradients cross the bridges unscaled (split and concatenation are exact), and every module's
data-parallel group then *sums* its gradients: the result is exactly the gradient of the
global mean loss, for any fan-in or fan-out.

Per-token losses. A sink whose ``pipeline_loss`` returns ``{"loss_sum": s, "num_tokens": n}``
backpropagates ``s`` unscaled; the step's loss is ``sum(s) / sum(n)`` over every microbatch and
replica, so after the data-parallel sums the strategy divides every gradient by the global
token count (known only when the step is over), as Megatron does. Further ``"<name>_sum"``
entries are metrics normalised by the same count. This needs a single sink: the gradients of
shared upstream modules could not be split per sink afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from lightning_mmpp.torch_api import tree_flatten, tree_map

from lightning_mmpp.core.actions import Compute, Direction, Exchange, MessageKey, Phase, Schedule
from lightning_mmpp.errors import ExchangeMismatchError, PipelineConfigError, PipelineError
from lightning_mmpp.engine.failures import FailureBoard
from lightning_mmpp.engine.sharding import forward_parameters
from lightning_mmpp.model.hooks import pipeline_loss_caller
from lightning_mmpp.model.partition import StageRunner
from lightning_mmpp.model.ragged import Ragged, run_ragged
from lightning_mmpp.core.placement import PipelineLayout
from lightning_mmpp.engine.trace import NULL_TRACER, PHASE_SPANS, Tracer


class PipelineHooks(Protocol):
    """What the runtime needs from the user's model (a LightningModule provides these)."""

    def pipeline_inputs(self, module: str, batch: Any, upstream: dict[str, Any]) -> Any: ...

    # ``pipeline_loss(module, output, batch)``, or the older ``pipeline_loss(output, batch)``
    def pipeline_loss(self, *args: Any) -> Tensor | dict[str, Tensor]: ...


class GradientSync(Protocol):
    """Told around the backwards that produce parameter gradients (fused ``B`` and ``W``).

    ``last`` says whether it is the stage's last such backward of the step: a sharded stage
    reduce-scatters only then, an unsharded dp stage starts its all-reduce right after it.
    """

    def before_backward(self, module: str, last: bool) -> None: ...

    def after_last_backward(self, module: str) -> None: ...


class _NoGradientSync:
    def before_backward(self, module: str, last: bool) -> None:
        pass

    def after_last_backward(self, module: str) -> None:
        pass


class Communicator(Protocol):
    """What the runtime needs from the communicator (see
    :class:`~lightning_mmpp.engine.comm.MultiModuleCommunicator`)."""

    def exchange(self, sends: Mapping[MessageKey, Any], recvs: Sequence[MessageKey]) -> dict[MessageKey, Any]: ...

    def post(self, sends: Mapping[MessageKey, Any], recvs: Sequence[MessageKey]) -> None: ...

    def take(self, key: MessageKey) -> Any: ...

    # post a later exchange's receive now where that is safe; whether it was posted
    def post_ahead(self, key: MessageKey) -> bool: ...

    # the start of a step: training (backwards follow) or forward-only, the same on every rank
    def begin_step(self, training: bool) -> None: ...

    # the end of a step: deferred checks, sends still in flight, state kept for backwards; raises
    # ExchangeMismatchError for messages that were not the expected ones
    def finish_step(self) -> None: ...


@dataclass
class StepResult:
    """What one rank computed in a step.

    ``metric_sums`` holds this rank's share of every metric (already divided by the number of
    microbatches and sink replicas), so a sum over all ranks gives the step's value.
    ``sink_outputs`` holds the sink stage outputs per microbatch (kept only when asked).
    """

    metric_sums: dict[str, Tensor] = field(default_factory=dict)
    # per-token form: this rank's unscaled sums ("loss_sum", "num_tokens", other "<name>_sum")
    token_sums: dict[str, Tensor] = field(default_factory=dict)
    # (sink module, microbatch) -> the unscaled loss (detached), to name a non-finite one
    sink_losses: dict[tuple[str, int], Tensor] = field(default_factory=dict)
    sink_outputs: dict[int, Any] = field(default_factory=dict)
    # microbatches held between a forward and its last backward piece (B, or W), at their peak
    peak_stashed: int = 0
    # bytes of the stashed outputs and received inputs held for backwards (after an I: the
    # layer inputs and output gradients its W needs), at their peak
    peak_stashed_bytes: int = 0


TOKEN_LOSS = "loss_sum"
TOKEN_COUNT = "num_tokens"

# exchanges whose receives are posted ahead (see PipelineRuntime's ``receive_ahead``)
RECEIVE_AHEAD = 2


def is_token_loss(result: Any) -> bool:
    """Whether a ``pipeline_loss`` result is in the per-token form ``{"loss_sum", "num_tokens"}``."""
    return isinstance(result, Mapping) and TOKEN_LOSS in result


def _token_loss_and_metrics(result: Mapping[str, Any], module: str) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """``(loss_sum, sums, metrics)``: ``sums`` holds loss_sum, num_tokens and every ``*_sum`` metric."""
    loss_sum = result[TOKEN_LOSS]
    if not isinstance(loss_sum, Tensor) or loss_sum.numel() != 1 or TOKEN_COUNT not in result or "loss" in result:
        raise PipelineConfigError(
            f"pipeline_loss for sink {module!r} returned 'loss_sum'; the per-token form is a dict with a scalar tensor "
            "'loss_sum' (the summed token losses), 'num_tokens' (how many tokens it sums) and no 'loss'."
        )
    sums = {TOKEN_LOSS: loss_sum.detach().float().reshape(()),
            TOKEN_COUNT: torch.as_tensor(result[TOKEN_COUNT]).detach().float().reshape(())}
    rest = {k: v for k, v in result.items() if k not in (TOKEN_LOSS, TOKEN_COUNT)}
    _, metrics = _loss_and_metrics({"loss": loss_sum, **rest}, module)
    for name in [n for n in metrics if n.endswith("_sum")]:
        sums[name] = metrics.pop(name).detach().float()
    return loss_sum.reshape(()), sums, metrics


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
    if isinstance(payload, Tensor):  # the common one-tensor payload: no tree to map
        return payload.grad
    return tree_map(lambda x: x.grad if isinstance(x, Tensor) else None, payload)


def _payload_bytes(payload: Any) -> int:
    """Bytes of the distinct tensors in a pytree (a tensor passed through twice counts once)."""
    seen: dict[tuple[int, torch.dtype, int], int] = {}
    _tensor_bytes(payload, seen)
    return sum(seen.values())


def _tensor_bytes(node: Any, seen: dict[tuple[int, torch.dtype, int], int]) -> None:
    """Add the tensors of ``node`` to ``seen`` (by storage address, dtype and size). Plain
    tuples, lists and dicts are walked here, without building a pytree spec per action; any
    other container (a namedtuple, a registered pytree node) goes through ``tree_flatten``."""
    kind = type(node)
    if isinstance(node, Tensor):
        numel = node.numel()
        seen[(node.data_ptr(), node.dtype, numel)] = numel * node.element_size()
    elif kind is tuple or kind is list:
        for item in node:
            _tensor_bytes(item, seen)
    elif kind is dict:
        for item in node.values():
            _tensor_bytes(item, seen)
    elif node is not None:
        for leaf in tree_flatten(node)[0]:
            if isinstance(leaf, Tensor):
                _tensor_bytes(leaf, seen)


def _add_payloads(a: Any, b: Any) -> Any:
    la, spec = tree_flatten(a)
    lb, _ = tree_flatten(b)
    out = [x if y is None else y if x is None else x + y for x, y in zip(la, lb)]
    return spec.unflatten(out)


@dataclass
class _LayerPiece:
    """One layer of a split-backward forward: its graph piece and, after ``I``, what ``W`` needs."""

    params: list[nn.Parameter]  # the layer's trainable parameters
    inputs: list[Any]  # pytree leaves of the layer's input (leaves of the autograd graph)
    outputs: list[Any]  # pytree leaves of the layer's output
    roots: list[Any] = field(default_factory=list)  # set by I: graph edges of the outputs W starts from
    grads: list[Tensor] = field(default_factory=list)  # set by I: their gradients


def _detached(payload: Any) -> Any:
    """``payload`` with every tensor leaf detached, ``requires_grad`` kept: a new graph starts here."""
    return tree_map(
        lambda x: x.detach().requires_grad_(x.requires_grad) if isinstance(x, Tensor) else x, payload
    )


def _with_grads(leaves: Sequence[Any], grads: Sequence[Any]) -> tuple[list[Tensor], list[Tensor]]:
    """The leaves that require grad and have a gradient, with those gradients."""
    pairs = [(t, g) for t, g in zip(leaves, grads) if isinstance(t, Tensor) and t.requires_grad and g is not None]
    return [t for t, _ in pairs], [g for _, g in pairs]


class StageExecutor:
    """Runs one stage's layers for the runtime: the forward, a fused backward, or its halves.

    Each phase is one small method, so a wrapper that changes how a stage computes (sharding,
    recompute) plugs in here. A split forward applies ``runner.layers`` one by one; wrap the
    layer modules themselves (as ``fully_shard`` and checkpoint wrappers do) to change them.
    """

    def __init__(self, runner: StageRunner, chunk: int = 0) -> None:
        self.runner = runner
        self.module = runner.module
        self.stage = runner.stage
        self.unit = (runner.module, chunk)  # which of the rank's stages of the module it is
        self.where = f"module {self.module!r} stage {self.stage}"  # names the stage in errors

    def forward(self, x: Any, track_grad: bool, split: bool) -> tuple[Any, Optional[list[_LayerPiece]]]:
        """The stage output for input ``x``; with ``split`` also the per-layer graph pieces."""
        where = self.where
        if not track_grad:
            with torch.no_grad():
                return run_ragged(self.runner, x, where), None
        if not split:
            return run_ragged(self.runner, x, where), None
        pieces: list[_LayerPiece] = []
        if isinstance(x, Ragged):  # the layers see the packed items; the output keeps the counts
            out, pieces = self.forward(x.values, track_grad, split)
            return run_ragged(lambda _values: out, x, where), pieces
        h = x  # the received input is already a graph leaf
        for index, layer in enumerate(self.runner.layers):
            if index:
                h = _detached(h)
            out = layer(h)
            params = forward_parameters(layer)  # an FSDP2 unit's unsharded ones
            pieces.append(_LayerPiece(params, tree_flatten(h)[0], tree_flatten(out)[0]))
            h = out
        return h, pieces

    def backward(self, roots: Sequence[Tensor], grads: Sequence[Optional[Tensor]]) -> None:
        """Fused backward: gradients of the stage input leaves and parameters in one call."""
        if roots:
            torch.autograd.backward(list(roots), list(grads))

    def backward_input(self, pieces: list[_LayerPiece], out_grads: Sequence[Any], received: Sequence[Tensor]) -> list[Any]:
        """``I``: gradients w.r.t. the ``received`` leaves (accumulated into their ``.grad``), layer
        by layer from the last, keeping what each layer's ``W`` needs. ``out_grads`` is aligned
        with the last layer's output leaves. Returns the layer inputs and output gradients the
        ``W`` keeps (for the stash accounting); the pieces drop everything else, the layer
        outputs included (``W`` starts from their autograd graph edges)."""
        grads = list(out_grads)
        for index in range(len(pieces) - 1, -1, -1):
            piece = pieces[index]
            roots, root_grads = _with_grads(piece.outputs, grads)
            keep = bool(piece.params and roots)
            if keep:  # the edges, not the tensors: W needs the graph, not the outputs' storage
                piece.roots, piece.grads = [get_gradient_edge(t) for t in roots], root_grads
            if index == 0:  # the first layer's graph reaches back to the received leaves
                if roots and received:
                    torch.autograd.backward(roots, root_grads, inputs=list(received), retain_graph=keep)
                break
            wanted = [t for t in piece.inputs if isinstance(t, Tensor) and t.requires_grad]
            if not roots or not wanted:
                grads = [None] * len(piece.inputs)
                continue
            got = iter(torch.autograd.grad(roots, wanted, root_grads, retain_graph=keep, allow_unused=True))
            grads = [next(got) if isinstance(t, Tensor) and t.requires_grad else None for t in piece.inputs]
        kept = [(piece.inputs, piece.grads) for piece in pieces if piece.roots]
        for piece in pieces:
            piece.inputs, piece.outputs = [], []
        return kept

    def backward_weight(self, pieces: list[_LayerPiece]) -> None:
        """``W``: parameter gradients of every layer from what ``I`` kept, accumulated into ``.grad``."""
        for piece in pieces:
            if piece.roots:
                torch.autograd.backward(piece.roots, piece.grads, inputs=piece.params)
            piece.roots, piece.grads = [], []


def _loss_grads(loss: Tensor, outputs: Sequence[Any]) -> list[Optional[Tensor]]:
    """Gradients of ``loss`` w.r.t. the output leaves that require grad (None elsewhere)."""
    wanted = [t for t in outputs if isinstance(t, Tensor) and t.requires_grad]
    if not wanted or not loss.requires_grad:
        return [None] * len(outputs)
    got = iter(torch.autograd.grad(loss, wanted, allow_unused=True))
    return [next(got) if isinstance(t, Tensor) and t.requires_grad else None for t in outputs]


class PipelineRuntime:
    """Runs the actions of ``rank`` for one step.

    Args:
        layout: the placement.
        rank: this process's global rank.
        comm: the communicator (see :class:`Communicator`); :meth:`run` ends with its ``finish_step``.
        runners: the stages this rank holds (any mapping; its values are used): one per module,
            or, under virtual stages, one per chunk of a module (the runtime keys each by
            ``(module, chunk)``, the chunk found from the runner's stage).
        hooks: ``pipeline_inputs`` / ``pipeline_loss`` provider.
        no_backward_modules: modules that run no backward (see
            :meth:`~lightning_mmpp.core.placement.PipelineLayout.no_backward_modules`).
        overlap: an exchange posts its transfers and returns; a compute waits only for the
            receives it consumes (its inputs, its output gradients), so transfers run beside
            the computes in between. ``False``: every exchange waits for its receives (and its
            previous sends) before the next action, for comparison.
        receive_ahead: with ``overlap``, after each exchange (and after a take, where the
            communicator refused one) the receives of up to this many later exchanges are
            posted already, in the schedule's order, as far as the communicator allows
            (:meth:`~lightning_mmpp.engine.comm.MultiModuleCommunicator.post_ahead`): a peer's
            data then lands while this rank computes instead of waiting for the receive's
            notice. Each receive posted ahead holds its buffer from then on. 0: none.
    """

    def __init__(
        self,
        layout: PipelineLayout,
        rank: int,
        comm: Communicator,
        runners: Mapping[Any, StageRunner],
        hooks: PipelineHooks,
        tracer: Tracer | None = None,
        no_backward_modules: frozenset[str] = frozenset(),
        failures: FailureBoard | None = None,
        gradient_sync: GradientSync | None = None,
        overlap: bool = True,
        receive_ahead: int = RECEIVE_AHEAD,
    ) -> None:
        if not isinstance(receive_ahead, int) or receive_ahead < 0:
            raise PipelineConfigError(f"receive_ahead={receive_ahead!r}: give a number of exchanges >= 0.")
        self.overlap = overlap
        self.receive_ahead = receive_ahead if overlap else 0
        self.gradient_sync = gradient_sync if gradient_sync is not None else _NoGradientSync()
        self.no_backward_modules = frozenset(no_backward_modules)
        self.failures = failures if failures is not None else FailureBoard(layout, rank, 1)
        self.tracer = tracer if tracer is not None else NULL_TRACER
        self.layout = layout
        self.rank = rank
        self.comm = comm
        self.stages = {
            (runner.module, layout.chunk_of(runner.module, runner.stage)):
                StageExecutor(runner, layout.chunk_of(runner.module, runner.stage))
            for runner in runners.values()
        }
        self.loss_stages = {  # (sink, chunk) of the sinks' last stages on this rank
            unit for unit, stage in self.stages.items()
            if stage.stage == layout.num_stages(stage.module) - 1 and not layout.topology.downstream(stage.module)
        }
        self.hooks = hooks
        self.pipeline_loss = pipeline_loss_caller(hooks)  # (module, output, batch) whatever form hooks wrote
        self.multiple_sinks = len(layout.topology.sinks) > 1
        # id(schedule) -> (the schedule, its lowered program for this rank)
        self._programs: dict[int, tuple[Schedule, _Program]] = {}

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
        program = self._prepared(schedule)
        actions = program.actions
        self.comm.begin_step(not schedule.forward_only)
        step = _StepState(
            schedule.num_microbatches, not schedule.forward_only, shard, keep_sink_outputs, compute_loss, program.split,
            program.receives,
        )
        # stages whose gradients are complete, told after the exchange that sends their input
        # gradients upstream (other ranks wait for those first) or, where a compute comes next,
        # before that compute (the sum then runs beside it instead of after the pipeline)
        finished: list[str] = []
        if self.receive_ahead:
            self._post_ahead(step, program.receives, 0)
        for action, prepared in zip(actions, program.steps):
            try:
                exchange = isinstance(prepared, _PreparedExchange)
                if exchange:
                    self._exchange(step, prepared)
                    if self.receive_ahead:
                        self._post_ahead(step, program.receives, prepared.ordinal + 1)
                if finished:
                    self._start_sums(finished)
                if exchange:
                    continue
                if prepared.gradient:
                    self.gradient_sync.before_backward(prepared.action.module, prepared.last)
                    self._compute(step, prepared)
                    if prepared.last:
                        finished.append(prepared.action.module)
                else:
                    self._compute(step, prepared)
            except PipelineError:
                raise
            except Exception as err:  # this rank's own failure: the root cause its peers will name
                self.failures.publish_exception(err, prepared.first_microbatch)
                raise
        self._start_sums(finished)
        try:
            self.comm.finish_step()
        except ExchangeMismatchError as err:  # the messages themselves were wrong: the root cause
            self.failures.publish_exception(err, None)
            raise
        except RuntimeError as err:  # a send still in flight failed: a peer failed, died or timed out
            peers = {t.peer for a in actions if isinstance(a, Exchange) for t in a.sends}
            raise self.failures.transport_failure(err, peers) from err
        assert not step.posted, f"receives posted and never consumed: {step.posted}"
        assert not step.received and not step.out_grads and not step.losses and not step.pieces, "stash not drained"
        return step.result

    def _post_ahead(self, step: "_StepState", receives: _Receives, position: int) -> None:
        """Post ahead the receives of the exchanges ``position`` .. ``position + receive_ahead``
        (ordinals), in schedule order, up to the first the communicator does not take ahead (the
        receives from a peer must be posted in the order of its sends); the rest are posted by
        their own exchanges, or ahead after a take made them plannable (a forward receive whose
        channel's earlier message is taken: it may have brought a new spec)."""
        limit = position + self.receive_ahead
        step.ahead_position, step.ahead_refused = position, False
        while step.ahead_cursor < len(receives):
            ordinal, consumer, key, peer = receives[step.ahead_cursor]
            if ordinal < position:  # its own exchange ran (and posted it, if it was not ahead)
                step.ahead_cursor += 1
                continue
            if ordinal >= limit:
                return
            try:
                posted = self.comm.post_ahead(key)
            except RuntimeError as err:
                raise self.failures.transport_failure(err, {peer}, key.microbatch) from err
            if not posted:
                step.ahead_refused = True
                return
            step.ahead.add(key)
            step.posted.setdefault(consumer, {})[key] = peer
            if self.tracer.enabled:
                step.posted_ns[key] = time.time_ns()
            step.ahead_cursor += 1

    def _start_sums(self, finished: list[str]) -> None:
        """Start the gradient sums of the ``finished`` modules (and empty the list)."""
        for module in finished:
            self.gradient_sync.after_last_backward(module)
        finished.clear()

    def _prepared(self, schedule: Schedule) -> "_Program":
        """This rank's actions of ``schedule`` lowered once (see :class:`_Program`), reused by
        every step that runs the same schedule object (the engine keeps one per kind of step and
        microbatch count)."""
        cached = self._programs.get(id(schedule))
        if cached is not None and cached[0] is schedule:
            return cached[1]
        lead = self.layout.tp_lead(self.rank)
        program = _Program.lower(schedule.for_rank(lead), lead)  # a tp group runs its lead's
        if len(self._programs) >= 16:  # schedules of past microbatch counts: keep a few
            self._programs.pop(next(iter(self._programs)))
        self._programs[id(schedule)] = (schedule, program)
        return program

    def _compute(self, step: "_StepState", prepared: "_PreparedCompute") -> None:
        action = prepared.action
        stage = self.stages[action.unit]
        k = action.microbatch
        # the receives this compute consumes, before its span: the trace shows waiting apart
        # from computing
        self._take(step, prepared.consumes)
        with self.tracer.span(PHASE_SPANS[action.phase], action.module, microbatch=k, stage=stage.stage):
            if action.phase is Phase.FORWARD:
                self._forward(step, stage, k)
            elif action.phase is Phase.BACKWARD_INPUT:
                self._backward_input(step, stage, k)
            elif action.phase is Phase.BACKWARD_WEIGHT and (*stage.unit, k) in step.pieces:
                self._backward_weight(step, stage, k)
            else:  # a fused B, or a lone W (a stage whose inputs need no gradient)
                self._backward(step, stage, k)

    def _exchange(self, step: "_StepState", prepared: "_PreparedExchange") -> None:
        sends = self._collect_sends(step, prepared.send_keys)
        recv_keys = prepared.recv_keys
        if step.ahead:
            recv_keys = tuple(key for key in recv_keys if key not in step.ahead)
        with self.tracer.span("exchange", "comm", sends=len(sends), recvs=len(recv_keys)):
            try:
                if self.overlap:
                    self.comm.post(sends, recv_keys)
                else:
                    got = self.comm.exchange(sends, recv_keys)
            except RuntimeError as err:  # a peer failed, died or timed out: name the root cause
                raise self.failures.transport_failure(err, prepared.peers, prepared.first_microbatch) from err
        if self.overlap:
            for consumer, key, peer in prepared.consumers:
                if key not in step.ahead:
                    step.posted.setdefault(consumer, {})[key] = peer
            if self.tracer.enabled:
                now = time.time_ns()
                step.posted_ns.update((key, now) for key in recv_keys)
            return
        for key, payload in got.items():
            self._store(step, key, payload)

    @staticmethod
    def _store(step: "_StepState", key: MessageKey, payload: Any) -> None:
        if key.direction is Direction.FORWARD:
            step.received.setdefault((*key.consumer, key.microbatch), {})[key.src_module] = payload
        else:
            step.out_grads.setdefault((*key.producer, key.microbatch), {})[key.dst_module] = payload

    def _take(self, step: "_StepState", consumer: _Consumer) -> None:
        """Wait for the receives posted for ``(module, chunk, k, direction)`` (overlap mode)."""
        keys = step.posted.pop(consumer, None)
        if not keys:
            return
        with self.tracer.span("wait", "comm", microbatch=consumer[2]):
            for key, peer in keys.items():
                try:
                    payload = self.comm.take(key)
                except RuntimeError as err:
                    raise self.failures.transport_failure(err, {peer}, key.microbatch) from err
                self._store(step, key, payload)
                if self.tracer.enabled:  # the receive's life: posted -> in the consumer's hands
                    self.tracer.record("recv", "transfer", step.posted_ns.pop(key), time.time_ns(), track=1,
                                       peer=peer, microbatch=key.microbatch, src=key.src_module, dst=key.dst_module,
                                       direction=key.direction.name.lower())
        if step.ahead_refused:
            self._post_ahead(step, step.receives, step.ahead_position)

    def _forward(self, step: "_StepState", stage: StageExecutor, k: int) -> None:
        module, unit = stage.module, (*stage.unit, k)
        inputs = step.received.get(unit, {})
        if stage.stage == 0:
            upstream = {u: inputs[u] for u in self.layout.topology.upstream(module)}
            x = self.hooks.pipeline_inputs(module, step.shard(module, k), upstream)
        else:
            x = inputs[module]
        trained = step.training and module not in self.no_backward_modules
        out, pieces = stage.forward(x, track_grad=trained, split=stage.unit in step.split)
        loss_stage = stage.unit in self.loss_stages
        if loss_stage and step.keep_sink_outputs:
            step.result.sink_outputs.setdefault(k, {})[module] = out
        if loss_stage and step.compute_loss:
            returned = self.pipeline_loss(module, out, step.shard(module, k))
            scale = 1.0 / (step.num_microbatches * self.layout.placements[module].dp)
            if is_token_loss(returned):
                if self.multiple_sinks:
                    raise PipelineConfigError(
                        f"pipeline_loss for sink {module!r} returned the per-token form, which needs a single sink "
                        f"(this model has {sorted(self.layout.topology.sinks)}); return a mean loss per microbatch instead."
                    )
                loss, sums, metrics = _token_loss_and_metrics(returned, module)
                step.result.sink_losses[(module, k)] = loss.detach()
                if step.training:
                    step.losses[unit] = loss  # unscaled: gradients are divided by the global count
                for name, value in sums.items():
                    step.result.token_sums[name] = step.result.token_sums.get(name, 0) + value
                self._accumulate(step.result, module, None, metrics, scale)
            else:
                loss, metrics = _loss_and_metrics(returned, module)
                step.result.sink_losses[(module, k)] = loss.detach()
                if step.training:
                    step.losses[unit] = loss * scale
                self._accumulate(step.result, module, loss, metrics, scale)
        if trained:
            step.outputs[unit] = out  # stashed until its backward
            if pieces is not None:
                step.pieces[unit] = pieces
            step.stashed += 1
            step.result.peak_stashed = max(step.result.peak_stashed, step.stashed)
            self._set_stash_bytes(step, unit, (out, inputs))
            return
        step.received.pop(unit, None)
        if not loss_stage:
            step.outputs[unit] = out  # freed once sent

    def _output_grads(self, step: "_StepState", unit: "_Unit") -> tuple[list[Any], list[Any]]:
        """The stage output's leaves and their gradients (summed over consumers), aligned."""
        out = step.outputs.pop(unit)
        out_leaves = [out] if isinstance(out, Tensor) else tree_flatten(out)[0]
        grad: Optional[Any] = None
        for g in step.out_grads.pop(unit, {}).values():
            grad = g if grad is None else _add_payloads(grad, g)
        if grad is None:
            grad_leaves: list[Any] = [None] * len(out_leaves)
        else:
            grad_leaves = [grad] if isinstance(grad, Tensor) else tree_flatten(grad)[0]
        return out_leaves, grad_leaves

    def _backward(self, step: "_StepState", stage: StageExecutor, k: int) -> None:
        unit = (*stage.unit, k)
        if stage.unit in self.loss_stages:
            step.outputs.pop(unit, None)
            loss = step.losses.pop(unit)
            stage.backward([loss] if loss.requires_grad else [], [None])
        else:
            stage.backward(*_with_grads(*self._output_grads(step, unit)))
        self._collect_input_grads(step, unit)
        self._release(step, unit)

    def _backward_input(self, step: "_StepState", stage: StageExecutor, k: int) -> None:
        unit = (*stage.unit, k)
        pieces = step.pieces[unit]
        if stage.unit in self.loss_stages:
            step.outputs.pop(unit, None)
            grads = _loss_grads(step.losses.pop(unit), pieces[-1].outputs)
        else:
            _, grads = self._output_grads(step, unit)
        received = [
            t for src, payload in step.received.get(unit, {}).items() if src not in self.no_backward_modules
            for t in tree_flatten(payload)[0] if isinstance(t, Tensor) and t.requires_grad
        ]
        kept = stage.backward_input(pieces, grads, received)
        self._collect_input_grads(step, unit)
        self._set_stash_bytes(step, unit, kept)

    def _backward_weight(self, step: "_StepState", stage: StageExecutor, k: int) -> None:
        unit = (*stage.unit, k)
        stage.backward_weight(step.pieces.pop(unit))
        self._release(step, unit)

    def _collect_input_grads(self, step: "_StepState", unit: "_Unit") -> None:
        """Take the gradients of the received inputs, to send to the producers that want them."""
        inputs = step.received.pop(unit, {})
        grads = {src: _grad_payload(p) for src, p in inputs.items() if src not in self.no_backward_modules}
        if grads:
            step.in_grads[unit] = grads

    def _set_stash_bytes(self, step: "_StepState", unit: "_Unit", held: Any) -> None:
        step.stash_bytes[unit] = _payload_bytes(held)
        step.result.peak_stashed_bytes = max(step.result.peak_stashed_bytes, sum(step.stash_bytes.values()))

    def _release(self, step: "_StepState", unit: "_Unit") -> None:
        """The last backward piece of ``(module, chunk, k)`` ran: it holds nothing any more."""
        step.stashed -= 1
        step.stash_bytes.pop(unit, None)

    def _collect_sends(self, step: "_StepState", keys: Sequence[MessageKey]) -> dict[MessageKey, Any]:
        sends: dict[MessageKey, Any] = {}
        for key in keys:  # distinct
            if key.direction is Direction.FORWARD:
                sends[key] = step.outputs[(*key.producer, key.microbatch)]
            else:
                sends[key] = step.in_grads[(*key.consumer, key.microbatch)][key.src_module]
        for key in sends:
            if key.direction is Direction.FORWARD and (not step.training or key.src_module in self.no_backward_modules):
                # not stashed for a backward: an output is dropped once its consumers have it
                step.outputs.pop((*key.producer, key.microbatch), None)
            elif key.direction is Direction.BACKWARD:
                pending = step.in_grads[(*key.consumer, key.microbatch)]
                pending.pop(key.src_module, None)
                if not pending:
                    del step.in_grads[(*key.consumer, key.microbatch)]
        return sends

    def _accumulate(
        self, result: StepResult, module: str, loss: Optional[Tensor], metrics: dict[str, Tensor], scale: float
    ) -> None:
        prefix = f"{module}_" if self.multiple_sinks else ""
        values = {f"{prefix}{n}": v for n, v in metrics.items()}
        if loss is not None:
            values["loss"] = loss
        for name, value in values.items():
            share = value.detach().float() * scale
            result.metric_sums[name] = result.metric_sums[name] + share if name in result.metric_sums else share


def _consumer(key: MessageKey) -> _Consumer:
    """The compute that needs a received message, ``(module, chunk, k, direction)``: the forward
    of its destination stage, or the backward of its source stage (the gradient of its output)."""
    module, chunk = key.consumer if key.direction is Direction.FORWARD else key.producer
    return (module, chunk, key.microbatch, key.direction)


_Unit = tuple[str, int, int]  # (module, chunk, microbatch): one microbatch on one of the rank's stages
_Consumer = tuple[str, int, int, Direction]  # (module, chunk, microbatch, direction): a compute taking receives
# a program's receives in schedule order: (exchange ordinal, consumer, key, peer)
_Receives = tuple[tuple[int, _Consumer, MessageKey, int], ...]


@dataclass(frozen=True)
class _PreparedExchange:
    """An :class:`Exchange` with what the runtime derives from it resolved once."""

    action: Exchange
    send_keys: tuple[MessageKey, ...]  # distinct, in order
    recv_keys: tuple[MessageKey, ...]  # distinct, in order
    consumers: tuple[tuple[_Consumer, MessageKey, int], ...]  # (consumer, key, peer)
    peers: frozenset[int]  # every rank it talks to (named when a transfer fails)
    first_microbatch: int  # the lowest microbatch it carries (failure reports)
    ordinal: int  # its position among the rank's exchanges


@dataclass(frozen=True)
class _PreparedCompute:
    """A :class:`Compute` with what the runtime derives from it resolved once."""

    action: Compute
    consumes: _Consumer  # the posted receives it takes first: (module, chunk, k, direction)
    gradient: bool  # a fused B or a W: produces parameter gradients
    last: bool  # the last such backward of its module in the step
    first_microbatch: int


@dataclass(frozen=True)
class _Program:
    """One rank's action list of a schedule, lowered once: per action the keys, consumers and
    peers it needs, which backward completes each module's gradients, and which stages split
    their backward. Peers, tags, buffers and specs live in the communicator, which resolves
    them once per channel (and again when a channel's spec changes)."""

    actions: tuple[Any, ...]
    steps: tuple[Any, ...]  # a _PreparedExchange or _PreparedCompute per action
    split: frozenset[tuple[str, int]]  # (module, chunk) stages whose backward runs as I then W
    # every key received from another rank, in schedule order: (its exchange's ordinal, consumer,
    # key, its first remote peer)
    receives: _Receives

    @classmethod
    def lower(cls, actions: Sequence[Any], rank: int) -> "_Program":
        """Lower ``rank``'s ``actions``."""
        gradient_phases = (Phase.BACKWARD, Phase.BACKWARD_WEIGHT)
        # the action after which a module's parameter gradients (over all its chunks) are complete
        last_gradient = {a.module: index for index, a in enumerate(actions)
                         if isinstance(a, Compute) and a.phase in gradient_phases}
        steps: list[Any] = []
        receives: list[tuple[int, _Consumer, MessageKey, int]] = []
        ordinal = 0
        for index, action in enumerate(actions):
            if isinstance(action, Exchange):
                transfers = action.sends + action.recvs
                consumers = tuple((_consumer(t.key), t.key, t.peer) for t in action.recvs)
                steps.append(_PreparedExchange(
                    action, tuple(dict.fromkeys(t.key for t in action.sends)),
                    tuple(dict.fromkeys(t.key for t in action.recvs)), consumers,
                    frozenset(t.peer for t in transfers), min((t.microbatch for t in transfers), default=0), ordinal,
                ))
                # one entry per key received from another rank (posted ahead, a key's peers go
                # at once; one from this rank only, a colocated module's, has nothing to post),
                # in key order: the order the sender posts an exchange's messages to one peer
                # in, which receives posted ahead one by one must follow (see comm.post_ahead)
                remote = {key: (ordinal, consumer, key, peer) for consumer, key, peer in reversed(consumers)
                          if peer != rank}
                receives.extend(remote[key] for key in sorted(remote))
                ordinal += 1
            else:
                direction = Direction.FORWARD if action.phase is Phase.FORWARD else Direction.BACKWARD
                gradient = action.phase in gradient_phases
                steps.append(_PreparedCompute(
                    action, (*action.unit, action.microbatch, direction), gradient,
                    gradient and last_gradient[action.module] == index, action.microbatch,
                ))
        split = frozenset(a.unit for a in actions if isinstance(a, Compute) and a.phase is Phase.BACKWARD_INPUT)
        return cls(tuple(actions), tuple(steps), split, tuple(receives))


@dataclass
class _StepState:
    """Everything one step holds between actions; emptied as backwards run."""

    num_microbatches: int
    training: bool
    shard: Callable[[str, int], Any]
    keep_sink_outputs: bool
    compute_loss: bool
    split: frozenset[tuple[str, int]]  # (module, chunk) stages whose backward runs as I then W in this schedule
    receives: _Receives  # the program's receives, for posting ahead
    result: StepResult = field(default_factory=StepResult)
    stashed: int = 0
    # every key below names one microbatch on one stage: (module, chunk, k)
    stash_bytes: dict[_Unit, int] = field(default_factory=dict)           # -> bytes held
    received: dict[_Unit, dict[str, Any]] = field(default_factory=dict)   # (dst, chunk, k) -> {src: payload}
    outputs: dict[_Unit, Any] = field(default_factory=dict)               # -> output
    losses: dict[_Unit, Tensor] = field(default_factory=dict)             # (sink, chunk, k) -> scaled loss
    out_grads: dict[_Unit, dict[str, Any]] = field(default_factory=dict)  # -> {consumer: grad}
    in_grads: dict[_Unit, dict[str, Any]] = field(default_factory=dict)   # -> {producer: grad}
    # receives posted and not taken yet: (consumer module, chunk, k, direction) -> {key: peer}
    posted: dict[_Consumer, dict[MessageKey, int]] = field(default_factory=dict)
    posted_ns: dict[MessageKey, int] = field(default_factory=dict)  # when each receive was posted (tracing)
    ahead: set[MessageKey] = field(default_factory=set)  # receives posted ahead of their exchange
    ahead_cursor: int = 0  # the next entry of the program's receives to consider posting ahead
    # the exchange (ordinal) the last posting ahead started from, and whether it stopped at a
    # receive the communicator refused (a take may lift that: tried again after each take)
    ahead_position: int = 0
    ahead_refused: bool = False
    pieces: dict[_Unit, list[_LayerPiece]] = field(default_factory=dict)  # -> split graph
