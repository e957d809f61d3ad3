"""Unit tests for lightning_mmpp.engine.payload: specs, packing, split/concat, errors (single process)."""

from __future__ import annotations

import collections
import pickle

import pytest
import torch

from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.engine.payload import (
    ALIGNMENT,
    FLAG_DATA,
    FLAG_STALE,
    HEADER_BYTES,
    PayloadSpec,
    TensorMeta,
    concat_payloads,
    flatten_payload,
    pack,
    pack_header,
    read_header,
    split_payload,
    unpack,
)

Pair = collections.namedtuple("Pair", ["left", "right"])


def nested_payload(batch: int = 6, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "h": torch.randn(batch, 5, generator=g).requires_grad_(),
        "half": torch.randn(batch, 3, generator=g).half(),
        "bf": torch.randn(batch, 7, generator=g).to(torch.bfloat16).requires_grad_(),
        "ids": torch.randint(-1000, 1000, (batch, 3), generator=g),
        "mask": torch.rand(batch, 2, generator=g) > 0.5,
        "none": None,
        7: (torch.randn(batch, generator=g, dtype=torch.float64), None, [torch.randn(batch, 1, 1, generator=g)]),
        "empty": torch.zeros(batch, 0),
        "pair": Pair(torch.arange(batch, dtype=torch.int32), None),
    }


def assert_same(a, b) -> None:
    la, sa = flatten_payload(a, "a")
    lb, sb = flatten_payload(b, "b")
    assert sa.treespec == sb.treespec
    for x, y in zip(la, lb):
        if x is None:
            assert y is None
        else:
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def test_spec_describes_leaves_and_roundtrips_bytes():
    payload = nested_payload()
    leaves, spec = flatten_payload(payload, "test")
    assert spec.num_leaves == len(leaves) == 12
    metas = {i: m for i, m in enumerate(spec.leaves)}
    assert metas[0] == TensorMeta((6, 5), torch.float32, True)
    assert sum(m is None for m in spec.leaves) == 3
    assert len(spec.grad_indices) == 2 and len(spec.tensor_indices) == 9
    again = PayloadSpec.from_bytes(spec.to_bytes())
    assert again == spec and hash(again) == hash(spec)
    assert again.unflatten(leaves)["pair"].left is payload["pair"].left
    assert isinstance(again.unflatten(leaves)["pair"], Pair)
    # Specs are usable as dict keys and compare by value.
    assert {spec: 1}[flatten_payload(nested_payload(seed=3), "x")[1]] == 1
    # A change of shape, dtype, requires_grad or structure changes the spec.
    changed = [
        nested_payload(batch=4),
        {**nested_payload(), "h": nested_payload()["h"].detach()},
        {**nested_payload(), "ids": nested_payload()["ids"].int()},
        {**nested_payload(), "extra": None},
    ]
    for other in changed:
        assert flatten_payload(other, "x")[1] != spec


def test_spec_bytes_int_keys_tuples_lists_top_level_tensor():
    for payload in [torch.ones(2, 3), None, [torch.ones(1), (None, torch.zeros(2))], {1: torch.ones(1), 2: {"x": None}}]:
        _, spec = flatten_payload(payload, "p")
        data = spec.to_bytes()
        assert isinstance(data, bytes)
        assert PayloadSpec.from_bytes(data) == spec
        assert pickle.loads(pickle.dumps(spec)) == spec


def test_pack_unpack_is_exact_and_aligned():
    payload = nested_payload()
    leaves, spec = flatten_payload(payload, "p")
    layout = spec.data_layout
    assert all(offset % ALIGNMENT == 0 for offset in layout.offsets)
    assert layout.offsets[0] == HEADER_BYTES
    tensors = [leaves[i] for i in layout.indices]
    buffer = pack(tensors, layout, torch.device("cpu"), FLAG_DATA, tag=1234)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.numel() == layout.nbytes
    assert read_header(buffer) == (FLAG_DATA, 1234)
    out = unpack(buffer, layout)
    rebuilt = [None] * spec.num_leaves
    for i, t in zip(layout.indices, out):
        rebuilt[i] = t
    assert_same(spec.unflatten(rebuilt), payload)
    assert all(not t.requires_grad for t in out)
    # Views share the buffer's memory: no copy on unpack.
    big = [t for t in out if t.numel()][0]
    assert big.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_pack_non_contiguous_and_special_values():
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    weird = torch.tensor([float("nan"), float("inf"), -0.0, 1e-45])
    leaves, spec = flatten_payload({"t": base.t(), "s": base[:, ::2], "w": weird}, "p")
    layout = spec.data_layout
    out = unpack(pack(leaves, layout, torch.device("cpu")), layout)
    assert torch.equal(out[0], base.t()) and torch.equal(out[1], base[:, ::2])
    assert out[2].view(torch.int32).tolist() == weird.view(torch.int32).tolist()  # bit-exact, NaN included


