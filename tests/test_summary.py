"""Unit test for the pipeline summary (single process)."""

from __future__ import annotations

from torch import nn

from lightning_mmpp import ModulePlacement as P
from lightning_mmpp import PipelineLayout
from lightning_mmpp.model.summary import pipeline_summary
from tests.models import MultiModalModel


def test_summary_rows_and_bytes_per_rank():
    model = MultiModalModel({"enc_a": ["llm"], "llm": []}, freeze=("enc_a",))
    model.enc_a = nn.Linear(6, 8).requires_grad_(False)  # a plain nn.Module (pp=1): one layer, 56 frozen
    layout = PipelineLayout({"enc_a": P(dp=2), "llm": P(pp=2)}, model.pipeline_topology)
    lines = pipeline_summary(model, layout).splitlines()
    assert lines[0].split() == ["module", "stage", "ranks", "layers", "trainable", "frozen", "param", "bytes/rank"]
    assert lines[1].split() == ["enc_a", "0/1", "0,1", "(whole", "module)", "0", "56", "224", "B"]
    # llm: 4 blocks (lin 8x8+8, emb 11x8: 160 each) and a head (8x11+11 = 99), split 2 | 3 by weight
    assert lines[2].split() == ["llm", "0/2", "2", "0-1", "(2)", "320", "0", "1.2", "KB"]
    assert lines[3].split() == ["llm", "1/2", "3", "2-4", "(3)", "419", "0", "1.6", "KB"]
    assert lines[4] == "parameter bytes per rank: 0: 224 B, 1: 224 B, 2: 1.2 KB, 3: 1.6 KB"


def test_summary_shows_tp():
    from lightning_mmpp import ModulePlacement
    from lightning_mmpp.core.placement import PipelineLayout
    from tests.models import TensorParallelModel

    topology = {"enc_a": ["llm"], "llm": []}
    model = TensorParallelModel(topology)
    layout = PipelineLayout({"enc_a": ModulePlacement(dp=2), "llm": ModulePlacement(pp=2, tp=2)}, topology)
    lines = pipeline_summary(model, layout).splitlines()
    assert "tp" in lines[0].split() and "(before tp splits)" in lines[0]
    assert lines[2].split()[:4] == ["llm", "0/2", "2,3", "2"] and lines[3].split()[:4] == ["llm", "1/2", "4,5", "2"]
