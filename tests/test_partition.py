"""Splitting a module's layers into stages and keeping what a rank owns."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_mmpp import ModulePlacement as P
from lightning_mmpp import PipelineConfigError, PipelineLayout
from lightning_mmpp.model.partition import balanced_split, partition_model, stage_ranges
from tests.models import MultiModalModel

TOPOLOGY = {"enc_a": ["llm"], "llm": []}


def _brute_force(weights, parts):
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = [0, *cuts, n]
        cost = max(sum(weights[bounds[i]:bounds[i + 1]]) for i in range(parts))
        best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=80, deadline=None, database=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=9), st.integers(1, 9))
def test_balanced_split_is_optimal_contiguous_and_complete(weights, parts):
    parts = min(parts, len(weights))
    ranges = balanced_split(weights, parts)
    assert len(ranges) == parts and all(len(r) > 0 for r in ranges)
    assert [i for r in ranges for i in r] == list(range(len(weights)))
    assert max(sum(weights[i] for i in r) for r in ranges) == _brute_force(weights, parts)


def test_stage_ranges_by_parameter_count_and_split_points():
    layers = [nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10), nn.Linear(10, 100)]
    assert stage_ranges(layers, 2, None, "m") == [range(0, 3), range(3, 4)]
    assert stage_ranges(layers, 2, (1,), "m") == [range(0, 1), range(1, 4)]
    with pytest.raises(PipelineConfigError, match="has 4 layer"):
        stage_ranges(layers, 5, None, "m")
    with pytest.raises(PipelineConfigError, match="must be < its 4 layers"):
        stage_ranges(layers, 2, (4,), "m")


def test_partition_keeps_owned_layers_under_original_names():
    layout = PipelineLayout({"enc_a": P(), "llm": P(pp=2, split_points=(2,))}, TOPOLOGY)
    full = MultiModalModel(TOPOLOGY)
    names = dict(full.named_parameters())
    owned_by_rank = {}
    for rank in range(layout.world_size):
        model = MultiModalModel(TOPOLOGY)
        partition = partition_model(model, layout, rank)
        kept = dict(model.named_parameters())
        owned_by_rank[rank] = set(kept)
        assert {id(p) for p in kept.values()} == partition.owned_parameter_ids
        for name, p in kept.items():
            assert torch.equal(p, names[name])
        for module, runner in partition.runners.items():
            assert runner.stage == layout.slot(rank, module).stage
    assert owned_by_rank[0] == {n for n in names if n.startswith("enc_a.")}
    assert owned_by_rank[1] == {n for n in names if n.startswith(("llm.0.", "llm.1."))}
    assert owned_by_rank[2] == {n for n in names if n.startswith(("llm.2.", "llm.3.", "llm.4."))}
    # a stage runner applies its layers in order
    model = MultiModalModel(TOPOLOGY)
    partition = partition_model(model, PipelineLayout({"enc_a": P(rank_offset=0), "llm": P(rank_offset=0)}, TOPOLOGY), 0)
    x = torch.randn(2, 6)
    assert torch.equal(partition.runners["enc_a"](x), model.enc_a(x))


def test_frozen_modules_and_shared_parameters():
    layout = PipelineLayout({"enc_a": P(), "llm": P(pp=2)}, TOPOLOGY)
    model = MultiModalModel(TOPOLOGY, freeze=("enc_a",))
    assert partition_model(model, layout, 0).frozen_modules == frozenset({"enc_a"})
    tied = MultiModalModel(TOPOLOGY)
    tied.llm[4].out.weight = nn.Parameter(torch.zeros(11, 8))
    tied.llm[0].lin.weight = tied.llm[4].out.weight  # tie across two stages (shapes aside)
    partition = partition_model(tied, PipelineLayout({"enc_a": P(), "llm": P(pp=2, split_points=(2,))}, TOPOLOGY), 1)
    (tie,) = partition.tied  # kept on both stages (see tests/test_tied.py)
    assert tie.owners == [("llm", 0), ("llm", 1)] and tie.local is tied.llm._modules["0"].lin.weight
