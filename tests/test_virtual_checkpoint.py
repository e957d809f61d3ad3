"""Checkpoints resume across virtual stages: keys are by layer, whatever chunk held the layer.

One launch of 3 ranks: ``llm`` with ``pp=2, virtual_stages=2`` (4 chunks, ``interleaved_1f1b``)
and with ``pp=2`` (2 stages, ``1f1b``) save after 3 steps; each resumes the other's checkpoint
exactly (parameters and Adam state) and ends where the uninterrupted run ends.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest

from lightning_mmpp import ModulePlacement, MultiModulePipelineStrategy
from tests.dist import run_distributed
from tests.test_checkpoint import _Snapshot, _assert_close, _assert_equal, _loader, _merge, _model, _optim, _params

pytestmark = pytest.mark.distributed

P = ModulePlacement
TOPOLOGY = {"enc_a": ["llm"], "llm": []}
VIRTUAL = ({"enc_a": P(), "llm": P(pp=2, virtual_stages=2)}, "interleaved_1f1b")
PLAIN = ({"enc_a": P(), "llm": P(pp=2)}, "1f1b")


def _trainer(layout, epochs: int, callbacks=()) -> L.Trainer:
    placements, schedule = layout
    strategy = MultiModulePipelineStrategy(placements, TOPOLOGY, num_microbatches=2, schedule=schedule)
    return L.Trainer(
        accelerator="cpu", devices=strategy.layout.world_size, strategy=strategy, max_epochs=epochs, logger=False,
        callbacks=list(callbacks), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )


def _run(rank, world, root: Path) -> dict:
    out: dict = {}
    model = _model()
    _trainer(VIRTUAL, 2).fit(model, _loader())
    out["params6"] = _params(model)
    for label, layout in (("virtual", VIRTUAL), ("plain", PLAIN)):
        model = _model()
        trainer = _trainer(layout, 1)
        trainer.fit(model, _loader())
        trainer.save_checkpoint(root / f"{label}.ckpt")
        out[f"{label}_params3"], out[f"{label}_optim3"] = _params(model), _optim(trainer)
    for label, layout, source in (("virtual_from_plain", VIRTUAL, "plain"), ("plain_from_virtual", PLAIN, "virtual")):
        snap = _Snapshot()
        model = _model()
        _trainer(layout, 2, [snap]).fit(model, _loader(), ckpt_path=root / f"{source}.ckpt")
        out[f"{label}_start"], out[f"{label}_optim"], out[f"{label}_params6"] = snap.params, snap.optim, _params(model)
    return out


@pytest.mark.timeout(400)
def test_checkpoints_resume_across_virtual_stages(tmp_path):
    per_rank = run_distributed(_run, 3, tmp_path, timeout=360, init_pg=False)
    params6 = _merge(per_rank, "params6")
    for label, source in (("virtual_from_plain", "plain"), ("plain_from_virtual", "virtual")):
        _assert_equal(_merge(per_rank, f"{label}_start"), _merge(per_rank, f"{source}_params3"), f"{label} parameters")
        resumed = {n: s for r in per_rank for n, s in r[f"{label}_optim"]["state"].items()}
        saved = {n: s for r in per_rank for n, s in r[f"{source}_optim3"]["state"].items()}
        _assert_equal(resumed, saved, f"{label} Adam state")
        _assert_close(_merge(per_rank, f"{label}_params6"), params6, f"{label} after 6 steps")
