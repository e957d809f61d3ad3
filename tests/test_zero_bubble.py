"""schedule="zero_bubble" beyond the equivalence matrix, in one launch: a frozen module in the
middle of the DAG (it still carries gradients upstream), a frozen source (no backward at all),
validation and gradient clipping, a checkpoint resumed exactly, and the timeline trace with the
input-gradient (I) and weight-gradient (W) halves shown apart and in schedule order.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_mmpp import ModulePlacement as P
from lightning_mmpp import MultiModulePipelineStrategy
from lightning_mmpp.core.actions import Compute
from lightning_mmpp.core.schedule import build_schedule
from lightning_mmpp.engine.trace import PHASE_SPANS
from tests.dist import run_distributed
from tests.models import MultiModalModel, SyntheticDataset, make_loader

CHAIN3 = {"enc_a": ["llm"], "llm": ["dec"], "dec": []}
PLACEMENTS = {"enc_a": P(), "llm": P(pp=2), "dec": P()}  # 4 ranks
pytestmark = pytest.mark.distributed  # every test here launches processes

M = 4
BS = 8
QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _val_loader() -> DataLoader:
    return DataLoader(SyntheticDataset(16, ["enc_a"], seed=1), batch_size=BS, shuffle=False)


def _scenario(devices: int, strategy_factory, workdir: str) -> dict:
    out: dict = {}

    def trainer(**kwargs) -> L.Trainer:
        strategy = strategy_factory(**kwargs.pop("strategy_kwargs", {}))
        extra = {"strategy": strategy} if strategy is not None else {}
        return L.Trainer(accelerator="cpu", devices=devices, **extra, **QUIET, **kwargs)

    # a frozen module in the middle (trainable upstream): it runs I (and an empty W)
    model = MultiModalModel(CHAIN3, freeze=("llm",))
    run = trainer(max_steps=3, gradient_clip_val=0.05, val_check_interval=3, limit_val_batches=2,
                  num_sanity_val_steps=0, enable_checkpointing=False)
    run.fit(model, make_loader(CHAIN3, BS, BS * 3), _val_loader())
    out["middle_frozen"] = _params(model)
    out["val_loss"] = float(run.callback_metrics["val_loss"])

    # a frozen source: no backward on its ranks at all
    model = MultiModalModel(CHAIN3, freeze=("enc_a",))
    run = trainer(max_steps=2, limit_val_batches=0, enable_checkpointing=False)
    run.fit(model, make_loader(CHAIN3, BS, BS * 2))
    out["source_frozen"] = _params(model)

    # checkpoint after one epoch (SGD with momentum: optimizer state), resume for a second; and two
    # epochs without a break
    ckpt = os.path.join(workdir, "zb.ckpt")
    model = MultiModalModel(CHAIN3)
    run = trainer(max_epochs=1, limit_val_batches=0, enable_checkpointing=False)
    run.fit(model, make_loader(CHAIN3, BS, BS * 2))
    run.save_checkpoint(ckpt)
    model = MultiModalModel(CHAIN3)
    run = trainer(max_epochs=2, limit_val_batches=0, enable_checkpointing=False,
                  strategy_kwargs={"trace_dir": os.path.join(workdir, "trace")})
    run.fit(model, make_loader(CHAIN3, BS, BS * 2), ckpt_path=ckpt)
    out["resumed"] = _params(model)
    model = MultiModalModel(CHAIN3)
    run = trainer(max_epochs=2, limit_val_batches=0, enable_checkpointing=False)
    run.fit(model, make_loader(CHAIN3, BS, BS * 2))
    out["straight"] = _params(model)
    return out


def _pipelined(rank: int, world: int, workdir: str) -> dict:
    def factory(**kwargs):
        return MultiModulePipelineStrategy(PLACEMENTS, CHAIN3, num_microbatches=M, schedule="zero_bubble", **kwargs)

    return _scenario(world, factory, workdir)


@pytest.mark.timeout(240)
def test_zero_bubble_features(tmp_path):
    reference = _scenario(1, lambda **kwargs: None, str(tmp_path / "ref"))
    layout = MultiModulePipelineStrategy(PLACEMENTS, CHAIN3, M).layout
    per_rank = run_distributed(_pipelined, layout.world_size, str(tmp_path / "pp"), timeout=200, init_pg=False)

    def close(a, b, what):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)

    for rank, result in enumerate(per_rank):
        for key in ("middle_frozen", "source_frozen", "resumed"):
            for name, value in result[key].items():
                close(value, reference[key][name], f"rank {rank} {key} {name}")
        for name, value in result["resumed"].items():
            close(value, result["straight"][name], f"rank {rank} resumed vs straight {name}")
        assert abs(result["val_loss"] - reference["val_loss"]) <= 1e-5 * abs(reference["val_loss"])
    assert torch.equal(per_rank[0]["source_frozen"]["enc_a.0.proj.weight"],
                       MultiModalModel(CHAIN3).state_dict()["enc_a.0.proj.weight"])

    # the trace of the resumed run (one step): I and W apart, in the schedule's order
    schedule = build_schedule(layout, M, "zero_bubble")
    names = set(PHASE_SPANS.values())
    for rank in range(layout.world_size):
        with open(os.path.join(tmp_path, "pp", "trace", f"trace_rank{rank}.json")) as f:
            events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X" and e["name"] in names]
        steps = sorted({e["args"]["step"] for e in events})
        assert steps, rank
        expected = [(PHASE_SPANS[a.phase], a.module, a.microbatch) for a in schedule.for_rank(rank)
                    if isinstance(a, Compute)]
        seen = defaultdict(int)
        for step in steps:
            mine = sorted((e for e in events if e["args"]["step"] == step), key=lambda e: e["ts"])
            assert [(e["name"], e["cat"], e["args"]["microbatch"]) for e in mine] == expected, (rank, step)
            for e in mine:
                seen[e["name"]] += 1
        assert seen["backward"] == 0 and seen["backward_weight"] == M * len(steps)
        # every stage but the source's first sends input gradients, so it has an I
        assert seen["backward_input"] == (0 if rank == 0 else M * len(steps)), (rank, dict(seen))
