"""StageGradients: bucketed all-reduces launched during a stage's last backward of the step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_mmpp.engine.data_parallel import StageGradients
from tests.dist import run_distributed

pytestmark = pytest.mark.distributed

LAYER_BYTES = (8 * 8 + 8) * 4  # one Linear(8, 8): weight and bias, fp32


def _buckets(rank: int, world: int) -> dict:
    torch.manual_seed(0)  # the same model on both replicas
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)), nn.Linear(8, 8))
    unused = model[4]  # gets no gradient: its bucket, and those after it, launch after the backward
    params = [p for layer in model for p in layer.parameters()]
    group = dist.new_group([0, 1])
    grads = StageGradients({"m": (group, params)}, params, params, world, bucket_bytes=LAYER_BYTES, launch_in_backward=True)
    reduction = grads.reductions["m"]
    out: dict = {"buckets": [len(b.params) for b in reduction.buckets]}
    torch.manual_seed(10 + rank)  # different data per replica
    launched = []
    for last in (False, False, True):
        x = torch.randn(4, 8)
        grads.before_backward("m", last)
        model[:4](x).square().sum().backward()
        launched.append(reduction.launched)
        if last:
            grads.after_last_backward("m")
    out["launched_during_backward"] = launched
    local = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    out["calls"] = grads.synchronize()
    everyone: list = [None, None]
    dist.all_gather_object(everyone, local)
    out["exact"] = all(torch.allclose(p.grad, everyone[0][n] + everyone[1][n], rtol=0, atol=1e-6)
                       for n, p in model.named_parameters() if p.grad is not None)
    out["unused_grad"] = unused.weight.grad is None
    # a second step starts from scratch; and after close() no hook fires any more
    for p in params:
        p.grad = None
    grads.before_backward("m", True)
    model[:4](torch.randn(4, 8)).sum().backward()
    grads.after_last_backward("m")
    out["second_calls"] = grads.synchronize()
    grads.close()
    grads.before_backward("m", True)
    model[:4](torch.randn(4, 8)).sum().backward()
    out["after_close"] = reduction.launched
    return out


@pytest.mark.timeout(60)
def test_buckets_launch_in_order_during_the_last_backward():
    for out in run_distributed(_buckets, 2, timeout=60):
        # five layers in reverse order, one bucket each (the unused last layer first)
        assert out["buckets"] == [2, 2, 2, 2, 2], out
        # nothing in the earlier backwards; in the last one the unused layer's bucket (first in
        # order) holds the rest back until the backward has ended
        assert out["launched_during_backward"] == [0, 0, 0], out
        assert out["calls"] == 4 and out["exact"] and out["unused_grad"], out
        assert out["second_calls"] == 4 and out["after_close"] == 0, out


def _in_flight(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    params = list(model.parameters())
    group = dist.new_group([0, 1])
    grads = StageGradients({"m": (group, params)}, params, params, world, bucket_bytes=LAYER_BYTES, launch_in_backward=True)
    reduction = grads.reductions["m"]
    seen = []
    # the first layer's backward runs last: by then the later layers' buckets are launched
    model[0].register_full_backward_hook(lambda *_: seen.append(reduction.launched))
    torch.manual_seed(10 + rank)
    grads.before_backward("m", True)
    model(torch.randn(4, 8, requires_grad=True)).square().sum().backward()
    grads.after_last_backward("m")
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads.synchronize()
    everyone: list = [None, None]
    dist.all_gather_object(everyone, expected)
    exact = all(torch.allclose(p.grad, everyone[0][n] + everyone[1][n], rtol=0, atol=1e-6)
                for n, p in model.named_parameters())
    return {"seen": seen, "exact": exact}


@pytest.mark.timeout(60)
def test_later_layers_are_summed_while_the_first_layer_computes_its_backward():
    for out in run_distributed(_in_flight, 2, timeout=60):
        assert out["seen"] and out["seen"][0] >= 3, out  # layers 3, 2, 1 launched before layer 0's backward
        assert out["exact"], out


def _empty_first(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    # each dtype's first parameter in bucket order (the last defined) has no elements
    linear = nn.Linear(4, 4)
    double = nn.Parameter(torch.randn(3, dtype=torch.float64))
    params = [linear.weight, linear.bias, nn.Parameter(torch.empty(0)), double,
              nn.Parameter(torch.empty(0, dtype=torch.float64))]
    group = dist.new_group([0, 1])
    grads = StageGradients({"m": (group, params)}, params, params, world, bucket_bytes=LAYER_BYTES)
    reduction = grads.reductions["m"]
    dtypes = [{p.dtype for p in b.params} for b in reduction.buckets]
    torch.manual_seed(10 + rank)
    grads.before_backward("m", True)
    (linear(torch.randn(2, 4)).square().sum() + (double * double).sum() + params[2].sum() + params[4].sum()).backward()
    grads.after_last_backward("m")
    local = [p.grad.clone() for p in params]
    calls = grads.synchronize()
    everyone: list = [None, None]
    dist.all_gather_object(everyone, local)
    exact = all(torch.allclose(p.grad, everyone[0][i] + everyone[1][i], rtol=0, atol=1e-6) for i, p in enumerate(params))
    return {"dtypes": dtypes, "calls": calls, "exact": exact}


@pytest.mark.timeout(60)
def test_a_dtype_whose_first_parameter_has_no_elements_gets_a_bucket_of_its_own():
    for out in run_distributed(_empty_first, 2, timeout=60):
        assert out["dtypes"] == [{torch.float32}, {torch.float64}], out
        assert out["calls"] == 2 and out["exact"], out
