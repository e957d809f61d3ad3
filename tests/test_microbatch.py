"""Unit tests for lightning_mmpp.engine.microbatch: the splitting rule for batches (single process)."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.engine.microbatch import (
    Unsplit,
    batch_size_of,
    microbatch_count,
    slice_batch,
    split_microbatches,
    unwrap_unsplit,
)


def _batch(n: int = 8) -> dict:
    return {
        "x": torch.arange(n * 2).reshape(n, 2),
        "names": [f"s{i}" for i in range(n)],  # per-sample strings, as default_collate leaves them
        "meta": ("a", "b", "c"),  # another length: passed whole
        "scale": torch.tensor(2.0),  # 0-d: passed whole
        "flag": True,
    }


def test_tensors_and_per_sample_lists_split_together():
    parts = split_microbatches(_batch(), 4)
    assert len(parts) == 4
    for k, part in enumerate(parts):
        assert torch.equal(part["x"], torch.arange(8 * 2).reshape(8, 2)[2 * k:2 * k + 2])
        assert part["names"] == [f"s{2 * k}", f"s{2 * k + 1}"]
        assert part["meta"] == ("a", "b", "c")
        assert part["scale"].item() == 2.0 and part["flag"] is True


def test_dp_shard_of_a_microbatch_keeps_samples_aligned():
    micro = split_microbatches(_batch(8), 2)[1]  # samples 4..7
    shard = slice_batch(micro, slice(2, 4))  # replica 1 of dp=2
    assert shard["names"] == ["s6", "s7"]
    assert shard["x"][:, 0].tolist() == [12, 14]


def test_tuple_field_stays_a_tuple_and_lists_of_records_split():
    batch = {"x": torch.zeros(4, 1), "ids": (1, 2, 3, 4), "records": [{"id": i} for i in range(4)]}
    first, second = split_microbatches(batch, 2)
    assert first["ids"] == (1, 2) and second["ids"] == (3, 4)
    assert second["records"] == [{"id": 2}, {"id": 3}]


def test_lists_holding_tensors_are_containers_not_fields():
    # default_collate of (x, y) samples: a list of two batched tensors, even with batch size 2
    batch = [torch.arange(2), torch.arange(2) * 10]
    first, second = split_microbatches(batch, 2)
    assert isinstance(first, list) and len(first) == 2
    assert first[0].tolist() == [0] and first[1].tolist() == [0]
    assert second[0].tolist() == [1] and second[1].tolist() == [10]


def test_namedtuple_is_a_record():
    Pair = namedtuple("Pair", ["a", "b"])
    batch = {"x": torch.zeros(2, 1), "pair": Pair("p", "q")}  # length 2 == batch size, but a record
    first, _ = split_microbatches(batch, 2)
    assert first["pair"] == Pair("p", "q")


def test_unsplit_is_the_escape_hatch():
    classes = ["cat", "dog", "emu", "fox"]  # length equals the batch size by accident
    batch = {"x": torch.zeros(4, 1), "classes": Unsplit(classes)}
    parts = split_microbatches(batch, 2)
    shard = unwrap_unsplit(slice_batch(parts[1], slice(1, 2)))
    assert shard["classes"] == classes
    assert shard["x"].shape == (1, 1)


def test_batch_of_strings_only_takes_its_length():
    assert batch_size_of({"text": ["a", "b", "c", "d"]}) == 4
    assert split_microbatches({"text": ["a", "b", "c", "d"]}, 2)[1] == {"text": ["c", "d"]}


def test_batch_size_errors():
    with pytest.raises(PipelineConfigError, match="disagree on dim 0"):
        batch_size_of({"a": torch.zeros(4), "b": torch.zeros(3)})
    with pytest.raises(PipelineConfigError, match="no tensor with a batch dimension"):
        batch_size_of({"a": torch.tensor(1.0), "n": 3})


def test_microbatch_count_messages():
    assert microbatch_count(8, 4, 2) == 4
    assert microbatch_count(4, 4, 2, short=True) == 2
    with pytest.raises(PipelineConfigError) as err:
        microbatch_count(6, 4, 1)
    # dp=1 everywhere: the message names the microbatch count, not dp replicas
    assert "num_microbatches=4 equal microbatches" in str(err.value) and "dp" not in str(err.value)
    assert "multiple of 4" in str(err.value)
    with pytest.raises(PipelineConfigError) as err:
        microbatch_count(12, 4, 2)
    assert "lcm of the dp sizes = 2" in str(err.value) and "multiple of 8" in str(err.value)


def test_sampler_replacement_is_stated_once_and_a_seeded_generator_is_kept(monkeypatch):
    import warnings

    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    import lightning_mmpp.lightning.data as microbatch
    from lightning_mmpp.lightning.data import same_order_on_every_rank

    monkeypatch.setattr(microbatch, "_WARNED_SAMPLER", False)
    data = list(range(12))
    with pytest.warns(UserWarning, match=r"generator=torch.Generator\(\).manual_seed\(seed\)"):
        replaced = same_order_on_every_rank(DataLoader(data, batch_size=4, shuffle=True))
    assert isinstance(replaced.sampler, DistributedSampler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same_order_on_every_rank(DataLoader(data, batch_size=4, shuffle=True))  # no second warning
        seeded = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
        assert same_order_on_every_rank(seeded) is seeded
    assert isinstance(seeded.sampler, RandomSampler)


def test_a_splitters_shards_are_the_split_batch_sliced_by_replica():
    """``BatchSplitter.split``'s ``shard(module, k)`` (the batch flattened once per step) gives
    what slicing the split microbatch by the replica's samples and unwrapping gives, in a fresh
    container every call."""
    from lightning_mmpp.core.kinds import StepKind
    from lightning_mmpp.core.placement import ModulePlacement, PipelineLayout
    from lightning_mmpp.engine.microbatch import BatchSplitter

    layout = PipelineLayout({"enc": ModulePlacement(dp=2), "llm": ModulePlacement()}, {"enc": ["llm"], "llm": []})
    batch = {"x": torch.arange(16.0).reshape(8, 2), "ids": list(range(8)), "tags": Unsplit(["a", "b"]),
             "pair": (torch.arange(8), torch.zeros(8, 3))}
    for rank, module, index in ((1, "enc", slice(2, 4)), (2, "llm", slice(0, 4))):
        m, shard = BatchSplitter(layout, rank, 2).split(batch, StepKind.TRAIN)
        assert m == 2
        for k, micro in enumerate(split_microbatches(batch, 2)):
            want, got = unwrap_unsplit(slice_batch(micro, index, 4)), shard(module, k)
            assert got.keys() == want.keys() and got["ids"] == want["ids"] and got["tags"] == ["a", "b"]
            assert torch.equal(got["x"], want["x"]) and isinstance(got["pair"], tuple)
            assert all(torch.equal(a, b) for a, b in zip(got["pair"], want["pair"]))
            assert shard(module, k) is not got  # a fresh container: a hook may change its own
