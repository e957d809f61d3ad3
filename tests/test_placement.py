"""Unit tests for lightning_mmpp.core.placement: rank layouts, bridges, groups, errors (single process)."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_mmpp.errors import PipelineConfigError
from lightning_mmpp.core.placement import BridgePeer, ModulePlacement, PipelineLayout, StageSlot
from lightning_mmpp.core.topology import ModuleTopology

P = ModulePlacement


def layout_error(placements, topology) -> str:
    with pytest.raises(PipelineConfigError) as info:
        PipelineLayout(placements, topology)
    return str(info.value)


def placement_error(**kwargs) -> str:
    with pytest.raises(PipelineConfigError) as info:
        ModulePlacement(**kwargs)
    return str(info.value)


def all_slots(layout: PipelineLayout):
    return [(rank, slot) for rank in range(layout.world_size) for slot in layout.slots(rank)]


def check_forward_consistency(layout: PipelineLayout) -> None:
    """Every forward target has the matching forward source on the peer, and vice versa."""
    targets = set()
    sources = set()
    for rank, slot in all_slots(layout):
        for consumer, peer in layout.forward_targets(slot):
            peer_slot = layout.slot(peer.rank, consumer)
            assert peer_slot is not None, (rank, slot, consumer, peer)
            if consumer == slot.module:
                assert (peer_slot.stage, peer_slot.replica) == (slot.stage + 1, slot.replica)
                assert (peer.chunk, peer.num_chunks) == (0, 1)
            else:
                assert layout.is_last_stage(slot) and peer_slot.stage == 0
                assert consumer in layout.topology.downstream(slot.module)
            assert (slot.module, BridgePeer(rank, peer.chunk, peer.num_chunks)) in layout.forward_sources(peer_slot)
            targets.add((rank, slot, peer.rank, peer_slot, peer.chunk, peer.num_chunks))
        for producer, peer in layout.forward_sources(slot):
            peer_slot = layout.slot(peer.rank, producer)
            assert peer_slot is not None, (rank, slot, producer, peer)
            assert (slot.module, BridgePeer(rank, peer.chunk, peer.num_chunks)) in layout.forward_targets(peer_slot)
            sources.add((peer.rank, peer_slot, rank, slot, peer.chunk, peer.num_chunks))
    assert targets == sources
    for rank, slot in all_slots(layout):
        if slot.stage > 0:
            assert layout.forward_sources(slot) == ((slot.module, BridgePeer(layout.pp_prev(slot), 0, 1)),)
        elif not layout.topology.upstream(slot.module):
            assert layout.forward_sources(slot) == ()
        if not layout.is_last_stage(slot):
            assert layout.forward_targets(slot) == ((slot.module, BridgePeer(layout.pp_next(slot), 0, 1)),)
        elif not layout.topology.downstream(slot.module):
            assert layout.forward_targets(slot) == ()


def check_bridge_samples(layout: PipelineLayout, batch_size: int) -> None:
    """Each downstream replica receives exactly the samples of its own batch shard."""
    samples = list(range(batch_size))
    for up, down in layout.topology.edges():
        last = layout.placements[up].pp - 1
        for j in range(layout.placements[down].dp):
            received = []
            peers = layout.bridge_sources(up, down, j)
            if len(peers) > 1:  # fan-in: senders in concatenation order
                assert [p.chunk for p in peers] == list(range(len(peers)))
                assert {p.num_chunks for p in peers} == {len(peers)}
            for peer in peers:
                slot = layout.slot(peer.rank, up)
                assert slot is not None and slot.stage == last
                sent = samples[layout.batch_shard(up, slot.replica, batch_size)]
                size = len(sent) // peer.num_chunks
                if len(peers) == 1:  # same dp, or fan-out: this receiver's chunk of the sender
                    sent = sent[peer.chunk * size : (peer.chunk + 1) * size]
                received += sent
            assert received == samples[layout.batch_shard(down, j, batch_size)], (up, down, j)


def check_cover(layout: PipelineLayout) -> None:
    seen = Counter((s.module, s.stage, s.replica) for _, s in all_slots(layout))
    expected = {
        (m, s, r) for m, p in layout.placements.items() for s in range(p.pp) for r in range(p.dp)
    }
    assert set(seen) == expected and set(seen.values()) == {1}
    for rank, slot in all_slots(layout):
        assert layout.rank_of(slot.module, slot.stage, slot.replica) == rank
        assert rank in layout.module_ranks(slot.module)
    for rank in range(layout.world_size):
        assert layout.slots(rank), rank
        modules = [s.module for s in layout.slots(rank)]
        assert modules == [m for m in layout.modules if m in modules]  # topological order, once each


# --- ModulePlacement -------------------------------------------------------------------------


def test_module_placement_defaults():
    p = ModulePlacement()
    assert (p.pp, p.dp, p.rank_offset, p.split_points, p.batch_dim, p.size) == (1, 1, None, None, 0, 1)
    assert ModulePlacement(pp=3, dp=2).size == 6


def test_split_points_are_stored_as_a_tuple():
    assert ModulePlacement(pp=3, split_points=[2, 5]).split_points == (2, 5)


@pytest.mark.parametrize("name", ["pp", "dp"])
@pytest.mark.parametrize("value", [0, -1, 1.0, 1.5, "2", None, True])
def test_pp_dp_must_be_positive_int(name, value):
    msg = placement_error(**{name: value})
    assert f"ModulePlacement({name}={value!r})" in msg
    assert f"{name} must be an integer >= 1" in msg


@pytest.mark.parametrize("value", [-1, 1.0, "0", True])
def test_bad_rank_offset(value):
    msg = placement_error(rank_offset=value)
    assert f"ModulePlacement(rank_offset={value!r})" in msg
    assert "rank_offset must be None or an integer >= 0" in msg


@pytest.mark.parametrize(
    "pp, points",
    [(3, (4,)), (2, (2, 4)), (1, (1,)), (3, (4, 4)), (3, (5, 2)), (2, (0,)), (2, (-1,)), (2, ("a",)), (2, (1.5,))],
)
def test_bad_split_points(pp, points):
    msg = placement_error(pp=pp, split_points=points)
    assert f"ModulePlacement(pp={pp}, split_points={tuple(points)})" in msg
    assert f"give pp-1 = {pp - 1} increasing layer indices > 0" in msg


def test_split_points_bare_int():
    msg = placement_error(pp=2, split_points=4)
    assert "ModulePlacement(pp=2, split_points=4)" in msg
    assert "split_points=(4,)" in msg


def test_good_split_points():
    assert ModulePlacement(pp=3, split_points=(1, 2)).split_points == (1, 2)
    assert ModulePlacement(pp=1, split_points=()).split_points == ()


@pytest.mark.parametrize("value", [0.0, "0", None, True])
def test_bad_batch_dim(value):
    assert "batch_dim must be an integer" in placement_error(batch_dim=value)


# --- layouts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "placements, topology, offsets, world",
    [
        ({"m": P()}, {"m": []}, {"m": 0}, 1),
        ({"m": P(pp=2)}, {"m": []}, {"m": 0}, 2),
        ({"a": P(), "b": P()}, {"a": ["b"], "b": []}, {"a": 0, "b": 1}, 2),
        ({"v": P(dp=2), "llm": P()}, {"v": ["llm"], "llm": []}, {"v": 0, "llm": 2}, 3),
        ({"v": P(dp=2), "llm": P(pp=2)}, {"v": ["llm"], "llm": []}, {"v": 0, "llm": 2}, 4),
        (
            {"vision": P(dp=2), "audio": P(), "llm": P(pp=2)},
            {"vision": ["llm"], "audio": ["llm"], "llm": []},
            {"vision": 0, "audio": 2, "llm": 3},
            5,
        ),
        ({"a": P(pp=3, dp=2)}, {"a": []}, {"a": 0}, 6),
        ({"a": P(pp=2), "b": P(pp=2, dp=2), "c": P()}, {"a": ["b"], "b": ["c"], "c": []}, {"a": 0, "b": 2, "c": 6}, 7),
        ({"a": P(dp=4), "m": P(pp=2, dp=2)}, {"a": ["m"], "m": []}, {"a": 0, "m": 4}, 8),
        # declaration order of the placements, not topological order, drives the offsets
        ({"llm": P(pp=2), "vision": P(dp=2)}, {"vision": ["llm"], "llm": []}, {"llm": 0, "vision": 2}, 4),
        # explicit offsets, in any order
        (
            {"llm": P(pp=2, rank_offset=2), "vision": P(dp=2, rank_offset=0)},
            {"vision": ["llm"], "llm": []},
            {"llm": 2, "vision": 0},
            4,
        ),
        # an automatic offset follows the highest rank used so far
        ({"a": P(rank_offset=1), "b": P(rank_offset=0), "c": P()}, {"a": [], "b": [], "c": []}, {"a": 1, "b": 0, "c": 2}, 3),
    ],
)
def test_layouts_of_1_to_8_ranks(placements, topology, offsets, world):
    layout = PipelineLayout(placements, topology)
    assert layout.offsets == offsets
    assert layout.world_size == world
    layout.check_world_size(world)
    for m, p in placements.items():
        assert layout.module_ranks(m) == range(offsets[m], offsets[m] + p.size)
    check_cover(layout)
    check_forward_consistency(layout)
    check_bridge_samples(layout, 8 * layout.max_dp)


def test_accepts_a_module_topology_object():
    topo = ModuleTopology({"a": ["b"], "b": []})
    layout = PipelineLayout({"a": P(), "b": P()}, topo)
    assert layout.topology is topo
    assert layout.modules == ("a", "b")


def test_pp2_dp2_rank_order_replica_fastest():
    layout = PipelineLayout({"a": P(dp=4), "m": P(pp=2, dp=2)}, {"a": ["m"], "m": []})
    assert [layout.rank_of("m", s, r) for s in range(2) for r in range(2)] == [4, 5, 6, 7]
    for s in range(2):
        for r in range(2):
            assert layout.rank_of("m", s, r) == 4 + s * 2 + r
            assert layout.slots(4 + s * 2 + r) == (StageSlot("m", s, r),)
    assert layout.slots(6) == (StageSlot("m", 1, 0),)
    with pytest.raises(IndexError):
        layout.rank_of("m", 2, 0)
    with pytest.raises(IndexError):
        layout.rank_of("m", 0, 2)


def test_first_last_stage_and_pp_neighbours():
    layout = PipelineLayout({"s": P(), "m": P(pp=3, dp=2)}, {"s": ["m"], "m": []})
    # m: stage 0 on 1,2; stage 1 on 3,4; stage 2 on 5,6
    s0, s1, s2 = StageSlot("m", 0, 1), StageSlot("m", 1, 1), StageSlot("m", 2, 1)
    assert [layout.pp_prev(s) for s in (s0, s1, s2)] == [None, 2, 4]
    assert [layout.pp_next(s) for s in (s0, s1, s2)] == [4, 6, None]
    assert layout.pp_next(StageSlot("m", 0, 0)) == 3
    assert [layout.is_first_stage(s) for s in (s0, s1, s2)] == [True, False, False]
    assert [layout.is_last_stage(s) for s in (s0, s1, s2)] == [False, False, True]
    single = StageSlot("s", 0, 0)
    assert layout.is_first_stage(single) and layout.is_last_stage(single)
    assert layout.pp_prev(single) is None and layout.pp_next(single) is None


def test_loss_stage_and_input_gradients():
    layout = PipelineLayout(
        {"enc": P(), "proj": P(), "llm": P(pp=2), "aux": P()},
        {"enc": ["proj"], "proj": ["llm", "aux"], "llm": [], "aux": []},
    )
    loss = {(r, s.module, s.stage) for r in range(layout.world_size) for s in layout.slots(r) if layout.is_loss_stage(s)}
    assert loss == {(3, "llm", 1), (4, "aux", 0)}  # the last stage of each sink only
    slot = {s.module + str(s.stage): s for r in range(layout.world_size) for s in layout.slots(r)}
    assert not layout.sends_input_gradients(slot["enc0"], frozenset())  # the first stage of a source
    assert layout.sends_input_gradients(slot["proj0"], frozenset())
    assert not layout.sends_input_gradients(slot["proj0"], {"enc"})  # its only producer runs no backward
    assert layout.sends_input_gradients(slot["llm1"], {"enc", "proj"})  # its producer is llm stage 0
    assert layout.no_backward_modules({"proj"}) == frozenset()  # a frozen middle module: trainable upstream
    assert layout.no_backward_modules({"enc", "proj"}) == {"enc", "proj"}


def test_slots_and_slot():
    layout = PipelineLayout(
        {"vision": P(dp=2), "audio": P(), "llm": P(pp=2)},
        {"vision": ["llm"], "audio": ["llm"], "llm": []},
    )
    assert [layout.slots(r) for r in range(5)] == [
        (StageSlot("vision", 0, 0),),
        (StageSlot("vision", 0, 1),),
        (StageSlot("audio", 0, 0),),
        (StageSlot("llm", 0, 0),),
        (StageSlot("llm", 1, 0),),
    ]
    assert layout.slot(1, "vision") == StageSlot("vision", 0, 1)
    assert layout.slot(1, "llm") is None
    assert layout.max_dp == 2
    assert layout.depth == 3
    assert [layout.stage_index("llm", s) for s in range(2)] == [1, 2]
    assert layout.stage_index("audio", 0, "alap") == layout.stage_index("audio", 0) == 0


def test_fan_in_2_to_1():
    layout = PipelineLayout({"vision": P(dp=2), "llm": P(pp=2)}, {"vision": ["llm"], "llm": []})
    assert layout.bridge_targets("vision", "llm", 0) == (BridgePeer(2, 0, 2),)
    assert layout.bridge_targets("vision", "llm", 1) == (BridgePeer(2, 1, 2),)
    assert layout.bridge_sources("vision", "llm", 0) == (BridgePeer(0, 0, 2), BridgePeer(1, 1, 2))
    assert layout.forward_targets(StageSlot("vision", 0, 1)) == (("llm", BridgePeer(2, 1, 2)),)
    assert layout.forward_sources(StageSlot("llm", 0, 0)) == (
        ("vision", BridgePeer(0, 0, 2)),
        ("vision", BridgePeer(1, 1, 2)),
    )
    assert layout.forward_targets(StageSlot("llm", 0, 0)) == (("llm", BridgePeer(3, 0, 1)),)
    assert layout.forward_sources(StageSlot("llm", 1, 0)) == (("llm", BridgePeer(2, 0, 1)),)
    assert layout.forward_targets(StageSlot("llm", 1, 0)) == ()
    assert layout.forward_sources(StageSlot("vision", 0, 0)) == ()


def test_fan_in_4_to_1_and_4_to_2():
    layout = PipelineLayout({"v": P(dp=4), "llm": P()}, {"v": ["llm"], "llm": []})
    assert layout.bridge_sources("v", "llm", 0) == tuple(BridgePeer(r, r, 4) for r in range(4))
    assert [layout.bridge_targets("v", "llm", r) for r in range(4)] == [(BridgePeer(4, r, 4),) for r in range(4)]

    layout = PipelineLayout({"v": P(dp=4), "llm": P(dp=2)}, {"v": ["llm"], "llm": []})
    assert layout.bridge_sources("v", "llm", 0) == (BridgePeer(0, 0, 2), BridgePeer(1, 1, 2))
    assert layout.bridge_sources("v", "llm", 1) == (BridgePeer(2, 0, 2), BridgePeer(3, 1, 2))
    assert layout.bridge_targets("v", "llm", 2) == (BridgePeer(5, 0, 2),)
    assert layout.bridge_targets("v", "llm", 3) == (BridgePeer(5, 1, 2),)


def test_fan_in_from_the_last_stage_of_a_pipelined_module():
    layout = PipelineLayout({"v": P(pp=2, dp=2), "llm": P()}, {"v": ["llm"], "llm": []})
    # v stage 0 on 0,1; stage 1 on 2,3; llm on 4
    assert layout.bridge_sources("v", "llm", 0) == (BridgePeer(2, 0, 2), BridgePeer(3, 1, 2))
    assert layout.forward_targets(StageSlot("v", 0, 1)) == (("v", BridgePeer(3, 0, 1)),)
    assert layout.forward_targets(StageSlot("v", 1, 1)) == (("llm", BridgePeer(4, 1, 2)),)


def test_fan_out_1_to_2():
    layout = PipelineLayout({"enc": P(), "dec": P(dp=2)}, {"enc": ["dec"], "dec": []})
    assert layout.bridge_targets("enc", "dec", 0) == (BridgePeer(1, 0, 2), BridgePeer(2, 1, 2))
    assert layout.bridge_sources("enc", "dec", 0) == (BridgePeer(0, 0, 2),)
    assert layout.bridge_sources("enc", "dec", 1) == (BridgePeer(0, 1, 2),)
    assert layout.forward_targets(StageSlot("enc", 0, 0)) == (
        ("dec", BridgePeer(1, 0, 2)),
        ("dec", BridgePeer(2, 1, 2)),
    )


def test_fan_out_1_to_4_and_2_to_4():
    layout = PipelineLayout({"enc": P(pp=2), "dec": P(dp=4)}, {"enc": ["dec"], "dec": []})
    assert layout.bridge_targets("enc", "dec", 0) == tuple(BridgePeer(2 + c, c, 4) for c in range(4))
    assert [layout.bridge_sources("enc", "dec", j) for j in range(4)] == [(BridgePeer(1, j, 4),) for j in range(4)]

    layout = PipelineLayout({"enc": P(dp=2), "dec": P(dp=4)}, {"enc": ["dec"], "dec": []})
    assert layout.bridge_targets("enc", "dec", 0) == (BridgePeer(2, 0, 2), BridgePeer(3, 1, 2))
    assert layout.bridge_targets("enc", "dec", 1) == (BridgePeer(4, 0, 2), BridgePeer(5, 1, 2))
    assert layout.bridge_sources("enc", "dec", 3) == (BridgePeer(1, 1, 2),)
    assert layout.bridge_sources("enc", "dec", 2) == (BridgePeer(1, 0, 2),)


def test_equal_dp_bridge_is_one_to_one():
    layout = PipelineLayout({"a": P(dp=2), "b": P(pp=2, dp=2)}, {"a": ["b"], "b": []})
    assert layout.bridge_targets("a", "b", 1) == (BridgePeer(3, 0, 1),)
    assert layout.bridge_sources("a", "b", 1) == (BridgePeer(1, 0, 1),)


def test_chain_of_three_modules_fan_in_then_out():
    layout = PipelineLayout({"a": P(dp=2), "b": P(pp=2), "c": P(dp=2)}, {"a": ["b"], "b": ["c"], "c": []})
    assert layout.offsets == {"a": 0, "b": 2, "c": 4} and layout.world_size == 6
    assert layout.forward_targets(StageSlot("a", 0, 1)) == (("b", BridgePeer(2, 1, 2)),)
    assert layout.forward_targets(StageSlot("b", 0, 0)) == (("b", BridgePeer(3, 0, 1)),)
    assert layout.forward_targets(StageSlot("b", 1, 0)) == (("c", BridgePeer(4, 0, 2)), ("c", BridgePeer(5, 1, 2)))
    assert layout.forward_sources(StageSlot("c", 0, 1)) == (("b", BridgePeer(3, 1, 2)),)
    assert layout.numbering.asap == {("a", 0): 0, ("b", 0): 1, ("b", 1): 2, ("c", 0): 3}
    check_forward_consistency(layout)
    check_bridge_samples(layout, 4)


def test_module_feeding_two_downstream_modules():
    layout = PipelineLayout(
        {"enc": P(dp=2), "head": P(), "gen": P(dp=4)}, {"enc": ["head", "gen"], "head": [], "gen": []}
    )
    assert layout.forward_targets(StageSlot("enc", 0, 1)) == (
        ("head", BridgePeer(2, 1, 2)),
        ("gen", BridgePeer(5, 0, 2)),
        ("gen", BridgePeer(6, 1, 2)),
    )
    check_forward_consistency(layout)
    check_bridge_samples(layout, 8)


# --- colocation ------------------------------------------------------------------------------


def test_colocated_encoders():
    layout = PipelineLayout(
        {"vision": P(dp=2, rank_offset=0), "audio": P(dp=2, rank_offset=0), "llm": P(pp=2)},
        {"vision": ["llm"], "audio": ["llm"], "llm": []},
    )
    assert layout.offsets == {"vision": 0, "audio": 0, "llm": 2}
    assert layout.world_size == 4
    assert layout.slots(0) == (StageSlot("vision", 0, 0), StageSlot("audio", 0, 0))
    assert layout.slots(1) == (StageSlot("vision", 0, 1), StageSlot("audio", 0, 1))
    assert layout.slots(2) == (StageSlot("llm", 0, 0),)
    assert layout.forward_sources(StageSlot("llm", 0, 0)) == (
        ("vision", BridgePeer(0, 0, 2)),
        ("vision", BridgePeer(1, 1, 2)),
        ("audio", BridgePeer(0, 0, 2)),
        ("audio", BridgePeer(1, 1, 2)),
    )
    assert layout.dp_groups() == ((0, 1),)
    check_cover(layout)
    check_forward_consistency(layout)
    check_bridge_samples(layout, 4)


def test_colocation_without_explicit_offset_on_the_first_module():
    layout = PipelineLayout(
        {"vision": P(dp=2), "audio": P(dp=2, rank_offset=0), "llm": P()},
        {"vision": ["llm"], "audio": ["llm"], "llm": []},
    )
    assert layout.offsets == {"vision": 0, "audio": 0, "llm": 2}
    assert layout.world_size == 3


def test_everything_colocated_on_a_world_of_one():
    layout = PipelineLayout(
        {"a": P(rank_offset=0), "b": P(rank_offset=0), "c": P(rank_offset=0)},
        {"c": [], "b": ["c"], "a": ["b"]},
    )
    assert layout.world_size == 1
    layout.check_world_size(1)
    assert layout.slots(0) == (StageSlot("a", 0, 0), StageSlot("b", 0, 0), StageSlot("c", 0, 0))
    assert layout.forward_targets(StageSlot("a", 0, 0)) == (("b", BridgePeer(0, 0, 1)),)
    assert layout.forward_sources(StageSlot("c", 0, 0)) == (("b", BridgePeer(0, 0, 1)),)
    assert layout.dp_groups() == ()
    check_forward_consistency(layout)


def test_colocated_pipelined_modules():
    layout = PipelineLayout({"enc": P(pp=2, rank_offset=0), "llm": P(pp=2, rank_offset=0)}, {"enc": ["llm"], "llm": []})
    assert layout.world_size == 2
    assert layout.slots(0) == (StageSlot("enc", 0, 0), StageSlot("llm", 0, 0))
    assert layout.slots(1) == (StageSlot("enc", 1, 0), StageSlot("llm", 1, 0))
    assert layout.forward_targets(StageSlot("enc", 1, 0)) == (("llm", BridgePeer(0, 0, 1)),)
    check_forward_consistency(layout)


# --- groups, shards, world size, table -------------------------------------------------------


def test_dp_group_and_dp_groups():
    layout = PipelineLayout(
        {"vision": P(dp=2), "audio": P(), "llm": P(pp=2, dp=2)},
        {"vision": ["llm"], "audio": ["llm"], "llm": []},
    )
    assert layout.dp_group("vision", 0) == (0, 1)
    assert layout.dp_group("audio", 0) == (2,)
    assert layout.dp_group("llm", 0) == (3, 4)
    assert layout.dp_group("llm", 1) == (5, 6)
    assert layout.dp_groups() == ((0, 1), (3, 4), (5, 6))


def test_dp_groups_sorted_even_if_declared_out_of_rank_order():
    layout = PipelineLayout(
        {"llm": P(pp=2, dp=2, rank_offset=2), "vision": P(dp=2, rank_offset=0)},
        {"vision": ["llm"], "llm": []},
    )
    groups = layout.dp_groups()
    assert groups == ((0, 1), (2, 3), (4, 5))
    assert len(set(groups)) == len(groups)


def test_dp_groups_empty_without_data_parallelism():
    assert PipelineLayout({"a": P(pp=3), "b": P()}, {"a": ["b"], "b": []}).dp_groups() == ()


def test_batch_shard():
    layout = PipelineLayout({"v": P(dp=4), "llm": P(dp=2), "a": P()}, {"v": ["llm"], "a": ["llm"], "llm": []})
    assert [layout.batch_shard("v", r, 8) for r in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    assert [layout.batch_shard("llm", r, 8) for r in range(2)] == [slice(0, 4), slice(4, 8)]
    assert layout.batch_shard("a", 0, 8) == slice(0, 8)
    assert layout.batch_shard("a", 0, 3) == slice(0, 3)
    with pytest.raises(PipelineConfigError) as info:
        layout.batch_shard("v", 0, 6)
    msg = str(info.value)
    assert "a microbatch of 6 samples cannot be split over 'v' dp=4" in msg
    assert "a multiple of 4" in msg
    with pytest.raises(PipelineConfigError, match="multiple of 4"):
        layout.batch_shard("llm", 0, 3)


def test_check_world_size_mismatch():
    layout = PipelineLayout(
        {"vision": P(dp=2), "audio": P(), "llm": P(pp=2)},
        {"vision": ["llm"], "audio": ["llm"], "llm": []},
    )
    layout.check_world_size(5)
    for world in (4, 6, 1):
        with pytest.raises(PipelineConfigError) as info:
            layout.check_world_size(world)
        msg = str(info.value)
        assert f"the placements need 5 ranks" in msg
        assert f"but the world has {world}" in msg
        assert "vision: 1x2 at rank 0, audio: 1x1 at rank 2, llm: 2x1 at rank 3" in msg
        assert "devices=5" in msg


def test_table():
    layout = PipelineLayout({"vision": P(dp=2), "llm": P(pp=2)}, {"vision": ["llm"], "llm": []})
    assert layout.table() == (
        "rank  module  stage  replica  global-stage\n"
        "0     vision  0/1    0/2      0\n"
        "1     vision  0/1    1/2      0\n"
        "2     llm     0/2    0/1      1\n"
        "3     llm     1/2    0/1      2"
    )
    assert str(layout) == layout.table()
    assert repr(layout) == "PipelineLayout(world_size=4, modules=['vision', 'llm'])"


def test_table_prints_the_runtime_numbering():
    """The table's global stage is the runtime's (ALAP) unless asked for another numbering: the
    short encoder ``b`` sits right before the LM (1), not at 0 as under ASAP."""
    layout = PipelineLayout({"a": P(pp=2), "b": P(), "llm": P(pp=2)}, {"a": ["llm"], "b": ["llm"], "llm": []})

    def global_stages(table: str) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for line in table.splitlines()[1:]:
            _, module, _, _, index = line.split()
            out.setdefault(module, []).append(int(index))
        return out

    assert global_stages(layout.table()) == {"a": [0, 1], "b": [1], "llm": [2, 3]}
    assert global_stages(layout.table("alap")) == global_stages(str(layout))
    assert global_stages(layout.table("asap")) == {"a": [0, 1], "b": [0], "llm": [2, 3]}
    with pytest.raises(PipelineConfigError, match="unknown stage numbering 'late'"):
        layout.table("late")


def test_table_one_row_per_rank_and_module():
    layout = PipelineLayout(
        {"vision_encoder": P(dp=2, rank_offset=0), "audio": P(dp=2, rank_offset=0), "llm": P(pp=2)},
        {"vision_encoder": ["llm"], "audio": ["llm"], "llm": []},
    )
    lines = layout.table().splitlines()
    assert lines[0].split() == ["rank", "module", "stage", "replica", "global-stage"]
    assert re.fullmatch(r"rank {2}module +stage {2}replica {2}global-stage", lines[0])
    rows = [line.split() for line in lines[1:]]
    assert rows == [
        ["0", "vision_encoder", "0/1", "0/2", "0"],
        ["0", "audio", "0/1", "0/2", "0"],
        ["1", "vision_encoder", "0/1", "1/2", "0"],
        ["1", "audio", "0/1", "1/2", "0"],
        ["2", "llm", "0/2", "0/1", "1"],
        ["3", "llm", "1/2", "0/1", "2"],
    ]
    # every value starts under its header
    for column, name in enumerate(["rank", "module", "stage", "replica", "global-stage"]):
        start = lines[0].index(name)
        assert [line[start:].split()[0] for line in lines[1:]] == [row[column] for row in rows]


# --- configuration errors --------------------------------------------------------------------


def test_module_with_no_placement():
    msg = layout_error({"vision": P()}, {"vision": ["llm"], "llm": []})
    assert "module(s) ['llm'] appear in the topology but have no placement" in msg
    assert "add 'llm': ModulePlacement(pp=1, dp=1) to placements" in msg


def test_placement_with_no_topology_entry():
    msg = layout_error({"vision": P(), "audio": P(), "llm": P()}, {"vision": ["llm"], "llm": []})
    assert "placement(s) for ['audio'] have no topology entry" in msg
    assert "add 'audio': [downstream modules] to the topology or remove the placement" in msg


@pytest.mark.parametrize("placements", [{}, None, [("a", P())]])
def test_placements_not_a_non_empty_dict(placements):
    msg = layout_error(placements, {"a": []})
    assert "placements must be a non-empty dict" in msg


@pytest.mark.parametrize("value", [{"pp": 1}, (1, 1), 2, None, "pp=1"])
def test_placement_that_is_not_a_module_placement(value):
    msg = layout_error({"a": P(), "b": value}, {"a": ["b"], "b": []})
    assert f"placements['b'] is {value!r}" in msg
    assert "wrap it as ModulePlacement(pp=..., dp=...)" in msg


def test_topology_errors_surface_through_the_layout():
    msg = layout_error({"a": P(), "b": P()}, {"a": ["b"], "b": ["a"]})
    assert "cycle: a -> b -> a" in msg


@pytest.mark.parametrize(
    "a, b, rank",
    [
        (P(pp=2, rank_offset=0), P(dp=2, rank_offset=0), 0),  # same ranks, different pp/dp
        (P(dp=2, rank_offset=0), P(dp=4, rank_offset=0), 0),  # different dp
        (P(pp=2, rank_offset=0), P(pp=3, rank_offset=0), 0),  # different pp
        (P(dp=2, rank_offset=0), P(dp=2, rank_offset=1), 1),  # different offset
        (P(dp=4), P(dp=2, rank_offset=2), 2),  # inside another module
        (P(dp=2, rank_offset=2), P(dp=4, rank_offset=0), 2),  # contains another module
    ],
)
def test_overlap_that_is_not_a_colocation(a, b, rank):
    msg = layout_error({"a": a, "b": b}, {"a": ["b"], "b": []})
    assert "modules 'a'" in msg and "and 'b'" in msg
    assert f"overlap on rank {rank}" in msg
    assert "Colocated modules need the same rank_offset, pp, dp and tp" in msg
    assert "disjoint rank ranges" in msg


def test_overlap_message_shows_ranges_and_shapes():
    msg = layout_error({"a": P(dp=2, rank_offset=0), "b": P(dp=2, rank_offset=1)}, {"a": ["b"], "b": []})
    assert "'a' (ranks 0-1, pp=1, dp=2) and 'b' (ranks 1-2, pp=1, dp=2) overlap on rank 1" in msg


@pytest.mark.parametrize(
    "placements, empty",
    [
        ({"a": P(), "b": P(rank_offset=2)}, [1]),
        ({"a": P(rank_offset=1), "b": P(rank_offset=3)}, [0, 2]),
        ({"a": P(rank_offset=2, dp=2), "b": P()}, [0, 1]),  # b goes after a, leaving 0-1 empty
    ],
)
def test_gap_in_ranks(placements, empty):
    msg = layout_error(placements, {"a": [], "b": []})
    assert f"rank(s) {empty} hold no module" in msg
    assert "Adjust rank_offset" in msg


@pytest.mark.parametrize("du, dd", [(2, 3), (3, 2), (4, 6), (3, 1 * 2)])
def test_fan_ratio_not_whole(du, dd):
    msg = layout_error({"up": P(dp=du), "down": P(dp=dd)}, {"up": ["down"], "down": []})
    assert f"edge 'up' -> 'down': dp sizes {du} and {dd} do not divide one another" in msg
    assert "Make one dp a multiple of the other" in msg


def test_fan_ratio_checked_on_every_edge():
    msg = layout_error(
        {"a": P(dp=2), "b": P(dp=4), "c": P(dp=3)}, {"a": ["b", "c"], "b": [], "c": []}
    )
    assert "edge 'a' -> 'c'" in msg


# --- property test on random DAGs ------------------------------------------------------------


@st.composite
def random_layouts(draw):
    n = draw(st.integers(2, 6))
    names = [f"m{i}" for i in range(n)]
    topology = {m: [names[j] for j in range(i + 1, n) if draw(st.booleans())] for i, m in enumerate(names)}
    order = draw(st.permutations(names))  # placement declaration order drives the offsets
    placements = {m: P(pp=draw(st.integers(1, 3)), dp=draw(st.sampled_from([1, 2, 4]))) for m in order}
    return placements, topology


@settings(max_examples=100, deadline=None, database=None)
@given(random_layouts())
def test_random_layouts(data):
    placements, topology = data
    layout = PipelineLayout(placements, topology)
    world = sum(p.size for p in placements.values())
    assert layout.world_size == world
    layout.check_world_size(world)

    cursor = 0
    for m, p in placements.items():
        assert layout.offsets[m] == cursor
        cursor += p.size
    for m, p in placements.items():
        for s in range(p.pp):
            for r in range(p.dp):
                assert layout.rank_of(m, s, r) == layout.offsets[m] + s * p.dp + r

    check_cover(layout)  # every rank holds >= 1 slot, each (module, stage, replica) exactly once
    assert all(len(layout.slots(r)) == 1 for r in range(world))  # nothing colocated here
    check_forward_consistency(layout)
    check_bridge_samples(layout, 2 * layout.max_dp)

    n = layout.numbering
    for m, p in placements.items():
        for s in range(p.pp):
            asap, alap = layout.stage_index(m, s, "asap"), layout.stage_index(m, s)
            assert 0 <= asap <= alap < layout.depth

    groups = layout.dp_groups()
    assert list(groups) == sorted(set(groups))
    assert all(len(g) > 1 for g in groups)
    assert len(groups) == sum(p.pp for p in placements.values() if p.dp > 1)
    assert len(layout.table().splitlines()) == world + 1
    assert n.depth == layout.depth


def test_module_beside_a_stage_declared_before_the_owner_covers_every_rank():
    """A pp=1 module declared first on the ranks of another module's stage 0: the later stages'
    ranks still belong to that module (no false 'gap')."""
    layout = PipelineLayout({"enc": ModulePlacement(rank_offset=0), "llm": ModulePlacement(pp=2, rank_offset=0)},
                            {"enc": ["llm"], "llm": []})
    assert layout.world_size == 2
    assert [s.module for s in layout.slots(0)] == ["enc", "llm"]
    assert [(s.module, s.stage) for s in layout.slots(1)] == [("llm", 1)]


# --- tensor parallelism -----------------------------------------------------------------------


def test_tp_ranks_are_consecutive_inside_a_dp_by_tp_stage_mesh():
    layout = PipelineLayout(
        {"enc": P(pp=1, dp=2), "llm": P(pp=2, dp=2, tp=2)}, {"enc": ["llm"], "llm": []}
    )
    assert layout.world_size == 2 + 8 and P(pp=2, dp=2, tp=2).size == 8
    # llm at offset 2: stage 0 replica 0 = ranks 2-3, replica 1 = 4-5; stage 1 = 6-7, 8-9
    assert layout.slots(3) == (StageSlot("llm", 0, 0, 1),)
    assert layout.slots(8) == (StageSlot("llm", 1, 1, 0),)
    assert layout.stage_mesh("llm", 1) == ((6, 7), (8, 9))
    assert layout.tp_group("llm", 0, 1) == (4, 5)
    assert layout.tp_groups() == ((2, 3), (4, 5), (6, 7), (8, 9))
    assert layout.dp_group("llm", 0, 1) == (3, 5)
    assert (2, 4) in layout.dp_groups() and (3, 5) in layout.dp_groups() and (0, 1) in layout.dp_groups()
    assert [layout.tp_lead(r) for r in range(10)] == [0, 1, 2, 2, 4, 4, 6, 6, 8, 8]
    assert layout.scheduled_slots(3) == () and layout.scheduled_slots(2) == layout.slots(2)
    # pipeline peers are tp leads: enc replica j feeds the lead of llm replica j
    assert layout.bridge_targets("enc", "llm", 1) == (BridgePeer(4, 0, 1),)
    assert layout.pp_next(layout.slot(4, "llm")) == 8
    assert layout.forward_sources(layout.slot(6, "llm")) == (("llm", BridgePeer(2, 0, 1)),)
    assert "tp" in layout.table().splitlines()[0] and "1/2" in layout.table()


def test_tp_one_changes_nothing():
    placements = {"a": P(pp=2, dp=2), "b": P(pp=1, dp=1)}
    layout = PipelineLayout(placements, {"a": ["b"], "b": []})
    assert layout.tp_groups() == () and "tp" not in layout.table().splitlines()[0]
    assert [layout.rank_of("a", s, j) for s in range(2) for j in range(2)] == [0, 1, 2, 3]


def test_tp_colocation_needs_the_same_tp():
    msg = layout_error({"a": P(pp=1, dp=1, tp=2, rank_offset=0), "b": P(pp=1, dp=1, rank_offset=0)},
                       {"a": ["b"], "b": []})
    assert "tp=2" in msg and "same rank_offset, pp, dp and tp" in msg
    ok = PipelineLayout({"llm": P(pp=2, tp=2), "proj": P(pp=1, tp=2, rank_offset=2)}, {"proj": ["llm"], "llm": []})
    assert [s.module for s in ok.slots(3)] == ["proj", "llm"] and ok.slot(3, "llm").tp_index == 1


@pytest.mark.parametrize("tp", [0, -1, 1.5, True])
def test_tp_must_be_a_positive_integer(tp):
    assert "tp must be an integer >= 1" in placement_error(tp=tp)
