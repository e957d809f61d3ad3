"""PipelineEngine without Lightning: construction agrees on initial weights, one step of every kind."""

from __future__ import annotations

import pytest
import torch

from lightning_mmpp import ModulePlacement as P
from lightning_mmpp import PipelineConfigError, PipelineEngine, PipelineLayout, StepKind
from tests.dist import rank_device, require_ranks, run_distributed
from tests.models import MultiModalModel, make_loader

TOPOLOGY = {"enc_a": ["llm"], "llm": []}


def _replicas_built_apart(rank: int, world: int) -> dict:
    model = MultiModalModel(TOPOLOGY)  # seeds itself: draw each rank's own weights on top
    torch.manual_seed(100 + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    layout = PipelineLayout({"enc_a": P(dp=2), "llm": P(pp=2, dp=2)}, TOPOLOGY)
    engine = PipelineEngine(model, layout, num_microbatches=2, device=rank_device(rank))
    initial = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if id(p) in
               {id(q) for q in engine.parameters()}}
    optimizer = torch.optim.SGD(engine.parameters(), lr=0.1)
    batch = next(iter(make_loader(TOPOLOGY, 8, 8)))
    order: list[str] = []  # the metric all-reduce is in flight while the dp sums are waited for
    for owner, name in ((engine.metrics, "start"), (engine.gradients, "synchronize"), (engine.metrics, "finish")):
        def record(*args, _inner=getattr(owner, name), _name=name, **kwargs):
            order.append(_name)
            return _inner(*args, **kwargs)
        setattr(owner, name, record)
    out = engine.step(batch, agreement=[float(rank == 3), 2.0])  # summed in the metric all-reduce
    optimizer.step()
    calls: list[str] = []  # a callable agreement is read after this rank's pipeline
    run_pipeline = engine.run_pipeline
    engine.run_pipeline = lambda *a, **k: calls.append("pipeline") or run_pipeline(*a, **k)
    evaluated = engine.step(batch, "val", agreement=lambda: calls.append("agreement") or [float(rank)])
    engine.run_pipeline = run_pipeline
    predicted = engine.step(batch, StepKind.PREDICT)
    final = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if n in initial}
    engine.close()
    return {"initial": initial, "final": final, "loss": float(out.loss), "val": float(evaluated.loss),
            "agreement": (out.agreement, evaluated.agreement), "order": order, "calls": calls,
            "predicted": None if predicted.predictions is None else tuple(predicted.predictions.shape)}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_dp_replicas_start_equal_and_every_step_kind_runs():
    require_ranks(6)
    per_rank = run_distributed(_replicas_built_apart, 6, timeout=100)
    replicas = {0: [0, 1], 2: [2, 3], 4: [4, 5]}  # enc_a dp=2; llm stage 0 dp=2; llm stage 1 dp=2
    for first, group in replicas.items():
        for rank in group[1:]:
            for name, value in per_rank[rank]["initial"].items():
                assert torch.equal(value, per_rank[first]["initial"][name]), (rank, name)
                assert torch.equal(per_rank[rank]["final"][name], per_rank[first]["final"][name]), (rank, name)
    assert len({r["loss"] for r in per_rank}) == 1 and len({r["val"] for r in per_rank}) == 1
    assert {r["predicted"] for r in per_rank} == {(8, 3, 11)}  # the sink output of the whole batch, everywhere
    assert [r["agreement"] for r in per_rank] == [((1.0, 12.0), (15.0,))] * 6  # summed over the world
    assert [r["calls"] for r in per_rank] == [["pipeline", "agreement"]] * 6
    # train step: metrics launched, dp sums waited for, metrics read; then val and predict (no dp sums)
    assert all(r["order"][:3] == ["start", "synchronize", "finish"] for r in per_rank)


def test_engine_errors_name_the_fix():
    layout = PipelineLayout({"enc_a": P(), "llm": P(pp=2)}, TOPOLOGY)  # 3 ranks, no process group
    with pytest.raises(PipelineConfigError, match="need 3 ranks"):
        PipelineEngine(MultiModalModel(TOPOLOGY), layout, 2)
    colocated = PipelineLayout({"enc_a": P(rank_offset=0), "llm": P(rank_offset=0)}, TOPOLOGY)
    with pytest.raises(PipelineConfigError, match="schedule"):
        PipelineEngine(MultiModalModel(TOPOLOGY), colocated, 2, schedule="zb")
    with pytest.raises(PipelineConfigError, match="not placed modules"):
        PipelineEngine(MultiModalModel(TOPOLOGY), colocated, 2, pretrained={"vision": "x.safetensors"})
    engine = PipelineEngine(MultiModalModel(TOPOLOGY), colocated, 2)
    with pytest.raises(PipelineConfigError, match="step kind"):
        engine.step(next(iter(make_loader(TOPOLOGY, 4, 4))), "eval")
    engine.close()


def _static_train_eval_train(rank: int, world: int) -> tuple[float, float, float]:
    layout = PipelineLayout({"enc_a": P(), "llm": P(pp=2)}, TOPOLOGY)
    engine = PipelineEngine(MultiModalModel(TOPOLOGY), layout, 2, static_shapes=True, device=rank_device(rank))
    batch = next(iter(make_loader(TOPOLOGY, 8, 8)))
    first = float(engine.step(batch).loss)
    with torch.no_grad():  # activations without requires_grad: other specs than training's
        evaluated = float(engine.step(batch, "val").loss)
    again = float(engine.step(batch).loss)
    engine.close()
    return first, evaluated, again


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_static_shapes_hold_per_kind_of_step():
    """``static_shapes=True`` promises fixed shapes per kind of step: an evaluation step between
    training steps (no grad: its activations do not require grad) keeps its own channel specs."""
    require_ranks(3)
    per_rank = run_distributed(_static_train_eval_train, 3, timeout=100)
    assert len(set(per_rank)) == 1 and per_rank[0][0] == per_rank[0][1] == per_rank[0][2], per_rank


def test_a_gradient_sum_starts_before_the_next_compute_where_no_exchange_follows():
    """Three colocated modules on one rank: the encoder whose last backward is followed by the
    other encoder's backward (no exchange in between) starts its sum before that backward, so
    the sum runs beside it instead of after the pipeline."""
    topology = {"enc_a": ["llm"], "enc_b": ["llm"], "llm": []}
    layout = PipelineLayout({name: P(rank_offset=0) for name in topology}, topology)
    engine = PipelineEngine(MultiModalModel(topology), layout, num_microbatches=2)
    events: list[tuple[str, str]] = []
    start_sum, compute = engine.gradients.after_last_backward, engine.runtime._compute

    def record_sum(module: str) -> None:
        events.append(("sum", module))
        start_sum(module)

    def record_compute(step, prepared) -> None:
        compute(step, prepared)
        events.append((prepared.action.phase.name, prepared.action.module))

    engine.gradients.after_last_backward = record_sum
    engine.runtime._compute = record_compute
    engine.step(next(iter(make_loader(topology, 4, 4))))
    engine.close()
    assert sorted(module for kind, module in events if kind == "sum") == sorted(topology)
    last_backward = {module: i for i, (kind, module) in enumerate(events) if kind == "BACKWARD"}
    for module, index in last_backward.items():
        later = events[index + 1:]
        computes_before_sum = [e for e in later[: later.index(("sum", module))] if e[0] != "sum"]
        assert computes_before_sum == [], (module, events)
    first_encoder = min(("enc_a", "enc_b"), key=last_backward.__getitem__)
    assert last_backward[first_encoder] < max(last_backward.values())  # a compute did follow it
