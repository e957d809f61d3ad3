"""The metric reducer: every rank ends a step with the same metric values, summed over the world."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_mmpp.core.kinds import StepKind
from lightning_mmpp.engine.comm import LATER_PARTS_TAG
from lightning_mmpp.engine.metrics import DIRECT_SUM_MAX_WORLD, METRIC_SUM_TAG, MetricReducer
from tests.dist import TEST_DEVICE, rank_device, run_distributed

# per rank: values whose float32 sum depends on the order of the additions
_SHARES = [1e8, 1.0, -1e8, 1e-3]


def _reduce_steps(rank: int, world: int, direct: bool) -> dict:
    device = rank_device(rank)
    reducer = MetricReducer(world, device)
    reducer.direct = reducer.direct and direct
    out: dict = {"direct": reducer.direct, "steps": []}
    # a pipeline message of the communicator's tags in flight beside the sum (rank 0 -> 1)
    beside = torch.full((3,), float(rank), device=device)
    for step in range(3):
        local = {"loss": torch.tensor(_SHARES[rank], device=device),
                 "acc": torch.tensor(float(rank + step), device=device)}
        if step == 2 and rank == 3:  # a name the others never heard of: gathered, reduced again
            local["late"] = torch.tensor(5.0, device=device)
        work = None
        if world > 1 and device.type == "cpu" and rank in (0, 1):
            work = (dist.isend(beside, 1, tag=LATER_PARTS_TAG) if rank == 0
                    else dist.irecv(beside, 0, tag=LATER_PARTS_TAG))
        pending = reducer.start(local, StepKind.TRAIN, extra=[float(rank == step), 1.0])
        metrics, extra = reducer.finish(pending)
        if work is not None:
            work.wait()
        out["steps"].append(({n: v.item() for n, v in metrics.items()}, extra,
                             {n: v.cpu().numpy().tobytes() for n, v in metrics.items()}))
    out["beside"] = beside.tolist()
    return out


def _expected(step: int, world: int) -> dict[str, float]:
    loss = torch.tensor(0.0)
    for share in _SHARES[:world]:
        loss = loss + torch.tensor(share, dtype=torch.float32)
    expected = {"loss": loss.item(), "acc": float(sum(r + step for r in range(world)))}
    if step == 2:
        expected["late"] = 5.0
    return expected


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("direct", [True, False], ids=["one-message-per-pair", "all_reduce"])
def test_metrics_summed_identically_on_every_rank(direct):
    world = 4
    results = run_distributed(_reduce_steps, world, direct)
    assert all(r["direct"] == (direct and TEST_DEVICE == "cpu") for r in results)
    for step in range(3):
        metrics, extra, raw = results[0]["steps"][step]
        # one message per pair adds in rank order (exactly _expected); gloo's all_reduce in its own
        # order, which may keep the 1.0 that rank order rounds away next to 1e8
        assert metrics == pytest.approx(_expected(step, world), abs=1e-6 if direct else 1.01)
        assert extra == [1.0, float(world)]  # exactly one rank has rank == step
        for other in results[1:]:  # bitwise the same everywhere
            assert other["steps"][step][2] == raw
            assert other["steps"][step][1] == extra
    if TEST_DEVICE == "cpu":
        assert results[1]["beside"] == [0.0, 0.0, 0.0]  # the communicator's message arrived intact


def test_metric_sum_tag_is_not_a_communicator_tag():
    assert METRIC_SUM_TAG not in (0, LATER_PARTS_TAG)


def test_one_message_per_pair_only_on_cpu_and_small_worlds():
    cpu = torch.device("cpu")
    assert MetricReducer(4, cpu).direct
    assert not MetricReducer(1, cpu).direct
    assert not MetricReducer(DIRECT_SUM_MAX_WORLD + 1, cpu).direct
    assert not MetricReducer(4, torch.device("cuda", 0)).direct
