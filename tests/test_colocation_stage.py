"""A pp=1 module on the ranks of one stage of another module (a projector beside the LM's first stage)."""

from __future__ import annotations

import pytest

from lightning_mmpp import ModulePlacement, PipelineConfigError
from lightning_mmpp.core.placement import PipelineLayout, StageSlot
from lightning_mmpp.core.schedule import build_schedule
from lightning_mmpp.core.simulator import validate_schedule
from tests.dist import run_distributed
from tests.test_equivalence import _check, _pipelined, _reference

P = ModulePlacement
ONE_ENC = {"enc_a": ["llm"], "llm": []}
CHAIN3 = {"enc_a": ["llm"], "llm": ["dec"], "dec": []}
LAYOUTS = {
    # the encoder on llm stage 0's rank
    "enc_beside_llm_stage0": (ONE_ENC, {"llm": P(pp=2), "enc_a": P(rank_offset=0)}, 4, 8),
    # dp=2: the encoder's replicas on llm stage 0's replicas
    "enc_dp2_beside_llm_stage0_dp2": (ONE_ENC, {"llm": P(pp=2, dp=2), "enc_a": P(dp=2, rank_offset=0)}, 2, 8),
    # a downstream module beside the last stage of its producer, and an encoder on its own rank
    "dec_beside_llm_stage1": (CHAIN3, {"enc_a": P(), "llm": P(pp=2), "dec": P(rank_offset=2)}, 3, 6),
}


def test_layout_and_errors():
    layout = PipelineLayout({"llm": P(pp=2, dp=2), "proj": P(dp=2, rank_offset=2)}, {"proj": ["llm"], "llm": []})
    assert layout.world_size == 4
    assert layout.slots(2) == (StageSlot("proj", 0, 0), StageSlot("llm", 1, 0))
    for placements in (
        {"llm": P(pp=2, dp=2), "proj": P(dp=1, rank_offset=0)},  # dp differs
        {"llm": P(pp=2, dp=2), "proj": P(dp=2, rank_offset=1)},  # straddles two stages' replicas
        {"llm": P(pp=2), "proj": P(pp=2, rank_offset=1)},  # pp > 1 on both
    ):
        with pytest.raises(PipelineConfigError, match="pp=1 module with the other's dp and tp on exactly the ranks"):
            PipelineLayout(placements, {"proj": ["llm"], "llm": []})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_schedules_are_valid(layout):
    topology, placements, m, _ = LAYOUTS[layout]
    pipeline = PipelineLayout(placements, topology)
    for name in ("1f1b", "gpipe", "zero_bubble"):
        validate_schedule(build_schedule(pipeline, m, name), pipeline)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_matches_single_process(layout):
    topology, placements, m, batch_size = LAYOUTS[layout]
    world = PipelineLayout(placements, topology).world_size
    reference = _reference(topology, batch_size, "sgd", None)
    per_rank = run_distributed(_pipelined, world, topology, placements, m, batch_size, "sgd", None,
                               timeout=180, init_pg=False)
    _check(per_rank, reference)
