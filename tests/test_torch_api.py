"""Pins the behaviour of every name lightning_mmpp/torch_api.py takes from torch's private API:
the pytree functions of ``torch.utils._pytree`` (payloads, batches and gradients are pytrees)
and the default process group's store. A torch release that changes one of them fails here
first, with the name of what changed."""

from __future__ import annotations

import socket
from collections import OrderedDict, namedtuple

import pytest
import torch
import torch.distributed as dist

from lightning_mmpp.torch_api import (
    LeafSpec,
    TreeSpec,
    default_store,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_leaves,
    tree_map,
    tree_unflatten,
    treespec_leaf,
)
from lightning_mmpp.engine.payload import PayloadSpec, flatten_payload

Pair = namedtuple("Pair", ["left", "right"])


def _is_none(node):
    return node is None


def _tensors(n):
    return [torch.full((2,), float(i)) for i in range(n)]


def test_flatten_order_of_dicts_lists_and_tuples():
    """Dicts flatten in insertion order (not sorted), lists and tuples in position order, depth
    first. If this fails, a payload's packed buffer lays its leaves out in another order and a
    gradient returned as a dict with its keys in another order than the input's no longer has
    the same structure (the communicator compares tree specs)."""
    t = _tensors(5)
    payload = {"b": [t[0], (t[1], t[2])], "a": t[3], "c": OrderedDict(z=t[4])}
    leaves, spec = tree_flatten(payload)
    assert [int(x[0]) for x in leaves] == [0, 1, 2, 3, 4]
    _, swapped = tree_flatten({"a": t[3], "b": [t[0], (t[1], t[2])], "c": OrderedDict(z=t[4])})
    assert swapped != spec  # insertion order is part of the structure
    assert tree_leaves(payload) == leaves


def test_none_is_a_leaf_with_is_leaf():
    """With ``is_leaf=lambda x: x is None`` a ``None`` entry is a leaf of its own (the package
    always passes it: whether ``None`` is a leaf by default changed across torch releases). If
    this fails, payloads with ``None`` entries (a leaf without gradient) flatten to another
    number of leaves than their spec has, and gradients are matched to the wrong inputs."""
    t = _tensors(2)
    payload = {"x": t[0], "mask": None, "y": [None, t[1]]}
    leaves, spec = tree_flatten(payload, is_leaf=_is_none)
    assert [x is None for x in leaves] == [False, True, True, False]
    assert spec.num_leaves == 4
    assert tree_unflatten(leaves, spec) == payload


def test_is_leaf_stops_the_descent():
    """``is_leaf`` keeps a matching subtree whole (the batch splitter treats lists of strings
    as one field). If this fails, such fields are split element by element."""
    batch = {"ids": torch.zeros(4, 2), "names": ["a", "b", "c", "d"]}
    leaves, _ = tree_flatten(batch, is_leaf=lambda node: isinstance(node, list))
    assert leaves[1] == ["a", "b", "c", "d"]


def test_unflatten_round_trip_keeps_types():
    """``tree_unflatten(tree_flatten(x))`` rebuilds dicts (key order), lists, tuples and
    namedtuples with their own types. If this fails, a received payload arrives with another
    container type than the stage sent."""
    t = _tensors(4)
    payload = {"pair": Pair(t[0], [t[1]]), "tup": (t[2],), "od": OrderedDict(k=t[3])}
    leaves, spec = tree_flatten(payload)
    rebuilt = tree_unflatten(leaves, spec)
    assert type(rebuilt["pair"]) is Pair and type(rebuilt["tup"]) is tuple and type(rebuilt["od"]) is OrderedDict
    assert list(rebuilt) == ["pair", "tup", "od"]
    assert rebuilt["pair"].right[0] is t[1]


def test_key_paths_and_keystr():
    """``tree_flatten_with_path`` yields each leaf's key path in flatten order and ``keystr``
    spells it as Python indexing. If this fails, the errors that name a bad payload leaf (e.g.
    "the leaf at ['img'][1][0] is a str") name another path or none."""
    payload = {"img": [torch.zeros(1), (torch.ones(1),)], "m": None}
    with_path, _ = tree_flatten_with_path(payload, is_leaf=_is_none)
    assert [keystr(path) for path, _ in with_path] == ["['img'][0]", "['img'][1][0]", "['m']"]
    assert with_path[2][1] is None


