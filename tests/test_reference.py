"""Unit tests for run_unpipelined and the pipeline_loss forms (single process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mmpp import PipelineConfigError, run_unpipelined
from lightning_mmpp.model.hooks import pipeline_loss_caller, pipeline_loss_takes_module
from tests.models import MultiModalModel, SyntheticDataset

TOPOLOGY = {"enc_a": ["llm"], "llm": []}


def _batch() -> dict:
    data = SyntheticDataset(4, ["enc_a"])
    return {k: torch.stack([data[i][k] for i in range(4)]) for k in data[0]}


class _OldForm(MultiModalModel):
    def pipeline_loss(self, output, batch):  # the older two-argument form
        return super().pipeline_loss("llm", output, batch)


def test_model_topology_and_explicit_topology_agree():
    model = MultiModalModel(TOPOLOGY)
    batch = _batch()
    loss_declared, outputs = run_unpipelined(model, batch)
    loss_explicit, _ = run_unpipelined(model, TOPOLOGY, batch)
    assert torch.equal(loss_declared, loss_explicit)
    assert set(outputs) == {"enc_a", "llm"}


def test_old_and_new_pipeline_loss_forms_give_the_same_loss():
    batch = _batch()
    new, _ = run_unpipelined(MultiModalModel(TOPOLOGY), batch)
    old, _ = run_unpipelined(_OldForm(TOPOLOGY), batch)
    assert torch.equal(new, old)


def test_signature_detection():
    class Hooks:
        def new(self, module, output, batch): return module
        def old(self, output, batch): return output
        def star(self, *args): return args[0]
        def broken(self, output): return output

    h = Hooks()
    assert pipeline_loss_takes_module(h.new) and pipeline_loss_takes_module(h.star)
    assert not pipeline_loss_takes_module(h.old)
    with pytest.raises(PipelineConfigError, match=r"pipeline_loss\(self, module, output, batch\)"):
        pipeline_loss_takes_module(h.broken)
    h.pipeline_loss = h.old
    assert pipeline_loss_caller(h)("llm", "out", "batch") == "out"


def test_without_a_declared_topology():
    model = MultiModalModel(TOPOLOGY)
    model.pipeline_topology = None
    with pytest.raises(PipelineConfigError, match="pipeline_topology"):
        run_unpipelined(model, _batch())


def test_a_plain_module_is_one_layer():
    model = MultiModalModel(TOPOLOGY)
    batch = _batch()
    expected, _ = run_unpipelined(model, batch)
    model.enc_a = _Wrapped(model.enc_a)  # the same layers behind one plain nn.Module
    loss, _ = run_unpipelined(model, batch)
    assert torch.equal(loss, expected)


class _Wrapped(nn.Module):
    def __init__(self, inner: nn.Sequential) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)
