"""Virtual stages in the engine: ``interleaved_1f1b`` and ``zbv`` train exactly as one process.

Each rank holds several chunks (stages) of a module: interleaved (chunk ``s`` on position
``s % pp``) or V-shaped for ``zbv`` (the bottom of each V on one rank: a local hand-off). The
matrix covers a chain, a fan-in of two encoders, colocated encoders, a 3-level DAG and a dp
module whose chunks are summed over its group, with Adam and global-norm clipping.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy, PipelineLayout
from lightning_mmpp.model.partition import partition_model
from tests.dist import require_ranks, run_distributed
from tests.models import MultiModalModel
from tests.test_equivalence import CHAIN3, ONE_ENC, TWO_ENC, _check, _pipelined, _reference

P = ModulePlacement
VIRTUAL_SCHEDULES = ("interleaved_1f1b", "zbv")

# id: (topology, placements, num_microbatches, batch_size)
VIRTUAL_LAYOUTS = {
    # llm: 4 stages on 2 ranks (rank 1 holds stages 0 and 2; under zbv stages 0 and 3)
    "chain_enc-llm_pp2_v2": (ONE_ENC, {"enc_a": P(), "llm": P(pp=2, virtual_stages=2)}, 4, 8),
    # fan-in; enc_b's two chunks sit on one rank (a local hand-off between them)
    "fanin_2enc-llm_pp2_v2": (TWO_ENC, {"enc_a": P(), "enc_b": P(virtual_stages=2),
                                        "llm": P(pp=2, virtual_stages=2)}, 4, 8),
    "colocated_2enc-llm_pp2_v2": (TWO_ENC, {"enc_a": P(rank_offset=0, virtual_stages=2), "enc_b": P(rank_offset=0),
                                            "llm": P(pp=2, virtual_stages=2)}, 4, 8),
    "3level_enc-llm_pp2_v2-dec_v2": (CHAIN3, {"enc_a": P(), "llm": P(pp=2, virtual_stages=2),
                                              "dec": P(virtual_stages=2)}, 3, 6),
    # the dp group sums the gradients of both chunks a rank holds; fan-in from a dp=2 encoder
    "fanin_enc_dp2-llm_v2_dp2": (ONE_ENC, {"enc_a": P(dp=2), "llm": P(virtual_stages=3, dp=2)}, 2, 8),
}


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", list(VIRTUAL_LAYOUTS))
def test_virtual_stages_match_single_process(layout):
    topology, placements, m, batch_size = VIRTUAL_LAYOUTS[layout]
    world = MultiModulePipelineStrategy(placements, topology, m).layout.world_size
    require_ranks(world)
    reference = _reference(topology, batch_size, "adam", 0.05)
    per_rank = run_distributed(_pipelined, world, topology, placements, m, batch_size, "adam", 0.05,
                               VIRTUAL_SCHEDULES, timeout=360, init_pg=False)
    _check(per_rank, reference, VIRTUAL_SCHEDULES)


@pytest.mark.parametrize("v_shape", [False, True])
def test_partition_keeps_every_chunk_of_a_rank(v_shape):
    """A rank keeps the layers of each chunk it holds, under their names, one runner per chunk;
    the module's runner holds them all (what dp sync, optimizers and checkpoints see)."""
    layout = PipelineLayout({"enc_a": P(), "llm": P(pp=2, virtual_stages=2)}, ONE_ENC, v_shape=v_shape)
    whole = MultiModalModel(ONE_ENC)
    names = list(whole.llm._modules)  # 4 blocks and a head
    for rank, stages in ((1, (0, 3) if v_shape else (0, 2)), (2, (1, 2) if v_shape else (1, 3))):
        model = MultiModalModel(ONE_ENC)
        partition = partition_model(model, layout, rank)
        chunks = [partition.chunks[("llm", c)] for c in range(2)]
        assert [c.stage for c in chunks] == list(stages)
        kept = sorted({n for c in chunks for n in c.layer_names}, key=names.index)
        assert list(model.llm._modules) == kept
        assert partition.runners["llm"].layer_names == kept
        assert {id(p) for p in partition.runners["llm"].parameters()} == {
            id(p) for c in chunks for p in c.parameters()}
        for c in chunks:  # the same weights as one process, each layer where it was
            for name in c.layer_names:
                torch.testing.assert_close(dict(model.llm.named_children())[name].state_dict(),
                                           dict(whole.llm.named_children())[name].state_dict())


