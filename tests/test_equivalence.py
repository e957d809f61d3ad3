"""The backbone: pipelined training equals single-process training, for many layouts."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch

from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy, run_unpipelined
from tests.compare import assert_close_after_adam
from tests.dist import require_ranks, run_distributed, test_accelerator
from tests.models import MultiModalModel, make_loader

pytestmark = pytest.mark.distributed  # every test here launches processes

P = ModulePlacement
STEPS = 3
SCHEDULES = ("1f1b", "gpipe", "zero_bubble")

TWO_ENC = {"enc_a": ["llm"], "enc_b": ["llm"], "llm": []}
ONE_ENC = {"enc_a": ["llm"], "llm": []}
CHAIN3 = {"enc_a": ["llm"], "llm": ["dec"], "dec": []}

# id: (topology, placements, num_microbatches, batch_size)
LAYOUTS = {
    "enc-llm": (ONE_ENC, {"enc_a": P(), "llm": P()}, 4, 8),
    "enc-llm_pp3": (ONE_ENC, {"enc_a": P(), "llm": P(pp=3)}, 4, 8),
    "2enc-llm_pp2": (TWO_ENC, {"enc_a": P(), "enc_b": P(), "llm": P(pp=2)}, 4, 8),
    "2enc_colocated-llm_pp2": (TWO_ENC, {"enc_a": P(rank_offset=0), "enc_b": P(rank_offset=0), "llm": P(pp=2)}, 4, 8),
    "fanin_enc_dp2-llm": (ONE_ENC, {"enc_a": P(dp=2), "llm": P()}, 4, 8),
    "fanout_enc-llm_dp2": (ONE_ENC, {"enc_a": P(), "llm": P(dp=2)}, 4, 8),
    "enc_pp2-llm_pp2_dp2": (ONE_ENC, {"enc_a": P(pp=2), "llm": P(pp=2, dp=2)}, 2, 8),
    "chain3": (CHAIN3, {"enc_a": P(), "llm": P(), "dec": P(pp=2)}, 3, 6),
    "all_colocated_world1": (TWO_ENC, {"enc_a": P(rank_offset=0), "enc_b": P(rank_offset=0), "llm": P(rank_offset=0)}, 2, 8),
    "m_below_depth": (ONE_ENC, {"enc_a": P(), "llm": P(pp=3)}, 2, 4),
    "two_sinks_fanout": ({"enc_a": ["llm", "aux"], "llm": [], "aux": []},
                         {"enc_a": P(), "llm": P(dp=2), "aux": P()}, 4, 8),
    "m_above_depth": (TWO_ENC, {"enc_a": P(dp=2), "enc_b": P(), "llm": P(pp=2)}, 8, 16),
}


# shard / recompute (ModulePlacement's memory levers); id: (topology, placements, m, batch size, frozen modules)
MEMORY_LAYOUTS = {
    "sharded_enc_dp2-fanin-llm": (ONE_ENC, {"enc_a": P(dp=2, shard=True), "llm": P()}, 4, 8, ()),
    "enc-fanout-llm_dp2_sharded": (ONE_ENC, {"enc_a": P(), "llm": P(dp=2, shard=True)}, 4, 8, ()),
    "sharded_colocated_encs-llm_pp2": (
        TWO_ENC, {"enc_a": P(dp=2, rank_offset=0, shard=True), "enc_b": P(dp=2, rank_offset=0, shard=True),
                  "llm": P(pp=2)}, 4, 8, ()),
    "frozen_sharded_enc-llm_pp2_dp2_sharded_recompute": (
        ONE_ENC, {"enc_a": P(dp=2, shard=True), "llm": P(pp=2, dp=2, shard=True, recompute=True)}, 2, 8, ("enc_a",)),
    "enc_recompute-llm_pp2_dp4_sharded": (
        ONE_ENC, {"enc_a": P(recompute=True), "llm": P(pp=2, dp=4, shard=True)}, 2, 8, ()),
    "recompute-llm_pp3": (ONE_ENC, {"enc_a": P(recompute=True), "llm": P(pp=3, recompute=True)}, 4, 8, ()),
}


def _trainer_kwargs(devices: int, steps: int) -> dict:
    return dict(
        accelerator=test_accelerator(), devices=devices, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )


def _reference(topology, batch_size: int, optimizer: str, clip: float | None, freeze=(),
               model_cls=MultiModalModel) -> dict[str, torch.Tensor]:
    model = model_cls(topology, optimizer=optimizer, freeze=freeze)
    trainer = L.Trainer(**_trainer_kwargs(1, STEPS), gradient_clip_val=clip)
    trainer.fit(model, make_loader(topology, batch_size, batch_size * STEPS))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class _FinalParameters(L.Callback):
    """Every parameter's whole value at the end of fit, before teardown releases the dp groups
    (a sharded parameter is gathered over its group)."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer, pl_module) -> None:
        from torch.distributed.tensor import DTensor

        self.values = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                       for n, p in pl_module.named_parameters()}


