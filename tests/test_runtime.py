"""StageExecutor: the split backward (I then W) gives exactly the fused backward's gradients
(single process, no communication)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_mmpp.model.partition import StageRunner
from lightning_mmpp.engine.runtime import StageExecutor


class DictLayer(nn.Module):
    """dict in, dict out; passes ``skip`` through untouched and ``ids`` (int64) along."""

    def __init__(self, shared: nn.Linear | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.shared = shared

    def forward(self, x: dict) -> dict:
        h = torch.tanh(self.lin(x["h"]))
        if self.shared is not None:
            h = h + self.shared(x["skip"])
        return {"h": h, "skip": x["skip"], "ids": x["ids"]}


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    frozen = DictLayer()
    frozen.requires_grad_(False)  # a frozen layer between trained ones
    return [DictLayer(shared), frozen, DictLayer(shared), DictLayer()]


def _inputs() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "h": torch.randn(3, 4, generator=g).requires_grad_(),
        "skip": torch.randn(3, 4, generator=g).requires_grad_(),
        "ids": torch.arange(3),
    }


def _grads(split: bool) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    layers = _layers()
    runner = StageRunner("m", 0, layers, [str(i) for i in range(len(layers))])
    stage = StageExecutor(runner)
    x = _inputs()
    out, pieces = stage.forward(x, track_grad=True, split=split)
    g = torch.Generator().manual_seed(2)
    out_leaves = tree_flatten(out)[0]
    out_grads = [torch.randn(t.shape, generator=g) if t.is_floating_point() else None for t in out_leaves]
    if split:
        assert pieces is not None and len(pieces) == 4
        received = [x["h"], x["skip"]]
        stage.backward_input(pieces, out_grads, received)
        assert all(p.grad is None for layer in layers for p in layer.parameters())  # I touches no weight
        input_grads = [x["h"].grad.clone(), x["skip"].grad.clone()]
        stage.backward_weight(pieces)
        assert all(not piece.roots for piece in pieces)  # W frees what it used
    else:
        assert pieces is None
        roots = [t for t, gr in zip(out_leaves, out_grads) if gr is not None]
        stage.backward(roots, [gr for gr in out_grads if gr is not None])
        input_grads = [x["h"].grad.clone(), x["skip"].grad.clone()]
    named = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            named[f"{i}.{name}"] = None if p.grad is None else p.grad.clone()
    return named, input_grads


def test_split_backward_equals_fused():
    fused, fused_inputs = _grads(split=False)
    split, split_inputs = _grads(split=True)
    assert fused.keys() == split.keys()
    for name in fused:
        if fused[name] is None:
            assert split[name] is None, name  # the frozen layer
        else:
            torch.testing.assert_close(split[name], fused[name], rtol=1e-6, atol=1e-7, msg=name)
    for a, b in zip(split_inputs, fused_inputs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_forward_without_grad_builds_no_graph():
    stage = StageExecutor(StageRunner("m", 0, _layers(), ["0", "1", "2", "3"]))
    out, pieces = stage.forward(_inputs(), track_grad=False, split=True)
    assert pieces is None and not out["h"].requires_grad


# --- the whole runtime on one process (colocated modules: the communicator hands over locally) ---


class _Hooks:
    def pipeline_inputs(self, module: str, batch, upstream: dict):
        return batch if not upstream else sum(upstream[name] for name in sorted(upstream))

    def pipeline_loss(self, module: str, output, batch):
        return output.pow(2).mean()


def _colocated_run(schedule_name: str, frozen: frozenset[str] = frozenset()):
    from lightning_mmpp.engine.comm import MultiModuleCommunicator
    from lightning_mmpp.core.placement import ModulePlacement as P
    from lightning_mmpp.core.placement import PipelineLayout
    from lightning_mmpp.engine.runtime import PipelineRuntime
    from lightning_mmpp.core.schedule import build_schedule
    from lightning_mmpp.core.simulator import simulate

    topology = {"enc_a": ["mid"], "enc_b": ["llm"], "mid": ["llm"], "llm": []}
    layout = PipelineLayout({m: P(rank_offset=0) for m in topology}, topology)
    torch.manual_seed(0)
    modules = {m: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)) for m in topology}
    for m in frozen:
        modules[m].requires_grad_(False)
    runners = {m: StageRunner(m, 0, list(seq), ["0", "1", "2"]) for m, seq in modules.items()}
    no_backward = layout.no_backward_modules(frozen)
    comm = MultiModuleCommunicator(layout, 0, torch.device("cpu"))
    runtime = PipelineRuntime(layout, 0, comm, runners, _Hooks(), no_backward_modules=no_backward)
    schedule = build_schedule(layout, 4, schedule_name, no_backward_modules=no_backward)
    data = torch.randn(4, 2, 4, generator=torch.Generator().manual_seed(1))
    result = runtime.run(schedule, lambda module, k: data[k])
    predicted = simulate(schedule, layout).peak_stashed[0]
    grads = {f"{m}.{n}": p.grad for m, seq in modules.items() for n, p in seq.named_parameters()}
    return result, predicted, grads


def test_zero_bubble_runtime_matches_fused_on_one_process():
    reference, _, ref_grads = _colocated_run("1f1b")
    for name in ("gpipe", "zero_bubble"):
        result, predicted, grads = _colocated_run(name)
        assert result.peak_stashed == predicted  # the runtime's count is the simulator's
        torch.testing.assert_close(result.metric_sums["loss"], reference.metric_sums["loss"])
        for key, value in grads.items():
            torch.testing.assert_close(value, ref_grads[key], rtol=1e-6, atol=1e-7, msg=f"{name} {key}")
    # a frozen module in the middle (trainable enc_a upstream) still passes gradients to enc_a
    _, _, fused = _colocated_run("1f1b", frozenset({"mid"}))
    result, predicted, split = _colocated_run("zero_bubble", frozenset({"mid"}))
    assert result.peak_stashed == predicted
    assert split["enc_a.0.weight"] is not None and split["mid.0.weight"] is None
    for key, value in fused.items():
        if value is None:
            assert split[key] is None, key
        else:
            torch.testing.assert_close(split[key], value, rtol=1e-6, atol=1e-7, msg=key)