def test_strategy_and_summary_show_chunks():
    """``print(strategy)``, the placements table and the pipeline summary name each rank's chunks."""
    from lightning_mmpp.model.summary import pipeline_summary

    placements = {"enc_a": P(), "llm": P(pp=2, virtual_stages=2)}
    strategy = MultiModulePipelineStrategy(placements, ONE_ENC, 4, schedule="zbv")
    rows = [line.split() for line in str(strategy).splitlines()[1:]]
    assert rows[0] == ["rank", "module", "stage", "chunk", "replica", "global-stage"]
    assert [r[:4] for r in rows[1:]] == [["0", "enc_a", "0/1", "0/1"], ["1", "llm", "0/4", "0/2"],
                                         ["1", "llm", "3/4", "1/2"], ["2", "llm", "1/4", "0/2"],
                                         ["2", "llm", "2/4", "1/2"]]
    unconnected = str(MultiModulePipelineStrategy(placements, None, 4)).splitlines()
    assert unconnected[1].split()[-1] == "chunks/rank" and unconnected[3].split()[-1] == "2"
    summary = [line.split() for line in pipeline_summary(MultiModalModel(ONE_ENC), strategy.layout).splitlines()]
    assert summary[0][:4] == ["module", "stage", "chunk", "ranks"]
    assert [r[:4] for r in summary[2:6]] == [["llm", "0/4", "0/2", "1"], ["llm", "1/4", "0/2", "2"],
                                             ["llm", "2/4", "1/2", "2"], ["llm", "3/4", "1/2", "1"]]


def _tied_runs(rank, world, placements):
    """A meta-built LM with its embedding tied to its head, under both schedules (one fit each)."""
    import lightning as L

    from tests.test_tied import MetaTiedModel, _all_params, _kwargs
    from tests.models import make_loader

    out = {}
    for schedule in VIRTUAL_SCHEDULES:
        L.seed_everything(11, verbose=False)
        model = MetaTiedModel({"llm": []}, optimizer="adam")
        strategy = MultiModulePipelineStrategy(placements, {"llm": []}, num_microbatches=2, schedule=schedule)
        initial = {}

        class Record(L.Callback):
            def on_train_start(self, trainer, pl_module):
                initial.update(_all_params(pl_module))

        L.Trainer(**_kwargs(world, 0.05), strategy=strategy, callbacks=[Record()]).fit(
            model, make_loader({"llm": []}, 8, 8 * 3))
        out[schedule] = (initial, _all_params(model))
    return out


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_meta_built_tied_lm_with_virtual_stages_trains_like_one_process():
    """Chunks materialised on the meta device take one process's values; the embedding (stage 0)
    and the head (stage 3) share a parameter: on two ranks under interleaved_1f1b (a tie group
    sums it), on one rank under zbv (the bottom and the top of the V: one tensor)."""
    from tests.test_tied import TIED, _reference

    placements = {"llm": P(pp=2, virtual_stages=2)}
    initial, final = _reference({"llm": []}, True, "adam", 0.05)
    per_rank = run_distributed(_tied_runs, 2, placements, timeout=360, init_pg=False)
    for schedule in VIRTUAL_SCHEDULES:
        held = set()
        for result in per_rank:
            start, end = result[schedule]
            for name, value in start.items():
                assert torch.equal(value, initial[name]), f"{schedule}: initial {name}"
                torch.testing.assert_close(end[name], final[name], rtol=1e-5, atol=1e-6, msg=f"{schedule} {name}")
                held.add(name)
        assert held == set(final), schedule
        ends = [result[schedule][1][n] for result in per_rank for n in TIED if n in result[schedule][1]]
        assert len(ends) >= 2 and all(torch.equal(ends[0], e) for e in ends), schedule
