"""Tensor parallelism (ModulePlacement(tp)): equivalence with one process, the relay, errors."""

from __future__ import annotations

import pytest

from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy
from lightning_mmpp.errors import PipelineConfigError
from tests.dist import require_ranks, run_distributed
from tests.models import MultiModalModel, TensorParallelModel
from tests.test_equivalence import _check, _pipelined, _reference

pytestmark = pytest.mark.distributed

P = ModulePlacement
LM = {"llm": []}
ONE_ENC = {"enc_a": ["llm"], "llm": []}

# id: (topology, placements, num_microbatches, batch size, schedules)
TP_LAYOUTS = {
    "llm_tp2_pp2": (LM, {"llm": P(pp=2, tp=2)}, 4, 8, ("1f1b", "zero_bubble")),
    "enc_dp2-llm_tp2": (ONE_ENC, {"enc_a": P(dp=2), "llm": P(tp=2)}, 4, 8, ("1f1b", "zero_bubble")),
    "enc_tp2-llm_tp2_pp2": (ONE_ENC, {"enc_a": P(tp=2), "llm": P(pp=2, tp=2)}, 2, 8, ("1f1b", "zero_bubble")),
    "llm_tp2_dp2_shard": (LM, {"llm": P(dp=2, tp=2, shard=True)}, 2, 8, ("1f1b",)),
    "enc-llm_tp2_dp2": (ONE_ENC, {"enc_a": P(), "llm": P(dp=2, tp=2)}, 2, 8, ("1f1b", "zero_bubble")),
}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("layout", list(TP_LAYOUTS))
def test_tensor_parallel_matches_single_process(layout):
    """SGD with momentum and global-norm clipping (shards of split parameters counted on every
    tp rank, replicated ones once per group), against one process without tensor parallelism.

    Not Adam: a row-parallel layer sums its partial products in another order than one process,
    and Adam divides each element's gradient by its own magnitude, so an element whose exact
    gradient is about zero turns that rounding into a full-size step."""
    topology, placements, m, batch_size, schedules = TP_LAYOUTS[layout]
    world = MultiModulePipelineStrategy(placements, topology, m).layout.world_size
    require_ranks(world)
    reference = _reference(topology, batch_size, "sgd", 0.05, model_cls=TensorParallelModel)
    per_rank = run_distributed(_pipelined, world, topology, placements, m, batch_size, "sgd", 0.05, schedules, (),
                               False, TensorParallelModel, timeout=400, init_pg=False)
    _check(per_rank, reference, schedules)


def _construct(rank, world, model_cls, placements, topology, heads=None):
    import lightning as L

    from tests.models import make_loader
    from tests.test_equivalence import _trainer_kwargs

    model = model_cls(topology) if heads is None else model_cls(topology, heads=heads)
    strategy = MultiModulePipelineStrategy(placements, topology, num_microbatches=2)
    trainer = L.Trainer(**_trainer_kwargs(world, 1), strategy=strategy)
    try:
        trainer.fit(model, make_loader(topology, 4, 4))
    except PipelineConfigError as err:
        return str(err)
    return None


@pytest.mark.timeout(120)
def test_tensor_parallel_errors_on_every_rank():
    """A model without the hook, and heads that tp does not divide, fail on every rank."""
    require_ranks(2)
    missing = run_distributed(_construct, 2, MultiModalModel, {"llm": P(tp=2)}, LM, timeout=90, init_pg=False)
    assert all("pipeline_parallelize" in m for m in missing), missing
    heads = run_distributed(_construct, 2, TensorParallelModel, {"llm": P(tp=2)}, LM, 3, timeout=90, init_pg=False)
    assert all("do not split over tp=2" in m for m in heads), heads