def test_header_only_buffer_and_grad_layout():
    buffer = pack_header(64, torch.device("cpu"), FLAG_STALE, 9)
    assert read_header(buffer) == (FLAG_STALE, 9) and buffer.numel() == 64
    _, spec = flatten_payload(nested_payload(), "p")
    assert spec.grad_layout.indices == spec.grad_indices
    assert spec.grad_layout.nbytes < spec.data_layout.nbytes
    _, no_tensors = flatten_payload({"a": None}, "p")
    assert no_tensors.data_layout.nbytes == HEADER_BYTES and not no_tensors.requires_grad


def test_flatten_rejects_non_tensor_leaves_with_path():
    with pytest.raises(PipelineConfigError) as info:
        flatten_payload({"h": torch.ones(1), "names": ["a", "b"]}, "module 'vision' stage 0 output")
    message = str(info.value)
    assert "module 'vision' stage 0 output" in message and "['names'][0]" in message and "str" in message
    with pytest.raises(PipelineConfigError, match=r"\['x'\]\[1\].*int"):
        flatten_payload({"x": (torch.ones(1), 3)}, "w")
    with pytest.raises(PipelineConfigError, match="the payload itself"):
        flatten_payload("text", "w")


def test_split_and_concat_roundtrip():
    payload = nested_payload(batch=8)
    chunks = split_payload(payload, 4, dim=0)
    assert len(chunks) == 4
    assert torch.equal(chunks[2]["h"], payload["h"][4:6])
    assert chunks[3]["none"] is None and chunks[1][7][1] is None
    assert isinstance(chunks[0]["pair"], Pair)
    assert_same(concat_payloads(chunks, dim=0), payload)
    assert split_payload(payload, 1) == [payload]
    # Another batch dim.
    x = {"h": torch.arange(24).view(2, 6, 2)}
    parts = split_payload(x, 3, dim=1)
    assert torch.equal(parts[1]["h"], x["h"][:, 2:4])
    assert torch.equal(concat_payloads(parts, dim=1)["h"], x["h"])


def test_split_errors_name_leaf_size_and_context():
    context = "for fan-out from 'vision' (dp=1) to 'llm' (dp=4)"
    with pytest.raises(PipelineConfigError) as info:
        split_payload({"h": torch.ones(6, 2)}, 4, 0, context)
    assert str(info.value).startswith(
        "cannot split the batch dim of size 6 of leaf ['h'] into 4 chunks for fan-out from 'vision' (dp=1) to 'llm' (dp=4)"
    )
    with pytest.raises(PipelineConfigError, match=r"\['loss'\] is a 0-dim tensor.*4 chunks for fan-out"):
        split_payload({"h": torch.ones(8), "loss": torch.tensor(1.0)}, 4, 0, context)
    with pytest.raises(PipelineConfigError, match="no dim 2"):
        split_payload({"h": torch.ones(8, 2)}, 2, 2)


def test_concat_errors():
    a = {"h": torch.ones(2, 3), "m": None}
    with pytest.raises(PipelineConfigError, match="different structure.*replicas"):
        concat_payloads([a, {"h": torch.ones(2, 3)}], 0, "from replicas 0, 1")
    with pytest.raises(PipelineConfigError, match="None in some"):
        concat_payloads([a, {"h": torch.ones(2, 3), "m": torch.ones(2)}], 0)
    with pytest.raises(PipelineConfigError, match=r"\['h'\].*do not concatenate"):
        concat_payloads([a, {"h": torch.ones(2, 4), "m": None}], 0)
    with pytest.raises(PipelineConfigError, match="different dtypes"):
        concat_payloads([a, {"h": torch.ones(2, 3, dtype=torch.float16), "m": None}], 0)
