"""StageExecutor: the split backward (I then W) gives exactly the fused backward's gradients
(single process, no communication)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_mmpp.partition import StageRunner
from lightning_mmpp.runtime import StageExecutor


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