def test_tree_map_maps_leaves_and_keeps_structure():
    """``tree_map`` applies the function to every leaf and rebuilds the structure (the
    package's functions pass non-tensors through). If this fails, detaching predictions, collecting input gradients or moving a
    batch to the device changes the payload's shape."""
    t = _tensors(2)
    payload = {"a": [t[0], None], "b": (t[1],)}
    doubled = tree_map(lambda x: x * 2 if isinstance(x, torch.Tensor) else x, payload)
    assert doubled["a"][1] is None and type(doubled["b"]) is tuple
    assert torch.equal(doubled["a"][0], t[0] * 2) and torch.equal(doubled["b"][0], t[1] * 2)


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
@pytest.mark.parametrize("make_leaf", [treespec_leaf, LeafSpec], ids=["treespec_leaf", "LeafSpec"])
def test_leaf_spec(make_leaf):
    """``treespec_leaf()`` (and the older ``LeafSpec()``) is the spec of a single leaf, equal to
    what flattening a tensor gives. If this fails, a payload spec received over the wire
    (rebuilt from its serialised form) no longer equals the sender's for a bare-tensor payload."""
    leaf = make_leaf()
    assert leaf.is_leaf() and leaf.num_leaves == 1
    x = torch.zeros(1)
    assert tree_unflatten([x], leaf) is x
    assert tree_flatten(x)[1] == leaf


def test_treespec_rebuilt_from_type_context_and_children():
    """``TreeSpec(type, context, children)`` rebuilds a flattened spec from its parts (what a
    payload spec's serialised form stores). If this fails, the receiver cannot rebuild the
    sender's structure and every changed spec raises or mismatches."""
    payload = {"a": [torch.zeros(1), None], "b": Pair(torch.zeros(1), (torch.zeros(1),))}
    _, spec = tree_flatten(payload, is_leaf=_is_none)

    def rebuild(s: TreeSpec) -> TreeSpec:
        if s.is_leaf():
            return treespec_leaf()
        children = s.children() if callable(getattr(s, "children", None)) else s.children_specs
        return TreeSpec(s.type, s.context, [rebuild(c) for c in children])

    assert rebuild(spec) == spec
    # the package's own round trip through bytes, as the wire protocol uses it
    _, payload_spec = flatten_payload(payload, "test")
    assert PayloadSpec.from_bytes(payload_spec.to_bytes()) == payload_spec


def test_default_store():
    """``None`` without a process group; inside one, the group's key-value store (``add``,
    ``set``, ``get``). If this fails, the failure board cannot attach and a failing rank's
    peers no longer name the root cause (only their own transport error)."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    assert default_store() is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        store = default_store()
        assert store is not None
        assert store.add("pin/tickets", 1) == 1 and store.add("pin/tickets", 1) == 2
        store.set("pin/key", "value")
        assert store.get("pin/key") == b"value"
    finally:
        dist.destroy_process_group()
    assert default_store() is None


def test_wait_collective_waits_an_async_collective_tensor_and_ignores_others():
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    from lightning_mmpp.torch_api import wait_collective

    waited = []

    class Fake(AsyncCollectiveTensor):  # the class torch returns; its wait() is what is relied on
        def wait(self):
            waited.append(True)
            return self.elem

    wait_collective(torch.ones(2))
    assert waited == []
    fake = Fake.__new__(Fake, torch.ones(2))
    wait_collective(fake)
    assert waited == [True]


def _direct_p2p_worker(rank: int, world: int) -> list[float]:
    from lightning_mmpp.torch_api import direct_p2p

    send, recv = direct_p2p(None)
    peer = 1 - rank
    out = torch.full((3,), float(rank))
    got = torch.empty(3)
    # a direct post pairs with dist's own calls in order (same tag), both ways
    works = [send(out, peer), recv(got, peer)]
    for work in works:
        work.wait()
    second = torch.empty(3)
    if rank == 0:
        dist.isend(out + 10, 1).wait()
        recv(second, 1).wait()
    else:
        recv(second, 0).wait()
        dist.isend(out + 10, 0).wait()
    # gloo matches a pair's transfers per tag: a receive on tag 0 posted first takes the tag-0
    # send even though a tag-1 send to it was posted before (the communicator's later parts)
    tagged = [torch.empty(3), torch.empty(3)]
    if rank == 0:
        for work in [send(out + 20, 1, 1), send(out + 30, 1, 0)]:
            work.wait()
    else:
        recv(tagged[0], 0, 0).wait()
        recv(tagged[1], 0, 1).wait()
    return got.tolist() + second.tolist() + (tagged[0].tolist() + tagged[1].tolist() if rank else [])


@pytest.mark.distributed
def test_direct_p2p_posts_on_the_group_like_isend_irecv():
    """``direct_p2p``'s send / recv are the process group's ``send([t], group_rank, tag)`` /
    ``recv``: they pair with ``dist.isend`` / ``irecv`` of the peer in order, and per tag (a later
    tag's send waits while an earlier tag's receive takes the send posted after it). If this
    fails, the communicator's gloo fast path (and its later parts' own tag) no longer holds."""
    from tests.dist import run_distributed

    got = run_distributed(_direct_p2p_worker, 2, timeout=60)
    assert got[0] == [1.0] * 3 + [11.0] * 3
    assert got[1] == [0.0] * 3 + [10.0] * 3 + [30.0] * 3 + [20.0] * 3