def _pipelined(rank, world, topology, placements, m, batch_size, optimizer, clip, schedules=SCHEDULES, freeze=(),
               static_shapes=False, model_cls=MultiModalModel):
    out = {}
    for schedule in schedules:
        model = model_cls(topology, optimizer=optimizer, freeze=freeze)
        strategy = MultiModulePipelineStrategy(placements, topology, num_microbatches=m, schedule=schedule,
                                               static_shapes=static_shapes)
        final = _FinalParameters()
        trainer = L.Trainer(**_trainer_kwargs(world, STEPS), strategy=strategy, gradient_clip_val=clip,
                            callbacks=[final])
        trainer.fit(model, make_loader(topology, batch_size, batch_size * STEPS))
        out[schedule] = final.values
        out[f"{schedule}_loss"] = float(trainer.callback_metrics["train_loss"])
        if static_shapes:  # a forward-only step after training: its messages carry other specs
            trainer.limit_val_batches = 1.0
            out[f"{schedule}_val"] = trainer.validate(model, make_loader(topology, batch_size, 2 * batch_size),
                                                      verbose=False)[0]["val_loss"]
    return out


def _check(per_rank, reference, schedules=SCHEDULES, adam=False):
    for schedule in schedules:
        seen: dict[str, torch.Tensor] = {}
        for rank, result in enumerate(per_rank):
            for name, value in result[schedule].items():
                value = value.cpu()  # on CUDA the reference comes back on the CPU (Lightning's teardown)
                if adam:
                    assert_close_after_adam(value, reference[name], f"{schedule} {name}")
                else:
                    torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6, msg=f"{schedule} {name}")
                if name in seen:  # dp replicas hold identical parameters
                    assert torch.equal(seen[name], value), f"{schedule}: replicas differ on {name}"
                seen[name] = value
        assert set(seen) == set(reference), f"{schedule}: missing {set(reference) - set(seen)}"
        losses = {r[f"{schedule}_loss"] for r in per_rank}
        assert len(losses) == 1, f"train_loss differs across ranks: {losses}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_matches_single_process(layout):
    topology, placements, m, batch_size = LAYOUTS[layout]
    world = MultiModulePipelineStrategy(placements, topology, m).layout.world_size
    require_ranks(world)
    reference = _reference(topology, batch_size, "sgd", None)
    per_rank = run_distributed(_pipelined, world, topology, placements, m, batch_size, "sgd", None,
                               timeout=180, init_pg=False)
    _check(per_rank, reference)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["fanin_enc_dp2-llm", "enc_pp2-llm_pp2_dp2", "2enc_colocated-llm_pp2"])
def test_pipeline_matches_single_process_with_gradient_clipping(layout):
    """Clipping by the global norm over every module and rank, dp replicas counted once."""
    topology, placements, m, batch_size = LAYOUTS[layout]
    world = MultiModulePipelineStrategy(placements, topology, m).layout.world_size
    require_ranks(world)
    reference = _reference(topology, batch_size, "adam", 0.05)
    per_rank = run_distributed(_pipelined, world, topology, placements, m, batch_size, "adam", 0.05,
                               timeout=180, init_pg=False)
    _check(per_rank, reference)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["fanin_enc_dp2-llm", "2enc_colocated-llm_pp2"])
def test_static_shapes_match_single_process(layout):
    """``static_shapes=True``: headers checked once per step instead of per received message."""
    topology, placements, m, batch_size = LAYOUTS[layout]
    world = MultiModulePipelineStrategy(placements, topology, m).layout.world_size
    require_ranks(world)
    reference = _reference(topology, batch_size, "adam", 0.05)
    per_rank = run_distributed(_pipelined, world, topology, placements, m, batch_size, "adam", 0.05, SCHEDULES, (),
                               True, timeout=180, init_pg=False)
    _check(per_rank, reference)
    model = MultiModalModel(topology)  # validation of the trained weights, on one process
    model.load_state_dict(reference, strict=False)
    with torch.no_grad():
        expected = sum(float(run_unpipelined(model, batch)[0]) for batch in make_loader(topology, batch_size,
                                                                                       2 * batch_size)) / 2
    for schedule in SCHEDULES:
        for result in per_rank:
            assert abs(result[f"{schedule}_val"] - expected) <= 1e-4 * abs(expected), (schedule, expected, result)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(MEMORY_LAYOUTS))
def test_sharded_and_recomputed_layouts_match_single_process(layout):
    """FSDP2-sharded and recomputed modules, Adam and global-norm clipping, against one process.

    Sharded gradients are reduce-scattered (another summation order than one process), and Adam
    turns such last-bit differences into larger ones in near-zero elements: parameters within
    1e-5 relative to their norm (:func:`tests.compare.assert_close_after_adam`). Every schedule,
    zero_bubble's split backward under FSDP2 (and with recompute) included.
    """
    topology, placements, m, batch_size, freeze = MEMORY_LAYOUTS[layout]
    world = MultiModulePipelineStrategy(placements, topology, m).layout.world_size
    require_ranks(world)
    schedules = SCHEDULES
    reference = _reference(topology, batch_size, "adam", 0.05, freeze)
    per_rank = run_distributed(_pipelined, world, topology, placements, m, batch_size, "adam", 0.05, schedules,
                               freeze, timeout=240, init_pg=False)
    _check(per_rank, reference, schedules, adam=True)
